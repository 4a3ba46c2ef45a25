"""What do peer copies (``local_replicas=2``) cost a save, and what do they
save a job that lost a node? Four gloo ranks, two "nodes" of two ranks (a
local directory each), the durable tier on moto behind the emulated WAN
(benchmarks/wanproxy.py).

Per kind and round, in one run, the kinds taking turns:

* ``durable``: ``CheckpointManager(s3://..., local_dir=NODE)``, no copies;
* ``peers``: the same with ``local_replicas=2``: each node's share is also
  committed in the other node's ``local_dir``;
* ``fetch``: as ``peers``, but node 0 loses its copies of node 1's share
  too before the resume: node 1 fetches just its ranks' files from the
  durable tier (the others load their local copies).

A job saves ``--saves`` steps, each waited for (``mgr.wait()``: the local
commit, the peer copies, the durable replica); then node 1's directory is
deleted (a replacement node) and a new job makes the manager and loads the
newest step: **resume s** (the slower rank's construction and load), and
the bytes the WAN proxy's endpoint sent for it (**durable bytes**: with no
copies every rank reads the durable tier; with them, none should). Reported:
the medians over the rounds (saves: over the saves after the first), each
kind's resume against ``durable`` (the reference, 1.0), the save's wait, and
the bytes each step's peer copies hold (all nodes' shares, once each).

    python benchmarks/tiered_peers.py --size-mib 16 --saves 3 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout

from dcpstore._impl.bench.report import result_meta  # noqa: E402

KINDS = {"durable": 1, "peers": 2, "fetch": 2}
WORLD, PER_NODE = 4, 2
BUCKET = "peers-bench"


def _state(numel: int, step: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.full((numel * WORLD // 1024, 1024), float(step))
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def _rank(
    rank: int, port: int, root: str, uri: str, replicas: int, numel: int, saves: int, expect: int, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import dcpstore

    local = f"{root}/node{rank // PER_NODE}"
    result: dict[str, Any] = {}
    if saves:
        waits = []
        with dcpstore.CheckpointManager(uri, local_dir=local, local_replicas=replicas, keep=2, local_keep=2) as mgr:
            for step in range(saves):
                state = _state(numel, step)
                dist.barrier()
                t0 = time.perf_counter()
                mgr.save(state, step)
                mgr.wait()
                waits.append(time.perf_counter() - t0)
        result["wait_s"] = waits
    else:
        state = _state(numel, 0)
        dist.barrier()
        t0 = time.perf_counter()
        with dcpstore.CheckpointManager(uri, local_dir=local, local_replicas=replicas) as mgr:
            assert mgr.load(state) == expect
            result["resume_s"] = time.perf_counter() - t0
        assert bool((state["w"].to_local() == float(expect)).all())
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _job(root: str, uri: str, replicas: int, numel: int, saves: int, expect: int = -1) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(root, "result")
    mp.start_processes(
        _rank, args=(port, root, uri, replicas, numel, saves, expect, out), nprocs=WORLD, start_method="spawn"
    )
    results = []
    for r in range(WORLD):
        with open(f"{out}.{r}") as f:
            results.append(json.load(f))
    return results


def _counted(path: str) -> int:
    time.sleep(0.3)  # the proxy writes its count as the last connection closes
    with open(path) as f:
        return int(f.read())


def _peer_bytes(root: str) -> int:
    total = 0
    for node in range(WORLD // PER_NODE):
        for dirpath, _, files in os.walk(f"{root}/node{node}/peers"):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.endswith(".distcp"))
    return total


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, HERE)
    import servers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=16, help="state per rank, MiB")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--rate-mbps", type=float, default=25.0, help="MB/s per connection")
    ap.add_argument("--total-mbps", type=float, default=50.0, help="MB/s the endpoint sends in all")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    numel = args.size_mib * (1 << 20) // 4
    samples: dict[str, dict[str, list[float]]] = {
        k: {"wait_s": [], "resume_s": [], "fetched": [], "peer": []} for k in KINDS
    }
    with tempfile.TemporaryDirectory() as tmp, servers.env(servers.s3_env("")):
        count = os.path.join(tmp, "count")
        with (
            servers.moto_server() as moto,
            servers.wan_proxy(
                moto, latency_ms=args.latency_ms, rate_mbps=args.rate_mbps, count=count, total_mbps=args.total_mbps
            ) as wan,
        ):
            servers.create_bucket(moto, BUCKET)
            os.environ.update(servers.s3_env(wan))  # type: ignore[arg-type]
            for n in range(args.rounds):
                for kind, replicas in KINDS.items():
                    root = os.path.join(tmp, f"{kind}-{n}")
                    uri = f"s3://{BUCKET}/{kind}-{n}"
                    saved = _job(root, uri, replicas, numel, args.saves)
                    waits = [max(r["wait_s"][i] for r in saved) for i in range(1, args.saves)]
                    samples[kind]["wait_s"].append(statistics.median(waits))
                    samples[kind]["peer"].append(_peer_bytes(root) / 2)  # local_keep=2: two steps' copies
                    shutil.rmtree(f"{root}/node1")  # node 1 is replaced: an empty local_dir
                    if kind == "fetch":
                        shutil.rmtree(f"{root}/node0/peers")  # and no peer holds its share
                    before = _counted(count)
                    loaded = _job(root, uri, replicas, numel, 0, args.saves - 1)
                    samples[kind]["fetched"].append(_counted(count) - before)
                    samples[kind]["resume_s"].append(max(r["resume_s"] for r in loaded))
                    print(
                        f"round {n} {kind}: save+wait {samples[kind]['wait_s'][-1]:.2f} s, "
                        f"resume {samples[kind]['resume_s'][-1]:.2f} s, durable bytes {samples[kind]['fetched'][-1]}"
                    )
                    shutil.rmtree(root, ignore_errors=True)
    rows = {
        kind: {
            "save_wait_s": statistics.median(s["wait_s"]),
            "resume_s": statistics.median(s["resume_s"]),
            "resume_durable_bytes": statistics.median(s["fetched"]),
            "peer_bytes_per_step": statistics.median(s["peer"]),
        }
        for kind, s in samples.items()
    }
    for row in rows.values():
        row["resume_x"] = row["resume_s"] / rows["durable"]["resume_s"]
        row["save_wait_x"] = row["save_wait_s"] / rows["durable"]["save_wait_s"]
    print(
        f"{'kind':<8} {'save+wait s':>12} {'x':>6} {'resume s':>9} {'x':>6} {'durable bytes':>14} {'peer bytes/step':>16}"
    )
    for kind, r in rows.items():
        print(
            f"{kind:<8} {r['save_wait_s']:>12.2f} {r['save_wait_x']:>5.2f}x {r['resume_s']:>9.2f} {r['resume_x']:>5.2f}x "
            f"{r['resume_durable_bytes']:>14.0f} {r['peer_bytes_per_step']:>16.0f}"
        )
    if args.json:
        meta = result_meta(
            "tiered_peers.py",
            argv,
            args.label,
            ranks=WORLD,
            ranks_per_node=PER_NODE,
            size_mib_per_rank=args.size_mib,
            wan={"latency_ms": args.latency_ms, "rate_mbps": args.rate_mbps, "total_mbps": args.total_mbps},
        )
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
