"""Whether this build can run async saves, for skipping the async suites.

The async engines land on another branch; until then ``dcpstore.save(...,
async_=True)`` raises NotImplementedError and the tests marked
``requires_async`` skip with that reason (and only for that reason).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import dcpstore


def _why_not() -> str | None:
    with tempfile.TemporaryDirectory() as root:
        try:
            dcpstore.save({"probe": torch.zeros(1)}, f"{root}/probe", async_=True).result()
        except NotImplementedError as e:
            return f"dcpstore.save(async_=True) is not implemented in this build: {e}"
    return None


ASYNC_UNAVAILABLE = _why_not()
requires_async = pytest.mark.skipif(ASYNC_UNAVAILABLE is not None, reason=ASYNC_UNAVAILABLE or "")
