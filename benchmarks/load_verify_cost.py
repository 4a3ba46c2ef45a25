"""What would an all-or-nothing load cost?

dcpstore reads large tensors straight into their destinations and verifies
each item there, so a damaged item is found after it has overwritten its
destination (the error then says which keys changed: see
dcpstore/_impl/dcp/load_progress.py). A load that leaves every destination
untouched unless the whole checkpoint verifies needs one of two things, both
measured here against the in-place load, on the same checkpoint in one run:

* ``in-place``: ``dcpstore.load`` as it is (the reference, ratio 1.0);
* ``verify-first``: a parallel CRC32C pass over every data file against the
  manifest (one thread per file), then ``dcpstore.load``: every byte is read
  twice (on an object store, twice the GETs and the egress);
* ``scratch-copy``: ``dcpstore.load`` into a second, freshly allocated copy
  of the state, then ``copy_`` into the destinations once it succeeded:
  a second copy of the state in memory, and one more pass over it.

Each mode runs in its own process (so peak RSS is its own), ``--reps``
times; the median wall time and the peak RSS above the destination's size
are reported. The page cache is left warm (dropping it would disturb other
work on the machine), which flatters ``verify-first`` on local disks.

    python benchmarks/load_verify_cost.py --size-mib 1024 --tensors 16 [--dir /tmp/x] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

MODES = ("in-place", "verify-first", "scratch-copy")


def _state(size_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    n = (size_mib << 20) // tensors // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def _verify_all(uri: str) -> None:
    """Read every data file once in parallel and check its CRC32C."""
    import crc32c

    import dcpstore
    from dcpstore._impl.dcp.commit import read_checkpoint_metadata

    storage = dcpstore.open_storage(uri)
    _, manifest = read_checkpoint_metadata(storage)
    assert manifest is not None, "needs a dcpstore checkpoint (with a manifest)"
    errors: list[str] = []

    def one(name: str, entry: dict[str, int]) -> None:
        crc, offset, size = 0, 0, entry["size"]
        while offset < size:
            chunk = storage.read_range(name, offset, min(64 << 20, size - offset))
            crc = crc32c.crc32c(chunk, crc)
            offset += len(chunk)
        if crc != entry["crc32c"]:
            errors.append(name)

    threads = [threading.Thread(target=one, args=item) for item in manifest["files"].items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"damaged: {errors}")


def _child(mode: str, uri: str, size_mib: int, tensors: int, reps: int) -> dict[str, Any]:
    import torch

    import dcpstore

    n = (size_mib << 20) // tensors // 4  # as _state, without a second copy raising the RSS high-water mark
    dest = {f"layer{i}.weight": torch.zeros(n) for i in range(tensors)}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if mode == "in-place":
            dcpstore.load(dest, uri)
        elif mode == "verify-first":
            _verify_all(uri)
            dcpstore.load(dest, uri)
        else:
            scratch = {k: torch.empty_like(v) for k, v in dest.items()}
            dcpstore.load(scratch, uri)
            for k, v in scratch.items():
                dest[k].copy_(v)
            del scratch
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    return {
        "mode": mode,
        "times_s": times,
        "median_s": statistics.median(times),
        "extra_rss_mib": (peak - base_rss) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "URI"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.size_mib, args.tensors, args.reps)))
        return

    import dcpstore

    root = tempfile.mkdtemp(dir=args.dir, prefix="dcpstore-loadcost-")
    try:
        uri = os.path.join(root, "ckpt")
        dcpstore.save(_state(args.size_mib, args.tensors), uri).result()
        rows = []
        for mode in MODES:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                mode,
                uri,
                "--size-mib",
                str(args.size_mib),
                "--tensors",
                str(args.tensors),
                "--reps",
                str(args.reps),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = rows[0]["median_s"]
    print(f"{args.size_mib} MiB in {args.tensors} tensors, {args.reps} reps, warm page cache")
    print(f"{'mode':<14}{'median s':>10}{'x in-place':>12}{'extra RSS MiB':>15}")
    for row in rows:
        print(f"{row['mode']:<14}{row['median_s']:>10.3f}{row['median_s'] / ref:>12.2f}{row['extra_rss_mib']:>15.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "size_mib": args.size_mib, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
