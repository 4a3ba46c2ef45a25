"""How long does an async save block the training loop?

Measures, in one run and on the same state dict:

* ``clone``: ``{k: v.clone()}``, the cheapest honest snapshot a trainer could
  take itself (the reference: ratio 1.0);
* ``dcpstore-native`` / ``dcpstore-nvrx``: the time ``AsyncSaver.save``
  (what ``dcpstore.save(async_=True)`` runs) blocks before returning;
* ``dcp.async_save``: the time ``torch.distributed.checkpoint.async_save``
  blocks (its default stager, a thread executor, ``FileSystemWriter``).

Each save is waited for before the next one starts (only the blocking part is
timed); the kinds take turns, so load from other processes hits all alike.
The first save of each kind allocates its staging memory and is reported
apart ("first"); the steady state, what a training loop that checkpoints
every N steps sees, is the median and the best of the rest, in wall time and
in process CPU time (steadier on a shared machine). With a GPU
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


def make_state(size_mib: int, device: str, tensor_mib: int = 8) -> dict[str, Any]:
    """A model-like state dict: mostly ``tensor_mib`` MiB fp32 matrices, every
    fourth one bf16 (same bytes), a small vector beside each, and a few
    plain values."""
    state: dict[str, Any] = {"step": 100, "lr": 1e-4}
    elems = tensor_mib * 1024 * 1024 // 4  # tensor_mib MiB of fp32
    n_big = max(1, size_mib // tensor_mib)
    for i in range(n_big):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        numel = elems if dtype == torch.float32 else 2 * elems
        state[f"layer{i}.weight"] = torch.randn(numel // 1024, 1024, device=device).to(dtype)
        state[f"layer{i}.bias"] = torch.randn(1024, device=device)
    return state


class _Timer:
    """Wall time and process CPU time (all threads) of one blocking call. CPU
    seconds are steadier than wall time on a shared, loaded machine."""

    def __enter__(self) -> _Timer:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Reference:
    """clone() on CPU; on a GPU, a non-blocking D2H copy into fresh pinned
    memory plus one synchronize (what NVRx's preload does)."""

    def __init__(self, state: dict[str, Any], device: str) -> None:
        self.state, self.device = state, device

    def once(self, i: int) -> _Timer:
        _sync(self.device)
        with _Timer() as t:
            if self.device == "cuda":
                copy = {
                    k: v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in self.state.items()
                }
                torch.cuda.synchronize()
            else:
                copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.state.items()}
        del copy
        return t

    def close(self) -> None:
        pass


class Dcpstore:
    """The blocking part of ``AsyncSaver.save``; the save is then waited for."""

    def __init__(self, state: dict[str, Any], root: str, engine: str, workers: int, device: str) -> None:
        self.state, self.root, self.engine, self.workers, self.device = state, root, engine, workers, device
        self.saver = dcpstore.AsyncSaver()

    def once(self, i: int) -> _Timer:
        _sync(self.device)
        uri = os.path.join(self.root, f"{self.engine}-{i % 2}")
        with _Timer() as t:
            handle = self.saver.save(
                self.state, uri, options=dcpstore.SaveOptions(engine=self.engine, workers=self.workers)
            )
        handle.result()
        return t

    def close(self) -> None:
        self.saver.close()


class DcpAsync:
    """The blocking part of ``torch.distributed.checkpoint.async_save``."""

    def __init__(self, state: dict[str, Any], root: str, workers: int, device: str) -> None:
        self.state, self.root, self.workers, self.device = state, root, workers, device

    def once(self, i: int) -> _Timer:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(os.path.join(self.root, f"dcp-{i % 2}"), thread_count=self.workers)
        _sync(self.device)
        with _Timer() as t:
            future = dcp.async_save(self.state, storage_writer=writer)
        future.result()
        return t

    def close(self) -> None:
        pass


def summarise(name: str, timers: list[_Timer], ref: dict[str, Any] | None) -> dict[str, Any]:
    """First call apart; steady state = median (and best) of the others."""
    rest = timers[1:] or timers
    row: dict[str, Any] = {
        "name": name,
        "first_s": timers[0].wall,
        "steady_s": statistics.median(t.wall for t in rest),
        "best_s": min(t.wall for t in rest),
        "steady_cpu_s": statistics.median(t.cpu for t in rest),
        "wall_s": [t.wall for t in timers],
        "cpu_s": [t.cpu for t in timers],
    }
    ref = ref or row
    row["ratio"] = row["steady_s"] / ref["steady_s"]
    row["best_ratio"] = row["best_s"] / ref["best_s"]
    row["cpu_ratio"] = row["steady_cpu_s"] / ref["steady_cpu_s"]
    row["first_ratio"] = row["first_s"] / ref["first_s"]
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
        timers: dict[str, list[_Timer]] = {name: [] for name, _ in kinds}
        for i in range(args.reps):
            for name, kind in kinds:
                timers[name].append(kind.once(i))
        for _, kind in kinds:
            kind.close()
        rows: list[dict[str, Any]] = []
        for name, _ in kinds:
            rows.append(summarise(name, timers[name], rows[0] if rows else None))
        print(f"state: {nbytes / 2**20:.0f} MiB on {args.device}, {args.reps} saves each, torch {torch.__version__}")
        print("blocked time; x ref = ratio to the reference (target for dcpstore: <= 1.00)")
        print(
            f"{'':28} {'first':>8} {'x ref':>6} {'median':>8} {'x ref':>6} {'best':>8} {'x ref':>6} {'cpu med':>8} {'x ref':>6}"
        )
        for r in rows:
            print(
                f"{r['name']:28} {r['first_s'] * 1e3:6.0f}ms {r['first_ratio']:5.2f}x {r['steady_s'] * 1e3:6.0f}ms "
                f"{r['ratio']:5.2f}x {r['best_s'] * 1e3:6.0f}ms {r['best_ratio']:5.2f}x "
                f"{r['steady_cpu_s'] * 1e3:6.0f}ms {r['cpu_ratio']:5.2f}x"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "device": args.device, "reps": args.reps, "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
