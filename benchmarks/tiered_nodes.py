"""What do node-local directories cost a tiered save? Two gloo ranks.

Measures, in one run, on the same per-rank state (Shard(0) DTensors plus a
step counter), each save waited for before the next one starts, the three
kinds taking turns so that load from other processes hits all alike:

* ``plain``: ``dcpstore.save(state, SHARED/step_N, async_=True)``, the
  plain local async save every rank makes into one directory (the
  reference: ratio 1.0);
* ``tiered-shared``: ``CheckpointManager(DURABLE, local_dir=SHARED)``, one
  local directory for both ranks;
* ``tiered-nodes``: the same manager with one local directory per rank (a
  node each): the manager's save id goes to every rank before the save (a
  broadcast on the caller's thread), and each node's copy of the commit is
  made on the replicator thread afterwards.

Each tiered save's replication is waited for (untimed) before the next
save, so that no kind's background work runs into another's save.
Per save and rank: **blocked** (the ``save`` call) and **local commit**
(``save`` to the handle's completion, the coordinator's local commit).
Reported: the median over the saves after the first (which allocates the
staging memory) of the slower rank, and each tiered kind against
``plain``. The durable tier is a local directory, so that the numbers are
the manager's own cost, not an object store's.

    python benchmarks/tiered_nodes.py --size-mib 64,256 --saves 6 [--dir /tmp/x] [--json out.json]

Target (issue #18): blocked and local commit within 10% of ``plain``.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dcpstore._impl.bench.report import result_meta  # noqa: E402

KINDS = ("plain", "tiered-shared", "tiered-nodes")


def _state(world: int, numel: int, step: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, numel * world // 1024)
    full = torch.full((rows, 1024), float(step))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def _rank(rank: int, world: int, port: int, root: str, numel: int, saves: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import dcpstore

    timings: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    managers = {
        "tiered-shared": dcpstore.CheckpointManager(
            f"{root}/durable-shared", local_dir=f"{root}/shared-tier", keep=2, local_keep=2
        ),
        "tiered-nodes": dcpstore.CheckpointManager(
            f"{root}/durable-nodes", local_dir=f"{root}/node{rank}", keep=2, local_keep=2
        ),
    }
    for step in range(saves):
        for kind in KINDS:
            state = _state(world, numel, step)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "plain":
                handle = dcpstore.save(state, f"{root}/plain/step_{step}", async_=True)
            else:
                handle = managers[kind].save(state, step)
            blocked = time.perf_counter() - t0
            handle.result()
            timings[kind].append((blocked, time.perf_counter() - t0))
            if kind != "plain":  # its replication, untimed: no kind's background work runs into another's save
                managers[kind].wait()
            if kind == "plain" and rank == 0 and step >= 2:
                shutil.rmtree(f"{root}/plain/step_{step - 2}", ignore_errors=True)
    for mgr in managers.values():
        mgr.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(timings, f)
    dist.destroy_process_group()


def _measure(size_mib: int, saves: int, directory: str | None) -> dict[str, dict[str, float]]:
    """One run of the three kinds at ``size_mib`` per rank: the medians (see the module docstring)."""
    world = 2
    root = tempfile.mkdtemp(prefix="tiered-nodes-", dir=directory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(root, "timings")
    numel = size_mib * (1 << 20) // 4
    try:
        mp.start_processes(_rank, args=(world, port, root, numel, saves, out), nprocs=world, start_method="spawn")
        per_rank = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                per_rank.append(json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        worst = [tuple(max(per_rank[r][kind][i][j] for r in range(world)) for j in (0, 1)) for i in range(1, saves)]
        rows[kind] = {
            "blocked_s": statistics.median(b for b, _ in worst),
            "local_commit_s": statistics.median(c for _, c in worst),
        }
    for row in rows.values():
        row["blocked_x"] = row["blocked_s"] / rows["plain"]["blocked_s"]
        row["local_commit_x"] = row["local_commit_s"] / rows["plain"]["local_commit_s"]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", default="64", help="state per rank, MiB; a comma list runs each (default 64)")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--label", default="", help="free text stored with the results")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {}
    for size in (int(x) for x in args.size_mib.split(",")):
        rows = results[str(size)] = _measure(size, args.saves, args.dir)
        print(f"{size} MiB per rank")
        print(f"{'kind':<15} {'blocked s':>10} {'x plain':>8} {'local commit s':>15} {'x plain':>8}")
        for kind, row in rows.items():
            print(
                f"{kind:<15} {row['blocked_s']:>10.3f} {row['blocked_x']:>7.2f}x "
                f"{row['local_commit_s']:>15.3f} {row['local_commit_x']:>7.2f}x"
            )
    if args.json:
        meta = result_meta(
            "tiered_nodes.py", argv if argv is not None else sys.argv[1:], args.label, saves=args.saves, ranks=2
        )
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
