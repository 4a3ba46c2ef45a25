"""Run inside a private mount namespace with a small tmpfs at ``argv[1]``
(see test_disk_full.py): a real full disk, for each engine in ``argv[2:]``."""

from __future__ import annotations

import os
import sys
import warnings

import torch

import dcpstore
from tests.support.oracle import SAVE_ENGINES, assert_same_state, destination

warnings.filterwarnings("ignore")


def _leftovers(uri: str) -> list[str]:
    return sorted(f for f in os.listdir(uri) if f.endswith(".distcp") or ".dcpstore-tmp-" in f)


def scenario(root: str, engine: str) -> None:
    small = {"w": torch.randn(40_000), "step": 1}  # 160 KB
    big = {"w": torch.randn(2 << 20), "step": 2}  # 8 MiB: more than the disk holds
    kwargs = dict(SAVE_ENGINES[engine], workers=2)
    previous = os.path.join(root, engine, "step_1")
    dcpstore.save(small, previous, **kwargs).result()
    failed = os.path.join(root, engine, "step_2")
    try:
        dcpstore.save(big, failed, **kwargs).result()
    except dcpstore.SaveError as e:
        message = str(e)
        cause = e.__cause__
    else:
        raise AssertionError(f"{engine}: a save larger than the disk succeeded")
    assert "ENOSPC" in message and failed in message, message
    assert "unexpected pos" not in message, message
    assert not os.path.exists(os.path.join(failed, ".metadata"))
    assert _leftovers(failed) == [], f"{engine}: the failed save left {_leftovers(failed)}"
    print(f"{engine}: {message} (cause: {type(cause).__name__})")
    restored = destination(small)
    dcpstore.load(restored, previous)  # the previous checkpoint is intact
    assert_same_state(restored, small)
    retry = os.path.join(root, engine, "step_3")  # space is back: the next save works
    dcpstore.save(small, retry, **kwargs).result()
    restored = destination(small)
    dcpstore.load(restored, retry)
    assert_same_state(restored, small)


if __name__ == "__main__":
    for name in sys.argv[2:]:
        scenario(sys.argv[1], name)
    print("OK")
