"""Shared staging memory: one block per staged set that another process maps.

The process engine's checkpoint process writes a snapshot the training
process staged. Its buffers are carved from one :class:`Slab`: an anonymous
memory file (``memfd_create``; elsewhere an unlinked file in ``/dev/shm``)
mapped here and, through its file descriptor sent once over a socket, in
the checkpoint process. Nothing is named in a filesystem, so nothing
outlives the two processes: a SIGKILLed trainer leaks no shared memory.
One descriptor per set, not per tensor, however many tensors it holds.

For a state on a CUDA device the block is page-locked
(``cudaHostRegister``) so that the device-to-host copies stay asynchronous,
as with private pinned buffers.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
import weakref
from typing import Any

import torch

from dcpstore._impl.storage.byte_ranges import ceil_div

#: Buffers start on this boundary (a cache line; every dtype's alignment).
ALIGN = 64

_ids = itertools.count(1)


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return ceil_div(n, ALIGN) * ALIGN


def _anonymous_file(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` of memory no path names."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("dcpstore-staging", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_bytes(fd: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of the memory file ``fd`` as a uint8 tensor (the mapping
    lives as long as the tensor or a view of it does)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


def view_at(
    block: torch.Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...] | None, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of ``shape`` / ``stride`` (None: row-major) / ``dtype``
    at byte ``offset`` of ``block`` (a uint8 tensor)."""
    numel = 1
    for dim in shape:
        numel *= dim
    if stride is None:
        return block[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if numel else 0
    return torch.as_strided(block[offset : offset + span * dtype.itemsize].view(dtype), shape, stride)


class Slab:
    """``nbytes`` of memory another process can map: :attr:`fd` for it,
    :attr:`block` (uint8) here; :attr:`id` tells slabs apart. Freed once
    the slab and every view of :attr:`block` are gone."""

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self.id = next(_ids)
        self.nbytes = max(ALIGN, aligned(nbytes))
        self.fd = _anonymous_file(self.nbytes)
        weakref.finalize(self, os.close, self.fd)
        try:
            self.block = map_bytes(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        if pin and torch.cuda.is_available():  # pragma: no cover - needs a GPU (tests/integration/test_cuda.py)
            self._pin()

    def _pin(self) -> None:  # pragma: no cover - needs a GPU
        """Page-lock the block for asynchronous device-to-host copies, until
        the slab goes (its buffers are staged into only while it lives);
        unpinned, those copies are merely synchronous."""
        ptr = self.block.data_ptr()
        try:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            if int(cudart.cudaHostRegister(ptr, self.nbytes, 0)) != 0:
                return
        except Exception:  # an older or odd CUDA runtime binding: stay unpinned
            return
        finalizer = weakref.finalize(self, cudart.cudaHostUnregister, ptr)
        finalizer.atexit = False  # never after the CUDA context is gone
