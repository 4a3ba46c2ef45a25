"""Checksum speed: each CRC32C library dcpstore can run on, and zlib's CRC-32.

    python benchmarks/checksum.py --json benchmarks/results/checksum.json

Rows, one thread each, best of ``--rounds`` runs:

* ``crc32c``: the ``crc32c`` package, dcpstore's CRC32C without ``awscrt``;
* ``awscrt``: AWS's common runtime (the ``crt`` extra), dcpstore's CRC32C
  where it is installed (``dcpstore/_impl/util/checksum.py``); missing when
  it is not installed here;
* ``zlib.crc32``: the CRC-32 ``torch.save`` computes over every record
  (dcpstore's records skip it), for scale.

Two places the bytes can be: ``in cache`` (one 1 MiB buffer checksummed
over and over: a save's or a load's pass over the piece a write or a read
has just touched) and ``from memory`` (one 256 MiB buffer, far larger than
the caches: a pass over bytes nothing touched just before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import crc32c as crc32c_package

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcpstore._impl.bench.report import result_meta  # noqa: E402

#: Where the bytes are: (buffer size, how many times it is checksummed per run).
PLACES = {"in cache": (1 << 20, 1024), "from memory": (256 << 20, 4)}


def libraries() -> dict[str, Callable[[Any], int]]:
    out: dict[str, Callable[[Any], int]] = {"crc32c": crc32c_package.crc32c}
    try:
        from awscrt import checksums
    except ImportError:
        print("awscrt is not installed: no awscrt row (pip install 'dcpstore[crt]')", file=sys.stderr)
    else:
        out["awscrt"] = checksums.crc32c
    out["zlib.crc32"] = zlib.crc32
    return out


def best_gbps(fn: Callable[[Any], int], data: memoryview, passes: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(passes):
            fn(data)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes * passes / best / 1e9


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    libs = libraries()
    rows: dict[str, dict[str, float]] = {name: {} for name in libs}
    for place, (size, passes) in PLACES.items():
        data = memoryview(os.urandom(size))
        for name, fn in libs.items():
            rows[name][place] = best_gbps(fn, data, passes, args.rounds)
    for name, row in rows.items():
        print(f"{name:12s} " + "  ".join(f"{place} {gbps:6.2f} GB/s" for place, gbps in row.items()))
    if args.json:
        doc = {"meta": result_meta("checksum.py", argv, args.label), "places": PLACES, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
