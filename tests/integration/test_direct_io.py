"""Direct I/O on a local disk (``StorageOptions(direct_io=True)``): a save
writes the whole pages of its large tensors from their memory to the disk,
past the page cache, and the rest as a buffered save does; a load reads
the whole pages of each large tensor that its destination holds at the
same place in a page straight from the disk into it. Seen here from
outside: which pages of the data files the page cache holds after the save
or the load (``mincore``), and every reader reading the checkpoint. A
filesystem that refuses direct I/O gets every byte buffered; a failed
direct write fails the save cleanly (tests/integration/test_local_faults.py);
a kill anywhere in a direct save leaves the previous checkpoint
(tests/processes/test_crash.py); damage under a direct read is found."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata
from dcpstore._impl.format.layout import DIRECT_ALIGN
from dcpstore._impl.format.record import DIRECT_MIN, is_raw
from dcpstore._impl.manager import step_dir
from dcpstore._impl.storage.backends import local
from dcpstore._impl.storage.byte_ranges import buffer_address
from dcpstore._impl.tools.maintenance import verify_checkpoint
from dcpstore.storage import open_storage
from tests.support.helpers import assert_state_equal, zeros_like_state

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def _cached_pages(path: str) -> set[int]:
    """The pages of the file at ``path`` that the page cache holds now."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    pages = -(-size // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    buf = (ctypes.c_char * size).from_buffer(mapped)
    try:
        if _libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        del buf
        mapped.close()
    return {i for i in range(pages) if vec[i] & 1}


def _state() -> dict:
    """Large tensors of odd sizes and dtypes (two not stored as they lie: a
    transposed one, cloned by the save, and a conjugate view, whose stored
    bytes are the un-conjugated ones), small ones and a plain value."""
    g = torch.Generator().manual_seed(3)
    return {
        "w1": torch.randn(300_001, generator=g),
        "w2": torch.randn(1000, 1501, generator=g).bfloat16(),
        "t": torch.randn(700, 800, generator=g).t(),
        "small": torch.randn(17, generator=g),
        "w3": torch.randint(-9, 9, (3 << 20,), generator=g, dtype=torch.int8),
        "c": torch.randn(200_003, generator=g, dtype=torch.complex64).conj(),
        "step": 5,
    }


def _direct_pages(root: str, state: dict) -> dict[str, set[int]]:
    """Per data file, the pages that lie wholly inside a large raw tensor's
    bytes: what a direct save sends past the page cache."""
    md, manifest = read_checkpoint_metadata(open_storage(root))
    assert manifest is not None
    pages: dict[str, set[int]] = {}
    for index, info in md.storage_data.items():
        value = state[index.fqn]
        if not (isinstance(value, torch.Tensor) and is_raw(value) and value.nbytes >= DIRECT_MIN):
            continue
        inside, nbytes = manifest["tensors"][f"{info.relative_path}@{info.offset}"]
        start = info.offset + inside
        first, end = -(-start // PAGE), (start + nbytes) // PAGE
        pages.setdefault(info.relative_path, set()).update(range(first, end))
    return pages


def _assert_cached(root: str, pages_of: dict[str, set[int]], cached: bool) -> None:
    """Every one of these pages of each data file is in the page cache
    (``cached``), or none is."""
    for name, pages in pages_of.items():
        held = _cached_pages(os.path.join(root, name))
        if cached:
            assert pages <= held, f"{name}: {len(pages - held)} of the pages are not cached"
        else:
            assert not held & pages, f"{name}: {len(held & pages)} of the pages are cached"


def _skip_unless_the_page_cache_is_separate(path: str) -> None:
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    real = os.path.realpath(path)
    where, kind = max(((m, k) for m, k in mounts if real == m or real.startswith(m.rstrip("/") + "/")), key=len)
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{where} is {kind}: its files are the page cache")


def _readers_agree(root: str, state: dict) -> None:
    """dcpstore's load, stock dcp.load and verify all read the checkpoint."""
    ours = zeros_like_state(state)
    dcpstore.load(ours, root)
    assert_state_equal(ours, state)
    stock = zeros_like_state(state)
    dcp.load(stock, storage_reader=FileSystemReader(root), no_dist=True)
    assert_state_equal(stock, state)
    report = verify_checkpoint(open_storage(root))
    assert report.ok, report.problems + report.refused


def _refuse_direct_io(monkeypatch: pytest.MonkeyPatch, where: str) -> list[str]:
    """Make this filesystem refuse ``O_DIRECT`` with ``EINVAL``: at every
    open that asks for it (``"open"``), or at every ``"write"`` or
    ``"read"`` through a descriptor that has it. Returns the list that
    each refusal is added to."""
    refused: list[str] = []

    def refuse() -> None:
        refused.append(where)
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    real_open = os.open

    def open_(path, flags: int, *args, **kwargs) -> int:
        if where == "open" and flags & os.O_DIRECT:
            refuse()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    if where != "open":
        name = {"write": "pwrite", "read": "preadv"}[where]
        real = getattr(os, name)

        def io(fd: int, *args):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                refuse()
            return real(fd, *args)

        monkeypatch.setattr(os, name, io)
    return refused


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_direct_save_leaves_the_pages_of_its_large_tensors_out_of_the_page_cache(tmp_path, direct: bool) -> None:
    """Buffered, every page of a freshly saved data file is in the page
    cache; direct, none of those wholly inside a large tensor's bytes is,
    and each such tensor lies at its memory's offset in a page."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=direct)).result()
    direct_pages = _direct_pages(root, state)
    assert sum(map(len, direct_pages.values())) >= (6 << 20) // PAGE, direct_pages.keys()
    _assert_cached(root, direct_pages, not direct)
    if direct:
        md, manifest = read_checkpoint_metadata(open_storage(root))
        assert manifest is not None
        for index, info in md.storage_data.items():
            value = state[index.fqn]
            if isinstance(value, torch.Tensor) and is_raw(value) and value.nbytes >= DIRECT_MIN:
                inside, _ = manifest["tensors"][f"{info.relative_path}@{info.offset}"]
                assert (info.offset + inside - value.data_ptr()) % DIRECT_ALIGN == 0, index.fqn
    _readers_agree(root, state)


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_filesystem_that_refuses_direct_io_gets_every_byte_buffered(tmp_path, monkeypatch, refused_at: str) -> None:
    """A filesystem may refuse ``O_DIRECT`` when the file is opened, or
    open it and refuse its writes (EINVAL): the writer tries once per data
    file, then writes every byte buffered."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    refused = _refuse_direct_io(monkeypatch, refused_at)
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True)).result()
    monkeypatch.undo()
    direct_pages = _direct_pages(root, state)
    assert len(refused) == len(direct_pages) == 2, refused
    for name, pages in direct_pages.items():
        assert pages <= _cached_pages(os.path.join(root, name)), name
    _readers_agree(root, state)


def test_a_tensor_larger_than_one_direct_write_lands_whole(tmp_path, monkeypatch) -> None:
    """A tensor's pages go out in direct writes of at most ``_DIRECT_CHUNK``
    bytes (64 MiB: an item over 512 MiB takes several); made three pages
    here, so that every large tensor of the state takes hundreds, each at
    its own offset."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    monkeypatch.setattr(local, "_DIRECT_CHUNK", 3 * DIRECT_ALIGN)
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True)).result()
    for name, pages in _direct_pages(root, state).items():
        assert not _cached_pages(os.path.join(root, name)) & pages, name
    _readers_agree(root, state)


def _at_place_in_page(like: torch.Tensor, file_offset: int) -> torch.Tensor:
    """A zeroed tensor like ``like`` whose bytes start at ``file_offset``'s
    place in a page (a view into a larger allocation)."""
    room = torch.zeros(like.nbytes + 2 * DIRECT_ALIGN, dtype=torch.uint8)
    skip = (file_offset - room.data_ptr()) % DIRECT_ALIGN
    return room[skip : skip + like.nbytes].view(like.dtype).view(like.shape)


def _evict(root: str) -> None:
    """Drop the data files' pages from the page cache (they are clean: the
    save fsynced them), so that what a load reads shows in it."""
    for name in os.listdir(root):
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_direct(root: str, state: dict, dest: dict) -> dict[str, set[int]]:
    """Per data file, the pages wholly inside a large raw tensor's bytes
    whose destination in ``dest`` takes them as they lie: what a direct
    load reads past the page cache (straight into the destination where it
    lies at the same place in a page, else through a bounce buffer)."""
    md, manifest = read_checkpoint_metadata(open_storage(root))
    assert manifest is not None
    pages: dict[str, set[int]] = {}
    for index, info in md.storage_data.items():
        value, target = state[index.fqn], dest[index.fqn]
        if not (isinstance(value, torch.Tensor) and is_raw(value) and value.nbytes >= DIRECT_MIN):
            continue
        if target.is_contiguous() and not target.is_conj():  # the reader reads into it as it lies
            inside, nbytes = manifest["tensors"][f"{info.relative_path}@{info.offset}"]
            start = info.offset + inside
            pages.setdefault(info.relative_path, set()).update(range(-(-start // PAGE), (start + nbytes) // PAGE))
    return pages


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_direct_load_reads_the_pages_of_its_large_tensors_past_the_page_cache(tmp_path, direct: bool) -> None:
    """A direct save's checkpoint, out of the page cache, loaded: buffered,
    the load brings every page of its large tensors into the page cache;
    direct, none, whether the destination lies at the same place in a page
    as the tensor's bytes in the file (read straight into it) or not
    (through a bounce buffer: one destination here is made to be off by
    64 bytes), and the values are the same."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    root = str(tmp_path / "ck")
    state = _state()
    options = dcpstore.StorageOptions(direct_io=True)
    dcpstore.save(state, root, workers=2, storage_options=options).result()
    _evict(root)
    dest = zeros_like_state(state)
    md, manifest = read_checkpoint_metadata(open_storage(root))
    (w3,) = [info for index, info in md.storage_data.items() if index.fqn == "w3"]
    w3_at = w3.offset + manifest["tensors"][f"{w3.relative_path}@{w3.offset}"][0]
    dest["w3"] = _at_place_in_page(dest["w3"], w3_at)
    dest["w1"] = _at_place_in_page(dest["w1"], w3_at + 64)
    read_direct = _read_direct(root, state, dest)
    assert sum(map(len, read_direct.values())) >= (6 << 20) // PAGE, read_direct
    dcpstore.load(dest, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=direct))
    assert_state_equal(dest, state)
    _assert_cached(root, read_direct, not direct)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_tiered_managers_local_tier_saves_and_loads_with_its_own_storage_options(tmp_path, direct: bool) -> None:
    """``local_storage_options`` reach the local tier: with ``direct_io``, a
    step saved there (in the background, the manager's default, and not
    replicated: ``replicate_every=2``) has its large tensors' pages out of
    the page cache, and a load of it from the local tier reads them past
    the page cache too; buffered, both bring them in. A step replicated
    from a direct local tier has its local files read whole by the
    replication and left out of the page cache, and loads in every reader
    from the durable root, which keeps its own (here default) options."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    state = _state()
    local_dir, root = tmp_path / "local", tmp_path / "durable"
    options = dcpstore.StorageOptions(direct_io=direct)
    # The manager's default: async saves, whose staging buffers go to the disk.
    with dcpstore.CheckpointManager(
        str(root), local_dir=str(local_dir), replicate_every=2, local_storage_options=options
    ) as mgr:
        mgr.save(state, 1)
        mgr.save(state, 2)
        mgr.wait()
        local_step = str(local_dir / step_dir(1))
        assert not (root / step_dir(1)).exists() and (root / step_dir(2)).exists()
        direct_pages = _direct_pages(local_step, state)
        assert sum(map(len, direct_pages.values())) >= (6 << 20) // PAGE, direct_pages.keys()
        _assert_cached(local_step, direct_pages, not direct)
        _evict(local_step)
        dest = zeros_like_state(state)
        read_direct = _read_direct(local_step, state, dest)
        assert mgr.load(dest, 1) == 1
        assert_state_equal(dest, state)
        _assert_cached(local_step, read_direct, not direct)
        replicated = str(local_dir / step_dir(2))
        _assert_cached(replicated, _direct_pages(replicated, state), not direct)
    _readers_agree(str(root / step_dir(2)), state)


def test_local_storage_options_are_checked_as_the_caller_spelt_them(tmp_path) -> None:
    durable, local_dir = str(tmp_path / "durable"), str(tmp_path / "local")
    options = dcpstore.StorageOptions(direct_io=True)
    with pytest.raises(dcpstore.InvalidArgument, match="local_storage_options.*need local_dir"):
        dcpstore.CheckpointManager(durable, local_storage_options=options)
    with pytest.raises(dcpstore.InvalidArgument, match="local_storage_options must be a dcpstore.StorageOptions"):
        dcpstore.CheckpointManager(durable, local_dir=local_dir, local_storage_options={"direct_io": True})
    with pytest.raises(dcpstore.InvalidArgument, match="local_storage_options has enable_msc=True"):
        dcpstore.CheckpointManager(
            durable, local_dir=local_dir, local_storage_options=dcpstore.StorageOptions(enable_msc=True)
        )


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_small_read_of_a_direct_storage_brings_only_its_own_pages(tmp_path, direct: bool) -> None:
    """The kernel's readahead would pull the pages after a small read (an
    item read whole, a record's header) into the page cache, and those may
    lie inside a large tensor that a direct load reads past it: with
    ``direct_io`` every read of the storage goes without readahead."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    storage = open_storage(str(tmp_path), storage_options=dcpstore.StorageOptions(direct_io=direct))
    storage.put("data", os.urandom(64 * PAGE))
    _evict(str(tmp_path))
    assert len(storage.read_range("data", 0, 100)) == 100  # at the start, where the kernel reads ahead
    held = _cached_pages(str(tmp_path / "data"))
    if direct:
        assert held == {0}
    else:
        assert {0, 1, 2, 3} <= held  # this filesystem reads ahead, so the case above shows something


def test_a_direct_load_of_a_buffered_save_reads_what_lies_elsewhere_in_a_page_buffered(tmp_path) -> None:
    """A buffered save does not place tensors at their memory's place in a
    page: a direct load reads those through the page cache, and every value
    is right (a tensor that happens to line up is read direct)."""
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2).result()
    dest = zeros_like_state(state)
    dcpstore.load(dest, root, storage_options=dcpstore.StorageOptions(direct_io=True))
    assert_state_equal(dest, state)


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_a_filesystem_that_refuses_direct_reads_gets_the_load_buffered(tmp_path, monkeypatch, refused_at: str) -> None:
    """A filesystem may refuse ``O_DIRECT`` at the open or at a read
    (EINVAL): the load reads the rest of that file buffered."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True)).result()
    _evict(root)
    dest = zeros_like_state(state)
    read_direct = _read_direct(root, state, dest)
    refused = _refuse_direct_io(monkeypatch, refused_at)
    dcpstore.load(dest, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True))
    monkeypatch.undo()
    assert refused
    assert_state_equal(dest, state)
    for name, pages in read_direct.items():
        assert pages <= _cached_pages(os.path.join(root, name)), name


def test_a_direct_load_in_many_reads_lands_every_byte(tmp_path, monkeypatch) -> None:
    """Direct reads of three pages each (8 MiB by default), each started
    before the last one's bytes are checked, into a destination at the
    file's place in a page and, through the two bounce buffers in turn,
    one that is not: every value lands."""
    monkeypatch.setattr(local, "_DIRECT_READ_CHUNK", 3 * DIRECT_ALIGN)
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True)).result()
    md, manifest = read_checkpoint_metadata(open_storage(root))
    at = {
        index.fqn: info.offset + manifest["tensors"][f"{info.relative_path}@{info.offset}"][0]
        for index, info in md.storage_data.items()
        if index.fqn in ("w1", "w3")
    }
    dest = zeros_like_state(state)
    dest["w3"] = _at_place_in_page(dest["w3"], at["w3"])
    dest["w1"] = _at_place_in_page(dest["w1"], at["w1"] + 8)
    dcpstore.load(dest, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True))
    assert_state_equal(dest, state)


def test_the_next_read_is_under_way_while_each_piece_is_checked(tmp_path, monkeypatch) -> None:
    """With ``direct_io``, every piece ``read_into_each`` hands over (a
    header, a tensor's direct pages, a bounced piece, a tail with the next
    header) waits here until a read of bytes past it has started:
    reads run ahead of the checks, across one tensor and the next, so the
    disk is not idle while the core checksums. A reader that reads only
    once the last piece is checked never gets there."""
    _skip_unless_the_page_cache_is_separate(str(tmp_path))
    storage = open_storage(str(tmp_path), storage_options=dcpstore.StorageOptions(direct_io=True))
    payload = os.urandom(12 << 20)
    storage.put("data", payload)
    memory = mmap.mmap(-1, 16 << 20)  # page-aligned
    start = 100
    spans = [
        (start, 300),
        (400, 3 << 20),
        ((4 << 20) + 8, 3 << 20),
        ((8 << 20) + 2000, 200),
    ]  # the second large one bounces
    buffers = [memoryview(memory)[a : a + n] for a, n in spans]
    at = [start]  # each buffer's offset in the file
    for buf in buffers[:-1]:
        at.append(at[-1] + buf.nbytes)
    end = at[-1] + buffers[-1].nbytes
    reach = [0]  # the end of the furthest read started
    moved = threading.Condition()
    real = os.preadv

    def preadv(fd: int, views, offset: int) -> int:
        with moved:
            reach[0] = max(reach[0], offset + sum(memoryview(v).nbytes for v in views))
            moved.notify_all()
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    checked: list[int] = []

    def each(k: int, view: memoryview) -> None:
        after = at[k] + buffer_address(view) - buffer_address(buffers[k]) + view.nbytes
        if after < end:
            with moved:
                assert moved.wait_for(lambda: reach[0] > after, timeout=30), (after, reach)
        checked.append(after)

    assert storage.read_into_each("data", start, buffers, each) == end - start
    monkeypatch.undo()
    assert b"".join(bytes(b) for b in buffers) == payload[start:end]
    assert checked == sorted(checked) and checked[-1] == end and len(checked) > 4, checked


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damage_under_a_direct_read_is_found(tmp_path, monkeypatch, damage: str) -> None:
    """A byte flipped, or the file cut, inside the pages a direct load reads
    (in reads of a few pages here, so the damage is in one of many, read
    while the one before is checked): the load fails naming the data file,
    as a buffered one does."""
    monkeypatch.setattr(local, "_DIRECT_READ_CHUNK", 3 * DIRECT_ALIGN)
    root = str(tmp_path / "ck")
    state = _state()
    dcpstore.save(state, root, workers=2, storage_options=dcpstore.StorageOptions(direct_io=True)).result()
    dest = zeros_like_state(state)
    name, pages = max(_read_direct(root, state, dest).items(), key=lambda item: len(item[1]))
    page = sorted(pages)[len(pages) // 2]
    path = os.path.join(root, name)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(page * PAGE + 100)
            byte = f.read(1)
            f.seek(page * PAGE + 100)
            f.write(bytes([byte[0] ^ 0x10]))
    else:
        os.truncate(path, page * PAGE + 100)
    with pytest.raises(dcpstore.CheckpointCorrupt, match="checksum|truncated") as info:
        dcpstore.load(dest, root, storage_options=dcpstore.StorageOptions(direct_io=True))
    assert name in str(info.value)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_direct_io_must_be_a_bool(value) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="direct_io must be a bool"):
        dcpstore.StorageOptions(direct_io=value)
