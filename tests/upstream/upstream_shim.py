"""The shim: upstream's own DCP tests with dcpstore's classes in place of theirs.

The test files beside this module are byte-identical copies of PyTorch's and
s3torchconnector's (see PROVENANCE.md). This module is the one place that
changes what they run:

* ``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader``
  become :class:`dcpstore.StorageWriter` / :class:`dcpstore.StorageReader`,
  both the names the copies import and DCP's own choice of storage when a
  test passes only ``checkpoint_id=`` (``_storage_utils``);
* s3torchconnector's ``S3StorageWriter(region, path, ...)`` /
  ``S3StorageReader(region, path, ...)`` become the same classes with
  ``region=`` (s3torchconnector puts ``region`` first, positionally).

``DCPSTORE_UPSTREAM=stock`` leaves the stock classes in place: that is how
the list of tests that pass with them here was found (conftest.py).

PyTorch's multi-process tests start each rank in a fresh process that
imports the copy again; there the substitution has to be in place *before*
that import. :class:`RankProcess` does it: a forkserver process (the suite's
one server, preloaded with torch and dcpstore; see tests/support/dist_utils.py) whose
target applies the substitution, then imports the test class by name and
runs torch's own per-rank entry point (``MultiProcessTestCase._run``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed.checkpoint as torch_dcp
import torch.multiprocessing
from torch.distributed.checkpoint import _storage_utils
from torch.testing._internal.common_distributed import MultiProcessTestCase

import dcpstore
from tests.support.dist_utils import PRELOAD

MODE = os.environ.get("DCPSTORE_UPSTREAM", "dcpstore")
if MODE not in ("dcpstore", "stock"):
    raise ValueError(f"DCPSTORE_UPSTREAM must be 'dcpstore' or 'stock', got {MODE!r}")

try:
    import s3torchconnector.dcp as s3_dcp
except ImportError:  # the copies of s3torchconnector's tests are then not collected
    s3_dcp = None


def s3_storage_writer(region: str, path: str, **kwargs: Any) -> dcpstore.StorageWriter:
    """``S3StorageWriter(region, path, ...)``, as dcpstore spells it."""
    return dcpstore.StorageWriter(path, region=region, **kwargs)


def s3_storage_reader(region: str, path: str, **kwargs: Any) -> dcpstore.StorageReader:
    """``S3StorageReader(region, path, ...)``, as dcpstore spells it."""
    return dcpstore.StorageReader(path, region=region, **kwargs)


def substitutions() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the current mode."""
    subs: list[tuple[Any, str, Any]] = [(MultiProcessTestCase, "_spawn_processes", _start_ranks)]
    if MODE == "dcpstore":
        for module in (torch_dcp, _storage_utils):
            subs += [
                (module, "FileSystemWriter", dcpstore.StorageWriter),
                (module, "FileSystemReader", dcpstore.StorageReader),
            ]
        if s3_dcp is not None:
            subs += [(s3_dcp, "S3StorageWriter", s3_storage_writer), (s3_dcp, "S3StorageReader", s3_storage_reader)]
    return subs


@contextlib.contextmanager
def substituted() -> Iterator[None]:
    """The substitution, undone on exit (the test process runs other suites,
    for which the stock classes are the oracle)."""
    mp = pytest.MonkeyPatch()
    try:
        for owner, name, value in substitutions():
            mp.setattr(owner, name, value)
        yield
    finally:
        mp.undo()


# ---------------------------------------------------------------------------
# Ranks of PyTorch's multi-process tests
# ---------------------------------------------------------------------------


def _start_ranks(self: MultiProcessTestCase) -> None:
    # Replaces MultiProcessTestCase._spawn_processes, which would also switch
    # the whole test process to "spawn" (set_start_method).
    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    self._start_processes(RankProcess)


def rank_main(module: str, qualname: str, *args: Any, **kwargs: Any) -> None:
    """One rank: substitute, import the test class, run torch's entry point."""
    with substituted():
        cls = getattr(importlib.import_module(module), qualname)
        cls._run(*args, **kwargs)


class RankProcess(torch.multiprocessing.get_context("forkserver").Process):  # type: ignore[misc,name-defined]
    """Started by ``MultiProcessTestCase._start_processes`` with
    ``target=cls._run``; runs :func:`rank_main` instead, which imports the
    class only after substituting (a class in the pickled arguments would be
    imported first, with the stock names)."""

    def __init__(self, *, target: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cls = target.__self__
        super().__init__(target=rank_main, name=name, args=(cls.__module__, cls.__qualname__, *args), kwargs=kwargs)
