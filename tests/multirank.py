"""Run a function on N gloo ranks (CPU), for the multi-rank suites.

Ranks are forked from a forkserver that has already imported torch, FSDP2
and dcpstore (importing those costs seconds per process on a small box), so
a job costs its work plus a fork. Job functions must live in an importable
module (tests/fsdp_jobs.py) and take ``(rank, world, *args)``.

A child's exception fails the job with its traceback; a job that runs past
``timeout`` (a deadlock) is killed and fails.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as tmp

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "dcpstore", "dcpstore.adapters.fsdp", "fsdp_jobs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, env: dict[str, str], args: tuple[Any, ...]
) -> None:
    import torch.distributed as dist

    # The forkserver's environment is the one it started with; fixtures set
    # things later (e.g. the S3 endpoint), so take the caller's as of now.
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise on failure."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = tmp.start_processes(
        _entry, args=(fn, world, free_port(), dict(os.environ), args), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks ran past {timeout}s (deadlock?)")
