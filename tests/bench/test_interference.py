"""The interference measurement (dcpstore/_impl/bench/interference.py): what a
background save costs a training step beside it. The accounting is checked
with rows whose cost is known in CPU seconds (not wall time, which a shared
machine bends): a thread that burns CPU holding the GIL, a child process
that burns CPU; then the real rows end to end, small."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstore._impl.bench.interference import (
    DcpstoreRow,
    GilSampler,
    Pending,
    Row,
    StepWork,
    find_pyspy,
    measure,
    text_table,
)
from dcpstore._impl.bench.report import git_commit
from dcpstore._impl.bench.runner import Skip
from dcpstore._impl.engines import saver as saver_module
from dcpstore._impl.engines import selection
from dcpstore._impl.engines.saver import AsyncSaver

ROOT = Path(__file__).resolve().parents[2]
BURN_S = 0.3


def _burn(seconds: float) -> None:
    """Hold the GIL and a core for ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(200))


class _ThreadRow(Row):
    name, target, executor = "burns on a thread", "nowhere", "threads"

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        future: Future[None] = Future()

        def run() -> None:
            _burn(BURN_S)
            future.set_result(None)

        threading.Thread(target=run, name="fake-saver").start()
        return future


def _child_burn() -> None:
    _burn(BURN_S)


class _ProcessRow(Row):
    name, target, executor = "burns in a child", "nowhere", "process"

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        proc = multiprocessing.get_context("fork").Process(target=_child_burn)
        proc.start()
        future: Future[None] = Future()
        threading.Thread(target=lambda: (proc.join(), future.set_result(None))).start()
        return future


class _Broken(Row):
    name, target = "breaks", "nowhere"

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        raise RuntimeError("the writer is broken")


class _Absent(Row):
    name, target = "absent", "nowhere"

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        raise Skip("its library is not installed")

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        raise AssertionError("never started")


def test_cpu_of_a_save_is_told_apart_from_the_training_threads() -> None:
    """A save that burns CPU on a thread shows as the process's other
    threads' CPU, one in a child process as the children's; the steps that
    ran beside either are counted; a broken row fails and an absent one is
    skipped, with their reasons, and the others still run."""
    state = {"t": torch.zeros(1024)}
    step = StepWork(ops=20, size=16)
    results = measure([_ThreadRow(), _ProcessRow(), _Broken(), _Absent()], state, step, repeat=2, gil=False)
    by = {r.name: r for r in results}
    thread, child = by["burns on a thread"], by["burns in a child"]
    for r in (thread, child):
        assert r.status == "ok" and r.repeats == 2 and r.steps_during and r.steps_during >= 1, r
        assert r.blocked_s is not None and r.save_s is not None and r.save_s >= r.blocked_s
        assert r.lost_s is not None and r.peak_inflation is not None and r.baseline_s
        assert r.gil_note == "not asked for" and r.gil_s is None
    assert thread.cpu_threads_s is not None and thread.cpu_threads_s >= 0.8 * BURN_S
    assert child.cpu_children_s is not None and child.cpu_children_s >= 0.8 * BURN_S
    assert child.cpu_threads_s is not None and child.cpu_threads_s < 0.5 * BURN_S
    assert (by["breaks"].status, by["breaks"].reason) == ("failed", "RuntimeError: the writer is broken")
    assert (by["absent"].status, by["absent"].reason) == ("skipped", "Skip: its library is not installed")
    table = text_table(results)
    assert "failed: RuntimeError: the writer is broken" in table and "burns in a child" in table
    assert thread.to_json()["cpu_threads_s_per_gb"] == pytest.approx(thread.cpu_threads_s / (4096 / 1e9))


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed (pip install py-spy, or set DCPSTORE_PYSPY)")
def test_gil_seconds_are_those_of_the_threads_that_held_it() -> None:
    """py-spy's GIL samples, attributed by thread: a thread that burns CPU
    in Python holds the GIL for about that long; a sleeping one not at all."""
    me = threading.get_native_id()
    ids: dict[str, int] = {}

    def burn() -> None:
        ids["burn"] = threading.get_native_id()
        _burn(0.5)

    def sleep() -> None:
        ids["sleep"] = threading.get_native_id()
        time.sleep(0.5)

    pyspy = find_pyspy()
    assert pyspy is not None
    try:
        with GilSampler(pyspy) as sampler:
            threads = [threading.Thread(target=burn), threading.Thread(target=sleep)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except Skip as e:
        pytest.skip(str(e))  # no ptrace here
    assert sampler.held.get(ids["burn"], 0.0) >= 0.25, sampler.held
    assert sampler.held.get(ids["sleep"], 0.0) < 0.1, sampler.held
    assert me not in ids.values()


def test_dcpstore_rows_save_and_clean_up(tmp_path: Path) -> None:
    """The real dcpstore row, small: every save it made is gone afterwards."""
    state = {f"t{i}": torch.randn(64 * 1024) for i in range(4)}
    row = DcpstoreRow("dcpstore native", str(tmp_path / "native"), "local", engine="native")
    cannot = DcpstoreRow("dcpstore NVRx", "memory://interference/nvrx", "memory", engine="nvrx")
    result, skipped = measure([row, cannot], state, StepWork(ops=20, size=16), repeat=1, gil=False)
    assert result.status == "ok", result.reason
    assert skipped.status == "skipped" and "nvrx" in skipped.reason.lower(), skipped  # not a failure
    assert result.bytes == 4 * 64 * 1024 * 4
    assert not any((tmp_path / "native").glob("save-*"))


@pytest.mark.parametrize("cores, runs_on", [(2, "threads"), (16, "process")])
def test_default_row_reports_where_auto_ran_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, runs_on: str
) -> None:
    """A row at engine="auto" is labelled by the engine auto chose, not by a
    guess made before the save (here auto is told the path is an object
    store, on 2 cores and on 16)."""
    monkeypatch.setattr(selection, "storage_kind", lambda backend, uri: "object store")
    monkeypatch.setattr(selection, "usable_cores", lambda: cores)
    own = AsyncSaver()  # this test's checkpoint process stops with it
    monkeypatch.setattr(saver_module, "_default_saver", own)
    state = {f"t{i}": torch.randn(16 * 1024) for i in range(2)}
    row = DcpstoreRow("dcpstore default", str(tmp_path / "default"), "local")
    try:
        (result,) = measure([row], state, StepWork(ops=20, size=16), repeat=1, gil=False)
    finally:
        own.close()
    assert result.status == "ok", result.reason
    assert result.executor == runs_on


def test_cli_bench_interference(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcpstore._impl.cli",
            "bench",
            str(tmp_path / "root"),
            "--interference",
            "--engine",
            "native",
            "--size",
            "4MiB",
            "--tensors",
            "4",
            "--repeat",
            "1",
            "-q",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "lost step-s" in done.stdout and "dcpstore native" in done.stdout
    doc = json.loads(out_json.read_text())
    (row,) = doc["results"]
    assert row["status"] == "ok" and row["lost_s_per_gb"] is not None
    assert doc["meta"]["git_commit"] == git_commit()  # None in a copy without git: a test runs from any copy
    assert not (tmp_path / "root").exists()  # the root it made is gone again


@pytest.mark.slow  # spawns torch's checkpoint process (a fresh interpreter importing torch)
def test_benchmark_runs_the_stock_executors_and_writes_its_metadata(tmp_path: Path) -> None:
    out_json = tmp_path / "interference.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "interference.py"),
            "--size",
            "4MiB",
            "--tensors",
            "4",
            "--repeat",
            "1",
            "--targets",
            "local",
            "--no-gil",
            "--root",
            str(tmp_path),
            "--only",
            "dcpstore native|dcpstore process|process \\+|thread \\+ FileSystemWriter",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out_json.read_text())
    got = {r["name"]: r for r in doc["results"]}
    assert set(got) == {
        "dcpstore native",
        "dcpstore process",
        "dcp.async_save thread + FileSystemWriter",
        "dcp.async_save process + FileSystemWriter",
        "dcp.async_save process + dcpstore.StorageWriter",
    }
    assert all(r["status"] == "ok" for r in got.values()), got
    assert got["dcp.async_save process + FileSystemWriter"]["executor"] == "process"
    assert got["dcpstore process"]["executor"] == "process"
    meta = doc["meta"]
    assert meta["git_commit"] == git_commit() and meta["machine"]["cpus"]
    assert meta["command"].startswith("python benchmarks/interference.py")
    assert os.listdir(tmp_path) == ["interference.json"]  # its scratch directory is gone
