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
BENCH = Path(dcpstore.__file__).parent / "bench"


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, also inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _module_names(directory: Path, pattern: str = "*.py") -> set[str]:
    return {p.stem for p in directory.glob(pattern)}


def test_the_bench_package_never_imports_benchmarks_or_tests() -> None:
    forbidden = _module_names(ROOT / "benchmarks") | _module_names(ROOT / "tests", "**/*.py") | {"benchmarks", "tests"}
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        wrong = _imported_modules(path) & forbidden
        assert not wrong, f"dcpstore/_impl/bench/{path.name} imports {sorted(wrong)}"


def test_benchmarks_never_import_tests() -> None:
    tests_modules = _module_names(ROOT / "tests", "**/*.py") | {"tests"}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        wrong = _imported_modules(path) & tests_modules
        assert not wrong, f"benchmarks/{path.name} imports {sorted(wrong)} from tests/"
        assert '"tests"' not in path.read_text(), f"benchmarks/{path.name} reaches into tests/"


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
