"""Object-store specifics the shared suites cannot see from the outside:
multipart vs single PUT, bounded part concurrency, parallel ranged reads,
no orphaned uploads, incomplete-upload cleanup (``dcpstore gc``), the client
cache, MSC's temp files and the fsspec transactional path (s3fs)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

import dcpstore
from dcpstore._impl.storage import MiB, StorageOptions, open_storage, parse_uri
from dcpstore._impl.storage.backends.s3.storage import S3Storage, s3_client
from dcpstore._impl.tools.maintenance import gc
from tests.support.backends import OBJECT_STORE_OPTIONS, make_target
from tests.support.faultproxy import FaultConfig, FaultProxy
from tests.support.s3_server import S3Endpoint

PART = 5 * MiB


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3(s3_endpoint: S3Endpoint) -> S3Storage:
    st = open_storage(f"s3://{s3_endpoint.bucket}/{_prefix()}", storage_options=OBJECT_STORE_OPTIONS)
    assert isinstance(st, S3Storage)
    return st


def _etag(endpoint: S3Endpoint, st: S3Storage, path: str) -> str:
    return str(endpoint.client().head_object(Bucket=endpoint.bucket, Key=st.key(path))["ETag"]).strip('"')


def test_small_objects_are_one_put_large_ones_multipart(s3: S3Storage, s3_endpoint: S3Endpoint) -> None:
    s3.put("small", b"x" * 1000)
    with s3.open_write("exact") as w:
        w.write(os.urandom(PART))
    payload = os.urandom(13 * MiB)
    with s3.open_write("big") as w:
        for i in range(0, len(payload), 777_777):  # odd-sized writes straddle parts
            w.write(payload[i : i + 777_777])
    assert "-" not in _etag(s3_endpoint, s3, "small")  # a plain PUT's ETag is an MD5
    assert _etag(s3_endpoint, s3, "exact").endswith("-1")  # >= part_size: multipart
    assert _etag(s3_endpoint, s3, "big").endswith("-3")  # 5 + 5 + 3 MiB
    assert s3.read("big") == payload
    assert s3.read_range("big", PART - 10, 20) == payload[PART - 10 : PART + 10]


def test_part_size_grows_for_objects_beyond_10000_parts() -> None:
    from dcpstore._impl.storage.backends.s3.upload import _part_size_for

    assert _part_size_for(PART, None) == PART
    assert _part_size_for(PART, 10_000 * PART) == PART
    grown = _part_size_for(PART, 10_000 * PART + 1)
    assert grown > PART and grown % MiB == 0 and grown * 10_000 >= 10_000 * PART + 1


def test_automatic_part_size_follows_the_object_size() -> None:
    auto = StorageOptions()
    assert auto.part_size_for(None) == 16 * MiB  # a stream of unknown size
    assert auto.part_size_for(10 * MiB) == 8 * MiB  # never below 8 MiB
    assert auto.part_size_for(128 * MiB) == 16 * MiB  # ~AUTO_PIECES parts
    assert auto.part_size_for(100 * MiB + 1) == 13 * MiB  # whole MiB, rounded up
    assert auto.part_size_for(64 << 30) == 64 * MiB  # never above 64 MiB
    # A last part of a few KiB is shared out: 4 parts for 32 MiB of tensors
    # and their record headers, not 4 x 8 MiB and one of 64 KiB.
    assert auto.part_size_for(32 * MiB + 64 * 1024) == 9 * MiB
    assert auto.part_size_for(34 * MiB) == 8 * MiB  # a 2 MiB last part is worth its request
    # The connection budget is shared by a rank's files: it does not size parts.
    assert StorageOptions(max_concurrency=2).part_size_for(128 * MiB) == 16 * MiB
    assert StorageOptions(part_size=PART).part_size_for(1 << 30) == PART  # set: used as is


def test_auto_parts_upload_a_file_as_several_parts(s3_endpoint: S3Endpoint) -> None:
    """A 24 MiB object goes up as 3 parts of 8 MiB (ETag ``-3``) and reads back."""
    st = open_storage(f"s3://{s3_endpoint.bucket}/{_prefix()}", storage_options=StorageOptions())
    payload = os.urandom(24 * MiB)
    with st.open_write("auto.bin", size_hint=len(payload)) as w:
        w.write(payload)
    assert _etag(s3_endpoint, st, "auto.bin").endswith("-3")
    assert st.read("auto.bin") == payload


def test_abort_mid_multipart_leaves_no_upload(s3: S3Storage, s3_endpoint: S3Endpoint) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with s3.open_write("partial.bin") as w:
            w.write(os.urandom(12 * MiB))  # two parts already on their way
            raise RuntimeError("boom")
    assert not s3.exists("partial.bin")
    assert s3_endpoint.open_uploads(s3.prefix) == []


def test_parts_in_flight_are_bounded_by_max_concurrency(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Held parts make overlap observable at the proxy: exactly max_concurrency.
    slow_parts = FaultConfig(delay_s=0.25, delay_applies=lambda r: r.kind == "UploadPart")
    with FaultProxy(s3_endpoint.url, slow_parts) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        for limit in (1, 3):
            opts = StorageOptions(part_size=PART, max_concurrency=limit)
            st = open_storage(f"s3://{s3_endpoint.bucket}/{_prefix()}", storage_options=opts)
            proxy.stats.peak_inflight.clear()
            chunk = os.urandom(MiB)
            with st.open_write("obj") as w:
                for _ in range(4 * 5):  # 4 parts
                    w.write(chunk)
            assert proxy.stats.peak_inflight["UploadPart"] == limit
            assert st.size("obj") == 20 * MiB


def test_large_reads_are_parallel_ranged_gets(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = os.urandom(13 * MiB)
    prefix = _prefix()
    s3_endpoint.client().put_object(Bucket=s3_endpoint.bucket, Key=f"{prefix}/obj", Body=payload)
    slow_gets = FaultConfig(delay_s=0.2, delay_applies=lambda r: r.kind == "GetObject")
    with FaultProxy(s3_endpoint.url, slow_gets) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        st = open_storage(f"s3://{s3_endpoint.bucket}/{prefix}", storage_options=OBJECT_STORE_OPTIONS)
        assert st.read_range("obj", 1, 13 * MiB - 2) == payload[1:-1]
        assert proxy.stats.requests["GetObject"] == 3
        assert proxy.stats.peak_inflight["GetObject"] == 3
        assert st.read("obj") == payload  # first GET learns the size, then 2 more in parallel
        assert proxy.stats.requests["GetObject"] == 6


def test_open_uploads_are_listed_and_cleaned_by_gc(s3: S3Storage, s3_endpoint: S3Endpoint) -> None:
    # What a process killed mid-save leaves: a data file without .metadata,
    # and a multipart upload that was never completed nor aborted.
    client = s3_endpoint.client()
    s3.put("step1/__0_0.distcp", b"data")
    upload = client.create_multipart_upload(Bucket=s3.bucket, Key=s3.key("step1/__0_1.distcp"))
    client.upload_part(
        Bucket=s3.bucket, Key=s3.key("step1/__0_1.distcp"), UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * 100
    )
    assert list(s3.list_incomplete()) == ["step1/__0_1.distcp"]
    assert [o["path"] for o in s3.list()] == ["step1/__0_0.distcp"]  # uploads are not objects
    # moto reports every upload as initiated in 2010, so "too recent" is
    # checked against an age no upload can have (~300 years).
    assert s3.cleanup_incomplete(older_than_s=1e10) == 0
    report = gc(s3, older_than_s=0)
    assert report.incomplete_uploads == 1
    assert report.removed == ["step1"]
    assert list(s3.list()) == [] and s3_endpoint.open_uploads(s3.prefix) == []


def test_list_reports_mtime(s3: S3Storage) -> None:
    s3.put("a", b"1")
    (entry,) = list(s3.list())
    assert entry["path"] == "a" and abs(entry["mtime"] - time.time()) < 600


def test_client_is_cached_per_configuration(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    a = StorageOptions(part_size=PART)
    assert s3_client(a) is s3_client(StorageOptions(part_size=PART))
    assert s3_client(a) is not s3_client(StorageOptions(part_size=PART, max_attempts=2))
    before = s3_client(a)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
    assert s3_client(a) is not before  # credentials changed: a fresh client
    monkeypatch.undo()
    assert s3_client(a) is before


# -- MSC -----------------------------------------------------------------------


def test_msc_posix_temp_files_are_hidden_then_gone(request: pytest.FixtureRequest) -> None:
    target = make_target("local+msc", request)
    st = open_storage(target.uri, **target.kwargs)
    st.makedirs()
    w = st.open_write("x.bin")
    w.write(b"partial")
    assert [o["path"] for o in st.list()] == []  # MSC's .x.bin.tmp is not an object
    assert list(st.list_incomplete()) == [".x.bin.tmp"]
    w.abort()
    assert list(st.list_incomplete()) == [] and not st.exists("x.bin")
    with st.open_write("x.bin") as w:
        w.write(b"done")
    assert st.read("x.bin") == b"done" and list(st.list_incomplete()) == []


@pytest.mark.parametrize("name", ["s3+msc", "msc"])
def test_msc_object_abort_sends_nothing(name: str, request: pytest.FixtureRequest, s3_endpoint: S3Endpoint) -> None:
    target = make_target(name, request)
    st = open_storage(target.uri, **target.kwargs)
    with pytest.raises(RuntimeError):
        with st.open_write("big.bin") as w:
            w.write(os.urandom(11 * MiB))
            raise RuntimeError("boom")
    assert not st.exists("big.bin")
    assert s3_endpoint.open_uploads() == []


@pytest.mark.parametrize("name", ["s3", "s3+msc", "msc"])
def test_object_store_targets_upload_multi_mib_files_in_parts(
    name: str, request: pytest.FixtureRequest, s3_endpoint: S3Endpoint
) -> None:
    """What backends.py promises the shared suites: on every object-store
    target a 12 MiB data file goes up as a multipart upload (5 MiB parts),
    and comes back whole (the quick run's round trip through ``s3+msc``,
    which the shared suites run in the slow run: conftest.SLOW_TARGETS)."""
    target = make_target(name, request)
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32), "step": 7}
    dcpstore.save(state, target.uri, workers=1, **target.kwargs)
    restored = {"w": torch.zeros(3 * MiB), "step": 0}
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 7
    prefix = target.uri.split("/", 3)[3] + "/"
    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=prefix)["Contents"]
    [key] = [o["Key"] for o in listed if o["Key"].endswith(".distcp")]
    etag = str(s3_endpoint.client().head_object(Bucket=s3_endpoint.bucket, Key=key)["ETag"]).strip('"')
    assert etag.endswith("-3"), f"{name}: {key} went up as {etag!r}, not in three parts"


def test_msc_s3_uses_an_implicit_profile(s3_endpoint: S3Endpoint) -> None:
    st = open_storage(f"s3://{s3_endpoint.bucket}/{_prefix()}", enable_msc=True)
    assert st.backend == "msc"
    assert st.client.profile == f"_s3-{s3_endpoint.bucket}"  # type: ignore[attr-defined]


# -- fsspec over s3fs: the transactional (autocommit=False) path ----------------


def test_fsspec_s3fs_commits_atomically_and_aborts_cleanly(s3_endpoint: S3Endpoint) -> None:
    pytest.importorskip("s3fs")
    from dcpstore._impl.storage.backends.fsspec import FsspecStorage

    st = FsspecStorage(parse_uri(f"s3://{s3_endpoint.bucket}/{_prefix()}"), StorageOptions(part_size=PART))
    assert st.transactional
    payload = os.urandom(12 * MiB)
    w = st.open_write("obj")
    w.write(payload)
    assert not st.exists("obj")  # parts are up, the object is not
    w.commit()
    assert st.read("obj") == payload and st.read_range("obj", PART, 10) == payload[PART : PART + 10]
    with pytest.raises(RuntimeError):
        with st.open_write("gone") as w:
            w.write(payload)
            raise RuntimeError("boom")
    assert not st.exists("gone")
    assert s3_endpoint.open_uploads() == []
    assert [o["path"] for o in st.list()] == ["obj"]


def test_fsspec_memory_uses_temp_then_move(request: pytest.FixtureRequest) -> None:
    target = make_target("memory", request)
    st = open_storage(target.uri)
    w = st.open_write("a.bin")
    w.write(b"half")
    assert not st.exists("a.bin") and len(list(st.list_incomplete())) == 1
    w.commit()
    assert st.read("a.bin") == b"half" and list(st.list_incomplete()) == []
