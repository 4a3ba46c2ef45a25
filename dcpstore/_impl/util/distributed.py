"""Whether torch.distributed is running: the one test every layer asks
before it calls a collective, a rank or a process group."""

from __future__ import annotations

import torch.distributed as dist


def is_distributed() -> bool:
    """torch.distributed is built into this torch and its default process
    group is initialised (else: one process, rank 0 of 1)."""
    return dist.is_available() and dist.is_initialized()
