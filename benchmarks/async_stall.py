"""How long does an async save block the training loop?

Measures, in one run and on the same state dict:

* ``clone``: ``{k: v.clone()}``, the cheapest honest snapshot a trainer could
  take itself (the reference: ratio 1.0);
* ``dcpstore-native`` / ``dcpstore-nvrx``: the time ``AsyncSaver.save``
  (what ``dcpstore.save(async_=True)`` runs) blocks before returning;
* ``dcp.async_save``: the time ``torch.distributed.checkpoint.async_save``
  blocks (its default stager, a thread executor, ``FileSystemWriter``).

Each save is waited for before the next one starts (only the blocking part is
timed). The first save of each kind allocates its staging memory and is
reported apart ("first"); the steady state is the median of the rest, which
is what a training loop that checkpoints every N steps sees. With a GPU
(``--device cuda``) the state lives on the GPU and the reference is a pinned
device-to-host copy.

    python benchmarks/async_stall.py --size-mib 512 --reps 5 [--dir /tmp/x] [--json out.json]

Target: dcpstore's steady-state blocked time <= 1.0x the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import dcpstore


def make_state(size_mib: int, device: str) -> dict[str, Any]:
    """A model-like state dict: mostly 8 MiB fp32 matrices, some bf16, small
    vectors and a few plain values."""
    state: dict[str, Any] = {"step": 100, "lr": 1e-4}
    elems = 2 * 1024 * 1024  # 8 MiB of fp32
    n_big = max(1, size_mib // 8)
    for i in range(n_big):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        numel = elems if dtype == torch.float32 else 2 * elems
        state[f"layer{i}.weight"] = torch.randn(numel // 1024, 1024, device=device).to(dtype)
        state[f"layer{i}.bias"] = torch.randn(1024, device=device)
    return state


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Reference:
    """clone() on CPU; on a GPU, a non-blocking D2H copy into fresh pinned
    memory plus one synchronize (what NVRx's preload does)."""

    def __init__(self, state: dict[str, Any], device: str) -> None:
        self.state, self.device = state, device

    def once(self, i: int) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        if self.device == "cuda":
            copy = {k: v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in self.state.items()}
            torch.cuda.synchronize()
        else:
            copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.state.items()}
        elapsed = time.perf_counter() - t0
        del copy
        return elapsed

    def close(self) -> None:
        pass


class Dcpstore:
    """The blocking part of ``AsyncSaver.save``; the save is then waited for."""

    def __init__(self, state: dict[str, Any], root: str, engine: str, workers: int, device: str) -> None:
        self.state, self.root, self.engine, self.workers, self.device = state, root, engine, workers, device
        self.saver = dcpstore.AsyncSaver()

    def once(self, i: int) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        handle = self.saver.save(self.state, os.path.join(self.root, f"{self.engine}-{i % 2}"), engine=self.engine, workers=self.workers)
        elapsed = time.perf_counter() - t0
        handle.result()
        return elapsed

    def close(self) -> None:
        self.saver.close()


class DcpAsync:
    """The blocking part of ``torch.distributed.checkpoint.async_save``."""

    def __init__(self, state: dict[str, Any], root: str, workers: int, device: str) -> None:
        self.state, self.root, self.workers, self.device = state, root, workers, device

    def once(self, i: int) -> float:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(os.path.join(self.root, f"dcp-{i % 2}"), thread_count=self.workers)
        _sync(self.device)
        t0 = time.perf_counter()
        future = dcp.async_save(self.state, storage_writer=writer)
        elapsed = time.perf_counter() - t0
        future.result()
        return elapsed

    def close(self) -> None:
        pass


def summarise(name: str, times: list[float], ref_steady: float | None) -> dict[str, Any]:
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    row: dict[str, Any] = {"name": name, "first_s": times[0], "steady_s": steady, "all_s": times}
    if ref_steady:
        row["ratio"] = steady / ref_steady
        row["first_ratio"] = times[0] / ref_steady
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5, help="saves per kind (the first one allocates)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--engines", default="native,nvrx")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    root = tempfile.mkdtemp(prefix="async-stall-", dir=args.dir)
    try:
        state = make_state(args.size_mib, args.device)
        nbytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
        kinds: list[tuple[str, Any]] = [
            (f"reference ({'pinned D2H' if args.device == 'cuda' else 'clone'})", Reference(state, args.device))
        ]
        for engine in [e for e in args.engines.split(",") if e]:
            kinds.append((f"dcpstore-{engine}", Dcpstore(state, root, engine, args.workers, args.device)))
        kinds.append(("dcp.async_save", DcpAsync(state, root, args.workers, args.device)))
        # Round-robin over the kinds, so that load from other processes on
        # the machine hits them all alike.
        times: dict[str, list[float]] = {name: [] for name, _ in kinds}
        for i in range(args.reps):
            for name, kind in kinds:
                times[name].append(kind.once(i))
        for _, kind in kinds:
            kind.close()
        rows: list[dict[str, Any]] = []
        ref = None
        for name, _ in kinds:
            row = summarise(name, times[name], ref)
            ref = ref or row["steady_s"]
            rows.append(row)
        print(f"state: {nbytes / 2**20:.0f} MiB on {args.device}, {args.reps} saves each, torch {torch.__version__}")
        print(f"{'':32} {'first':>9} {'steady':>9} {'x ref':>7}")
        for row in rows:
            ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "1.00x"
            print(f"{row['name']:32} {row['first_s'] * 1e3:7.1f}ms {row['steady_s'] * 1e3:7.1f}ms {ratio:>7}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "device": args.device, "reps": args.reps, "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
