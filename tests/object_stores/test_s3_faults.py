"""Saves through a faulty network (tests/support/faultproxy.py in front of moto).

A share of requests answered ``503 SlowDown`` or ``500 InternalError``, of
connections dropped mid-request or mid-response, of responses stalled past
the read timeout, or every response slow: saves still commit and round-trip.
Every request failing, every part upload stalled, or a dead endpoint (nothing
listening, or a black hole that accepts connections and never answers): the
save or load fails within a bound, clearly, with nothing committed and no
multipart upload left open.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.tools.maintenance import gc
from dcpstore.storage import MiB, StorageOptions, open_storage
from tests.support.faultproxy import FaultConfig, FaultProxy, Request, s3_error
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.s3_server import S3Endpoint

PART = 5 * MiB


def _uri(endpoint: S3Endpoint) -> str:
    return f"s3://{endpoint.bucket}/faults-{uuid.uuid4().hex[:8]}"


def _direct_keys(endpoint: S3Endpoint, uri: str) -> list[str]:
    """Keys under ``uri`` as the server has them (bypassing the proxy)."""
    prefix = uri.split("/", 3)[3]
    resp = endpoint.client().list_objects_v2(Bucket=endpoint.bucket, Prefix=prefix + "/")
    return [o["Key"].rsplit("/", 1)[-1] for o in resp.get("Contents", [])]


def _state() -> dict[str, torch.Tensor]:
    # One multipart-sized file (3 parts) and a small one (workers=2).
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(3 * MiB, generator=g), "c": torch.arange(10)}


def _save_and_load_back(uri: str, opts: StorageOptions) -> None:
    """Save the test state through the faults, load it back, compare."""
    state = _state()
    dcpstore.save(state, uri, workers=2, storage_options=opts).result()
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri, storage_options=opts)
    assert_state_equal(state, restored)


@pytest.mark.slow  # seconds of seeded faults; each fault kind alone is quick below
def test_save_through_slowdowns_and_drops_commits_and_roundtrips(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    # Every fault kind on every request kind; the proxy's RNG is seeded, so
    # how many faults the first N requests draw is fixed (botocore's backoff
    # sleeps dominate this test's time, hence modest shares).
    proxy.config = FaultConfig(slowdown=0.1, drop=0.07, drop_response=0.07)
    opts = StorageOptions(part_size=PART, max_concurrency=4, max_attempts=8, op_timeout_s=60)
    uri = _uri(s3_endpoint)
    _save_and_load_back(uri, opts)
    assert sum(proxy.stats.faults.values()) >= 3, proxy.stats  # the faults really happened
    assert proxy.stats.requests["UploadPart"] >= 3
    assert ".metadata" in _direct_keys(s3_endpoint, uri)
    # No parts are left behind. A CreateMultipartUpload whose *response* was
    # dropped and then retried leaves an empty upload that no client can know
    # of; gc (or a lifecycle rule) removes those.
    prefix = uri.split("/", 3)[3]
    client = s3_endpoint.client()
    for upload in s3_endpoint.open_uploads(prefix):
        parts = client.list_parts(Bucket=s3_endpoint.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        assert parts.get("Parts", []) == []
    gc(open_storage(uri, storage_options=opts), older_than_s=0)
    assert s3_endpoint.open_uploads(prefix) == []


def test_every_request_failing_fails_within_bound_and_commits_nothing(
    proxy: FaultProxy, s3_endpoint: S3Endpoint
) -> None:
    proxy.config = FaultConfig(slowdown=1.0)
    opts = StorageOptions(part_size=PART, max_attempts=3, op_timeout_s=20)
    uri = _uri(s3_endpoint)
    t0 = time.monotonic()
    with pytest.raises(dcpstore.SaveError) as info:
        dcpstore.save(_state(), uri, storage_options=opts)
    elapsed = time.monotonic() - t0
    # botocore standard backoff: <= 1 s + 2 s for 3 attempts; far below the bound.
    assert elapsed < opts.op_timeout_s
    message = str(info.value)
    assert uri in message and "SlowDown" in message and "3 attempts" in message
    assert _direct_keys(s3_endpoint, uri) == []
    assert s3_endpoint.open_uploads(uri.split("/", 3)[3]) == []


def test_failing_parts_abort_their_upload(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    # Only UploadPart fails: the multipart upload was opened, so the writer
    # must abort it; .metadata must never be written.
    proxy.config = FaultConfig(slowdown=1.0, applies=lambda r: r.kind == "UploadPart")
    opts = StorageOptions(part_size=PART, max_attempts=2, op_timeout_s=20)
    uri = _uri(s3_endpoint)
    with pytest.raises(dcpstore.SaveError, match="cannot upload part"):
        dcpstore.save(_state(), uri, workers=2, storage_options=opts)
    assert proxy.stats.requests["CreateMultipartUpload"] >= 1
    assert proxy.stats.requests["AbortMultipartUpload"] >= 1
    assert ".metadata" not in _direct_keys(s3_endpoint, uri)
    assert s3_endpoint.open_uploads(uri.split("/", 3)[3]) == []


def test_retry_time_is_bounded_by_op_timeout(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    proxy.config = FaultConfig(slowdown=1.0)
    opts = StorageOptions(part_size=PART, max_attempts=50, op_timeout_s=0.5)
    st = open_storage(_uri(s3_endpoint), storage_options=opts)
    t0 = time.monotonic()
    with pytest.raises(dcpstore.StorageError, match=r"gave up after .* \(op_timeout_s=0\.5\); last error: SlowDown"):
        st.put("x", b"x")
    # Past the deadline no further attempt starts; one backoff sleep (<= 20 s
    # in botocore's standard mode) may still run before that check.
    assert time.monotonic() - t0 < 25
    assert proxy.stats.requests["PutObject"] < 50


def test_unabortable_upload_is_reported_and_gc_removes_it(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    # The network dies after the upload was opened: even the abort fails. The
    # writer says so (naming gc); gc over a healthy connection cleans it up.
    proxy.config = FaultConfig(slowdown=1.0, applies=lambda r: r.kind in ("UploadPart", "AbortMultipartUpload"))
    opts = StorageOptions(part_size=PART, max_attempts=2)
    uri = _uri(s3_endpoint)
    st = open_storage(uri, storage_options=opts)
    with caplog.at_level(logging.WARNING, logger="dcpstore"):
        with pytest.raises(dcpstore.StorageError, match=r"cannot upload part \d"):
            with st.open_write("__0_0.distcp") as w:
                w.write(b"z" * (2 * PART))
                w.commit()
    assert "dcpstore gc" in caplog.text
    prefix = uri.split("/", 3)[3]
    assert len(s3_endpoint.open_uploads(prefix)) == 1
    proxy.config = FaultConfig()  # the network is back
    assert list(st.list_incomplete()) == ["__0_0.distcp"]
    assert gc(st, older_than_s=0).incomplete_uploads == 1
    assert s3_endpoint.open_uploads(prefix) == []


def _nth(kind: str, n: int) -> Callable[[Request], bool]:
    """A rule matching only the n-th request (1-based) of ``kind``."""
    seen = [0]

    def rule(req: Request) -> bool:
        if req.kind != kind:
            return False
        seen[0] += 1
        return seen[0] == n

    return rule


NO_SUCH_UPLOAD = s3_error(404, "Not Found", "NoSuchUpload", "The specified upload does not exist.")


def test_lost_complete_reply_still_commits(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    # S3 completed the upload but the reply broke off; botocore retries and
    # S3 may then answer NoSuchUpload: the writer recognises its own object
    # (by the multipart ETag) and reports success.
    second = _nth("CompleteMultipartUpload", 2)
    proxy.config = FaultConfig(
        drop_response=1.0,
        applies=_nth("CompleteMultipartUpload", 1),
        answer=lambda req: NO_SUCH_UPLOAD if second(req) else None,
    )
    st = open_storage(_uri(s3_endpoint), storage_options=StorageOptions(part_size=PART, max_attempts=3))
    payload = bytes(range(256)) * (11 * MiB // 256)
    with st.open_write("obj") as w:
        w.write(payload)
    assert proxy.stats.faults == {"drop_response": 1, "answer": 1}
    assert st.read("obj") == payload


def test_no_such_upload_on_complete_without_the_object_fails(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    proxy.config = FaultConfig(answer=lambda req: NO_SUCH_UPLOAD if req.kind == "CompleteMultipartUpload" else None)
    uri = _uri(s3_endpoint)
    st = open_storage(uri, storage_options=StorageOptions(part_size=PART, max_attempts=3))
    with pytest.raises(dcpstore.StorageNotFound, match="cannot complete multipart upload"):
        with st.open_write("obj") as w:
            w.write(b"q" * (11 * MiB))
    assert not st.exists("obj")
    assert s3_endpoint.open_uploads(uri.split("/", 3)[3]) == []  # aborted after all


# -- 500s, slow responses, stalls, dead endpoints -----------------------------------


def _share(p: float, seed: int, kinds: tuple[str, ...] | None = None) -> Callable[[Request], bool]:
    """A seeded predicate true for a share ``p`` of requests (of ``kinds``)."""
    rng, lock = random.Random(seed), threading.Lock()

    def rule(req: Request) -> bool:
        if kinds is not None and req.kind not in kinds:
            return False
        with lock:
            return rng.random() < p

    return rule


@pytest.mark.slow  # waits out stalls and backoffs
def test_500s_and_stalled_responses_are_retried_save_and_load_roundtrip(
    proxy: FaultProxy, s3_endpoint: S3Endpoint
) -> None:
    # 500 InternalError on a share of requests, and a share held past the
    # read timeout (a stalled response: botocore gives up on it and retries;
    # a CompleteMultipartUpload may so land twice, which the writer handles).
    opts = StorageOptions(part_size=PART, max_concurrency=4, max_attempts=8, read_timeout_s=0.5, op_timeout_s=60)
    proxy.config = FaultConfig(internal_error=0.1, delay_s=0.8, delay_applies=_share(0.08, seed=3))
    uri = _uri(s3_endpoint)
    _save_and_load_back(uri, opts)
    assert proxy.stats.faults["internal_error"] >= 1 and proxy.stats.faults["delay"] >= 1, proxy.stats
    assert ".metadata" in _direct_keys(s3_endpoint, uri)


@pytest.mark.slow
def test_slow_responses_only_slow_a_save_down(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    # Every request answered late, but within the read timeout: no retry needed.
    opts = StorageOptions(part_size=PART, max_attempts=1, read_timeout_s=5.0)
    proxy.config = FaultConfig(delay_s=0.15, delay_applies=lambda req: True)
    uri = _uri(s3_endpoint)
    _save_and_load_back(uri, opts)
    assert proxy.stats.faults["delay"] == sum(proxy.stats.requests.values())


#: Bounds for the dead-endpoint cases: generous for a loaded 2-core box,
#: far below "forever". Expected: attempts x (connect/read timeout + backoff).
DEAD_OPTS = StorageOptions(part_size=PART, max_attempts=2, connect_timeout_s=0.5, read_timeout_s=0.5, op_timeout_s=5.0)
DEAD_BOUND_S = 60.0
#: Below MSC's default read timeout (60 s), so that the MSC test tells them apart.
MSC_DEAD_BOUND_S = 30.0


@contextlib.contextmanager
def _dead_endpoint(kind: str) -> Iterator[str]:
    """``refused``: nothing listens. ``blackhole``: TCP connects (the kernel's
    backlog) but no byte is ever answered, like a wedged server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        if kind == "blackhole":
            sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    ("kind", "cause"),
    [
        ("refused", "cannot connect"),
        pytest.param("blackhole", "ReadTimeoutError", marks=pytest.mark.slow),  # waits out read timeouts
    ],
)
def test_dead_endpoint_fails_saves_and_loads_within_a_bound(
    kind: str, cause: str, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = _uri(s3_endpoint)
    dcpstore.save(_state(), uri, storage_options=DEAD_OPTS)  # a checkpoint to load, on the live endpoint
    with _dead_endpoint(kind) as dead:
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
        other = _uri(s3_endpoint)
        calls = {
            "sync save": lambda: dcpstore.save(_state(), other, storage_options=DEAD_OPTS),
            "async save": lambda: dcpstore.save(
                _state(), other, async_=True, engine="native", storage_options=DEAD_OPTS
            ).result(timeout=DEAD_BOUND_S),
            "load": lambda: dcpstore.load(zeros_like_state(_state()), uri, storage_options=DEAD_OPTS),
        }
        for what, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(dcpstore.CheckpointError) as info:
                call()
            elapsed = time.monotonic() - t0
            assert elapsed < DEAD_BOUND_S, f"{what} took {elapsed:.1f} s"
            message = "".join(traceback.format_exception(info.value))
            assert cause in message and dead in message, (what, message)
            assert (other if "save" in what else uri) in str(info.value), what
    assert _direct_keys(s3_endpoint, other) == []  # nothing committed, nothing at all
    assert s3_endpoint.open_uploads(other.split("/", 3)[3]) == []


def test_a_hung_endpoint_fails_within_the_configured_timeout_through_msc(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # s3:// with enable_msc=True and no MSC profile for it: MSC's implicit
    # profile, whose own defaults (60 s timeouts, MSC's retries around
    # botocore's) would take minutes here. It must take StorageOptions'.
    small = {"c": torch.arange(10)}
    uri = _uri(s3_endpoint)
    dcpstore.save(small, uri, enable_msc=True, storage_options=DEAD_OPTS)  # a checkpoint to load
    with _dead_endpoint("blackhole") as dead:
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
        other = _uri(s3_endpoint)
        calls = {
            "save": (other, lambda: dcpstore.save(small, other, enable_msc=True, storage_options=DEAD_OPTS)),
            "load": (
                uri,
                lambda: dcpstore.load(zeros_like_state(small), uri, enable_msc=True, storage_options=DEAD_OPTS),
            ),
        }
        for what, (named, call) in calls.items():
            t0 = time.monotonic()
            with pytest.raises(dcpstore.CheckpointError) as info:
                call()
            elapsed = time.monotonic() - t0
            # 2 attempts x 0.5 s plus backoff; MSC's default would be >= 60 s.
            assert elapsed < MSC_DEAD_BOUND_S, f"{what} took {elapsed:.1f} s"
            assert named in str(info.value), (what, str(info.value))
            assert "timeout" in "".join(traceback.format_exception(info.value)).lower(), what
    assert _direct_keys(s3_endpoint, other) == []


def test_stalled_part_uploads_fail_the_save_within_a_bound(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    # Every UploadPart stalls past the read timeout, for good: the async save
    # fails by itself (no hang), its upload is aborted, nothing is committed.
    proxy.config = FaultConfig(delay_s=3.0, delay_applies=lambda req: req.kind == "UploadPart")
    uri = _uri(s3_endpoint)
    t0 = time.monotonic()
    handle = dcpstore.save(_state(), uri, async_=True, engine="native", storage_options=DEAD_OPTS)
    with pytest.raises(dcpstore.SaveError, match="cannot upload part") as info:
        handle.result(timeout=DEAD_BOUND_S)
    assert time.monotonic() - t0 < DEAD_BOUND_S
    assert "ReadTimeoutError" in str(info.value) or "op_timeout_s" in str(info.value), str(info.value)
    assert ".metadata" not in _direct_keys(s3_endpoint, uri)
    assert s3_endpoint.open_uploads(uri.split("/", 3)[3]) == []


# -- a failed save's clean-up, while the endpoint is down (#29 item 12) ------------

#: The endpoint "goes down" once the save's data is on its way: every part
#: upload, abort and delete fails (so the save fails, and so does its clean-up).
_DOWN = FaultConfig(
    slowdown=1.0, applies=lambda r: r.kind in ("UploadPart", "AbortMultipartUpload", "DeleteObjects", "DeleteObject")
)


def _leftover_state(uri: str, endpoint: S3Endpoint) -> tuple[list[str], int]:
    """The alive files under ``uri`` and its open uploads, as the server has them."""
    alive = [k for k in _direct_keys(endpoint, uri) if k.startswith(".dcpstore.alive.")]
    return alive, len(endpoint.open_uploads(uri.split("/", 3)[3] + "/"))


def _fail_while_down(proxy: FaultProxy, endpoint: S3Endpoint, save: Callable[[str], object]) -> tuple[str, str]:
    proxy.config = _DOWN
    uri = _uri(endpoint)
    with pytest.raises(dcpstore.SaveError) as info:
        save(uri)
    assert _leftover_state(uri, endpoint) == ([_leftover_state(uri, endpoint)[0][0]], 1)  # both left behind
    proxy.config = FaultConfig()  # the endpoint answers again
    return uri, str(info.value)


def _wait_clean(uri: str, endpoint: S3Endpoint, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _leftover_state(uri, endpoint) != ([], 0):
        assert time.monotonic() < deadline, _leftover_state(uri, endpoint)
        time.sleep(0.1)


_OPTS = StorageOptions(part_size=PART, max_attempts=2, op_timeout_s=20)


def test_a_failed_saves_clean_up_is_retried_by_the_next_save(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, tmp_path
) -> None:
    """The error says what will happen; the next save (to another storage,
    even) tries the clean-up again, in the background, and it succeeds."""
    uri, message = _fail_while_down(
        proxy, s3_endpoint, lambda u: dcpstore.save(_state(), u, workers=1, storage_options=_OPTS)
    )
    assert "Its clean-up failed as well (2 step(s)" in message, message
    assert "abort the multipart upload of" in message and "remove the alive file" in message, message
    assert "tries again at its next save, at close() and at exit" in message and f"'dcpstore gc {uri}'" in message
    dcpstore.save({"x": torch.ones(3)}, str(tmp_path / "next"))
    _wait_clean(uri, s3_endpoint)
    # What is left is an ordinary interrupted save: gc takes it, its process notwithstanding.
    assert gc(open_storage(uri, storage_options=_OPTS), older_than_s=0).removed == ["."]
    assert _direct_keys(s3_endpoint, uri) == []


def test_a_failed_async_saves_clean_up_is_retried_by_close(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    saver = dcpstore.AsyncSaver()

    def save(u: str) -> None:
        saver.save(
            _state(), u, options=dcpstore.SaveOptions(engine="native", workers=1, storage_options=_OPTS)
        ).result()

    uri, message = _fail_while_down(proxy, s3_endpoint, save)
    assert "tries again at its next save, at close() and at exit" in message
    saver.close()  # tries once more, and waits for it
    assert _leftover_state(uri, s3_endpoint) == ([], 0)


def test_a_failed_dropin_saves_clean_up_is_kept_by_its_writer(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, tmp_path
) -> None:
    """The drop-in writer under stock ``dcp.save`` keeps what a failed save
    could not clean up as dcpstore's own savers do: the error (inside DCP's
    CheckpointException) says what will happen, the writer's next save
    tries again in the background, and close() waits for a last try."""
    import torch.distributed.checkpoint as dcp

    writer = dcpstore.StorageWriter(
        _uri(s3_endpoint), thread_count=1, options=dcpstore.SaveOptions(storage_options=_OPTS)
    )
    first = _fail_while_down(proxy, s3_endpoint, lambda u: _dcp_save_raising_ours(dcp, writer, u))
    assert "Its clean-up failed as well (2 step(s)" in first[1], first[1]
    assert "tries again at its next save, at close() and at exit" in first[1], first[1]
    dcp.save({"x": torch.ones(3)}, storage_writer=writer, checkpoint_id=str(tmp_path / "next"))
    _wait_clean(first[0], s3_endpoint)
    second = _fail_while_down(proxy, s3_endpoint, lambda u: _dcp_save_raising_ours(dcp, writer, u))
    writer.close()  # tries once more, and waits for it
    assert _leftover_state(second[0], s3_endpoint) == ([], 0)


def _dcp_save_raising_ours(dcp: Any, writer: dcpstore.StorageWriter, uri: str) -> None:
    """``dcp.save`` through ``writer`` to ``uri``; the rank's own error,
    which DCP wraps in a CheckpointException (a BaseException), raised as
    the SaveError ``_fail_while_down`` expects, its message as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(_state(), storage_writer=writer, checkpoint_id=uri)
    except CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, dcpstore.CheckpointError)]
        if not ours:
            raise
        raise dcpstore.SaveError(str(ours[0])) from e


def test_a_failed_saves_clean_up_is_retried_at_exit(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """A process whose save failed while the endpoint was down, and that
    exits without another save or close(): the exit hook does it."""
    uri = _uri(s3_endpoint)
    code = textwrap.dedent(
        f"""
        import sys, torch, dcpstore
        from dcpstore.storage import MiB, StorageOptions
        opts = StorageOptions(part_size=5 * MiB, max_attempts=2, op_timeout_s=20)
        try:
            dcpstore.save({{"a": torch.randn(3 * MiB)}}, {uri!r}, workers=1, storage_options=opts)
        except dcpstore.SaveError as e:
            print("failed", flush=True)
        sys.stdin.readline()  # the endpoint answers again
        """
    )
    proxy.config = _DOWN
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "failed"
        assert _leftover_state(uri, s3_endpoint)[1] == 1
        proxy.config = FaultConfig()
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert _leftover_state(uri, s3_endpoint) == ([], 0)
