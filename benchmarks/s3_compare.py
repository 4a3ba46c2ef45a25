"""S3 save/load, side by side against one local S3 endpoint, in one run.

    python benchmarks/s3_compare.py [--size-mib 256] [--tensors 16] [--workers 4]
                                    [--repeat 3] [--json FILE]

Starts ``moto_server`` on a free loopback port (a separate process, real
HTTP), points the standard AWS environment at it, and saves (then loads) the
same state dict with:

* ``dcpstore native``: ``dcpstore.save(sd, "s3://...")`` (boto3, parallel multipart)
* ``dcpstore via MSC``: the same call with ``enable_msc=True``
* ``MSC MultiStorageFileSystemWriter``: MSC's own DCP writer/reader
  (``multistorageclient.contrib.torch``) on the same ``s3://`` URI
* ``DCP FsspecWriter (s3fs)``: stock DCP's fsspec writer/reader with s3fs

Every contender uses ``--workers`` threads and its library's default part
sizes; runs alternate contender by contender so that endpoint state affects
all alike. Prints, per contender, the median wall seconds and GB/s of save
and load, the client CPU seconds they cost (this process, all threads), and
the ratios to dcpstore native (``x`` > 1: dcpstore native is faster / cheaper).
The endpoint is moto, an in-memory Python server on the same machine: wall
times measure the clients *and* moto (usually the bottleneck); client CPU is
the steadier signal on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import servers
import torch
import torch.distributed.checkpoint as dcp

import dcpstore

BUCKET = "dcpstore-bench"


def _contenders(
    workers: int,
) -> dict[str, tuple[Callable[[dict[str, Any], str], None], Callable[[dict[str, Any], str], None]]]:
    from multistorageclient.contrib.torch import MultiStorageFileSystemReader, MultiStorageFileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    def ds_save(msc: bool) -> Callable[[dict[str, Any], str], None]:
        return lambda sd, uri: dcpstore.save(sd, uri, workers=workers, enable_msc=msc).result() and None

    def ds_load(msc: bool) -> Callable[[dict[str, Any], str], None]:
        return lambda sd, uri: dcpstore.load(sd, uri, workers=workers, enable_msc=msc)

    return {
        "dcpstore native": (ds_save(False), ds_load(False)),
        "dcpstore via MSC": (ds_save(True), ds_load(True)),
        "MSC MultiStorageFileSystemWriter": (
            lambda sd, uri: (
                dcp.save(sd, storage_writer=MultiStorageFileSystemWriter(uri, thread_count=workers), no_dist=True)
                and None
            ),
            lambda sd, uri: dcp.load(
                sd, storage_reader=MultiStorageFileSystemReader(uri, thread_count=workers), no_dist=True
            ),
        ),
        "DCP FsspecWriter (s3fs)": (
            lambda sd, uri: dcp.save(sd, storage_writer=FsspecWriter(uri, thread_count=workers), no_dist=True) and None,
            lambda sd, uri: dcp.load(sd, storage_reader=FsspecReader(uri), no_dist=True),
        ),
    }


def _delete_prefix(client: Any, prefix: str) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def _cpu() -> float:
    """CPU seconds of this process, all threads (the S3 server is another process)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "boto3", "multi-storage-client", "s3fs", "moto")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args()

    with servers.moto_server() as endpoint, servers.env(servers.s3_env(endpoint)):
        client = servers.admin_client(endpoint)
        client.create_bucket(Bucket=BUCKET)
        results = run(args, client)
    report(args, results)


def run(args: argparse.Namespace, client: Any) -> dict[str, dict[str, list[float]]]:
    numel = args.size_mib * (1 << 20) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(numel, generator=g) for i in range(args.tensors)}
    contenders = _contenders(args.workers)
    ops = ("save", "load", "save_cpu", "load_cpu")
    times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in ops} for name in contenders}
    # Warm-up: client creation (boto3 model loading, connection pools, MSC
    # profiles) is a once-per-process cost that would otherwise land on the
    # first timed run of each contender.
    small = {"w": torch.ones(16)}
    for i, (save, load) in enumerate(contenders.values()):
        save(small, f"s3://{BUCKET}/warmup-{i}")
        load({"w": torch.zeros(16)}, f"s3://{BUCKET}/warmup-{i}")
        _delete_prefix(client, f"warmup-{i}/")
    for r in range(args.repeat):
        for i, (name, (save, load)) in enumerate(contenders.items()):
            prefix = f"r{r}-c{i}"
            uri = f"s3://{BUCKET}/{prefix}"
            t0, c0 = time.perf_counter(), _cpu()
            save(state, uri)
            times[name]["save"].append(time.perf_counter() - t0)
            times[name]["save_cpu"].append(_cpu() - c0)
            restored = {k: torch.empty_like(v) for k, v in state.items()}
            t0, c0 = time.perf_counter(), _cpu()
            load(restored, uri)
            times[name]["load"].append(time.perf_counter() - t0)
            times[name]["load_cpu"].append(_cpu() - c0)
            bad = [k for k in state if not torch.equal(state[k], restored[k])]
            if bad:
                raise SystemExit(f"{name}: loaded data differs in {bad[:3]}")
            _delete_prefix(client, prefix + "/")
            print(
                f"  run {r + 1}/{args.repeat} {name}: save {times[name]['save'][-1]:.2f} s, "
                f"load {times[name]['load'][-1]:.2f} s",
                file=sys.stderr,
            )
    return times


def report(args: argparse.Namespace, times: dict[str, dict[str, list[float]]]) -> None:
    nbytes = args.size_mib * (1 << 20) // 4 // args.tensors * 4 * args.tensors
    med = {name: {op: statistics.median(ts) for op, ts in ops.items()} for name, ops in times.items()}
    base = med["dcpstore native"]
    print(
        f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, {args.workers} threads each, "
        f"median of {args.repeat}, local moto S3 endpoint on loopback"
    )
    header = (
        f"{'':34s} {'save s':>7s} {'GB/s':>6s} {'x':>6s} {'cpu s':>6s} {'x':>6s}"
        f"   {'load s':>7s} {'GB/s':>6s} {'x':>6s} {'cpu s':>6s} {'x':>6s}"
    )
    print(header)
    rows = []
    for name, m in med.items():
        row: dict[str, Any] = {"name": name}
        line = f"{name:34s}"
        for op in ("save", "load"):
            row[f"{op}_s"] = m[op]
            row[f"{op}_gbps"] = nbytes / m[op] / 1e9
            row[f"{op}_ratio"] = m[op] / base[op]
            row[f"{op}_cpu_s"] = m[f"{op}_cpu"]
            row[f"{op}_cpu_ratio"] = m[f"{op}_cpu"] / base[f"{op}_cpu"]
            row[f"{op}_runs_s"] = times[name][op]
            line += (
                f" {m[op]:7.2f} {row[f'{op}_gbps']:6.2f} {row[f'{op}_ratio']:5.2f}x"
                f" {m[f'{op}_cpu']:6.2f} {row[f'{op}_cpu_ratio']:5.2f}x  "
            )
        rows.append(row)
        print(line.rstrip())
    print(
        "x = that contender's wall (or client CPU) time / dcpstore native's; > 1: native is faster.\n"
        "cpu s = CPU seconds spent in this (client) process; the moto server is not included."
    )
    if args.json:
        doc = {
            "benchmark": "s3_compare",
            "bytes": nbytes,
            "tensors": args.tensors,
            "workers": args.workers,
            "repeat": args.repeat,
            "endpoint": "moto_server on 127.0.0.1",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "versions": _versions(),
            "results": rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
