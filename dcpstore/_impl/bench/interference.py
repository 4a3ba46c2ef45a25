"""What a background save costs the loop that keeps training.

An async save's *blocked* time is only what the caller waits for; the rest
of the save (planning, serialisation, checksums, requests, commit) runs
while training goes on, and where it runs on threads of the training
process it competes with the training loop for the GIL, the cores and the
memory bus. This module measures that cost, the same way for every way of
saving in the background (a :class:`Row`):

* a *training step of fixed work* (:class:`StepWork`): many small tensor
  ops, like a GPU loop's CPU side (each op is a dispatch that holds the
  GIL; on a GPU a kernel launch), on one intra-op thread;
* per repeat: the step's *baseline* (median of steps with no save running),
  then one save started (``blocked_s``) and steps run until it is done;
  **lost step-seconds** = the sum of (step time - baseline) over those
  steps, **peak inflation** = the slowest of them / baseline;
* box-independent figures per GB saved: CPU seconds spent by the training
  process's *other* threads while the save ran (process CPU minus the
  training thread's), CPU seconds of child processes (a checkpoint process,
  NVRx's writers), and -- where ``py-spy`` is installed -- **GIL-held
  seconds** of the other threads: a separate pass samples which thread
  holds the GIL (``py-spy record --gil --nonblocking``, attached to this
  process), so the sampler never slows the timed repeats. GIL seconds a
  save's threads hold are seconds the training thread cannot dispatch,
  whatever the core count; the step timings say what that costs on this
  machine.

Rows are interleaved across repeats (repeat 1 of every row, then repeat 2,
...) after one warm-up save each (the first save of a structure allocates
staging buffers, starts processes), and reported as medians.
:class:`DcpstoreRow` is one row for any ``dcpstore.save(..., async_=True,
**kwargs)``: another engine or executor of dcpstore's own is one more row
with other keywords. ``benchmarks/interference.py`` adds the stock
``dcp.async_save`` rows (thread and process executors).

Used by ``dcpstore bench URI --interference`` and benchmarks/interference.py.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from dcpstore._impl.api import save
from dcpstore._impl.bench.entries import open_root
from dcpstore._impl.bench.runner import SKIP_ERRORS, Skip
from dcpstore._impl.engines.selection import engine_problem
from dcpstore._impl.storage import join_uri, open_storage, parse_uri
from dcpstore._impl.util.units import human_bytes

log = logging.getLogger(__name__)

#: Steps that make a baseline (their median), before each save.
BASELINE_STEPS = 30
#: The row a user gets: ``dcpstore.save(async_=True)`` with every default
#: (``engine="auto"``; its "runs on" column says what auto chose there).
DEFAULT_ROW = "dcpstore default (engine='auto')"
#: A save running longer than this fails its row (nothing hangs forever).
SAVE_TIMEOUT_S = 900.0
#: py-spy's sampling rate for the GIL pass (samples per second).
GIL_RATE = 200


class Pending(Protocol):
    """A save in the background: a ``SaveHandle``, a ``Future``."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class StepWork:
    """A training step of fixed work: ``ops`` chained small ops (a matmul of
    ``size`` x ``size``, an add, a ReLU) on ``device``, synchronised at the
    end on a GPU. Python dispatch dominates: each op holds the GIL."""

    def __init__(self, ops: int = 200, size: int = 64, device: str = "cpu") -> None:
        self.ops, self.size, self.device = ops, size, torch.device(device)
        g = torch.Generator().manual_seed(0)
        self._a = torch.randn(size, size, generator=g).to(self.device)
        self._b = (torch.randn(size, size, generator=g) / size).to(self.device)

    def __call__(self) -> float:
        """Run one step; its wall time in seconds."""
        t0 = time.perf_counter()
        x = self._a
        for _ in range(self.ops):
            x = torch.relu(x @ self._b + self._a)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def describe(self) -> str:
        return f"{self.ops} x (matmul {self.size}x{self.size} + add + relu) on {self.device}"


class Row(abc.ABC):
    """One way of saving in the background, measured by :func:`measure`."""

    name: str = ""
    #: Where the bytes go: "local", "s3", ...
    target: str = ""
    #: Where the background work runs: "threads" (of the training process)
    #: or "process" (a process of its own).
    executor: str = "threads"

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        """Check dependencies; raise :class:`Skip` if the row cannot run here."""

    @abc.abstractmethod
    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        """Start save number ``n`` of ``state``; return once the caller may
        go on (training may then change the tensors)."""

    def cleanup(self) -> None:
        """Remove what the saves wrote."""


class DcpstoreRow(Row):
    """``dcpstore.save(state, uri, async_=True, **save_kwargs)`` (each save
    to its own URI under ``root_uri``). Without ``engine`` (or with
    ``"auto"``) the row measures the default, and its ``executor`` becomes
    that of the engine auto chose, at the first save."""

    def __init__(self, name: str, root_uri: str, target: str, *, executor: str = "threads", **save_kwargs: Any) -> None:
        self.name, self.root_uri, self.target, self.executor = name, root_uri, target, executor
        self.save_kwargs = save_kwargs
        self._uris: list[str] = []

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        """Skip where the backend or the engine cannot save here (not installed, or not to this URI)."""
        storage = open_root(self.root_uri, enable_msc=bool(self.save_kwargs.get("enable_msc", False)))
        try:
            problem = engine_problem(str(self.save_kwargs.get("engine", "auto")), storage.backend, storage.uri)
        finally:
            storage.close()
        if problem:
            raise Skip(problem)

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        uri = join_uri(self.root_uri, f"save-{n}")
        self._uris.append(uri)
        handle = save(state, uri, async_=True, **self.save_kwargs)
        if self.save_kwargs.get("engine", "auto") == "auto":  # where the default runs is what the row measures
            self.executor = "process" if handle.engine == "process" else "threads"
        return handle

    def cleanup(self) -> None:
        for uri in self._uris:
            remove_uri(uri, enable_msc=bool(self.save_kwargs.get("enable_msc", False)))
        self._uris = []


def remove_uri(uri: str, *, enable_msc: bool = False) -> None:
    """Remove everything under ``uri`` (a local directory, or an object-store prefix)."""
    if parse_uri(uri).scheme == "file" and not enable_msc:
        shutil.rmtree(parse_uri(uri).path, ignore_errors=True)
        return
    storage = open_storage(uri, enable_msc=enable_msc)
    try:
        storage.delete([o["path"] for o in storage.list()])
    finally:
        storage.close()


# ---------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------


def _children_cpu(ignore: frozenset[int] = frozenset()) -> dict[int, float]:
    """CPU seconds of every live child process (recursive) but ``ignore``, by pid."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for child in psutil.Process().children(recursive=True):
        if child.pid in ignore:
            continue
        try:
            t = child.cpu_times()
            out[child.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


@dataclass
class CpuClock:
    """CPU seconds at one instant: the whole process (exited threads
    included), the calling (training) thread, reaped children, live children."""

    process: float
    training: float
    reaped: float
    live: dict[int, float]

    @classmethod
    def now(cls, ignore: frozenset[int] = frozenset()) -> CpuClock:
        """``ignore``: child processes that are not the save's (a storage server)."""
        t = os.times()
        return cls(time.process_time(), time.thread_time(), t.children_user + t.children_system, _children_cpu(ignore))

    def since(self, earlier: CpuClock) -> tuple[float, float]:
        """``(other threads of this process, child processes)`` CPU seconds since ``earlier``."""
        threads = (self.process - earlier.process) - (self.training - earlier.training)
        live = sum(v - earlier.live.get(pid, 0.0) for pid, v in self.live.items())
        return max(0.0, threads), max(0.0, (self.reaped - earlier.reaped) + live)


def find_pyspy() -> str | None:
    """The py-spy binary: ``$DCPSTORE_PYSPY``, else on ``PATH``."""
    return os.environ.get("DCPSTORE_PYSPY") or shutil.which("py-spy")


class GilSampler:
    """``py-spy record --gil`` attached to this process for the ``with``
    block; :attr:`held` then maps each native thread id to the seconds it was
    seen holding the GIL. Raises :class:`Skip` where py-spy cannot attach."""

    _THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)")

    def __init__(self, pyspy: str, rate: int = GIL_RATE) -> None:
        self.pyspy, self.rate = pyspy, rate
        self.held: dict[int, float] = {}
        self._dir = tempfile.mkdtemp(prefix="dcpstore-gil-")
        self._out = os.path.join(self._dir, "gil.txt")
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> GilSampler:
        cmd = [
            self.pyspy,
            "record",
            "--gil",
            "--threads",
            "--nonblocking",
            "-r",
            str(self.rate),
            "-f",
            "raw",
            "-o",
            self._out,
            "--pid",
            str(os.getpid()),
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self._proc.stdout is not None
        deadline = time.monotonic() + 20
        seen = b""
        while b"Sampling process" not in seen:  # attached
            line = self._proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self._stop()
                raise Skip(f"py-spy could not attach to this process: {seen.decode(errors='replace').strip()[-200:]}")
            seen += line
        return self

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __exit__(self, *exc: object) -> None:
        self._stop()
        try:
            with open(self._out) as f:
                for line in f:
                    found = self._THREAD.match(line)
                    if not found:
                        continue
                    tid = int(found.group(1), 0)
                    count = int(line.rsplit(" ", 1)[1])
                    self.held[tid] = self.held.get(tid, 0.0) + count / self.rate
        except OSError:
            pass
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@dataclass
class Sample:
    """One save of one row, with the steps that ran beside it."""

    blocked_s: float
    save_s: float
    baseline_s: float
    steps: list[float]
    cpu_threads_s: float
    cpu_children_s: float

    @property
    def lost_s(self) -> float:
        return sum(t - self.baseline_s for t in self.steps)

    @property
    def peak_inflation(self) -> float:
        return max(self.steps, default=self.baseline_s) / self.baseline_s


class Pinning:
    """Keep the training thread on ``cpu`` (None: anywhere) -- except while a
    save starts, so that threads the save creates from it are not pinned too
    (a new thread inherits its creator's CPUs)."""

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self._all = os.sched_getaffinity(0) if cpu is not None else set()

    def pin(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # pid 0: the calling thread only

    def unpin(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, self._all)


def _wait(pending: Pending, step: StepWork, steps: list[float], started: float) -> None:
    """Run steps until ``pending`` is done (raising its failure)."""
    while not pending.done():
        if time.perf_counter() - started > SAVE_TIMEOUT_S:
            raise TimeoutError(f"the save ran past {SAVE_TIMEOUT_S:g} s")
        steps.append(step())
    pending.result()


def measure_once(
    row: Row,
    state: dict[str, torch.Tensor],
    step: StepWork,
    n: int,
    pinning: Pinning,
    baseline_steps: int = BASELINE_STEPS,
    ignore_pids: frozenset[int] = frozenset(),
) -> Sample:
    """One repeat of ``row``: the baseline, then one save with steps beside it."""
    pinning.pin()
    try:
        baseline = statistics.median(step() for _ in range(baseline_steps))
        steps: list[float] = []
        before = CpuClock.now(ignore_pids)
        t0 = time.perf_counter()
        pinning.unpin()
        pending = row.start(state, n)
        pinning.pin()
        blocked = time.perf_counter() - t0
        _wait(pending, step, steps, t0)
        save_s = time.perf_counter() - t0
        threads, children = CpuClock.now(ignore_pids).since(before)
    finally:
        pinning.unpin()
    return Sample(blocked, save_s, baseline, steps, threads, children)


def gil_once(row: Row, state: dict[str, torch.Tensor], step: StepWork, n: int, pyspy: str) -> tuple[float, float]:
    """One more save of ``row`` with the GIL sampled: ``(seconds the other
    threads held it, seconds the training thread held it)``."""
    me = threading.get_native_id()
    steps: list[float] = []
    with GilSampler(pyspy) as sampler:
        t0 = time.perf_counter()
        _wait(row.start(state, n), step, steps, t0)
    others = sum(v for tid, v in sampler.held.items() if tid != me)
    return others, sampler.held.get(me, 0.0)


@dataclass
class Result:
    """A row's figures (medians over its repeats); ``status`` ok / skipped / failed."""

    name: str
    target: str
    executor: str
    bytes: int
    status: str = "ok"
    reason: str = ""
    repeats: int = 0
    blocked_s: float | None = None
    save_s: float | None = None
    baseline_s: float | None = None
    lost_s: float | None = None
    peak_inflation: float | None = None
    steps_during: int | None = None
    cpu_threads_s: float | None = None
    cpu_children_s: float | None = None
    gil_s: float | None = None
    gil_training_s: float | None = None
    gil_note: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)

    def per_gb(self, value: float | None) -> float | None:
        return None if value is None else value / (self.bytes / 1e9)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("lost_s", "cpu_threads_s", "cpu_children_s", "gil_s"):
            out[f"{key}_per_gb"] = self.per_gb(getattr(self, key))
        return out


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _median(values: Iterator[float]) -> float:
    return float(statistics.median(list(values)))


def measure(
    rows: Sequence[Row],
    state: dict[str, torch.Tensor],
    step: StepWork,
    *,
    repeat: int = 3,
    pin_cpu: int | None = None,
    gil: bool = True,
    budget_s: float | None = None,
    on_result: Callable[[Result], None] | None = None,
    ignore_pids: Collection[int] = (),
) -> list[Result]:
    """Every row: a warm-up save, then ``repeat`` measured saves interleaved
    across rows, then (``gil`` and py-spy found) one GIL-sampled save each.
    A row that cannot run is ``skipped``, one that breaks ``failed``; neither
    stops the others. Past ``budget_s`` seconds no further row is warmed up
    (it is ``skipped``) and no further repeat starts (rows then report the
    repeats they have). ``ignore_pids``: child
    processes whose CPU is not the saves' (a storage server this process
    started)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    started = time.monotonic()
    results = [Result(r.name, r.target, r.executor, nbytes) for r in rows]
    samples: list[list[Sample]] = [[] for _ in rows]
    pinning = Pinning(pin_cpu)
    counter = iter(range(1 << 30))
    live = []
    for row, res in zip(rows, results):
        if budget_s is not None and time.monotonic() - started > budget_s:
            res.status, res.reason = "skipped", "time budget"
            continue
        try:
            row.setup(state)
            _wait(row.start(state, next(counter)), step, [], time.perf_counter())  # warm-up, not measured
            res.executor = row.executor  # an engine="auto" row knows where it runs once it has saved
            live.append((row, res))
        except SKIP_ERRORS as e:
            res.status, res.reason = "skipped", _why(e)
        except Exception as e:  # noqa: BLE001 -- a broken row is a result, not the end of the run
            log.exception("%s: warm-up save failed", row.name)
            res.status, res.reason = "failed", _why(e)
    for r in range(repeat):
        if r and budget_s is not None and time.monotonic() - started > budget_s:
            break
        for row, res in live:
            if res.status != "ok":
                continue
            try:
                samples[rows.index(row)].append(
                    measure_once(row, state, step, next(counter), pinning, ignore_pids=frozenset(ignore_pids))
                )
            except Exception as e:  # noqa: BLE001
                log.exception("%s: save failed", row.name)
                res.status, res.reason = "failed", _why(e)
    pyspy = find_pyspy() if gil else None
    for row, res in live:
        got = samples[rows.index(row)]
        if res.status == "ok" and got:
            _fill(res, got)
            if not gil:
                res.gil_note = "not asked for"
            elif pyspy is None:
                res.gil_note = "py-spy not found (pip install py-spy, or set DCPSTORE_PYSPY)"
            elif budget_s is not None and time.monotonic() - started > budget_s:
                res.gil_note = "skipped: time budget"
            else:
                try:
                    res.gil_s, res.gil_training_s = gil_once(row, state, step, next(counter), pyspy)
                except Skip as e:
                    res.gil_note = str(e)
                    pyspy = None  # it will not attach for the next row either
                except Exception as e:  # noqa: BLE001
                    res.gil_note = f"failed: {_why(e)}"
        try:
            row.cleanup()
        except Exception as e:  # noqa: BLE001 -- leftovers are reported, the figures stand
            log.warning("%s: cleanup failed: %s", row.name, e)
        if on_result is not None:
            on_result(res)
    return results


def _fill(res: Result, got: list[Sample]) -> None:
    res.repeats = len(got)
    res.blocked_s = _median(s.blocked_s for s in got)
    res.save_s = _median(s.save_s for s in got)
    res.baseline_s = _median(s.baseline_s for s in got)
    res.lost_s = _median(s.lost_s for s in got)
    res.peak_inflation = _median(s.peak_inflation for s in got)
    res.steps_during = int(_median(float(len(s.steps)) for s in got))
    res.cpu_threads_s = _median(s.cpu_threads_s for s in got)
    res.cpu_children_s = _median(s.cpu_children_s for s in got)
    res.samples = [
        {
            "blocked_s": s.blocked_s,
            "save_s": s.save_s,
            "baseline_s": s.baseline_s,
            "lost_s": s.lost_s,
            "peak_inflation": s.peak_inflation,
            "steps": len(s.steps),
            "cpu_threads_s": s.cpu_threads_s,
            "cpu_children_s": s.cpu_children_s,
        }
        for s in got
    ]


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


TABLE_HEAD = [
    "row",
    "target",
    "runs on",
    "blocked s",
    "save s",
    "lost step-s",
    "peak inflation",
    "steps",
    "CPU s/GB threads / children",
    "GIL s/GB (training thread's)",
]


def table_rows(results: Sequence[Result]) -> list[list[str]]:
    """The results as table cells (:data:`TABLE_HEAD`); a row that did not run says why."""
    out = []
    for r in results:
        if r.status != "ok":
            out.append([r.name, r.target, r.executor, *(["-"] * 6), f"{r.status}: {r.reason}"])
            continue
        gil = (
            f"{_num(r.per_gb(r.gil_s), '.3f')} ({_num(r.per_gb(r.gil_training_s), '.2f')})"
            if r.gil_s is not None
            else r.gil_note or "-"
        )
        out.append(
            [
                r.name,
                r.target,
                r.executor,
                _num(r.blocked_s, ".3f"),
                _num(r.save_s, ".2f"),
                _num(r.lost_s, ".3f"),
                f"{_num(r.peak_inflation, '.2f')}x",
                str(r.steps_during),
                f"{_num(r.per_gb(r.cpu_threads_s), '.2f')} / {_num(r.per_gb(r.cpu_children_s), '.2f')}",
                gil,
            ]
        )
    return out


def text_table(results: Sequence[Result]) -> str:
    body = table_rows(results)
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(TABLE_HEAD)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [TABLE_HEAD, *body])


def describe(step: StepWork, nbytes: int, repeat: int, pin_cpu: int | None) -> str:
    pin = f", training thread pinned to CPU {pin_cpu}" if pin_cpu is not None else ""
    return (
        f"interference: one save of {human_bytes(nbytes)} per repeat beside a step of {step.describe()}, "
        f"{torch.get_num_threads()} intra-op thread(s), {os.cpu_count()} CPUs{pin}, repeat {repeat}"
    )
