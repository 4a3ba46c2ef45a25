"""Two processes saving to one URI at once: one wins or a clear error.

Whatever the interleaving, each writer succeeds or fails with "another
save"; at least one succeeds; a load afterwards returns exactly the state
of a writer that reported success, never a mixture. The one documented
exception (RELIABILITY.md, "Known limits": the check-then-publish window)
is a load that fails with a clear error: ``CheckpointCorrupt`` naming a
data file when one writer's file landed over the other's (both claimed
the fresh URI at once, so both write stock DCP's names). A claim never
retracts a commit, so a writer that reported success always leaves a
``.metadata``. The window is narrow, so at most ``MAX_ERROR_ROUNDS`` of
the rounds may end that way.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import dcpstore
from tests.support.crashkit import forkserver


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


#: Rounds and how many of them may end in a load error (the known window;
#: none in 20 rounds measured on a loaded 2-core box).
ROUNDS = 6
MAX_ERROR_ROUNDS = 2


def _load_error_is_documented(e: dcpstore.CheckpointError, said: dict[int, str]) -> bool:
    # The last commit's .metadata stands (no claim retracts one), so only the
    # data-file window can fail a load.
    return isinstance(e, dcpstore.CheckpointCorrupt) and ".distcp" in str(e)  # a data file of the other writer, named


def test_two_writers_one_uri(tmp_path, ctx) -> None:
    outcomes = []
    for round_ in range(ROUNDS):
        uri = str(tmp_path / f"race_{round_}")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_racer, args=(uri, seed, barrier, results)) for seed in (1, 2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        said = dict(results.get(timeout=5) for _ in procs)
        for _seed, what in said.items():
            assert what == "ok" or "another save" in what, what
        assert "ok" in said.values(), f"both writers failed: {said}"
        restored = {k: torch.zeros_like(v) for k, v in writer_state(1).items()}
        try:
            dcpstore.load(restored, uri)
        except dcpstore.CheckpointError as e:
            assert _load_error_is_documented(e, said), f"{said}: {type(e).__name__}: {e}"
            outcomes.append(f"load error: {type(e).__name__}: {e}")
            continue
        winners = [s for s in (1, 2) if all(torch.equal(restored[k], v) for k, v in writer_state(s).items())]
        assert len(winners) == 1, "loaded a mixture of two saves"
        assert said[winners[0]] == "ok", "loaded the state of a save that reported failure"
        outcomes.append(f"winner {winners[0]}")
    errors = [o for o in outcomes if o.startswith("load error")]
    assert len(errors) <= MAX_ERROR_ROUNDS, outcomes
