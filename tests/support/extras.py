"""The optional parts the suites skip without, decided independently of the
code under test.

A skip decided by calling dcpstore (``nvrx.import_error()``,
``nvrx.target_for()``) hides a bug there: had it refused a backend it
serves, every case on that backend would become a skip and the run would
stay green. Here a skip is decided by importing the module itself, or by
the table below; the suites assert that dcpstore agrees with it.

Under ``CI=true`` (``.ci/run``, which installs ``.[dev]``: every extra) a
missing extra fails the test that needs it instead of skipping it, and
``tests/ci/test_extras.py`` fails when anything ``.[dev]`` names is not
installed or does not import.
"""

from __future__ import annotations

import importlib
import os

import pytest

#: Set by CI systems (and by .ci/run's callers): every extra must be here.
CI = os.environ.get("CI", "").lower() == "true"

#: Per distribution the suites can run without: the modules a test needs
#: from it, imported to tell whether it is usable here.
MODULES: dict[str, tuple[str, ...]] = {
    "nvidia-resiliency-ext": (
        "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
        "nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver",
    ),
    "multi-storage-client": ("multistorageclient",),
    "boto3": ("boto3",),
    "fsspec": ("fsspec",),
    "s3fs": ("s3fs",),
    "s3torchconnector": ("s3torchconnector.dcp",),
    "moto": ("moto.server",),
    "torchtitan": ("torchtitan.components.checkpoint",),
    "lightning": ("lightning.fabric", "lightning.pytorch"),
    "torch-checkpointing": ("torch_checkpointing.checkpoint_manager",),
    "safetensors": ("safetensors.torch",),
}

NVRX = "nvidia-resiliency-ext"

#: The targets of tests/support/backends.py that the NVRx engine writes to: NVRx
#: writes with ``open()`` or ``msc.open()``, so POSIX paths and MSC, never
#: the native S3 or the fsspec backend (docs/engines.md).
NVRX_TARGETS = frozenset({"local", "local+direct", "local+msc", "msc", "s3+msc"})

#: The targets the process engine cannot write: fsspec's ``memory://`` is
#: one process's memory, not the checkpoint process's (docs/engines.md).
PROCESS_REFUSED = frozenset({"memory"})


def missing(dist: str) -> str | None:
    """Why ``dist`` is not usable here (``None``: each of its modules imports)."""
    for module in MODULES[dist]:
        try:
            importlib.import_module(module)
        except Exception as e:  # a broken install counts as missing, with its reason
            return f"{dist} does not import here ({module}: {type(e).__name__}: {e})"
    return None


def skip_unless(dist: str, what: str = "") -> None:
    """Skip the running test (``what``: the part that could not run) when
    ``dist`` is not usable; under CI fail it: CI installs every extra."""
    why = missing(dist)
    if why is None:
        return
    text = f"{what}: {why}" if what else why
    if CI:
        pytest.fail(f"CI installs every extra, yet {text}")
    pytest.skip(text)


def skip_module_unless(dist: str) -> None:
    """At a test module's top, for a module that needs ``dist`` throughout:
    skip the whole module when it is not usable; under CI fail: CI installs
    every extra, and a broken install must not pass as a skip."""
    why = missing(dist)
    if why is None:
        return
    if CI:
        pytest.fail(f"CI installs every extra, yet {why}", pytrace=False)
    pytest.skip(f"{why} (pip install 'dcpstore[{dist}]')", allow_module_level=True)


#: For tests that need NVRx throughout (under CI, tests/ci/test_extras.py
#: fails the run when it is missing).
needs_nvrx = pytest.mark.skipif(missing(NVRX) is not None, reason=missing(NVRX) or "")
