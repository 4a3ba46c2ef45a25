"""Every code block in README.md and docs/ runs, so that no example can rot.

tests/support/doc_examples.py extracts the blocks and says how each kind is run and
how a page marks what a block needs. Here:

* every block is of a known kind, its marker names known set-ups, and a
  fragment gives its reason and still compiles;
* the fragments are exactly :data:`FRAGMENTS`: a new block that does not
  run is a decision, made here, not a default;
* each page's Python and shell blocks run, each block in a fresh namespace
  and directory, in one interpreter that serves every page (torch imported
  once; Lightning's page gets its own), against a moto S3 endpoint of this
  module's own, emptied for each page; an unmarked block that fails fails
  its page, naming the block's page and line;
* the YAML blocks parse, and name only dcpstore classes that exist;
* README.md's relative links lead to files that exist (mkdocs checks the
  links inside docs/ when CI builds the site with ``--strict``).

Blocks marked ``slow`` run under ``pytest -m slow`` (CI runs both):
``dcpstore bench``'s default run (~20 s) and Lightning's Fabric on one CPU
rank (~10 s; tests/frameworks/test_lightning.py holds the adapter on 2 ranks in the
quick run). A page whose blocks need an extra (Lightning) skips
without it, and fails under CI (tests/support/extras.py).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import doc_examples as de
from tests.support.extras import skip_unless
from tests.support.s3_server import FAKE_KEY_ID, MotoServer, aws_env

ROOT = de.ROOT
BLOCKS = [block for page in de.pages() for block in de.extract(page)]

#: The blocks that do not run: (page, how the marker's reason begins). By
#: page, not line, so that an edit above a block does not move its entry.
FRAGMENTS = [
    ("README.md", "the install and test commands: CI runs them as they are"),
    ("docs/frameworks/megatron-bridge.md", "Megatron-Bridge imports CUDA-only packages"),
    ("docs/frameworks/megatron-bridge.md", "Megatron-Bridge imports CUDA-only packages"),
    ("docs/frameworks/torchtitan.md", "a torchtitan Trainer needs a model"),
    ("docs/manager.md", "a job of several nodes, each with its own /nvme"),
]

#: Set-ups that need an extra: the page is skipped without it (failed under CI).
SETUP_EXTRAS = {"lightning": "lightning", "torch-checkpointing": "torch-checkpointing"}


def _runnable(slow: bool) -> dict[str, list[de.Block]]:
    by_page: dict[str, list[de.Block]] = {}
    for block in BLOCKS:
        if block.lang in de.RUN and block.fragment is None and block.slow == slow:
            by_page.setdefault(block.page, []).append(block)
    return by_page


QUICK = _runnable(slow=False)
SLOW = _runnable(slow=True)


def test_every_block_is_of_a_known_kind_and_marked_as_it_must_be() -> None:
    problems = []
    for block in BLOCKS:
        if block.lang not in de.LANGUAGES:
            problems.append(f"{block.where}: ```{block.lang or '(no language)'} is none of {sorted(de.LANGUAGES)}")
        unknown = set(block.setup) - set(de.SETUPS)
        if unknown:
            problems.append(f"{block.where}: unknown set-up(s) {sorted(unknown)}; known: {sorted(de.SETUPS)}")
        if block.lang not in de.RUN and (block.setup or block.fragment is not None):
            problems.append(f"{block.where}: a ```{block.lang} block is not run: it takes no marker")
        if block.fragment is not None and not block.fragment.strip():
            problems.append(f"{block.where}: a fragment must say why it cannot run")
        if block.fragment is not None and block.lang == "python":
            try:
                compile(block.source, block.where, "exec")
            except SyntaxError as e:
                problems.append(f"{block.where}: a fragment that does not even compile: {e}")
    assert not problems, "\n".join(problems)


def test_the_fragments_are_the_listed_ones() -> None:
    marked = sorted((block.page, block.fragment or "") for block in BLOCKS if block.fragment is not None)
    listed = sorted(FRAGMENTS)
    matched = len(marked) == len(listed) and all(
        page == want_page and reason.startswith(want) for (page, reason), (want_page, want) in zip(marked, listed)
    )
    assert matched, (
        "the blocks that do not run changed: make them run, or list them in FRAGMENTS with the reason\n"
        f"marked: {marked}\nlisted: {listed}"
    )


def test_what_runs_and_what_does_not_is_counted() -> None:
    runs = sum(len(blocks) for blocks in (*QUICK.values(), *SLOW.values()))
    kinds = {lang: sum(block.lang == lang for block in BLOCKS) for lang in sorted(de.LANGUAGES)}
    print(f"{len(BLOCKS)} blocks {kinds}: {runs} run, {len(FRAGMENTS)} fragments")
    # Most of what the pages show runs: a page of fragments is a page that can rot.
    assert runs >= 3 * len(FRAGMENTS), (runs, len(FRAGMENTS))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()


class Runner:
    """tests/support/doc_examples.py serving pages in an interpreter of its own."""

    def __init__(self, s3: MotoServer, log: Path) -> None:
        env = {k: v for k, v in {**os.environ, **aws_env(s3.url)}.items() if v is not None}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(de.__file__)), str(log)],
            env=env,
            cwd=log.parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, blocks: list[de.Block], tmp: Path, timeout: float = 240) -> list[dict[str, str | None]]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(de.spec(blocks, str(tmp)) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        answer = self.proc.stdout.readline() if ready else ""
        if not answer:
            self.close()
            raise AssertionError(
                f"the runner gave no answer ({'timed out' if not ready else 'it died'}):\n{self.tail()}"
            )
        return list(json.loads(answer))

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def runner(s3: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    shared = Runner(s3, tmp_path_factory.mktemp("runner") / "blocks.log")
    try:
        yield shared
    finally:
        shared.close()


def _run_page(page: str, blocks: list[de.Block], s3: MotoServer, shared: Runner, tmp: Path) -> None:
    setups = {name for block in blocks for name in block.setup}
    for name in sorted(setups & set(SETUP_EXTRAS)):
        skip_unless(SETUP_EXTRAS[name], f"{page}: set-up {name!r}")
    s3.reset()
    for bucket in de.BUCKETS:
        s3.client().create_bucket(Bucket=bucket)
    runner = Runner(s3, tmp / "blocks.log") if setups & de.ISOLATED else shared
    t0 = time.monotonic()
    try:
        start = len(runner.tail(10**9))
        results = runner.run(blocks, tmp)
        output = runner.tail(10**9)[start:]
    finally:
        if runner is not shared:
            runner.close()
    failed = [r for r in results if r["error"]]
    assert FAKE_KEY_ID not in output, f"{page}: an example printed a credential"
    assert not failed, "\n\n".join(f"{r['where']} failed:\n{r['error']}" for r in failed) + (
        f"\n--- what the page's blocks printed:\n{output[-4000:]}"
    )
    print(f"{page}: {len(blocks)} block(s) in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("page", sorted(QUICK))
def test_the_examples_run(page: str, s3: MotoServer, runner: Runner, tmp_path: Path) -> None:
    _run_page(page, QUICK[page], s3, runner, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(SLOW))
def test_the_slow_examples_run(page: str, s3: MotoServer, runner: Runner, tmp_path: Path) -> None:
    _run_page(page, SLOW[page], s3, runner, tmp_path)


def test_yaml_blocks_parse_and_name_classes_that_exist() -> None:
    import yaml

    def names(value: object) -> Iterator[str]:
        if isinstance(value, dict):
            for v in value.values():
                yield from names(v)
        elif isinstance(value, list):
            for v in value:
                yield from names(v)
        elif isinstance(value, str) and re.fullmatch(r"dcpstore(\.\w+)+", value):
            yield value

    blocks = [block for block in BLOCKS if block.lang == "yaml"]
    assert blocks
    for block in blocks:
        config = yaml.safe_load(block.source)
        for name in names(config):
            module, _, attr = name.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), f"{block.where}: {name} does not exist"


def test_the_roots_the_examples_use_are_mapped() -> None:
    assert de.map_roots('save(s, "/ckpt/run1/step100")', "/tmp/x") == 'save(s, "/tmp/x/ckpt/run1/step100")'
    assert de.map_roots("dcpstore ls /nvme/run1 s3://b/ckpt/x", "/t") == "dcpstore ls /t/nvme/run1 s3://b/ckpt/x"
    # every absolute path a runnable example writes is under a mapped root
    for block in BLOCKS:
        if block.lang in de.RUN and block.fragment is None:
            for path in re.findall(r"(?<![\w./:~-])/[a-z]\w*(?:/[\w.-]+)*", block.source):
                assert path.startswith(tuple(r + "/" for r in de.ROOTS)) or path in de.ROOTS, (
                    f"{block.where}: {path} is outside the example roots {de.ROOTS}"
                )


def test_readme_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]
    assert "docs/index.md" in local and "docs/api.md" in local and "docs/concepts.md" in local
    missing = [link for link in local if link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_a_block_that_fails_is_reported_with_its_page_and_line(s3: MotoServer, runner: Runner, tmp_path: Path) -> None:
    """The runner's own check: failures are reported, at the page's line
    numbers, and a failure does not stop the next block."""
    blocks = [
        de.Block("docs/fake.md", 10, "python", "x = 1\n1 / x\nraise ValueError('from the page')\n"),
        de.Block("docs/fake.md", 20, "bash", "true\nfalse\n"),
        de.Block("docs/fake.md", 30, "python", "import warnings\nwarnings.warn('old form', DeprecationWarning)\n"),
        de.Block("docs/fake.md", 40, "python", "print('still runs')\n"),
    ]
    results = runner.run(blocks, tmp_path)
    errors = {r["where"]: r["error"] or "" for r in results}
    assert 'File "docs/fake.md", line 13' in errors["docs/fake.md:10"] and "from the page" in errors["docs/fake.md:10"]
    assert "exit 1" in errors["docs/fake.md:20"]
    assert "DeprecationWarning: old form" in errors["docs/fake.md:30"]
    assert errors["docs/fake.md:40"] == ""
