"""Hostile local storage: symbolic links out of a checkpoint, link loops,
names too long, unreadable directories, and every OSError the local backend
can meet.

The rules checked:

* a file a load or ``verify`` reads resolves inside the checkpoint directory
  (the directory itself may be reached through a link), else
  ``UnsafeCheckpoint`` naming it (``verify``: REFUSED, exit 1) -- on the
  local backend, MSC's POSIX profile and fsspec's local filesystem;
* listing and ``gc`` never follow a link: nothing outside the checkpoint is
  deleted, no linked directory is walked;
* a root that cannot be listed is a ``StorageError`` naming it and the cause
  (the CLI: one line, exit 2); an entry below it that cannot be read is
  skipped with a warning; a loop or an unreadable corner never surfaces as a
  raw ``OSError``.

Tests run as root, whom permissions do not stop: ``EACCES`` (and the other
errnos of the last suite) are injected at the OS boundary the local backend
calls, so its own mapping runs for real.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import posixpath
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata
from dcpstore._impl.manager import CheckpointManager
from dcpstore._impl.storage.backends.local import LocalStorage
from dcpstore._impl.util.errors import (
    CheckpointError,
    CheckpointNotFound,
    StorageError,
    StoragePermissionError,
    UnsafeCheckpoint,
)
from dcpstore.storage import open_storage
from tests.support.hostile_kit import METADATA, cli, fresh, state

#: How each local-filesystem backend is reached: (URI for a path, CLI flags, load kwargs).
BACKENDS: dict[str, tuple[Callable[[Path], str], list[str], dict[str, Any]]] = {
    "local": (str, [], {}),
    "local+msc": (str, ["--enable-msc"], {"enable_msc": True}),
    "fsspec-local": (lambda p: f"local://{p}", [], {}),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "local+msc":
        pytest.importorskip("multistorageclient")
    return str(request.param)


def _uri(backend: str, path: Path) -> str:
    return BACKENDS[backend][0](path)


def _cli(backend: str, command: str, path: Path, *more: str) -> tuple[int, str, str]:
    return cli(command, *BACKENDS[backend][1], *more, _uri(backend, path))


def _load(backend: str, path: Path) -> dict[str, Any]:
    out = fresh()
    dcpstore.load(out, _uri(backend, path), **BACKENDS[backend][2])
    return out


def _save(path: Path, writer: str = "dcpstore", spread: int = 1) -> Path:
    if writer == "stock":
        dcp.save(state(), storage_writer=FileSystemWriter(str(path)), no_dist=True)
    else:
        dcpstore.save(state(), str(path), spread_prefixes=spread).result()
    return path


def _data_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*.distcp"))


# ---------------------------------------------------------------------------
# Links out of a checkpoint are never read
# ---------------------------------------------------------------------------


def _link_data_file(ckpt: Path, outside: Path) -> str:
    """The first data file moved outside, a link to it in its place."""
    victim = _data_files(ckpt)[0]
    outside.mkdir()
    shutil.move(victim, outside / victim.name)
    victim.symlink_to(outside / victim.name)
    return victim.relative_to(ckpt).as_posix()


def _link_subdir(ckpt: Path, outside: Path) -> str:
    """A directory of data files (the spread layout's ``p*/``) moved outside, a link in its place."""
    first = _data_files(ckpt)[0]
    sub = first.parent
    assert sub != ckpt
    shutil.move(sub, outside)
    sub.symlink_to(outside, target_is_directory=True)
    return first.relative_to(ckpt).as_posix()


def _link_metadata(ckpt: Path, outside: Path) -> str:
    outside.mkdir()
    shutil.move(ckpt / METADATA, outside / METADATA)
    (ckpt / METADATA).symlink_to(outside / METADATA)
    return METADATA


#: name -> (writer, spread prefixes, make the link; returns the file it names)
LINKS_OUT: dict[str, tuple[str, int, Callable[[Path, Path], str]]] = {
    "data-file": ("dcpstore", 1, _link_data_file),
    "subdir": ("dcpstore", 2, _link_subdir),
    "metadata": ("dcpstore", 1, _link_metadata),
    "stock-data-file": ("stock", 1, _link_data_file),
}


@pytest.mark.parametrize("case", list(LINKS_OUT))
def test_a_file_linked_from_outside_is_never_read(tmp_path: Path, backend: str, case: str) -> None:
    """The bytes outside are the checkpoint's own (every checksum passes):
    still refused, naming the file, by load, verify and inspect."""
    writer, spread, link = LINKS_OUT[case]
    ckpt = _save(tmp_path / "ck", writer, spread)
    name = link(ckpt, tmp_path / "outside")
    with pytest.raises(UnsafeCheckpoint, match=rf"{name}.*outside the checkpoint directory"):
        _load(backend, ckpt)
    code, out, err = _cli(backend, "verify", ckpt, "-q")
    assert code == 1 and "REFUSED" in out and name in out and "outside the checkpoint" in out, out + err
    if case == "metadata":
        code, out, err = _cli(backend, "inspect", ckpt)
        assert code == 2 and name in err and err.count("\n") == 1, err


def test_links_inside_the_checkpoint_and_to_it_are_followed(tmp_path: Path, backend: str) -> None:
    """The checkpoint reached through a link, and a data file that links to a
    file of the same checkpoint, load exactly and verify."""
    real = _save(tmp_path / "real" / "ck")
    data = _data_files(real)[0]
    (real / "keep").mkdir()
    shutil.move(data, real / "keep" / data.name)
    data.symlink_to(Path("keep") / data.name)
    (tmp_path / "via").symlink_to(tmp_path / "real", target_is_directory=True)
    ckpt = tmp_path / "via" / "ck"
    got = _load(backend, ckpt)
    assert torch.equal(got["w"], state()["w"]) and torch.equal(got["b"], state()["b"]) and got["step"] == 5
    code, out, err = _cli(backend, "verify", ckpt, "-q")
    assert code == 0 and out.startswith("OK"), out + err


def test_gc_never_deletes_through_a_link(tmp_path: Path, backend: str) -> None:
    """An interrupted save's directory holding a linked directory and a
    linked file: gc removes the directory's own files, nothing outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_bytes(b"someone else's")
    (outside / "victim.distcp").write_bytes(b"precious")
    wreck = tmp_path / "root" / "wreck"
    wreck.mkdir(parents=True)
    (wreck / "__1_0.distcp").write_bytes(b"leftover")
    (wreck / "p0").symlink_to(outside, target_is_directory=True)
    (wreck / "__2_0.distcp").symlink_to(outside / "victim.distcp")
    (tmp_path / "root" / "loop").symlink_to("loop")
    code, out, err = _cli(backend, "gc", tmp_path / "root", "--older-than", "0")
    assert code == 0, out + err
    # Removed, or kept whole for the links the local backend lists (files no save writes).
    assert not (wreck / "__1_0.distcp").exists() or "kept wreck: holds files no DCP save writes" in out, out
    assert (outside / "__0_0.distcp").read_bytes() == b"someone else's"
    assert (outside / "victim.distcp").read_bytes() == b"precious"


def test_retention_never_deletes_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_bytes(b"someone else's")
    manager = CheckpointManager(str(tmp_path / "root"), keep=1, async_=False)
    manager.save(state(), 1).result()
    (Path(manager.step_uri(1)) / "p0").symlink_to(outside, target_is_directory=True)
    manager.save(state(), 2).result()
    assert manager.all_steps() == [2]
    assert (outside / "__0_0.distcp").read_bytes() == b"someone else's"


def test_the_local_backend_lists_and_deletes_links_as_links(tmp_path: Path) -> None:
    """A link is listed as itself (its own size: never followed), a linked
    directory is not walked, and a path reached through one is not deleted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"x" * 100)
    root = tmp_path / "root"
    root.mkdir()
    (root / "dir").symlink_to(outside, target_is_directory=True)
    (root / "file").symlink_to(outside / "f")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (root / "loop").symlink_to("loop")
    storage = open_storage(str(root))
    listed = {o["path"]: o["size"] for o in storage.list()}
    assert set(listed) == {"dir", "file", "dangling", "loop"} and listed["file"] < 100
    assert list(storage.list("dir/")) == []
    storage.delete(["dir/f", "file", "loop"])
    assert (outside / "f").read_bytes() == b"x" * 100
    assert not (root / "file").is_symlink() and not (root / "loop").is_symlink() and (root / "dir").is_symlink()
    storage.delete(["dir"])
    assert not (root / "dir").is_symlink() and (outside / "f").read_bytes() == b"x" * 100


# ---------------------------------------------------------------------------
# Loops, names too long, unreadable directories: clear errors, never OSError
# ---------------------------------------------------------------------------


@pytest.fixture
def root_with_loop(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    _save(root / "step_00000001")
    (root / "loop").symlink_to("loop")
    (root / "step_00000001" / "loop").symlink_to("loop")
    return root


def test_a_loop_in_a_root_is_listed_around(root_with_loop: Path, backend: str) -> None:
    root = root_with_loop
    if backend == "local":
        manager = CheckpointManager(str(root))
        assert manager.all_steps() == [1]
        loaded = fresh()
        manager.load(loaded)
        assert torch.equal(loaded["w"], state()["w"])
    for command in ("ls", "gc"):
        code, out, err = _cli(backend, command, root)
        assert code == 0 and "OSError" not in err, (command, out, err)
    code, out, err = _cli(backend, "verify", root / "step_00000001", "-q")
    assert code == 0, out + err


@pytest.mark.parametrize("why", ["loop", "too-long"])
def test_a_root_that_cannot_be_reached_is_a_storage_error(tmp_path: Path, why: str) -> None:
    """The root itself a link loop, or a name longer than the filesystem
    allows: every entry point names the path and the cause."""
    if why == "loop":
        (tmp_path / "loop").symlink_to("loop")
        root, cause = tmp_path / "loop", "ELOOP"
    else:
        root, cause = tmp_path / ("x" * 300), "ENAMETOOLONG"
    with pytest.raises(StorageError, match=rf"{root.name[:20]}.*\({cause}\)"):
        CheckpointManager(str(root)).all_steps()
    with pytest.raises(StorageError, match=rf"{root.name[:20]}.*\({cause}\)"):
        dcpstore.load(fresh(), str(root))
    for command in ("ls", "gc", "verify", "inspect"):
        code, out, err = cli(command, str(root))
        assert code == 2 and cause in err and root.name[:20] in err and err.count("\n") == 1, (command, err)
        assert "unexpected" not in err


@contextlib.contextmanager
def unreadable(*paths: Path) -> Iterator[None]:
    """``os.scandir`` of these directories fails with EACCES, as ``chmod
    000`` makes it for anyone but root."""
    real = os.scandir
    denied = {os.fspath(p) for p in paths}

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path) in denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path)

    os.scandir = scandir  # type: ignore[assignment]
    try:
        yield
    finally:
        os.scandir = real


def test_an_unreadable_directory_below_a_root_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    _save(root / "step_00000001")
    _save(root / "step_00000002")
    (root / "lost+found").mkdir()
    (root / "wreck").mkdir()
    (root / "wreck" / "__0_0.distcp").write_bytes(b"x")
    with unreadable(root / "lost+found", root / "step_00000002"), caplog.at_level(logging.WARNING, "dcpstore"):
        assert CheckpointManager(str(root)).all_steps() == [1]
        code, out, err = cli("ls", str(root))
        assert code == 0 and "step_00000001" in out and "step_00000002" not in out, out + err
        code, out, err = cli("gc", "--older-than", "0", str(root))
        assert code == 0 and "wreck" in out, out + err
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert any("lost+found" in m and "EACCES" in m for m in skipped), skipped
    assert any("step_00000002" in m for m in skipped), skipped
    assert (root / "step_00000002" / METADATA).exists()


def test_an_unreadable_root_is_a_permission_error(tmp_path: Path) -> None:
    root = _save(tmp_path / "root" / "step_00000001").parent
    with unreadable(root):
        with pytest.raises(StoragePermissionError, match=rf"{root}.*permission denied"):
            CheckpointManager(str(root)).all_steps()
        for command in ("ls", "gc"):
            code, out, err = cli(command, str(root))
            assert code == 2 and "permission denied" in err and str(root) in err, (command, err)


def test_loading_the_filesystem_root_says_no_checkpoint_is_there(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match=r"no checkpoint at /"):
        dcpstore.load(fresh(), "file:///")


def test_explaining_a_missing_checkpoint_reads_a_bounded_listing(tmp_path: Path) -> None:
    """Why nothing is there is told from the first objects listed, never a
    walk of everything below (a filesystem's root, a whole bucket)."""

    class Endless(LocalStorage):
        listed = 0

        def list(self, prefix: str = "") -> Iterator[Any]:
            for i in itertools.count():
                type(self).listed += 1
                if self.listed > 100_000:  # an unbounded reader would run on forever
                    raise AssertionError("listed past any bound")
                yield {"path": f"d{i}/f", "size": 0}

    storage = Endless(open_storage(str(tmp_path)).url)
    with pytest.raises(CheckpointNotFound, match="no .metadata found"):
        read_checkpoint_metadata(storage)
    assert 0 < Endless.listed <= 10_001


# ---------------------------------------------------------------------------
# The class: every OSError the local backend meets becomes ours
# ---------------------------------------------------------------------------

#: The OS calls the local backend makes, failed one at a time.
OS_CALLS = [
    "open",
    "write",
    "fsync",
    "replace",
    "unlink",
    "fstat",
    "pread",
    "preadv",
    "lstat",
    "stat",
    "scandir",
    "makedirs",
    "readlink",
]
ERRNOS = [
    errno.EACCES,
    errno.EPERM,
    errno.ELOOP,
    errno.ENAMETOOLONG,
    errno.EIO,
    errno.ENOSPC,
    errno.EROFS,
    errno.EMFILE,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOENT,
    errno.EDQUOT,
    errno.ESTALE,
    errno.EINVAL,
]
#: What the message says for an errno the mapping words itself.
WORDED = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "not a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def _ops(tmp_path: Path) -> dict[str, tuple[str, Callable[[LocalStorage], Any]]]:
    """name -> (the path it names, the operation)."""

    def write(s: LocalStorage) -> None:
        with s.open_write("sub/new.bin") as w:
            w.write(b"y" * 10)

    return {
        "read_range": ("ck/data.bin", lambda s: s.read_range("ck/data.bin", 0, 10)),
        "read_into": ("ck/data.bin", lambda s: s.read_into("ck/data.bin", 0, [memoryview(bytearray(10))])),
        "read_into_each": (
            "ck/data.bin",
            lambda s: s.read_into_each("ck/data.bin", 0, [memoryview(bytearray(10))], lambda k, v: None),
        ),
        "read": ("ck/data.bin", lambda s: s.read("ck/data.bin")),
        "size": ("ck/data.bin", lambda s: s.size("ck/data.bin")),
        "exists": ("ck/data.bin", lambda s: s.exists("ck/data.bin")),
        "list": ("", lambda s: list(s.list())),
        "list-prefix": ("ck", lambda s: list(s.list("ck/"))),
        "list_incomplete": ("", lambda s: list(s.list_incomplete())),
        "cleanup_incomplete": ("", lambda s: s.cleanup_incomplete(0)),
        "delete": ("ck/old.bin", lambda s: s.delete(["ck/old.bin"])),
        "put": ("ck/new.bin", lambda s: s.put("ck/new.bin", b"x" * 10)),
        "put-volatile": ("ck/new.bin", lambda s: s.put("ck/new.bin", b"x", durable=False)),
        "open_write": ("sub/new.bin", write),
        "makedirs": ("d/e", lambda s: s.makedirs("d/e")),
    }


OPS = list(_ops(Path()))


@contextlib.contextmanager
def failing(call: str, code: int) -> Iterator[None]:
    real = getattr(os, call)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    setattr(os, call, fail)
    try:
        yield
    finally:
        setattr(os, call, real)


@pytest.mark.parametrize("op", OPS)
def test_every_os_error_of_the_local_backend_is_ours_naming_path_and_cause(tmp_path: Path, op: str) -> None:
    wrong = []
    for call, code in itertools.product(OS_CALLS, ERRNOS):
        root = tmp_path / f"{call}-{code}"
        (root / "ck").mkdir(parents=True)
        (root / "ck" / "data.bin").write_bytes(b"d" * 100)
        (root / "ck" / "old.bin").write_bytes(b"o")
        (root / "ck" / ".x.dcpstore-tmp-1").write_bytes(b"t")
        storage = open_storage(str(root))
        path, run = _ops(root)[op]
        assert isinstance(storage, LocalStorage)
        try:
            with failing(call, code):
                run(storage)
        except CheckpointError as e:
            # The cause may be a knock-on error of the one injected (a failed
            # stat makes os.makedirs report EEXIST): any cause, worded or by code.
            message = str(e)
            named = storage.describe(path) in message or storage.describe(posixpath.dirname(path)) + ":" in message
            if not named or not (re.search(r"\(E[A-Z0-9]+\)", message) or any(w in message for w in WORDED.values())):
                wrong.append(f"os.{call} {errno.errorcode[code]}: {type(e).__name__}: {message}")
        except BaseException as e:  # noqa: BLE001 -- what is looked for: anything not ours
            wrong.append(f"os.{call} {errno.errorcode[code]}: raw {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)
