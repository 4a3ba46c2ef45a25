"""How a rank uses an object store: one connection budget for all its files,
checksums in transit, no request it does not need, defaults per backend, and
the MSC spool's memory.

Seen from the outside where it can be: requests in flight and their
headers at a proxy in front of the real (moto) endpoint, peak RSS of the
process, files under ``TMPDIR``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import psutil
import pytest
import torch

import dcpstore
from dcpstore._impl.bench.measure import PeakRSS
from dcpstore._impl.storage.backends.s3.client import CONTINUE_MIN
from dcpstore._impl.storage.concurrency import disk_workers
from dcpstore._impl.storage.storage_options import OBJECT_STORE_WORKERS
from dcpstore._impl.util.errors import CheckpointCorrupt
from dcpstore.storage import MiB, StorageOptions, open_storage
from tests.support.faultproxy import FaultConfig, FaultProxy, Request
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.s3_budget import PART, budget_uri
from tests.support.s3_server import BUCKET, MotoServer, S3Endpoint, Tls


def _in_threads(*fns: object) -> None:
    errors: list[BaseException] = []

    def run(fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_parts_of_all_files_share_one_budget(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """Two objects written at once by two threads keep max_concurrency parts
    in flight between them, not each (a rank's budget, not a file's)."""
    proxy.config = FaultConfig(delay_s=0.25, delay_applies=lambda r: r.kind == "UploadPart")
    st = open_storage(budget_uri(s3_endpoint), storage_options=StorageOptions(part_size=PART, max_concurrency=3))
    payload = os.urandom(4 * PART)

    def write(name: str) -> None:
        with st.open_write(name) as w:
            for i in range(0, len(payload), MiB):
                w.write(payload[i : i + MiB])

    try:
        _in_threads(lambda: write("a"), lambda: write("b"))
        assert proxy.stats.peak_inflight["UploadPart"] == 3
        assert st.read("a") == payload and st.read("b") == payload
    finally:
        st.close()


def test_reads_of_all_files_share_one_budget(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """Ranged GETs of two files read at once stay within one budget."""
    payload = os.urandom(3 * PART)
    uri = budget_uri(s3_endpoint)
    prefix = uri.split("/", 3)[3]
    for name in ("a", "b"):
        s3_endpoint.client().put_object(Bucket=s3_endpoint.bucket, Key=f"{prefix}/{name}", Body=payload)
    proxy.config = FaultConfig(delay_s=0.25, delay_applies=lambda r: r.kind == "GetObject")
    st = open_storage(uri, storage_options=StorageOptions(part_size=PART, max_concurrency=3))
    got: dict[str, bytes] = {}
    try:
        _in_threads(*(lambda n=n: got.__setitem__(n, st.read_range(n, 0, len(payload))) for n in ("a", "b")))
        assert got == {"a": payload, "b": payload}
        assert proxy.stats.requests["GetObject"] == 6
        assert proxy.stats.peak_inflight["GetObject"] == 3
    finally:
        st.close()


def _crc_header(body: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode()


def _unsigned_payloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AWS profile that turns botocore's payload signing off (also over HTTP)."""
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n  payload_signing_enabled = false\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))


def _save_and_load(uri: str) -> None:
    state = {"big": torch.randn(3 * MiB), "small": torch.arange(10)}
    dcpstore.save(state, uri, workers=2, storage_options=StorageOptions(part_size=PART)).result()
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri, storage_options=StorageOptions(part_size=PART))
    assert_state_equal(state, restored)


@pytest.mark.parametrize("setting", ["signed", "unsigned", "unsigned+when_required"])
def test_every_put_and_part_carries_one_digest_of_its_bytes(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setting: str
) -> None:
    """Every PutObject and UploadPart carries exactly one digest of exactly
    the bytes it sends, which S3 verifies. Over plain HTTP botocore signs
    the payload's SHA-256 (``signed``), so no checksum is added beside it --
    neither ours nor botocore's software CRC32. Where the profile turns
    payload signing off (``unsigned``), each request carries its CRC32C,
    uploads are created for CRC32C and completed with every part's; and
    AWS_REQUEST_CHECKSUM_CALCULATION=when_required then turns that off too."""
    if setting != "signed":
        _unsigned_payloads(tmp_path, monkeypatch)
    if setting.endswith("when_required"):
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    seen: list[Request] = []
    proxy.config = FaultConfig(applies=lambda r: seen.append(r) or False)
    _save_and_load(budget_uri(s3_endpoint))

    sends = [r for r in seen if r.kind in ("PutObject", "UploadPart")]
    creates = [r for r in seen if r.kind == "CreateMultipartUpload"]
    completes = [r for r in seen if r.kind == "CompleteMultipartUpload"]
    assert len(sends) >= 5 and creates and completes  # 3 parts, the small file, the commit objects
    crc32c_sent = setting == "unsigned"
    for r in sends:
        assert r.header("x-amz-checksum-crc32") is None  # botocore's own software CRC32: never
        assert r.header("content-encoding") != "aws-chunked"  # no trailer: the body is the bytes
        signed = hashlib.sha256(r.body).hexdigest() if setting == "signed" else "UNSIGNED-PAYLOAD"
        assert r.header("x-amz-content-sha256") == signed, r.kind
        assert r.header("x-amz-checksum-crc32c") == (_crc_header(r.body) if crc32c_sent else None), r.kind
    for r in creates:
        assert (r.header("x-amz-checksum-algorithm") == "CRC32C") is crc32c_sent
    for r in completes:
        assert (b"<ChecksumCRC32C>" in r.body) is crc32c_sent


def test_only_large_bodies_wait_for_100_continue(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """A PUT body under CONTINUE_MIN goes with its headers; a larger one
    (a part) still asks ``Expect: 100-continue`` first, as botocore does for
    every body: a save's small commit files each cost one round trip, not
    two (requests as the endpoint receives them)."""
    seen: list[Request] = []
    proxy.config = FaultConfig(applies=lambda r: seen.append(r) or False)
    _save_and_load(budget_uri(s3_endpoint))

    sends = [r for r in seen if r.kind in ("PutObject", "UploadPart")]
    small = [r for r in sends if len(r.body) < CONTINUE_MIN]
    large = [r for r in sends if len(r.body) >= CONTINUE_MIN]
    assert len(small) >= 4 and len(large) >= 2  # the commit's files and the small tensor's; the parts
    assert [r.kind for r in small if r.header("expect") is not None] == []
    assert all(r.header("expect") == "100-continue" for r in large)


@pytest.fixture(scope="module")
def tls_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """A second moto server, over HTTPS (a self-signed loopback certificate)."""
    where = tmp_path_factory.mktemp("moto-tls")
    server = MotoServer(where, tls=Tls.make(where)).start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield S3Endpoint(server, BUCKET)
    finally:
        server.stop()


def test_over_https_a_crc32c_spares_the_payload_signature(
    s3_endpoint: S3Endpoint, tls_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTPS each PutObject and UploadPart carries its CRC32C, and
    botocore, seeing it, leaves the payload unsigned: one hardware CRC32C of
    the bytes instead of a SHA-256 (requests as the client sends them, seen
    through botocore's ``before-send``: TLS hides them from a proxy)."""
    assert tls_endpoint.server.tls is not None
    monkeypatch.setenv("AWS_ENDPOINT_URL", tls_endpoint.url)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tls_endpoint.server.tls.cert))
    uri = budget_uri(tls_endpoint)
    client = open_storage(uri).client  # the process's shared client for this environment
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def record(request: Any, event_name: str, **_: Any) -> None:
        body = request.body
        if hasattr(body, "read"):
            at = body.tell()
            body, _rest = body.read(), body.seek(at)
        # Lower-cased: botocore's own signer writes X-Amz-Content-SHA256, the CRT's (awscrt installed) lower case.
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        seen.append((event_name.rsplit(".", 1)[-1], headers, bytes(body or b"")))

    client.meta.events.register("before-send.s3", record)
    try:
        _save_and_load(uri)
    finally:
        client.meta.events.unregister("before-send.s3", record)
    sends = [(op, h, b) for op, h, b in seen if op in ("PutObject", "UploadPart")]
    assert len(sends) >= 5 and {op for op, _, _ in sends} == {"PutObject", "UploadPart"}
    for op, headers, body in sends:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD", op
        assert headers["x-amz-checksum-crc32c"] == _crc_header(body), op
        assert "x-amz-checksum-crc32" not in headers


def test_a_load_knows_each_size_before_reading_and_still_finds_a_wrong_one(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load knows each data file's real size before reading it (nothing is
    allocated for bytes a file does not hold): from one listing, in flight
    beside the commit read, so no size request per file; where the listing
    does not serve (it failed, or a checkpoint of more files than a page),
    one size request per file, never one per ranged GET. A data file longer
    than the manifest says is refused either way."""
    from dcpstore._impl.storage.backends.s3.storage import S3Storage

    state = {f"t{i}": torch.randn(MiB // 4) for i in range(4)}
    uri = budget_uri(s3_endpoint)
    info = dcpstore.save(state, uri, workers=2).result()
    asked: list[str] = []
    size = S3Storage.size

    def spy(self: S3Storage, path: str) -> int:
        asked.append(path)
        return size(self, path)

    monkeypatch.setattr(S3Storage, "size", spy)
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri)
    assert_state_equal(state, restored)
    assert [p for p in asked if p.endswith(".distcp")] == []  # the listing told every size

    prefix = uri.split("/", 3)[3]
    client = s3_endpoint.client()
    key = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=prefix)["Contents"]
        if o["Key"].endswith(".distcp")
    )
    body = client.get_object(Bucket=s3_endpoint.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_endpoint.bucket, Key=key, Body=body + b"appended")
    with pytest.raises(CheckpointCorrupt, match=r"size .* expected"):
        dcpstore.load(zeros_like_state(state), uri)

    monkeypatch.setattr(S3Storage, "learn_sizes", lambda self: None)  # no listing: a size request per file
    client.put_object(Bucket=s3_endpoint.bucket, Key=key, Body=body)
    asked.clear()
    dcpstore.load(restored, uri)
    assert sorted(p for p in asked if p.endswith(".distcp")) == sorted(info.files)
    client.put_object(Bucket=s3_endpoint.bucket, Key=key, Body=body + b"appended")
    with pytest.raises(CheckpointCorrupt, match=r"size .* expected"):
        dcpstore.load(zeros_like_state(state), uri)


def test_a_load_reads_its_commit_in_one_round_trip(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """``.metadata`` and the manifest are asked for together, by GET alone
    (its ``Content-Range`` tells the size a capped read checks: no HEAD),
    and so is the one listing that tells the data files' sizes: the proxy
    holds each of the three until all three have arrived, which they do
    only if none waits for another's answer. After an overwrite
    (save-unique manifest name) the right manifest is asked for next, and
    no name that is not there."""
    state = {f"t{i}": torch.randn(MiB // 4) for i in range(4)}
    uri = budget_uri(s3_endpoint)
    dcpstore.save(state, uri, workers=2).result()
    bucket = s3_endpoint.bucket  # a listing's target
    together = {".metadata", ".dcpstore.json", bucket}
    seen: list[tuple[str, str]] = []
    arrived: set[str] = set()
    all_arrived = threading.Event()
    lock = threading.Lock()
    alone: list[str] = []  # held until the hold gave up: the others came only after its answer

    def hold_until_all_arrive(req: Request) -> None:
        name = req.target.split("?")[0].rsplit("/", 1)[-1]
        with lock:
            seen.append((req.method, name))
            if name in together and not all_arrived.is_set():
                arrived.add(name)
                if arrived == together:
                    all_arrived.set()
            else:
                return None
        if not all_arrived.wait(10):
            alone.append(name)
        return None

    proxy.config.answer = hold_until_all_arrive  # type: ignore[assignment]
    dcpstore.load(zeros_like_state(state), uri)
    assert not alone, (alone, seen)
    commit = [(m, name) for m, name in seen if not name.endswith(".distcp") and name != bucket]
    assert sorted(commit) == [("GET", ".dcpstore.json"), ("GET", ".metadata")], commit
    assert [name for _, name in seen].count(bucket) == 1, seen  # one listing per load

    dcpstore.save(state, uri, workers=2, overwrite=True).result()  # save-unique names
    seen.clear()

    def record(req: Request) -> None:
        seen.append((req.method, req.target.split("?")[0].rsplit("/", 1)[-1]))

    proxy.config.answer = record  # type: ignore[assignment]
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri)
    assert_state_equal(state, restored)
    commit_reads = [(m, name) for m, name in seen if not name.endswith(".distcp") and name != bucket]
    assert [name for _, name in seen].count(bucket) == 1  # one listing per load
    assert [m for m, _ in commit_reads] == ["GET"] * 3, (
        commit_reads
    )  # .metadata, the plain name (gone: a 404), the tagged one
    assert commit_reads[-1][1].startswith(".dcpstore.") and commit_reads[-1][1] != ".dcpstore.json", commit_reads


def test_a_body_cut_short_is_read_again(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """A GET whose body stops half-way (received straight into the tensors)
    is retried, and the load is right."""
    state = {"a": torch.randn(3 * MiB)}
    uri = budget_uri(s3_endpoint)
    opts = StorageOptions(part_size=PART, max_attempts=8)
    dcpstore.save(state, uri, storage_options=opts).result()
    gets = iter(range(1000))
    proxy.config = FaultConfig(drop_response=1.0, applies=lambda r: r.kind == "GetObject" and next(gets) % 2 == 1)
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri, storage_options=opts)
    assert_state_equal(state, restored)
    assert proxy.stats.faults["drop_response"] >= 1


def test_default_workers_follow_the_cpus_on_disks_only(
    tmp_path: Path, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = open_storage(budget_uri(s3_endpoint))
    local = open_storage(str(tmp_path))
    try:
        for cpus, on_disk in ((1, 2), (4, 4), (64, 8)):
            monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
            assert disk_workers() == on_disk
            assert local.default_workers() == on_disk
            assert s3.default_workers() == OBJECT_STORE_WORKERS
    finally:
        s3.close()
        local.close()


def test_msc_spools_large_objects_to_a_file_not_to_memory(
    s3_endpoint: S3Endpoint, msc_config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object beyond the in-memory spool goes through a temporary file
    under TMPDIR, uploaded by name: RSS grows by far less than the object,
    and no spool file outlives the write, committed or aborted."""
    import tempfile

    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool_dir))
    st = open_storage(f"msc://{msc_config}/spool-{uuid.uuid4().hex[:8]}")
    size = 96 * MiB  # above MSC's 64 MiB multipart threshold: its streamed path
    chunk = os.urandom(MiB)
    seen_spool: list[str] = []
    servers = {c.pid for c in psutil.Process().children(recursive=True)}  # moto's memory is the store's
    try:
        with PeakRSS(ignore_pids=servers) as rss, st.open_write("big.bin") as w:
            for _ in range(size // MiB):
                w.write(chunk)
            seen_spool = os.listdir(spool_dir)
        assert seen_spool and all(n.startswith(".dcpstore-msc-") for n in seen_spool)
        assert os.listdir(spool_dir) == []
        assert rss.peak - rss.before < size // 3, f"RSS grew by {(rss.peak - rss.before) >> 20} MiB"
        assert st.size("big.bin") == size
        with pytest.raises(RuntimeError, match="boom"), st.open_write("aborted.bin") as w:
            for _ in range(16):
                w.write(chunk)
            raise RuntimeError("boom")
        assert os.listdir(spool_dir) == [] and not st.exists("aborted.bin")
    finally:
        st.delete(["big.bin"])
        st.close()
