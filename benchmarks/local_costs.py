"""What a local save and load cost against their yardsticks: the sync save
against stock ``dcp.save``, an async save against a clone, a load against
the raw reader (and the checksum pass its verification needs).

    python benchmarks/local_costs.py [--size-mib 512] [--tensors 16] [--threads 2] \\
        [--rounds 5] [--root DIR] [--source cpu|pinned] [--label TEXT] [--json FILE]

One process, one state dict, one directory; each round runs every row once,
in an order that rotates from round to round so a slow spell of the shared
box lands on all of them alike (the first round warms up and is not
counted). The saves run first, then the loads, which read what that
round's saves wrote (warm, from the page cache). Every row uses the same
thread count ``T``:

* ``raw``: :class:`~dcpstore._impl.bench.limits.RawFiles`, ``T`` threads
  ``os.write`` the tensors' bytes into one file each and ``fsync``: the
  disk's limit for the plainest code.
* ``dcpstore sync``: ``dcpstore.save(state, path, workers=T).result()``.
* ``dcpstore sync direct``: the same with ``storage_options=
  StorageOptions(direct_io=True)``: large tensors' whole pages go to the
  disk with ``O_DIRECT``, past the page cache.
* ``stock dcp.save``: ``dcp.save(state, storage_writer=FileSystemWriter(path,
  thread_count=T))``, the writer dcpstore replaces.
* ``clone``: ``{k: v.clone()}`` of the state: what any consistent snapshot
  must at least cost.
* ``copy into reused``: ``copy_`` of each tensor into buffers allocated
  once: a clone without the page faults of fresh memory, which is what an
  async save's staging does from its second save on (its buffers are
  pooled), so the like-for-like yardstick.
* ``dcpstore async``: ``dcpstore.save(state, path, async_=True,
  workers=T)``, then ``result()``: the whole save, staging and the
  background write, in this process's CPU seconds.
* ``dcpstore async direct``: the same with direct I/O.
* ``raw read``: the raw writer's files read back with ``readinto`` by ``T``
  threads, straight into ``dest``.
* ``dcpstore load``: ``dcpstore.load(dest, path, workers=T)`` of the
  (buffered) sync save's checkpoint, every item's CRC32C verified.
* ``stock dcp.load``: ``dcp.load(dest, storage_reader=FileSystemReader(path))``
  of stock's checkpoint (its reader has no thread count).
* ``raw read cold``, ``dcpstore load cold``: the raw reader and the
  dcpstore load above, their files' pages dropped from the page cache
  first (``posix_fadvise(DONTNEED)``, outside the timed block), so both
  read the disk: how a restarted job loads.
* ``raw read cold, dcpstore's files``: the raw reader's threads
  ``readinto`` the data files of a second buffered dcpstore save (made
  before the round's rows, untimed) whole, into one buffer allocated once,
  their pages dropped first: the first read of dcpstore's files after
  their save, as ``dcpstore load cold`` reads its copy, by the plainest
  reader. Against ``dcpstore load cold`` it separates what the reader
  costs from what the files' layout on this disk costs.
* ``dcpstore load direct``: the direct save's checkpoint, cold too, loaded
  with ``storage_options=StorageOptions(direct_io=True)``: large tensors'
  whole pages read with ``O_DIRECT`` into ``dest`` (through a page-aligned
  bounce buffer where ``dest`` lies elsewhere in a page).
* ``crc32c pass``: dcpstore's CRC32C over every tensor's bytes, on one
  thread: what verifying the checksums costs by itself. It runs on awscrt
  where that is installed (the ``crt`` extra; the result's ``machine``
  says which), and then ``crc32c package pass`` is the same over the
  ``crc32c`` package, the library dcpstore uses without it.

``--keep-files`` keeps every round's checkpoints (and the raw writer's
files) to the end, as a manager keeps its last steps, instead of deleting
them after the round: the page cache then fills with checkpoints as it
does in training, and a buffered write takes fresh pages, where a deleted
file's would do. (The raw writer writes new files each round either way.)

``--source pinned`` keeps the state in pinned host memory, as a GPU's
state is once staged to the host (``scripts/gpu-check.sh`` runs it so).
Every load reads into the same ``dest``, allocated once and zeroed before
each run (outside the timed block, so no load pays page faults of fresh
memory) and compared with the state after it.

Per row: wall seconds and this process's CPU seconds (all threads), medians
and least over the rounds. The goals: ``dcpstore sync`` time <= 0.75x
``stock dcp.save``'s (medians); each sync save's CPU per GB <= 1.15x the
raw writer's, and each async save's <= the clone's + 1.15x the raw
writer's (judged on each row's quietest run, the medians beside it: on
this shared box the CPU a write costs swings with the page cache's
writeback, the raw writer's most of all). The load's CPU per GB <= 1.15x
the raw reader's comes with its yardstick that counts the verification:
the raw reader's plus the CRC32C pass's. The cold loads' CPU per GB <=
1.15x the raw cold read's, and their speed >= 0.9x its.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c as crc32c_package
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcpstore  # noqa: E402
from dcpstore._impl.bench.limits import RawFiles, byte_view  # noqa: E402
from dcpstore._impl.bench.measure import (  # noqa: E402
    Stopwatch,
    make_state,
    state_bytes,
    states_equal,
    zero_state,
    zeros_like_state,
)
from dcpstore._impl.bench.report import result_meta  # noqa: E402
from dcpstore._impl.format.layout import is_data_file  # noqa: E402
from dcpstore._impl.util.checksum import CRC32C_LIBRARY, crc32c  # noqa: E402

SAVES = (
    "raw",
    "dcpstore sync",
    "dcpstore sync direct",
    "stock dcp.save",
    "clone",
    "copy into reused",
    "dcpstore async",
    "dcpstore async direct",
)
#: ``storage_options`` of the rows whose save writes with direct I/O.
DIRECT = dcpstore.StorageOptions(direct_io=True)
#: Rows that checksum the state and read nothing.
CRC_PASSES = ("crc32c pass", *(("crc32c package pass",) if CRC32C_LIBRARY != "crc32c" else ()))
#: Loads that read the disk: their files' pages are dropped from the page
#: cache first (outside the timed block).
#: The raw reader over a second buffered save's files (``_Round.setup``).
TWIN_READ = "raw read cold, dcpstore's files"
COLD = ("raw read cold", "dcpstore load cold", TWIN_READ, "dcpstore load direct")
#: Loads that fill no destination tensor (nothing to zero or check).
NO_DEST = (TWIN_READ, *CRC_PASSES)
LOADS = ("raw read", "dcpstore load", "stock dcp.load", *COLD, *CRC_PASSES)
ROWS = SAVES + LOADS


def _copy_into(dest: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    for key, tensor in state.items():
        dest[key].copy_(tensor)


def _evict(root: str) -> None:
    """Drop the pages of every file under ``root`` from the page cache (they
    are clean: every writer here fsyncs), so that the next read of them
    reads the disk."""
    for where, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_whole(files: list[str], into: memoryview, threads: int) -> None:
    """``threads`` threads ``readinto`` ``files`` whole, one after another
    in ``into``, file ``i`` on thread ``i % threads``."""
    starts = [0]
    for path in files:
        starts.append(starts[-1] + os.path.getsize(path))
    if starts[-1] > into.nbytes:
        raise RuntimeError(f"{starts[-1]} bytes of files do not fit a {into.nbytes}-byte buffer")

    def read(i: int) -> None:
        for k in range(i, len(files), threads):
            with open(files[k], "rb", buffering=0) as f:
                view = into[starts[k] : starts[k + 1]]
                while view:
                    n = f.readinto(view[: 32 << 20])
                    if not n:
                        raise EOFError(f"{files[k]} is short")
                    view = view[n:]

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(read, i) for i in range(threads)]:
            done.result()


def _crc_pass(state: dict[str, torch.Tensor], checksum: Callable[[Any], int]) -> None:
    for tensor in state.values():
        checksum(byte_view(tensor))


class _Round:
    """One round's rows, in ``root``: the saves first (their checkpoints
    stay for the loads), then the loads into ``dest``."""

    def __init__(self, root: str, state: dict[str, torch.Tensor], threads: int, raw: RawFiles) -> None:
        self.state, self.threads, self.raw = state, threads, raw
        self.ours, self.stock = os.path.join(root, "dcpstore"), os.path.join(root, "stock")
        self.direct = os.path.join(root, "direct")
        self.scratch = os.path.join(root, "async")
        self.twin = os.path.join(root, "dcpstore-twin")
        self.twin_files: list[str] = []

    def setup(self) -> int:
        """The second buffered save, which :data:`TWIN_READ` reads;
        returns its data files' size in all."""
        dcpstore.save(self.state, self.twin, workers=self.threads).result()
        names = sorted(n for n in os.listdir(self.twin) if is_data_file(n))
        self.twin_files = [os.path.join(self.twin, n) for n in names]
        return sum(os.path.getsize(p) for p in self.twin_files)

    def action(
        self, name: str, reused: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], twin_buffer: memoryview
    ) -> Callable[[], Any]:
        state, threads = self.state, self.threads
        return {
            "raw": lambda: self.raw.save(state)(),
            "dcpstore sync": lambda: dcpstore.save(state, self.ours, workers=threads).result(),
            "dcpstore sync direct": lambda: dcpstore.save(
                state, self.direct, workers=threads, storage_options=DIRECT
            ).result(),
            "stock dcp.save": lambda: dcp.save(
                state, storage_writer=FileSystemWriter(self.stock, thread_count=threads)
            ),
            "clone": lambda: {k: v.clone() for k, v in state.items()},
            "copy into reused": lambda: _copy_into(reused, state),
            "dcpstore async": lambda: dcpstore.save(state, self.scratch, async_=True, workers=threads).result(),
            "dcpstore async direct": lambda: dcpstore.save(
                state, self.scratch, async_=True, workers=threads, storage_options=DIRECT
            ).result(),
            "raw read": lambda: self.raw.load(dest),
            "raw read cold": lambda: self.raw.load(dest),
            "dcpstore load": lambda: dcpstore.load(dest, self.ours, workers=threads),
            "dcpstore load cold": lambda: dcpstore.load(dest, self.ours, workers=threads),
            TWIN_READ: lambda: _read_whole(self.twin_files, twin_buffer, threads),
            "dcpstore load direct": lambda: dcpstore.load(dest, self.direct, workers=threads, storage_options=DIRECT),
            "stock dcp.load": lambda: dcp.load(dest, storage_reader=FileSystemReader(self.stock)),
            "crc32c pass": lambda: _crc_pass(state, crc32c),
            "crc32c package pass": lambda: _crc_pass(state, crc32c_package.crc32c),
        }[name]

    def run(
        self, name: str, reused: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], twin_buffer: memoryview
    ) -> dict[str, Any]:
        """One run of row ``name``: its wall and CPU seconds (and the engine
        of an async save). A load's destination is zeroed first and checked
        after, both outside the timed block: a wrong result is a failure."""
        act = self.action(name, reused, dest, twin_buffer)
        if name in LOADS and name not in NO_DEST:
            zero_state(dest)
        if name in COLD:
            evict = {"raw read cold": self.raw.root, "dcpstore load cold": self.ours, TWIN_READ: self.twin}
            _evict(evict.get(name, self.direct))
        with Stopwatch() as sw:
            result = act()
        if name in LOADS and name not in NO_DEST and not states_equal(self.state, dest):
            raise RuntimeError(f"{name} read back something other than what was saved")
        if name.startswith("dcpstore async"):
            shutil.rmtree(self.scratch)
            return {"s": sw.s, "cpu_s": sw.cpu_s, "engine": result.engine}
        del result  # a clone is freed outside the timed block, as its owner would later
        return {"s": sw.s, "cpu_s": sw.cpu_s}


def _rotated(rows: tuple[str, ...], r: int) -> tuple[str, ...]:
    return rows[r % len(rows) :] + rows[: r % len(rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="every row's thread count")
    p.add_argument("--rounds", type=int, default=5, help="counted rounds (one more warms up)")
    p.add_argument("--root", default=None, help="a directory on the disk to measure (default: a temporary one)")
    p.add_argument(
        "--source",
        choices=("cpu", "pinned"),
        default="cpu",
        help="where the state lives: pageable host memory, or pinned (a CUDA tensor's host copy; needs CUDA)",
    )
    p.add_argument(
        "--keep-files",
        action="store_true",
        help="keep every round's files to the end, as a manager keeps its last steps: the page cache fills "
        "with checkpoints, and every buffered write takes pages no file just gave back",
    )
    p.add_argument("--label", default="")
    p.add_argument("--json", metavar="FILE")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.size_mib <= 0 or args.tensors <= 0 or args.threads <= 0 or args.rounds <= 0:
        p.error("--size-mib, --tensors, --threads and --rounds must be positive")
    root = tempfile.mkdtemp(prefix="dcpstore-local-costs-", dir=args.root)
    state = make_state(args.size_mib << 20, args.tensors)
    if args.source == "pinned":
        if not torch.cuda.is_available():
            p.error("--source pinned needs CUDA (pinned host memory is a CUDA allocation)")
        state = {k: v.pin_memory() for k, v in state.items()}
    nbytes = state_bytes(state)
    gb = nbytes / 1e9
    # Faulted in once, by the warm-up round: no row pays for fresh memory
    # but the clone, whose point that is.
    reused, dest = zeros_like_state(state), zeros_like_state(state)
    # The twin save's files, read whole: sized by the warm-up round's save.
    twin_buffer = torch.zeros(0, dtype=torch.uint8)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    try:
        for r in range(args.rounds + 1):
            here = os.path.join(root, f"r{r}")
            raw = RawFiles(here, args.threads)  # its own files each round, as every other writer
            raw.setup(state)
            one = _Round(here, state, args.threads, raw)
            twin_bytes = one.setup()
            if twin_bytes > twin_buffer.numel():
                twin_buffer = torch.zeros(twin_bytes, dtype=torch.uint8)  # zeroed: its pages are faulted in
            for name in _rotated(SAVES, r) + _rotated(LOADS, r):
                run = one.run(name, reused, dest, byte_view(twin_buffer))
                if r:
                    runs[name].append(run)
            if not args.keep_files:
                shutil.rmtree(here, ignore_errors=True)
            print(f"  round {r}/{args.rounds}{' (warm-up)' if not r else ''} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = {}
    for name, rs in runs.items():
        cpu_per_gb = [x["cpu_s"] / gb for x in rs]
        gbps = [gb / x["s"] for x in rs]
        rows[name] = {
            "s": [x["s"] for x in rs],
            "cpu_s": [x["cpu_s"] for x in rs],
            "median_s": statistics.median(x["s"] for x in rs),
            "median_gbps": statistics.median(gbps),
            "median_cpu_s_per_gb": statistics.median(cpu_per_gb),
            "least_cpu_s_per_gb": min(cpu_per_gb),
            **({"engine": rs[0]["engine"]} if "engine" in rs[0] else {}),
        }
    goals = verdicts(rows)
    print(f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, {args.threads} thread(s), {args.rounds} rounds:")
    for name, row in rows.items():
        print(
            f"  {name:16s} {row['median_s']:6.3f} s  {row['median_gbps']:5.2f} GB/s  "
            f"CPU-s/GB {row['median_cpu_s_per_gb']:.3f} (least {row['least_cpu_s_per_gb']:.3f})"
        )
    for goal in goals:
        verdict = "" if goal["bound"] is None else f" vs {goal['bound']:.2f}: {'met' if goal['met'] else 'missed'}"
        print(f"  {goal['goal']}: {goal['value']:.2f}{verdict}")
    if args.json:
        doc = {
            "meta": result_meta("local_costs.py", argv, args.label),
            "args": vars(args),
            "bytes": nbytes,
            "rows": rows,
            "goals": goals,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def verdicts(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals, each with its value, bound and whether it is met: the
    sync save's median time over stock ``dcp.save``'s (and the median of
    each round's ratio, the two runs a round apart at most); each sync
    save's CPU per GB over the raw writer's, and each async save's against
    the clone's (and the reused copy's) plus 1.15x the raw writer's, on the
    quietest runs (``least``) and on the medians; the load's CPU per GB
    over the raw reader's; each cold load's CPU per GB and time over the
    raw cold read's. Unjudged (``bound`` None): the sync save's CPU
    per GB over stock's (the time ratio a CPU-bound machine would show,
    where this box's disk swings), each sync save's speed over the raw
    writer's, the load's CPU over the raw reader's plus the CRC32C
    pass's, the load's time over stock ``dcp.load``'s, and the raw cold
    read of dcpstore's files over the raw writer's and under dcpstore's
    cold load (which tells a slow reader from slow files)."""
    ours, stock = rows["dcpstore sync"], rows["stock dcp.save"]
    per_round = statistics.median(a / b for a, b in zip(ours["s"], stock["s"]))
    out: list[dict[str, Any]] = [
        {
            "goal": "sync save time / stock dcp.save's (medians)",
            "value": ours["median_s"] / stock["median_s"],
            "bound": 0.75,
        },
        {"goal": "sync save time / stock dcp.save's (each round's ratio, median)", "value": per_round, "bound": 0.75},
    ]
    for stat in ("least", "median"):
        key = f"{stat}_cpu_s_per_gb"
        out.append(
            {"goal": f"sync save CPU-s/GB / stock dcp.save's ({stat})", "value": ours[key] / stock[key], "bound": None}
        )
    for sync in ("dcpstore sync", "dcpstore sync direct"):
        for stat in ("least", "median"):
            key = f"{stat}_cpu_s_per_gb"
            text = f"{sync[9:]} save CPU-s/GB / raw's ({stat})"
            out.append({"goal": text, "value": rows[sync][key] / rows["raw"][key], "bound": 1.15})
        text = f"{sync[9:]} save speed / raw's (medians)"
        out.append({"goal": text, "value": rows["raw"]["median_s"] / rows[sync]["median_s"], "bound": None})
    for save in ("dcpstore async", "dcpstore async direct"):
        for copy in ("clone", "copy into reused"):
            for stat in ("least", "median"):
                key = f"{stat}_cpu_s_per_gb"
                bound = rows[copy][key] + 1.15 * rows["raw"][key]
                text = f"{save[9:]} save CPU-s/GB ({stat}) <= {copy} + 1.15x raw"
                out.append({"goal": text, "value": rows[save][key], "bound": bound})
    load, read, crc = rows["dcpstore load"], rows["raw read"], rows["crc32c pass"]
    for stat in ("least", "median"):
        key = f"{stat}_cpu_s_per_gb"
        out.append({"goal": f"load CPU-s/GB / raw read's ({stat})", "value": load[key] / read[key], "bound": 1.15})
        out.append(
            {
                "goal": f"load CPU-s/GB / (raw read's + crc32c pass's) ({stat})",
                "value": load[key] / (read[key] + crc[key]),
                "bound": None,
            }
        )
    out.append(
        {
            "goal": "load time / stock dcp.load's (medians)",
            "value": load["median_s"] / rows["stock dcp.load"]["median_s"],
            "bound": None,
        }
    )
    cold = rows["raw read cold"]
    for name in ("dcpstore load cold", "dcpstore load direct"):
        what = name[9:]
        for stat in ("least", "median"):
            key = f"{stat}_cpu_s_per_gb"
            text = f"{what} CPU-s/GB / raw cold read's ({stat})"
            out.append({"goal": text, "value": rows[name][key] / cold[key], "bound": 1.15})
        text = f"{what} time / raw cold read's (medians; speed >= 0.9x)"
        out.append({"goal": text, "value": rows[name]["median_s"] / cold["median_s"], "bound": 1 / 0.9})
    same = rows[TWIN_READ]
    text = "raw cold read time, dcpstore's files / the raw writer's (medians)"
    out.append({"goal": text, "value": same["median_s"] / cold["median_s"], "bound": None})
    text = "load cold time / raw cold read's of dcpstore's files (medians)"
    out.append({"goal": text, "value": rows["dcpstore load cold"]["median_s"] / same["median_s"], "bound": None})
    for goal in out:
        goal["met"] = None if goal["bound"] is None else goal["value"] <= goal["bound"]
    return out


if __name__ == "__main__":
    main()
