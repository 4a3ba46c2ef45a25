"""dcpstore.save (sync) against dcp.save(FileSystemWriter(thread_count=1)), one run.

    python benchmarks/sync_save.py [--size-mib 512] [--tensors 16] [--workers 4] [--repeat 3] [--root DIR]

Both write the same state dict to the same filesystem; runs alternate so
that page-cache and disk state affect both alike. Prints the median of each
and the ratio (dcp time / dcpstore time: > 1 means dcpstore is faster).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import dcpstore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", default=None)
    args = p.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="dcpstore-bench-")
    numel = args.size_mib * (1 << 20) // 4 // args.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    nbytes = numel * 4 * args.tensors
    runs: dict[str, list[float]] = {
        "dcp FileSystemWriter(thread_count=1)": [],
        f"dcpstore.save(workers={args.workers})": [],
    }
    try:
        for r in range(args.repeat):
            for name in runs:
                path = f"{root}/r{r}-{len(runs[name])}-{'dcp' if name.startswith('dcp ') else 'ds'}"
                t0 = time.perf_counter()
                if name.startswith("dcp "):
                    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1))
                else:
                    dcpstore.save(state, path, workers=args.workers).result()
                runs[name].append(time.perf_counter() - t0)
                shutil.rmtree(path)
        print(f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, median of {args.repeat}:")
        med = {name: statistics.median(ts) for name, ts in runs.items()}
        for name, t in med.items():
            print(f"  {name:<40s} {t:6.2f} s  {nbytes / t / 1e9:5.2f} GB/s")
        base, ours = med.values()
        print(f"  ratio (dcp / dcpstore): {base / ours:.2f}x")
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
