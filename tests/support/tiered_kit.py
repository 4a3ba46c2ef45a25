"""What the tiered-checkpoint tests share (tests/integration/test_tiered*.py,
tests/processes/test_tiered_nodes.py): the durable backends they run over,
a state per step, checks of what each tier holds, and the kill loop of
their crash tests."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.dcp.liveness.alive_file import ALIVE_PREFIX
from dcpstore._impl.format.layout import METADATA, REPLICA_REPORT_PREFIX
from dcpstore._impl.manager import step_dir
from dcpstore._impl.manager.tiers.replicate import read_local_commit
from tests.support import killcount
from tests.support.backends import Target, make_target
from tests.support.crashkit import crash
from tests.support.helpers import assert_state_equal, zeros_like_state

#: Durable tiers: a local path, native S3 (moto over HTTP), S3 through MSC.
DURABLE = ["local", "s3", "msc"]

#: Kill points at an event index that may fall past the end of a run: a run
#: can have a few events fewer than its probe (a new manager reads a durable
#: ``.metadata`` only when its whole-second time looks older than the local
#: copy's), which shifts the last indices out.
MAY_MISS = 2


def crash_at_each(
    ctx: Any,
    child: Callable[..., None],
    durable: Target,
    tmp_path: Path,
    child_kwargs: dict[str, Any],
    kills: Sequence[tuple[int | tuple[str, bool], Any]],
    events: Sequence[str],
) -> Iterator[tuple[Target, Path, Any, tuple[object, str]]]:
    """Run ``child(root_uri, local_dir, child_kwargs, point)`` once per kill
    point of ``kills`` (an event index, or an event name for
    :class:`faults.KillOn`, each with what the test expects there), in a
    fresh durable root and local dir, and check that it died there; yields
    the root, the local dir, the expectation and a description of the point.
    A run may have fewer events than the probe run that found ``events``,
    and end before an index: a named point must kill, an index may not,
    and once every point ran, all but :data:`MAY_MISS` of them must have
    killed (:func:`killcount.record`)."""
    killed = 0
    min_killed = len(kills) - min(MAY_MISS, sum(isinstance(at, int) for at, _ in kills))
    for i, (at, expected) in enumerate(kills):
        root = durable.child(f"kill{i}")
        local = tmp_path / f"local{i}"
        rc = crash(ctx, child, root.uri, str(local), child_kwargs, at)
        where = (at, events[at] if isinstance(at, int) else "")
        assert rc == -signal.SIGKILL or (rc == 0 and isinstance(at, int)), (where, rc)
        killed += rc == -signal.SIGKILL
        yield root, local, expected, where
    killcount.record(len(kills), killed, min_killed)


@pytest.fixture(params=DURABLE)
def durable(request: pytest.FixtureRequest) -> Target:
    return make_target(request.param, request)


def state(step: int, big: int = 4096) -> dict[str, Any]:
    """The state saved at ``step`` (or any seed: an overwrite saves another one)."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 33, generator=g),
        "big": torch.randn(big, generator=g),
        "opt": {"m": torch.randn(17, generator=g).bfloat16(), "step": step},
        "step": step,
    }


def manager(durable: Target, local: Path, *, engine: str | None = None, **kwargs: Any) -> dcpstore.CheckpointManager:
    kwargs.setdefault("async_", False)
    options = durable.save_options(**({} if engine is None else {"engine": engine}))
    return dcpstore.CheckpointManager(durable.uri, local_dir=str(local), options=options, **kwargs)


def durable_steps(durable: Target) -> list[int]:
    return dcpstore.CheckpointManager(durable.uri, options=durable.save_options(async_=True)).all_steps()


def local_steps(local: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in local.glob("step_*") if (p / METADATA).exists())


def assert_durable_step(
    durable: Target, step: int, big: int = 4096, *, killed: bool = False, load: bool = True, seed: int | None = None
) -> None:
    """The durable copy of ``step`` loads exactly ``state(seed or step)`` (a
    plain load of its URI), and holds exactly what the commit protocol
    writes: ``.metadata``, its manifest, the files that names; no replica
    reports, no alive file, no other commit's files (``killed``: a kill
    after the commit may have left reports and alive files, which gc removes)."""
    uri = f"{durable.uri.rstrip('/')}/{step_dir(step)}"
    if load:
        expected = state(step if seed is None else seed, big)
        restored = zeros_like_state(expected)
        dcpstore.load(restored, uri, **durable.kwargs)
        assert_state_equal(expected, restored)
    root = dcpstore.open_storage(durable.uri, **durable.kwargs)
    try:
        names = {o["path"].partition("/")[2] for o in root.list(f"{step_dir(step)}/")}
        commit = read_local_commit(root, step)
    finally:
        root.close()
    assert commit is not None, names
    if killed:
        names = {n for n in names if not (n.startswith(REPLICA_REPORT_PREFIX) or n.startswith(ALIVE_PREFIX))}
    assert names == {METADATA, commit.manifest_name, *commit.manifest["files"]}, names


def loads(mgr: dcpstore.CheckpointManager, step: int | None = None, big: int = 4096) -> int:
    """Load through the manager; check the state is exactly that step's."""
    restored = zeros_like_state(state(0, big))
    got = mgr.load(restored, step)
    assert_state_equal(state(got, big), restored)
    return got


def dtensor_state(world_size: int, step: int) -> dict[str, Any]:
    """A state sharded over ``world_size`` gloo ranks (every rank calls it)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return {"w": distribute_tensor(full(step), mesh, [Shard(0)]), "step": step}


def full(step: int) -> torch.Tensor:
    """The whole of ``dtensor_state(..., step)["w"]``."""
    return torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24) + step


def gc_keeps_running(uri: str, gate: Any, step: int) -> None:
    """Once ``gate`` (a :class:`faults.BlockAt`) holds a save or replication
    under ``uri``, ``dcpstore gc`` of any age keeps ``step`` as running and
    removes nothing; then the gate is released."""
    from dcpstore._impl.tools.maintenance import gc

    assert gate.reached.wait(60)
    root = dcpstore.open_storage(uri)
    try:
        report = gc(root, older_than_s=0)
        assert report.kept_running == [step_dir(step)] and not report.removed, report
    finally:
        gate.release()
        root.close()
