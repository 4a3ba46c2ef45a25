"""Checksum speed on 256 MiB: the crc32c library dcpstore uses against zlib.crc32.

    python benchmarks/checksum.py

Prints GiB/s for each (best of 3) and the ratio.
"""

from __future__ import annotations

import os
import time
import zlib

import crc32c


def best_gibps(fn, data: memoryview, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 2**30


def main() -> None:
    data = memoryview(os.urandom(256 << 20))
    ours = best_gibps(crc32c.crc32c, data)
    base = best_gibps(zlib.crc32, data)
    print(f"crc32c (hardware: {crc32c.hardware_based}): {ours:6.2f} GiB/s")
    print(f"zlib.crc32:                   {base:6.2f} GiB/s")
    print(f"ratio: {ours / base:.1f}x")


if __name__ == "__main__":
    main()
