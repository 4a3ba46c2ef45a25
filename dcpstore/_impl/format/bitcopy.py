"""``copy_`` for every dtype DCP saves, bit for bit.

torch lacks a copy kernel for some dtypes between tensors of different
layouts (``float4_e2m1fn_x2`` in torch 2.13: '"copy_" not implemented'),
although their bytes can be moved like any other: a transposed or strided
tensor of such a dtype could then not be staged for an async save, nor
loaded (stock ``dcp.load`` fails the same way). Same-dtype copies fall back
to an integer view of the same width.
"""

from __future__ import annotations

import torch

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_values(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``, also where torch has no kernel for the dtype."""
    try:
        dst.copy_(src, non_blocking=non_blocking)
    except NotImplementedError:
        carrier = _SAME_WIDTH.get(dst.element_size())
        flagged = dst.is_conj() or dst.is_neg() or src.is_conj() or src.is_neg()
        if carrier is None or dst.dtype != src.dtype or flagged:
            raise
        dst.view(carrier).copy_(src.view(carrier), non_blocking=non_blocking)
