"""scripts/gpu-check.sh and its parts, without a GPU: the benchmark's dry
run, the summary over real pytest reports, the script's arguments, and (slow)
the whole dry run end to end. What they check is the plumbing; the
measurements themselves need the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    return gpu_check


@pytest.fixture
def gpu_stage(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_stage

    return gpu_stage


PASS = "def test_passes():\n    pass\n"
FAIL = "def test_fails():\n    assert 1 == 2, 'the snapshot differs'\n"
SKIP = "@pytest.mark.skip(reason='needs a CUDA device')\ndef test_skipped():\n    pass\n"


def junit_report(out_dir: Path, body: str) -> None:
    """Write out_dir/cuda-tests.xml: a real pytest JUnit report of a
    throwaway test file, run outside this project's configuration."""
    work = out_dir / "throwaway"
    work.mkdir(exist_ok=True)
    test_file = work / "test_throwaway.py"
    test_file.write_text("import pytest\n" + body)
    xml = out_dir / "cuda-tests.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-c",
            os.devnull,
            "-p",
            "no:cacheprovider",
            f"--rootdir={work}",
            f"--junitxml={xml}",
            str(test_file),
        ],
        cwd=work,
        capture_output=True,
        timeout=120,
        env=dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"),
    )
    assert xml.exists()


def test_benchmark_dry_run_writes_what_the_summary_reads(tmp_path: Path, gpu_stage: Any, gpu_check: Any) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert gpu_stage.main(["--dry-run", "--json", str(out / "gpu_stage.json")]) == 0
    result = json.loads((out / "gpu_stage.json").read_text())
    assert result["dry_run"] and result["device"] == "cpu"
    assert [r["bytes"] > 0 and r["stage_gbps"] > 0 and r["limit_gbps"] > 0 for r in result["staging"]] == [True, True]
    assert all(r["sweep"] and r["ratio"] > 0 for r in result["staging"])
    (blocked,) = result["blocked"]
    names = [r["name"] for r in blocked["rows"]]
    assert names[0] == "dcpstore-native" and "dcp.async_save" in names
    assert "steady_s" in blocked["rows"][0] and blocked["ratio_vs_dcp_default"] > 0
    # A dry run judges nothing.
    assert {g["met"] for g in result["goals"].values()} == {None}
    # Out of time: every size is skipped, and says so.
    assert gpu_stage.main(["--dry-run", "--budget-s", "0", "--json", str(tmp_path / "none.json")]) == 0
    late = json.loads((tmp_path / "none.json").read_text())
    assert late["staging"] == [] and late["blocked"] == []
    assert [(s["phase"], s["why"]) for s in late["skipped"]] == [("staging", "time budget")] * 2 + [
        ("blocked", "time budget")
    ]

    junit_report(out, PASS)
    summary = gpu_check.summarise(str(out), tests_rc=0, bench_rc=0, dry_run=True)
    assert summary["ok"] and summary["tests"]["passed"] == 1
    assert [r["ratio"] for r in summary["benchmark"]["staging"]] == [r["ratio"] for r in result["staging"]]
    assert not gpu_check.summarise(str(out), tests_rc=0, bench_rc=1, dry_run=True)["ok"]
    os.remove(out / "gpu_stage.json")
    assert not gpu_check.summarise(str(out), tests_rc=0, bench_rc=0, dry_run=True)["ok"]


def test_summary_records_the_interference_benchmark(tmp_path: Path, gpu_check: Any) -> None:
    """The summary carries interference.json's rows (a real, tiny run of
    benchmarks/interference.py) and fails when that step failed or left no
    results; a run that skipped the step is judged without it."""
    (tmp_path / "gpu_stage.json").write_text(json.dumps({"goals": {}, "staging": [], "blocked": [], "skipped": []}))
    junit_report(tmp_path, PASS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "interference.py"),
            "--size",
            "2MiB",
            "--tensors",
            "2",
            "--repeat",
            "1",
            "--targets",
            "local",
            "--only",
            "^dcpstore native$",
            "--no-gil",
            "--json",
            str(tmp_path / "interference.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=True, interference_rc=0)
    assert summary["ok"] and summary["interference"]["ok"]
    (row,) = summary["interference"]["rows"]
    assert row["name"] == "dcpstore native" and row["status"] == "ok" and row["lost_s_per_gb"] is not None
    assert not gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=True, interference_rc=124)["ok"]
    os.remove(tmp_path / "interference.json")
    assert not gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=True, interference_rc=0)["ok"]
    assert gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=True)["interference"] is None


def test_summary_counts_failures_and_refuses_skips_on_a_gpu_run(tmp_path: Path, gpu_check: Any) -> None:
    (tmp_path / "gpu_stage.json").write_text(json.dumps({"goals": {}, "staging": [], "blocked": [], "skipped": []}))
    junit_report(tmp_path, PASS + FAIL + SKIP)
    summary = gpu_check.summarise(str(tmp_path), tests_rc=1, bench_rc=0, dry_run=False)
    tests = summary["tests"]
    assert (tests["passed"], tests["failures"], tests["skipped"]) == (1, 1, 1)
    assert not summary["ok"]
    outcomes = {t["test"]: t["outcome"] for t in tests["not_passed"]}
    assert outcomes == {"test_fails": "failure", "test_skipped": "skipped"}
    assert "the snapshot differs" in next(t["message"] for t in tests["not_passed"] if t["test"] == "test_fails")

    # Passes and skips only: fine on a dry run, not on a GPU, where every test must run.
    junit_report(tmp_path, PASS + SKIP)
    assert gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=True)["ok"]
    assert not gpu_check.summarise(str(tmp_path), tests_rc=0, bench_rc=0, dry_run=False)["ok"]
    os.remove(tmp_path / "cuda-tests.xml")  # no report at all (the run was killed)
    assert not gpu_check.summarise(str(tmp_path), tests_rc=124, bench_rc=0, dry_run=True)["ok"]


def test_script_refuses_unknown_arguments_and_explains_itself() -> None:
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-rn"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    assert "unknown argument: --dry-rn" in bad.stderr and "--fetch-wheels" in bad.stderr
    helped = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "--dry-run" in helped.stdout and "$OUT" in helped.stdout


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path: Path) -> None:
    """The whole script on this machine: environment, the cuda tests (run
    or skipped, as the machine allows), the benchmark's dry run, summary."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = {
        "env.json",
        "cuda-tests.xml",
        "cuda-tests.log",
        "gpu_stage.json",
        "gpu_stage.log",
        "interference.json",
        "interference.log",
        "local_disk.json",
        "local_disk.log",
        "local_costs.json",
        "local_costs.log",
        "summary.json",
    }
    assert files <= set(os.listdir(tmp_path))
    # The local disk's rows: dcpstore's save and load beside the raw writer's, measured.
    local = json.loads((tmp_path / "local_disk.json").read_text())["records"]
    assert {r["group"] for r in local} == {"dcpstore", "limit"}
    assert all(r["status"] == "ok" and r["write_cpu_s"] > 0 for r in local), local
    # The same disk against stock DCP, a clone and a CRC pass: every row ran and every goal was computed.
    costs = json.loads((tmp_path / "local_costs.json").read_text())
    assert set(costs["rows"]) >= {
        "dcpstore sync",
        "dcpstore sync direct",
        "stock dcp.save",
        "dcpstore async",
        "dcpstore async direct",
        "dcpstore load",
        "raw read",
        "dcpstore load cold",
        "dcpstore load direct",
        "raw read cold",
        "raw read cold, dcpstore's files",
    }
    assert all(row["median_s"] > 0 for row in costs["rows"].values()), costs["rows"]
    assert costs["goals"] and all(g["value"] > 0 for g in costs["goals"]), costs["goals"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] and summary["ok"] and summary["tests"]["tests"] >= 13
    rows = {r["name"]: r for r in summary["interference"]["rows"]}
    assert {
        "dcpstore native",
        "dcpstore default (engine='auto')",
        "dcp.async_save process + dcpstore.StorageWriter",
    } <= set(rows), rows
    assert all(r["status"] == "ok" for r in rows.values()), rows  # both executors, through the script
    assert summary["env"]["dcpstore_path"] == str(ROOT / "dcpstore")  # this checkout, not an installed copy
    assert "DRY RUN" in done.stdout and "GPU check" in done.stdout and "interference:" in done.stdout
