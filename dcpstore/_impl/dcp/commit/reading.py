"""The read side of the commit protocol: what load, inspect and verify
accept as a committed checkpoint (:func:`read_checkpoint_metadata`), a
commit file of one (:func:`read_commit_file`), and whether the commit a
load read was replaced meanwhile (:func:`commit_replaced`).

A committed checkpoint passes capped reads, the manifest's schema, the
restricted unpickle of ``.metadata`` (nothing in a checkpoint is ever
executed), its chunks tiling every tensor, every stored item checked
against the manifest, and has the manifest that belongs to it: found by
the save id ``.metadata`` records (one of ours only for a ``.metadata`` of
ours: :func:`~dcpstore._impl.format.layout.manifest_names`), and checked by the
CRC32C it records, the rule :mod:`.from_listing` finds it by from a listing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata

from dcpstore._impl.dcp.commit.from_listing import disowned
from dcpstore._impl.dcp.liveness.inflight_marker import is_marker
from dcpstore._impl.format.chunks import check_tiling
from dcpstore._impl.format.layout import (
    MANIFEST,
    METADATA,
    commit_file_of,
    committed_by_us,
    is_commit_file,
    is_data_file,
    is_manifest,
    manifest_names,
)
from dcpstore._impl.format.manifest import (
    MANIFEST_LIMIT,
    METADATA_LIMIT,
    Manifest,
    check_items_listed,
    check_metadata_crc,
    parse_manifest,
    read_capped,
)
from dcpstore._impl.format.safe_pickle import TOOLS, Trust, load_metadata
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    StorageNotFound,
    UnsafeCheckpoint,
)
from dcpstore._impl.util.threads import run_parallel

log = logging.getLogger(__name__)


def read_commit_file(storage: Storage, manifest: Manifest | None, name: str, limit: int = MANIFEST_LIMIT) -> bytes:
    """The commit file ``name`` of the committed checkpoint whose manifest
    is ``manifest`` (from :func:`read_checkpoint_metadata`): the copy the
    manifest records, its size and CRC32C checked
    (:class:`CheckpointCorrupt` on a mismatch). A checkpoint without a
    manifest (written by stock DCP and its caller) gives the plain file,
    unverified, at most ``limit`` bytes. :class:`CheckpointNotFound` when
    the checkpoint has no such file."""
    paths = (
        [name]
        if manifest is None
        else [p for p in manifest["files"] if commit_file_of(p) == name and not is_data_file(p)]
    )
    if not paths:
        raise CheckpointNotFound(f"{storage.describe(name)}: the checkpoint's commit does not record this file")
    path = paths[0]
    try:
        blob = read_capped(storage, path, limit)
    except StorageNotFound as e:
        raise (CheckpointNotFound if manifest is None else CheckpointCorrupt)(
            f"{storage.describe(path)}: missing{' (recorded in the integrity manifest)' if manifest else ''}"
        ) from e
    if manifest is not None:
        entry = manifest["files"][path]
        if len(blob) != entry["size"] or crc32c(blob) != entry["crc32c"]:
            raise CheckpointCorrupt(
                f"{storage.describe(path)}: {len(blob)} bytes, CRC32C {crc32c(blob):08x}; the integrity "
                f"manifest records {entry['size']} bytes, CRC32C {entry['crc32c']:08x} (damaged or replaced)"
            )
    return blob


def read_checkpoint_metadata(
    storage: Storage, trust: Trust = TOOLS, *, on_read: Callable[[bytes], None] | None = None
) -> tuple[Metadata, Manifest | None]:
    """Read and verify ``.metadata`` (and the manifest, if there is one):
    capped reads, the manifest's schema, the CRC, the restricted unpickle
    (``trust``: what it may build beyond the allowlist), and every stored
    item checked against the manifest. Load, verify and inspect all come here.

    ``on_read`` is given the ``.metadata`` bytes as soon as they are read,
    before any check (a load judges from them whether a failure met a
    checkpoint replaced meanwhile: :func:`commit_replaced`)."""
    # Both in flight at once: most checkpoints' manifest has the plain name
    # (a save picks save-unique names only over an existing checkpoint), so
    # on an object store the commit usually costs one round trip, not two.
    commit_files = [(METADATA, METADATA_LIMIT), (MANIFEST, MANIFEST_LIMIT)]
    blob_or_error, plain = run_parallel(lambda f: _read_or_error(storage, *f), commit_files, 2, "dcpstore-commit-read")
    if isinstance(blob_or_error, StorageNotFound):
        raise CheckpointNotFound(_why_missing(storage)) from blob_or_error
    if isinstance(blob_or_error, BaseException):
        raise blob_or_error
    blob = blob_or_error
    if on_read is not None:
        on_read(blob)
    # The save id .metadata records names its manifest, so the restricted
    # unpickle comes first; the CRC check then covers every byte of the blob.
    try:
        metadata, stored = load_metadata(blob, storage.describe(METADATA), trust)
    except (CheckpointCorrupt, UnsafeCheckpoint) as e:
        _check_damage(storage, blob, f"unpickling it said: {e}", e)
        raise
    check_tiling(metadata, storage.describe(METADATA))
    manifest = None
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    for name in manifest_names(save_id, _first_data_file(metadata)):
        try:
            text = plain if name == MANIFEST else read_capped(storage, name, MANIFEST_LIMIT)
            if isinstance(text, BaseException):
                raise text
            manifest = parse_manifest(text, storage.describe(name))
        except StorageNotFound:
            continue
        check_metadata_crc(blob, manifest, storage.describe(METADATA))
        check_items_listed(manifest, stored, storage.describe, storage.describe(name))
        break
    else:
        if committed_by_us(save_id):  # its manifest gone, or its save id damaged: which, the CRCs tell
            _check_damage(storage, blob, f"its save id {save_id!r} names none", None)
            # No manifest in the directory at all: read as stock DCP reads it.
            # (A damaged save id, not of dcpstore's form, names no manifest.)
            names = manifest_names(save_id, _first_data_file(metadata)) or [MANIFEST]
            log.warning(
                "%s was committed by dcpstore (save id %r) but its integrity manifest %s is gone; "
                "reading it unverified, as stock DCP would",
                storage.uri,
                save_id,
                names[0],
            )
        else:
            log.debug("%s has no integrity manifest (stock DCP's); loading unverified", storage.uri)
    return metadata, manifest


def commit_replaced(storage: Storage, crc: int) -> bool:
    """Whether the ``.metadata`` at ``storage`` is no longer the one of CRC32C
    ``crc`` (read earlier): another save committed over it, or it is gone.
    Every commit's bytes differ (each records its own save id). False where
    it cannot be read for another reason."""
    try:
        return crc32c(read_capped(storage, METADATA, METADATA_LIMIT)) != crc
    except StorageNotFound:
        return True
    except CheckpointError:
        return False


def _read_or_error(storage: Storage, name: str, limit: int) -> bytes | CheckpointError:
    """:func:`read_capped`, its :class:`CheckpointError` returned, not raised
    (the caller decides whether it matters)."""
    try:
        return read_capped(storage, name, limit)
    except CheckpointError as e:
        return e


def _first_data_file(metadata: object) -> object:
    """The relative path of one item of ``metadata`` (None if it has none);
    read defensively: this runs before the manifest checks ``.metadata``."""
    storage_data = getattr(metadata, "storage_data", None)
    if not isinstance(storage_data, dict) or not storage_data:
        return None
    return getattr(next(iter(storage_data.values())), "relative_path", None)


def _check_damage(storage: Storage, blob: bytes, why: str, refused: CheckpointError | None) -> None:
    """``.metadata`` could not be unpickled (or names a class off the
    allowlist), or no manifest of the name its save id gives is there: if
    the directory holds manifests and none records this blob's CRC32C
    (:func:`~.from_listing.disowned`), the blob is damaged -- say that rather than
    what the damage happens to look like (``why``: that)."""
    if disowned(storage, blob):
        raise CheckpointCorrupt(
            f"{storage.describe(METADATA)}: checksum mismatch (damaged commit object: no manifest records its "
            f"CRC32C; {why})"
        ) from refused


#: The most listed objects :func:`_why_missing` looks at: explaining an
#: absence must not walk a whole filesystem (``file:///``) or bucket. A
#: checkpoint's commit files, markers and first data files come first.
EXPLAIN_LIMIT = 10_000


def _why_missing(storage: Storage) -> str:
    try:
        listed = [o["path"] for o in itertools.islice(storage.list(), EXPLAIN_LIMIT)]
        # The marker alone is what a save that failed before publishing any
        # data file leaves (its rank's files are published together).
        leftovers = [p for p in listed if is_data_file(p) or is_manifest(p) or is_marker(p)]
    except StorageNotFound as e:  # e.g. the bucket itself does not exist: say so
        return f"no checkpoint at {storage.uri}: {e}"
    except CheckpointError as e:
        return f"no checkpoint at {storage.uri} (and listing it failed: {e})"
    rank_local = sorted(p for p in listed if is_commit_file(p) and p != METADATA)
    if rank_local:
        return (
            f"no global {METADATA} at {storage.uri}: it holds rank-local metadata ({', '.join(rank_local[:3])}"
            f"{', ...' if len(rank_local) > 3 else ''}), a checkpoint of dcp.save(..., use_collectives=False) "
            "that dcpstore does not read (stock dcp.load does)"
        )
    if leftovers:
        return (
            f"no committed checkpoint at {storage.uri}: a save's files exist but no {METADATA} "
            f"(an interrupted save, or one still running; 'dcpstore gc {storage.uri}' removes what an "
            "interrupted one left)"
        )
    return f"no checkpoint at {storage.uri} (no {METADATA} found)"
