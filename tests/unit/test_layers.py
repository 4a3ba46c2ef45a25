"""The package's import graph: layered, acyclic, no late imports of our own.

Parses every module of ``dcpstore`` (ast; every import statement, at module
level, inside functions and under ``TYPE_CHECKING`` alike) and checks the
Layout rules (docs/layout.md):

* no module imports a module of a higher layer;
* no import cycle, counting imports inside functions;
* imports inside functions only for optional third-party packages.

A layer is a top-level module or package of ``dcpstore``; modules of one
layer may import each other (without cycles). The table below is the
Layout page's table (docs/layout.md), bottom first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcpstore"

#: Bottom first. A layer is named by a module's place under ``dcpstore._impl``
#: (``dcpstore._impl.dcp.reader`` is in ``dcp``); the supported surface --
#: ``dcpstore`` itself (``""``), ``dcpstore.storage`` (``public:storage``),
#: ``dcpstore.tools`` and ``dcpstore.adapters`` -- sits above what it
#: re-exports and below the tools built on the package.
LAYERS: list[set[str]] = [
    {"_impl", "util"},  # foundation: imports nothing of ours
    {"storage"},  # bytes
    {"values"},  # value objects: options, where keywords meet them, what a save reports
    {"format"},  # what the bytes mean
    {"dcp"},  # the DCP protocol: commit, writer, reader
    {"engines"},  # when: async saves, engines, exit hook
    {"api", "dropin", "tools", "safetensors"},  # front door for one checkpoint, DCP's drop-ins; checkpoints at rest
    {"manager"},  # many checkpoints under a root
    {"adapters"},  # other projects' shapes (dcpstore.adapters and its private parts)
    {"", "public:storage", "tools"},  # the supported surface
    {"bench"},
    {"cli", "__main__"},  # the dcpstore command; dcpstore/__main__.py is python -m dcpstore
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

#: Test-only packages -> the modules of ours that may import them: the
#: backend contract suite, which only tests import (and no module of ours).
TEST_ONLY = {"pytest": {"dcpstore.storage.testing"}}

#: Packages whose late imports are still to be moved to the top (none).
LATE_IMPORTS_PENDING: set[str] = set()
#: (module, what it imports inside a function): a feature's subpackage that
#: only its users load. The tiers (replicator threads, node discovery over a
#: gloo group) are imported by a manager only when it is given ``local_dir``
#: (tests/integration/test_tiered.py checks that a plain manager leaves them unloaded).
ON_DEMAND = {("dcpstore._impl.manager.manager", "dcpstore._impl.manager.tiers")}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer_name(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["_impl"]:
        return parts[2] if len(parts) > 2 else "_impl"
    if len(parts) == 1:
        return ""
    return "public:storage" if parts[1] == "storage" else parts[1]


def _layer(module: str) -> int:
    top = _layer_name(module)
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/layout.md")


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
        and (module, target) not in ON_DEMAND
        and not any(module == p or module.startswith(p + ".") for p in LATE_IMPORTS_PENDING)
    ]
    assert not late, "\n".join(late)


def test_test_only_packages_only_in_the_modules_tests_import() -> None:
    """pytest is not a dependency of dcpstore: only the shipped contract
    suite imports it, and nothing of ours imports that suite."""
    suites = set().union(*TEST_ONLY.values())
    wrong = [
        f"{module}:{line} imports {target}"
        for module in MODULES
        for target, line, _ in _imports(module)
        if (target.split(".")[0] in TEST_ONLY and module not in TEST_ONLY[target.split(".")[0]])
        or (target in suites and module != target)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from . import x", {"dcpstore._impl.dcp.x"}),
        ("from ..util import errors", {"dcpstore._impl.util.errors"}),
        ("from ..format.layout import METADATA", {"dcpstore._impl.format.layout"}),
        ("import dcpstore.storage", {"dcpstore.storage"}),
        ("def f():\n    from ..values.results import SaveStats", {"dcpstore._impl.values.results"}),
        ("if TYPE_CHECKING:\n    from ..api import save", {"dcpstore._impl.api"}),
    ],
)
def test_the_parser_sees_every_kind_of_import(source: str, expected: set[str], tmp_path: Path) -> None:
    """The checks above are only as good as the import parser: relative
    imports, function-level imports and TYPE_CHECKING imports all count."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    MODULES["dcpstore._impl.dcp.fake"] = fake
    MODULES.setdefault("dcpstore._impl.dcp.x", fake)
    try:
        got = {t for t, _, _ in _imports("dcpstore._impl.dcp.fake") if t.startswith("dcpstore")}
    finally:
        del MODULES["dcpstore._impl.dcp.fake"]
        if MODULES["dcpstore._impl.dcp.x"] is fake:
            del MODULES["dcpstore._impl.dcp.x"]
    assert got == expected


# -- one writer of commits ---------------------------------------------------------

#: The commit and liveness packages: the module trees that write or remove a
#: commit (``.metadata``, a manifest), an in-flight marker or an alive file.
COMMIT_PACKAGES = ("dcpstore._impl.dcp.commit", "dcpstore._impl.dcp.liveness")
#: The format layer defines those names (and writes nothing).
NAMES_HOME = "dcpstore._impl.format"
#: What a module needs only to write or remove a marker, an alive file or a
#: save's manifest, or to tell which of a directory's files are leftovers:
#: used nowhere but the commit package (and defined in the format layer).
#: (``is_alive_file`` is not one: ``ls`` and ``gc`` read alive files to
#: tell a running save.)
WRITER_NAMES = {"INFLIGHT", "ALIVE_PREFIX", "alive_name", "manifest_name", "is_manifest"}
#: The committed names and alive files, which readers need too: never in a write.
READ_NAMES = {"METADATA", "MANIFEST", "is_alive_file"}
#: Literal spellings of every one of those names.
NAME_LITERALS = (".metadata", ".dcpstore.json", ".dcpstore.inflight", ".dcpstore.alive")
#: The Storage calls that write or remove a file.
WRITES = {"put", "delete", "open_write"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _mentions_a_commit_name(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in READ_NAMES | WRITER_NAMES:
            return True
        # ``commit.manifest_name`` is a Commit's field, not the naming function
        if isinstance(sub, ast.Attribute) and sub.attr in READ_NAMES | WRITER_NAMES - {"manifest_name"}:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and any(n in sub.value for n in NAME_LITERALS):
            return True
    return False


def commit_writes(module: str, tree: ast.AST) -> list[str]:
    """Where ``module`` writes or removes a commit, a marker or an alive file
    itself, or handles the names only that needs (none in the commit package)."""
    if any(_in(module, package) for package in COMMIT_PACKAGES):
        return []
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in WRITES and any(_mentions_a_commit_name(a) for a in [*node.args, *node.keywords]):
                found.append(f"{module}:{line} {name}() of a commit's file, a marker or an alive file")
        if _in(module, NAMES_HOME):
            continue
        if isinstance(node, ast.alias) and node.name in WRITER_NAMES:
            found.append(f"{module} imports {node.name}")
        elif isinstance(node, ast.Name) and node.id in WRITER_NAMES:
            found.append(f"{module}:{line} uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in WRITER_NAMES - {"manifest_name"}:
            found.append(f"{module}:{line} uses {node.attr}")
    return found


def test_only_the_commit_package_writes_commits_markers_and_alive_files() -> None:
    """The commit protocol's files are written and removed in one place:
    every other module (the replicator, node-local tiers, retention, gc)
    calls the commit package for them (Orbax's ``TemporaryPath`` is the
    one place its atomicity lives). A parse of the source, so it sees the
    names and calls, not where a computed list of paths came from."""
    found = [hit for module, path in MODULES.items() for hit in commit_writes(module, ast.parse(path.read_text()))]
    assert not found, "\n".join(sorted(set(found)))


@pytest.mark.parametrize(
    "source, caught",
    [
        ("storage.put(f'{d}/{METADATA}', blob)", True),
        ("root.delete([p for p in paths if p.endswith('/.metadata')])", True),
        ("storage.put(layout.MANIFEST, blob)", True),
        ("storage.delete([n for n in names if inflight.is_alive_file(n)])", True),
        ("storage.put(path, blob)", False),
        ("if storage.exists(METADATA): pass", False),
        ("from ..format.layout import INFLIGHT", True),
        ("ok = layout.is_manifest(name)", True),
        ("ok = inflight.is_alive_file(name)", False),
        ("lease = Lease(storage, prefix)", False),  # the commit package's lease writes the file
        ("name = commit.manifest_name", False),
    ],
)
def test_the_commit_check_sees_every_kind_of_write(source: str, caught: bool) -> None:
    assert bool(commit_writes("dcpstore._impl.manager.fake", ast.parse(source))) == caught
    assert not commit_writes("dcpstore._impl.dcp.commit.fake", ast.parse(source))
    assert not commit_writes("dcpstore._impl.dcp.liveness.fake", ast.parse(source))


# -- torch's private names: one seam ------------------------------------------------

#: The one module that may use what torch does not publish.
TORCH_COMPAT = "dcpstore._impl.util.torch_compat"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_torch_uses(tree: ast.AST) -> list[str]:
    """Where a module imports a private name or module of torch's, or reaches
    one as an attribute of a torch module it imported."""
    found = []
    modules: set[str] = set()  # local names bound to torch modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                modules.add(alias.asname or alias.name.split(".")[0])
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private_module = any(_private(part) for part in node.module.split("."))
            for alias in node.names:
                if private_module or _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                if alias.name[:1].islower():  # a module (or a function: harmless here)
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base: ast.AST = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_torch_compat_uses_torchs_private_names() -> None:
    """Every name torch does not publish goes through one module, so that a
    torch release that moves one breaks one place (as NVRx's release churn
    has its seam)."""
    found = [
        f"{module}:{hit}"
        for module, path in MODULES.items()
        if module != TORCH_COMPAT
        for hit in private_torch_uses(ast.parse(path.read_text()))
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source, caught",
    [
        ("from torch.distributed.checkpoint.filesystem import _StorageInfo", True),
        ("from torch.distributed.checkpoint._traverse import set_element", True),
        ("import torch._dynamo", True),
        ("import torch\nx = torch._C.foo", True),
        ("import torch.distributed as dist\ndist.distributed_c10d._get_default_group()", True),
        ("from torch import serialization as ser\nser._save(1)", True),
        ("from torch.distributed.checkpoint import FileSystemWriter", False),
        ("import torch\nx = torch.tensor(1).__class__", False),
        ("import torch\nt = torch.ones(1)\nt._local_tensor", False),  # an object's attribute, not torch's module
        ("from ..util.torch_compat import StorageInfo", False),
    ],
)
def test_the_private_name_check_sees_every_kind_of_use(source: str, caught: bool) -> None:
    assert bool(private_torch_uses(ast.parse(source))) == caught
