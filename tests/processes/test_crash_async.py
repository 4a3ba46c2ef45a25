"""SIGKILL an *async* save at >= 20 points, on every engine; nothing wrong ever loads.

Kill points span the whole save (see crashkit.py): staging (the caller's
thread, before ``save`` returns), the background write (each data file's
open, chunks, commit before and after its rename; NVRx's per-item writes),
the window between the last data file and the commit (manifest), the
commit itself (``.metadata`` before and after it lands, marker removal),
the ``latest`` pointer and retention. The child mutates its state as soon
as ``save`` returns, as training would.

The child saves through ``CheckpointManager(keep=1)``
(crashkit.run_managed_crashes): either step 2 beside a committed step 1,
which retention deletes once step 2 is committed, so retention races the
kill; or step 1 again over itself (``overwrite=True``, the same URI). After
each kill, exactly: the new step loads the state at ``save`` time (never
the mutated state, never a mixture) iff its ``.metadata`` landed; step 1
loads until retention's delete of it landed; an overwrite leaves exactly
the old state until the new ``.metadata`` landed and exactly the new one
after (never none, never a mixture); ``all_steps()`` lists exactly the committed steps
and ``load()`` picks the newest. ``dcpstore ls``'s listing agrees, a new
save over a wreck commits cleanly, and ``dcpstore gc`` removes every
leftover and nothing committed.
"""

from __future__ import annotations

import pytest

from dcpstore._impl.format.layout import METADATA
from tests.support.crashkit import Managed, forkserver, run_managed_crashes
from tests.support.extras import needs_nvrx

slow = pytest.mark.slow
#: engine, scenario, kill-point budget (None: every point). The quick run
#: keeps the native engine's retention race to 24 points; the overwrite,
#: NVRx and every point are in the slow run.
CASES = [
    pytest.param("native", "next", 24, id="native-next"),
    pytest.param("native", "overwrite", 24, id="native-overwrite", marks=slow),
    pytest.param("nvrx", "next", None, id="nvrx-next", marks=[needs_nvrx, slow]),
    pytest.param("nvrx", "overwrite", None, id="nvrx-overwrite", marks=[needs_nvrx, slow]),
    pytest.param("native", "next", None, id="native-next-all", marks=slow),
    pytest.param("native", "overwrite", None, id="native-overwrite-all", marks=slow),
    pytest.param("process", "next", 24, id="process-next", marks=slow),
    pytest.param("process", "overwrite", 24, id="process-overwrite", marks=slow),
]
#: Always killed at, whatever the budget: staging, the gap between the data
#: and the commit (the manifest), and both sides of the commit.
KEEP = (
    "stage:",
    "open:.dcpstore.",
    f"commit:{METADATA}",
    f"committed:{METADATA}",
)  # the manifest, marker and alive file


@pytest.fixture(scope="module")
def ctx():
    return forkserver()


@pytest.mark.parametrize(("engine", "scenario", "budget"), CASES)
def test_kill_anywhere_in_an_async_save(tmp_path, ctx, engine: str, scenario: str, budget: int | None) -> None:
    how = Managed({"async_": True, "engine": engine, "workers": 3})
    run_managed_crashes(ctx, str(tmp_path / "runs"), scenario, how, budget=budget, keep=KEEP, required=KEEP)
