"""The backend contract as tests: subclass :class:`StorageContract` to run
them against a storage of your own.

Every backend, built-in or your own (:func:`dcpstore.storage.register_backend`),
keeps the contract :class:`~dcpstore.storage.Storage` states; this is the
suite that checks it, the one dcpstore runs against each of its own
backends (as fsspec ships its ``tests/abstract`` for filesystems). In a test
module of yours::

    import pytest
    from dcpstore.storage import open_storage, register_backend
    from dcpstore.storage.testing import StorageContract

    register_backend("myfs", MyStorage)

    class TestMyStorage(StorageContract):
        @pytest.fixture
        def storage(self, tmp_path):
            storage = open_storage(f"myfs://test-bucket/{tmp_path.name}")
            storage.makedirs()
            yield storage
            storage.close()

and pytest runs every ``test_*`` method below against it. The fixture gives
a fresh, empty root for each test (two tests never share one) and closes it
afterwards; it may be parametrised to run the suite over several
configurations. Some tests write objects of up to 17 MiB and run for a few
seconds (a reader beside a stream of replaces).

Needs pytest, which dcpstore itself does not: import this module from tests
only.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dcpstore._impl.storage.base import Storage
from dcpstore._impl.storage.storage_options import MiB
from dcpstore._impl.util.errors import CheckpointError, ObjectTooLarge, StorageNotFound

__all__ = ["StorageContract"]


class StorageContract:
    """The contract's tests, as methods of a class to subclass (its name
    does not start with ``Test``, so pytest collects only your subclass).

    Override the :meth:`storage` fixture to give the storage under test.
    """

    @pytest.fixture
    def storage(self) -> Iterator[Storage]:
        """A fresh storage whose root exists and holds nothing (``makedirs``
        done), closed when the test ends. Override it."""
        raise NotImplementedError(
            f"{type(self).__name__}: override the 'storage' fixture to give the storage under test"
        )

    def test_put_read_roundtrip(self, storage: Storage) -> None:
        storage.put("a.bin", b"hello world")
        assert storage.read("a.bin") == b"hello world"
        assert storage.size("a.bin") == 11
        assert storage.exists("a.bin")
        assert not storage.exists("b.bin")

    def test_read_range(self, storage: Storage) -> None:
        payload = os.urandom(10_000)
        storage.put("r.bin", payload)
        assert storage.read_range("r.bin", 0, 10) == payload[:10]
        assert storage.read_range("r.bin", 1234, 4000) == payload[1234:5234]
        assert storage.read_range("r.bin", 9990, 100) == payload[9990:]  # short at the end

    def test_empty_object(self, storage: Storage) -> None:
        storage.put("empty", b"")
        assert storage.size("empty") == 0
        assert storage.read("empty") == b""

    @pytest.mark.parametrize("size", [0, 1, 100, 17 * MiB + 3])
    def test_read_with_a_limit_refuses_what_is_larger(self, storage: Storage, size: int) -> None:
        """``read(limit=)`` reads an object of up to ``limit`` bytes whole, and
        refuses a larger one (naming its size) instead of reading it; a missing
        object is still "not found"."""
        payload = os.urandom(size)
        storage.put("capped.bin", payload)
        assert storage.read("capped.bin", limit=size) == payload
        assert storage.read("capped.bin", limit=size + 1) == payload
        if size:
            with pytest.raises(ObjectTooLarge, match=rf"capped\.bin.*{size} bytes") as info:
                storage.read("capped.bin", limit=size - 1)
            assert (info.value.size, info.value.limit) == (size, size - 1)
        with pytest.raises(StorageNotFound):
            storage.read("absent.bin", limit=10)

    def test_streamed_write_larger_than_a_part(self, storage: Storage) -> None:
        chunk = os.urandom(MiB)
        with storage.open_write("big.bin", size_hint=13 * MiB) as w:
            for i in range(13):
                w.write(bytes([i]) + chunk[1:])
            assert w.tell() == 13 * MiB
        assert storage.size("big.bin") == 13 * MiB
        assert storage.read_range("big.bin", 7 * MiB, 2)[:1] == bytes([7])
        whole = storage.read("big.bin")
        assert len(whole) == 13 * MiB and whole[12 * MiB] == 12

    def test_lent_writes_land_in_order_wherever_they_lie(self, storage: Storage) -> None:
        """``write_lent`` of buffers that lie at the object's offset modulo a
        page in memory or not, whole pages or not, among plain writes: the
        object is every byte in order (whatever a writer sends past a cache,
        ``ObjectWriter.direct_align``)."""
        page = 4096
        memory = mmap.mmap(-1, 4 * MiB)  # page-aligned
        memory.write(os.urandom(4 * MiB))
        view = memoryview(memory)
        expected = bytearray()
        with storage.open_write("lent.bin") as w:

            def lent(start: int, length: int) -> None:
                w.write_lent(view[start : start + length], memory)
                expected.extend(view[start : start + length])

            def plain(data: bytes) -> None:
                w.write(data)
                expected.extend(data)

            plain(b"h" * 100)
            lent(100, 2 * MiB + 50)  # at its file offset within a page: a head, whole pages, a tail
            lent(7, MiB)  # not
            lent(len(expected) % page + page, 3 * page)  # whole pages after a head
            plain(b"t" * (-len(expected) % page))
            lent(0, page - 1)  # page-aligned, shorter than a page
            lent(page, MiB)  # misaligned by one byte against the object
            lent(len(expected) % page, 5)
            plain(b"u" * (-len(expected) % page))
            lent(2 * page, 4 * page)  # whole pages only
            assert w.tell() == len(expected)
        assert storage.read("lent.bin") == expected
        view.release()
        memory.close()

    @pytest.mark.parametrize("hint", [100, 6 * MiB, 13 * MiB + 5])
    def test_a_size_hint_is_only_a_hint(self, storage: Storage, hint: int) -> None:
        """An object lands whole whatever its size hint said: longer than a
        small hint (its writes straddling the hint and the part boundaries), or
        exactly as hinted."""
        payload = os.urandom(13 * MiB + 5)
        with storage.open_write("hinted.bin", size_hint=hint) as w:
            for i in range(0, len(payload), 3 * MiB + 1):
                w.write(payload[i : i + 3 * MiB + 1])
        assert storage.read("hinted.bin") == payload

    def test_abort_leaves_nothing(self, storage: Storage) -> None:
        with pytest.raises(RuntimeError):
            with storage.open_write("partial.bin") as w:
                w.write(b"x" * 1000)
                raise RuntimeError("boom")
        assert not storage.exists("partial.bin")
        assert [o["path"] for o in storage.list()] == []

    def test_a_put_that_need_not_be_durable_is_still_whole_and_replaces(self, storage: Storage) -> None:
        """``durable=False`` may skip the fsyncs (markers written where a caller
        waits), never the atomic replace: a reader running beside a stream of
        such puts sees the old bytes or the new, whole, every time -- never a
        short object, a mixture or nothing (a truncate-and-rewrite would show
        one). Each read is one request for more than either version holds
        (below the 5 MiB part size of dcpstore's own object-store tests), so
        what it returns is what the object held at one moment."""
        versions = (b"o" * (MiB + 3), b"n" * (2 * MiB + 7))  # other bytes, other sizes
        _read_beside_puts(storage, versions, lambda n: storage.read_range("m/marker", 0, 4 * MiB), durable=False)

    def test_a_whole_read_beside_a_stream_of_replaces_returns_one_version_whole(self, storage: Storage) -> None:
        """``read`` returns exactly one version of an object, whole, however
        often it is replaced meanwhile (a load reading ``.metadata`` while an
        overwrite commits its own): never the first bytes of the new version cut
        at the old one's size, never a mixture. The larger version spans two
        parts of 5 MiB (the part size of dcpstore's own object-store tests), so
        a read of it takes more than one request there; every other read has a
        ``limit`` (a limit must not change which version is read)."""
        versions = (b"o" * (MiB + 3), b"n" * (6 * MiB + 7))  # other bytes, other sizes
        limits = (None, 8 * MiB)
        _read_beside_puts(storage, versions, lambda n: storage.read("m/marker", limit=limits[n % 2]), durable=True)

    def test_overwrite_replaces_whole_object(self, storage: Storage) -> None:
        storage.put("o.bin", b"first version, longer")
        storage.put("o.bin", b"second")
        assert storage.read("o.bin") == b"second"

    def test_list_is_recursive_and_relative(self, storage: Storage) -> None:
        storage.put("x/1.bin", b"1")
        storage.put("x/y/2.bin", b"22")
        storage.put("3.bin", b"333")
        listed = {o["path"]: o["size"] for o in storage.list()}
        assert listed == {"x/1.bin": 1, "x/y/2.bin": 2, "3.bin": 3}
        assert {o["path"] for o in storage.list("x")} == {"x/1.bin", "x/y/2.bin"}

    def test_list_prefix_is_a_directory_not_a_string_prefix(self, storage: Storage) -> None:
        storage.put("x/1.bin", b"1")
        storage.put("xy.bin", b"2")
        assert [o["path"] for o in storage.list("x")] == ["x/1.bin"]

    def test_delete_ignores_missing(self, storage: Storage) -> None:
        storage.put("d.bin", b"d")
        storage.delete(["d.bin", "never-existed.bin"])
        assert not storage.exists("d.bin")

    def test_missing_object_raises_not_found(self, storage: Storage) -> None:
        with pytest.raises(StorageNotFound) as info:
            storage.read("nope.bin")
        assert "nope.bin" in str(info.value)
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(StorageNotFound):
            storage.size("nope.bin")

    def test_concurrent_writers(self, storage: Storage) -> None:
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                storage.put(f"t/{i}.bin", bytes([i]) * (100_000 + i))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i in range(8):
            assert storage.read(f"t/{i}.bin") == bytes([i]) * (100_000 + i)

    def test_read_into_scatters_in_order(self, storage: Storage) -> None:
        payload = os.urandom(3 * MiB + 123)
        storage.put("into.bin", payload)
        whole = bytearray(len(payload))
        assert storage.read_into("into.bin", 0, [memoryview(whole)]) == len(payload)
        assert whole == payload
        # Several buffers, split across part boundaries, from an offset.
        a, b, c = bytearray(MiB + 5), bytearray(7), bytearray(2 * MiB - 1000)
        assert storage.read_into("into.bin", 777, [memoryview(a), memoryview(b), memoryview(c)]) == len(a) + len(
            b
        ) + len(c)
        assert a + b + c == payload[777 : 777 + len(a) + len(b) + len(c)]
        tail, rest = bytearray(6), bytearray(1000)  # short at the end: the count says how much arrived
        assert storage.read_into("into.bin", len(payload) - 10, [memoryview(tail), memoryview(rest)]) == 10
        assert tail + rest[:4] == payload[-10:]
        with pytest.raises(StorageNotFound):
            storage.read_into("nope.bin", 0, [memoryview(bytearray(4))])

    def test_read_into_each_reports_every_byte_to_its_buffer(self, storage: Storage) -> None:
        payload = os.urandom(3 * MiB + 123)
        storage.put("each.bin", payload)
        bufs = [bytearray(MiB + 5), bytearray(0), bytearray(7), bytearray(2 * MiB - 1000)]
        seen: list[tuple[int, bytes]] = []

        def each(k: int, view: memoryview) -> None:
            seen.append((k, bytes(view)))

        views = [memoryview(b) for b in bufs]
        assert storage.read_into_each("each.bin", 777, views, each) == sum(map(len, bufs))
        assert b"".join(bufs) == payload[777 : 777 + sum(map(len, bufs))]
        # In order, each buffer's views its own bytes as they are now (empty buffers need none).
        assert [k for k, _ in seen] == sorted(k for k, _ in seen)
        for k, buf in enumerate(bufs):
            assert b"".join(v for i, v in seen if i == k) == buf
        seen.clear()
        tail, rest = bytearray(6), bytearray(1000)  # short at the end: only what arrived is reported
        assert storage.read_into_each("each.bin", len(payload) - 10, [memoryview(tail), memoryview(rest)], each) == 10
        assert b"".join(v for _, v in seen) == payload[-10:]
        with pytest.raises(StorageNotFound):
            storage.read_into_each("nope.bin", 0, [memoryview(bytearray(4))], each)

    def test_scatter_reads_land_wherever_the_buffers_lie(self, storage: Storage) -> None:
        """``read_into`` and ``read_into_each`` into buffers that lie at the
        object's offset modulo a page in memory or not, whole pages or not,
        the last running past the object's end: every byte in order, the
        count of those that arrived, and each reported to its own buffer
        (whatever a reader takes past a cache, ``direct_io``)."""
        page = 4096
        size = 6 * MiB + 1234
        payload = os.urandom(size)
        storage.put("scatter.bin", payload)
        memory = mmap.mmap(-1, 16 * MiB)  # page-aligned
        view = memoryview(memory)
        offset = 100

        def layout() -> list[memoryview]:
            """(start in memory, length) of each buffer, read from ``offset``."""
            spans: list[tuple[int, int]] = []
            pos, mem = offset, 0

            def add(start: int, length: int) -> None:
                nonlocal pos, mem
                spans.append((start, length))
                pos += length
                mem = start + length

            add(pos % page, 2 * MiB + 50)  # at its object offset within a page: a head, whole pages, a tail
            add(mem + 8, 7)  # small, between
            add(mem + page + 3, MiB + 1)  # large, misaligned against the object
            add(-(-mem // page) * page + pos % page, 4 * page)  # aligned, too small to be taken whole
            add(-(-mem // page) * page + pos % page + page, 3 * MiB)  # aligned, past the end of the object
            return [view[a : a + n] for a, n in spans]

        def read(each_read: bool) -> None:
            memory.seek(0)
            memory.write(b"\xee" * len(memory))
            buffers = layout()
            seen: list[tuple[int, bytes]] = []

            def each(k: int, piece: memoryview) -> None:
                seen.append((k, bytes(piece)))

            if each_read:
                got = storage.read_into_each("scatter.bin", offset, buffers, each)
            else:
                got = storage.read_into("scatter.bin", offset, buffers)
            assert got == size - offset
            assert b"".join(bytes(b) for b in buffers)[:got] == payload[offset:]
            if each_read:
                assert [k for k, _ in seen] == sorted(k for k, _ in seen)
                left = got
                for k, buf in enumerate(buffers):
                    arrived = min(left, buf.nbytes)
                    assert b"".join(v for i, v in seen if i == k) == bytes(buf[:arrived]), k
                    left -= arrived
                    buf.release()
            for buf in buffers:
                buf.release()

        read(each_read=False)
        read(each_read=True)
        view.release()
        memory.close()


def _read_beside_puts(
    storage: Storage, versions: tuple[bytes, ...], read: Callable[[int], bytes], *, durable: bool
) -> None:
    """Put ``versions`` in turn over ``m/marker`` (40 times, and on until 20
    reads ran beside them) while another thread reads it with ``read``
    (given the read's number), and assert that every read returned one of
    them, whole: never a short object, a mixture or nothing."""
    storage.put("m/marker", versions[0])
    stop, streaming = threading.Event(), threading.Event()
    wrong: list[str] = []
    beside = [0]  # reads made while the stream of puts ran (memory:// puts are too quick to straddle)

    def read_meanwhile() -> None:
        n = 0
        while not stop.is_set():
            during = streaming.is_set()
            n += 1
            try:
                data = read(n)
            except CheckpointError as e:
                wrong.append(f"{type(e).__name__}: {e}")
                continue
            if data not in versions:
                wrong.append(f"{len(data)} bytes, starting {data[:1]!r}, ending {data[-1:]!r}")
            beside[0] += during and streaming.is_set()

    reader = threading.Thread(target=read_meanwhile)
    reader.start()
    try:
        streaming.set()
        deadline = time.monotonic() + 30
        i = 0
        while i < 40 or (beside[0] < 20 and time.monotonic() < deadline):
            i += 1
            storage.put("m/marker", versions[i % 2], durable=durable)
            time.sleep(0)  # a put to memory:// holds the GIL throughout: let the reader in between
        streaming.clear()
    finally:
        stop.set()
        reader.join()
    assert not wrong, wrong[:5]
    assert beside[0] >= 3, beside  # the reader really ran beside the puts
    assert storage.read("m/marker") in versions
    assert [o["path"] for o in storage.list("m/")] == ["m/marker"]  # no temporary file left beside it
