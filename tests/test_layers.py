"""The package's import graph: layered, acyclic, no late imports of our own.

Parses every module of ``dcpstore`` (ast; every import statement, at module
level, inside functions and under ``TYPE_CHECKING`` alike) and checks the
README's Layout rules:

* no module imports a module of a higher layer;
* no import cycle, counting imports inside functions;
* imports inside functions only for optional third-party packages.

A layer is a top-level module or package of ``dcpstore``; modules of one
layer may import each other (without cycles). The table below is the
README's Layout section, bottom first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dcpstore"

#: Bottom first. ``dcpstore`` itself (its __init__: the public surface) sits
#: above everything it re-exports and below the tools built on the package.
LAYERS: list[set[str]] = [
    {"errors", "threads", "quiet", "units", "keywords", "progress"},  # foundation: imports nothing of ours
    {"storage"},  # bytes
    {"options", "option_keywords", "handle"},  # value objects; where keywords meet them
    {"format"},  # what the bytes mean
    {"dcp"},  # the DCP protocol: commit, writer, reader
    {"engines"},  # when: async saves, engines, exit hook
    {"api", "dropin", "listing", "maintenance"},  # front door for one checkpoint, DCP's drop-ins; checkpoints at rest
    {"manager"},  # many checkpoints under a root
    {"adapters"},  # other projects' shapes
    {""},  # dcpstore/__init__.py: the public surface
    {"bench"},
    {"cli"},
]

#: Packages that may be imported inside a function: optional dependencies.
OPTIONAL = {
    "boto3",
    "botocore",
    "fsspec",
    "s3fs",
    "multistorageclient",
    "nvidia_resiliency_ext",
    "matplotlib",
    "psutil",
    "megatron",  # adapters.megatron asks megatron-core whether --enable-msc is on
}

#: Packages whose late imports are still to be moved to the top (none).
LATE_IMPORTS_PENDING: set[str] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to the README's Layout section")


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in ``module``."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def in_function(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return True
        return False

    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, in_function(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in MODULES else base), node.lineno, in_function(node)


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {m: [(target, line) for target, line, _ in _imports(m) if target in MODULES] for m in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_no_module_imports_a_higher_layer() -> None:
    wrong = [
        f"{module}:{line} imports {target} (layer {_layer(target)} > {_layer(module)})"
        for module, edges in _graph().items()
        for target, line in edges
        if _layer(target) > _layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = {m: sorted({t for t, _ in edges if t != m}) for m, edges in _graph().items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_late_imports_only_for_optional_packages() -> None:
    late = [
        f"{module}:{line} imports {target} inside a function"
        for module in MODULES
        for target, line, inside in _imports(module)
        if inside
        and target.split(".")[0] not in OPTIONAL
        and not any(module == p or module.startswith(p + ".") for p in LATE_IMPORTS_PENDING)
    ]
    assert not late, "\n".join(late)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from . import x", {"dcpstore.dcp.x"}),
        ("from .. import errors", {"dcpstore.errors"}),
        ("from ..format.layout import METADATA", {"dcpstore.format.layout"}),
        ("import dcpstore.storage", {"dcpstore.storage"}),
        ("def f():\n    from ..handle import SaveStats", {"dcpstore.handle"}),
        ("if TYPE_CHECKING:\n    from ..api import save", {"dcpstore.api"}),
    ],
)
def test_the_parser_sees_every_kind_of_import(source: str, expected: set[str], tmp_path: Path) -> None:
    """The checks above are only as good as the import parser: relative
    imports, function-level imports and TYPE_CHECKING imports all count."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    MODULES["dcpstore.dcp.fake"] = fake
    MODULES.setdefault("dcpstore.dcp.x", fake)
    try:
        got = {t for t, _, _ in _imports("dcpstore.dcp.fake") if t.startswith("dcpstore")}
    finally:
        del MODULES["dcpstore.dcp.fake"]
        if MODULES["dcpstore.dcp.x"] is fake:
            del MODULES["dcpstore.dcp.x"]
    assert got == expected
