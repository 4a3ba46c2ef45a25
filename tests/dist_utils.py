"""Run a function on N real ranks (processes) with a gloo process group.

    run_ranks(_worker, 2, some_arg)     # _worker(rank, world_size, some_arg)

The function must live at module level in an importable module (the test
file itself is fine) since ranks are spawned fresh. A failure on any rank
re-raises here with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
