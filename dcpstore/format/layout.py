"""On-storage layout: file names, the integrity manifest, commit markers.

A checkpoint directory (or key prefix) holds, in stock DCP layout::

    .dcpstore.inflight      the save id of the save in progress (removed at commit)
    __{rank}_{n}.distcp     data files, one per writer thread per rank
    .dcpstore.json          the integrity manifest (written just before .metadata)
    .metadata               the commit: pickled DCP ``Metadata``, written last

``.metadata`` stays exactly what ``torch.distributed.checkpoint`` writes, so
stock DCP loads dcpstore checkpoints and vice versa. The manifest is a
sidecar that stock DCP ignores. It records, for every data file, its size and
CRC32C; for every item (tensor or bytes blob) its CRC32C, keyed by
``"<file>@<offset>"`` so ranged reads verify exactly what they read; and the
CRC32C of the ``.metadata`` blob that follows it, so a damaged commit object
is detected too. And (``tensors``), for every item whose ``torch.save``
record holds its tensor's bytes row-major and contiguous: where those bytes
start within the item and how many there are -- a load then reads them
straight into the destination tensor (shape and dtype are in
``.metadata``), the record's other bytes into scratch, and verifies the
item's CRC32C over all of them.
Readers that predate the key ignore it; manifests without it load through
the records. A checkpoint written by plain DCP has no manifest and loads
unverified.

Which save writes these names, in which order, and when a file counts as
committed is the commit protocol's business (:mod:`dcpstore.dcp.commit`).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

from ..errors import CheckpointCorrupt

METADATA = ".metadata"
MANIFEST = ".dcpstore.json"
#: Written by the coordinator when a save starts, holding its save id, and
#: removed after the commit. A save whose marker was replaced by another
#: save's while it wrote refuses to commit (two writers, one URI).
INFLIGHT = ".dcpstore.inflight"
DATA_SUFFIX = ".distcp"
MANIFEST_FORMAT = "dcpstore-manifest/1"
_DATA_RE = re.compile(r"^__\d+_\d+\.distcp$")


def data_file_name(rank_prefix: str, index: int) -> str:
    """``__{rank}_`` + ``{index}`` + ``.distcp``, as stock DCP names them."""
    return f"{rank_prefix}{index}{DATA_SUFFIX}"


def is_data_file(path: str) -> bool:
    return _DATA_RE.match(path) is not None


def item_key(path: str, offset: int) -> str:
    return f"{path}@{offset}"


class FileEntry(TypedDict):
    size: int
    crc32c: int


class Manifest(TypedDict):
    format: str
    checksum: str
    metadata_crc32c: int
    files: dict[str, FileEntry]
    items: dict[str, int]
    #: item key -> [offset of the tensor bytes in the item, nbytes]
    tensors: dict[str, list[int]]


def build_manifest(
    files: dict[str, FileEntry],
    items: dict[str, int],
    metadata_crc: int,
    tensors: dict[str, list[int]] | None = None,
) -> bytes:
    manifest: Manifest = {
        "format": MANIFEST_FORMAT,
        "checksum": "crc32c",
        "metadata_crc32c": metadata_crc,
        "files": dict(sorted(files.items())),
        "items": items,
        "tensors": tensors or {},
    }
    return json.dumps(manifest, separators=(",", ":")).encode()


def parse_manifest(blob: bytes, where: str) -> Manifest:
    """Parse a manifest, raising :class:`CheckpointCorrupt` naming ``where``."""
    try:
        data: Any = json.loads(blob)
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}")
        for key in ("metadata_crc32c", "files", "items"):
            if key not in data:
                raise ValueError(f"missing key {key!r}")
        data.setdefault("tensors", {})  # absent from manifests written before it existed
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(f"{where}: damaged integrity manifest ({e})") from e
    manifest: Manifest = data
    return manifest
