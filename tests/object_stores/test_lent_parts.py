"""Lent bytes: an S3 part that holds a tensor's bytes sends them from the
tensor's memory, and nothing about the object changes for it.

:class:`PartBody` is checked as the file botocore reads (short reads,
seeks for a retry, ``read()``); :class:`LendingObjectWriter` against the
plain concatenation of whatever was written, for any mix of lent and copied
writes and any part size (hypothesis); and the whole path against a real
(moto) endpoint: what botocore sends for a save, a lender that the caller
drops before its part is sent, and a part that fails and is retried.
"""

from __future__ import annotations

import gc
import io
import itertools
import uuid
import weakref
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore._impl.storage.lending_writer import LEND_MIN, LendingObjectWriter, Part, PartBody
from dcpstore.storage import MiB, StorageOptions, open_storage
from tests.support.faultproxy import FaultConfig, FaultProxy
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.s3_server import S3Endpoint

PART = 5 * MiB


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


# -- PartBody: the file botocore reads ------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), max_size=6),
    reads=st.lists(st.integers(1, 400), min_size=1, max_size=8),
    seek_to=st.integers(0, 2000),
)
def test_a_body_reads_back_its_pieces_in_order_in_any_read_sizes(
    sizes: list[int], reads: list[int], seek_to: int
) -> None:
    pieces = [memoryview(bytes((i * 7 + j) % 251 for j in range(n))) for i, n in enumerate(sizes)]
    whole = b"".join(pieces)
    body = PartBody(pieces)
    assert len(body) == body.nbytes == len(whole) and bool(body) == bool(whole)
    assert body.crc32c() == crc32c.crc32c(whole)
    got = bytearray()
    for i in range(10_000):
        chunk = body.read(reads[i % len(reads)])
        assert len(chunk) <= reads[i % len(reads)]
        if not chunk:
            break
        got += chunk
    assert bytes(got) == whole and body.tell() == len(whole)
    # A retry seeks back (botocore resets the stream), from anywhere.
    at = min(seek_to, len(whole))
    assert body.seek(at) == at
    assert body.read() == whole[at:]
    body.seek(-len(whole), io.SEEK_END)
    out = bytearray(len(whole) + 3)
    assert body.readinto(out) == len(whole) and bytes(out[: len(whole)]) == whole
    body.seek(0)
    body.seek(at, io.SEEK_CUR)
    assert body.read() == whole[at:]
    with pytest.raises(ValueError):
        body.seek(-1)


def test_a_body_reads_views_of_the_pieces_not_copies() -> None:
    lent = bytearray(b"x" * (1 << 20))
    body = PartBody([memoryview(b"head"), memoryview(lent)])
    assert body.read(1 << 30) == b"head"  # a short read: the rest of the first piece only
    chunk = body.read(4096)
    assert isinstance(chunk, memoryview) and _address(chunk) == _address(memoryview(lent))


def test_release_lets_the_owners_go_and_hands_the_buffers_back() -> None:
    class Owner:
        pass

    owner, buffer = Owner(), bytearray(16)
    gone = weakref.ref(owner)
    body = PartBody([memoryview(buffer)[:8], memoryview(b"lent bytes")], owners=[owner], buffers=[buffer])
    del owner
    gc.collect()
    assert gone() is not None  # the body keeps its lender
    assert body.release() == [buffer]
    gc.collect()
    assert gone() is None and len(body) == 0 and body.read(10) == b""
    buffer.extend(b"!")  # no view of the buffer is left: it may be resized for reuse


# -- LendingObjectWriter: the parts are the bytes written ---------------------


class _Recorder(LendingObjectWriter):
    """Keeps every part as it is handed over, and recycles it after copying it."""

    def __init__(self, part_size: int, size_hint: int | None = None) -> None:
        super().__init__(open_storage(f"/tmp/dcpstore-lent-{uuid.uuid4().hex[:8]}"), "obj", part_size, size_hint)
        self.parts: list[bytes] = []
        self.kinds: list[str] = []
        self.tail: bytes | None = None
        self.lent_addresses: set[int] = set()
        self.discarded = False

    def _note(self, part: Any) -> bytes:
        if isinstance(part, PartBody):
            self.kinds.append("body")
            self.lent_addresses.update(_address(p) for p in part._pieces)
            data = part.getvalue()
        else:
            self.kinds.append("bytes")
            data = bytes(part)
        return data

    def _write_part(self, part: bytes | bytearray | memoryview | PartBody) -> None:
        self.parts.append(self._note(part))
        self._recycle(part)

    def _publish(self, tail: Part) -> None:
        self.tail = self._note(tail)
        self._recycle(tail)

    def _discard(self) -> None:
        self.discarded = True


_writes = st.lists(st.tuples(st.booleans(), st.integers(1, 3 * LEND_MIN)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(writes=_writes, part_size=st.sampled_from([LEND_MIN, 100_000, 3 * LEND_MIN + 5]), seal=st.booleans())
def test_parts_are_the_bytes_written_whatever_mix_is_lent(
    writes: list[tuple[bool, int]], part_size: int, seal: bool
) -> None:
    w = _Recorder(part_size)
    sources = []
    for i, (lend, n) in enumerate(writes):
        data = bytearray((i * 31 + j) % 256 for j in range(n))
        sources.append((lend, data))
        if lend:
            w.write_lent(data, owner=data)
        else:
            w.write(data)
    assert w.tell() == sum(len(d) for _, d in sources)
    if seal:
        w.seal()
    w.commit()
    whole = b"".join(bytes(d) for _, d in sources)
    assert b"".join(w.parts) + (w.tail or b"") == whole
    assert all(len(p) == part_size for p in w.parts)  # every part but the last is whole
    assert w.tail is not None and len(w.tail) < part_size
    # Lent writes of LEND_MIN or more were sent from where they lie.
    for lend, data in sources:
        if lend and len(data) >= LEND_MIN:
            assert _address(memoryview(data)) in w.lent_addresses


def test_a_writer_that_does_not_lend_copies_lent_bytes() -> None:
    st_ = open_storage(f"/tmp/dcpstore-lent-{uuid.uuid4().hex[:8]}")
    data = bytearray(b"y" * (2 * LEND_MIN))
    with st_.open_write("plain.bin") as w:
        assert w.write_lent(data, owner=data) == len(data)
    data[:] = b"z" * len(data)  # the local writer copied (wrote) it at once
    assert st_.read("plain.bin") == b"y" * (2 * LEND_MIN)


def test_an_aborted_writer_lets_its_lenders_go() -> None:
    class Owner:
        pass

    owner = Owner()
    gone = weakref.ref(owner)
    w = _Recorder(4 * LEND_MIN)
    w.write_lent(bytearray(2 * LEND_MIN), owner=owner)  # less than a part: held by the writer
    del owner
    gc.collect()
    assert gone() is not None
    w.abort()
    gc.collect()
    assert gone() is None and w.discarded and not w.parts


# -- against a real endpoint -----------------------------------------------------


def _uri(endpoint: S3Endpoint) -> str:
    return f"s3://{endpoint.bucket}/lent-{uuid.uuid4().hex[:8]}"


def _storage_spans(state: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
        for t in state.values()
    ]


def test_a_save_sends_its_tensors_from_their_memory(s3_endpoint: S3Endpoint) -> None:
    """What botocore is handed for each part of a save: a body whose large
    pieces lie in the tensors' own memory; released once answered; and the
    loaded values are the saved ones."""
    uri = _uri(s3_endpoint)
    state = {f"t{i}": torch.randn(2 * MiB) for i in range(4)}  # 8 MiB each: two 5 MiB parts per file
    spans = _storage_spans(state)
    client = open_storage(uri).client  # the client every storage of these options shares
    bodies: list[PartBody] = []
    in_tensors = 0

    def record(params: dict[str, Any], **_: Any) -> None:
        nonlocal in_tensors
        body = params["Body"]
        assert isinstance(body, PartBody), type(body)
        bodies.append(body)
        for piece in body._pieces:
            if piece.nbytes >= LEND_MIN:
                at = _address(piece)
                assert any(lo <= at and at + piece.nbytes <= hi for lo, hi in spans)
                in_tensors += piece.nbytes

    client.meta.events.register("before-parameter-build.s3.UploadPart", record)
    try:
        dcpstore.save(state, uri, storage_options=StorageOptions(part_size=PART))
    finally:
        client.meta.events.unregister("before-parameter-build.s3.UploadPart", record)
    assert len(bodies) >= 4 and in_tensors >= 4 * 5 * MiB  # most bytes went up from the tensors
    assert all(len(b) == 0 and not b.owners for b in bodies)  # released: no part keeps a tensor alive
    dest = zeros_like_state(state)
    dcpstore.load(dest, uri)
    assert_state_equal(dest, state)


def test_a_lender_dropped_by_its_caller_lives_until_its_part_is_sent(s3_endpoint: S3Endpoint) -> None:
    storage = open_storage(_uri(s3_endpoint), storage_options=StorageOptions(part_size=PART))
    tensor = torch.arange(3 * MiB, dtype=torch.int32)  # 12 MiB: two whole parts and a tail
    expected = tensor.numpy().tobytes()
    gone = weakref.ref(tensor)
    with storage.open_write("lent.bin", size_hint=len(expected)) as w:
        w.write_lent(memoryview(tensor.numpy()).cast("B"), owner=tensor)
        del tensor
        gc.collect()
        assert gone() is not None  # its parts hold it
    gc.collect()
    assert gone() is None  # and let it go once the object is written
    assert storage.read("lent.bin") == expected


def test_a_lent_part_that_fails_is_sent_again_whole(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore retries a part by seeking its body back: the second try
    sends the same bytes, which the load's checksums confirm."""
    failures = itertools.count()
    config = FaultConfig(internal_error=1.0, applies=lambda req: req.kind == "UploadPart" and next(failures) < 2)
    with FaultProxy(s3_endpoint.url, config) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        uri = _uri(s3_endpoint)
        state = {f"t{i}": torch.randn(2 * MiB) for i in range(2)}
        dcpstore.save(state, uri, storage_options=StorageOptions(part_size=PART))
        assert sum(proxy.stats.faults.values()) == 2
        dest = zeros_like_state(state)
        dcpstore.load(dest, uri)
    assert_state_equal(dest, state)
