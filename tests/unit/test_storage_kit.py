"""The backend kit: what every backend shares, written once.

* the buffered object writer (position, ``tell``, part buffering) against a
  recording backend, property-tested over write and part sizes;
* the kit's arithmetic (read ranges, buffer slices, S3 part sizes), and its
  whole-object read of one version;
* the root-containment check, on every backend;
* one read pool per storage: bounded per call, kept between calls, gone
  after ``close``;
* one S3 error-code table: the native and the MSC backend turn the same
  server answer into the same exception;
* the import boundary of ``dcpstore.storage``.
"""

from __future__ import annotations

import ast
import os
import threading
import time
from pathlib import Path

import botocore.exceptions as bexc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore._impl.storage.backends.s3.error_codes import CODES, STATUSES, Meaning, code_in_text, meaning
from dcpstore._impl.storage.backends.s3.upload import _MAX_PARTS, _part_size_for
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.storage.byte_ranges import PIECE_SLACK, byte_ranges, slice_buffers
from dcpstore._impl.util.errors import ObjectTooLarge, StorageError, StorageNotFound, StoragePermissionError
from dcpstore.storage import MiB, Storage, StorageOptions, open_storage
from tests.support.backends import OBJECT_STORE_OPTIONS, Target
from tests.support.s3_server import S3Endpoint

STORAGE_DIR = Path(dcpstore.__file__).parent / "_impl" / "storage"


# ---------------------------------------------------------------------------
# The buffered object writer
# ---------------------------------------------------------------------------


class _Recording(BufferedObjectWriter):
    """Keeps what the base hands on; can fail at a chosen step."""

    def __init__(self, storage: Storage, part_size: int | None, fail: str = "") -> None:
        super().__init__(storage, "obj.bin", part_size)
        self.parts: list[bytes | bytearray | memoryview] = []
        self.copies: list[bytes] = []
        self.tail: bytes | None = None
        self.discarded = 0
        self.fail = fail

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        if self.fail == "part":
            raise OSError(28, "No space left on device")
        self.parts.append(part)
        self.copies.append(bytes(part))

    def _publish(self, tail: bytearray) -> None:
        if self.fail == "publish":
            raise OSError(5, "Input/output error")
        self.tail = bytes(tail)

    def _discard(self) -> None:
        self.discarded += 1


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    return open_storage(str(tmp_path_factory.mktemp("kit")))


@settings(max_examples=200, deadline=None)
@given(
    part_size=st.integers(1, 64),
    sizes=st.lists(st.integers(0, 200), max_size=12),
    seed=st.integers(0, 255),
)
def test_parts_are_whole_owned_and_in_order(local: Storage, part_size: int, sizes: list[int], seed: int) -> None:
    w = _Recording(local, part_size)
    data = bytes((seed + i) % 251 for i in range(sum(sizes)))
    pos = 0
    for n in sizes:
        chunk = bytearray(data[pos : pos + n])
        assert w.write(memoryview(chunk)) == n
        chunk[:] = b"\xff" * n  # the caller reuses its buffer at once
        pos += n
        assert w.tell() == pos
    w.commit()
    assert w.tail is not None and len(w.tail) < part_size
    assert all(len(p) == part_size for p in w.copies)
    # Parts were owned (bytes/bytearray), not views of the caller's buffer:
    # what the backend kept is still what was written.
    assert all(isinstance(p, bytes | bytearray) for p in w.parts)
    assert b"".join(bytes(p) for p in w.parts) + w.tail == data
    assert w.discarded == 0


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), max_size=10))
def test_streaming_hands_each_write_on_at_once(local: Storage, sizes: list[int]) -> None:
    w = _Recording(local, None)
    data = os.urandom(sum(sizes))
    pos = 0
    for n in sizes:
        w.write(data[pos : pos + n])
        pos += n
        assert w.tell() == pos
        assert b"".join(w.copies) == data[:pos]  # nothing held back
    w.commit()
    assert w.copies == [data[p - n : p] for p, n in zip(_cumulative(sizes), sizes) if n]
    assert w.tail == b""


def _cumulative(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        total += n
        out.append(total)
    return out


def test_a_failed_part_is_a_named_storage_error(local: Storage) -> None:
    w = _Recording(local, 4, fail="part")
    with pytest.raises(StorageError, match=r"cannot write .*obj\.bin: No space left on device \(ENOSPC\)") as info:
        with w:
            w.write(b"12345678")
    assert isinstance(info.value.__cause__, OSError)
    assert w.discarded == 1 and w.tail is None and w.tell() == 0


def test_a_failed_publish_discards(local: Storage) -> None:
    w = _Recording(local, 4, fail="publish")
    with pytest.raises(StorageError, match=r"cannot write .*obj\.bin: Input/output error \(EIO\)"):
        with w:
            w.write(b"123456")
    assert w.discarded == 1


def test_an_error_in_the_block_discards_and_publishes_nothing(local: Storage) -> None:
    w = _Recording(local, 4)
    with pytest.raises(KeyError):
        with w:
            w.write(b"123456")
            raise KeyError("caller")
    assert w.discarded == 1 and w.tail is None
    w.commit()  # closed: a late commit does nothing
    assert w.tail is None


# ---------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------


@given(offset=st.integers(0, 1 << 40), length=st.integers(0, 10_000), piece=st.integers(1, 3_000))
def test_byte_ranges_tile_the_range(offset: int, length: int, piece: int) -> None:
    ranges = byte_ranges(offset, length, piece)
    assert sum(n for _, n in ranges) == length
    pos = offset
    for o, n in ranges:
        assert o == pos and 0 < n <= piece + piece // PIECE_SLACK
        pos += n
    sizes = {n for _, n in ranges}
    assert len(sizes) <= 1 or max(sizes) - min(sizes) == 1  # equal, to a byte
    # As few as the slack allows, and never one more than pieces of `piece` need.
    assert len(ranges) == -(-length // (piece + piece // PIECE_SLACK))
    assert len(ranges) <= -(-length // piece)


def test_byte_ranges_share_out_a_small_tail() -> None:
    """4 x 8 MiB and a record's trailer: four GETs, not a fifth for the trailer."""
    MiB = 1 << 20
    assert [n for _, n in byte_ranges(0, 32 * MiB + 12_000, 8 * MiB)] == [8 * MiB + 3_000] * 4
    assert len(byte_ranges(0, 32 * MiB + 5 * MiB, 8 * MiB)) == 5  # more than the four can share: its own GET


@pytest.mark.parametrize(
    ("now", "limit", "want", "requests"),
    [
        (b"abc", None, b"abc", [4]),  # as seen: one request
        (b"ab", 10, b"ab", [4]),  # replaced by a smaller version: whole, one request
        (b"abcdefgh", 10, b"abcdefgh", [4, 11]),  # by a larger one: asked again, to the limit + 1
        (b"abcdefgh", None, b"abcdefgh", [4, None]),  # no limit: the whole object
        (b"abcdefghijklmnop", 10, ObjectTooLarge, [4, 11]),  # past the limit: refused
        (b"", None, b"", [4]),  # emptied
    ],
)
def test_a_whole_read_returns_one_version_in_at_most_two_requests(
    local: Storage, now: bytes, limit: int | None, want: bytes | type[Exception], requests: list[int | None]
) -> None:
    """The kit's whole-object read for backends whose every request returns
    one version (MSC, fsspec): the size seen was 3 bytes; whatever replaced
    the object since, it returns one version whole, or refuses one past the
    limit, having asked for no more than a byte past it."""
    asked: list[int | None] = []

    def head(n: int | None) -> bytes:
        asked.append(n)
        return now if n is None else now[:n]

    if isinstance(want, bytes):
        assert local._read_one_version("obj", 3, limit, head) == want
    else:
        with pytest.raises(want, match=r"obj: more than the 10 bytes read"):
            local._read_one_version("obj", 3, limit, head)
    assert asked == requests


@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    start=st.integers(0, 450),
    length=st.integers(0, 450),
)
def test_slice_buffers_views_the_requested_bytes(sizes: list[int], start: int, length: int) -> None:
    buffers = [memoryview(bytearray(n)) for n in sizes]
    for b, n in zip(buffers, sizes):
        b[:] = bytes(range(n))
    whole = b"".join(bytes(b) for b in buffers)
    views = slice_buffers(buffers, start, length)
    assert b"".join(bytes(v) for v in views) == whole[start : start + length]
    assert all(v.nbytes for v in views)
    for v in views:  # views into the caller's buffers, not copies
        v[:] = b"\xee" * v.nbytes
    changed = b"".join(bytes(b) for b in buffers)
    end = min(start + length, len(whole))
    assert changed[start:end] == b"\xee" * max(0, end - start)
    assert changed[:start] == whole[:start] and changed[end:] == whole[end:]


@given(part=st.integers(5 * MiB, 64 * MiB), size=st.one_of(st.none(), st.integers(0, 5 << 40)))
def test_s3_parts_fit_the_part_limit(part: int, size: int | None) -> None:
    grown = _part_size_for(part, size)
    assert grown >= part
    if size:
        assert -(-size // grown) <= _MAX_PARTS  # the object fits in 10,000 parts
        assert grown == part or grown % MiB == 0 and (grown - MiB) * _MAX_PARTS < size  # no bigger than needed


# ---------------------------------------------------------------------------
# Root containment, on every backend
# ---------------------------------------------------------------------------

ESCAPES = ["../outside.bin", "/etc/hostname", "a/../../outside.bin", ".."]


@pytest.mark.parametrize("path", ESCAPES)
def test_no_path_escapes_the_root(target: Target, path: str) -> None:
    storage = open_storage(target.uri, **target.kwargs)
    try:
        calls = {
            "open_write": lambda: storage.open_write(path),
            "put": lambda: storage.put(path, b"x"),
            "read": lambda: storage.read(path),
            "read_range": lambda: storage.read_range(path, 0, 1),
            "read_into": lambda: storage.read_into(path, 0, [memoryview(bytearray(1))]),
            "read_into_each": lambda: storage.read_into_each(path, 0, [memoryview(bytearray(1))], lambda k, v: None),
            "size": lambda: storage.size(path),
            "exists": lambda: storage.exists(path),
            "delete": lambda: storage.delete([path]),
            "makedirs": lambda: storage.makedirs(path),
        }
        if not path.startswith("/"):  # list() reads a leading "/" as the root itself
            calls["list"] = lambda: list(storage.list(path))
        for name, call in calls.items():
            with pytest.raises(StorageError, match="escapes the checkpoint root"):
                call()
                pytest.fail(f"{name}({path!r}) did not refuse")
    finally:
        storage.close()
    if target.name == "local":
        assert not os.path.exists(os.path.join(os.path.dirname(target.uri), "outside.bin"))


# ---------------------------------------------------------------------------
# One read pool per storage
# ---------------------------------------------------------------------------


def test_parallel_reads_are_bounded_ordered_and_fail_with_the_earliest(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path), storage_options=StorageOptions(max_concurrency=3))
    lock = threading.Lock()
    active, peak = [0], [0]

    def job(i: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        return i * i

    try:
        assert storage._in_parallel(job, [(i,) for i in range(20)]) == [i * i for i in range(20)]
        assert 1 < peak[0] <= 3

        finished = threading.Event()

        def flaky(i: int) -> None:
            if i == 0:
                time.sleep(0.2)
                finished.set()
            if i in (2, 5):
                raise ValueError(f"job {i}")

        with pytest.raises(ValueError, match="job 2"):
            storage._in_parallel(flaky, [(i,) for i in range(8)])
        # It raised only after the slow job (which may be filling the
        # caller's buffers) was done.
        assert finished.is_set()
    finally:
        storage.close()


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dcpstore-s3-io")}


def test_s3_reads_share_one_pool_until_close(s3_endpoint: S3Endpoint) -> None:
    uri = f"s3://{s3_endpoint.bucket}/kit-pool"
    storage = open_storage(uri, storage_options=OBJECT_STORE_OPTIONS)
    try:
        payload = os.urandom(12 * MiB)  # three 5 MiB ranges
        storage.put("big.bin", payload)
        served: set[threading.Thread] = set()
        get = storage._get  # type: ignore[attr-defined]

        def recording_get(*args: object, **kwargs: object) -> object:
            served.add(threading.current_thread())
            return get(*args, **kwargs)

        storage._get = recording_get  # type: ignore[attr-defined]
        assert storage.read_range("big.bin", 0, len(payload)) == payload
        helpers = served - {threading.current_thread()}
        assert helpers, "the ranges were read in parallel"
        assert all(t.is_alive() for t in helpers), "the pool outlives the call"
        assert all(t in _pool_threads() for t in helpers), "one pool per storage, not per call"
        for _ in range(3):
            assert storage.read("big.bin") == payload
        # Later calls reuse the pool: the threads of the first one are still there.
        assert helpers <= _pool_threads()
    finally:
        storage.close()
        s3_endpoint.delete_prefix("kit-pool/")
    assert not any(t.is_alive() for t in helpers), "close() shut the pool"


# ---------------------------------------------------------------------------
# One S3 error-code table for the native and the MSC backend
# ---------------------------------------------------------------------------

FAMILY = {
    Meaning.NO_BUCKET: StorageNotFound,
    Meaning.NOT_FOUND: StorageNotFound,
    Meaning.BAD_CREDENTIALS: StoragePermissionError,
    Meaning.DENIED: StoragePermissionError,
    Meaning.PAST_END: StorageError,
    Meaning.CHANGED: StorageError,
    Meaning.OTHER: StorageError,
}


def _client_error(code: str, status: int) -> bexc.ClientError:
    return bexc.ClientError(
        {"Error": {"Code": code, "Message": "server says no"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def _as_msc_raises(e: BaseException) -> RuntimeError:
    """MSC's S3 provider re-raises a ClientError as a built-in, chained."""
    try:
        try:
            raise e
        except bexc.ClientError as inner:
            raise RuntimeError("MSC: request failed") from inner
    except RuntimeError as outer:
        return outer


ANSWERS = [(code, 400) for code in CODES] + [("", status) for status in STATUSES] + [("SlowDown", 503), ("", 500)]


@pytest.mark.parametrize(("code", "status"), ANSWERS)
def test_native_and_msc_read_an_s3_answer_alike(s3_endpoint: S3Endpoint, code: str, status: int) -> None:
    uri = f"s3://{s3_endpoint.bucket}/kit-codes"
    native = open_storage(uri)
    via_msc = open_storage(uri, enable_msc=True)
    expected = FAMILY[meaning(code, status)]
    got_native = native._error(_client_error(code, status), "cannot read x")
    got_msc = via_msc._error(_as_msc_raises(_client_error(code, status)), "cannot read x")
    assert type(got_native) is expected, got_native
    assert type(got_msc) is expected, got_msc
    if meaning(code, status) is Meaning.NO_BUCKET:
        assert f"bucket {s3_endpoint.bucket!r} does not exist" in str(got_native)
        assert f"bucket {s3_endpoint.bucket!r} does not exist" in str(got_msc)


def test_codes_in_text_are_whole_words() -> None:
    assert code_in_text("DeleteObjects: key a/b: NoSuchBucket (bucket gone)") == "NoSuchBucket"
    assert code_in_text("FileNotFoundError: x") == ""  # not "NotFound"
    assert code_in_text("HTTP 404") == ""  # statuses are not codes
    assert meaning("NoSuchKey", 403) is Meaning.NOT_FOUND  # the code is the more specific
    assert meaning("Whatever", 403) is Meaning.DENIED


# ---------------------------------------------------------------------------
# The package's import boundary
# ---------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, also inside functions (relative ones resolved)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.add(node.module or "")
            else:
                base = "dcpstore._impl.storage".split(".")[: 4 - node.level]
                out.add(".".join(base + ([node.module] if node.module else [])))
    return out


#: What the storage layer's own modules may import of the rest: the exception
#: family, the one checksum, and the checks of sizes and seconds (which import
#: only the exceptions).
STORAGE_MAY_IMPORT = {"dcpstore._impl.util.errors", "dcpstore._impl.util.checksum", "dcpstore._impl.util.units"}


def test_storage_imports_nothing_of_dcpstore_but_errors_checksum_and_units() -> None:
    for path in sorted(STORAGE_DIR.glob("*.py")):
        ours = {m for m in _imports(path) if m.split(".")[0] == "dcpstore"}
        outside = {m for m in ours if not m.startswith("dcpstore._impl.storage") and m not in STORAGE_MAY_IMPORT}
        assert not outside, f"{path.name} imports {sorted(outside)}"


@given(nbytes=st.integers(1, 1 << 40))
def test_automatic_part_size_leaves_no_tiny_last_part(nbytes: int) -> None:
    """Whole MiB between 8 and 64 MiB, about AUTO_PIECES parts, and no last
    part under 1/8 of the others (a request for a few KiB) unless the size
    is already at its cap."""
    from dcpstore._impl.storage.storage_options import AUTO_PART_MAX, AUTO_PART_MIN, AUTO_PIECES

    size = StorageOptions().part_size_for(nbytes)
    assert size % MiB == 0 and AUTO_PART_MIN <= size <= AUTO_PART_MAX
    count = -(-nbytes // size)
    last = nbytes - (count - 1) * size
    assert count == 1 or last >= size // PIECE_SLACK or size == AUTO_PART_MAX
    if AUTO_PART_MIN < size < AUTO_PART_MAX:
        assert count <= AUTO_PIECES  # never more pieces than asked for
