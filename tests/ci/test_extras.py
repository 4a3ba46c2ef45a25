"""What .ci/run installs is here, and the suites' skips are decided
independently of the code they test (tests/support/extras.py)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from dcpstore._impl.engines import nvrx as nvrx_adapter
from tests.support import extras
from tests.support.backends import TARGETS

ROOT = Path(__file__).resolve().parents[2]


def _requirements(extra: str) -> list[Requirement]:
    """What ``pip install -e ".[extra]"`` installs beyond the base
    dependencies, through dcpstore's own extras it names."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out: list[Requirement] = []
    for line in optional[extra]:
        req = Requirement(line)
        if req.name == "dcpstore":
            for inner in sorted(req.extras):
                out += _requirements(inner)
        else:
            out.append(req)
    return out


def test_ci_installs_the_dev_extra() -> None:
    """The test of this file stands for .ci/run's install: it must keep
    installing ``.[dev]`` (scripts/setup.sh), else the check below checks
    the wrong list."""
    assert '-e ".[dev]"' in (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/setup.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_extra_ci_installs_is_installed_and_imports() -> None:
    """Under CI=true, every distribution ``.[dev]`` names is installed at a
    version it allows, and each optional part a suite skips without
    imports: a missing one fails the run instead of turning its cases into
    skips. Elsewhere, what is missing is a skip that lists it."""
    problems = []
    for req in _requirements("dev"):
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} is installed at {version}")
    names = {req.name for req in _requirements("dev")}
    assert set(extras.MODULES) <= names, set(extras.MODULES) - names  # a skip on something CI never installs
    problems += [why for why in map(extras.missing, extras.MODULES) if why is not None]
    if problems and not extras.CI:
        pytest.skip("; ".join(problems))
    assert not problems, problems


def test_the_nvrx_table_names_real_targets_and_the_engine_agrees_where_it_imports() -> None:
    """tests/support/backends.py's targets are what the table speaks of; where NVRx
    imports, dcpstore's own check says so too."""
    assert extras.NVRX_TARGETS <= set(TARGETS), extras.NVRX_TARGETS - set(TARGETS)
    assert "s3" not in extras.NVRX_TARGETS and "memory" not in extras.NVRX_TARGETS
    assert (extras.missing(extras.NVRX) is None) == (nvrx_adapter.import_error() is None), (
        extras.missing(extras.NVRX),
        nvrx_adapter.import_error(),
    )
