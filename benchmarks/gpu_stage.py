"""CUDA staging against the pinned device-to-host copy limit, and async-save
blocked time against ``dcp.async_save``, on one GPU, in one run.

1. Staging (``--sizes-gib``, default 1,2,4,8,16). ``Stager.stage`` -- what
   every dcpstore async save runs on the caller's thread -- on a model-like
   state in GPU memory (``--tensor-mib`` matrices, fp32 and bf16, a small
   vector beside each), in steady state: its pinned buffers pooled, as in a
   training loop that checkpoints every N steps (the first call, which pins
   fresh memory, is reported apart). The limit is the best time to copy the
   same number of bytes into *preallocated* pinned memory with
   ``copy_(non_blocking=True)`` and a wait, swept over how the copy is cut
   (the state's own tensors, or one flat buffer in 16, 64 or 256 MiB chunks
   or whole) and over 1, 2 or 4 streams; the best configuration is the
   hardware's limit for this machine. Goal: staging bandwidth >= 0.8x the
   limit at every size.

2. Blocked time (``--save-sizes-gib``, default 1,4). How long
   ``AsyncSaver.save`` blocks the caller (native engine; ``--engines``) against
   ``dcp.async_save`` with its default stager (``FileSystemWriter``: pageable
   memory, allocated per save), with ``FileSystemWriter(
   cache_staged_state_dict=True)`` (pinned, reused) and, where this torch has
   it, ``DefaultStager`` with pinned memory and non-blocking copies. Each save
   is waited for before the next, and its files deleted. Goal: dcpstore's
   steady-state blocked time <= the best of the ``dcp.async_save`` variants.

Also recorded, with no goal: the pinned host memory staging holds per byte
of state when tensor sizes are not powers of two (torch's pinned allocator
rounds every block up to one).

Sizes run in increasing order and stop when ``--budget-s`` would be
exceeded (recorded as skipped). Memory at the default sizes: GPU about 2x the
largest size; host about 2x the largest staging size pinned, plus the save
phase's copies; the checkpoints go to ``--dir`` (default: /dev/shm when it has
room, else a temporary directory).

    python benchmarks/gpu_stage.py [--sizes-gib 1,2,4,8,16] [--save-sizes-gib 1,4] \
        [--json out.json] [--budget-s 200]
    python benchmarks/gpu_stage.py --dry-run     # tiny sizes on the CPU: plumbing only

``--dry-run`` measures nothing meaningful: it runs every step on CPU tensors
of a few MiB so that the script, its JSON and the summary can be checked
where there is no GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from async_stall import DcpAsync, Dcpstore, _Timer, make_state  # a sibling: run as benchmarks/gpu_stage.py

from dcpstore._impl.engines.staging import Stager, StagingPool

MiB = 1 << 20
GiB = 1 << 30
STAGING_GOAL = 0.8  # staging bandwidth / pinned-copy limit, at least
BLOCKED_GOAL = 1.0  # dcpstore blocked time / best dcp.async_save variant, at most


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    """Seconds from issuing ``fn`` to its data being on the host (``fn``
    waits itself; the sync before keeps earlier work out)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the limit: preallocated pinned memory, swept -----------------------------


class PinnedCopyLimit:
    """Device-to-host copies into preallocated (on a GPU: pinned) memory.

    ``main`` takes the large tensors and the flat copies, ``tail`` the small
    vectors: two buffers, so that neither is rounded up much by torch's
    pinned allocator (power-of-two blocks). Layouts: the state's own tensors
    one by one, or one flat device buffer of the large tensors' bytes in
    chunks; each over 1, 2 or 4 streams (round robin), waiting for all.
    """

    def __init__(self, main: torch.Tensor, tail: torch.Tensor, flat_src: torch.Tensor, device: str) -> None:
        self.main, self.tail, self.flat_src, self.device = main, tail, flat_src, device
        self.streams = {n: [torch.cuda.Stream() for _ in range(n)] for n in (1, 2, 4)} if device == "cuda" else {}

    def _run(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], n_streams: int) -> None:
        if self.device != "cuda":
            for d, s in pairs:
                d.copy_(s)
            return
        streams = self.streams[n_streams]
        current = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(current)
        for i, (d, s) in enumerate(pairs):
            with torch.cuda.stream(streams[i % n_streams]):
                d.copy_(s, non_blocking=True)
        for s in streams:
            s.synchronize()

    def per_tensor(self, srcs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs, offsets = [], {"main": 0, "tail": 0}
        for t in srcs:
            where = "main" if t.nbytes >= MiB else "tail"
            buf, off = getattr(self, where), offsets[where]
            pairs.append((buf[off : off + t.nbytes].view(t.dtype).view(t.shape), t))
            offsets[where] = off + t.nbytes
        return pairs

    def chunks(self, nbytes: int, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        starts = range(0, nbytes, chunk)
        return [(self.main[a : min(a + chunk, nbytes)], self.flat_src[a : min(a + chunk, nbytes)]) for a in starts]

    def sweep(self, srcs: list[torch.Tensor], reps: int) -> list[dict[str, Any]]:
        """Every layout x stream count: bytes, median and best seconds, GB/s."""
        flat = sum(t.nbytes for t in srcs if t.nbytes >= MiB)
        layouts: list[tuple[str, int, list[tuple[torch.Tensor, torch.Tensor]]]] = [
            ("per tensor", sum(t.nbytes for t in srcs), self.per_tensor(srcs))
        ]
        for chunk_mib in (16, 64, 256):
            if chunk_mib * MiB < flat:
                layouts.append((f"{chunk_mib} MiB chunks", flat, self.chunks(flat, chunk_mib * MiB)))
        layouts.append(("one copy", flat, self.chunks(flat, flat)))
        rows = []
        for name, nbytes, pairs in layouts:
            for n in sorted(self.streams) or [1]:
                if n > len(pairs):
                    continue
                self._run(pairs, n)  # warm-up
                times = [timed(lambda: self._run(pairs, n), self.device) for _ in range(reps)]  # noqa: B023 (called here)
                median = statistics.median(times)
                rows.append(
                    {
                        "layout": name,
                        "streams": n,
                        "bytes": nbytes,
                        "median_s": median,
                        "best_s": min(times),
                        "gbps": nbytes / median / 1e9,
                    }
                )
        return rows


def measure_staging(size_gib: float, args: argparse.Namespace, limit: PinnedCopyLimit) -> dict[str, Any]:
    state = make_state(max(1, int(size_gib * 1024)), args.device, args.tensor_mib)
    srcs = tensors(state)
    nbytes = sum(t.nbytes for t in srcs)
    sweep = limit.sweep(srcs, args.limit_reps)
    best = max(sweep, key=lambda r: r["gbps"])

    stager = Stager(StagingPool(max_structures=1, max_sets=1))
    holder: list[Any] = []

    def stage() -> None:
        holder.append(stager.stage(state))

    first_s = timed(stage, args.device)  # pins fresh memory (or reuses torch's cached blocks)
    _check_staged(holder[-1].state_dict, state)
    holder.pop().release()
    times = []
    for _ in range(args.reps):
        times.append(timed(stage, args.device))
        holder.pop().release()
    again = stager.stage(state)  # pooled buffers hold the new values too
    _check_staged(again.state_dict, state)
    again.release()
    stager.pool.clear()
    n_tensors = len(srcs)
    del state, srcs, holder, again
    gc.collect()

    stage_s = statistics.median(times)
    stage_gbps = nbytes / stage_s / 1e9
    return {
        "size_gib": size_gib,
        "bytes": nbytes,
        "tensors": n_tensors,
        "limit": best,
        "limit_gbps": best["gbps"],
        "sweep": sweep,
        "stage_first_s": first_s,
        "stage_s": stage_s,
        "stage_best_s": min(times),
        "stage_gbps": stage_gbps,
        "ratio": stage_gbps / best["gbps"],
    }


def pinned_overhead(device: str) -> dict[str, Any] | None:
    """Pinned host bytes that staging holds per byte of state, for tensor
    sizes that are not powers of two (torch's pinned allocator rounds every
    block up to one). Informational; None without CUDA's host statistics."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    empty = getattr(torch._C, "_host_emptyCache", None)
    if device != "cuda" or stats is None or empty is None:
        return None
    empty()
    before = stats().get("allocated_bytes.current", 0)
    state = {f"w{i}": torch.randn(40 * MiB // 4, device="cuda") for i in range(8)}
    state.update({f"h{i}": torch.randn(24 * MiB // 2, device="cuda").to(torch.bfloat16) for i in range(8)})
    staged = Stager(StagingPool()).stage(state)
    held = stats().get("allocated_bytes.current", 0) - before
    nbytes = sum(t.nbytes for t in state.values())
    staged.release()
    del staged, state
    gc.collect()
    empty()
    return {"state_bytes": nbytes, "pinned_bytes": held, "ratio": held / nbytes, "tensor_mib": [40, 24]}


def _check_staged(staged: dict[str, Any], state: dict[str, Any]) -> None:
    """Correct first: the staged copy holds the state's values (first and
    last tensors, compared on the host)."""
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    for k in (keys[0], keys[-1]):
        if not torch.equal(staged[k], state[k].cpu()):
            raise AssertionError(f"staged {k} differs from the state")


# -- blocked time against dcp.async_save ----------------------------------------


class DcpAsyncCached(DcpAsync):
    """``dcp.async_save`` with ``FileSystemWriter(cache_staged_state_dict=True)``:
    pinned staging memory, reused by the one writer across saves."""

    def __init__(self, state: dict[str, Any], root: str, workers: int, device: str) -> None:
        import torch.distributed.checkpoint as dcp

        super().__init__(state, root, workers, device)
        self.writer = dcp.FileSystemWriter(
            os.path.join(root, "dcp-cached"), thread_count=workers, cache_staged_state_dict=True
        )

    def once(self, i: int) -> _Timer:
        import torch.distributed.checkpoint as dcp

        sync(self.device)
        with _Timer() as t:
            future = dcp.async_save(
                self.state, checkpoint_id=os.path.join(self.root, f"dcp-cached-{i}"), storage_writer=self.writer
            )
        future.result()
        return t


class DcpAsyncDefaultStager(DcpAsync):
    """``dcp.async_save`` with ``DefaultStager``: pinned memory, non-blocking
    copies, staged synchronously (so the state may change on return)."""

    def __init__(self, state: dict[str, Any], root: str, workers: int, device: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().__init__(state, root, workers, device)
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
            )
        )

    def once(self, i: int) -> _Timer:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(os.path.join(self.root, f"dcp-stager-{i}"), thread_count=self.workers)
        sync(self.device)
        with _Timer() as t:
            result = dcp.async_save(self.state, storage_writer=writer, async_stager=self.stager)
        getattr(result, "upload_completion", result).result()
        return t

    def close(self) -> None:
        self.stager.close()


def measure_blocked(size_gib: float, args: argparse.Namespace, root: str) -> dict[str, Any]:
    state = make_state(max(1, int(size_gib * 1024)), args.device, args.tensor_mib)
    nbytes = sum(t.nbytes for t in tensors(state))
    kinds: list[tuple[str, Callable[[], Any]]] = [
        (f"dcpstore-{e}", lambda e=e: Dcpstore(state, root, e, args.workers, args.device))
        for e in args.engines.split(",")
        if e
    ]
    kinds += [
        ("dcp.async_save", lambda: DcpAsync(state, root, args.workers, args.device)),
        ("dcp.async_save cached pinned", lambda: DcpAsyncCached(state, root, args.workers, args.device)),
        ("dcp.async_save DefaultStager pinned", lambda: DcpAsyncDefaultStager(state, root, args.workers, args.device)),
    ]
    rows: list[dict[str, Any]] = []
    for name, make in kinds:
        try:
            kind = make()
            timers = []
            for i in range(args.save_reps):
                timers.append(kind.once(i))
                _empty(root)
            kind.close()
        except Exception as e:  # a variant this torch lacks, or that fails: recorded, not fatal
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            _empty(root)
            continue
        rest = timers[1:] or timers
        rows.append(
            {
                "name": name,
                "first_s": timers[0].wall,
                "steady_s": statistics.median(t.wall for t in rest),
                "best_s": min(t.wall for t in rest),
                "wall_s": [t.wall for t in timers],
            }
        )
        gc.collect()
    del state
    gc.collect()
    ours = [r for r in rows if r["name"].startswith("dcpstore") and "steady_s" in r]
    peers = [r for r in rows if r["name"].startswith("dcp.") and "steady_s" in r]
    out: dict[str, Any] = {"size_gib": size_gib, "bytes": nbytes, "rows": rows}
    default = next((r for r in peers if r["name"] == "dcp.async_save"), None)
    if ours and peers:
        worst = max(r["steady_s"] for r in ours)
        best_peer = min(peers, key=lambda r: r["steady_s"])
        out["best_dcp"] = best_peer["name"]
        out["ratio_vs_best_dcp"] = worst / best_peer["steady_s"]
        if default is not None:
            out["ratio_vs_dcp_default"] = worst / default["steady_s"]
    return out


def _empty(root: str) -> None:
    for name in os.listdir(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def default_dir(need_bytes: int) -> str | None:
    """/dev/shm when it has room for a few checkpoints (writes then cost
    memory bandwidth, not disk time), else the system's temporary directory."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > 3 * need_bytes else None


# -- driver ------------------------------------------------------------------------


def parse_sizes(text: str) -> list[float]:
    sizes = sorted(float(x) for x in text.split(",") if x.strip())
    if any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=parse_sizes, default=[1, 2, 4, 8, 16], help="staging sizes")
    ap.add_argument("--save-sizes-gib", type=parse_sizes, default=[1, 4], help="blocked-time sizes ('' for none)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="size of the state's large tensors")
    ap.add_argument("--reps", type=int, default=5, help="timed stagings per size (after the first)")
    ap.add_argument("--limit-reps", type=int, default=3, help="timed copies per limit configuration")
    ap.add_argument("--save-reps", type=int, default=4, help="saves per kind (the first one allocates)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--engines", default="native")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm if roomy, else a temp dir)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new sizes past this")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU run: exercises the plumbing, measures nothing")
    args = ap.parse_args(argv)
    if not args.sizes_gib:
        ap.error("--sizes-gib needs at least one size")
    if args.dry_run:
        args.device = "cpu"
        args.sizes_gib = [4 / 1024, 8 / 1024]
        args.save_sizes_gib = [4 / 1024]
        args.tensor_mib, args.reps, args.limit_reps, args.save_reps = 1, 2, 1, 2
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device (use --dry-run to check the plumbing on a CPU)")
        args.device = "cuda"
    return args


def over_sizes(
    phase: str,
    sizes: list[float],
    measure: Callable[[float], dict[str, Any]],
    seconds_left: Callable[[], float],
    result: dict[str, Any],
    lines: Callable[[dict[str, Any]], list[str]],
) -> None:
    """``measure`` each size, smallest first, into ``result[phase]``; skip a
    size (recorded) when the previous one's time, scaled by size, exceeds
    what is left."""
    last: tuple[float, float] | None = None  # (size, seconds) of the previous size
    for size in sizes:
        if seconds_left() <= 0 or (last is not None and last[1] * size / last[0] > seconds_left()):
            result["skipped"].append({"phase": phase, "size_gib": size, "why": "time budget"})
            continue
        t = time.perf_counter()
        row = measure(size)
        last = (size, time.perf_counter() - t)
        row["elapsed_s"] = last[1]
        result[phase].append(row)
        for line in lines(row):
            print(line, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "tensor_mib": args.tensor_mib,
        "staging": [],
        "blocked": [],
        "skipped": [],
    }
    # The limit's buffers, sized for the largest state and shared by every
    # size (pinning memory is slow: once).
    top = max(args.sizes_gib)
    big = max(1, int(top * 1024)) // args.tensor_mib * args.tensor_mib * MiB
    pinned = args.device == "cuda"
    t0 = time.perf_counter()
    main = torch.empty(big, dtype=torch.uint8, pin_memory=pinned)  # pinning faults every page in
    tail = torch.empty(16 * MiB, dtype=torch.uint8, pin_memory=pinned)
    if not pinned:
        main.fill_(1)  # fault every page in before timing
    flat_src = torch.randint(0, 255, (big,), dtype=torch.uint8, device=args.device)
    limit = PinnedCopyLimit(main, tail, flat_src, args.device)
    result["limit_buffers_s"] = time.perf_counter() - t0
    # Staging may use the first half of the budget, blocked time the rest.
    over_sizes(
        "staging",
        args.sizes_gib,
        lambda size: measure_staging(size, args, limit),
        lambda: left() - args.budget_s / 2,
        result,
        lambda row: [_staging_line(row)],
    )
    del limit, main, tail, flat_src
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result["pinned_overhead"] = pinned_overhead(args.device)  # also empties torch's pinned-memory cache

    if args.save_sizes_gib:
        need = int(max(args.save_sizes_gib) * GiB)
        parent = args.dir or default_dir(need)
        root = tempfile.mkdtemp(prefix="gpu-stage-", dir=parent)
        result["save_dir"] = root
        try:
            over_sizes(
                "blocked",
                args.save_sizes_gib,
                lambda size: measure_blocked(size, args, root),
                left,
                result,
                _blocked_lines,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    result["goals"] = goals(result)
    result["elapsed_s"] = time.perf_counter() - t_start
    return result


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The two goals, judged over every size measured (``met`` is None when
    nothing was measured, and on a dry run, which judges nothing)."""
    staging = [r["ratio"] for r in result["staging"]]
    blocked = [r["ratio_vs_best_dcp"] for r in result["blocked"] if "ratio_vs_best_dcp" in r]
    judge = not result["dry_run"]
    return {
        "staging_vs_pinned_copy": {
            "goal": f">= {STAGING_GOAL}",
            "worst": min(staging) if staging else None,
            "met": (min(staging) >= STAGING_GOAL) if staging and judge else None,
        },
        "blocked_vs_dcp_async_save": {
            "goal": f"<= {BLOCKED_GOAL} (against the best dcp.async_save variant)",
            "worst": max(blocked) if blocked else None,
            "met": (max(blocked) <= BLOCKED_GOAL) if blocked and judge else None,
        },
    }


def human(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def _staging_line(r: dict[str, Any]) -> str:
    lim = r["limit"]
    return (
        f"staging {human(r['bytes']):>9}: {r['stage_gbps']:6.2f} GB/s (first {r['stage_first_s']:.2f} s) | "
        f"pinned copy limit {r['limit_gbps']:6.2f} GB/s ({lim['layout']}, {lim['streams']} stream(s)) | "
        f"ratio {r['ratio']:.2f}x (goal >= {STAGING_GOAL})"
    )


def _blocked_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"blocked time, {human(r['bytes'])} state:"]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"  {row['name']:38} not measured: {row['error'][:100]}")
        else:
            lines.append(
                f"  {row['name']:38} first {row['first_s'] * 1e3:8.0f} ms  steady {row['steady_s'] * 1e3:8.0f} ms"
            )
    if "ratio_vs_best_dcp" in r:
        lines.append(f"  dcpstore / best dcp ({r['best_dcp']}): {r['ratio_vs_best_dcp']:.2f}x (goal <= {BLOCKED_GOAL})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's experimental-API and no-process-group warnings, per save
        result = run(args)
    for name, g in result["goals"].items():
        state = (
            ("dry run, not judged" if args.dry_run else "not measured")
            if g["met"] is None
            else ("MET" if g["met"] else "MISSED")
        )
        worst = "-" if g["worst"] is None else f"{g['worst']:.2f}x"
        print(f"goal {name}: {state} (worst {worst}, goal {g['goal']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
