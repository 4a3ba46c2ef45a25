"""A mutation fuzzer over every field of a checkpoint's commit and records.

    PYTHONPATH=$PWD .venv/bin/python -m tests.support.mutation_fuzz OUT.json [--full] [--examples N]

Run by tests/hostile/test_mutation_fuzz.py in a process of its own
(``rss.in_own_process``: fresh peak RSS, a fixed mmap threshold, an audit
hook on every ``open``), or by hand. It saves one checkpoint that has
every kind of item (tensors read straight into their destination, small and
large; tensors read through their record; a tensor of two chunks; non-tensor
items; two data files), then, one mutation at a time, changes one field:

* ``.metadata`` (unpickled, changed, pickled again): every storage entry's
  file, offset, length and stream transforms, every storage key's chunk
  offsets, every tensor's dtype and size, every chunk's offsets and sizes,
  the save id, a dropped key;
* the manifest (JSON): format, checksums, every file's size and CRC, file
  names, every item's CRC and key, every tensor location (offset and
  length), locations added for items that have none;
* the record bytes (the zip headers torch's reader trusts): the end
  records, the central and local headers of ``data.pkl`` and ``data/0``
  (compression method, sizes, offsets, name lengths, flags), bytes of
  ``data.pkl`` and ``byteorder``, one byte of tensor data;
* byte flips across ``.metadata`` and the manifest; and items declared to
  run into a sparse hole (with and without stream transforms);

each under the modes that apply: ``damage`` (only that file changes),
``resealed`` (every checksum that would see the change recomputed, as an
attacker would) and ``stripped`` (the manifest removed: a stock-looking
checkpoint). Hypothesis then draws combinations of two to four mutations
and a mode. For every case it records what a load (into a destination of
the checkpoint's own declared shapes) and ``verify`` said, what a plain
reference reader makes of the mutated checkpoint, the peak RSS so far,
and every file opened outside the checkpoint. The properties the test
asserts (see it): only :class:`~dcpstore.CheckpointError`; ``verify``
agrees with ``load``; a change a checksum covers is refused; otherwise the
load returns exactly what the reference reads or refuses; peak RSS stays
within ``2 x state + 64 MiB`` of the baseline; nothing outside is opened.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import pickle
import re
import resource
import shutil
import struct
import sys
import tempfile
import traceback
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import dcpstore
from dcpstore._impl.tools.maintenance import verify_checkpoint
from tests.support.rss import fix_mmap_threshold

METADATA, MANIFEST = ".metadata", ".dcpstore.json"
MiB = 1 << 20
#: The peak RSS bound above the baseline: twice the state, plus this.
RSS_SLACK = 64 * MiB
#: How far a sparse hole runs past a data file's end.
HOLE = 256 * MiB


def fuzz_state() -> dict[str, Any]:
    """Every kind of item, flat keys (DCP's fqns are the keys)."""
    g = torch.Generator().manual_seed(29)
    return {
        "big": torch.randn(512, 520, generator=g),  # > 1 MiB: read into its destination, viewed in place
        "mid": torch.randn(100, 200, generator=g),  # 64 KiB .. 1 MiB: into its destination
        "small": torch.randn(10, generator=g),  # < 64 KiB: with its record, copied out
        "i64": torch.arange(50, dtype=torch.int64) * 7,
        "half": torch.randn(33, 7, generator=g).bfloat16(),
        "t": torch.randn(70, 30, generator=g).t(),  # not row-major: through its record, never located
        "shard0": torch.randn(4, 6, generator=g),  # merged below into "sharded", two chunks
        "shard1": torch.randn(4, 6, generator=g),
        "step": 1234,
        "name": "fuzz-29",
    }


def saved_state() -> dict[str, Any]:
    """What the checkpoint holds (after the merge), as loaded."""
    state = fuzz_state()
    state["sharded"] = torch.cat([state.pop("shard0"), state.pop("shard1")])
    state["t"] = state["t"].contiguous()
    return state


def state_bytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


def build(ckpt: Path) -> None:
    """Save the fuzz state (two data files), then merge ``shard0`` and
    ``shard1`` into one tensor of two chunks, as a 2-rank save writes it."""
    dcpstore.save(fuzz_state(), str(ckpt), workers=2).result()
    md = pickle.loads((ckpt / METADATA).read_bytes())
    parts = [md.state_dict_metadata.pop(f"shard{i}") for i in range(2)]
    chunks = [ChunkStorageMetadata(torch.Size([4 * i, 0]), torch.Size([4, 6])) for i in range(2)]
    md.state_dict_metadata["sharded"] = TensorStorageMetadata(parts[0].properties, torch.Size([8, 6]), chunks)
    for i in range(2):
        info = md.storage_data.pop(MetadataIndex(f"shard{i}", torch.Size([0, 0])))
        md.storage_data[MetadataIndex("sharded", torch.Size([4 * i, 0]), i)] = info
        md.planner_data.pop(f"shard{i}", None)
    md.planner_data["sharded"] = ("sharded",)
    write_metadata(ckpt, md)
    reseal(ckpt, {"metadata"})


# ---------------------------------------------------------------------------
# Reading and writing the parts of a checkpoint
# ---------------------------------------------------------------------------


def read_metadata(ckpt: Path) -> Any:
    return pickle.loads((ckpt / METADATA).read_bytes())


def write_metadata(ckpt: Path, md: Any) -> None:
    (ckpt / METADATA).write_bytes(pickle.dumps(md))


def read_manifest(ckpt: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ckpt / MANIFEST).read_bytes())
    return data


def write_manifest(ckpt: Path, manifest: Any) -> None:
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            crc = crc32c.crc32c(chunk, crc)
    return crc


def reseal(ckpt: Path, what: set[str], items: list[tuple[str, int, int]] | None = None) -> None:
    """Recompute the checksums an attacker would: the manifest's CRC of
    ``.metadata`` ("metadata"), and every listed item's and data file's
    CRC and size from the bytes now stored ("data"; ``items``: (path,
    offset, length) of the items the manifest keys)."""
    if not (ckpt / MANIFEST).exists():
        return
    manifest = read_manifest(ckpt)
    if "metadata" in what:
        manifest["metadata_crc32c"] = crc32c.crc32c((ckpt / METADATA).read_bytes())
    if "data" in what:
        for name in manifest["files"]:
            if (ckpt / name).is_file():
                manifest["files"][name] = {"size": (ckpt / name).stat().st_size, "crc32c": _file_crc(ckpt / name)}
        for path, offset, length in items or ():
            key = f"{path}@{offset}"
            if key in manifest["items"]:
                with open(ckpt / path, "rb") as f:
                    f.seek(offset)
                    manifest["items"][key] = crc32c.crc32c(f.read(length))
    write_manifest(ckpt, manifest)


def stored_items(md: Any) -> list[tuple[MetadataIndex, Any]]:
    return sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))


def label(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}@{list(index.offset)}"


# ---------------------------------------------------------------------------
# The mutations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One change to one field. ``target``: which seal covers it
    ("metadata", "manifest" -- nothing -- or "data"); ``modes``: the modes
    it runs under; ``kind``: its class, for the quick sample and reports.
    ``foreign``: it makes ``.metadata`` another writer's commit (a save id
    of stock DCP's form), which no manifest of ours describes: no seal
    applies, and a load must return what the checkpoint describes."""

    name: str
    kind: str
    target: str
    apply: Callable[[Path], None]
    modes: tuple[str, ...]
    foreign: bool = False


def _md_mutation(name: str, kind: str, change: Callable[[Any], Any]) -> Mutation:
    def apply(ckpt: Path) -> None:
        md = read_metadata(ckpt)
        out = change(md)
        write_metadata(ckpt, md if out is None else out)

    return Mutation(name, f"metadata.{kind}", "metadata", apply, ("damage", "resealed", "stripped"))


def _manifest_mutation(name: str, kind: str, change: Callable[[dict[str, Any]], Any]) -> Mutation:
    def apply(ckpt: Path) -> None:
        manifest = read_manifest(ckpt)
        change(manifest)
        write_manifest(ckpt, manifest)

    return Mutation(name, f"manifest.{kind}", "manifest", apply, ("damage",))


def _setter(obj_path: Callable[[Any], Any], attr: str, value: Any) -> Callable[[Any], None]:
    return lambda md: setattr(obj_path(md), attr, value)


def metadata_mutations(md: Any, files: dict[str, int]) -> Iterator[Mutation]:
    names = sorted(files)
    for index, info in stored_items(md):
        at = label(index)

        def entry(m: Any, index: MetadataIndex = index) -> Any:
            return m.storage_data[index]

        other = next(n for n in names if n != info.relative_path)
        for value in (other, "../sibling/" + info.relative_path, "/etc/passwd", "absent.distcp"):
            yield _md_mutation(f"{at}.relative_path={value}", "relative_path", _setter(entry, "relative_path", value))
        size = files[info.relative_path]
        for value in (info.offset + 1, info.offset - 1, info.offset + 64, 0, size, size - info.length, 1 << 40):
            if value >= 0 and value != info.offset:
                yield _md_mutation(f"{at}.offset={value}", "offset", _setter(entry, "offset", value))
        for value in (info.length + 1, info.length - 1, 0, info.length * 2, 1 << 40):
            yield _md_mutation(f"{at}.length={value}", "length", _setter(entry, "length", value))
        for value in (["zstandard/1"], ["bogus/1"], []):
            yield _md_mutation(f"{at}.transforms={value}", "transforms", _setter(entry, "transform_descriptors", value))
        if index.offset is not None:
            moved = torch.Size([index.offset[0] + 1, *index.offset[1:]])

            def rekey(m: Any, index: MetadataIndex = index, moved: torch.Size = moved) -> None:
                m.storage_data[MetadataIndex(index.fqn, moved, index.index)] = m.storage_data.pop(index)

            yield _md_mutation(f"{at}.key_offset={list(moved)}", "storage_key", rekey)
    for fqn, tmd in sorted(md.state_dict_metadata.items()):
        if isinstance(tmd, BytesStorageMetadata):
            yield _md_mutation(f"{fqn}: dropped", "dropped_key", lambda m, fqn=fqn: m.state_dict_metadata.pop(fqn))
            continue

        def props(m: Any, fqn: str = fqn) -> Any:
            return m.state_dict_metadata[fqn].properties

        def tensor(m: Any, fqn: str = fqn) -> Any:
            return m.state_dict_metadata[fqn]

        for dtype in (torch.float64, torch.int32, torch.float16, torch.uint8, torch.bool, torch.int64):
            if dtype != tmd.properties.dtype:
                yield _md_mutation(f"{fqn}.dtype={dtype}", "dtype", _setter(props, "dtype", dtype))
        size = list(tmd.size)
        for value in (
            [size[0] + 1, *size[1:]],
            [size[0] - 1, *size[1:]],
            size[:-1],
            [*size, 1],
            [size[-1], *size[:-1]],
        ):
            yield _md_mutation(f"{fqn}.size={value}", "size", _setter(tensor, "size", torch.Size(value)))
        for i, chunk in enumerate(tmd.chunks):

            def chunk_of(m: Any, fqn: str = fqn, i: int = i) -> Any:
                return m.state_dict_metadata[fqn].chunks[i]

            off, sz = list(chunk.offsets), list(chunk.sizes)
            for value in ([off[0] + 1, *off[1:]], [max(off[0] - 1, 0), *off[1:]]):
                if value != off:
                    yield _md_mutation(
                        f"{fqn}.chunks[{i}].offsets={value}",
                        "chunk_offsets",
                        _setter(chunk_of, "offsets", torch.Size(value)),
                    )
            for value in ([sz[0] - 1, *sz[1:]], [sz[0] + 1, *sz[1:]], [0, *sz[1:]]):
                yield _md_mutation(
                    f"{fqn}.chunks[{i}].sizes={value}", "chunk_sizes", _setter(chunk_of, "sizes", torch.Size(value))
                )
        if len(tmd.chunks) > 1:
            yield _md_mutation(
                f"{fqn}.chunks: last dropped",
                "chunk_dropped",
                lambda m, fqn=fqn: m.state_dict_metadata[fqn].chunks.pop(),
            )
    for value in ("0123456789abcdef", None, "0123456789abcdeg"):
        yield _md_mutation(f"save_id={value}", "save_id", _setter(lambda m: m.storage_meta, "save_id", value))
    stock_id = str(uuid.UUID(int=29))
    mutation = _md_mutation(
        f"save_id={stock_id} (stock's form)", "save_id", _setter(lambda m: m.storage_meta, "save_id", stock_id)
    )
    yield Mutation(mutation.name, mutation.kind, mutation.target, mutation.apply, mutation.modes, foreign=True)
    yield _md_mutation("storage_meta=None", "save_id", lambda m: setattr(m, "storage_meta", None))


def manifest_mutations(manifest: dict[str, Any]) -> Iterator[Mutation]:
    yield _manifest_mutation("format=x", "format", lambda m: m.update(format="x"))
    yield _manifest_mutation("checksum=crc32", "format", lambda m: m.update(checksum="crc32"))
    yield _manifest_mutation(
        "metadata_crc32c+1", "metadata_crc", lambda m: m.update(metadata_crc32c=(m["metadata_crc32c"] + 1) % 2**32)
    )
    for name in sorted(manifest["files"]):
        for delta in (1, -1):
            yield _manifest_mutation(
                f"files[{name}].size{delta:+}",
                "file_size",
                lambda m, n=name, d=delta: m["files"][n].update(size=m["files"][n]["size"] + d),
            )
        yield _manifest_mutation(
            f"files[{name}].crc32c^1",
            "file_crc",
            lambda m, n=name: m["files"][n].update(crc32c=m["files"][n]["crc32c"] ^ 1),
        )
        yield _manifest_mutation(
            f"files[{name}] renamed",
            "file_name",
            lambda m, n=name: m["files"].update({"__7_7.distcp": m["files"].pop(n)}),
        )
        yield _manifest_mutation(f"files[{name}] dropped", "file_name", lambda m, n=name: m["files"].pop(n))
    yield _manifest_mutation(
        "files: one more", "file_name", lambda m: m["files"].update({"__9_9.distcp": {"size": 1, "crc32c": 0}})
    )
    for key in sorted(manifest["items"]):
        path, _, offset = key.rpartition("@")
        yield _manifest_mutation(
            f"items[{key}]^1", "item_crc", lambda m, k=key: m["items"].update({k: m["items"][k] ^ 1})
        )
        yield _manifest_mutation(
            f"items[{key}] offset+1",
            "item_key",
            lambda m, k=key, p=path, o=offset: m["items"].update({f"{p}@{int(o) + 1}": m["items"].pop(k)}),
        )
    yield _manifest_mutation(
        "items: one more", "item_key", lambda m: m["items"].update({f"{sorted(m['files'])[0]}@1": 7})
    )
    for key, (start, nbytes) in sorted(manifest["tensors"].items()):
        for field, value in (
            (0, start + 1),
            (0, start - 1),
            (0, start + 64),
            (0, start - 64),
            (0, 0),
            (1, nbytes + 1),
            (1, nbytes - 1),
            (1, nbytes * 2),
            (1, 0),
        ):
            if value >= 0:
                yield _manifest_mutation(
                    f"tensors[{key}][{field}]={value}",
                    "tensor_location",
                    lambda m, k=key, f=field, v=value: m["tensors"][k].__setitem__(f, v),
                )
        yield _manifest_mutation(f"tensors[{key}] dropped", "tensor_location", lambda m, k=key: m["tensors"].pop(k))
    for key in sorted(set(manifest["items"]) - set(manifest["tensors"])):
        for loc in ([64, 8400], [704, 8400], [576, 16]):  # "t" is 70 x 30 floats; plausible record offsets
            yield _manifest_mutation(
                f"tensors[{key}] added {loc}",
                "tensor_location_added",
                lambda m, k=key, loc=loc: m["tensors"].update({k: list(loc)}),
            )
    yield _manifest_mutation("tensors: all dropped", "tensor_location", lambda m: m.pop("tensors"))


def _zip_fields(blob: bytes) -> dict[str, tuple[int, str]]:
    """Byte offsets of the fields worth mutating in one torch.save record
    (found with Python's zipfile and struct, not with the code under test):
    name -> (offset, struct format)."""
    fields: dict[str, tuple[int, str]] = {}
    end = len(blob) - 22
    fields["end.count"], fields["end.cd_size"], fields["end.cd_offset"] = (
        (end + 10, "<H"),
        (end + 12, "<I"),
        (end + 16, "<I"),
    )
    fields["end.comment_len"] = (end + 20, "<H")
    locator = end - 20
    if blob[locator : locator + 4] == b"PK\x06\x07":
        fields["end64_locator.offset"] = (locator + 8, "<Q")
        end64 = struct.unpack_from("<Q", blob, locator + 8)[0]
        fields["end64.cd_offset"], fields["end64.count"] = (end64 + 48, "<Q"), (end64 + 32, "<Q")
    cd_offset = struct.unpack_from("<I", blob, end + 16)[0]
    pos = cd_offset
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        infos = {i.filename.partition("/")[2]: i for i in z.infolist()}  # by name without the archive directory
    for _ in range(struct.unpack_from("<H", blob, end + 10)[0]):
        n, m, k = struct.unpack_from("<HHH", blob, pos + 28)
        short = blob[pos + 46 : pos + 46 + n].decode().partition("/")[2]
        if short in ("data.pkl", "data/0", "byteorder"):
            for name, at, fmt in (
                ("flags", 8, "<H"),
                ("method", 10, "<H"),
                ("csize", 20, "<I"),
                ("usize", 24, "<I"),
                ("name_len", 28, "<H"),
                ("header", 42, "<I"),
            ):
                fields[f"central[{short}].{name}"] = (pos + at, fmt)
            header = infos[short].header_offset
            for name, at, fmt in (
                ("sig", 0, "<I"),
                ("method", 8, "<H"),
                ("name_len", 26, "<H"),
                ("extra_len", 28, "<H"),
            ):
                fields[f"local[{short}].{name}"] = (header + at, fmt)
            ln, lm = struct.unpack_from("<HH", blob, header + 26)
            data = header + 30 + ln + lm
            size = infos[short].file_size
            if short == "data.pkl":
                for i in range(2, size - 1, max(1, size // 12)):
                    fields[f"data.pkl[{i}]"] = (data + i, "<B")
            elif short == "byteorder":
                fields["byteorder[0]"] = (data, "<B")
            else:
                fields["data/0[middle]"] = (data + size // 2, "<B")
        pos += 46 + n + m + k
    return fields


def _mutated_value(value: int, fmt: str) -> list[int]:
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    out = [value + 1, value - 1, value ^ 0x80, 8 if fmt == "<H" else 0, top, top >> 1]
    return sorted({v & top for v in out if v >= 0} - {value})


def record_mutations(ckpt: Path, md: Any) -> Iterator[Mutation]:
    """Fields of the records of a few items: a large and a mid tensor read
    into place, a small one, the record-path tensor, a chunk, a non-tensor."""
    wanted = {"big", "mid", "small", "t", "step", "sharded"}
    for index, info in stored_items(md):
        if index.fqn not in wanted or (index.fqn == "sharded" and index.index != 1):
            continue
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        for field, (at, fmt) in sorted(_zip_fields(blob).items()):
            (value,) = struct.unpack_from(fmt, blob, at)
            values = _mutated_value(value, fmt)
            if field.startswith(("data.pkl[", "byteorder", "data/0")):
                values = [value ^ 0x01, value ^ 0x20]
            for new in values:

                def apply(
                    ckpt: Path,
                    path: str = info.relative_path,
                    pos: int = info.offset + at,
                    fmt: str = fmt,
                    new: int = new,
                ) -> None:
                    with open(ckpt / path, "r+b") as f:
                        f.seek(pos)
                        f.write(struct.pack(fmt, new))

                kind = "record." + re.sub(r"\[[^\]]*\]", "", field)
                yield Mutation(f"{label(index)} {field}={new}", kind, "data", apply, ("damage", "resealed"))


def flip_mutations(ckpt: Path) -> Iterator[Mutation]:
    for name in (METADATA, MANIFEST):
        size = (ckpt / name).stat().st_size
        for pos in range(0, size, max(1, size // 24)):

            def apply(ckpt: Path, name: str = name, pos: int = pos) -> None:
                with open(ckpt / name, "r+b") as f:
                    f.seek(pos)
                    byte = f.read(1)
                    f.seek(pos)
                    f.write(bytes([byte[0] ^ 0x04]))

            target = "metadata" if name == METADATA else "manifest"
            yield Mutation(f"{name} byte {pos} flipped", f"flip.{target}", target, apply, ("damage",))


def sparse_mutations(md: Any) -> Iterator[Mutation]:
    """An item declared to run into a hole past its file's end (nothing on
    disk); with and without stream transforms named."""
    for index, _info in stored_items(md):
        if index.fqn not in ("big", "step"):
            continue
        for transforms in (None, ["zstandard/1"]):

            def apply(ckpt: Path, index: MetadataIndex = index, transforms: Any = transforms) -> None:
                m = read_metadata(ckpt)
                entry = m.storage_data[index]
                size = (ckpt / entry.relative_path).stat().st_size
                os.truncate(ckpt / entry.relative_path, size + HOLE)
                entry.length = size + HOLE - entry.offset
                entry.transform_descriptors = transforms
                write_metadata(ckpt, m)

            yield Mutation(
                f"{label(index)} runs {HOLE >> 20} MiB into a hole, transforms {transforms}",
                "sparse",
                "metadata",
                apply,
                ("resealed", "stripped"),
            )


def catalogue(ckpt: Path) -> list[Mutation]:
    md = read_metadata(ckpt)
    files = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name.endswith(".distcp")}
    return [
        *metadata_mutations(md, files),
        *manifest_mutations(read_manifest(ckpt)),
        *record_mutations(ckpt, md),
        *flip_mutations(ckpt),
        *sparse_mutations(md),
    ]


# ---------------------------------------------------------------------------
# The reference reader: what a mutated checkpoint describes, read plainly
# ---------------------------------------------------------------------------


class Invalid(Exception):
    """The checkpoint describes no state a load could return."""


def reference_state(ckpt: Path) -> dict[str, Any]:
    """The state the checkpoint describes, read the plain way: every chunk's
    record through ``torch.load(weights_only=True)``, of its declared dtype
    and shape, the chunks tiling each tensor, nothing outside the directory.
    Raises :class:`Invalid` where it describes none."""
    try:
        md = read_metadata(ckpt)
    except Exception as e:
        raise Invalid(f"unpickle: {e}") from e
    if type(md) is not Metadata or not isinstance(md.storage_data, dict):
        raise Invalid("not Metadata")
    out: dict[str, Any] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, BytesStorageMetadata):
            out[fqn] = _reference_object(ckpt, md.storage_data.get(MetadataIndex(fqn)))
            continue
        dtype, size = tmd.properties.dtype, tuple(tmd.size)
        value = torch.zeros(size, dtype=dtype)
        covered = torch.zeros(size, dtype=torch.bool)
        for chunk in tmd.chunks:
            info = md.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            record = torch.load(io.BytesIO(_reference_bytes(ckpt, info)), weights_only=True)
            if (
                not isinstance(record, torch.Tensor)
                or record.dtype != dtype
                or tuple(record.shape) != tuple(chunk.sizes)
            ):
                raise Invalid(f"{fqn}: record is not the declared chunk")
            if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size)) or len(chunk.offsets) != len(size):
                raise Invalid(f"{fqn}: chunk outside the tensor")
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            if covered[box].any():
                raise Invalid(f"{fqn}: chunks overlap")
            value[box] = record
            covered[box] = True
        if not bool(covered.all()):
            raise Invalid(f"{fqn}: chunks do not cover it")
        out[fqn] = value
    used = {
        MetadataIndex(f, c.offsets)
        for f, t in md.state_dict_metadata.items()
        if isinstance(t, TensorStorageMetadata)
        for c in t.chunks
    }
    used |= {MetadataIndex(f) for f, t in md.state_dict_metadata.items() if isinstance(t, BytesStorageMetadata)}
    if set(md.storage_data) - used:
        raise Invalid("storage entries no key declares")  # dcpstore refuses these; so does this reader
    return out


#: No item of the fuzz state is near this: the reference reads nothing larger.
REFERENCE_ITEM_LIMIT = 64 * MiB


def _reference_bytes(ckpt: Path, info: Any) -> bytes:
    if info is None:
        raise Invalid("no storage entry")
    if info.length > REFERENCE_ITEM_LIMIT:
        raise Invalid("larger than any item of the fuzz state")
    if info.transform_descriptors:
        raise Invalid("stream transforms (none registered here)")
    path = info.relative_path
    if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/") or not (ckpt / path).is_file():
        raise Invalid(f"file {path!r}")
    if info.offset < 0 or info.length < 0 or info.offset + info.length > (ckpt / path).stat().st_size:
        raise Invalid("item outside its file")
    with open(ckpt / path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _reference_object(ckpt: Path, info: Any) -> Any:
    blob = _reference_bytes(ckpt, info)
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:
        raise Invalid(f"object: {type(e).__name__}") from e


# ---------------------------------------------------------------------------
# Running one case
# ---------------------------------------------------------------------------


class Opens:
    """Every file opened outside the current checkpoint but inside the fuzz
    root, or anywhere under /etc (the audit hook's record)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.ckpt: str | None = None
        self.outside: list[str] = []

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or self.ckpt is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        inside_root = path == self.root or path.startswith(self.root + os.sep)
        inside_ckpt = path == self.ckpt or path.startswith(self.ckpt + os.sep)
        if (inside_root and not inside_ckpt) or path.startswith("/etc/"):
            self.outside.append(path)


def destination(described: dict[str, Any] | None, fallback: dict[str, Any]) -> dict[str, Any]:
    """A destination of the shapes the checkpoint declares (where it
    describes a state), else of the saved state's."""
    source = described if described is not None else fallback
    return {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else None for k, v in source.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Every key, dtype, shape and value (NaN included: bits, not numbers)."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape):
                return False
            if v.numel() and not torch.equal(v.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
                return False
        elif v != w:
            return False
    return True


def _fingerprint(ckpt: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, _file_crc(p)) for p in ckpt.iterdir()}


def _outcome(fn: Callable[[], Any]) -> tuple[bool, str]:
    """(passed, what it said); a non-dcpstore exception is reported as such."""
    try:
        fn()
        return True, "ok"
    except dcpstore.CheckpointError as e:
        return False, f"{type(e).__name__}: {str(e)[:400]}"
    except Exception as e:
        return False, f"NOT A CheckpointError: {type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-1500:]}"


def run_case(
    root: Path, pristine: Path, mutations: list[Mutation], mode: str, opens: Opens, saved: dict[str, Any]
) -> dict[str, Any]:
    gc.collect()  # the last case's failed load left cycles (exception, traceback, frames, buffers): not this one's peak
    work = Path(tempfile.mkdtemp(dir=root, prefix="case-"))
    ckpt = work / "ck"
    shutil.copytree(pristine, ckpt)
    before = _fingerprint(ckpt)
    for mutation in mutations:
        try:
            mutation.apply(ckpt)
        except Exception as e:  # a mutation that cannot apply over an earlier one (a combination)
            shutil.rmtree(work, ignore_errors=True)
            return {"mutations": [m.name for m in mutations], "skipped": f"{type(e).__name__}: {e}", "mode": mode}
    after = _fingerprint(ckpt)
    changed = {name for name, fingerprint in before.items() if after.get(name) != fingerprint}
    if mode == "resealed":
        reseal(
            ckpt,
            {"metadata", "data"},
            [(i.relative_path, i.offset, i.length) for i in read_metadata(pristine).storage_data.values()],
        )
    elif mode == "stripped":
        (ckpt / MANIFEST).unlink(missing_ok=True)
    # What the mutated checkpoint's own seals must catch: a changed file that
    # a checksum of the untouched manifest covers.
    sealed = mode == "damage" and bool(changed - {MANIFEST}) and not any(m.foreign for m in mutations)
    try:
        described: dict[str, Any] | None = reference_state(ckpt)
        why_invalid = ""
    except Exception as e:  # Invalid, or torch.load refusing the record
        described, why_invalid = None, f"{type(e).__name__}: {str(e)[:200]}"
    dest = destination(described, saved)
    opens.ckpt, opens.outside = str(ckpt.resolve()), []
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        loaded, load_says = _outcome(lambda: dcpstore.load(dest, str(ckpt)))
        report: list[Any] = []
        verified, verify_says = _outcome(lambda: report.append(verify_checkpoint(dcpstore.open_storage(str(ckpt)))))
    opens.ckpt = None
    if verified:
        verified = report[0].ok
        verify_says = "ok" if verified else "; ".join(report[0].problems + report[0].refused)[:400]
    result = {
        "mutations": [m.name for m in mutations],
        "kinds": sorted({m.kind for m in mutations}),
        "mode": mode,
        "changed": sorted(changed),
        "sealed": sealed,
        "reference": "valid" if described is not None else why_invalid,
        "load": load_says,
        "verify": verify_says,
        "loaded_ok": loaded,
        "verify_ok": verified,
        "as_described": bool(loaded and described is not None and same(dest, described)),
        "outside": sorted(set(opens.outside)),
        "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    shutil.rmtree(work, ignore_errors=True)
    return result


def quick_sample(cases: list[tuple[Mutation, str]]) -> list[tuple[Mutation, str]]:
    """One case of every kind of field, the modes taken in turn (kind by
    kind), so that the sample has every kind and every mode in seconds."""
    by_kind: dict[str, list[tuple[Mutation, str]]] = {}
    for mutation, mode in cases:
        by_kind.setdefault(mutation.kind, []).append((mutation, mode))
    out = []
    for i, (_kind, options) in enumerate(sorted(by_kind.items())):
        modes = sorted({mode for _, mode in options})
        want = modes[i % len(modes)]
        out.append(next(case for case in options if case[1] == want))
    return out


def run_to_file(out: str, full: bool, examples: int) -> None:
    """The sweep, its results written to ``out`` (JSON), in a process of its
    own (``rss.in_own_process``): the allocator's mmap threshold is fixed
    there, so that peak RSS tracks live memory, and the audit hook stays there."""
    fix_mmap_threshold()
    _sweep_to_file(out, full, examples)


def _sweep_to_file(out: str, full: bool, examples: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="dcpstore-fuzz-"))
    try:
        results = sweep(root, full, examples)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--full", action="store_true", help="every mutation in every mode (else a sample)")
    parser.add_argument("--examples", type=int, default=20, help="hypothesis combinations")
    args = parser.parse_args()
    # By hand the allocator is left as it is: peak RSS then includes what glibc keeps for reuse.
    _sweep_to_file(args.out, args.full, args.examples)


def sweep(root: Path, full: bool, examples: int) -> dict[str, Any]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pristine = root / "pristine" / "ck"
    build(pristine)
    shutil.copytree(pristine, root / "sibling")  # what an escaping name would reach
    saved = saved_state()
    opens = Opens(root)
    sys.addaudithook(opens.hook)
    baseline_case = run_case(root, pristine, [], "damage", opens, saved)  # warms every code path once
    # What is alive now (torch's modules, the warmed paths) lives to the end:
    # out of the collector's sight, each case's gc.collect() walks only what
    # cases made, in milliseconds instead of a tenth of a second.
    gc.collect()
    gc.freeze()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mutations = catalogue(pristine)
    cases = [(m, mode) for m in mutations for mode in m.modes]
    chosen = cases if full else quick_sample(cases)
    results = []
    for i, (m, mode) in enumerate(chosen):
        results.append(run_case(root, pristine, [m], mode, opens, saved))
        if i % 250 == 249:
            print(f"{i + 1} of {len(chosen)} cases", file=sys.stderr, flush=True)
    combos: list[dict[str, Any]] = []
    failures: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        picks=st.lists(st.sampled_from(range(len(mutations))), min_size=2, max_size=4, unique=True),
        mode=st.sampled_from(["damage", "resealed", "stripped"]),
    )
    def combination(picks: list[int], mode: str) -> None:
        combos.append(run_case(root, pristine, [mutations[i] for i in picks], mode, opens, saved))

    try:
        combination()
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
    return {
        "baseline": baseline_case,
        "baseline_kib": baseline,
        "state_bytes": state_bytes(saved),
        "catalogue": len(cases),
        "kinds": sorted({m.kind for m in mutations}),
        "cases": results,
        "combinations": combos,
        "hypothesis_errors": failures,
    }


if __name__ == "__main__":
    main()
