"""Who may import whom around the benchmarks.

``dcpstore._impl.bench`` ships in the wheel and builds on the package only;
``benchmarks/`` builds on ``dcpstore._impl.bench`` and never reaches into
``tests/``; the CLI's size formatting does not come from the bench package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dcpstore

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(dcpstore.__file__).parent / "_impl" / "bench"


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, also inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _tests_folder_literals(path: Path) -> list[int]:
    """Lines of string literals that name the ``tests/`` folder (``"tests"``,
    ``"tests/..."``), leaving out subscript keys (``doc["tests"]``, a key of
    a summary, reaches into no folder)."""
    tree = ast.parse(path.read_text())
    keys = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.split("/")[0] == "tests"
        and id(node) not in keys
    ]


def _module_names(directory: Path, pattern: str = "*.py") -> set[str]:
    return {p.stem for p in directory.glob(pattern)}


def test_the_bench_package_never_imports_benchmarks_or_tests() -> None:
    forbidden = _module_names(ROOT / "benchmarks") | _module_names(ROOT / "tests", "**/*.py") | {"benchmarks", "tests"}
    paths = sorted(BENCH.glob("*.py"))
    assert paths, f"no modules under {BENCH}: the check would pass vacuously"
    for path in paths:
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        wrong = _imported_modules(path) & forbidden
        assert not wrong, f"dcpstore/_impl/bench/{path.name} imports {sorted(wrong)}"


def test_benchmarks_never_import_tests() -> None:
    tests_modules = _module_names(ROOT / "tests", "**/*.py") | {"tests"}
    paths = sorted((ROOT / "benchmarks").glob("*.py"))
    assert paths, f"no modules under {ROOT / 'benchmarks'}: the check would pass vacuously"
    for path in paths:
        wrong = _imported_modules(path) & tests_modules
        assert not wrong, f"benchmarks/{path.name} imports {sorted(wrong)} from tests/"
        lines = _tests_folder_literals(path)
        assert not lines, f"benchmarks/{path.name} reaches into tests/ (lines {lines})"


def test_the_cli_formats_sizes_without_the_bench_package() -> None:
    """``dcpstore ls`` / ``inspect`` print sizes; the helper lives in
    :mod:`dcpstore._impl.util.units`, not in the benchmark harness."""
    cli = Path(dcpstore.__file__).parent / "_impl" / "cli.py"
    sources = {
        alias.name: ("." * node.level) + (node.module or "")
        for node in ast.walk(ast.parse(cli.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert sources.get("human_bytes") == "dcpstore._impl.util.units", sources.get("human_bytes")
    code = "import sys, dcpstore._impl.util.units; print(sorted(m for m in sys.modules if m.startswith('dcpstore._impl.bench')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
