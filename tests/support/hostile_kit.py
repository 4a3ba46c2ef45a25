"""Crafting hostile checkpoints, and running the CLI on them.

What an attacker does to a good checkpoint: rewrite ``.metadata`` (and the
manifest's CRC of it, or drop the manifest), declare items far larger than
their files hold, swap an item for a crafted ``torch.save`` record, replace
data files by links or FIFOs. Shared by the hostile suites (tests/hostile),
the suites that run the CLI in-process, and tests/support/hostile_stock.py
(what stock DCP does with the same checkpoints).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import crc32c
import torch

import dcpstore
from dcpstore._impl.cli import main

MANIFEST, METADATA = ".dcpstore.json", ".metadata"


class Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def cli(*args: str) -> tuple[int, str, str]:
    """Run the CLI in-process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4), "step": 5}


def fresh() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(4), "step": 0}


def read_manifest(ckpt: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ckpt / MANIFEST).read_bytes())
    return data


def write_metadata(ckpt: Path, md: Any, *, manifest: bool = True) -> None:
    """What an attacker does: rewrite .metadata, then the manifest's CRC of it
    (or delete the manifest: the checkpoint then loads unverified)."""
    blob = pickle.dumps(md)
    (ckpt / METADATA).write_bytes(blob)
    if manifest:
        data = read_manifest(ckpt)
        data["metadata_crc32c"] = crc32c.crc32c(blob)
        (ckpt / MANIFEST).write_text(json.dumps(data))
    else:
        (ckpt / MANIFEST).unlink()


def good(path: Path) -> Path:
    dcpstore.save(state(), str(path)).result()
    return path


def declare(ckpt: Path, fqn: str, size: int, transforms: list[str] | None = None) -> None:
    """Declare item ``fqn`` to run to byte ``size`` of its file, and make the
    file that long: sparse, nothing on disk. The manifest goes, as an
    attacker would drop it (the checkpoint then loads unverified).
    ``transforms``: also name DCP stream transforms for it."""
    md = pickle.loads((ckpt / METADATA).read_bytes())
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            info.length = size - info.offset
            info.transform_descriptors = transforms
            os.truncate(ckpt / info.relative_path, size)
    write_metadata(ckpt, md, manifest=False)


def _deflated_zeros(mib: int) -> bytes:
    """A raw DEFLATE stream of ``mib`` MiB of zeros (~1 KiB per MiB), built
    without compressing them all: full flushes make each MiB's block alone."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(bytes(1 << 20)) + packer.flush(zlib.Z_FULL_FLUSH)
    return block * mib + packer.flush(zlib.Z_FINISH)


def record_with_deflated_entry(obj: Any, entry: str, mib: int) -> bytes:
    """``torch.save(obj)`` rebuilt as a zip whose entry ``entry`` is a
    DEFLATE stream of ``mib`` MiB of zeros: what torch's reader inflates to
    the size it declares before anything checks it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as original:
        entries = [(i.filename, original.open(i).read()) for i in original.infolist()]
    out, central = bytearray(), bytearray()
    for name, data in entries:
        usize, method = len(data), 0
        if name.endswith("/" + entry):
            data, usize, method = _deflated_zeros(mib), mib << 20, 8
        raw = name.encode()
        header = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, 0, len(data), usize, len(raw), 0)
        central += (
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0,
                0,
                len(data),
                usize,
                len(raw),
                0,
                0,
                0,
                0,
                0,
                len(out),
            )
            + raw
        )
        out += header + raw + data
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), len(out), 0)
    return bytes(out + central + end)


def replace_item(ckpt: Path, fqn: str, blob: bytes) -> None:
    """Item ``fqn`` becomes ``blob``, appended to its data file; the manifest
    goes (or an attacker rewrites it: its CRCs prove nothing then)."""
    md = pickle.loads((ckpt / METADATA).read_bytes())
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            with open(ckpt / info.relative_path, "ab") as f:
                info.offset, info.length = f.tell(), len(blob)
                f.write(blob)
    write_metadata(ckpt, md, manifest=False)


def replace_data_files(ckpt: Path, make: Any) -> None:
    """Replace every data file of ``ckpt`` by ``make(path)`` (a link, a FIFO)."""
    for name in os.listdir(ckpt):
        if name.endswith(".distcp"):
            os.unlink(ckpt / name)
            make(ckpt / name)
