"""Progress bars for long operations: saves, loads and verify (``progress=True``).

A :class:`Progress` is handed down to the code that moves the bytes, which
calls :meth:`Progress.start` once it knows how many it will move and
:meth:`Progress.update` as it goes, from any thread. It draws a tqdm bar on
stderr only when asked to (``enabled``); otherwise every call is a no-op, so
the code below never checks. Under ``torch.distributed`` the callers enable
it on one rank only (bars of several processes would overwrite each other
on one terminal).

Foundation layer: imports nothing of dcpstore's.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType

from tqdm import tqdm


class Progress:
    """One byte-counting progress bar, drawn only if ``enabled``.

    Args:
        desc: what the bar is about, e.g. ``"save s3://b/run/step100"``.
        enabled: draw it (``False``: every method does nothing).
    """

    def __init__(self, desc: str, *, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled
        self._bar: tqdm[None] | None = None
        self._lock = threading.Lock()

    def start(self, total: int) -> None:
        """Begin (or extend) the bar: ``total`` more bytes are to come."""
        if not self.enabled:
            return
        with self._lock:
            if self._bar is None:
                self._bar = tqdm(
                    total=total,
                    desc=self.desc,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    file=sys.stderr,
                    leave=False,
                    dynamic_ncols=True,
                )
            else:
                self._bar.total = (self._bar.total or 0) + total
                self._bar.refresh()

    def update(self, n: int) -> None:
        """``n`` more bytes are done (from any thread)."""
        if not self.enabled or n <= 0:
            return
        with self._lock:
            if self._bar is None:  # a mover that does not know its total
                self._bar = tqdm(
                    desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False
                )
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar (idempotent)."""
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


#: A progress that draws nothing (the default everywhere below the front doors).
NO_PROGRESS = Progress("", enabled=False)
