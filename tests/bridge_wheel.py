"""Megatron-Bridge 0.6.2's own code, read from its wheel.

Bridge cannot be imported on a CPU-only machine (its package imports
CUDA-only ones at the top), yet what the tests need of it is plain Python:
how it names a step's directory from the configured root
(``megatron/bridge/training/utils/checkpoint_utils.py``: ``join_paths``,
``get_checkpoint_name``, ...). :func:`compile_from_wheel` compiles exactly
the named top-level functions from the wheel's source, unchanged, into a
namespace that holds only what they refer to, so a test drives Bridge's own
lines with the values a user types.

``scripts/setup.sh`` downloads the wheel into ``.cache/wheels`` (one
``pip download``, no install). Without it the tests that need it skip, and
under ``CI=true`` fail: CI runs setup.sh.
"""

from __future__ import annotations

import ast
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from extras import CI

WHEEL = "megatron_bridge-0.6.2-py3-none-any.whl"
WHEELS = Path(__file__).resolve().parents[1] / ".cache" / "wheels"
CHECKPOINT_UTILS = "megatron/bridge/training/utils/checkpoint_utils.py"


def wheel() -> Path:
    """The wheel's path (skips, or under CI fails, when setup.sh did not fetch it)."""
    path = WHEELS / WHEEL
    if not path.is_file():
        why = f"{path} is missing: scripts/setup.sh downloads it"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    return path


def compile_from_wheel(member: str, names: Sequence[str], namespace: dict[str, Any]) -> SimpleNamespace:
    """The top-level functions ``names`` of the wheel's ``member``, compiled
    from its source as they are, with ``namespace`` as their globals."""
    with zipfile.ZipFile(wheel()) as whl:
        source = whl.read(member).decode()
    tree = ast.parse(source, filename=member)
    found = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    missing = [n for n in names if n not in found]
    assert not missing, f"{WHEEL}:{member} has no {missing}: not the Bridge release these tests read"
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    exec(compile(module, f"{WHEEL}/{member}", "exec"), namespace)  # noqa: S102 -- Bridge's own released code
    return SimpleNamespace(**{n: namespace[n] for n in names})


class MultiStorageClientFeature:
    """megatron-core's process-global ``--enable-msc`` switch, off: what a
    Bridge run gets unless it passes ``--enable-msc``."""

    @staticmethod
    def is_enabled() -> bool:
        return False


def checkpoint_utils() -> SimpleNamespace:
    """Bridge's path functions for a step, as its save and load call them."""
    namespace: dict[str, Any] = {
        "os": os,
        "Path": Path,
        "Optional": Any,
        "MultiStorageClientFeature": MultiStorageClientFeature,
        "TRAIN_STATE_FILE": "train_state.pt",
        "CONFIG_FILE": "run_config.yaml",
    }
    names = ["join_paths", "get_checkpoint_name", "get_checkpoint_train_state_filename", "get_checkpoint_tracker_filename"]
    return compile_from_wheel(CHECKPOINT_UTILS, names, namespace)
