"""Child processes that the manager suites SIGKILL or let exit.

    python -m tests.support.manager_child MODE ROOT KEEP ASYNC    (from the repository root)

MODE:
  commit-kill  commit steps 1 and 2, then die (SIGKILL) inside step 3 after
               every data file is durable, just before .metadata is written
  loop         save steps 1, 2, ... until the parent kills it
  exit         save step 1 and return without wait()/close(): the atexit
               hook must finish it
Each committed step prints "committed N".
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import dcpstore
from dcpstore._impl.storage.backends.local import LocalStorage


def state(step: int) -> dict[str, object]:
    return {**{f"t{i}": torch.full((1 << 20,), float(step)) for i in range(4)}, "step": step}


def main() -> None:
    mode, root, keep, async_ = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    mgr = dcpstore.CheckpointManager(root, keep=keep, async_=async_, options=dcpstore.SaveOptions(workers=4))
    if mode == "commit-kill":
        for step in (1, 2):
            mgr.save(state(step), step)
            mgr.wait()
            print("committed", step, flush=True)
        original = LocalStorage.put

        def put(self: LocalStorage, path: str, data: bytes, **kwargs: bool) -> None:
            if path == ".metadata":  # data + manifest are durable; the commit is next
                os.kill(os.getpid(), signal.SIGKILL)
            original(self, path, data, **kwargs)

        LocalStorage.put = put  # type: ignore[method-assign]
        mgr.save(state(3), 3)
        mgr.wait()
        raise SystemExit("unreachable: step 3 was committed")
    if mode == "loop":
        for step in range(1, 10_000):
            mgr.save(state(step), step)
            print("committed" if not async_ else "started", step, flush=True)
    if mode == "exit":
        mgr.save(state(1), 1)  # returns at once when async; no wait(), no close()


if __name__ == "__main__":
    main()
