"""Crash injection shared by the crash suites (test_crash*.py).

A crash run is a child process, forked from a forkserver that has torch and
dcpstore imported (a kill costs milliseconds, not an interpreter start),
that saves with a :class:`faults.KillAt` hook and SIGKILLs itself at the
n-th *event*. Events come from every layer a save passes through:

* storage calls (:class:`faults.EventStorage`): open, each chunk written,
  each commit before and after it lands, deletes, lists, reads;
* staging of an async save (``stage:copy`` per tensor, ``stage:done``):
  instrumented by :func:`instrument_staging`;
* NVRx's own data-file writes (``nvrx:item`` / ``nvrx:item-done`` around
  each item; NVRx writes data files itself, not through our Storage):
  :func:`instrument_nvrx`;
* S3 requests (``s3:<Operation>`` before and ``s3:<Operation>-done`` after
  each botocore call, on whichever thread makes it, e.g. the part-upload
  pool): :func:`instrument_s3`.

With the process engine a save runs in two processes, the trainer (staging,
the manager's pointer and retention) and its checkpoint process (the DCP
save), one after the other: their events are counted together
(:class:`faults.SharedEvents`; the checkpoint process installs its hook at
start-up, tests/support/worker_site/sitecustomize.py), and a kill at an event of
the checkpoint process kills the trainer with it, as the kernel does when
the trainer dies (the checkpoint process never outlives it).

A probe run records the events (:class:`faults.Recorder`) and
:func:`kill_points` picks where to kill: every structural event, plus a
spread over the repetitive ones (chunk writes, staging copies, NVRx items).

:func:`run_managed_crashes` is the suite every engine and backend shares
for a save through ``CheckpointManager(keep=1)`` that races the kill:
either the next step (retention deletes the previous one once the new one
is committed) or the same step again (``overwrite=True``, the same URI).
Each kill point gets its own root, so every expectation is exact.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

import dcpstore
from dcpstore._impl.cli import main as cli_main
from dcpstore._impl.format.layout import METADATA, is_manifest
from dcpstore._impl.manager import parse_step_dir, step_dir
from dcpstore._impl.storage import join_uri, open_storage
from dcpstore._impl.tools.maintenance import inspect_checkpoint, list_checkpoints
from tests.support import killcount
from tests.support.faults import Hook, KillAt, Recorder, SharedEvents, hook_all_storage, spread
from tests.support.helpers import assert_state_equal, zeros_like_state

#: Events that repeat per chunk / tensor: only a spread of them become kill points.
REPETITIVE = ("write:", "wrote:", "stage:copy", "nvrx:item")


def crash_state(seed: int, big: int = 256 * 1024) -> dict[str, Any]:
    """Ten layers, a nested bf16 optimizer entry, a plain int and one
    ``big``-element float32 tensor (several chunks / multipart parts)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"layer{i}.w": torch.randn(128, 96 + i, generator=g) for i in range(10)}
    state["opt"] = {"m": torch.randn(300, generator=g).bfloat16(), "step": seed}
    state["big"] = torch.randn(big, generator=g)
    return state


def mutate(state: dict[str, Any]) -> None:
    """What training does right after an async save returns."""
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.add_(1)
    state["opt"]["m"].add_(1)
    state["opt"]["step"] = -1


def kill_points(
    events: list[str],
    repetitive: int = 12,
    total: int | None = None,
    keep: tuple[str, ...] = (),
    always: Iterable[int] = (),
) -> list[int]:
    """Every structural event plus ``repetitive`` spread over the repetitive
    ones. With ``total``: then thinned evenly to about that many, always
    keeping the events that start with one of ``keep`` and the indices in
    ``always`` (the two sides of each transition a test judges)."""
    rep = [i for i, e in enumerate(events) if e.startswith(REPETITIVE)]
    structural = [i for i, e in enumerate(events) if not e.startswith(REPETITIVE)]
    points = sorted(structural + [rep[j] for j in spread(len(rep), repetitive)])
    pinned = {k for k in always if 0 <= k < len(events)}
    if total is not None and len(points) > total:
        kept = sorted(pinned | {k for k in points if keep and events[k].startswith(keep)})
        rest = [k for k in points if k not in kept]
        points = kept + [rest[j] for j in spread(len(rest), max(0, total - len(kept)))]
    return sorted(set(points) | pinned)


def commit_index(events: list[str]) -> int:
    """The first event at which the checkpoint counts as committed: once
    ``.metadata`` has landed (renamed into place; on S3, its ``PutObject``
    answered, which comes before our writer's own ``committed:`` event)."""
    start, end = events.index("commit:.metadata"), events.index("committed:.metadata")
    for i in range(start, end):
        if events[i] == "s3:PutObject-done":
            return i
    return end


def _delete_landed(events: list[str], start: int) -> int:
    """The first event after the delete reported at ``events[start]`` has
    taken effect: on S3 once its request is answered, elsewhere the next
    event (``EventStorage`` reports a delete before making it)."""
    for i in range(start + 1, len(events)):
        if not events[i].startswith("s3:"):
            break
        if events[i].endswith("-done"):
            return i
    return start + 1


def retire_index(events: list[str], step: int) -> int | None:
    """Where retention's delete of ``step``'s ``.metadata`` has landed (the
    step stops being a checkpoint there); None if retention never got to it."""
    name = f"{step_dir(step)}/{METADATA}"
    for i, e in enumerate(events):
        if e.startswith("delete:") and name in e.removeprefix("delete:").split(","):
            return _delete_landed(events, i)
    return None


def overwrite_expected(events: list[str], k: int) -> str:
    """What a save over a committed checkpoint, killed at event ``k``, must
    leave there: exactly the old checkpoint until the new ``.metadata``
    landed, exactly the new one from then on (never nothing, never a mixture)."""
    return "new" if k >= commit_index(events) else "old"


# -- instrumentation (runs in the crash child, or in a probe) ---------------


def instrument_staging(hook: Hook) -> None:
    """Report each tensor copy of async staging (on the caller's thread)."""
    from dcpstore._impl.engines.staging import Stager

    real = Stager._copy

    def copy(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        for buf, src in zip(buffers, sources):
            hook("stage:copy")
            real([buf], [src])
        hook("stage:done")

    Stager._copy = staticmethod(copy)  # type: ignore[method-assign]


def instrument_nvrx(hook: Hook) -> None:
    """Report each item NVRx's per-bucket writer writes into a data file."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fa

    real = fa._write_item

    @functools.wraps(real)  # NVRx inspects its signature
    def write_item(*args: Any, **kwargs: Any) -> Any:
        hook("nvrx:item")
        result = real(*args, **kwargs)
        hook("nvrx:item-done")
        return result

    fa._write_item = write_item


def instrument_s3(hook: Hook, options: dcpstore.StorageOptions) -> None:
    """Report every S3 request the (per-process, cached) client makes."""
    from dcpstore._impl.storage.backends.s3.storage import s3_client

    events = s3_client(options).meta.events
    events.register("before-call.s3", lambda model, **_: hook(f"s3:{model.name}"))
    events.register("after-call.s3", lambda model, **_: hook(f"s3:{model.name}-done"))


# -- running and judging ------------------------------------------------------


def age_temp_files(root: str, seconds: float = 600.0) -> None:
    """Make the temporary files under a local ``root`` look ``seconds`` old:
    what a crash left, found later. ``dcpstore gc`` keeps an in-progress
    write younger than the lease (it may be a running save's first file);
    an object store's uploads carry their own start time (moto: 2010)."""
    if "://" in root and not root.startswith("file://"):
        return
    past = time.time() - seconds
    for dirpath, _, names in os.walk(root.removeprefix("file://")):
        for name in names:
            if ".dcpstore-tmp-" in name or (name.startswith(".") and name.endswith(".tmp")):
                os.utime(os.path.join(dirpath, name), (past, past))


def forkserver() -> mp.context.BaseContext:
    """The session's forkserver context, preloading dist_utils.PRELOAD
    (which names every crash suite, so their children import nothing)."""
    from tests.support.dist_utils import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _in_env(env: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def crash(ctx: mp.context.BaseContext, target: Callable[..., None], *args: Any, timeout: float = 120) -> int:
    """Run ``target(*args)`` in a child; its exit code (``-9``: SIGKILLed).

    The child runs in the caller's environment as of the call, as
    :func:`dist_utils.run_ranks`'s ranks do: the session's forkserver keeps
    the environment it started with, which may predate a fixture's (an S3
    endpoint, an MSC config)."""
    proc = ctx.Process(target=_in_env, args=(dict(os.environ), target, args))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"crash child {target.__name__}{args} hung")
    return int(proc.exitcode)


def outcome(uri: str, expected: dict[str, Any], **load_kwargs: Any) -> str:
    """``"absent"`` (no committed checkpoint) or ``"complete"`` (loads
    exactly ``expected``); anything else fails the test."""
    restored = zeros_like_state(expected)
    try:
        dcpstore.load(restored, uri, **load_kwargs)
    except dcpstore.CheckpointNotFound:
        return "absent"
    assert_state_equal(expected, restored)
    return "complete"


def which_state(uri: str, candidates: dict[str, dict[str, Any]], **load_kwargs: Any) -> str:
    """``"absent"``, or the name of the one candidate the checkpoint at
    ``uri`` loads as, every value exact. A mixture, a partial load or any
    other error fails the test."""
    restored = zeros_like_state(next(iter(candidates.values())))
    try:
        dcpstore.load(restored, uri, **load_kwargs)
    except dcpstore.CheckpointNotFound:
        return "absent"
    for name, state in candidates.items():
        try:
            assert_state_equal(state, restored)
        except AssertionError:
            continue
        return name
    raise AssertionError(f"{uri} loads none of {sorted(candidates)} exactly: a mixture")


# -- saves through CheckpointManager(keep=1), killed anywhere ------------------

#: scenario -> the step a crash child saves; its root holds committed step 1.
#: "next": step 2, after whose commit retention (keep=1) deletes step 1.
#: "overwrite": step 1 again, over itself (the same URI).
SCENARIOS = {"next": 2, "overwrite": 1}


@dataclass(frozen=True)
class Managed:
    """How a crash child saves: ``CheckpointManager(root, keep=1, options=SaveOptions(**kwargs))``."""

    #: The save options (async_, engine, workers, storage_options).
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Elements of crash_state's big tensor.
    big: int = 256 * 1024
    #: Environment for the child (the forkserver predates the test's); None unsets.
    env: dict[str, str | None] = field(default_factory=dict)
    #: Where a save in two processes counts its events (run_managed_crashes makes it).
    events_dir: str | None = None

    @property
    def io(self) -> dict[str, Any]:
        """What dcpstore.save / load need beside the URI."""
        options = self.kwargs.get("storage_options")
        return {"storage_options": options} if options is not None else {}

    @property
    def options(self) -> dcpstore.SaveOptions:
        """``kwargs`` as the manager's options (async unless they say not)."""
        return dcpstore.SaveOptions(**{"async_": True, **self.kwargs})

    @property
    def reader_options(self) -> dcpstore.SaveOptions:
        """The options of a manager that only lists and loads: ``io``."""
        return dcpstore.SaveOptions(async_=True, **self.io)

    def state(self, seed: int) -> dict[str, Any]:
        return crash_state(seed, big=self.big)


def _managed_save(root: str, scenario: str, how: Managed, hook: Hook) -> None:
    if isinstance(hook, SharedEvents):  # the checkpoint process installs the same hook
        os.environ.update(hook.environment())
    for key, value in how.env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if root.startswith("s3://"):
        instrument_s3(hook, how.kwargs.get("storage_options") or dcpstore.StorageOptions())
    instrument_staging(hook)
    if how.kwargs.get("engine") == "nvrx":
        instrument_nvrx(hook)
    hook_all_storage(hook)
    state = how.state(2)
    manager = dcpstore.CheckpointManager(root, keep=1, options=how.options)
    manager.save(state, SCENARIOS[scenario], overwrite=scenario == "overwrite")
    mutate(state)  # training goes on; an async checkpoint must not see this
    manager.close()  # waits, then writes the pointer and applies retention


def _in_two_processes(how: Managed) -> bool:
    """Whether the save runs in a checkpoint process (the process engine):
    its events are counted across the trainer and that process."""
    return how.kwargs.get("engine") == "process"


def _shared_events(how: Managed, kill_at: int | None) -> SharedEvents:
    fd, path = tempfile.mkstemp(dir=how.events_dir)
    os.close(fd)
    return SharedEvents(path, os.getpid(), kill_at)


def managed_child(root: str, scenario: str, how: Managed, kill_at: int) -> None:
    _managed_save(root, scenario, how, _shared_events(how, kill_at) if _in_two_processes(how) else KillAt(kill_at))


def managed_probe(root: str, scenario: str, how: Managed, queue: Any) -> None:
    recorder = _shared_events(how, None) if _in_two_processes(how) else Recorder()
    _managed_save(root, scenario, how, recorder)
    queue.put(recorder.events)


def _seeded_root(base: str, name: str, how: Managed) -> str:
    """A manager root under ``base`` holding committed step 1 (seed 1)."""
    root = join_uri(base, name)
    dcpstore.save(how.state(1), dcpstore.CheckpointManager(root, options=how.reader_options).step_uri(1), **how.io)
    return root


def run_managed_crashes(
    ctx: mp.context.BaseContext,
    base: str,
    scenario: str,
    how: Managed,
    *,
    budget: int | None,
    keep: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    before_gc: Callable[[], None] | None = None,
) -> list[str]:
    """Kill a managed save (see :data:`SCENARIOS`) at every point of a probe
    run (thinned to ``budget``, keeping events that start with ``keep``),
    each in its own root under ``base``; each of ``required`` must start
    some killed event.

    After each kill, exactly: the new step loads (every value) iff its
    ``.metadata`` landed, else it is absent; step 1 of "next" loads until
    retention's delete of its ``.metadata`` landed, absent after (retention
    runs only once step 2 is committed, so the newest committed step always
    loads); "overwrite" leaves what :func:`overwrite_expected` says, never a
    mixture; ``all_steps()`` lists exactly the committed steps and ``load()``
    picks the newest. Then ``dcpstore ls``'s listing agrees, a save over a
    wreck commits cleanly, and ``dcpstore gc`` removes every leftover and no
    committed step. Returns the probe's events, for backend-specific checks.
    """
    if _in_two_processes(how) and how.events_dir is None:
        with tempfile.TemporaryDirectory(prefix="dcpstore-crash-events-") as events_dir:
            return run_managed_crashes(
                ctx,
                base,
                scenario,
                dataclasses.replace(how, events_dir=events_dir),
                budget=budget,
                keep=keep,
                required=required,
                before_gc=before_gc,
            )
    queue = ctx.Queue()
    assert crash(ctx, managed_probe, _seeded_root(base, "probe", how), scenario, how, queue) == 0
    events: list[str] = queue.get(timeout=30)
    landed = commit_index(events)
    if scenario == "next":
        gone = retire_index(events, 1)
        assert gone is not None and gone > landed, "retention never deleted step 1 after step 2's commit"
    else:
        gone = None
    edges = [landed] + ([gone] if gone is not None else [])
    points = kill_points(events, total=budget, keep=keep, always=[i - d for i in edges for d in (0, 1)])
    assert len(points) >= 20 and points[0] < landed <= points[-1], (len(points), events)
    killed = [events[k] for k in points]
    missing = [r for r in required if not any(e.startswith(r) for e in killed)]
    assert not missing, f"no kill point at {missing}: {events}"
    committed: dict[str, list[int]] = {}  # root name -> committed steps, oldest first
    loads: dict[str, str] = {}  # root name -> what step 1 loads after an overwrite was killed
    for k in points:
        name = f"k{k:03d}"
        root = _seeded_root(base, name, how)
        manager = dcpstore.CheckpointManager(root, options=how.reader_options)
        code = crash(ctx, managed_child, root, scenario, how, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        where = f"kill point {k} ({events[k]})"
        if scenario == "next":
            new = "complete" if k >= landed else "absent"
            old = "complete" if gone is None or k < gone else "absent"
            steps = [s for s, found in ((1, old), (2, new)) if found == "complete"]
            assert manager.all_steps() == steps, where
            # A resume picks the newest committed step, and loads it exactly;
            # the other step is exact too, or absent (never partial).
            restored = zeros_like_state(how.state(1))
            assert manager.load(restored) == steps[-1], where
            assert_state_equal(how.state(steps[-1]), restored)
            other = 1 if steps[-1] == 2 else 2
            assert outcome(manager.step_uri(other), how.state(other), **how.io) == (old if other == 1 else new), where
        else:
            found = which_state(manager.step_uri(1), {"old": how.state(1), "new": how.state(2)}, **how.io)
            assert found == overwrite_expected(events, k), f"{where}: {found}"
            loads[name] = found
            steps = [] if found == "absent" else [1]
            assert manager.all_steps() == steps, where
        committed[name] = steps
    # The listing (what `dcpstore ls` prints) shows exactly the committed steps.
    storage = open_storage(base, **how.io)
    want = {f"{name}/{step_dir(s)}" for name, steps in committed.items() for s in steps}
    want |= {f"probe/{step_dir(s)}" for s in ([2] if scenario == "next" else [1])}
    listed = list_checkpoints(storage)
    assert {e.path for e in listed if e.committed} == want
    # Wrecks: uncommitted directories, and (an overwrite killed before its
    # clean-up) committed ones holding a second save's files.
    wrecks = [e.path for e in listed if not e.committed or e.leftovers or e.mixed]
    assert wrecks, "no kill left an interrupted save behind: the suite lost its point"
    # A new save over a wreck commits and leaves no stray file of the crash.
    for path in wrecks[:2]:
        uri = join_uri(base, path)
        dcpstore.save(how.state(3), uri, **how.io)
        assert outcome(uri, how.state(3), **how.io) == "complete"
        files = set(inspect_checkpoint(open_storage(uri, **how.io))["files"])
        names = {o["path"] for o in open_storage(uri, **how.io).list()}
        manifests = {n for n in names if is_manifest(n)}
        assert len(manifests) == 1 and names == files | {METADATA} | manifests
        name, directory = path.split("/")
        committed[name] = sorted({*committed[name], parse_step_dir(directory)})
        loads.pop(name, None)
        want.add(path)
    if before_gc is not None:
        before_gc()
    age_temp_files(base)
    assert cli_main(["gc", "--older-than", "0", base]) == 0
    assert list(storage.list_incomplete()) == []
    after = list_checkpoints(storage)
    assert all(e.committed for e in after) and {e.path for e in after} == want
    assert not [e.path for e in after if e.leftovers or e.mixed]  # the files no commit names went too
    for name, steps in committed.items():  # gc deleted no committed step
        assert dcpstore.CheckpointManager(join_uri(base, name), options=how.reader_options).all_steps() == steps
    for name, found in loads.items():  # ...and no file one needs
        uri = dcpstore.CheckpointManager(join_uri(base, name), options=how.reader_options).step_uri(1)
        assert which_state(uri, {"old": how.state(1), "new": how.state(2)}, **how.io) == found, name
    killcount.record(len(points), len(points), len(points))  # each one was asserted to kill
    return events
