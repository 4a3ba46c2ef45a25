"""BENCHMARKS.md and RELIABILITY.md hold what the evidence holds.

BENCHMARKS.md: every table and every figure is generated from a committed
result file (benchmarks/report.py), each file names its commit and its
command (the one the page tells a reader to run), and no target reads
"met" from a row that measured nothing. RELIABILITY.md: every row names
tests pytest collects, with the quick/slow markers they carry, and quotes
only kill counts the crash tests recorded (tests/support/reliability.py).

Each check also runs against a page with one drift put in, and must find it.
All of it holds on any copy of the repository (a shallow clone, a source
archive without git): how old a result is against its code needs this
repository's history, so it is reported (``report.py --check``, CI), never
asserted; its test builds a small repository of its own.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import reliability

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> ModuleType:
    """benchmarks/report.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs(report: ModuleType) -> dict[str, Any]:
    return dict(report.read_results())


@pytest.fixture(scope="module")
def items(pytestconfig: pytest.Config) -> reliability.Items:
    return reliability.collect(pytestconfig)


# -- BENCHMARKS.md -----------------------------------------------------------------


def test_benchmarks_is_what_the_committed_result_files_give(report: ModuleType, docs: dict[str, Any]) -> None:
    page = (ROOT / "BENCHMARKS.md").read_text()
    assert report.problems(page, docs) == []


def test_a_hand_written_figure_is_refused(report: ModuleType, docs: dict[str, Any]) -> None:
    page = (ROOT / "BENCHMARKS.md").read_text()
    drifted = page.replace("## The machine\n", "## The machine\n\nThe save took 0.35 s, 1.26x the limit.\n", 1)
    found = report.loose_figures(drifted, docs)
    assert [f.split(" (")[0] for f in found] == ["0.35 s", "1.26x"], found
    # Settings the files record, bounds and versions are not figures.
    assert report.loose_figures("through +20 ms and 25 MB/s per connection, >= 0.85x, torch 2.13", docs) == []


def test_an_edited_generated_figure_or_table_is_refused(report: ModuleType, docs: dict[str, Any]) -> None:
    page = (ROOT / "BENCHMARKS.md").read_text()
    marker = "<!-- fig target|local save -->"
    start = page.index(marker) + len(marker)
    edited = page[:start] + "0.99x" + page[page.index("<!-- /fig -->", start) :]
    assert any("differs from what the result files give" in p for p in report.problems(edited, docs))
    row = "| dcpstore local sync w=4 | local | 4 |"
    assert row in page
    assert any(
        "differs" in p for p in report.problems(page.replace(row, "| dcpstore local sync w=4 | local | 8 |"), docs)
    )


def test_a_met_target_needs_a_measurement(report: ModuleType, docs: dict[str, Any]) -> None:
    """The async staging cap read "met (0.00x)" from saves whose staging was
    allocated before they were measured: such a row is n/a, and a "met"
    from a ratio that rounds to nothing is refused."""
    import targets

    compare = docs["compare.json"]
    rows = report.summarize(compare["records"])
    warm = next(r for r in rows if r["name"] == "dcpstore local async/native w=4")
    title = "async save: peak RSS"
    target = next(t for t in targets.compare_targets(4) if t.title.startswith(title))
    renamed = dict(warm, name=target.ours)
    assert targets.evaluate(target, [renamed])["status"] == "n/a"  # the process-wide saver's buffers
    flagged = dict(renamed, extra={**renamed["extra"], "fresh_staging": True})
    assert targets.evaluate(target, [flagged])["status"] == "met"  # 48 KiB of growth: a ratio of 0.00
    records = [
        dict(r, name=target.ours, extra={**r["extra"], "fresh_staging": True})
        for r in compare["records"]
        if r["name"] == warm["name"]
    ]
    real = [r for r in compare["records"] if r["name"] != target.ours]  # the measured row, whatever it holds
    faked = {**docs, "compare.json": {**compare, "records": [*real, *records]}}
    assert any(title in p and "nothing was measured" in p for p in report.empty_met(faked))


def test_every_result_file_names_its_commit_and_command(report: ModuleType, docs: dict[str, Any]) -> None:
    assert report.metadata_problems(docs) == []
    doc = json.loads(json.dumps(docs["scale_sim.json"]))
    del doc["meta"]["command"]
    assert report.metadata_problems({"scale_sim.json": doc}) == [
        "benchmarks/results/scale_sim.json: its metadata has no command"
    ]
    assert "no block" in report.metadata_problems({"compare-wan.json": docs["compare.json"]})[0]


def test_the_regenerate_commands_are_the_ones_that_made_the_results(report: ModuleType, docs: dict[str, Any]) -> None:
    """report.py's COMMANDS and the page's Regenerate block name, for every
    result file a ``python ...`` command made, that very command (its label
    aside); a changed flag in either is refused."""
    page = (ROOT / "BENCHMARKS.md").read_text()
    assert report.command_problems(page, docs) == []
    made = docs["wan_scale.json"]["meta"]["command"]
    assert "--repeat 7" in made
    edited = page.replace("    --repeat 7 --only", "    --repeat 3 --only", 1)
    assert edited != page
    assert report.command_problems(edited, docs) == [
        f"BENCHMARKS.md: the Regenerate block lacks the command that made wan_scale.json: `{report.COMMANDS['wan_scale.json']}`"
    ]
    other = {
        **docs["wan_scale.json"],
        "meta": {**docs["wan_scale.json"]["meta"], "command": made.replace("--repeat 7", "--repeat 5")},
    }
    found = report.command_problems(page, {"wan_scale.json": other})
    assert len(found) == 1 and "was made by" in found[0] and "--repeat 5" in found[0]


def _commit(repo: Path, message: str) -> str:
    """Commit everything in ``repo``; its short hash. Settings of its own, so
    that a user's git configuration (signing, hooks) plays no part."""
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-q", "--no-verify", "-m", message], cwd=repo, check=True, capture_output=True)
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main_check(report: ModuleType, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``report.py --check`` on the committed page: its exit status, and
    "age unknown" if every age it printed is unknown (else its output)."""
    code = report.main(["--check", "--page", str(ROOT / "BENCHMARKS.md")])
    out = capsys.readouterr().out
    ages = [line for line in out.splitlines() if line.startswith("- ")]
    return code, "age unknown" if ages and all("age unknown" in line for line in ages) else out


def test_the_report_says_how_old_each_result_is_and_fails_nothing_for_it(
    report: ModuleType,
    docs: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ages`` counts the commits since a result's own that touch the code
    it measures, under that code's former names too, and calls the result
    stale past STALE_AFTER; a commit this copy's history lacks (a shallow
    clone), or a copy without git (an archive), leaves the age unknown. Neither is a problem of the page. Run in
    a repository of the test's own, so that it holds on a shallow clone."""
    if shutil.which("git") is None:
        pytest.skip("no git on this machine: ages() has nothing to count with")
    repo = tmp_path / "repo"
    old, new = repo / "dcpstore/_impl/dcp/old_writer.py", repo / "dcpstore/_impl/dcp/writer.py"  # writer.py is in LOCAL
    old.parent.mkdir(parents=True)
    old.write_text("measured = 0\n" * 20)
    (repo / "other.py").write_text("")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    measured = _commit(repo, "the benchmark ran here")
    old.write_text("measured = 1\n" * 20)
    _commit(repo, "touches the measured code under its former name")
    old.rename(new)
    _commit(repo, "moves it")
    for i in range(2):
        new.write_text(f"measured = {i + 2}\n" * 20)
        _commit(repo, "touches it again")
    (repo / "other.py").write_text("x = 1\n")
    _commit(repo, "touches nothing measured")

    page = (ROOT / "BENCHMARKS.md").read_text()
    compare = {**docs["compare.json"], "meta": {**docs["compare.json"]["meta"], "git_commit": measured}}
    aged = {**docs, "compare.json": compare}
    monkeypatch.setattr(report, "ROOT", str(repo))
    monkeypatch.setattr(report, "STALE_AFTER", 3)
    lines = {line.split(" ")[0]: line for line in report.ages(page, aged)}
    head = (
        f"compare.json ({compare['meta']['date'][:10]}, commit {measured}): 4 commits since touch the code it measures"
    )
    rerun = f"re-run `{compare['meta']['command']}` on a quiet box, then python benchmarks/report.py"
    assert lines["compare.json"] == f"{head}; stale (more than 3): {rerun}"
    scaling = docs["scaling.json"]["meta"][
        "git_commit"
    ]  # a commit the small repository lacks, as a shallow clone would
    assert lines["scaling.json"].endswith(
        f"age unknown: commit {scaling} is not in this repository's history (a shallow clone, or a squashed branch?)"
    )
    monkeypatch.setattr(report, "STALE_AFTER", 4)
    assert {line.split(" ")[0]: line for line in report.ages(page, aged)}["compare.json"] == head
    # Against a history that lacks every result's commit, the check passes and only says so.
    assert main_check(report, capsys) == (0, "age unknown")
    archive = tmp_path / "archive"  # no git directory in it, nor above it (GIT_CEILING_DIRECTORIES)
    archive.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setattr(report, "ROOT", str(archive))
    assert report.ages(page, docs)[0].endswith("age unknown: this copy has no git history (a source archive?)")
    assert main_check(report, capsys) == (0, "age unknown")


# -- RELIABILITY.md ------------------------------------------------------------------


def test_reliability_rows_name_the_tests_and_markers_the_suite_has(items: reliability.Items) -> None:
    page = (ROOT / "RELIABILITY.md").read_text()
    assert reliability.problems(page, items, reliability.read_counts()) == []


@pytest.mark.slow
def test_a_whole_suite_run_checks_against_the_same_tests_a_collection_of_its_own_finds(
    pytestconfig: pytest.Config,
) -> None:
    """The README's test command checks RELIABILITY.md against the session's
    own collection (taken before ``-m`` deselects): it must be what pytest
    collects in a process of its own, slow tests and markers included."""
    if not reliability._whole_suite(pytestconfig):
        pytest.skip("this run did not collect the whole suite (CI's slow run does)")
    mine = reliability.collect(pytestconfig)
    assert any("slow" in markers for markers in mine.values())
    assert mine == reliability.collect_apart()


def test_the_reliability_check_finds_each_kind_of_drift(items: reliability.Items) -> None:
    counts = reliability.read_counts()
    header = "| Case | Injected | Points | Outcome | Reproduce |\n| --- | --- | --- | --- | --- |\n"
    page = header + (
        "| moved to slow | x | 20 | y | `tests/processes/test_crash.py::test_kill_anywhere_in_a_managed_sync_save[overwrite]` |\n"
        "| gone | x | 1 | y | `tests/processes/test_crash.py::test_no_such_test` |\n"
        "| wrong count | x | 20 | y | `tests/processes/test_crash.py::test_kill_anywhere_in_a_save[sampled]` |\n"
        "| slow that is quick | x | 24 | y | slow: `tests/processes/test_crash.py::test_kill_anywhere_in_a_save[sampled]` |\n"
        "| unrecorded | x | 3 | y | `tests/integration/test_overwrite.py::test_every_point_of_an_overwrite_loads_old_or_new` |\n"
        "\n## What the suite does not cover\n\n- **Real S3.** No test names `absent: moto`.\n- **Nothing checked.**\n"
    )
    found = reliability.row_problems(reliability.rows(page), items, counts)
    expected = [
        "is listed as quick, but every case is slow",
        "is no test pytest collects",
        "Points says [20]",
        "is listed as slow, but runs in the quick suite",
        "no counts are recorded",
        "says no test does 'moto'",
        "needs a check",
    ]
    for text in expected:
        assert sum(text in p for p in found) == 1, (text, found)
    assert len(found) == len(expected), found


def test_the_kill_point_table_is_the_recorded_counts(items: reliability.Items) -> None:
    counts = reliability.read_counts()
    table = reliability.kill_table(items, counts)
    row = "| `tests/integration/test_tiered.py::test_sigkill_during_replication_leaves_whole_steps_local` | quick |"
    assert row in table
    assert (
        "| `tests/integration/test_tiered.py::test_sigkill_during_replication_leaves_whole_steps_s3` | slow |" in table
    )
    assert reliability.count_problems(items, {"tests/test_x.py::gone": {}}) == [
        "tests/support/kill_counts.json: tests/test_x.py::gone is no test pytest collects"
    ]
