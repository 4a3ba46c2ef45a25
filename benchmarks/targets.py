"""The issue's targets as ratios between rows of one run.

Each target names the dcpstore row and the reference row it is compared
with (by entry name, as compare.py builds them). A target is

* ``met`` / ``missed`` when both rows ran,
* ``pending merge`` when the dcpstore row was skipped because the code it
  needs (a backend, the async engines) is not in this tree yet,
* ``n/a`` when a row was skipped or failed for another reason (the reason
  is shown);
* ``harness-bound`` when it compares throughput with a limit in a section
  whose harness self-test (dcpstore._impl.bench.limits.harness_verdicts) says
  the proxy and endpoint, not the emulated network, set that limit: no row
  is called at the limit there (a peer ratio there is still computed, and
  says that the harness caps both rows);
* ``no room`` for a peer target whose bound times the peer is above the
  best the endpoint gave any raw client (``room=True``): no client can show
  it there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dcpstore._impl.bench.limits import best_limits, harness_verdicts

Row = dict[str, Any]

#: ``Target.ref`` prefix: the best limit row (see dcpstore._impl.bench.limits.best_limits)
#: of the backend named after it, in the target's direction.
LIMIT = "limit:"
#: ``Target.ref`` prefix: the best of the rows whose name starts with what follows
#: (a peer at every thread count it ran with).
BEST = "best:"


@dataclass(frozen=True)
class Target:
    title: str
    ours: str  # entry name of the dcpstore row
    #: entry name of the reference row; ``limit:<backend>`` or ``best:<name prefix>``
    #: (see above); "" for rss_extra: the row's own state size
    ref: str
    #: "write_gbps" / "read_gbps" (higher is better); "write_s" / "read_s" /
    #: "blocked_s", "write_cpu_per_gb" / "read_cpu_per_gb" (client CPU seconds
    #: per GB) and "rss_growth_bytes" (lower is better); or "rss_extra": the
    #: largest RSS growth of any of the row's saves (peak - before; the first
    #: save allocates staging) / state bytes.
    metric: str
    bound: float  # ours/ref must be >= bound (throughput) or <= bound (time, memory, CPU)
    #: A peer target that only counts where bound x the peer is below the
    #: swept limit of ours' backend (else ``no room``).
    room: bool = False

    @property
    def higher_is_better(self) -> bool:
        return self.metric.endswith("gbps")


def compare_targets(workers: int, regimes: Sequence[str] | None = None) -> list[Target]:
    """The targets at ``workers`` (the largest worker count of the run) and
    at default settings (the ``default`` rows); the WAN's per ``regimes``
    (:func:`wan_targets`), or, for a run from before the regimes (None), its
    one ``wan`` section's."""
    w = workers
    wan = [t for regime in regimes for t in wan_targets(regime)] if regimes is not None else legacy_wan_targets(w)
    local_s3 = [
        Target(
            "local save >= 0.95x raw write+fsync (best thread count)",
            f"dcpstore local sync w={w}",
            f"{LIMIT}local",
            "write_gbps",
            0.95,
        ),
        Target(
            "local load >= 0.9x raw read (cold cache, best thread count)",
            f"dcpstore local sync w={w}",
            f"{LIMIT}local",
            "read_gbps",
            0.9,
        ),
        Target(
            "async stall <= 1.0x clone() (native)",
            f"dcpstore local async/native w={w}",
            "clone() of every tensor",
            "blocked_s",
            1.0,
        ),
        Target(
            "async stall <= 1.0x clone() (nvrx)",
            f"dcpstore local async/nvrx w={w}",
            "clone() of every tensor",
            "blocked_s",
            1.0,
        ),
        Target(
            "NVRx-written checkpoint loads >= 0.9x native-written",
            f"dcpstore local async/nvrx w={w}",
            f"dcpstore local async/native w={w}",
            "read_gbps",
            0.9,
        ),
        Target(
            "S3 save >= 0.85x best raw PUT (default settings)",
            "dcpstore s3 sync default",
            f"{LIMIT}s3",
            "write_gbps",
            0.85,
        ),
        Target(
            "S3 load >= 0.8x best raw GET (default settings)",
            "dcpstore s3 sync default",
            f"{LIMIT}s3",
            "read_gbps",
            0.8,
        ),
        Target(
            "S3 save client CPU/GB <= 1.3x bare boto3 (best raw PUT row)",
            "dcpstore s3 sync default",
            f"{LIMIT}s3",
            "write_cpu_per_gb",
            1.3,
        ),
        Target(
            "S3 load client CPU/GB <= 1.3x bare boto3 (best raw GET row)",
            "dcpstore s3 sync default",
            f"{LIMIT}s3",
            "read_cpu_per_gb",
            1.3,
        ),
        Target(
            "S3 save >= 2x FsspecWriter+s3fs",
            f"dcpstore s3 sync w={w}",
            f"dcp FsspecWriter+s3fs (s3) threads={w}",
            "write_gbps",
            2.0,
        ),
        Target(
            "S3 save >= 1.3x MSC writer",
            f"dcpstore s3 sync w={w}",
            f"MSC MultiStorageFileSystemWriter (s3) threads={w}",
            "write_gbps",
            1.3,
        ),
        Target(
            "MSC route: save RSS growth <= 1.2x native S3",
            f"dcpstore s3+msc sync w={w}",
            f"dcpstore s3 sync w={w}",
            "rss_growth_bytes",
            1.2,
        ),
        Target(
            "async save: peak RSS growth <= 1.1x state (staging cap = one state)",
            f"dcpstore local async/native w={w} own saver",
            "",
            "rss_extra",
            1.1,
        ),
    ]
    return local_s3 + wan


def legacy_wan_targets(w: int) -> list[Target]:
    """The WAN targets of runs with one ``wan`` section (before the regimes)."""
    return [
        Target(
            "WAN S3 save >= 0.85x best raw PUT (default settings)",
            "dcpstore s3-wan sync default",
            f"{LIMIT}s3-wan",
            "write_gbps",
            0.85,
        ),
        Target(
            "WAN S3 load >= 0.8x best raw GET (default settings)",
            "dcpstore s3-wan sync default",
            f"{LIMIT}s3-wan",
            "read_gbps",
            0.8,
        ),
        Target(
            "WAN S3 save >= 1.3x s3torchconnector (its best thread count)",
            "dcpstore s3-wan sync default",
            f"{BEST}s3torchconnector S3StorageWriter (s3-wan)",
            "write_gbps",
            1.3,
        ),
        Target(
            "WAN S3 save client CPU/GB <= 1.3x bare boto3 (best raw PUT row)",
            "dcpstore s3-wan sync default",
            f"{LIMIT}s3-wan",
            "write_cpu_per_gb",
            1.3,
        ),
        Target(
            "WAN S3 load client CPU/GB <= 1.3x bare boto3 (best raw GET row)",
            "dcpstore s3-wan sync default",
            f"{LIMIT}s3-wan",
            "read_cpu_per_gb",
            1.3,
        ),
        Target(
            "WAN S3 save >= 2x FsspecWriter+s3fs",
            f"dcpstore s3-wan sync w={w}",
            f"dcp FsspecWriter+s3fs (s3-wan) threads={w}",
            "write_gbps",
            2.0,
        ),
        Target(
            "WAN S3 save >= 1.3x MSC writer",
            f"dcpstore s3-wan sync w={w}",
            f"MSC MultiStorageFileSystemWriter (s3-wan) threads={w}",
            "write_gbps",
            1.3,
        ),
    ]


def wan_targets(regime: str) -> list[Target]:
    """The targets of one emulated-WAN regime (compare.py's ``wan-<regime>``
    section), all at dcpstore's default settings."""
    b = f"s3-wan-{regime}"
    ours = f"dcpstore {b} sync default"
    return [
        Target(f"WAN/{regime}: save >= 0.9x best raw PUT", ours, f"{LIMIT}{b}", "write_gbps", 0.9),
        Target(f"WAN/{regime}: load >= 0.9x best raw GET", ours, f"{LIMIT}{b}", "read_gbps", 0.9),
        Target(
            f"WAN/{regime}: save client CPU/GB <= 1.1x bare boto3 (best raw PUT row)",
            ours,
            f"{LIMIT}{b}",
            "write_cpu_per_gb",
            1.1,
        ),
        Target(
            f"WAN/{regime}: load client CPU/GB <= 1.1x bare boto3 (best raw GET row)",
            ours,
            f"{LIMIT}{b}",
            "read_cpu_per_gb",
            1.1,
        ),
        Target(
            f"WAN/{regime}: save >= 1.3x s3torchconnector (its best thread count)",
            ours,
            f"{BEST}s3torchconnector S3StorageWriter ({b})",
            "write_gbps",
            1.3,
            room=True,
        ),
        Target(
            f"WAN/{regime}: save >= 2x FsspecWriter+s3fs",
            ours,
            f"{BEST}dcp FsspecWriter+s3fs ({b})",
            "write_gbps",
            2.0,
            room=True,
        ),
        Target(
            f"WAN/{regime}: save >= 1.3x MSC writer",
            ours,
            f"{BEST}MSC MultiStorageFileSystemWriter ({b})",
            "write_gbps",
            1.3,
            room=True,
        ),
    ]


def scaling_targets(workers: int, count: int = 20000) -> list[Target]:
    return [
        Target(
            f"{count:,} small tensors: save no slower than dcp.save",
            f"dcpstore [tensors={count}]",
            f"dcp.save [tensors={count}]",
            "write_s",
            1.0,
        ),
        Target(
            f"{count:,} small tensors: load no slower than dcp.load (info)",
            f"dcpstore [tensors={count}]",
            f"dcp.save [tensors={count}]",
            "read_s",
            1.0,
        ),
    ]


def _pending(row: Row) -> bool:
    reason = row.get("reason", "")
    return row["status"] == "skipped" and (
        "not built yet" in reason or "arrives with" in reason or "NotImplementedError" in reason
    )


def _allocated(row: Row) -> bool:
    """Whether the row's saves allocated their staging while measured (an
    entry with an AsyncSaver of its own per save): the peak RSS of a save
    that reuses buffers says nothing about the staging cap."""
    return bool(row.get("extra", {}).get("fresh_staging"))


def _rss_extra(row: Row) -> float | None:
    growth = row.get("rss_growth_max_bytes", row.get("rss_growth_bytes"))
    return None if growth is None else float(growth) / row["bytes"]


def with_derived(row: Row) -> Row:
    """``row`` plus the metrics computed from its fields: client CPU seconds
    per GB (10^9 bytes) of the save and the load."""
    out = dict(row)
    for direction in ("write", "read"):
        cpu = row.get(f"{direction}_cpu_s")
        out[f"{direction}_cpu_per_gb"] = cpu / (row["bytes"] / 1e9) if cpu is not None and row.get("bytes") else None
    return out


def _direction(metric: str) -> str:
    return "read" if metric.startswith("read") else "write"


def reference(target: Target, rows: Sequence[Row]) -> Row | None:
    """The reference row of ``target`` among ``rows`` (see :class:`Target`)."""
    if target.ref.startswith(LIMIT):
        backend = target.ref[len(LIMIT) :]
        best = best_limits(r for r in rows if r.get("backend") == backend)
        return best.get(_direction(target.metric))
    if target.ref.startswith(BEST):
        prefix = target.ref[len(BEST) :]
        candidates = [
            r for r in rows if r["name"].startswith(prefix) and r["status"] == "ok" and r.get(target.metric) is not None
        ]
        if not candidates:
            return next((r for r in rows if r["name"].startswith(prefix)), None)
        pick = max if target.higher_is_better else min
        return pick(candidates, key=lambda r: r[target.metric])
    return next((r for r in rows if r["name"] == target.ref), None)


def evaluate(target: Target, rows: Sequence[Row]) -> Row:
    rows = [with_derived(r) for r in rows]
    ours = next((r for r in rows if r["name"] == target.ours), None)
    if target.metric == "rss_extra" and ours is not None:
        ours = dict(ours, rss_extra=_rss_extra(ours))
        ref: Row | None = {"name": "state size", "status": "ok", "rss_extra": 1.0}
    else:
        ref = reference(target, rows)
    out: Row = {
        "target": target.title,
        "ours": target.ours,
        "ref": ref["name"] if ref else target.ref,
        "metric": target.metric,
        "bound": target.bound,
        "ratio": None,
        "status": "n/a",
        "why": "",
    }
    if target.metric == "rss_extra" and ours is not None and ours["status"] == "ok" and not _allocated(ours):
        out["why"] = f"{ours['name']}: no measured save allocated its staging (the buffers existed before it)"
        return out
    if ours is None or ref is None:
        out["why"] = f"not in this run: {target.ours if ours is None else target.ref}"
        return out
    if _pending(ours):
        out["status"], out["why"] = "pending merge", ours["reason"]
        return out
    for row in (ours, ref):
        if row["status"] != "ok" or row.get(target.metric) in (None, 0):
            out["why"] = f"{row['name']}: {row['status']} {row.get('reason', '')}".strip()
            return out
    ratio = ours[target.metric] / ref[target.metric]
    out["ratio"] = ratio
    ok = ratio >= target.bound if target.higher_is_better else ratio <= target.bound
    out["status"] = "met" if ok else "missed"
    if target.higher_is_better:
        _bounds(target, out, ours, ref, rows)
    return out


def _bounds(target: Target, out: Row, ours: Row, ref: Row, rows: Sequence[Row]) -> None:
    """Say where the section's harness, or its limit, decides the target
    rather than the rows (see the module docstring)."""
    mine = [r for r in rows if r.get("backend") == ours.get("backend")]
    direction = _direction(target.metric)
    verdict = harness_verdicts(mine).get(direction)
    if verdict is not None and verdict["bound"] == "harness":
        why = (
            f"harness-bound: the proxy and endpoint with shaping off pass {verdict['ratio']:.2f}x the best row "
            f"({verdict['best']}), under {verdict['margin']:g}x"
        )
        if target.ref.startswith(LIMIT):
            out["status"], out["why"] = "harness-bound", why
            return
        out["why"] = f"{why}: both rows may be capped by it"
    limit = best_limits(mine).get(direction)
    if target.room and limit is not None:
        needed = target.bound * ref[target.metric] / limit[target.metric]
        if needed > 1.0:
            out["status"] = "no room" if out["status"] == "missed" else out["status"]
            out["why"] = (
                f"{target.bound:g}x the peer is {needed:.2f}x the swept limit ({limit['name']}): "
                "no client can show it here"
            )


def evaluate_all(targets: Sequence[Target], rows: Sequence[Row]) -> list[Row]:
    return [evaluate(t, rows) for t in targets]


def ratio_text(row: Row) -> str:
    return "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"


def format_targets(results: Sequence[Row], table: Callable[[list[str], list[list[str]]], str]) -> str:
    head = ["target", "ratio", "status", "note"]
    body = [[r["target"], ratio_text(r), r["status"], r["why"]] for r in results]
    return table(head, body)


def text_table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body])


def markdown_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines)
