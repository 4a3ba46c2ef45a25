"""Two processes saving to one URI at once: one wins or a clear error.

Whatever the interleaving, a load afterwards returns exactly one writer's
state, or fails with a clear error; it never returns a mixture.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import dcpstore
from crashkit import forkserver


def writer_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64 * 1024, generator=g) for i in range(8)}


def _racer(uri: str, seed: int, barrier, results) -> None:
    state = writer_state(seed)
    barrier.wait()
    try:
        dcpstore.save(state, uri, workers=4).result()
        results.put((seed, "ok"))
    except dcpstore.SaveError as e:
        results.put((seed, f"error: {e}"))


@pytest.fixture(scope="module")
def ctx() -> mp.context.BaseContext:
    return forkserver()


def test_two_writers_one_uri(tmp_path, ctx) -> None:
    outcomes = []
    for round_ in range(6):
        uri = str(tmp_path / f"race_{round_}")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_racer, args=(uri, seed, barrier, results)) for seed in (1, 2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        said = dict(results.get(timeout=5) for _ in procs)
        for seed, what in said.items():
            assert what == "ok" or "another save" in what, what
        restored = {k: torch.zeros_like(v) for k, v in writer_state(1).items()}
        try:
            dcpstore.load(restored, uri)
        except dcpstore.CheckpointError as e:  # clear error, never silent garbage
            outcomes.append(f"load error: {type(e).__name__}: {e}")
            continue
        winners = [s for s in (1, 2) if all(torch.equal(restored[k], v) for k, v in writer_state(s).items())]
        assert len(winners) == 1, "loaded a mixture of two saves"
        assert said[winners[0]] == "ok", "loaded the state of a save that reported failure"
        outcomes.append(f"winner {winners[0]}")
    assert any(o.startswith("winner") for o in outcomes), outcomes
