"""Entries and the loop that measures them.

A benchmark is a table of :class:`Entry` objects: each is one way of getting
the same state dict onto storage and back (dcpstore on a backend and engine,
a peer such as ``dcp.save`` with ``FileSystemWriter``, or a hardware limit
such as plain threads writing files). :func:`run_entry` measures one entry
the same way for all, per repeat::

    entry.setup()                    # once; raises Skip if it cannot run here
    t0; wait = entry.save(state)     # returns when the caller may go on
    blocked = now - t0               #   (= the whole save when synchronous)
    wait(); write_s = now - t0       # data durable / committed
    drop the page cache              # so the load reads storage, not memory
    entry.load(dest); read_s         # into preallocated tensors
    compare dest with state          # a wrong result is a failure, not a number
    entry.cleanup()                  # remove what the save wrote

An entry whose dependency is missing here (a backend not installed, an
engine not built yet, a peer that cannot reach the endpoint) becomes a
``skipped`` record carrying the reason; an entry that breaks becomes a
``failed`` record. Neither stops the run.
"""

from __future__ import annotations

import abc
import logging
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dcpstore._impl.bench.measure import PeakRSS, Stopwatch, drop_page_cache, state_bytes, states_equal, zero_state

log = logging.getLogger(__name__)

#: Keys every JSON record carries (the schema the tests check).
RECORD_KEYS = (
    "name",
    "group",
    "backend",
    "engine",
    "mode",
    "workers",
    "ranks",
    "tensors",
    "bytes",
    "repeat",
    "status",
    "reason",
    "write_s",
    "write_gbps",
    "read_s",
    "read_gbps",
    "blocked_s",
    "write_cpu_s",
    "read_cpu_s",
    "phases",
    "bytes_written",
    "peak_rss_bytes",
    "rss_before_bytes",
    "rss_growth_bytes",
    "load_peak_rss_bytes",
    "cold_read",
    "verified",
)


class Skip(Exception):
    """The entry cannot run here; the message says why (shown as ``skipped: ...``)."""


@dataclass
class SaveOutcome:
    """What a finished save reports beyond its wall time (all optional)."""

    phases: dict[str, float] = field(default_factory=dict)
    bytes_written: int | None = None
    #: The engine that actually ran, where the entry resolves one (``auto``).
    engine: str | None = None


Waiter = Callable[[], SaveOutcome]


class Entry(abc.ABC):
    """One row of a benchmark table. Subclasses set the labels in ``__init__``."""

    name: str = ""
    group: str = "dcpstore"  # "limit", "peer" or "dcpstore"
    backend: str = ""
    engine: str = ""
    mode: str = "sync"  # "sync" or "async"
    workers: int = 1
    ranks: int = 1
    #: False for write-only entries (e.g. the clone() limit): no load is measured.
    reads: bool = True
    #: True where a load would otherwise be served from the page cache.
    page_cached: bool = True

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        """Check dependencies and connect; raise :class:`Skip` if it cannot run."""

    @abc.abstractmethod
    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        """Start saving ``state``; return once the caller may go on, with a
        callable that waits until the data is durable."""

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        """Read the saved state into ``dest`` in place (entries with ``reads``)."""
        raise NotImplementedError(f"{self.name} has no load")

    def cleanup(self) -> None:
        """Remove what the last save wrote."""

    def close(self) -> None:
        """Release connections; called once after the last repeat."""


def done(outcome: SaveOutcome | None = None) -> Waiter:
    """The waiter of a save that is already complete."""
    result = outcome or SaveOutcome()
    return lambda: result


@dataclass
class Record:
    name: str
    group: str
    backend: str
    engine: str
    mode: str
    workers: int
    ranks: int
    tensors: int
    bytes: int
    repeat: int = 0
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    write_s: float | None = None
    write_gbps: float | None = None
    read_s: float | None = None
    read_gbps: float | None = None
    blocked_s: float | None = None
    #: CPU seconds of this process (all threads, not children or servers)
    #: during the save (until durable) and the load: steadier than wall time
    #: on a shared machine.
    write_cpu_s: float | None = None
    read_cpu_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    bytes_written: int | None = None
    peak_rss_bytes: int | None = None
    rss_before_bytes: int | None = None
    #: peak - before of the same measurement: what the save itself added.
    rss_growth_bytes: int | None = None
    load_peak_rss_bytes: int | None = None
    cold_read: bool | None = None
    verified: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


#: Exceptions that mean "not available here" rather than "broken".
SKIP_ERRORS: tuple[type[BaseException], ...] = (Skip, NotImplementedError, ImportError)


def run_entry(
    entry: Entry,
    state: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    *,
    repeat: int = 1,
    drop_caches: bool = True,
    verify: bool = True,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Measure ``entry`` ``repeat`` times; never raises for the entry's own errors."""
    return measure_all([entry], state, dest, repeat=repeat, drop_caches=drop_caches, verify=verify, on_record=on_record)


def measure_all(
    entries: Sequence[Entry],
    state: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    *,
    repeat: int = 1,
    drop_caches: bool = True,
    verify: bool = True,
    on_record: Callable[[Record], None] | None = None,
    rss_ignore_pids: Collection[int] = (),
) -> list[Record]:
    """Measure every entry ``repeat`` times, *interleaved*: repeat 1 of every
    entry, then repeat 2 of every entry, ... so that a slow spell of a shared
    machine lands on all entries alike instead of on whichever ran then.

    Records come back grouped by entry (in ``entries`` order), then repeat.
    An entry that skips or fails stops there; the others go on. Child
    processes in ``rss_ignore_pids`` (an S3 server the benchmark started)
    are left out of the RSS figures.
    """
    nbytes = state_bytes(state)
    records: dict[int, list[Record]] = {i: [] for i in range(len(entries))}

    def blank(entry: Entry, r: int) -> Record:
        return Record(
            entry.name,
            entry.group,
            entry.backend,
            entry.engine,
            entry.mode,
            entry.workers,
            entry.ranks,
            len(state),
            nbytes,
            repeat=r,
        )

    def emit(i: int, rec: Record) -> None:
        records[i].append(rec)
        if on_record:
            on_record(rec)

    active: list[int] = []
    for i, entry in enumerate(entries):
        try:
            entry.setup(state)
            active.append(i)
        except SKIP_ERRORS as e:
            emit(i, _mark(blank(entry, 0), "skipped", e))
        except Exception as e:
            emit(i, _mark(blank(entry, 0), "failed", e))
    try:
        for r in range(repeat):
            for i in list(active):
                entry, rec = entries[i], blank(entries[i], r)
                try:
                    _measure_once(entry, state, dest, rec, nbytes, drop_caches, verify, rss_ignore_pids)
                except SKIP_ERRORS as e:
                    _mark(rec, "skipped", e)
                except Exception as e:
                    log.debug("entry %s failed", entry.name, exc_info=True)
                    _mark(rec, "failed", e)
                finally:
                    _quietly(entry.cleanup, entry.name)
                emit(i, rec)
                if rec.status != "ok":
                    active.remove(i)
                    _quietly(entry.close, entry.name)
    finally:
        for i in active:
            _quietly(entries[i].close, entries[i].name)
    return [rec for i in range(len(entries)) for rec in records[i]]


def _mark(rec: Record, status: str, e: BaseException) -> Record:
    rec.status = status
    rec.reason = str(e) if isinstance(e, Skip) else _why(e)
    return rec


def _quietly(fn: Callable[[], None], name: str) -> None:
    try:
        fn()
    except Exception as e:  # cleanup must not hide the measurement
        log.warning("benchmark entry %s: cleanup failed: %s", name, _why(e))


def _measure_once(
    entry: Entry,
    state: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    rec: Record,
    nbytes: int,
    drop_caches: bool,
    verify: bool,
    rss_ignore_pids: Collection[int] = (),
) -> None:
    with PeakRSS(ignore_pids=rss_ignore_pids) as rss:
        with Stopwatch() as total:
            with Stopwatch() as stall:
                wait = entry.save(state)
            outcome = wait()
    rec.blocked_s, rec.write_s, rec.write_cpu_s = stall.s, total.s, total.cpu_s
    rec.write_gbps = _gbps(nbytes, total.s)
    rec.phases = dict(outcome.phases)
    rec.bytes_written = outcome.bytes_written
    rec.engine = outcome.engine or rec.engine
    rec.peak_rss_bytes, rec.rss_before_bytes = rss.peak, rss.before
    rec.rss_growth_bytes = rss.peak - rss.before

    if not entry.reads:
        return
    zero_state(dest)
    rec.cold_read = drop_page_cache() if (drop_caches and entry.page_cached) else False
    with PeakRSS(ignore_pids=rss_ignore_pids) as load_rss:
        with Stopwatch() as read:
            entry.load(dest)
    rec.read_s, rec.read_gbps, rec.read_cpu_s = read.s, _gbps(nbytes, read.s), read.cpu_s
    rec.load_peak_rss_bytes = load_rss.peak
    if verify:
        rec.verified = states_equal(state, dest)
        if not rec.verified:
            raise AssertionError("the loaded tensors differ from the saved ones")


# ---------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------

_MEDIAN_KEYS = (
    "write_s",
    "write_gbps",
    "read_s",
    "read_gbps",
    "blocked_s",
    "write_cpu_s",
    "read_cpu_s",
    "peak_rss_bytes",
    "rss_before_bytes",
    "rss_growth_bytes",
    "load_peak_rss_bytes",
)


def summarize(records: Iterable[Record | dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry name (first-seen order): medians over its ok repeats,
    or its skipped/failed reason."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        row = rec.to_json() if isinstance(rec, Record) else rec
        groups.setdefault(row["name"], []).append(row)
    out = []
    for rows in groups.values():
        ok = [r for r in rows if r["status"] == "ok"]
        bad = [r for r in rows if r["status"] != "ok"]
        first = dict(ok[0] if ok else rows[0])
        first["repeats"] = len(ok)
        if bad and not ok:
            first["status"], first["reason"] = bad[0]["status"], bad[0]["reason"]
        elif bad:  # some repeats ran, then one broke: keep the numbers, flag it
            first["status"], first["reason"] = bad[0]["status"], bad[0]["reason"]
        for key in _MEDIAN_KEYS:
            values = [r[key] for r in ok if r.get(key) is not None]
            first[key] = statistics.median(values) if values else None
        # The first save of an engine that keeps staging buffers allocates
        # them; later saves reuse them, so the median growth hides it.
        growths = [r["rss_growth_bytes"] for r in ok if r.get("rss_growth_bytes") is not None]
        first["rss_growth_max_bytes"] = max(growths) if growths else None
        phase_names = {p for r in ok for p in r.get("phases", {})}
        first["phases"] = {p: statistics.median(r["phases"].get(p, 0.0) for r in ok) for p in sorted(phase_names)}
        out.append(first)
    return out
