"""Scaling sweeps: how save and load scale with bytes, tensor count, workers,
ranks and repeated saves -- dcpstore next to dcp.save and the raw limit.

    python benchmarks/scaling.py --json benchmarks/results/scaling.json --plots benchmarks/results

Sweeps (``--sweeps``, comma-separated):

* ``bytes``   64 MiB .. 2 GiB (``--sizes``) at ``--tensors`` tensors;
* ``tensors`` 10 large .. 20,000 small (``--counts``) at ``--size``;
* ``workers`` 1, 2, 4, 8 (``--workers``) at ``--size``;
* ``ranks``   1, 2, 4 processes on gloo (``--ranks``), ``--size`` split across them;
* ``repeat``  the same structure saved ``--saves`` times in a row (per-save times).

Every point runs dcpstore (local, sync), ``dcp.save`` with ``FileSystemWriter``
at the same thread count and, where it means something, the raw
write+fsync/read limit -- each on the same state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import limits  # noqa: E402
import peers  # noqa: E402
import torch  # noqa: E402
from servers import free_port  # noqa: E402

from dcpstore._impl.bench import (  # noqa: E402
    Entry,
    Record,
    make_state,
    parse_int_list,
    parse_size,
    run_entries,
    summarize,
    zeros_like_state,
)
from dcpstore._impl.bench.entries import DcpstoreEntry  # noqa: E402
from dcpstore._impl.bench.measure import drop_page_cache, states_equal  # noqa: E402
from dcpstore._impl.bench.report import format_table, write_json  # noqa: E402


def point_entries(root: str, run_id: str, workers: int, *, raw: bool = True) -> list[tuple[str, Entry]]:
    """(family, entry) for one point of a sweep: dcpstore, dcp.save, raw."""
    out: list[tuple[str, Entry]] = [
        ("dcpstore", DcpstoreEntry(os.path.join(root, "dcpstore"), run_id, workers=workers)),
        ("dcp.save", peers.DcpFileSystem(root, workers)),
    ]
    if raw:
        out.append(("raw write+fsync / read", limits.RawFiles(root, workers)))
    return out


def repeat_entries(root: str, run_id: str, workers: int) -> list[tuple[str, Entry]]:
    """Saves of one structure again and again: sync, both async engines (the
    nvrx engine caches its plan for a repeated structure) and dcp's own."""
    base = os.path.join(root, "dcpstore")
    return [
        *point_entries(root, run_id, workers, raw=False),
        ("dcpstore async/native", DcpstoreEntry(base, run_id, workers=workers, engine="native", async_=True)),
        ("dcpstore async/nvrx", DcpstoreEntry(base, run_id, workers=workers, engine="nvrx", async_=True)),
        ("dcp.async_save", peers.DcpFileSystem(root, workers, async_=True)),
    ]


def run_point(
    sweep: str,
    x_name: str,
    x: Any,
    entries: list[tuple[str, Entry]],
    state: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    repeat: int,
    progress: bool,
    drop_caches: bool,
) -> list[Record]:
    for family, entry in entries:
        entry.name = f"{family} [{x_name}={x}]"
    records = run_entries(
        [e for _, e in entries],
        state,
        dest,
        repeat=repeat,
        progress=progress,
        desc=f"{sweep} {x}",
        drop_caches=drop_caches,
    )
    families = {e.name: f for f, e in entries}
    for r in records:
        r.extra.update(sweep=sweep, family=families[r.name], x_name=x_name, x=x)
    return records


# ---------------------------------------------------------------------------
# Ranks: one process per rank on gloo, timed between barriers
# ---------------------------------------------------------------------------


def _rank_main(
    rank: int,
    world: int,
    port: int,
    kind: str,
    path: str,
    size: int,
    tensors: int,
    workers: int,
    drop: bool,
    results: Any,
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        local = make_state(size // world, max(1, tensors // world), seed=rank)
        state = {f"r{rank}.{k}": v for k, v in local.items()}
        dest = zeros_like_state(state)

        def save() -> None:
            if kind == "dcpstore":
                import dcpstore

                dcpstore.save(state, path, workers=workers)
            else:
                from torch.distributed.checkpoint import FileSystemWriter

                dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=workers))

        def load() -> None:
            if kind == "dcpstore":
                import dcpstore

                dcpstore.load(dest, path, workers=workers)
            else:
                from torch.distributed.checkpoint import FileSystemReader

                dcp.load(dest, storage_reader=FileSystemReader(path))

        dist.barrier()
        t0 = time.perf_counter()
        save()
        dist.barrier()
        write_s = time.perf_counter() - t0
        cold = drop_page_cache() if (drop and rank == 0) else False
        dist.barrier()
        t0 = time.perf_counter()
        load()
        dist.barrier()
        read_s = time.perf_counter() - t0
        ok = torch.tensor([1 if states_equal(state, dest) else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            results.put({"write_s": write_s, "read_s": read_s, "verified": bool(ok.item()), "cold_read": cold})
    finally:
        dist.destroy_process_group()


def run_ranks(root: str, ranks: Sequence[int], size: int, tensors: int, workers: int, drop: bool) -> list[Record]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    records = []
    for world in ranks:
        for kind in ("dcpstore", "dcp.save"):
            path = os.path.join(root, f"ranks-{kind}-{world}")
            rec = Record(
                f"{kind} [ranks={world}]",
                "dcpstore" if kind == "dcpstore" else "peer",
                "local",
                "sync" if kind == "dcpstore" else "dcp.save",
                "sync",
                workers,
                world,
                tensors,
                size,
            )
            rec.extra.update(sweep="ranks", family=kind, x_name="ranks", x=world)
            queue = ctx.SimpleQueue()
            print(f"  ranks={world} {kind} ...", file=sys.stderr, flush=True)
            try:
                mp.start_processes(
                    _rank_main,
                    args=(world, free_port(), kind, path, size, tensors, workers, drop, queue),
                    nprocs=world,
                    start_method="spawn",
                    join=True,
                )
                got = queue.get()
                rec.write_s, rec.read_s = got["write_s"], got["read_s"]
                rec.write_gbps, rec.read_gbps = size / got["write_s"] / 1e9, size / got["read_s"] / 1e9
                rec.blocked_s, rec.verified, rec.cold_read = got["write_s"], got["verified"], got["cold_read"]
                if not rec.verified:
                    rec.status, rec.reason = "failed", "loaded tensors differ from the saved ones"
            except Exception as e:
                rec.status, rec.reason = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                shutil.rmtree(path, ignore_errors=True)
            records.append(rec)
    return records


# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweeps", default="bytes,tensors,workers,ranks,repeat")
    p.add_argument("--size", default="256MiB", help="state size for the tensors/workers/ranks/repeat sweeps")
    p.add_argument("--sizes", default="64MiB,256MiB,1GiB,2GiB")
    p.add_argument("--tensors", type=int, default=32, help="tensor count where it is not swept")
    p.add_argument("--counts", default="10,100,1000,10000,20000")
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--fixed-workers", type=int, default=2, help="workers where they are not swept (default 2)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--saves", type=int, default=5, help="saves in a row for the repeat sweep")
    p.add_argument("--repeat", type=int, default=1, help="measurements per point (median reported)")
    p.add_argument("--root", help="directory for files (default: a temporary directory under /tmp)")
    p.add_argument("--label", default="")
    p.add_argument("--json")
    p.add_argument("--plots", help="directory for scaling_*.png")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before loads (it needs root)")
    p.add_argument("--replot", metavar="JSON", help="only redraw --plots from an earlier run's JSON")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            write_plots(args.plots or os.path.dirname(os.path.abspath(args.replot)), json.load(f)["records"])
        return 0
    warnings.filterwarnings("ignore")

    sweeps = args.sweeps.split(",")
    size, w = parse_size(args.size), args.fixed_workers
    root = tempfile.mkdtemp(prefix="dcpstore-scaling-", dir=args.root)
    run_id = f"scaling-{uuid.uuid4().hex[:6]}"
    records: list[Record] = []
    opts = {"progress": not args.quiet, "drop_caches": not args.warm}
    try:
        if "bytes" in sweeps:
            for s in (parse_size(x) for x in args.sizes.split(",")):
                state = make_state(s, args.tensors)
                dest = zeros_like_state(state)
                records += run_point(
                    "bytes", "bytes", s, point_entries(root, run_id, w), state, dest, args.repeat, **opts
                )
                del state, dest
        state = make_state(size, args.tensors)
        dest = zeros_like_state(state)
        if "workers" in sweeps:
            for n in parse_int_list(args.workers):
                records += run_point(
                    "workers", "workers", n, point_entries(root, run_id, n), state, dest, args.repeat, **opts
                )
        if "repeat" in sweeps:
            records += run_point(
                "repeat", "saves", args.saves, repeat_entries(root, run_id, w), state, dest, args.saves, **opts
            )
        if "tensors" in sweeps:
            for n in parse_int_list(args.counts, "counts"):
                st = make_state(size, n)
                de = zeros_like_state(st)
                records += run_point(
                    "tensors", "tensors", n, point_entries(root, run_id, w, raw=False), st, de, args.repeat, **opts
                )
                del st, de
        if "ranks" in sweeps:
            records += run_ranks(root, parse_int_list(args.ranks, "ranks"), size, args.tensors, w, not args.warm)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = summarize(records)
    for sweep in sweeps:
        sub = [r for r in rows if r["extra"].get("sweep") == sweep]
        if sub:
            print(f"\n== {sweep}")
            print(format_table(sub))
    if args.json:
        write_json(
            args.json,
            records,
            {
                "command": shlex.join(
                    ["python", "benchmarks/scaling.py", *(argv if argv is not None else sys.argv[1:])]
                ),
                "label": args.label,
                "size": size,
                "tensors": args.tensors,
                "fixed_workers": w,
            },
        )
        print(f"wrote {args.json}")
    if args.plots:
        write_plots(args.plots, [r.to_json() for r in records])
    return 1 if any(r.status == "failed" for r in records) else 0


def write_plots(directory: str, records: Sequence[dict[str, Any]]) -> None:
    """All scaling_*.png from the per-repeat records (JSON dicts)."""
    import plots

    rows = summarize(records)
    os.makedirs(directory, exist_ok=True)
    sweeps = (
        ("bytes", "state size (bytes)", 2),
        ("tensors", "tensors (same total bytes)", 10),
        ("workers", "workers", 2),
        ("ranks", "ranks (gloo processes)", 2),
    )
    for sweep, xlabel, base in sweeps:
        sub = [dict(r, x=r["extra"]["x"]) for r in rows if r["extra"].get("sweep") == sweep]
        for metric, what in (("write_gbps", "save"), ("read_gbps", "load")):
            if sub:
                path = os.path.join(directory, f"scaling_{sweep}_{what}.png")
                plots.sweep_plot(path, sub, "x", f"{what} GB/s vs {xlabel}", metric=metric, xlabel=xlabel, base=base)
                print(f"wrote {path}")
    per_save = [dict(r, x=r["repeat"] + 1) for r in records if r.get("extra", {}).get("sweep") == "repeat"]
    if per_save:
        for metric, name, title in (
            ("write_s", "scaling_repeat.png", "seconds until durable, per save"),
            ("blocked_s", "scaling_repeat_blocked.png", "seconds the caller was blocked, per save"),
        ):
            path = os.path.join(directory, name)
            plots.sweep_plot(
                path,
                per_save,
                "x",
                f"same structure saved again: {title}",
                logx=False,
                metric=metric,
                xlabel="save # (same structure)",
            )
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
