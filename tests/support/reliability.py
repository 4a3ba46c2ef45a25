"""RELIABILITY.md against the suite: its rows name tests that exist, with
the markers they really carry, and its kill-point figures are the ones the
crash tests recorded.

    python tests/support/reliability.py            # check the page (what tests/docs/test_docs.py asserts)
    python tests/support/reliability.py --write    # regenerate its generated blocks from tests/support/kill_counts.json

The row format (RELIABILITY.md says it at its top): every table with a
``Reproduce`` column names its tests there as node ids in backticks, and
the bullets of "What the suite does not cover" do too (or name an
``absent: TEXT`` that no test file may contain). Short forms continue the
node id before them in the same cell: ``::name`` (another test of the same
file), ``[id]`` or ``...[id]`` (another case of the same test); ``*`` in an
id matches anything; ```-k word``` narrows the node id before it to the
cases whose name holds ``word``. Node ids after ``slow:`` in a cell run in
the slow run only (every case they match is marked slow); the others in
the quick suite (at least one case is not). ``(N quick, M slow)`` after a
node id states how many cases it has of each, ``(marker NAME)`` that every
case carries that marker. In a row that names a crash test recorded in
``tests/support/kill_counts.json``, every number in the ``Points`` column must be
one of those tests' recorded counts (points, or points that killed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "RELIABILITY.md"
COUNTS = ROOT / "tests" / "support" / "kill_counts.json"
ENV_HINT = "DCPSTORE_KILL_COUNTS=$PWD/tests/support/kill_counts.json python -m pytest -m '' NODE"
#: The section whose bullets each carry a check.
NOT_COVERED = "What the suite does not cover"
#: Generated blocks, as in BENCHMARKS.md.
BLOCK = re.compile(
    r"(<!-- BEGIN generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated:(?P=name) -->)", re.S
)

Items = dict[str, list[str]]  # node id -> marker names


# -- the page ------------------------------------------------------------------


@dataclass
class Ref:
    """One node id as a row names it."""

    text: str  # as written
    pattern: str  # the whole node id (``*`` globs)
    slow: bool
    k: str | None = None
    counts: tuple[int, int] | None = None  # (quick, slow) cases
    markers: list[str] = field(default_factory=list)


@dataclass
class Row:
    section: str
    line: int
    cells: dict[str, str]
    refs: list[Ref]

    def where(self) -> str:
        case = self.cells.get("Case") or next(iter(self.cells.values()), "")
        return f"RELIABILITY.md:{self.line} ({self.section}: {case[:60]})"


def _cells(line: str) -> list[str]:
    """A markdown table line's cells (``|`` inside backticks or escaped stays)."""
    out, cur, in_code, i = [], "", False, 0
    body = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            cur += body[i : i + 2]
            i += 2
            continue
        if c == "`":
            in_code = not in_code
        if c == "|" and not in_code:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur.strip())
    return out


_SPAN = re.compile(r"`([^`]+)`")
_TEST_FILE = re.compile(r"tests/(?:[\w.-]+/)*test_\w*\.py(?:::|$)")
_COUNTS = re.compile(r"^\s*\((\d+) quick, (\d+) slow\)")
_MARKER = re.compile(r"^\s*\(marker (\w+)\)")


def refs_in(text: str) -> list[Ref]:
    """The node ids a cell (or bullet) names, in order (see the module docstring)."""
    label = re.search(r"\bslow:", text)
    refs: list[Ref] = []
    file = func = ""
    for m in _SPAN.finditer(text):
        span = m.group(1).strip()
        if span.startswith("-k ") and refs:
            refs[-1].k = span[3:].strip()
            continue
        if _TEST_FILE.match(span):
            file, _, rest = span.partition("::")
            func = rest
        elif span.startswith("::") and file:
            func = span[2:]
        elif span.startswith(("[", "...[")) and file and func:
            func = func.split("[", 1)[0] + span[span.index("[") :]
        else:
            continue  # code, not a node id
        pattern = f"{file}::{func}" if func else file
        after = text[m.end() :]
        counts = _COUNTS.match(after)
        markers = [x.group(1) for x in [_MARKER.match(after)] if x]
        refs.append(
            Ref(
                span,
                pattern,
                bool(label and m.start() > label.start()),
                counts=(int(counts.group(1)), int(counts.group(2))) if counts else None,
                markers=markers,
            )
        )
    return refs


def rows(page: str) -> list[Row]:
    """Every row of every table with a ``Reproduce`` column, and every
    bullet of the "does not cover" section (one cell: ``Text``)."""
    out: list[Row] = []
    lines = page.splitlines()
    section, head = "", None
    in_gap = False
    for n, line in enumerate(lines, 1):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
            in_gap = section == NOT_COVERED
            head = None
            continue
        if line.startswith("|"):
            cells = _cells(line)
            if head is None:
                head = cells
            elif set("".join(cells)) <= set("-: "):
                continue  # the separator
            elif "Reproduce" in head:
                by = dict(zip(head, cells))
                out.append(Row(section, n, by, refs_in(by["Reproduce"])))
            continue
        head = None
        if in_gap and line.startswith("- "):
            text = line
            for more in lines[n:]:
                if not more.startswith("  "):
                    break
                text += " " + more.strip()
            out.append(Row(section, n, {"Text": text}, refs_in(text)))
    return out


def absent_claims(text: str) -> list[str]:
    """The ``absent: TEXT`` checks a bullet names."""
    return [m.group(1)[len("absent:") :].strip() for m in _SPAN.finditer(text) if m.group(1).startswith("absent:")]


# -- the suite -----------------------------------------------------------------


#: Where :func:`record` keeps this session's collection, before ``-m``/``-k`` deselect.
SESSION_ITEMS = pytest.StashKey[list[pytest.Item]]()


def record(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Keep every test this session collected: conftest.py calls this first
    in ``pytest_collection_modifyitems``, before ``-m``, ``-k`` and
    ``--deselect`` drop any. Their markers are read later, once every
    plugin has added its own (hypothesis marks its tests there too)."""
    config.stash[SESSION_ITEMS] = list(items)


def _marked(items: Iterable[Any]) -> Items:
    return {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}


def _whole_suite(config: pytest.Config) -> bool:
    """Whether this session collected every test file: the README's test
    command does (``pytest`` or ``pytest tests``); a run of some files, or
    one that ignores some, did not."""
    whole = {ROOT, ROOT / "tests"}
    ignored = config.getoption("ignore") or config.getoption("ignore_glob")
    return SESSION_ITEMS in config.stash and not ignored and {Path(a).resolve() for a in config.args} <= whole


def collect(config: pytest.Config | None = None) -> Items:
    """Every test pytest collects under ``tests`` (slow ones too), with its
    markers: this session's own collection when it took in the whole suite
    (``config``), else pytest's collection in a process of its own."""
    if config is not None and _whole_suite(config):
        return _marked(config.stash[SESSION_ITEMS])
    return collect_apart()


def collect_apart(paths: Sequence[str] = ("tests",)) -> Items:
    """:func:`collect` in a process of its own (about 10 s on 2 cores)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "items.json")
        env = dict(
            os.environ,
            DCPSTORE_COLLECT_ITEMS=out,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-m",
                "",
                "-p",
                "tests.support.reliability",
                "-p",
                "no:logging",
                *paths,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"pytest --collect-only failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        with open(out) as f:
            items: Items = json.load(f)
    return items


def pytest_collection_finish(session: Any) -> None:
    """With ``-p tests.support.reliability``: write what was collected (see :func:`collect`)."""
    out = os.environ.get("DCPSTORE_COLLECT_ITEMS")
    if out:
        with open(out, "w") as f:
            json.dump(_marked(session.items), f)


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else re.escape(c) for c in pattern))


def matches(ref: Ref, items: Items) -> list[str]:
    """The node ids ``ref`` names."""
    rx = _glob(ref.pattern)
    if "::" not in ref.pattern:  # a file
        found = [n for n in items if n.split("::", 1)[0] == ref.pattern]
    elif "[" in ref.pattern:
        found = [n for n in items if rx.fullmatch(n)]
    else:
        found = [n for n in items if rx.fullmatch(n.split("[", 1)[0])]
    if ref.k:
        found = [n for n in found if ref.k in n.rsplit("::", 1)[-1]]
    return found


def _absent_problems(text: str, where: str) -> list[str]:
    problems = []
    for claim in absent_claims(text):
        holders = [
            str(p.relative_to(ROOT))
            for p in sorted((ROOT / "tests").rglob("*.py"))  # the suite and its support, not the upstream copies
            if p.relative_to(ROOT / "tests").parts[0] != "upstream"
            and p.name != "reliability.py"
            and claim in p.read_text()
        ]
        if holders:
            problems.append(f"{where}: says no test does {claim!r}, but {', '.join(holders)} holds it")
    return problems


def row_problems(rows_: Iterable[Row], items: Items, counts: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the rows: each a sentence naming the row."""
    problems = []
    for row in rows_:
        where = row.where()
        if "Reproduce" in row.cells and not row.refs:
            problems.append(f"{where}: names no test (a node id in backticks in Reproduce)")
        if "Text" in row.cells:
            if not row.refs and not absent_claims(row.cells["Text"]):
                problems.append(f"{where}: a 'does not cover' bullet needs a check: a node id or `absent: TEXT`")
            problems += _absent_problems(row.cells["Text"], where)
        counted: list[str] = []
        for ref in row.refs:
            found = matches(ref, items)
            if not found:
                problems.append(f"{where}: `{ref.text}` ({ref.pattern}) is no test pytest collects")
                continue
            slow = [n for n in found if "slow" in items[n]]
            if ref.slow and len(slow) != len(found):
                problems.append(
                    f"{where}: `{ref.text}` is listed as slow, but runs in the quick suite: "
                    f"{sorted(set(found) - set(slow))[:3]}"
                )
            if not ref.slow and len(slow) == len(found):
                problems.append(
                    f"{where}: `{ref.text}` is listed as quick, but every case is slow (list it after 'slow:')"
                )
            if ref.counts and ref.counts != (len(found) - len(slow), len(slow)):
                problems.append(
                    f"{where}: `{ref.text}` says {ref.counts[0]} quick, {ref.counts[1]} slow; "
                    f"it has {len(found) - len(slow)} quick, {len(slow)} slow"
                )
            for marker in ref.markers:
                if not all(marker in items[n] for n in found):
                    problems.append(f"{where}: `{ref.text}`: not every case carries marker {marker}")
            counted += [n for n in found if n in counts]
        points = row.cells.get("Points")
        stated = {int(x.replace(",", "")) for x in re.findall(r"(?<![\w.])\d[\d,]*(?![\w.])", points or "")}
        named = sorted({n for ref in row.refs for n in matches(ref, items)})
        if stated and named:
            unrecorded = [n for n in named if n not in counts]
            if unrecorded:
                problems.append(
                    f"{where}: Points gives numbers, but no counts are recorded for {unrecorded[:4]} "
                    f"(run them with {ENV_HINT})"
                )
            backed = {counts[n][k] for n in counted for k in ("points", "killed")}
            if stated - backed and not unrecorded:
                problems.append(
                    f"{where}: Points says {sorted(stated - backed)}, which no recorded count of "
                    f"{counted} is (tests/support/kill_counts.json: {sorted(backed)})"
                )
    return problems


def count_problems(items: Items, counts: dict[str, dict[str, Any]]) -> list[str]:
    return [f"tests/support/kill_counts.json: {n} is no test pytest collects" for n in counts if n not in items]


# -- the generated block ---------------------------------------------------------


def kill_table(items: Items, counts: dict[str, dict[str, Any]]) -> str:
    """RELIABILITY.md's kill-point table, from the recorded counts."""
    lines = ["| Test | Run | Points | Killed | Must kill (asserted) | Recorded at |", "|---|---|---|---|---|---|"]
    for node, c in sorted(counts.items()):
        run = "slow" if "slow" in items.get(node, []) else "quick"
        lines.append(f"| `{node}` | {run} | {c['points']} | {c['killed']} | {c['minimum']} | `{c.get('commit')}` |")
    return "\n".join(lines)


def generated(items: Items, counts: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {"kill-points": kill_table(items, counts)}


def render(page: str, blocks: dict[str, str]) -> str:
    return BLOCK.sub(
        lambda m: m.group(1) + blocks.get(m["name"], m["body"].rstrip()).rstrip() + "\n" + m.group(4), page
    )


def read_counts() -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads(COUNTS.read_text()) if COUNTS.exists() else {}
    return data


def problems(page: str, items: Items, counts: dict[str, dict[str, Any]]) -> list[str]:
    out = row_problems(rows(page), items, counts) + count_problems(items, counts)
    if render(page, generated(items, counts)) != page:
        out.append(
            "RELIABILITY.md: a generated block differs from what tests/support/kill_counts.json and the markers give: "
            "run python tests/support/reliability.py --write"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="regenerate the generated blocks")
    args = p.parse_args(argv)
    page, items, counts = PAGE.read_text(), collect(), read_counts()
    if args.write:
        PAGE.write_text(render(page, generated(items, counts)))
        page = PAGE.read_text()
    found = problems(page, items, counts)
    print("\n".join(found) or "RELIABILITY.md agrees with the suite")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
