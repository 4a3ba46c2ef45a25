"""Regenerate the tables in BENCHMARKS.md from benchmarks/results/*.json.

    python benchmarks/report.py

Replaces the text between ``<!-- BEGIN generated:NAME -->`` and
``<!-- END generated:NAME -->`` markers; everything else in the page (the
analysis) is left as written. Blocks: ``meta``, ``local``, ``s3``, ``wan`` (or one
``wan-<regime>`` per regime, each with ``harness-wan-<regime>``: its
harness self-test), ``sweep-<section>`` (the raw limit sweep as a grid), ``targets``,
``interference`` / ``interference-gpu`` (benchmarks/interference.py's results),
``scaling-<sweep>`` for each sweep, and ``scale`` (benchmarks/scale_sim.py's
modelled points).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import targets  # noqa: E402
from dcpstore.bench import summarize  # noqa: E402
from dcpstore.bench.limits import best_limits, harness_verdicts, limit_ratios  # noqa: E402
from dcpstore.units import human_bytes  # noqa: E402

Row = dict[str, Any]


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _note(r: Row) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    notes = []
    if r.get("read_s") is not None and r["backend"] == "local" and r.get("cold_read") is False:
        notes.append("warm read")
    if r.get("repeats", 1) > 1:
        notes.append(f"median of {r['repeats']}")
    return ", ".join(notes)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def rows_table(rows: Sequence[Row]) -> str:
    """One row per entry. ``save/limit`` and ``load/limit``: its speed over the
    best limit row of its backend (the fastest raw row of the sweep, per
    direction); ``CPU s/GB``: client CPU seconds per GB moved."""
    head = ["entry", "backend", "W", "save GB/s", "load GB/s", "save/limit", "load/limit", "blocked s",
            "CPU s/GB save/load", "plan/stage/write/commit s", "RSS growth", "note"]  # fmt: skip
    by_backend: dict[str, list[Row]] = {}
    for r in rows:
        by_backend.setdefault(r["backend"], []).append(r)
    ratios = {id_: r for group in by_backend.values() for id_, r in zip((id(x) for x in group), limit_ratios(group))}
    body = []
    for r in rows:
        d = targets.with_derived(r)
        lim = ratios[id(r)]
        ph = r.get("phases") or {}
        phases = "/".join(f"{ph[p]:.2f}" for p in ("plan", "stage", "write", "commit") if p in ph) or "-"
        growth = r.get("rss_growth_bytes")
        body.append([r["name"], r["backend"], str(r["workers"]), _num(r.get("write_gbps")), _num(r.get("read_gbps")),
                     _ratio(lim.get("write_vs_limit")), _ratio(lim.get("read_vs_limit")), _num(r.get("blocked_s")),
                     f"{_num(d.get('write_cpu_per_gb'), '.2f')}/{_num(d.get('read_cpu_per_gb'), '.2f')}",
                     phases if r["status"] == "ok" else "-",
                     human_bytes(growth) if growth is not None else "-", _note(r)])  # fmt: skip
    return targets.markdown_table(head, body)


def sweep_table(rows: Sequence[Row]) -> str:
    """The raw limit sweep of one section as a grid: connections down, part
    size across, save / load GB/s in each cell; the best of each direction
    in bold."""
    # Runs from before the sweep have one raw row without a part size.
    raw = [r for r in rows if r.get("group") == "limit" and r.get("engine") == "boto3"
           and "part_size" in r.get("extra", {})]  # fmt: skip
    if not raw:
        return "_no raw sweep in this run (the committed run predates it)_"
    best = best_limits(raw)
    parts = sorted({r["extra"]["part_size"] for r in raw})
    conns = sorted({r["workers"] for r in raw})
    cell = {(r["workers"], r["extra"]["part_size"]): r for r in raw}

    def text(r: Row | None, direction: str) -> str:
        if r is None:
            return ""
        if r["status"] != "ok":
            return r["status"]
        value = _num(r.get(f"{direction}_gbps"))
        return f"**{value}**" if best.get(direction) is r else value

    head = ["connections", *(f"part {human_bytes(p)}" for p in parts)]
    body = [[str(c), *(f"{text(cell.get((c, p)), 'write')} / {text(cell.get((c, p)), 'read')}"
                       if (c, p) in cell else "" for p in parts)] for c in conns]  # fmt: skip
    return targets.markdown_table(head, body)


def harness_table(rows: Sequence[Row]) -> str:
    """The section's harness self-test, per direction: the proxy and endpoint
    with shaping off against the best row measured through the shaping, and
    what that makes the section (dcpstore.bench.limits.harness_verdicts)."""
    verdicts = harness_verdicts(rows)
    if not verdicts:
        return "_no harness self-test in this run_"
    head = ["direction", "harness, shaping off (GB/s)", "best measured row", "its GB/s", "harness / best", "section is"]
    body = [[{"write": "save", "read": "load"}[d], _num(v["harness_gbps"]), v["best"], _num(v["best_gbps"]),
             _ratio(v["ratio"]), f"**{v['bound']}-bound** (needs {v['margin']:g}x)"]
            for d, v in verdicts.items()]  # fmt: skip
    return targets.markdown_table(head, body)


def targets_table(results: Sequence[Row]) -> str:
    head = ["target", "ours / reference", "ratio", "status", "why"]
    body = [[r["target"], f"{r['ours']} / {r['ref'] or 'state size'}", targets.ratio_text(r), f"**{r['status']}**",
             r["why"] or "see analysis below"] for r in results]  # fmt: skip
    return targets.markdown_table(head, body)


def meta_block(docs: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, doc in docs.items():
        m = doc["meta"]
        mach = m.get("machine", {})
        label = f" -- **{m['label']}**" if m.get("label") else ""
        lines.append(f"- `{name}`: {m['date']}{label}, commit `{m.get('git_commit')}`, "
                     f"{mach.get('cpus')} CPUs, {human_bytes(mach.get('memory_bytes', 0))} RAM, "
                     f"torch {mach.get('torch')}, Python {mach.get('python')}  \n"
                     f"  regenerate: `{m.get('command')}`")  # fmt: skip
    return "\n".join(lines)


def scale_block(scale: dict[str, Any]) -> str:
    """scale_sim.py's table, as markdown."""
    import scale_sim

    rows = scale_sim.table([scale_sim.Point(**p) for p in scale["points"]])
    return targets.markdown_table(rows[0], rows[1:])


def blocks(compare: dict[str, Any] | None, scaling: dict[str, Any] | None,
           scale: dict[str, Any] | None = None, interference: dict[str, Any] | None = None,
           interference_gpu: dict[str, Any] | None = None) -> dict[str, str]:  # fmt: skip
    out: dict[str, str] = {}
    named = (("compare.json", compare), ("scaling.json", scaling), ("scale_sim.json", scale),
             ("interference.json", interference), ("interference-gpu.json", interference_gpu))  # fmt: skip
    docs = {k: v for k, v in named if v}
    out["meta"] = meta_block(docs)
    for name, doc in (("interference", interference), ("interference-gpu", interference_gpu)):
        if doc:
            import interference as intf

            out[name] = intf.markdown(doc)
    if scale:
        out["scale"] = scale_block(scale)
    results: list[Row] = []
    if compare:
        summary = summarize(compare["records"])  # re-derived: summaries gain fields over time
        regimes = list((compare["meta"].get("wan") or {}).get("regimes") or {}) or None
        wan = [f"wan-{r}" for r in regimes] if regimes else ["wan"]
        for section in ("local", "s3", *wan):
            rows = [r for r in summary if r.get("extra", {}).get("section") == section]
            out[section] = rows_table(rows)
            out[f"sweep-{section}"] = sweep_table(rows)
            if section.startswith("wan-"):
                out[f"harness-{section}"] = harness_table(rows)
        # Recomputed from the summary so that edited target definitions apply to old runs too.
        results += targets.evaluate_all(targets.compare_targets(max(compare["meta"]["workers"]), regimes), summary)
    if scaling:
        summary = summarize(scaling["records"])
        for sweep in ("bytes", "tensors", "workers", "ranks", "repeat"):
            sub = [r for r in summary if r.get("extra", {}).get("sweep") == sweep]
            if sweep == "repeat":
                sub = [r for r in scaling["records"] if r.get("extra", {}).get("sweep") == "repeat"]
                sub = [dict(r, name=f"{r['name']} save #{r['repeat'] + 1}") for r in sub]
            out[f"scaling-{sweep}"] = rows_table(sub)
        counts = [r["extra"]["x"] for r in summary if r.get("extra", {}).get("sweep") == "tensors"]
        if counts:
            results += targets.evaluate_all(targets.scaling_targets(scaling["meta"]["fixed_workers"], max(counts)), summary)
    out["targets"] = targets_table(results)
    return out


def render(page: str, generated: dict[str, str]) -> str:
    for name, text in generated.items():
        pattern = re.compile(rf"(<!-- BEGIN generated:{re.escape(name)} -->\n).*?(<!-- END generated:{re.escape(name)} -->)", re.S)
        if pattern.search(page):
            page = pattern.sub(lambda m: m.group(1) + text.rstrip() + "\n" + m.group(2), page)
    return page


def _read(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    results = os.path.join(HERE, "results")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", default=os.path.join(results, "compare.json"))
    p.add_argument("--scaling", default=os.path.join(results, "scaling.json"))
    p.add_argument("--scale", default=os.path.join(results, "scale_sim.json"))
    p.add_argument("--interference", default=os.path.join(results, "interference.json"))
    p.add_argument("--interference-gpu", default=os.path.join(results, "interference-gpu.json"),
                   help="scripts/gpu-check.sh's interference.json, committed under this name")
    p.add_argument("--page", default=os.path.join(os.path.dirname(HERE), "BENCHMARKS.md"))
    args = p.parse_args(argv)
    with open(args.page) as f:
        page = f.read()
    page = render(page, blocks(_read(args.compare), _read(args.scaling), _read(args.scale), _read(args.interference),
                               _read(args.interference_gpu)))  # fmt: skip
    with open(args.page, "w") as f:
        f.write(page)
    print(f"updated {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
