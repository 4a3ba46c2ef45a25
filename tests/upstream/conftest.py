"""Wiring for the upstream copies: the substitution (upstream_shim.py) while
they are imported and while each runs, the list of tests that run here, and
s3torchconnector's ``checkpoint_directory`` fixture on moto.

Default: dcpstore's classes, and every test outside :data:`PASS_WITH_STOCK`
is skipped with the reason it does not run here, so this directory asserts
exactly "ours pass what the stock classes pass on this machine".
``DCPSTORE_UPSTREAM=stock`` runs every copied test with the stock classes
(s3torchconnector's client pointed at the same moto endpoint): rerun it to
refresh the list after a torch or s3torchconnector upgrade.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from upstream_shim import MODE, s3_dcp, substituted

from tests.support.s3_server import REGION, S3Endpoint

HERE = Path(__file__).resolve().parent

if s3_dcp is None:
    collect_ignore_glob = ["s3torchconnector/*"]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    # The copies bind FileSystemWriter & co. when they are imported.
    if isinstance(collector, pytest.Module):
        with substituted():
            return (yield)
    return (yield)


@pytest.fixture(autouse=True)
def _substitute() -> Iterator[None]:
    with substituted():
        yield


# ---------------------------------------------------------------------------
# Which tests run here
# ---------------------------------------------------------------------------

_FS_CPU = "pytorch/test_file_system_checkpoint_cpu.py::"
_E2E = "pytorch/e2e/test_e2e_save_and_load.py::"
_S3_FS = "s3torchconnector/test_e2e_s3_file_system.py::"

#: Every test that passes with the stock classes here (CPU only, S3 on moto),
#: found with DCPSTORE_UPSTREAM=stock, minus those NOT_HERE puts out of scope
#: (listed in PROVENANCE.md). Ours must pass them all.
PASS_WITH_STOCK: frozenset[str] = frozenset(
    [f"{_FS_CPU}TestDistributedStateDictSaveLoad::test_read_write_only_tensor_thread_count_{n}" for n in (1, 2)]
    + [
        f"{_FS_CPU}TestDistributedStateDictSaveLoadRot13::test_read_write_tensor_and_blob_thread_count_{n}"
        for n in (1, 2)
    ]
    + [
        f"{_FS_CPU}TestDistributedStateDictSaveLoadWithSharedTensor::test_read_write_shard_tensor_thread_count_{n}"
        for n in (1, 2)
    ]
    + [
        f"{_FS_CPU}TestDistributedReshardOnLoad::{test}_thread_count_{n}"
        for test in (
            "test_load_rowwise_to_colwise",
            "test_load_with_different_shard_plan",
            "test_save_load_bytes",
            "test_switch_between_sharded_tensor_to_tensor",
        )
        for n in (1, 2)
    ]
    + [
        f"{_E2E}TestE2ESaveAndLoad::test_no_dist",
        f"{_E2E}TestE2ESaveAndLoad::test_stateful_and_non_stateful_loads",
        f"{_E2E}TestInitStateDict::test_init_state_dict",
        f"{_S3_FS}test_overwrite",
    ]
)

#: Why each other test does not run here, by node id prefix (first match
#: wins). "fails with the stock classes": it fails here whatever the classes.
NOT_HERE: dict[str, str] = {
    f"{_FS_CPU}TestDistributedStateDictSaveLoad::test_dtype_mismatch_casting": (
        "fails with the stock classes: DefaultLoadPlanner(allow_unsafe_types=) is newer than torch 2.13"
    ),
    f"{_FS_CPU}TestDistributedStateDictSaveLoadZStandard": (
        "fails with the stock classes: the zstandard module is not installed"
    ),
    f"{_E2E}TestNoCPU": "fails with the stock classes: needs NCCL",
    f"{_E2E}": "needs 4 CUDA devices (skipped by the test itself)",
    f"{_S3_FS}test_dcp_when_multi_process": (
        "out of scope: checks s3torchconnector's user-agent string (writer.fs._client) and exact object count"
    ),
    f"{_S3_FS}test_round_": (
        "out of scope: s3torchconnector's prefix strategies (the object-store performance issue), "
        "checked through its user-agent string and exact object count"
    ),
    f"{_S3_FS}test_successful_rename": "out of scope: calls s3torchconnector's private client (writer.fs.rename)",
    f"{_S3_FS}test_rename_non_existing_s3_uri": "out of scope: calls s3torchconnector's private client (writer.fs.rename)",
    f"{_S3_FS}test_rm_file_non_existing_s3_uri": "out of scope: calls s3torchconnector's private client (writer.fs.rm_file)",
    f"{_S3_FS}test_s3client_config_for_writer": "out of scope: reads s3torchconnector's private client config",
    "s3torchconnector/test_e2e_s3_storage_reader.py::test_dcp_load_reads_tensors_in_sequential_order": (
        "out of scope: observes s3torchconnector's reader classes (patches SequentialS3Reader.read / "
        "DCPOptimizedS3Reader.read) chosen by its reader_constructor"
    ),
    "s3torchconnector/test_e2e_s3_storage_reader.py::test_dcp_optimized_loading_patterns": (
        "out of scope: counts calls of s3torchconnector's private client (S3Client._get_object_stream)"
    ),
    "s3torchconnector/test_e2e_s3_storage_reader.py::test_zstd_compression_partial_load": (
        "fails with the stock classes: the zstandard module is not installed"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MODE == "stock":
        return
    for item in items:
        if not Path(item.path).resolve().is_relative_to(HERE):
            continue  # pytest hands every conftest the whole session's items
        nodeid = _local_id(item)
        if nodeid in PASS_WITH_STOCK:
            continue
        reason = next((why for prefix, why in NOT_HERE.items() if nodeid.startswith(prefix)), None)
        item.add_marker(pytest.mark.skip(reason=reason or "not in the list of tests that pass with the stock classes"))


def _local_id(item: pytest.Item) -> str:
    return Path(item.path).resolve().relative_to(HERE).as_posix() + "::" + item.nodeid.split("::", 1)[1]


# ---------------------------------------------------------------------------
# s3torchconnector's fixture, on moto
# ---------------------------------------------------------------------------


class CheckpointDirectory:
    """What s3torchconnector's ``checkpoint_directory`` fixture provides
    (tst/e2e/conftest.py, which needs a real bucket): a unique prefix in a
    bucket, here on the session's moto endpoint."""

    def __init__(self, endpoint: S3Endpoint, prefix: str) -> None:
        self.region = REGION
        self.bucket = endpoint.bucket
        self.prefix = prefix
        self.storage_class = None

    @property
    def s3_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def is_express_storage(self) -> bool:
        return False


@pytest.fixture
def checkpoint_directory(request: pytest.FixtureRequest, s3_endpoint: S3Endpoint) -> Iterator[CheckpointDirectory]:
    prefix = f"upstream-{random.randrange(2**64):016x}/"
    if MODE == "stock":
        _point_s3torchconnector_at(s3_endpoint, request)
    yield CheckpointDirectory(s3_endpoint, prefix)
    s3_endpoint.delete_prefix(prefix)


def _point_s3torchconnector_at(endpoint: S3Endpoint, request: pytest.FixtureRequest) -> None:
    """Stock mode: give every s3torchconnector client the moto endpoint and
    path-style addressing (it takes no endpoint from the environment)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import _s3client

    original = _s3client.S3Client.__init__
    url = endpoint.url

    def init(
        self: Any, region: str, *, endpoint: str | None = None, s3client_config: Any = None, **kwargs: Any
    ) -> None:
        config = dataclasses.replace(s3client_config or S3ClientConfig(), force_path_style=True)
        original(self, region, endpoint=endpoint or url, s3client_config=config, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(_s3client.S3Client, "__init__", init)
    request.addfinalizer(mp.undo)
