"""Whether a tensor's stored chunks tile its declared shape.

``.metadata`` declares each tensor's size and the chunks (boxes) that hold
it. A load fills the destination from the chunks it overlaps; an element no
chunk holds keeps whatever the destination held before (stock DCP loads such
a checkpoint without a word), and an element two chunks hold gets either. So
a checkpoint's chunks must tile each tensor exactly: every element in one
chunk. :func:`tiling_problem` checks that without visiting elements: the
boundaries of the chunks cut each dimension into intervals, the intervals
into grid cells, and each chunk covers a block of cells; every cell must be
covered exactly once. Shardings are grids (row, column or block shards), so
there are about as many cells as chunks; a pathological set falls back to
comparing the chunks pairwise.

A rank-local ``__{rank}.metadata`` (``use_collectives=False``) holds its
rank's chunks only; :func:`check_tiling` is for a global ``.metadata``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcpstore._impl.util.errors import CheckpointCorrupt

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)

#: Grids with more cells than this are checked pairwise instead.
MAX_CELLS = 1 << 22


def check_tiling(metadata: Metadata, where: str) -> None:
    """Every tensor of a global ``.metadata`` (already validated) is tiled by
    its chunks; :class:`CheckpointCorrupt` naming ``where`` and the tensor."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            why = tiling_problem(md.size, [(c.offsets, c.sizes) for c in md.chunks])
            if why:
                raise CheckpointCorrupt(
                    f"{where}: state_dict_metadata[{fqn!r}].chunks do not tile its size {list(md.size)}: {why}"
                )


def tiling_problem(size: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """Why ``chunks`` (each inside ``size``) do not tile ``size`` exactly, or
    None if they do."""
    total = math.prod(size)
    boxes = [(tuple(o), tuple(s)) for o, s in chunks if math.prod(s) > 0]  # empty chunks hold nothing
    if total == 0:
        return None
    held = sum(math.prod(s) for _, s in boxes)
    if len(boxes) == 1 and held == total:
        return None  # one chunk inside the tensor, as large: all of it
    if _overlap(size, boxes):
        return "two of its chunks overlap (elements stored twice)"
    if held != total:  # inside the tensor and apart: fewer
        return f"its chunks hold {held} of its {total} elements (the rest is in no chunk)"
    return None


def _overlap(size: Sequence[int], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two boxes share an element."""
    cuts = [
        np.unique([0, dim, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)]) for d, dim in enumerate(size)
    ]
    if math.prod(len(c) - 1 for c in cuts) <= MAX_CELLS:
        cells = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
        for offsets, sizes in boxes:
            block = tuple(
                slice(int(np.searchsorted(c, o)), int(np.searchsorted(c, o + s)))
                for c, o, s in zip(cuts, offsets, sizes)
            )
            cells[block] += 1
        return bool((cells > 1).any())
    lo = np.array([o for o, _ in boxes], dtype=np.int64)
    hi = lo + np.array([s for _, s in boxes], dtype=np.int64)
    for i in range(len(boxes) - 1):
        shared = (lo[i + 1 :] < hi[i]) & (lo[i] < hi[i + 1 :])
        if shared.all(axis=1).any():
            return True
    return False
