"""One connection budget shared out over a rank's files *and* their parts,
seen from the outside: requests held at a proxy in front of the real (moto)
endpoint until as many as the budget allows are in flight together -- no
timing, so a client that keeps fewer in flight never gets there -- and the
sizes the requests carry.

A rank writing or reading few large files must still keep its whole
``max_concurrency`` busy (each file then goes in more parts or ranges), and
one writing many must not make more requests than the budget needs
(:meth:`~dcpstore.storage.StorageOptions.transfer_pieces`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

import dcpstore
from dcpstore._impl.util.errors import StorageError
from dcpstore.storage import MiB, StorageOptions, open_storage
from tests.support.faultproxy import FaultConfig, FaultProxy, Request
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.s3_budget import PART, budget_uri
from tests.support.s3_server import S3Endpoint

#: The budget of the one-file tests: above the 8 pieces a lone object or
#: read was cut into before the batch decided (so that they fail there),
#: with as few 8 MiB pieces as that allows.
ONE_FILE_BUDGET = 9


def _holding(kind: str, sizes: list[int]) -> FaultConfig:
    """Hold every ``kind`` request for a data file at the proxy; note each
    one's body size (uploads) or asked range length (GETs) in ``sizes``."""

    def data(req: Request) -> bool:
        return req.kind == kind and req.target.split("?")[0].endswith(".distcp")

    def note(req: Request) -> None:
        if data(req):
            asked = req.header("Range")
            sizes.append(len(req.body) if asked is None else _range_length(asked))

    return FaultConfig(hold_applies=data, answer=lambda r: note(r))  # type: ignore[func-returns-value]


def _range_length(header: str) -> int:
    lo, _, hi = header.removeprefix("bytes=").partition("-")
    return int(hi) - int(lo) + 1


def _held_at_once(proxy: FaultProxy, count: int, run: Callable[[], object]) -> int:
    """Run ``run`` on a thread until ``count`` requests are held at the
    proxy (or a minute passes); release them; return how many were held."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            run()
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=go)
    worker.start()
    try:
        held = proxy.wait_held(count, timeout_s=60)
    finally:
        proxy.release()
        worker.join(120)
    assert not worker.is_alive() and not errors, errors
    return held


def test_a_one_file_save_keeps_the_whole_budget_in_flight(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """A save of one data file (one worker) at the automatic part size keeps
    ``max_concurrency`` parts in flight at once: every UploadPart is held at
    the proxy until that many are held together (no timing: a client that
    sends fewer at once never gets there). The parts are of equal size, the
    last one no larger."""
    width = ONE_FILE_BUDGET
    state = {f"t{i}": torch.randn(2 * MiB) for i in range(width)}  # one file of width x 8 MiB
    sizes: list[int] = []
    proxy.config = _holding("UploadPart", sizes)
    uri = budget_uri(s3_endpoint)
    opts = StorageOptions(max_concurrency=width)
    assert _held_at_once(proxy, width, lambda: dcpstore.save(state, uri, workers=1, storage_options=opts)) == width
    ordered = sorted(sizes)
    assert len(sizes) == width and ordered[1:] == [ordered[-1]] * (width - 1), sizes  # the last part no larger
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri, storage_options=opts)
    assert_state_equal(state, restored)


def test_a_one_tensor_load_keeps_the_whole_budget_in_flight(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """A load of one large tensor (one run of one reader) keeps
    ``max_concurrency`` ranged GETs in flight at once, held at the proxy
    as above, in ranges of equal size."""
    width = ONE_FILE_BUDGET
    state = {"big": torch.randn(width * 2 * MiB)}
    uri = budget_uri(s3_endpoint)
    opts = StorageOptions(max_concurrency=width)
    dcpstore.save(state, uri, storage_options=opts).result()
    sizes: list[int] = []
    proxy.config = _holding("GetObject", sizes)
    restored = zeros_like_state(state)
    assert _held_at_once(proxy, width, lambda: dcpstore.load(restored, uri, storage_options=opts)) == width
    assert len(sizes) == width and max(sizes) - min(sizes) <= 1, sizes
    assert_state_equal(state, restored)


def test_the_last_part_leaves_at_seal_and_the_upload_starts_at_open(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """An object whose hint says it needs parts starts its multipart upload
    when it is opened, before any byte is written; ``seal()`` sends the
    last, partial part before the commit, which only completes the upload.
    An object far smaller than its hint still lands whole (one part), an
    aborted one leaves no upload behind, and a write after ``seal()`` is refused."""
    st = open_storage(budget_uri(s3_endpoint))
    prefix = st.key("")  # type: ignore[attr-defined]
    payload = os.urandom(20 * MiB)  # hint 20 MiB: 2 parts of 10 MiB
    try:
        w = st.open_write("a.bin", size_hint=len(payload))
        _eventually(lambda: proxy.stats.requests["CreateMultipartUpload"] == 1)
        w.write(payload[: 15 * MiB])  # one full part and half of the last
        w.write(payload[15 * MiB :])
        w.seal()
        _eventually(lambda: proxy.stats.requests["UploadPart"] == 2)
        assert proxy.stats.requests["CompleteMultipartUpload"] == 0 and not st.exists("a.bin")
        with pytest.raises(StorageError, match="after seal"):
            w.write(b"more")
        w.commit()
        assert st.read("a.bin") == payload

        with st.open_write("small.bin", size_hint=len(payload)) as w:
            w.write(b"much less than the hint")
        assert st.read("small.bin") == b"much less than the hint"
        with st.open_write("empty.bin", size_hint=len(payload)):
            pass
        assert st.read("empty.bin") == b""
        with pytest.raises(RuntimeError, match="boom"), st.open_write("aborted.bin", size_hint=len(payload)):
            raise RuntimeError("boom")
        assert not st.exists("aborted.bin") and s3_endpoint.open_uploads(prefix) == []
    finally:
        st.close()


def _eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the request never arrived"
        time.sleep(0.01)


def test_part_and_range_sizes_share_the_budget_out_over_the_batch() -> None:
    """The batch, not each object, is cut into about two rounds of the
    budget: four files of a 128 MiB save in 4 parts each, one file alone in
    16; equal pieces to the byte; 8-64 MiB; one piece under 16 MiB."""
    o = StorageOptions()  # max_concurrency 16
    file = 32 * MiB + 32 * 1024  # a quarter of a 128 MiB save, with the record headers' estimate
    assert o.transfer_pieces(file, 4 * file) == 4
    assert o.upload_part_size(file, 4 * file) == -(-file // 4)  # not 9 MiB x 3 and a 5 MiB sliver
    big = 128 * MiB + 32 * 1024  # a quarter of a 512 MiB save (BENCHMARKS' WAN pair at 512 MiB)
    assert o.transfer_pieces(big, 4 * big) == 8 and o.upload_part_size(big, 4 * big) == -(-big // 8)  # ~16 MiB parts
    assert o.transfer_pieces(128 * MiB) == 16  # a lone object fills the budget
    assert o.transfer_pieces(1 << 30) == 32  # 32 MiB each: two rounds
    assert o.transfer_pieces(100 << 30) == 1600  # never above 64 MiB
    assert o.transfer_pieces(12 * MiB) == 1 and o.upload_part_size(12 * MiB) == 12 * MiB  # one PUT
    assert o.upload_part_size(4096) == 8 * MiB  # a hint too low still makes parts S3 accepts
    assert o.transfer_pieces(64 * MiB, 64 * 64 * MiB) == 1  # many files: a part each, no more requests
    assert o.upload_part_size(None) == 16 * MiB
    assert StorageOptions(part_size=PART).upload_part_size(1 << 30, 1 << 40) == PART


def test_part_buffers_are_reused_and_never_shared(s3_endpoint: S3Endpoint) -> None:
    """A part's buffer goes back to the process's cache once its upload is
    answered and serves a later part of the same size (no fresh pages per
    part); two objects written at once from reused buffers still land
    byte for byte. The cache keeps at most its limit, dropping the sizes
    not asked for any more first."""
    from dcpstore._impl.storage.buffered import PARTS, PartCache

    st = open_storage(budget_uri(s3_endpoint), storage_options=StorageOptions(part_size=PART, max_concurrency=2))
    PARTS.clear()
    payloads = {name: os.urandom(4 * PART + 123) for name in ("a", "b", "c")}
    taken: list[int] = []
    take = PARTS.take

    def spy(size: int) -> bytearray:
        buf = take(size)
        taken.append(id(buf))
        return buf

    try:
        PARTS.take = spy  # type: ignore[method-assign]
        with st.open_write("a") as w:
            w.write(payloads["a"])
        assert PARTS.cached_bytes() >= PART  # handed back once answered
        errors: list[BaseException] = []

        def write(name: str) -> None:
            try:
                with st.open_write(name) as w:
                    for i in range(0, len(payloads[name]), MiB):
                        w.write(payloads[name][i : i + MiB])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=write, args=(n,)) for n in ("b", "c")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(set(taken)) < len(taken)  # some buffer served more than one part
        for name, payload in payloads.items():
            assert st.read(name) == payload, name
    finally:
        PARTS.take = take  # type: ignore[method-assign]
        PARTS.clear()
        st.close()

    cache = PartCache(limit=3 * MiB)
    old, new = bytearray(MiB), bytearray(2 * MiB)
    cache.give(old)
    cache.give(bytearray(MiB))
    cache.give(new)  # full: the 1 MiB size (older) goes first
    assert cache.cached_bytes() == 2 * MiB and cache.take(2 * MiB) is new
    assert len(cache.take(MiB)) == MiB  # none left of that size: a fresh one
    cache.give(bytearray(4 * MiB))  # larger than the limit: not kept
    assert cache.cached_bytes() == 0
