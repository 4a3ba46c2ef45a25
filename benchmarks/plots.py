"""PNG plots of comparison and scaling results (matplotlib, files only)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, rows: Sequence[Row], title: str) -> None:
    rows = [r for r in rows if r["status"] == "ok"]
    names = [r["name"] for r in rows]
    y = range(len(rows))
    write = [r.get("write_gbps") or 0 for r in rows]
    read = [r.get("read_gbps") or 0 for r in rows]
    ax.barh([i - 0.2 for i in y], write, height=0.4, label="save GB/s")
    ax.barh([i + 0.2 for i in y], read, height=0.4, label="load GB/s")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (state bytes / wall time)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7)


def _family(name: str) -> str:
    """The entry name without its worker count: one line per family."""
    return re.sub(r"\s+", " ", re.sub(r"(w=|threads=)\d+|, \d+ thread\(s\)", "", name)).strip()


def _lines(ax: Any, rows: Sequence[Row], key: str, title: str) -> None:
    families: dict[str, list[Row]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get(key) is not None:
            families.setdefault(_family(r["name"]), []).append(r)
    for fam, pts in families.items():
        pts.sort(key=lambda r: r["workers"])
        ax.plot([r["workers"] for r in pts], [r[key] for r in pts], marker="o", label=fam)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers / threads")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if families:
        ax.legend(fontsize=6)


def compare_plot(path: str, rows: Sequence[Row]) -> None:
    plt = _plt()
    section = {s: [r for r in rows if r.get("extra", {}).get("section") == s] for s in ("local", "s3", "wan")}
    panels = [s for s in ("local", "s3") if any(r["status"] == "ok" for r in section[s])]
    wan = any(r["status"] == "ok" for r in section["wan"])
    n = len(panels) + (2 if wan else 0)
    if n == 0:
        return
    fig, axes = plt.subplots(n, 1, figsize=(10, 3.2 * n + 1))
    axes = list(axes) if n > 1 else [axes]
    for ax, s in zip(axes, panels):
        _bars(ax, section[s], f"{s}: save and load throughput")
    if wan:
        _lines(axes[-2], section["wan"], "write_gbps", "emulated WAN S3: save throughput vs workers")
        _lines(axes[-1], section["wan"], "read_gbps", "emulated WAN S3: load throughput vs workers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_plot(
    path: str,
    rows: Sequence[Row],
    x: str,
    title: str,
    *,
    logx: bool = True,
    metric: str = "write_gbps",
    xlabel: str | None = None,
    base: int = 2,
) -> None:
    """One line per family (entry name without its parameter) of ``metric`` vs ``x``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    families: dict[str, list[Row]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get(metric) is not None:
            families.setdefault(r.get("extra", {}).get("family", r["name"]), []).append(r)
    for fam, pts in families.items():
        pts.sort(key=lambda r: r[x])
        ax.plot([r[x] for r in pts], [r[metric] for r in pts], marker="o", label=fam)
    if logx:
        ax.set_xscale("log", base=base)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel("seconds" if metric.endswith("_s") else "GB/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
