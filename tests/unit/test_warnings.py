"""dcpstore never changes the process's warning filters, at import or after a call.

It still keeps two warnings torch raises from inside its calls out of the
user's way (DCP's "torch.distributed is disabled ..." on a single-process
save or load; torch.frombuffer's "not writable" on a load's item views), by
ignoring them only while its own call runs (dcpstore._impl.util.warning_filters).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.util.warning_filters import ignoring

NO_DIST = "torch.distributed is disabled"


def test_importing_dcpstore_leaves_the_filters_alone() -> None:
    """Every filter change made while the package is imported comes from a
    third-party package (sympy adds one, via torch), none from dcpstore."""
    code = (
        "import sys, warnings\n"
        "callers = []\n"
        "def spy(real):\n"
        "    def f(*a, **k):\n"
        "        callers.append(sys._getframe(1).f_code.co_filename)\n"
        "        return real(*a, **k)\n"
        "    return f\n"
        "warnings.filterwarnings = spy(warnings.filterwarnings)\n"
        "warnings.simplefilter = spy(warnings.simplefilter)\n"
        "import dcpstore, dcpstore._impl.cli, dcpstore.adapters.fsdp, dcpstore.adapters.megatron, dcpstore._impl.engines.nvrx\n"
        "ours = [c for c in callers if '/dcpstore/' in c.replace('\\\\', '/')]\n"
        "assert not ours, ours\n"
        "assert not [f for f in warnings.filters if f[1] is not None and f[1].pattern.startswith(('torch.distributed', 'torch\\\\.distributed', 'The given'))]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_importing_torch_dcpstore_and_nvrx_prints_no_warning() -> None:
    """The environment setup.sh builds is quiet: no pynvml FutureWarning (the
    'pynvml' shim NVRx requires warns from 13.0 on; constraints.txt and the
    nvrx extra keep 12.x, nvidia-ml-py provides the module), nor any other."""
    code = "import torch, dcpstore, dcpstore._impl.cli, dcpstore.adapters.fsdp, dcpstore._impl.engines.nvrx, pynvml\n"
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr


def test_single_process_calls_raise_no_dcp_warning_and_leave_the_filters_alone(tmp_path: Path) -> None:
    state = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: loaded through an item view
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        dcpstore.save(state, str(tmp_path / "sync"), engine="native")
        dcpstore.save(state, str(tmp_path / "async"), async_=True, engine="native").result()
        out = {"w": torch.zeros(1 << 19)}
        dcpstore.load(out, str(tmp_path / "async"))
        assert warnings.filters == before
        ours = [str(w.message) for w in caught]
        dcp.save(state, checkpoint_id=str(tmp_path / "stock"), no_dist=True)  # the control: torch warns
        stock = [str(w.message) for w in caught][len(ours) :]
    assert torch.equal(out["w"], state["w"])
    assert not [m for m in ours if NO_DIST in m or "not writable" in m], ours
    assert [m for m in stock if NO_DIST in m], stock


def _run(*targets: object) -> None:
    threads = [threading.Thread(target=t) for t in targets]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_ignoring_is_scoped_and_safe_across_threads() -> None:
    """Calls on many threads at once (the saver's thread, the reader's
    threads): every warning inside is ignored, and afterwards the filters are
    exactly what they were (catch_warnings, used this way, leaks or loses
    filters)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)

        def use() -> None:
            for _ in range(300):
                with ignoring("quiet please"):
                    time.sleep(0)  # let the other threads in, mid-call
                    warnings.warn("quiet please: ignored")
                    time.sleep(0)

        _run(*[use] * 8)
        assert warnings.filters == before
        warnings.warn("quiet please: heard once the calls are done")
    assert [str(w.message) for w in caught] == ["quiet please: heard once the calls are done"]


def test_ignoring_never_undoes_another_threads_filter_changes() -> None:
    with warnings.catch_warnings():
        before = list(warnings.filters)
        done = threading.Event()

        def use() -> None:
            for _ in range(300):
                with ignoring("quiet please"):
                    time.sleep(0)

        def other() -> None:  # one thread making scoped changes of its own
            while not done.is_set():
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message="unrelated")
                    time.sleep(0)

        watcher = threading.Thread(target=other)
        watcher.start()
        _run(*[use] * 4)
        done.set()
        watcher.join()
        assert warnings.filters == before
        warnings.filterwarnings("error", message="mine")  # and a change made meanwhile stays
        with ignoring("quiet please"):
            pass
        assert warnings.filters[0][1].pattern == "mine"
