"""Soak: 100 async saves with keep=2; RSS, open files and threads stay flat.

A training loop in miniature: every step mutates the state and saves it
with ``CheckpointManager(root, keep=2, async_=True)``, which keeps the newest
two committed steps. Every ``SAMPLE_EVERY`` steps the loop waits for the save in
flight (a quiescent point: no per-save writer threads alive) and samples
the process's RSS, open file descriptors and threads.

Flat means: after a warm-up (the first fifth of the saves: allocator, caches,
the background thread and staging buffers come into being), the samples grow
by less than a tolerance, and RSS has no upward trend (least-squares slope
per save below a small bound). The default run saves a small state (512
KiB) on a local root; the full size (64 MiB per save, 6.4 GB written) and
the S3 variant (8 MiB) are ``slow``::

    PYTHONPATH=$PWD python -m pytest -q -m slow tests/processes/test_soak.py
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psutil
import pytest
import torch

import dcpstore
from tests.support.backends import Target
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.rss import fix_mmap_threshold, in_own_process, live_rss

SAVES = 100
KEEP = 2
SAMPLE_EVERY = 10


def _state(numel: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    per = numel // 8
    state: dict[str, Any] = {f"layer{i}.w": torch.randn(per, generator=g) for i in range(8)}
    state["optim"] = {"step": 0, "lr": 1e-3}
    return state


def _usage(proc: psutil.Process) -> tuple[int, int, int]:
    return live_rss(proc), proc.num_fds(), threading.active_count()


def _slope(ys: list[int]) -> float:
    """Least-squares slope of ``ys`` per sample."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def _soak(target: Target, numel: int, engine: str = "native") -> str:
    """The soak, in a process of its own (it changes the allocator); its samples, as text."""
    logging.getLogger("c10d-NullHandler-dcp_logger").disabled = True  # no DEBUG records pile up here
    proc = psutil.Process()
    fix_mmap_threshold()
    state = _state(numel)
    state_bytes = numel * 4
    samples: list[tuple[int, int, int]] = []
    manager = dcpstore.CheckpointManager(
        target.uri, keep=KEEP, async_=True, options=target.save_options(engine=engine, workers=2)
    )
    with manager:
        for step in range(SAVES):
            for _name, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.add_(1)  # the optimizer step
            state["optim"]["step"] = step
            manager.save(state, step)
            if (step + 1) % SAMPLE_EVERY == 0:
                manager.wait()
                samples.append(_usage(proc))
        manager.wait()
        assert manager.all_steps() == [SAVES - 2, SAVES - 1]
    restored = zeros_like_state(state)
    assert dcpstore.CheckpointManager(target.uri, options=target.save_options(async_=True)).load(restored) == SAVES - 1
    assert_state_equal(state, restored)

    steady = samples[len(samples) // 5 :]  # after the warm-up
    rss = [s[0] for s in steady]
    fds = [s[1] for s in steady]
    threads = [s[2] for s in steady]
    mib = 2**20
    report = f"RSS MiB {[round(r / mib, 1) for r in rss]}, fds {fds}, threads {threads}"
    assert max(fds) - fds[0] <= 2, f"open files grew: {report}"
    assert max(threads) - threads[0] <= 1, f"threads grew: {report}"
    # Tolerance: half a state (allocator slack) + 24 MiB (a loaded box's noise);
    # a leak of one state copy per save would be 80 states here.
    assert max(rss) - rss[0] < state_bytes // 2 + 24 * mib, f"RSS grew: {report}"
    per_save = _slope(rss) / SAMPLE_EVERY
    assert per_save < max(state_bytes // 100, 64 * 1024), f"RSS trends up {per_save / 1024:.0f} KiB/save: {report}"
    return report


def soak(target: Target, numel: int) -> None:
    print(in_own_process(_soak, target, numel, timeout=1800))


@pytest.mark.slow  # 100 saves; the quick suite has test_async's 50-save flat check
def test_soak_100_async_saves_keep_2(local_target: Target) -> None:
    soak(local_target, numel=128 * 1024)  # 512 KiB per save


@pytest.mark.slow
def test_soak_full_size(local_target: Target) -> None:
    soak(local_target, numel=16 * 1024 * 1024)  # 64 MiB per save, 6.4 GB in all


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s3"])
def test_soak_on_s3(name: str, request: pytest.FixtureRequest) -> None:
    from tests.support.backends import make_target

    soak(make_target(name, request), numel=2 * 1024 * 1024)  # 8 MiB per save: two-part uploads
