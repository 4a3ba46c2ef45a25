"""Turning records into a table, a JSON file and a plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dcpstore._impl.bench.limits import best_limits, limit_ratios
from dcpstore._impl.bench.runner import Record, summarize
from dcpstore._impl.util.checksum import CRC32C_LIBRARY
from dcpstore._impl.util.units import human_bytes


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rss(r: dict[str, Any]) -> str:
    if not r.get("peak_rss_bytes"):
        return "-"
    growth = r.get("rss_growth_bytes")
    return human_bytes(r["peak_rss_bytes"]) + (f" (+{human_bytes(growth)})" if growth is not None else "")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """A fixed-width text table of summary rows (see :func:`summarize`).

    Where limit rows were measured (:mod:`.limits`), every other row also
    shows its save and load speed over the best limit's, per direction."""
    rows = list(rows)
    with_limit = bool(best_limits(rows))
    if with_limit:
        rows = limit_ratios(rows)
    head: tuple[str, ...] = (
        "ENTRY",
        "BACKEND",
        "ENGINE",
        "W",
        "WRITE GB/s",
        "READ GB/s",
        "BLOCKED s",
        "PLAN/STAGE/WRITE/COMMIT s",
        "PEAK RSS (+SAVE)",
        "NOTE",
    )
    if with_limit:
        head = head[:6] + ("SAVE/LIMIT", "LOAD/LIMIT") + head[6:]
    lines: list[tuple[str, ...]] = []
    for r in rows:
        ph = r.get("phases") or {}
        phases = "/".join(f"{ph[p]:.2f}" for p in ("plan", "stage", "write", "commit") if p in ph) or "-"
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        if (
            r["status"] == "ok"
            and r.get("cold_read") is False
            and r.get("read_s") is not None
            and r["backend"] == "local"
        ):
            note = "warm read (page cache not dropped)"
        cells = [
            r["name"],
            r["backend"],
            r["engine"],
            str(r["workers"]),
            _fmt(r.get("write_gbps"), ".3f"),
            _fmt(r.get("read_gbps"), ".3f"),
            _fmt(r.get("blocked_s"), ".3f"),
            phases if r["status"] == "ok" else "-",
            _rss(r),
            note,
        ]
        if with_limit:
            cells[6:6] = [_ratio(r.get("write_vs_limit")), _ratio(r.get("read_vs_limit"))]
        lines.append(tuple(cells))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    right = {3, 4, 5, 6, 7, 8, 10} if with_limit else {3, 4, 5, 6, 8}

    def row(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([row(head), *(row(line) for line in lines)])


def tiered_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """For ``bench --tiered``: each tiered row against its baselines of the
    same worker count, as ratios (tiered / baseline; 1.00 = as fast)."""
    by_name = {r["name"]: r for r in rows if r["status"] == "ok"}
    out = []
    for r in by_name.values():
        if not r["name"].startswith("dcpstore tiered/"):
            continue
        suffix = r["name"].removeprefix("dcpstore tiered/")
        local, direct = by_name.get(f"local async/{suffix}"), by_name.get(f"direct async/{suffix}")
        ph = r.get("phases") or {}
        parts = [f"{r['name']}: blocked {r['blocked_s']:.3f} s"]
        if local and local.get("blocked_s"):
            parts[0] += f" ({r['blocked_s'] / local['blocked_s']:.2f}x plain local async)"
        if "local_commit" in ph:
            text = f"local commit {ph['local_commit']:.3f} s"
            if local and local.get("write_s"):
                text += f" ({ph['local_commit'] / local['write_s']:.2f}x plain local async)"
            parts.append(text)
        text = f"durable {r['write_s']:.3f} s"
        if direct and direct.get("write_s"):
            text += f" ({r['write_s'] / direct['write_s']:.2f}x direct async save)"
        parts.append(text)
        out.append(", ".join(parts))
    return out


def cache_note(records: Sequence[Record], drop_caches: bool) -> str:
    """One line saying whether the loads of ``records`` were cold (the page
    cache dropped before each) or may have read memory; empty if none loaded."""
    loads = [r for r in records if r.status == "ok" and r.read_s is not None]
    local = [r for r in loads if r.backend == "local"]
    if not local:
        return f"loads: read from {loads[0].backend}, not from this host's page cache" if loads else ""
    cold = sum(bool(r.cold_read) for r in local)
    if cold == len(local):
        return "loads were cold: the page cache was dropped before each local load (--drop-caches)"
    if drop_caches and cold == 0:
        return (
            "loads were warm: --drop-caches could not drop the page cache (it needs root: "
            "/proc/sys/vm/drop_caches), so local loads may have read memory, not the disk"
        )
    if cold:
        return f"loads were cold in {cold} of {len(local)} local runs (dropping the page cache failed in the others)"
    return (
        "loads were warm: the page cache was not dropped, so local loads may have read memory, not the disk "
        "(--drop-caches, as root, drops it before each load; that empties the whole host's cache)"
    )


def git_commit() -> str | None:
    """The short hash of the checkout the benchmark runs from, if it is one.

    ``DCPSTORE_GIT_COMMIT``, where set, wins: a copy of a checkout sent to
    another machine (the GPU machine of ``scripts/gpu-check.sh``) may carry
    no git directory, or a stale one that names another commit, and only
    the sender knows which commit it copied."""
    given = os.environ.get("DCPSTORE_GIT_COMMIT")
    if given:
        return given
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_dirty() -> bool | None:
    """Whether tracked files of the checkout differ from its commit (the
    numbers then measured code no commit holds); None outside a checkout.
    Result files (``benchmarks/results/``) do not count: one benchmark's
    fresh output is not code the next one measures, so the runs of one
    regeneration need no commit between them."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)benchmarks/results"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def checkout_commit(checkout: str) -> str:
    """The short hash of another checkout (one side of an A/B run), ``+``
    when its ``dcpstore/`` differs from that commit."""
    git = ["git", "-C", checkout]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "dcpstore"], capture_output=True, text=True).stdout
    return (commit or "unknown") + ("+" if dirty.strip() else "")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "crc32c": CRC32C_LIBRARY,  # the library dcpstore's checksums ran on
    }
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    return info


def result_meta(script: str, argv: Sequence[str], label: str | None, **more: Any) -> dict[str, Any]:
    """A result file's ``meta``: the command that makes it again
    (``python benchmarks/<script> <argv>``), its label, when and on which
    commit (and whether the checkout differed) it ran, the machine, and
    what else the benchmark records (``more``)."""
    return {
        "command": shlex.join(["python", f"benchmarks/{script}", *argv]),
        "label": label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "machine": machine(),
        **more,
    }


def write_json(path: str, records: Sequence[Record | dict[str, Any]], meta: dict[str, Any] | None = None) -> None:
    """``{"meta": ..., "records": [...], "summary": [...]}``; records are per repeat."""
    rows = [r.to_json() if isinstance(r, Record) else r for r in records]
    doc = {
        "meta": {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "git_dirty": git_dirty(),
            "machine": machine(),
            **(meta or {}),
        },
        "records": rows,
        "summary": summarize(rows),
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def plot_workers(path: str, rows: Sequence[dict[str, Any]], title: str) -> None:
    """Write and read GB/s against workers, one line per backend/engine/mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok":
            series.setdefault(f"{r['backend']} {r['mode']}/{r['engine']}", []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, key, label in ((axes[0], "write_gbps", "save"), (axes[1], "read_gbps", "load")):
        for name, pts in series.items():
            pts = sorted((p for p in pts if p.get(key) is not None), key=lambda p: p["workers"])
            if pts:
                ax.plot([p["workers"] for p in pts], [p[key] for p in pts], marker="o", label=name)
        ax.set_title(label)
        ax.set_xlabel("workers")
        ax.set_ylabel("GB/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    if series:
        axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
