"""dcpstore.StorageWriter / StorageReader under DCP's own entry points.

``dcp.save`` / ``dcp.load`` / ``dcp.async_save`` with dcpstore's classes, on
every backend; stock DCP (``FileSystemWriter`` / ``FileSystemReader``) is the
oracle wherever both can reach the checkpoint (local paths). Upstream's own
tests run against these classes in tests/upstream.
"""

from __future__ import annotations

import inspect
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcpstore
from dcpstore._impl.dcp.reader import DcpStorageReader
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.engines import staging
from dcpstore.storage import open_storage
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks
from tests.support.helpers import assert_state_equal, sample_state, zeros_like_state
from tests.support.transforms import Inflate, Xor, registry


def tensors(seed: int) -> dict[str, Any]:
    """A state dict of tensors and plain values (what DCP loads in place)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 17, generator=g),
        "b": torch.randn(17, generator=g).half(),
        "ids": torch.randint(0, 1 << 40, (33,), generator=g),
        "nested": {"m": torch.randn(5, 5, generator=g)},
        "step": seed,
    }


def writer(target: Target, **kwargs: Any) -> dcpstore.StorageWriter:
    return dcpstore.StorageWriter(target.uri, options=target.save_options(), **kwargs)


def reader(target: Target, **kwargs: Any) -> dcpstore.StorageReader:
    return dcpstore.StorageReader(target.uri, options=target.load_options(), **kwargs)


def load_with_dcp(state: dict[str, Any], target: Target) -> dict[str, Any]:
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=reader(target))
    return restored


# ---------------------------------------------------------------------------
# dcp.save / dcp.load
# ---------------------------------------------------------------------------


def test_dcp_save_and_load(target: Target) -> None:
    state = sample_state(3)
    dcp.save(state, storage_writer=writer(target))
    assert_state_equal(state, load_with_dcp(state, target))
    restored = zeros_like_state(state)
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert_state_equal(state, restored)


def test_stock_dcp_reads_ours_and_ours_reads_stock(tmp_path: Path) -> None:
    state = sample_state(4)
    dcp.save(state, storage_writer=dcpstore.StorageWriter(tmp_path / "ours"))
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path / "ours"))
    assert_state_equal(state, restored)

    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"))
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=dcpstore.StorageReader(tmp_path / "stock"))
    assert_state_equal(state, restored)


def test_one_writer_and_reader_serve_many_checkpoints(target: Target) -> None:
    # torchtitan and Megatron-Bridge keep one writer and pass checkpoint_id per step.
    w, r = writer(target), reader(target)
    states = {step: tensors(step) for step in (1, 2, 3)}
    for step, state in states.items():
        dcp.save(state, storage_writer=w, checkpoint_id=target.child(f"step{step}").uri)
    for step, state in states.items():
        restored = zeros_like_state(state)
        dcp.load(restored, storage_reader=r, checkpoint_id=target.child(f"step{step}").uri)
        assert_state_equal(state, restored)


def test_checkpoint_id_may_be_spelled_relatively(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    w = dcpstore.StorageWriter(tmp_path / "ckpt")
    dcp.save(tensors(1), storage_writer=w, checkpoint_id="ckpt")
    dcp.save(tensors(2), storage_writer=w, checkpoint_id=Path("other"))
    restored = zeros_like_state(tensors(2))
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path / "other"))
    assert_state_equal(tensors(2), restored)


@pytest.mark.parametrize("role", ["writer", "reader"])
def test_a_writer_or_reader_on_one_storage_refuses_another_checkpoint_id(tmp_path: Path, role: str) -> None:
    # Built on one Storage (as dcpstore.save builds them) there is no way to
    # open another URI: reset to the same URI is fine, another is refused.
    storage = open_storage(str(tmp_path / "a"))
    cls = DcpStorageWriter if role == "writer" else DcpStorageReader
    bound = cls(storage)
    bound.reset(None)
    bound.reset(tmp_path / "a")
    assert bound.storage is storage
    with pytest.raises(dcpstore.InvalidArgument) as e:
        bound.reset(tmp_path / "b")
    message = str(e.value)
    assert f"this {role} is bound to {storage.uri}" in message and str(tmp_path / "b") in message
    assert f"dcpstore.Storage{role.capitalize()} can" in message
    assert bound.storage is storage


def test_a_reused_reader_reads_the_commit_again(target: Target) -> None:
    r = reader(target)
    dcpstore.save(tensors(1), target.uri, **target.kwargs)
    restored = zeros_like_state(tensors(1))
    dcp.load(restored, storage_reader=r)
    assert_state_equal(tensors(1), restored)
    dcpstore.save(tensors(2), target.uri, **target.kwargs)  # replaces the checkpoint at the URI
    dcp.load(restored, storage_reader=r)
    assert_state_equal(tensors(2), restored)


def test_dcp_picks_its_own_writer_for_checkpoint_id_alone(tmp_path: Path) -> None:
    # Our classes are used only when passed: DCP's auto-detection is stock.
    dcp.save(tensors(1), checkpoint_id=tmp_path)
    restored = zeros_like_state(tensors(1))
    dcp.load(restored, storage_reader=dcpstore.StorageReader(tmp_path))
    assert_state_equal(tensors(1), restored)


@pytest.mark.parametrize(
    ("checkpoint_id", "served"),
    [
        ("abc://abc.abc", False),  # stock FileSystemWriter says False too
        ("no-such-scheme://bucket/x", False),
        ("/abs/path", True),
        ("rel/path", True),
        ("file:///abs/path", True),
        ("s3://bucket/prefix", True),
        ("msc://profile/path", True),
        ("memory://x", True),  # an installed fsspec filesystem
    ],
)
def test_validate_checkpoint_id_is_true_exactly_for_what_we_serve(checkpoint_id: str, served: bool) -> None:
    assert dcpstore.StorageWriter.validate_checkpoint_id(checkpoint_id) is served
    assert dcpstore.StorageReader.validate_checkpoint_id(checkpoint_id) is served


class RecordingPlanner(DefaultSavePlanner):
    """Keeps the storage_meta DCP hands the planner."""

    seen: list[StorageMeta | None]

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        self.seen.append(storage_meta)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def test_the_planner_sees_the_save_id_that_metadata_records(target: Target) -> None:
    w, r = writer(target), reader(target)
    planner = RecordingPlanner()
    planner.seen = []
    ids = []
    for step in (1, 2):
        dcp.save(tensors(step), storage_writer=w, planner=planner)
        recorded = r.read_metadata().storage_meta
        assert recorded is not None and planner.seen[-1] is not None
        assert planner.seen[-1].save_id == recorded.save_id != ""
        ids.append(recorded.save_id)
    assert ids[0] != ids[1]


def test_use_collectives_false_is_refused(target: Target) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="use_collectives=False.*no single commit point"):
        dcp.save(tensors(1), storage_writer=writer(target), use_collectives=False)
    assert not any(o["path"] == ".metadata" for o in writer(target).storage.list())


# ---------------------------------------------------------------------------
# Keyword arguments
# ---------------------------------------------------------------------------


def _named_parameters(func: Any) -> set[str]:
    return {
        name
        for name, p in inspect.signature(func).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def test_every_stock_keyword_is_taken() -> None:
    # Each one is honoured or refused with InvalidArgument (tests below);
    # a keyword a new torch adds fails here until it is decided.
    assert _named_parameters(FileSystemWriter.__init__) <= _named_parameters(dcpstore.StorageWriter.__init__)
    assert _named_parameters(FileSystemReader.__init__) <= _named_parameters(dcpstore.StorageReader.__init__)


def test_every_s3torchconnector_keyword_is_taken() -> None:
    s3_dcp = pytest.importorskip("s3torchconnector.dcp")
    assert _named_parameters(s3_dcp.S3StorageWriter.__init__) <= _named_parameters(dcpstore.StorageWriter.__init__)
    assert _named_parameters(s3_dcp.S3StorageReader.__init__) <= _named_parameters(dcpstore.StorageReader.__init__)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"serialization_format": SerializationFormat.SAFETENSORS}, "serialization_format"),
        ({"s3client_config": object()}, "s3client_config"),
        ({"prefix_strategy": object()}, "prefix_strategy"),
        ({"overwrite": "no"}, "overwrite"),
        ({"single_file_per_rank": 1}, "single_file_per_rank"),
        ({"thread_count": 0}, "^StorageWriter: thread_count must be a positive int"),
        ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead"),
        ({"region": ""}, "region"),
        (
            {
                "region": "eu-west-1",
                "options": dcpstore.SaveOptions(storage_options=dcpstore.StorageOptions(region="us-east-1")),
            },
            "region",
        ),
    ],
)
def test_writer_refuses_what_it_cannot_honour(tmp_path: Path, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=named):
        dcpstore.StorageWriter(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"reader_constructor": object()}, "reader_constructor"),
        ({"s3client_config": object()}, "s3client_config"),
        ({"thread_count": 0}, "^StorageReader: thread_count must be a positive int"),
    ],
)
def test_reader_refuses_what_it_cannot_honour(tmp_path: Path, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=named):
        dcpstore.StorageReader(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("cls", "keyword", "instead"),
    [
        (
            dcpstore.StorageWriter,
            "enable_msc",
            "options=dcpstore.SaveOptions(storage_options=dcpstore.StorageOptions(enable_msc=...))",
        ),
        (dcpstore.StorageWriter, "storage_options", "options=dcpstore.SaveOptions(storage_options=...)"),
        (dcpstore.StorageWriter, "spread_prefixes", "options=dcpstore.SaveOptions(spread_prefixes=...)"),
        (dcpstore.StorageReader, "verify", "options=dcpstore.LoadOptions(verify=...)"),
        (dcpstore.StorageReader, "trusted", "options=dcpstore.LoadOptions(trusted=...)"),
        (dcpstore.StorageReader, "storage_options", "options=dcpstore.LoadOptions(storage_options=...)"),
    ],
)
def test_dcpstores_options_go_in_the_options(tmp_path: Path, cls: Any, keyword: str, instead: str) -> None:
    """Beside FileSystemWriter's and FileSystemReader's own arguments the
    drop-ins take dcpstore's options whole: a keyword for one is a
    TypeError naming it and how to pass it."""
    with pytest.raises(
        TypeError, match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument '{keyword}'"
    ) as info:
        cls(str(tmp_path), **{keyword: True})
    assert instead in str(info.value), str(info.value)


def test_a_bad_uri_fails_at_construction() -> None:
    with pytest.raises(dcpstore.InvalidURI, match="abc"):
        dcpstore.StorageWriter("abc://abc.abc")
    with pytest.raises(dcpstore.InvalidURI, match="abc"):
        dcpstore.StorageReader("abc://abc.abc")


def test_region_reaches_the_s3_client(s3_endpoint: Any) -> None:
    w = dcpstore.StorageWriter(f"s3://{s3_endpoint.bucket}/region", region="eu-west-1")
    assert w.storage.client.meta.region_name == "eu-west-1"
    r = dcpstore.StorageReader(f"s3://{s3_endpoint.bucket}/region", region="eu-west-1")
    assert r.storage.client.meta.region_name == "eu-west-1"


def test_single_file_per_rank_false_writes_a_file_per_item(tmp_path: Path) -> None:
    state = tensors(5)
    dcp.save(state, storage_writer=dcpstore.StorageWriter(tmp_path, single_file_per_rank=False, thread_count=2))
    data_files = [p for p in os.listdir(tmp_path) if p.endswith(".distcp")]
    assert len(data_files) == 5  # four tensors and one bytes item (step)
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path))
    assert_state_equal(state, restored)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_thread_count_is_the_number_of_files_per_rank(tmp_path: Path, thread_count: int) -> None:
    dcp.save(tensors(6), storage_writer=dcpstore.StorageWriter(tmp_path, thread_count=thread_count))
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".distcp")]) == thread_count


def test_writer_and_reader_pickle_and_reopen_their_storage(target: Target) -> None:
    w = pickle.loads(pickle.dumps(writer(target, thread_count=3)))
    assert w.workers == 3 and w.checkpoint_id == writer(target).checkpoint_id
    dcp.save(tensors(7), storage_writer=w)
    r = pickle.loads(pickle.dumps(reader(target)))
    restored = zeros_like_state(tensors(7))
    dcp.load(restored, storage_reader=r)
    assert_state_equal(tensors(7), restored)


# ---------------------------------------------------------------------------
# dcp.async_save: our staging, every executor
# ---------------------------------------------------------------------------


class GatedWriter(dcpstore.StorageWriter):
    """Writes only once ``gate`` is set, so a test can change the tensors
    between ``dcp.async_save`` returning and the write."""

    gate: threading.Event

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(60)
        return super().write_data(plan, planner)


def test_async_save_stages_through_dcpstore(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    staged = []
    original = staging.Stager.stage

    def spy(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        staged.append(state_dict)
        return original(self, state_dict, **kwargs)

    monkeypatch.setattr(staging.Stager, "stage", spy)
    w = GatedWriter(target.uri, options=target.save_options())
    w.gate = threading.Event()
    assert isinstance(w, AsyncStager)
    state = tensors(8)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items() if k != "nested"}
    expected["nested"] = {"m": state["nested"]["m"].clone()}
    future = dcp.async_save(state, storage_writer=w)
    assert len(staged) == 1
    for value in (state["w"], state["b"], state["ids"], state["nested"]["m"]):
        value.add_(1)  # training goes on: the checkpoint must not see this
    w.gate.set()
    future.result(timeout=120)
    assert_state_equal(expected, load_with_dcp(expected, target))


def test_cached_staging_reuses_buffers_only_after_the_write(tmp_path: Path) -> None:
    state = tensors(9)
    w = GatedWriter(tmp_path, cache_staged_state_dict=True)
    w.gate = threading.Event()
    w.gate.set()
    first = w.stage(state)
    second = w.stage(state)  # the first staged copy was never written: no reuse
    assert first["w"].data_ptr() != second["w"].data_ptr()
    dcp.async_save(state, storage_writer=w, checkpoint_id=tmp_path / "a").result(timeout=120)
    w.gate.clear()
    pending = dcp.async_save(state, storage_writer=w, checkpoint_id=tmp_path / "b")  # reuses a's buffers
    w.gate.set()
    pending.result(timeout=120)
    for name in ("a", "b"):
        restored = zeros_like_state(state)
        dcp.load(restored, storage_reader=FileSystemReader(tmp_path / name))
        assert_state_equal(state, restored)
    w.close()


def test_staging_without_cache_allocates_every_time(tmp_path: Path) -> None:
    w = dcpstore.StorageWriter(tmp_path)
    state = tensors(10)
    dcp.async_save(state, storage_writer=w).result(timeout=120)
    first = w.stage(state)
    assert first["w"].data_ptr() != w.stage(state)["w"].data_ptr()


def _async_save_on_ranks(rank: int, world_size: int, uri: str, executor: str) -> None:
    g = torch.Generator().manual_seed(rank)
    state = {f"rank{rank}": torch.randn(1000, generator=g), "common": torch.arange(7.0)}
    expected = {k: v.clone() for k, v in state.items()}
    w = dcpstore.StorageWriter(uri)
    future = dcp.async_save(state, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType(executor))
    future.result(timeout=300)
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=dcpstore.StorageReader(uri))
    assert_state_equal(expected, restored)
    w.close()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_on_every_executor(tmp_path: Path, executor: str) -> None:
    # DCP's process executor needs torch.distributed (it sets up its own
    # group in the checkpoint process), so this runs as a 2-rank job.
    run_ranks(_async_save_on_ranks, 2, str(tmp_path / "ckpt"), executor, timeout=600)
    assert (tmp_path / "ckpt" / ".metadata").exists()


# ---------------------------------------------------------------------------
# DCP stream transforms (_extensions / _extension_registry)
# ---------------------------------------------------------------------------


def transformed_state() -> dict[str, Any]:
    state = tensors(11)
    state["big"] = torch.randn(600_000)  # past the size that reads straight into the tensor
    state["blob"] = {"a": [1, 2, 3]}
    return state


def test_stream_transforms_round_trip(target: Target) -> None:
    state = transformed_state()
    dcp.save(state, storage_writer=writer(target, _extensions=[Xor()]))
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=reader(target, _extension_registry=registry(Xor)))
    assert_state_equal(state, restored)


def test_stream_transforms_match_stock_dcp_both_ways(tmp_path: Path) -> None:
    state = transformed_state()
    # One transform: with two that do not commute, stock DCP 2.13 cannot read
    # its own checkpoint back (it undoes them in the order it applied them).
    dcp.save(state, storage_writer=dcpstore.StorageWriter(tmp_path / "ours", _extensions=[Xor()]))
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path / "ours", _extension_registry=registry(Xor)))
    assert_state_equal(state, restored)

    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock", _extensions=[Xor()]))
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=dcpstore.StorageReader(tmp_path / "stock", _extension_registry=registry(Xor)))
    assert_state_equal(state, restored)


def test_an_unknown_stream_transform_is_a_clear_error(tmp_path: Path) -> None:
    state = transformed_state()
    dcp.save(state, storage_writer=dcpstore.StorageWriter(tmp_path, _extensions=[Xor()]))
    with pytest.raises(
        dcpstore.CheckpointCorrupt, match=r"cannot be decoded with its stream transforms \['test.xor/1'\]"
    ):
        dcpstore.load(zeros_like_state(state), tmp_path)


def test_an_item_that_decodes_to_endless_bytes_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000)}
    dcp.save(state, storage_writer=dcpstore.StorageWriter(tmp_path, _extensions=[Xor()]))
    with pytest.raises(CheckpointException, match="decodes to more than"):
        dcp.load(
            zeros_like_state(state),
            storage_reader=dcpstore.StorageReader(tmp_path, _extension_registry=registry(Inflate)),
        )
