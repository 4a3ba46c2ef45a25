"""The limits a comparison measures dcpstore against.

The storage limits ship with ``dcpstore bench`` (:mod:`dcpstore._impl.bench.limits`:
raw threads on files, raw boto3 swept over connections and part sizes, the
best of each direction; the harness self-test rows of an emulated network);
this module adds the one reference that is not a storage's:

* :class:`Clone` -- ``tensor.clone()`` of every tensor: the least an async
  save must block to take a consistent snapshot on the CPU.
"""

from __future__ import annotations

import torch

from dcpstore._impl.bench import Entry, SaveOutcome, Waiter, done
from dcpstore._impl.bench.limits import HarnessRaw, RawFiles, RawS3, byte_view, harness_points, s3_sweep, shares

__all__ = ["Clone", "HarnessRaw", "RawFiles", "RawS3", "byte_view", "harness_points", "s3_sweep", "shares"]


class Clone(Entry):
    # Not a storage limit: best_limits never takes it for one.
    group = "reference"
    backend = "memory"
    engine = "clone"
    reads = False
    page_cached = False
    name = "clone() of every tensor"

    def __init__(self) -> None:
        self._copies: dict[str, torch.Tensor] = {}

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        self._copies = {k: v.clone() for k, v in state.items()}
        return done(SaveOutcome(phases={"stage": 0.0}))

    def cleanup(self) -> None:
        self._copies = {}
