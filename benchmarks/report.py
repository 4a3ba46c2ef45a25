"""Regenerate BENCHMARKS.md from benchmarks/results/*.json, and check it.

    python benchmarks/report.py            # rewrite the generated blocks and figures
    python benchmarks/report.py --check    # what does not hold, then each result's age (CI prints both)

Generated text is of two kinds, both rewritten from the committed result
files and nothing else:

* blocks, ``<!-- BEGIN generated:NAME -->`` ... ``<!-- END generated:NAME -->``
  (see :data:`SOURCES` for each block's result files): ``local``, ``s3``,
  one ``wan-<regime>`` per WAN regime with its ``harness-wan-<regime>``
  self-test, ``sweep-<section>``, ``targets``, ``interference`` /
  ``interference-gpu``, ``scaling-<sweep>``, ``scale``, ``tiered``...;
* figures inside prose, ``<!-- fig SPEC -->TEXT<!-- /fig -->``, SPEC one of
  ``row|FILE|ENTRY|FIELD|FORMAT`` (a summary row's field),
  ``ratio|FILE|ENTRY|REFERENCE|FIELD|FORMAT`` (one row's field over
  another's), ``target|TITLE`` / ``status|TITLE`` (a target's ratio or
  status, TITLE a prefix of its title), ``scale|RANKS|SPREAD|FIELD|FORMAT``
  (a point of the scale model; FIELD like ``model.write_s``) and
  ``meta|FILE|KEY|FORMAT`` (a field of a file's metadata) and
  ``const|NAME|FORMAT`` (a setting of this module). FORMAT: see
  :func:`_format`.

The check (:func:`problems`, which tests/docs/test_docs.py asserts empty) holds
on any copy of the repository, a shallow clone or a source archive without
git included: it fails when the page differs from what the files give,
when a figure outside generated text is in no committed file
(:func:`loose_figures`), when a target reads "met" from a row that
measured nothing, when a result file lacks its commit or command, and when
the page's Regenerate block or :data:`COMMANDS` names another command than
the one that made a file (:func:`command_problems`).

How old each result is against the code it measures (:func:`ages`: the
commits touching that code, :data:`SOURCES`, since the one its file
records) needs git history, so it is no problem: ``--check`` prints it
after the problems and its exit status ignores it. A test would fail a
change for a benchmark nobody re-ran, and fails on every shallow clone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import interference  # noqa: E402
import targets  # noqa: E402

from dcpstore._impl.bench import summarize  # noqa: E402
from dcpstore._impl.bench.limits import best_limits, harness_verdicts, limit_ratios  # noqa: E402
from dcpstore._impl.bench.report import tiered_lines  # noqa: E402
from dcpstore._impl.util.units import human_bytes  # noqa: E402

Row = dict[str, Any]
Doc = dict[str, Any]

#: :func:`ages` calls a result stale (worth re-running) once this many
#: commits touching the paths it measures came after the commit it records.
STALE_AFTER = 10

#: The page's own settings, for ``const|NAME|FORMAT`` figures.
CONSTANTS = {"stale_after": STALE_AFTER}

#: What each kind of table measures, as narrowly as the rows' code paths go.
WRITE_READ = (
    "dcpstore/_impl/dcp/writer.py",
    "dcpstore/_impl/dcp/reader.py",
    "dcpstore/_impl/dcp/load.py",
    "dcpstore/_impl/dcp/read_plan.py",
    "dcpstore/_impl/format/record.py",
    "dcpstore/_impl/util/checksum.py",
)
LOCAL = (
    *WRITE_READ,
    "dcpstore/_impl/storage/backends/local.py",
    "dcpstore/_impl/engines/saver.py",
    "dcpstore/_impl/engines/staging.py",
    "dcpstore/_impl/engines/nvrx.py",
    "dcpstore/_impl/engines/nvrx_stream.py",
)
OBJECT_STORE = (
    *WRITE_READ,
    "dcpstore/_impl/storage/backends/s3/storage.py",
    "dcpstore/_impl/storage/backends/s3/client.py",
    "dcpstore/_impl/storage/backends/s3/upload.py",
    "dcpstore/_impl/storage/buffered.py",
    "dcpstore/_impl/storage/lending_writer.py",
    "dcpstore/_impl/storage/storage_options.py",
    "dcpstore/_impl/storage/request_pool.py",
    "dcpstore/_impl/storage/backends/msc.py",
)
SCALE = (
    "dcpstore/_impl/dcp/writer.py",
    "dcpstore/_impl/dcp/reader.py",
    "dcpstore/_impl/dcp/read_plan.py",
    "dcpstore/_impl/dcp/commit",
    "dcpstore/_impl/dcp/liveness/owner_gate.py",
    "dcpstore/_impl/storage/storage_options.py",
    "dcpstore/_impl/storage/backends/s3/storage.py",
    "dcpstore/_impl/storage/backends/s3/upload.py",
    "dcpstore/_impl/storage/request_pool.py",
    "benchmarks/scale_sim.py",
)
INTERFERENCE = (
    "dcpstore/_impl/engines/saver.py",
    "dcpstore/_impl/engines/staging.py",
    "dcpstore/_impl/engines/nvrx.py",
    "dcpstore/_impl/dcp/writer.py",
    "dcpstore/_impl/format/record.py",
    "dcpstore/_impl/storage/backends/s3/storage.py",
    "dcpstore/_impl/storage/backends/s3/client.py",
    "dcpstore/_impl/storage/backends/s3/upload.py",
    "dcpstore/_impl/storage/lending_writer.py",
    "dcpstore/_impl/bench/interference.py",
)
GPU_STAGING = (
    "dcpstore/_impl/engines/staging.py",
    "dcpstore/_impl/engines/buffers.py",
    "dcpstore/_impl/engines/saver.py",
    "benchmarks/gpu_stage.py",
)
#: The WAN regimes compare.py runs by default (one section each).
WAN_REGIMES = ("network", "cpu")
TIERED = (
    "dcpstore/_impl/manager/tiers",
    "dcpstore/_impl/manager/roots.py",
    "dcpstore/_impl/engines/saver.py",
    "dcpstore/_impl/storage/backends/s3/storage.py",
)


@dataclass(frozen=True)
class Source:
    """A result file a block renders and the code paths its numbers measure;
    ``history``: a past run kept for comparison, never stale."""

    file: str
    paths: tuple[str, ...] = ()
    history: bool = False


SOURCES: dict[str, tuple[Source, ...]] = {
    "meta": (),
    "targets": (Source("compare.json", LOCAL + OBJECT_STORE), Source("scaling.json", LOCAL)),
    "targets-history": (Source("compare-before.json", history=True), Source("compare.json", LOCAL + OBJECT_STORE)),
    "local": (Source("compare.json", LOCAL),),
    "s3": (Source("compare.json", OBJECT_STORE),),
    "sweep-s3": (Source("compare.json", OBJECT_STORE),),
    "wan": (Source("compare.json", OBJECT_STORE),),
    "sweep-wan": (Source("compare.json", OBJECT_STORE),),
    **{
        f"{kind}wan-{regime}": (Source("compare.json", OBJECT_STORE),)
        for kind in ("", "sweep-", "harness-")
        for regime in WAN_REGIMES
    },
    "interference": (Source("interference.json", INTERFERENCE),),
    # The GPU machine's run is kept as measured (commit c7993bc, before S3
    # parts were lent) until a task is lent a device again to re-run it.
    "interference-gpu": (Source("interference-gpu.json", INTERFERENCE, history=True),),
    "gpu-check": (Source("gpu-check.json", GPU_STAGING),),
    **{f"scaling-{s}": (Source("scaling.json", LOCAL),) for s in ("bytes", "tensors", "workers", "ranks", "repeat")},
    "scale": (Source("scale_sim.json", SCALE),),
    "tiered": (Source("tiered.json", TIERED),),
    "tiered-nodes": (Source("tiered_nodes.json", TIERED),),
    "tiered-peers": (Source("tiered_peers.json", TIERED),),
    "shared-reads": (Source("shared_reads.json", TIERED),),
    "local-disk": (Source("local_disk_ab.json", LOCAL),),
    "local-disk-cold": (Source("local_disk_cold_ab.json", LOCAL),),
    "local-costs": (Source("local_costs.json", LOCAL),),
    "local-costs-kept": (Source("local_costs_kept.json", LOCAL),),
    "local-costs-cold": (Source("local_costs_cold.json", LOCAL),),
    "checksum": (Source("checksum.json", ("dcpstore/_impl/util/checksum.py",)),),
    "wan-scale": (Source("wan_scale.json", OBJECT_STORE),),
}

#: How to produce each result file (printed where one is missing).
COMMANDS = {
    "compare.json": "python benchmarks/compare.py --size 512MiB --tensors 64 --workers 1,2,4 --repeat 3 "
    "--sections wan,s3,local --wan-size 128MiB --wan-tensors 32 --wan-regimes network:5,cpu:25 --wan-pair-repeat 9 --label LABEL --json benchmarks/results/compare.json "
    "--plot benchmarks/results/compare.png --quiet",
    "scaling.json": "python benchmarks/scaling.py --repeat 3 --label LABEL --json benchmarks/results/scaling.json "
    "--plots benchmarks/results --quiet",
    "scale_sim.json": "python benchmarks/scale_sim.py --ranks 1,16,256,1024,4096,16384 --size 1MiB --tensors 2 "
    "--spread auto,1 --label LABEL --json benchmarks/results/scale_sim.json --plot benchmarks/results/scale_sim.png",
    "tiered.json": "python benchmarks/compare.py --sections tiered --tiered-size 256MiB --tensors 32 --workers 4 "
    "--repeat 3 --label LABEL --json benchmarks/results/tiered.json --quiet",
    "interference.json": "python benchmarks/interference.py --size 512MiB --tensors 32 --repeat 3 --pin-training 0 "
    "--json benchmarks/results/interference.json",
    "interference-gpu.json": "bash scripts/gpu-check.sh (on the GPU machine), then commit its interference.json "
    "as benchmarks/results/interference-gpu.json",
    "gpu-check.json": "bash scripts/gpu-check.sh (on the GPU machine, DCPSTORE_GIT_COMMIT set to the commit sent), "
    "then commit its summary.json as benchmarks/results/gpu-check.json",
    "wan_scale.json": "python benchmarks/compare.py --sections wan --wan-size 512MiB --wan-tensors 32 "
    "--wan-regimes network:5,cpu:25 --repeat 7 --only '^(dcpstore s3-wan-[a-z]+ sync default|"
    "raw PUT/GET \\(s3-wan-[a-z]+\\) c=16 part=8\\.0 MiB)$' --label LABEL "
    "--json benchmarks/results/wan_scale.json --quiet",
    "tiered_nodes.json": "python benchmarks/tiered_nodes.py --size-mib 64,256 --saves 6 --label LABEL "
    "--json benchmarks/results/tiered_nodes.json",
    "tiered_peers.json": "python benchmarks/tiered_peers.py --size-mib 32 --saves 3 --rounds 3 --label LABEL "
    "--json benchmarks/results/tiered_peers.json",
    # /work/before: a worktree of the commit compared against (git worktree add /work/before COMMIT).
    # /work/before-align: a worktree of the commit compared against (git worktree add /work/before-align COMMIT).
    "local_disk_ab.json": "python benchmarks/ab_bench.py --a before=/work/before-align --b after=. --backends local "
    "--size 512MiB --tensors 16 --workers 2 --repeat 3 --rounds 11 --limit --label LABEL "
    "--json benchmarks/results/local_disk_ab.json",
    # As root: --cold drops the page cache before each load.
    "local_disk_cold_ab.json": "python benchmarks/ab_bench.py --a before=/work/before-align --b after=. "
    "--backends local --size 512MiB --tensors 16 --workers 2 --repeat 3 --rounds 7 --limit --cold --label LABEL "
    "--json benchmarks/results/local_disk_cold_ab.json",
    # With the crt extra installed, so that the table has an awscrt row.
    "checksum.json": "python benchmarks/checksum.py --label LABEL --json benchmarks/results/checksum.json",
    "local_costs.json": "python benchmarks/local_costs.py --size-mib 512 --tensors 16 --threads 2 --rounds 9 "
    "--label LABEL --json benchmarks/results/local_costs.json",
    "local_costs_kept.json": "python benchmarks/local_costs.py --size-mib 512 --tensors 16 --threads 2 --rounds 9 "
    "--keep-files --label LABEL --json benchmarks/results/local_costs_kept.json",
    # Without the crt extra: on the VM it ran on, awscrt's CRC32C was slower than the crc32c package's.
    "local_costs_cold.json": "python benchmarks/local_costs.py --size-mib 512 --tensors 16 --threads 2 --rounds 9 "
    "--label LABEL --json benchmarks/results/local_costs_cold.json",
    "shared_reads.json": "python benchmarks/shared_reads.py --a before=/work/before --b after=. --size-mib 64 "
    "--ranks 2,4 --rounds 5 --latency-ms 5 --rate-mbps 50 --total-mbps 100 --label LABEL "
    "--json benchmarks/results/shared_reads.json",
}

BLOCK = re.compile(
    r"(<!-- BEGIN generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated:(?P=name) -->)", re.S
)
FIGURE = re.compile(r"<!-- fig (?P<spec>.*?) -->(?P<text>.*?)<!-- /fig -->")


# -- tables ----------------------------------------------------------------------


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _note(r: Row) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    notes = []
    if r.get("read_s") is not None and r["backend"] == "local" and r.get("cold_read") is False:
        notes.append("warm read")
    if r.get("extra", {}).get("fresh_staging"):
        notes.append("own saver: staging allocated in each save")
    if r.get("repeats", 1) > 1:
        notes.append(f"median of {r['repeats']}")
    return ", ".join(notes)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def rows_table(rows: Sequence[Row]) -> str:
    """One row per entry. ``save/limit`` and ``load/limit``: its speed over the
    best limit row of its backend (the fastest raw row of the sweep, per
    direction); ``CPU s/GB``: client CPU seconds per GB moved."""
    head = [
        "entry",
        "backend",
        "W",
        "save GB/s",
        "load GB/s",
        "save/limit",
        "load/limit",
        "blocked s",
        "CPU s/GB save/load",
        "plan/stage/write/commit s",
        "RSS growth",
        "note",
    ]
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
        body.append(
            [
                r["name"],
                r["backend"],
                str(r["workers"]),
                _num(r.get("write_gbps")),
                _num(r.get("read_gbps")),
                _ratio(lim.get("write_vs_limit")),
                _ratio(lim.get("read_vs_limit")),
                _num(r.get("blocked_s")),
                f"{_num(d.get('write_cpu_per_gb'), '.2f')}/{_num(d.get('read_cpu_per_gb'), '.2f')}",
                phases if r["status"] == "ok" else "-",
                human_bytes(growth) if growth is not None else "-",
                _note(r),
            ]
        )
    return targets.markdown_table(head, body)


def sweep_table(rows: Sequence[Row]) -> str:
    """The raw limit sweep of one section as a grid: connections down, part
    size across, save / load GB/s in each cell; the best of each direction
    in bold."""
    # Runs from before the sweep have one raw row without a part size.
    raw = [
        r
        for r in rows
        if r.get("group") == "limit" and r.get("engine") == "boto3" and "part_size" in r.get("extra", {})
    ]
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
    body = [
        [
            str(c),
            *(
                f"{text(cell.get((c, p)), 'write')} / {text(cell.get((c, p)), 'read')}" if (c, p) in cell else ""
                for p in parts
            ),
        ]
        for c in conns
    ]
    return targets.markdown_table(head, body)


def harness_table(rows: Sequence[Row]) -> str:
    """The section's harness self-test, per direction: the proxy and endpoint
    with shaping off against the best row measured through the shaping, and
    what that makes the section (dcpstore._impl.bench.limits.harness_verdicts)."""
    verdicts = harness_verdicts(rows)
    if not verdicts:
        return "_no harness self-test in this run_"
    head = ["direction", "harness, shaping off (GB/s)", "best measured row", "its GB/s", "harness / best", "section is"]
    body = [
        [
            {"write": "save", "read": "load"}[d],
            _num(v["harness_gbps"]),
            v["best"],
            _num(v["best_gbps"]),
            _ratio(v["ratio"]),
            f"**{v['bound']}-bound** (needs {v['margin']:g}x)",
        ]
        for d, v in verdicts.items()
    ]
    return targets.markdown_table(head, body)


def targets_table(results: Sequence[Row]) -> str:
    head = ["target", "ours / reference", "ratio", "status", "why"]
    body = [
        [
            r["target"],
            f"{r['ours']} / {r['ref'] or 'state size'}",
            targets.ratio_text(r),
            f"**{r['status']}**",
            r["why"] or "see analysis below",
        ]
        for r in results
    ]
    return targets.markdown_table(head, body)


def history_table(before: Sequence[Row], now: Sequence[Row]) -> str:
    """Each target as the past run and the current one give it (both
    re-evaluated from their records with today's definitions)."""
    old = {r["target"]: r for r in before}
    head = ["target", "before", "now"]
    body = [
        [r["target"], *(f"{targets.ratio_text(x)} {x['status']}" if x else "-" for x in (old.get(r["target"]), r))]
        for r in now
    ]
    return targets.markdown_table(head, body)


def meta_block(docs: dict[str, Doc]) -> str:
    lines = []
    for name, doc in docs.items():
        m = doc["meta"]
        mach = m.get("machine", {})
        label = f" -- **{m['label']}**" if m.get("label") else ""
        lines.append(
            f"- `{name}`: {m['date']}{label}, commit `{m.get('git_commit')}`, "
            f"{mach.get('cpus')} CPUs, {human_bytes(mach.get('memory_bytes', 0))} RAM, "
            f"torch {mach.get('torch')}, Python {mach.get('python')}"
            + (f", CRC32C by `{mach['crc32c']}`" if "crc32c" in mach else "")
            + "  \n"
            f"  regenerate: `{m.get('command')}`"
        )
    return "\n".join(lines)


def scale_block(scale: Doc) -> str:
    """scale_sim.py's tables, the save's and the load's, as markdown."""
    import scale_sim

    points = [scale_sim.Point(**p) for p in scale["points"]]
    save, load = scale_sim.table(points), scale_sim.load_table(points)
    return (
        "Save:\n\n"
        + targets.markdown_table(save[0], save[1:])
        + "\n\nLoad (every rank reads what it saved):\n\n"
        + targets.markdown_table(load[0], load[1:])
    )


def tiered_block(doc: Doc) -> str:
    rows = [r for r in summarize(doc["records"]) if r.get("extra", {}).get("section") == "tiered"]
    lines = [f"- {line}" for line in tiered_lines(rows)]
    return rows_table(rows) + ("\n\n" + "\n".join(lines) if lines else "")


def tiered_nodes_block(doc: Doc) -> str:
    head = ["state per rank", "kind", "blocked s", "x plain", "local commit s", "x plain"]
    body = [
        [
            f"{size} MiB",
            kind,
            f"{r['blocked_s']:.3f}",
            f"{r['blocked_x']:.2f}x",
            f"{r['local_commit_s']:.3f}",
            f"{r['local_commit_x']:.2f}x",
        ]
        for size, kinds in doc["rows"].items()
        for kind, r in kinds.items()
    ]
    return targets.markdown_table(head, body)


def tiered_peers_block(doc: Doc) -> str:
    """Per kind: a save's wait, the resume after a lost node, what it read from the durable tier."""
    head = ["kind", "save + wait s", "x durable", "peer copies per step", "resume s", "x durable", "durable bytes read"]
    body = [
        [
            kind,
            f"{r['save_wait_s']:.2f}",
            f"{r['save_wait_x']:.2f}x",
            f"{r['peer_bytes_per_step'] / (1 << 20):.1f} MiB",
            f"{r['resume_s']:.2f}",
            f"{r['resume_x']:.2f}x",
            f"{r['resume_durable_bytes'] / (1 << 20):.2f} MiB",
        ]
        for kind, r in doc["rows"].items()
    ]
    return targets.markdown_table(head, body)


def shared_reads_block(doc: Doc) -> str:
    """Bytes fetched over bytes stored, and restore time, before and after."""
    sides = doc["meta"]["sides"]
    a, b = sides
    head = [
        "state",
        "ranks",
        f"{a} (`{sides[a]}`): fetched / stored",
        f"{b} (`{sides[b]}`): fetched / stored",
        f"{a} s",
        f"{b} s",
        f"{b} / {a}",
    ]
    body = [
        [
            r["state"],
            str(r["ranks"]),
            f"{r[a]['fetched_x']:.2f}x",
            f"{r[b]['fetched_x']:.2f}x",
            f"{r[a]['restore_s']:.2f}",
            f"{r[b]['restore_s']:.2f}",
            f"{r['restore_b_over_a']:.2f}x",
        ]
        for r in doc["rows"]
    ]
    return targets.markdown_table(head, body)


#: The local disk's goals against the raw writer in the same run (issue 44):
#: (figure, at least / at most, bound).
LOCAL_DISK_GOALS = {
    "save speed": (">=", 0.95),
    "save CPU/GB": ("<=", 1.15),
    "load speed": (">=", 0.90),
    "load CPU/GB": ("<=", 1.15),
}


def quietest(row: Doc, raw: Doc, side: str, metric: str) -> float:
    """``side``'s least ``metric`` over the raw's least: the two rows' runs
    least disturbed by the box's other work (its CPU per GB swings with the
    page cache's writeback, the raw writer's most of all)."""
    return float(min(row["all"][side][metric]) / min(raw["all"][side][metric]))


def local_disk_block(doc: Doc) -> str:
    """``ab_bench.py --limit`` on a local directory: each side's dcpstore
    rows against the raw writer and reader measured in the same processes.
    Speeds are judged on medians; CPU per GB on the quietest runs
    (:func:`quietest`), the medians beside them: the raw writer's median
    CPU per GB swings with the page cache's writeback from one run to the
    next, and a goal read off it would say more of the box than of the code."""
    sides = doc["meta"]["sides"]
    rows = {(r["group"], r["workers"]): r for r in doc["rows"]}
    head = ["workers", "side", "save GB/s (raw)", "save CPU-s/GB (raw)", "load GB/s (raw)", "load CPU-s/GB (raw)"]
    head += [f"{name} ({op} {bound:.2f}x raw)" for name, (op, bound) in LOCAL_DISK_GOALS.items()]
    head.append("RSS growth of a save")
    body = []
    for (group, workers), row in sorted(rows.items()):
        raw = rows.get(("limit", workers))
        if group != "dcpstore" or raw is None:
            continue
        for side, commit in sides.items():
            ours, lim = row["median"][side], raw["median"][side]
            judged = {
                "save speed": ours["write_gbps"] / lim["write_gbps"],
                "save CPU/GB": quietest(row, raw, side, "write_cpu_s_per_gb"),
                "load speed": ours["read_gbps"] / lim["read_gbps"],
                "load CPU/GB": quietest(row, raw, side, "read_cpu_s_per_gb"),
            }
            medians = {
                "save CPU/GB": ours["write_cpu_s_per_gb"] / lim["write_cpu_s_per_gb"],
                "load CPU/GB": ours["read_cpu_s_per_gb"] / lim["read_cpu_s_per_gb"],
            }
            cells = []
            for name, (op, bound) in LOCAL_DISK_GOALS.items():
                value = judged[name]
                met = value >= bound if op == ">=" else value <= bound
                cell = f"{value:.2f}x {'met' if met else 'missed'}"
                if name in medians:
                    cell += f" (medians {medians[name]:.2f}x)"
                cells.append(cell)
            body.append(
                [
                    str(workers),
                    f"{side} (`{commit}`)",
                    f"{ours['write_gbps']:.2f} ({lim['write_gbps']:.2f})",
                    f"{ours['write_cpu_s_per_gb']:.3f} ({lim['write_cpu_s_per_gb']:.3f})",
                    f"{ours['read_gbps']:.2f} ({lim['read_gbps']:.2f})",
                    f"{ours['read_cpu_s_per_gb']:.3f} ({lim['read_cpu_s_per_gb']:.3f})",
                    *cells,
                    f"{ours['rss_growth_mib']:.1f} MiB",
                ]
            )
    return targets.markdown_table(head, body)


def local_costs_block(doc: Doc) -> str:
    """``local_costs.py``: every row at one thread count, then its goals
    (the sync save against stock ``dcp.save``, the async save's CPU per GB
    against a copy's plus the raw writer's, the load's against the raw
    reader's), each with its value and bound."""
    gb = doc["bytes"] / 1e9
    threads = doc["args"]["threads"]
    head = ["row", "median s", "median GB/s", "CPU-s/GB median", "CPU-s/GB least"]
    body = []
    for name, row in doc["rows"].items():
        label = f"{name} ({row['engine']} engine)" if "engine" in row else name
        body.append(
            [
                label,
                f"{row['median_s']:.3f}",
                f"{gb / row['median_s']:.2f}",
                f"{row['median_cpu_s_per_gb']:.3f}",
                f"{row['least_cpu_s_per_gb']:.3f}",
            ]
        )
    rows = doc["rows"]
    # The raw writer only writes and fsyncs: its time over stock's is as low
    # as the first goal's ratio goes, on the disk measured, for a writer that
    # leaves all its writeback to the fsync as both of them do.
    floor = {
        "goal": "raw write+fsync time / stock dcp.save's (medians; neither starts writeback before its fsync)",
        "value": rows["raw"]["median_s"] / rows["stock dcp.save"]["median_s"],
        "bound": None,
        "met": None,
    }
    listed = [*doc["goals"][:2], floor, *doc["goals"][2:]]
    kept = ", every round's files kept to the end" if doc["args"].get("keep_files") else ""
    goals = [
        [
            g["goal"],
            f"{g['value']:.2f}",
            "-" if g["bound"] is None else f"{g['bound']:.2f}",
            "-" if g["met"] is None else "met" if g["met"] else "**missed**",
        ]
        for g in listed
    ]
    return (
        f"{human_bytes(doc['bytes'])} in {doc['args']['tensors']} tensors "
        f"({'pinned' if doc['args'].get('source') == 'pinned' else 'pageable'} host memory), "
        f"{threads} thread(s) in every row, "
        f"{doc['args']['rounds']} rounds{kept}.\n\n"
        + targets.markdown_table(head, body)
        + "\n\n"
        + targets.markdown_table(["goal", "value", "bound", "status"], goals)
    )


def checksum_block(doc: Doc) -> str:
    """``checksum.py``: each library's GB/s on a buffer in cache and from
    memory, and each against the ``crc32c`` package (dcpstore's CRC32C
    without ``awscrt``)."""
    places = list(doc["places"])
    base = doc["rows"]["crc32c"]
    head = ["library", *(f"{p} GB/s" for p in places), *(f"{p} vs crc32c" for p in places)]
    body = [
        [f"`{name}`", *(f"{row[p]:.1f}" for p in places), *(f"{row[p] / base[p]:.2f}x" for p in places)]
        for name, row in doc["rows"].items()
    ]
    return targets.markdown_table(head, body)


def gpu_check_block(doc: Doc) -> str:
    """``scripts/gpu-check.sh``'s summary: the machine, the cuda tests, the
    staging and blocked-time rows and their goals."""
    env, tests, bench = doc["env"], doc["tests"], doc["benchmark"]  # the summary's key, not the tests/ folder
    lines = [
        f"{doc['meta']['date'][:10]}, one {env['gpu']} (compute capability {env['gpu_capability']}), "
        f"{env['cpus']} cores, torch {env['torch']} (CUDA {env['torch_cuda']}), NVRx "
        f"{env.get('pkg:nvidia-resiliency-ext')}, commit `{doc['meta']['git_commit']}`.",
        "",
        f"- `tests/integration/test_cuda.py -m cuda`: {tests['passed']} passed, {tests['failures']} failed, "
        f"{tests['errors']} errors, {tests['skipped']} skipped",
        "",
        "| staged | staging GB/s | best pinned copy GB/s | that copy | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in bench["staging"]:
        lines.append(
            f"| {human_bytes(r['bytes'])} | {r['stage_gbps']:.1f} | {r['limit_gbps']:.1f} | {r['limit']} | "
            f"{r['ratio']:.2f}x |"
        )
    lines += [
        "",
        "| state | dcpstore blocked s (steady) | best dcp.async_save | its blocked s | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in bench["blocked"]:
        steady = r["steady_s"]
        lines.append(
            f"| {human_bytes(r['bytes'])} | {steady['dcpstore-native']:.3f} | {r['best_dcp']} | "
            f"{steady[r['best_dcp']]:.3f} | {r['ratio_vs_best_dcp']:.2f}x |"
        )
    lines.append("")
    for name, g in bench["goals"].items():
        verdict = "not judged" if g["met"] is None else ("met" if g["met"] else "missed")
        lines.append(f"- goal `{name}` {g['goal']}: **{verdict}** (worst {g['worst']:.2f}x)")
    overhead = bench.get("pinned_overhead")
    if overhead:
        lines.append(
            f"- pinned host memory held by staging: {overhead['ratio']:.2f}x the state's bytes "
            f"(tensors of {overhead['tensor_mib']} MiB)"
        )
    for skipped in bench.get("skipped") or []:
        lines.append(f"- not run ({skipped['why']}): {skipped['phase']} at {skipped['size_gib']} GiB")
    return "\n".join(lines)


def pending(name: str) -> str:
    return f"_pending: no committed `{name}`; run `{COMMANDS[name]}`, then `python benchmarks/report.py`_"


def wan_regimes(meta: Doc) -> list[str] | None:
    """The WAN regimes a compare run measured (None: a run from before the
    regimes, with one ``wan`` section)."""
    return list((meta.get("wan") or {}).get("regimes") or {}) or None


def target_results(docs: dict[str, Doc], compare: str = "compare.json") -> list[Row]:
    """Every target, recomputed from the records (edited definitions apply to old runs too)."""
    results: list[Row] = []
    if compare in docs:
        summary = summarize(docs[compare]["records"])
        meta = docs[compare]["meta"]
        results += targets.evaluate_all(targets.compare_targets(max(meta["workers"]), wan_regimes(meta)), summary)
    scaling = docs.get("scaling.json")
    if compare == "compare.json" and scaling:
        summary = summarize(scaling["records"])
        counts = [r["extra"]["x"] for r in summary if r.get("extra", {}).get("sweep") == "tensors"]
        if counts:
            results += targets.evaluate_all(
                targets.scaling_targets(scaling["meta"]["fixed_workers"], max(counts)), summary
            )
    return results


def wan_scale_block(doc: Doc) -> str:
    """The WAN pair at a larger state (dcpstore's defaults and bare boto3 at
    the same connections and part size), and the CPU targets it judges: one
    raw row is no swept limit, so the throughput targets stay with the
    sections of ``compare.json``."""
    summary = summarize(doc["records"])
    judged = [
        r
        for r in targets.evaluate_all(
            targets.compare_targets(max(doc["meta"]["workers"]), wan_regimes(doc["meta"])), summary
        )
        if r["status"] != "n/a" and r["metric"].endswith("_cpu_per_gb")
    ]
    return rows_table(summary) + "\n\n" + targets_table(judged)


def blocks(docs: dict[str, Doc]) -> dict[str, str]:
    """Every block's text from the result files in ``docs`` (name -> document)."""
    out: dict[str, str] = {"meta": meta_block(docs)}
    if "scale_sim.json" in docs:
        out["scale"] = scale_block(docs["scale_sim.json"])
    compare = docs.get("compare.json")
    if compare:
        summary = summarize(compare["records"])  # re-derived: summaries gain fields over time
        regimes = wan_regimes(compare["meta"])
        for section in ("local", "s3", *([f"wan-{r}" for r in regimes] if regimes else ["wan"])):
            rows = [r for r in summary if r.get("extra", {}).get("section") == section]
            out[section] = rows_table(rows)
            out[f"sweep-{section}"] = sweep_table(rows)
            if section.startswith("wan-"):
                out[f"harness-{section}"] = harness_table(rows)
    scaling = docs.get("scaling.json")
    if scaling:
        summary = summarize(scaling["records"])
        for sweep in ("bytes", "tensors", "workers", "ranks", "repeat"):
            sub = [r for r in summary if r.get("extra", {}).get("sweep") == sweep]
            if sweep == "repeat":
                sub = [r for r in scaling["records"] if r.get("extra", {}).get("sweep") == "repeat"]
                sub = [dict(r, name=f"{r['name']} save #{r['repeat'] + 1}") for r in sub]
            out[f"scaling-{sweep}"] = rows_table(sub)
    out["targets"] = targets_table(target_results(docs))
    if "compare-before.json" in docs and compare:
        out["targets-history"] = history_table(target_results(docs, "compare-before.json"), target_results(docs))
    for name in ("interference", "interference-gpu"):
        doc = docs.get(f"{name}.json")
        if doc:
            out[name] = interference.markdown(doc)
        elif name == "interference":
            out[name] = pending(f"{name}.json")
    out["gpu-check"] = (
        gpu_check_block(docs["gpu-check.json"]) if "gpu-check.json" in docs else pending("gpu-check.json")
    )
    out["tiered"] = tiered_block(docs["tiered.json"]) if "tiered.json" in docs else pending("tiered.json")
    out["wan-scale"] = (
        wan_scale_block(docs["wan_scale.json"]) if "wan_scale.json" in docs else pending("wan_scale.json")
    )
    out["tiered-nodes"] = (
        tiered_nodes_block(docs["tiered_nodes.json"]) if "tiered_nodes.json" in docs else pending("tiered_nodes.json")
    )
    out["tiered-peers"] = (
        tiered_peers_block(docs["tiered_peers.json"]) if "tiered_peers.json" in docs else pending("tiered_peers.json")
    )
    out["shared-reads"] = (
        shared_reads_block(docs["shared_reads.json"]) if "shared_reads.json" in docs else pending("shared_reads.json")
    )
    out["local-disk"] = (
        local_disk_block(docs["local_disk_ab.json"]) if "local_disk_ab.json" in docs else pending("local_disk_ab.json")
    )
    out["local-disk-cold"] = (
        local_disk_block(docs["local_disk_cold_ab.json"])
        if "local_disk_cold_ab.json" in docs
        else pending("local_disk_cold_ab.json")
    )
    out["local-costs"] = (
        local_costs_block(docs["local_costs.json"]) if "local_costs.json" in docs else pending("local_costs.json")
    )
    out["local-costs-cold"] = (
        local_costs_block(docs["local_costs_cold.json"])
        if "local_costs_cold.json" in docs
        else pending("local_costs_cold.json")
    )
    out["local-costs-kept"] = (
        local_costs_block(docs["local_costs_kept.json"])
        if "local_costs_kept.json" in docs
        else pending("local_costs_kept.json")
    )
    out["checksum"] = checksum_block(docs["checksum.json"]) if "checksum.json" in docs else pending("checksum.json")
    return out


# -- figures in prose ---------------------------------------------------------------


def _field(row: Row, field: str) -> Any:
    value: Any = targets.with_derived(row)
    for part in field.split("."):
        value = value[part]
    return value


def _format(value: Any, spec: str) -> str:
    """``value`` by ``spec``: ``bytes`` (a size), or ``[UNIT:]FORMAT[x]``:
    the value in units of UNIT (``1e6:.0f`` prints bytes/s as MB/s), by a
    Python format spec, ``x`` after it for a ratio."""
    if spec == "bytes":
        return human_bytes(int(value))
    unit, _, spec = spec.rpartition(":") if ":" in spec else ("", "", spec)
    if unit:
        value = value / float(unit)
    suffix = "x" if spec.endswith("x") else ""
    return format(value, spec.removesuffix("x")) + suffix


def _row(docs: dict[str, Doc], file: str, name: str) -> Row:
    rows = [r for r in summarize(docs[file]["records"]) if r["name"] == name]
    if len(rows) != 1:
        raise KeyError(f"{file} has {len(rows)} rows named {name!r}")
    return rows[0]


def _target(docs: dict[str, Doc], title: str) -> Row:
    found = [r for r in target_results(docs) if r["target"].startswith(title)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} targets' titles start with {title!r}")
    return found[0]


def figure(spec: str, docs: dict[str, Doc]) -> str:
    """The text of the figure ``spec`` names (see the module docstring)."""
    kind, *args = [a.strip() for a in spec.split("|")]
    if kind == "row":
        file, name, field, fmt = args
        return _format(_field(_row(docs, file, name), field), fmt)
    if kind == "ratio":
        file, name, ref, field, fmt = args
        return _format(_field(_row(docs, file, name), field) / _field(_row(docs, file, ref), field), fmt)
    if kind == "target":
        return targets.ratio_text(_target(docs, args[0]))
    if kind == "status":
        return str(_target(docs, args[0])["status"])
    if kind == "scale":
        ranks, spread, field, fmt = args
        points = [
            p
            for p in docs["scale_sim.json"]["points"]
            if p["ranks"] == int(ranks) and str(p["extra"].get("spread", 1)) == spread
        ]
        if len(points) != 1:
            raise KeyError(f"scale_sim.json has {len(points)} points of {ranks} ranks, spread {spread}")
        return _format(_field(points[0], field), fmt)
    if kind == "meta":
        file, key, fmt = args
        return _format(_field(docs[file]["meta"], key), fmt)
    if kind == "const":
        return _format(CONSTANTS[args[0]], args[1])
    raise KeyError(f"unknown figure kind {kind!r}")


def figure_file(spec: str) -> str | None:
    """The result file a figure comes from (None: this module's constants)."""
    kind, *args = [a.strip() for a in spec.split("|")]
    if kind in ("target", "status"):
        return "compare.json"
    if kind == "scale":
        return "scale_sim.json"
    return None if kind == "const" else args[0]


# -- the page --------------------------------------------------------------------------


def render(page: str, generated: dict[str, str], docs: dict[str, Doc] | None = None) -> str:
    """``page`` with its blocks (and, given ``docs``, its figures) regenerated."""
    page = BLOCK.sub(
        lambda m: m.group(1) + generated.get(m["name"], m["body"].rstrip()).rstrip() + "\n" + m.group(4), page
    )
    if docs is not None:
        page = FIGURE.sub(lambda m: f"<!-- fig {m['spec']} -->{figure(m['spec'], docs)}<!-- /fig -->", page)
    return page


def read_results(directory: str = RESULTS) -> dict[str, Doc]:
    """Every committed result file, by name."""
    docs: dict[str, Doc] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                docs[name] = json.load(f)
    return docs


#: Outside generated text, a number that reads as a measurement: one with a
#: fraction, or one with a ratio, percent or rate unit after it (a whole
#: number of seconds or of bytes reads as a setting).
MEASURED = re.compile(
    r"(?<![\w.,/-])(?P<num>\d[\d,]*(?:\.\d+)?)(?![\d.]*\.\d)(?![\w-]*[a-wyzA-Z])(?P<unit>x\b|\s?%|\s?(?:GB/s|MB/s|PUT/s|GET/s|req/s)"
    r"|\s?ms\b|\s?s\b)?"
)
#: What a bound (a target, not a figure) is written after.
BOUNDS = (">=", "<=", "<", ">", "within", "target", "bound")
#: Metadata that is no setting of the run (results, the machine).
NOT_SETTINGS = ("targets", "machine", "date")
#: What a version number is written after.
VERSIONED = ("Python", "torch", "NVRx", "moto")


def _prose(page: str) -> str:
    """``page`` without generated text, code, links and comments."""
    page = BLOCK.sub("", page)
    page = FIGURE.sub("", page)
    page = re.sub(r"```.*?```", "", page, flags=re.S)
    page = re.sub(r"`[^`]*`", "", page)
    page = re.sub(r"<!--.*?-->", "", page, flags=re.S)
    page = re.sub(r"\]\([^)]*\)", "]", page)
    return page


def _numbers(value: Any) -> Iterable[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def loose_figures(page: str, docs: dict[str, Doc]) -> list[str]:
    """Measured-looking numbers of the prose that no committed file's
    metadata holds (the runs' settings: sizes, rates, model parameters);
    a measured figure belongs in a block or a figure span."""
    settings = {
        v
        for doc in docs.values()
        for key, value in doc.get("meta", {}).items()
        if key not in NOT_SETTINGS
        for v in _numbers(value)
    }
    out = []
    prose = _prose(page)
    for m in MEASURED.finditer(prose):
        text, unit = m["num"], m["unit"]
        if "." not in text and (not unit or unit.strip() in ("s", "ms")):
            continue  # a count, a size or a whole number of seconds: a setting, not a figure
        before = prose[max(0, m.start() - 8) : m.start()].strip()
        if before.endswith(BOUNDS) or before.endswith(VERSIONED):
            continue
        value = float(text.replace(",", ""))
        places = len(text.split(".")[1]) if "." in text else 0
        if any(round(s, places) == value for s in settings):
            continue
        line = prose[: m.start()].count("\n") + 1
        out.append(f"{text}{unit or ''} (prose line {line}: ...{prose[max(0, m.start() - 40) : m.end() + 10]!r})")
    return out


# -- git: which commit measured a file, and what changed since -----------------------


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError as e:  # no git on this machine: the age is unknown, as in a copy without history
        raise LookupError(f"git cannot run: {e}") from e


def commits_since(commit: str, paths: Sequence[str]) -> int:
    """How many commits between ``commit`` and HEAD touch ``paths``; raises
    LookupError if ``commit`` is not in this repository's history."""
    if _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").returncode != 0:
        if _git("rev-parse", "--git-dir").returncode != 0:
            raise LookupError("this copy has no git history (a source archive?)")
        raise LookupError(
            f"commit {commit} is not in this repository's history (a shallow clone, or a squashed branch?)"
        )
    if _git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        raise LookupError(f"commit {commit} is not an ancestor of HEAD")
    out = _git("rev-list", "--count", f"{commit}..HEAD", "--", *sorted(former_names(commit, paths)))
    if out.returncode != 0:
        raise LookupError(f"git rev-list failed: {out.stderr.strip()}")
    return int(out.stdout.strip())


def former_names(commit: str, paths: Sequence[str]) -> set[str]:
    """``paths`` and every name each had between ``commit`` and HEAD: a
    module moved (the private tree, a module split into a package) is the
    same measured code, and the commits that touched it under its old name
    count too."""
    names = set(paths)
    for path in paths:
        out = _git("log", "--follow", "--name-only", "--format=", f"{commit}..HEAD", "--", path)
        if out.returncode == 0:
            names.update(line for line in out.stdout.splitlines() if line.strip())
    return names


def measured_paths(page: str) -> dict[str, set[str]]:
    """Each result file ``page`` renders (in a block or a figure) -> the
    code paths its numbers measure (past runs kept for comparison aside)."""
    used: dict[str, set[str]] = {}
    for m in BLOCK.finditer(page):
        for src in SOURCES.get(m["name"], ()):
            if not src.history:
                used.setdefault(src.file, set()).update(src.paths)
    for m in FIGURE.finditer(page):
        file = figure_file(m["spec"])
        if file is not None:
            paths = {p for srcs in SOURCES.values() for s in srcs if s.file == file for p in s.paths}
            used.setdefault(file, set()).update(paths)
    return used


def ages(page: str, docs: dict[str, Doc]) -> list[str]:
    """One line per result file ``page`` renders: its date, its commit and
    how many commits since touch the code it measures, ``stale`` past
    :data:`STALE_AFTER` with the command that re-runs it. Never a problem:
    without history (a shallow clone, an archive) the count is unknown, and
    an old benchmark says so without failing the change that made it old."""
    out = []
    for file, paths in sorted(measured_paths(page).items()):
        meta = docs[file]["meta"] if file in docs else None
        if not meta or not meta.get("git_commit") or not paths:
            continue  # missing files and metadata are problems (metadata_problems, pending blocks)
        head = f"{file} ({meta.get('date', '?')[:10]}, commit {meta['git_commit']})"
        try:
            n = commits_since(meta["git_commit"], sorted(paths))
        except LookupError as e:
            out.append(f"{head}: age unknown: {e}")
            continue
        line = f"{head}: {n} commit{'' if n == 1 else 's'} since touch the code it measures"
        if n > STALE_AFTER:
            line += (
                f"; stale (more than {STALE_AFTER}): re-run `{meta.get('command')}` on a quiet box, "
                "then python benchmarks/report.py"
            )
        out.append(line)
    return out


def metadata_problems(docs: dict[str, Doc]) -> list[str]:
    out = []
    for name, doc in docs.items():
        meta = doc.get("meta", {})
        for key in ("git_commit", "command", "date"):
            if not meta.get(key):
                out.append(f"benchmarks/results/{name}: its metadata has no {key}")
        if meta.get("git_dirty"):
            out.append(f"benchmarks/results/{name}: measured on a checkout with uncommitted changes")
        if not any(s.file == name for srcs in SOURCES.values() for s in srcs):
            out.append(f"benchmarks/results/{name}: no block of BENCHMARKS.md renders it (add one, or remove the file)")
    return out


def _args(command: str) -> list[str]:
    """``command``'s arguments, its ``--label`` value spelled ``LABEL``."""
    args = shlex.split(command)
    if "--label" in args[:-1]:
        args[args.index("--label") + 1] = "LABEL"
    return args


def command_problems(page: str, docs: dict[str, Doc]) -> list[str]:
    """A result file made by a ``python ...`` command whose :data:`COMMANDS`
    entry, or the page's "Regenerate" block, says another command (``--label``
    aside): the page would tell a reader to run what did not make its numbers."""
    block = re.search(r"## Regenerate\n.*?```bash\n(?P<body>.*?)```", page, re.S)
    listed = [
        _args(line)
        for line in (block["body"].replace("\\\n", " ").splitlines() if block else [])
        if line.startswith("python ")
    ]
    out = []
    for name, doc in docs.items():
        want, made = COMMANDS.get(name, ""), doc.get("meta", {}).get("command") or ""
        if not want.startswith("python ") or not made:
            continue  # a command run on another machine is described in words
        wanted = _args(want)
        if _args(made) != wanted:
            out.append(f"benchmarks/results/{name} was made by `{made}`, but report.py's COMMANDS says `{want}`")
        elif wanted not in [a[: len(wanted)] for a in listed]:  # a line may end in a comment
            out.append(f"BENCHMARKS.md: the Regenerate block lacks the command that made {name}: `{want}`")
    return out


def empty_met(docs: dict[str, Doc]) -> list[str]:
    """Targets that read "met" from a row that measured nothing."""
    return [
        f"target {r['target']!r} reads met from a ratio of {r['ratio']!r}: nothing was measured"
        for r in target_results(docs)
        if r["status"] == "met" and not (r["ratio"] and round(r["ratio"], 2) > 0)
    ]


def problems(page: str, docs: dict[str, Doc]) -> list[str]:
    """Everything that does not hold of ``page`` against the result files."""
    out = metadata_problems(docs) + empty_met(docs) + command_problems(page, docs)
    try:
        fresh = render(page, blocks(docs), docs)
    except KeyError as e:
        return [*out, f"BENCHMARKS.md: a figure names what no result file holds: {e}"]
    if fresh != page:
        out.append("BENCHMARKS.md differs from what the result files give: run python benchmarks/report.py")
    return out + [f"BENCHMARKS.md: a figure outside generated text: {f}" for f in loose_figures(page, docs)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=RESULTS, help="the result files (default benchmarks/results)")
    p.add_argument("--compare", help="this compare.json instead of the committed one")
    p.add_argument("--scaling", help="this scaling.json instead of the committed one")
    p.add_argument("--scale", help="this scale_sim.json instead of the committed one")
    p.add_argument("--interference", help="this interference.json instead of the committed one")
    p.add_argument(
        "--interference-gpu", help="scripts/gpu-check.sh's interference.json (committed as interference-gpu.json)"
    )
    p.add_argument("--page", default=os.path.join(ROOT, "BENCHMARKS.md"))
    p.add_argument(
        "--check",
        action="store_true",
        help="change nothing; print what does not hold (exit 1 if any), then each result's age (never a failure)",
    )
    args = p.parse_args(argv)
    docs = read_results(args.results)
    overrides = (
        ("compare.json", args.compare),
        ("scaling.json", args.scaling),
        ("scale_sim.json", args.scale),
        ("interference.json", args.interference),
        ("interference-gpu.json", args.interference_gpu),
    )
    for name, path in overrides:
        if path is not None:
            docs.pop(name, None)
            if os.path.exists(path):
                with open(path) as f:
                    docs[name] = json.load(f)
    with open(args.page) as f:
        page = f.read()
    if args.check:
        found = problems(page, docs)
        print("\n".join(found) or f"{args.page} agrees with the result files")
        print("\nHow old each result is (commits touching the code it measures since its own):")
        print("\n".join(f"- {line}" for line in ages(page, docs)))
        return 1 if found else 0
    page = render(page, blocks(docs), docs)
    with open(args.page, "w") as f:
        f.write(page)
    print(f"updated {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
