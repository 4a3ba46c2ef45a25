"""RELIABILITY.md holds what the suite holds: every row names tests pytest
collects, with the quick/slow markers they carry, and quotes only kill
counts the crash tests recorded (tests/reliability.py).

Each check also runs against a page with one drift put in, and must find it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import reliability

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def items() -> reliability.Items:
    return reliability.collect()


# -- RELIABILITY.md ------------------------------------------------------------------


def test_reliability_rows_name_the_tests_and_markers_the_suite_has(items: reliability.Items) -> None:
    page = (ROOT / "RELIABILITY.md").read_text()
    assert reliability.problems(page, items, reliability.read_counts()) == []


def test_the_reliability_check_finds_each_kind_of_drift(items: reliability.Items) -> None:
    counts = reliability.read_counts()
    header = "| Case | Injected | Points | Outcome | Reproduce |\n| --- | --- | --- | --- | --- |\n"
    page = header + (
        "| moved to slow | x | 20 | y | `tests/test_crash.py::test_kill_anywhere_in_a_managed_sync_save[overwrite]` |\n"
        "| gone | x | 1 | y | `tests/test_crash.py::test_no_such_test` |\n"
        "| wrong count | x | 20 | y | `tests/test_crash.py::test_kill_anywhere_in_a_save[sampled]` |\n"
        "| slow that is quick | x | 24 | y | slow: `tests/test_crash.py::test_kill_anywhere_in_a_save[sampled]` |\n"
        "| unrecorded | x | 3 | y | `tests/test_overwrite.py::test_every_point_of_an_overwrite_loads_old_or_new` |\n"
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
    row = "| `tests/test_tiered.py::test_sigkill_during_replication_leaves_whole_steps_local` | quick |"
    assert row in table
    assert "| `tests/test_tiered.py::test_sigkill_during_replication_leaves_whole_steps_s3` | slow |" in table
    assert reliability.count_problems(items, {"tests/test_x.py::gone": {}}) == [
        "tests/kill_counts.json: tests/test_x.py::gone is no test pytest collects"
    ]
