"""What a benchmark needs to measure honestly: the state, peak memory, cold reads.

* :func:`make_state` builds a deterministic state dict of float32 tensors of a
  given total size, split into a given number of tensors, so that every entry
  of a comparison saves *the same bytes*.
* :class:`PeakRSS` records the peak resident memory of this process (and its
  children, for peers that fork writers) while a block runs. On Linux it
  resets the kernel's high-water mark (``/proc/self/clear_refs``) so the peak
  is exact; elsewhere it falls back to sampling in a thread.
* :func:`drop_page_cache` empties the page cache (root only) so a load right
  after a save reads from the disk, not from memory.
"""

from __future__ import annotations

import os
import re
import resource
import threading
import time
from collections.abc import Collection
from types import TracebackType
from typing import Any

import torch

from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.units import human_bytes


def parse_int_list(text: str, what: str = "workers") -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]`` (positive ints, order kept, no duplicates)."""
    out: list[int] = []
    for part in str(text).split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise InvalidArgument(f"{what} {text!r}: expected comma-separated positive ints such as 1,2,4,8") from None
        if value < 1:
            raise InvalidArgument(f"{what} {text!r}: {value} is not a positive int")
        if value not in out:
            out.append(value)
    return out


# ---------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------


def make_state(nbytes: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors totalling ``nbytes`` (rounded down to whole
    elements; the last tensor takes the remainder). Deterministic in ``seed``."""
    if tensors < 1:
        raise InvalidArgument(f"tensors must be >= 1, got {tensors}")
    numel = nbytes // 4
    if numel < tensors:
        raise InvalidArgument(f"{human_bytes(nbytes)} is too small to split into {tensors} float32 tensors")
    each = numel // tensors
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    width = len(str(tensors - 1))
    for i in range(tensors):
        n = each if i < tensors - 1 else numel - each * (tensors - 1)
        state[f"t{i:0{width}d}"] = torch.empty(n, dtype=torch.float32).uniform_(generator=gen)
    return state


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def zero_state(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


def states_equal(a: dict[str, torch.Tensor], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(isinstance(b[k], torch.Tensor) and torch.equal(v, b[k]) for k, v in a.items())


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_hwm() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def current_rss(children: bool = False, ignore: Collection[int] = ()) -> int:
    """RSS of this process, plus its live children's with ``children=True``
    (except the pids in ``ignore``: servers a benchmark started, whose memory
    is the storage, not the client's)."""
    import psutil

    me = psutil.Process()
    total = int(me.memory_info().rss)
    if children:
        for child in me.children(recursive=True):
            if child.pid in ignore:
                continue
            try:
                total += int(child.memory_info().rss)
            except psutil.Error:
                pass
    return total


class PeakRSS:
    """Peak RSS of this process plus its children while the block runs.

    ``before`` is the RSS on entry; ``peak`` the highest seen (bytes). This
    process's peak is the kernel's exact high-water mark where it can be
    reset (Linux); a thread samples the children (forked NVRx writers) every
    ``children_every_s`` -- finding them scans every process, ~2 ms here, so
    it is kept rare to leave the CPU and the GIL to what is being measured --
    and this process too every ``interval_s`` where no high-water mark exists.
    """

    def __init__(
        self, interval_s: float = 0.01, children_every_s: float = 0.1, ignore_pids: Collection[int] = ()
    ) -> None:
        self.interval_s = interval_s
        self.children_every_s = children_every_s
        self.ignore_pids = ignore_pids
        self.before = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exact = False
        self._children = 0

    def _sample(self) -> None:
        import psutil

        interval = self.children_every_s if self._exact else self.interval_s
        every = max(1, round(self.children_every_s / interval))
        n = 0
        while not self._stop.wait(interval):
            try:
                if n % every == 0:
                    self._children = current_rss(children=True, ignore=self.ignore_pids) - current_rss()
                self.peak = max(self.peak, current_rss() + self._children)
            except psutil.Error:
                pass
            n += 1

    def __enter__(self) -> PeakRSS:
        # Children alive before the block (a multiprocessing manager left by
        # an earlier entry) count in ``before`` too, so they are not "growth".
        self.before = current_rss(children=True, ignore=self.ignore_pids)
        self._children = self.before - current_rss()
        self.peak = self.before
        self._exact = _reset_hwm()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="dcpstore-bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._exact:  # this process's exact peak plus its children as last sampled
            self.peak = max(self.peak, (_status_bytes("VmHWM") or 0) + self._children)


# ---------------------------------------------------------------------------
# Page cache
# ---------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False if not permitted.

    Needs root (``/proc/sys/vm/drop_caches``). It empties the cache of the
    whole machine, so it also slows other processes' next reads a little.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def process_cpu_s() -> float:
    """CPU seconds this process has used, all threads (not its children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Stopwatch:
    """``with Stopwatch() as sw: ...`` -- ``sw.s`` wall seconds of the block,
    ``sw.cpu_s`` this process's CPU seconds during it."""

    def __init__(self) -> None:
        self.s = self.cpu_s = 0.0
        self._t0 = self._c0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0, self._c0 = time.perf_counter(), process_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0
        self.cpu_s = process_cpu_s() - self._c0
