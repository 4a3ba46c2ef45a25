"""What a failing load has already changed in the caller's state dict.

A load reads large tensors straight into their destinations (no second copy
of the model in memory) and verifies each item's CRC32C once its bytes are
in: a damaged item is detected only after it has overwritten its
destination. Keeping every destination intact until the whole checkpoint is
verified would need either a second copy of the state (read into scratch,
verify, then copy) or a second pass over the storage (verify, then read);
benchmarks/load_verify_cost.py measures both against the in-place path.
dcpstore keeps the in-place path and says exactly what a failed load
changed instead:

* Structural damage (a missing or truncated data file, a size that disagrees
  with the manifest, a damaged ``.metadata``) and mismatched destinations
  are found before any byte is read: nothing is changed.
* Content damage stops the load at the first damaged item: no job starts a
  new item once one has failed. The error lists, for this rank, the keys
  already loaded (verified values from the checkpoint), those loaded only
  in part (resharding reads some keys in several pieces), and those whose
  destination holds bytes that failed verification or were cut short;
  every other key is unchanged. The lists are also attributes of the error
  (``loaded_keys``, ``partly_loaded_keys``, ``damaged_keys``).

Small tensors (under 64 KiB) and objects are verified before they are copied,
so they are never among the damaged.

A load tried again because its checkpoint was replaced meanwhile (see
:func:`~dcpstore._impl.dcp.load.load_state_dict`) counts what its earlier tries
changed too (:func:`merge_changes`): a try that succeeds sets every key, a
last one that fails names all the tries' changes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from dcpstore._impl.util.errors import CheckpointError, LoadError

#: Keys listed by name in an error message; the attributes hold them all.
SHOWN = 8

#: What a load left changed: its (loaded, partly loaded, damaged) keys, sorted.
Changes = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
NO_CHANGES: Changes = ((), (), ())


def changes_of(error: BaseException) -> Changes:
    """What an error of :meth:`LoadProgress.annotate` says its load changed."""
    v = vars(error)
    return tuple(v.get("loaded_keys", ())), tuple(v.get("partly_loaded_keys", ())), tuple(v.get("damaged_keys", ()))


def merge_changes(earlier: Changes, later: Changes) -> Changes:
    """What two tries of one load left changed, ``later`` after ``earlier``
    (a load tried again over a checkpoint replaced meanwhile): a key is as
    the later try left it where that touched it, except that bytes the
    earlier left damaged stay damaged unless the later loaded the whole key;
    as the earlier left it elsewhere."""
    loaded, partly, damaged = (set(keys) for keys in later)
    touched = loaded | partly | damaged
    damaged |= set(earlier[2]) - loaded
    partly = (partly | (set(earlier[1]) - touched)) - damaged
    loaded |= set(earlier[0]) - touched - damaged
    return tuple(sorted(loaded)), tuple(sorted(partly)), tuple(sorted(damaged))


class Stopped(Exception):
    """Raised in a read job that finds the load already failed elsewhere."""


class LoadProgress:
    """Per-key progress of one ``read_data`` call (thread-safe).

    Call order per item: :meth:`check` (before starting it), :meth:`exposing`
    (before unverified bytes go into its destination), :meth:`loaded` (once
    verified and committed). A job that fails calls :meth:`fail`.
    """

    def __init__(self, planned: Iterable[str], earlier: Changes = NO_CHANGES) -> None:
        self._planned = Counter(planned)
        self._earlier = earlier  # what earlier tries of this load changed
        self._loaded: Counter[str] = Counter()
        self._exposed: Counter[str] = Counter()  # unverified bytes in the destination
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self.error: BaseException | None = None

    def check(self) -> None:
        if self._failed.is_set():
            raise Stopped

    def exposing(self, keys: Iterable[str], *, undo: bool = False) -> None:
        """Unverified bytes are about to go into these keys' destinations
        (``undo``: after all, none went)."""
        with self._lock:
            if undo:
                self._exposed.subtract(keys)
            else:
                self._exposed.update(keys)

    def loaded(self, keys: Iterable[str], *, exposed: bool = False) -> None:
        with self._lock:
            for key in keys:
                self._loaded[key] += 1
                if exposed:
                    self._exposed[key] -= 1

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None and not isinstance(error, Stopped):
                self.error = error
        self._failed.set()

    # -- after the jobs -----------------------------------------------------
    def lists(self) -> tuple[list[str], list[str], list[str]]:
        """(loaded, partly loaded, damaged) keys, sorted, earlier tries' included."""
        with self._lock:
            damaged = sorted(k for k, n in self._exposed.items() if n > 0)
            loaded = sorted(k for k, n in self._loaded.items() if n >= self._planned[k] and k not in damaged)
            partly = sorted(k for k, n in self._loaded.items() if 0 < n < self._planned[k] and k not in damaged)
        if self._earlier == NO_CHANGES:
            return loaded, partly, damaged
        merged = merge_changes(self._earlier, (tuple(loaded), tuple(partly), tuple(damaged)))
        return list(merged[0]), list(merged[1]), list(merged[2])

    def annotate(self, error: BaseException, uri: str) -> CheckpointError:
        """The error to raise: the first real failure (not a job that merely
        stopped), saying which keys it left changed on this rank."""
        cause = self.error or error
        loaded, partly, damaged = self.lists()
        changed = []
        if loaded:
            changed.append(f"loaded {_names(loaded)}")
        if partly:
            changed.append(f"partly loaded {_names(partly)}")
        if damaged:
            changed.append(f"holding damaged or unverified bytes {_names(damaged)}")
        if changed:
            what = f"the load stopped after changing {len(loaded) + len(partly) + len(damaged)} key(s) on this rank: "
            what += "; ".join(changed) + "; every other key is unchanged"
        else:
            what = "no key was changed"
        if isinstance(cause, CheckpointError):
            out = type(cause)(f"{cause} ({what})")
            out.__dict__.update(cause.__dict__)
        else:
            out = LoadError(f"load from {uri} failed: {type(cause).__name__}: {cause} ({what})")
        vars(out).update(loaded_keys=tuple(loaded), partly_loaded_keys=tuple(partly), damaged_keys=tuple(damaged))
        out.__cause__ = cause
        return out


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
