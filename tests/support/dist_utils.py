"""Run a function on N real ranks (processes) with a gloo process group.

    run_ranks(_worker, 2, some_arg)     # _worker(rank, world_size, some_arg)

The function must live at module level in an importable module (the test
file itself is fine). A failure on any rank re-raises here with that rank's
traceback; a job that runs past ``timeout`` (a deadlock) is killed and fails.

Ranks fork from a forkserver that has already imported torch, FSDP2 and
dcpstore: importing those costs seconds per process on a small box, so a
spawned job paid them on every rank of every job. Forking from the server
(started once per session, single-threaded, before any torch op) is safe
where forking the test process itself would not be. The forkserver keeps the
environment it started with, so each rank takes the caller's environment as
of the call (fixtures may have set, say, an S3 endpoint since).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: What the session's one forkserver imports before forking. multiprocessing
#: has a single forkserver per process and the first suite to start it fixes
#: its preload list, so every suite that forks from it (these ranks,
#: crashkit's crash children, test_concurrency's racers) names this same
#: list; otherwise every child of a later suite re-imports its modules.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "dcpstore",
    "dcpstore._impl.storage.backends.s3.storage",
    "crashkit",
    "test_crash",
    "test_crash_async",
    "test_crash_s3",
    "test_concurrency",
    "test_tiered",
    "test_tiered_overwrite",
    "dcpstore._impl.storage.backends.s3.storage",
    "tests.support.crashkit",
    "tests.processes.test_crash",
    "tests.processes.test_crash_async",
    "tests.processes.test_crash_s3",
    "tests.processes.test_concurrency",
    "tests.integration.test_tiered",
    "tests.integration.test_tiered_overwrite",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    # A rank that dies of a signal (a SIGABRT at exit, a SIGSEGV in a native
    # library) prints every thread's Python stack to its stderr first, so the
    # failure says which thread was where (issue #38: a torchtitan rank once
    # aborted at exit after its checks passed, and left nothing to go on).
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    # OMP_NUM_THREADS is read when torch loads (in the forkserver): set the
    # thread count directly so ranks do not oversubscribe the cores.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if backend == "nccl":  # one GPU per rank, bound before the group exists
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a
    ``backend`` group (``"nccl"``: one GPU per rank); raise on failure."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), dict(os.environ), args, backend),
        nprocs=world_size,
        join=False,
        # CUDA ranks are spawned: a process that may have touched the CUDA
        # driver (the forkserver's imports, this one) must not fork them.
        start_method="spawn" if backend == "nccl" else "forkserver",
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks ran past {timeout}s (deadlock?)")
