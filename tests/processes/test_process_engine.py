"""What only the process engine has: a checkpoint process per rank.

The engine's saves themselves run through the suites every engine runs
(test_async.py, test_multirank_async.py, the oracle suites, test_crash_async.py,
test_unobserved.py). Here: a SIGKILLed checkpoint process fails its save,
never hangs, and the next save starts a new one; the process dies with its
trainer; what cannot reach it (a planner that does not pickle, a
``memory://`` URI) is refused naming why; it sees the trainer's environment
as of each save.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore._impl.util.errors import CheckpointNotFound, InvalidArgument, SaveError
from tests.support.async_helpers import GatedPlanner

#: Bound on how long a save whose checkpoint process died may take to fail.
FAIL_WITHIN_S = 30.0


def checkpoint_processes(parent: psutil.Process | None = None) -> list[int]:
    """The pids of ``parent``'s (this process's) checkpoint processes."""
    parent = parent or psutil.Process()
    return [p.pid for p in parent.children() if "dcpstore._impl.engines.process" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def saver() -> Any:
    s = dcpstore.AsyncSaver()
    yield s
    s.close()


@pytest.mark.slow  # the quick run kills one on 2 ranks (test_multirank_async.py), with the same outcome
def test_a_killed_checkpoint_process_fails_its_save_and_the_next_save_starts_a_new_one(tmp_path: Path) -> None:
    state = {"w": torch.arange(1000.0), "step": 1}
    others = set(checkpoint_processes())  # the per-process default saver's, say
    with dcpstore.AsyncSaver() as saver:
        planner = GatedPlanner("setup")  # held in the checkpoint process, before it plans
        handle = saver.save(state, str(tmp_path / "a"), options=dcpstore.SaveOptions(engine="process", planner=planner))
        assert planner.reached.wait(120)
        (victim,) = set(checkpoint_processes()) - others
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            SaveError, match=rf"checkpoint process died \(rank 0: pid {victim}, killed by SIGKILL\)"
        ) as info:
            handle.result(timeout=FAIL_WITHIN_S)  # a hang would raise TimeoutError instead
        assert time.monotonic() - started < FAIL_WITHIN_S
        assert str(tmp_path / "a") in str(info.value)
        with pytest.raises(CheckpointNotFound):
            dcpstore.load({"w": torch.zeros(1000), "step": 0}, str(tmp_path / "a"))
        # The next save starts a new checkpoint process and commits.
        info2 = saver.save(state, str(tmp_path / "a"), options=dcpstore.SaveOptions(engine="process")).result(
            timeout=120
        )
        assert info2.engine == "process" and info2.bytes_written > 0
        (replacement,) = set(checkpoint_processes()) - others
        assert replacement != victim
    assert set(checkpoint_processes()) <= others  # close() stopped it
    loaded: dict[str, Any] = {"w": torch.zeros(1000), "step": 0}
    dcpstore.load(loaded, str(tmp_path / "a"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 1


class _EnvPlanner(DefaultSavePlanner):
    """Fails the save unless the process that plans it sees ``name=value``."""

    def __init__(self, name: str, value: str) -> None:
        super().__init__()
        self.name, self.value = name, value

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        seen = os.environ.get(self.name)
        if seen != self.value:
            raise RuntimeError(f"the planner saw {self.name}={seen!r}, not {self.value!r}")
        super().set_up_planner(*args, **kwargs)


def test_each_save_sees_the_trainers_environment_as_of_that_save(
    saver: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials and endpoints come from the environment, which a long
    job may change between saves: the checkpoint process takes the
    trainer's with every save, not the one it started with."""
    name = "DCPSTORE_TEST_ENV_MARK"
    for value in ("first", "second"):
        monkeypatch.setenv(name, value)
        saver.save(
            {"w": torch.ones(3)},
            str(tmp_path / value),
            options=dcpstore.SaveOptions(engine="process", planner=_EnvPlanner(name, value)),
        ).result(timeout=120)


def test_a_planner_that_does_not_pickle_fails_the_save_naming_why(saver: Any, tmp_path: Path) -> None:
    class Local(DefaultSavePlanner):  # a class inside a function: pickle cannot name it
        pass

    handle = saver.save(
        {"w": torch.ones(3)}, str(tmp_path / "a"), options=dcpstore.SaveOptions(engine="process", planner=Local())
    )
    with pytest.raises(SaveError, match="Can't pickle local object"):
        handle.result(timeout=120)
    assert not os.path.exists(tmp_path / "a" / ".metadata")
    saver.save({"w": torch.ones(3)}, str(tmp_path / "a"), options=dcpstore.SaveOptions(engine="process")).result(
        timeout=120
    )  # and the next one runs


def test_memory_uris_are_refused_before_anything_starts() -> None:
    with pytest.raises(InvalidArgument, match=r"engine='process' cannot save to memory://.*engine='native'"):
        dcpstore.save({"w": torch.ones(1)}, "memory://process-refused", async_=True, engine="process")


_TRAINER = textwrap.dedent(
    """
    import sys, time, torch, dcpstore
    sys.path.insert(0, sys.argv[2])
    from tests.support.async_helpers import GatedPlanner
    planner = GatedPlanner("setup")
    handle = dcpstore.save({"w": torch.ones(100)}, sys.argv[1], async_=True, engine="process", planner=planner)
    assert planner.reached.wait(120)
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_the_checkpoint_process_dies_with_its_trainer(tmp_path: Path) -> None:
    """A SIGKILLed trainer leaves no checkpoint process behind (it would go
    on writing, and commit, for a job that is gone), and the save it held
    commits nothing."""
    uri = str(tmp_path / "a")
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )  # where tests.support imports from
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, uri, root], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "held"
        (worker,) = checkpoint_processes(psutil.Process(trainer.pid))
        trainer.kill()
        trainer.wait(30)
        gone, alive = psutil.wait_procs([psutil.Process(worker)], timeout=FAIL_WITHIN_S)
        assert not alive, f"checkpoint process {worker} outlived its trainer"
    finally:
        trainer.kill()
    assert not os.path.exists(os.path.join(uri, ".metadata"))


def test_a_manager_saves_and_retires_through_the_process_engine(tmp_path: Path) -> None:
    """``CheckpointManager(options=SaveOptions(engine="process"))``: the manager's pointer and
    retention in the trainer, each step's save in the checkpoint process."""
    with dcpstore.CheckpointManager(
        str(tmp_path / "run"), keep=1, options=dcpstore.SaveOptions(async_=True, engine="process")
    ) as mgr:
        for step in (1, 2):
            state = {"w": torch.full((100,), float(step)), "step": step}
            handle = mgr.save(state, step)
            state["w"].zero_()  # the next optimizer step, before the save is written
            assert handle.result(timeout=120).engine == "process"
        mgr.wait()
        assert mgr.all_steps() == [2]
        loaded: dict[str, Any] = {"w": torch.zeros(100), "step": 0}
        assert mgr.load(loaded) == 2
    assert torch.equal(loaded["w"], torch.full((100,), 2.0)) and loaded["step"] == 2
