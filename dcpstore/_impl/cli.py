"""``dcpstore`` command line: ls, inspect, verify, gc, bench.

Exit codes: 0 success; 1 the checkpoint is damaged (verify) or absent (a
missing root for ``ls``), or a benchmark run failed (wrong data loaded, an
error); 2 bad usage or a storage error, or a benchmark that could measure
nothing here (every run skipped). Errors print one line, never a traceback,
and never a credential (:func:`dcpstore._impl.storage.secrets.scrub`). No command
executes checkpoint content: ``inspect`` and ``verify`` unpickle through
dcpstore's allowlists only, ``ls`` and ``gc`` never read what a checkpoint
holds.

``--help``, ``ls`` and ``gc`` never import torch (seconds): they use
:mod:`dcpstore._impl.tools.listing` only. ``inspect``, ``verify`` and ``bench`` import
their modules (and with them torch) when they run (:func:`_needs_torch`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tqdm import tqdm

from dcpstore._impl.storage import Storage, open_storage
from dcpstore._impl.storage.overlap import Role, check_roles
from dcpstore._impl.storage.secrets import scrub
from dcpstore._impl.tools.listing import TierRow, list_checkpoints, list_tiers
from dcpstore._impl.tools.listing import gc as collect
from dcpstore._impl.util.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    InvalidArgument,
    UnsafeCheckpoint,
)
from dcpstore._impl.util.units import check_seconds, human_bytes, parse_size

#: What ``FILES`` counts in ``ls``, and what ``inspect`` lists.
LS_FILES = "FILES counts every file of a checkpoint: data files, .metadata, the manifest and markers"
INSPECT_FILES = "data files only (besides them: .metadata and the .dcpstore.json manifest)"


def _needs_torch(module: str) -> ModuleType:
    """``dcpstore.<module>``, imported by the command that uses it: these
    import torch, which ``--help``, ``ls`` and ``gc`` must not wait for."""
    return importlib.import_module(f"{__package__}.{module}")


def _open(args: argparse.Namespace) -> Storage:
    return open_storage(args.uri, enable_msc=args.enable_msc)


def _name(storage: Storage, path: str) -> str:
    """A checkpoint found under the command's root, as printed: its path
    relative to the root, or the URI when it is the root itself."""
    return path if path not in ("", ".") else storage.uri


def _is_empty(storage: Storage) -> bool:
    return next(iter(storage.list()), None) is None


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _open(args)
    # With --local-dir (a tiered manager's local tier): each entry with the tier it lives in.
    local = open_storage(args.local_dir) if args.local_dir else None
    if local is not None:  # one directory in two roles would list each step as "both"
        check_roles(
            [Role("--local-dir", local, exclusive=True, given=args.local_dir), Role("URI", storage, given=args.uri)]
        )
    if local is None:
        rows = [TierRow(e, storage, "durable") for e in list_checkpoints(storage)]
    else:
        rows = list_tiers(storage, local)
    roots = storage.uri + (f" or {local.uri}" if local is not None else "")
    if not rows and _is_empty(storage) and (local is None or _is_empty(local)):
        print(f"dcpstore ls: nothing at {roots} (no such directory or prefix, or it is empty)", file=sys.stderr)
        return 1
    if args.json:
        records = [dict(r.entry.__dict__, **({"where": r.where} if local is not None else {})) for r in rows]
        print(json.dumps(records, indent=2, default=str))
        return 0
    if not rows:
        print(f"no checkpoints under {roots} (it holds files, none of them a checkpoint's)")
        return 0
    width = max(len("CHECKPOINT"), *(len(r.entry.path or ".") for r in rows))
    where = f"  {'WHERE':<7}" if local is not None else ""
    print(f"{'CHECKPOINT':<{width}}  {'STATUS':<10}{where}  {'FILES':>5}  {'SIZE':>10}")
    for r in rows:
        e = r.entry
        status = "committed" if e.committed else "saving" if e.running(r.storage) else "incomplete"
        note = "  (rank-local metadata)" if e.rank_local else ""
        if e.unknown and not e.committed:
            note = f"  (also holds {len(e.unknown)} file(s) no DCP save writes: gc leaves it alone)"
        where = f"  {r.where:<7}" if local is not None else ""
        print(f"{e.path or '.':<{width}}  {status:<10}{where}  {e.files:>5}  {human_bytes(e.bytes):>10}{note}")
    print(f"under {roots}; {LS_FILES}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    info = _needs_torch("tools.maintenance").inspect_checkpoint(_open(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint  {info['uri']}")
    print(
        f"checksums   {'crc32c manifest' if info['verified_format'] else 'none (written by stock DCP, or its manifest is gone)'}"
    )
    print(
        f"tensors     {human_bytes(info['tensor_bytes'])} in {sum(k['kind'] == 'tensor' for k in info['keys'].values())} keys"
    )
    print(f"files       {len(info['files'])} totalling {human_bytes(info['file_bytes'])}: {INSPECT_FILES}\n")
    width = max(3, *(len(k) for k in info["keys"]))
    print(f"{'KEY':<{width}}  {'DTYPE':<10}  {'SHAPE':<20}  {'BYTES':>10}")
    for key, k in info["keys"].items():
        if k["kind"] == "tensor":
            print(f"{key:<{width}}  {k['dtype']:<10}  {str(tuple(k['shape'])):<20}  {human_bytes(k['bytes']):>10}")
        else:
            print(f"{key:<{width}}  {'object':<10}  {'':<20}  {'':>10}")
    print()
    for name, f in info["files"].items():
        crc = f" crc32c={f['crc32c']:08x}" if "crc32c" in f else ""
        print(f"  {name}  {human_bytes(f['size'])}{crc}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    maintenance = _needs_torch("tools.maintenance")
    storage = _open(args)
    try:
        total: int | None = sum(f["size"] for f in maintenance.inspect_checkpoint(storage)["files"].values())
    except (CheckpointCorrupt, UnsafeCheckpoint):
        total = None  # verify names the problem below
    t0 = time.perf_counter()
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet or None, file=sys.stderr
    ) as bar:
        report = maintenance.verify_checkpoint(storage, progress=bar.update)
    elapsed = time.perf_counter() - t0
    for problem in report.problems:
        print(f"DAMAGED  {scrub(problem)}")
    for refusal in report.refused:
        print(f"REFUSED  {scrub(refusal)}")
    if report.ok:
        what = "verified" if report.checksums else "checked"
        print(f"OK  {report.files_checked} files, {human_bytes(report.bytes_checked)} {what} in {elapsed:.2f} s")
        if not report.checksums:
            print(
                "no checksums (written by stock DCP, or its integrity manifest is gone): every data file is "
                "there, every item lies inside "
                "its file and decodes to the dtype and shape .metadata declares; whether the bytes are "
                "the ones saved cannot be checked"
            )
        return 0
    print(f"FAILED  {len(report.problems) + len(report.refused)} problem(s) in {storage.uri}")
    return 1


def cmd_gc(args: argparse.Namespace) -> int:
    storage = _open(args)
    report = collect(storage, older_than_s=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in report.removed:
        print(f"{verb} incomplete checkpoint {_name(storage, path)}")
    for path in report.kept_running:
        print(f"kept {_name(storage, path)}: a save is running there (its alive file is fresh, or it just ended)")
    for path in report.kept_recent:
        print(f"kept {_name(storage, path)}: modified within {args.older_than:g} s (a save may be running)")
    for path, names in report.kept_unknown:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        print(
            f"kept {_name(storage, path)}: holds files no DCP save writes ({shown}); remove it by hand if it is garbage"
        )
    if report.incomplete_uploads:
        print(f"{verb} {report.incomplete_uploads} in-progress upload(s)/temporary file(s)")
    if not (
        report.removed or report.kept_recent or report.kept_running or report.kept_unknown or report.incomplete_uploads
    ):
        print("nothing to clean up")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    bench, report = _needs_torch("bench"), _needs_torch("bench.report")
    if args.interference:
        return _bench_interference(args, bench, report)
    size, workers = parse_size(args.size), bench.parse_int_list(args.workers)
    mode = "async/" + args.engine if args.async_ or args.tiered else "sync"
    if args.tiered:
        mode += f", tiered through {args.tiered}"
    print(
        f"dcpstore bench {args.uri}: {human_bytes(size)} in {args.tensors} tensors, workers {workers}, "
        f"{mode}, {args.repeat} repeat(s)",
        flush=True,
    )
    records = bench.bench(
        args.uri,
        size=size,
        tensors=args.tensors,
        workers=workers,
        engine=args.engine,
        async_=args.async_,
        repeat=args.repeat,
        enable_msc=args.enable_msc,
        drop_caches=args.drop_caches,
        progress=not args.quiet,
        tiered=args.tiered,
        limit=args.limit,
    )
    rows = bench.summarize(records)
    print(report.format_table(rows))
    for line in report.tiered_lines(rows):
        print(line)
    if note := report.cache_note(records, args.drop_caches):
        print(note)
    if args.json:
        report.write_json(args.json, records, {"command": "dcpstore bench", "uri": args.uri, "size": size})
        print(f"wrote {args.json}")
    if args.plot:
        report.plot_workers(args.plot, rows, f"dcpstore bench {args.uri} ({human_bytes(size)}, {args.tensors} tensors)")
        print(f"wrote {args.plot}")
    if any(r.status == "failed" for r in records):
        return 1
    return 0 if any(r.status == "ok" for r in records) else 2


def _bench_interference(args: argparse.Namespace, bench: Any, report: Any) -> int:
    """``dcpstore bench URI --interference``: one async save per engine beside a training step."""
    engines = {} if args.engine == "auto" else {"engines": (args.engine,)}  # auto: every engine, and the default
    text, results = bench.interference(
        args.uri,
        size=parse_size(args.size),
        tensors=args.tensors,
        repeat=args.repeat,
        **engines,
        enable_msc=args.enable_msc,
        progress=not args.quiet,
    )
    interference = _needs_torch("bench.interference")
    print(text)
    print(interference.text_table(results))
    if args.json:
        with open(args.json, "w") as f:
            meta = {
                "command": "dcpstore bench --interference",
                "uri": args.uri,
                "describe": text,
                "git_commit": report.git_commit(),
                "machine": report.machine(),
            }
            json.dump({"meta": meta, "results": [r.to_json() for r in results]}, f, indent=1)
        print(f"wrote {args.json}")
    if any(r.status == "failed" for r in results):
        return 1
    return 0 if any(r.status == "ok" for r in results) else 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        return check_seconds("", float(text), zero=True, infinite=True)
    except (ValueError, InvalidArgument):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcpstore", description="Inspect and maintain DCP checkpoints on any backend."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("uri", help="checkpoint URI or path (local path, file://, s3://, msc://, fsspec URL)")
        p.add_argument("--enable-msc", action="store_true", help="route s3:// and local paths through MSC")
        p.set_defaults(fn=fn)
        return p

    p = add(
        "ls",
        cmd_ls,
        "list checkpoints (committed and incomplete) under a root; FILES counts every file of "
        "each (data, .metadata, manifest, markers); exit 1 if the root is missing or empty",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--local-dir",
        metavar="PATH",
        help="a tiered manager's local tier: show where each step lives (local, durable, both)",
    )
    add("inspect", cmd_inspect, "show keys, shapes, dtypes, bytes and data files of a checkpoint").add_argument(
        "--json", action="store_true"
    )
    p = add(
        "verify",
        cmd_verify,
        "read every data file and check its size and checksums (a stock DCP "
        "checkpoint has none: its sizes, and that every item decodes)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p = add("gc", cmd_gc, "remove leftovers of interrupted saves (never a committed checkpoint)")
    p.add_argument(
        "--older-than",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="keep leftovers modified more recently than this (default 300)",
    )
    p.add_argument("--dry-run", action="store_true")
    p = add("bench", cmd_bench, "benchmark save and load at a URI (writes under it, then removes what it wrote)")
    p.add_argument("--size", default="256MiB", help="total tensor bytes, e.g. 64MiB, 1GiB (default 256MiB)")
    p.add_argument(
        "--tensors",
        type=_positive_int,
        default=32,
        metavar="N",
        help="split the bytes into N float32 tensors (default 32)",
    )
    p.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts to try (default 1,2,4,8)")
    p.add_argument(
        "--engine",
        default="auto",  # checked by save() against dcpstore._impl.values.options.ENGINES (torch-free here)
        help="async engine (with --async): dcpstore.save's engine=, e.g. native, nvrx, process",
    )
    p.add_argument(
        "--async", dest="async_", action="store_true", help="save with async_=True; reports the blocked time"
    )
    p.add_argument("--repeat", type=_positive_int, default=1, help="saves per worker count (default 1)")
    p.add_argument(
        "--tiered",
        metavar="LOCAL_DIR",
        help="compare a tiered manager (commit to LOCAL_DIR, replicate to URI) with plain async saves "
        "to LOCAL_DIR and to URI",
    )
    p.add_argument(
        "--limit",
        action="store_true",
        help="also measure the storage's limit with the plainest code (a local path: raw threads per "
        "worker count; s3://: raw boto3 over 1-32 connections and 8-64 MiB parts) and show every "
        "row's save and load speed over the best limit",
    )
    p.add_argument(
        "--interference",
        action="store_true",
        help="instead: what one async save per engine (native, nvrx, process, and auto: the default, on the "
        "engine it chooses; --engine picks one) costs a "
        "training step of fixed work running beside it: lost step-seconds, peak step inflation, "
        "CPU and (with py-spy installed) GIL seconds per GB of the save's threads",
    )
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON records")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s against workers")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each local load, so that loads read the disk (needs root; "
        "it empties the whole host's cache). Off by default: loads may then read memory",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CheckpointNotFound as e:
        print(f"dcpstore {args.command}: {scrub(str(e))}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"dcpstore {args.command}: {scrub(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug or an unforeseen input: still one line, still scrubbed
        print(f"dcpstore {args.command}: unexpected {type(e).__name__}: {scrub(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
