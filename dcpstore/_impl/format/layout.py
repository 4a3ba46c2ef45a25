"""On-storage layout: file names, item keys, commit markers.

A checkpoint directory (or key prefix) holds, in stock DCP layout::

    .dcpstore.inflight      the save id of the save in progress (removed at commit)
    .dcpstore.alive.<id>    a running writer's proof of life for gc, written
                            before its other files and removed at commit or
                            failure (:mod:`dcpstore._impl.dcp.liveness.alive_file`)
    __{rank}_{n}.distcp     data files, one per writer thread per rank: items one
                            after another, a zero pad shorter than
                            PAD_LIMIT before a large tensor's record
    p{d}/__{rank}_{n}.distcp  the same, spread over key prefixes (see below)
    <name>                  a commit file a caller hands the save (e.g. Lightning's
                            ``meta.pt``), written after every data file and
                            before the manifest, recorded in it like a data file
    .dcpstore.json          the integrity manifest (written just before .metadata)
    .dcpstore.replica.<r>.<x>  a tiered manager's replication report of rank r
                            (durable tier only; removed after the commit)
    .metadata               the commit: pickled DCP ``Metadata``, written last

A safetensors save (:mod:`dcpstore._impl.safetensors`) writes Hugging Face's
shard files instead of data files (``model-{i}-of-{n}.safetensors``, or
``shard-{r}-model-{i}-of-{n}.safetensors`` for rank r's part of a sharded
save) and their index (``model.safetensors.index.json``) as a commit file.

A save to a URI that already holds something of a save (a commit, data
files, a manifest, a marker) uses *save-unique* names instead, so that its
files sit beside the committed checkpoint's until its ``.metadata`` replaces
the old one::

    __{rank}_{tag}_{n}.distcp    tag: the first 8 hex digits of the save id
                                 (in ``p{d}/`` too when the save spreads)
    model-{i}-of-{n}.{tag}.safetensors  a safetensors save's shards
    .dcpstore.{tag}.json         its manifest
    .dcpstore.side.{tag}.<name>  its commit files; copied to ``<name>`` once
                                 its ``.metadata`` landed (for readers that
                                 know only the plain name)

``.metadata`` records the save id (``storage_meta.save_id``), so a reader
finds the manifest that belongs to it (:func:`manifest_names`); a
``.metadata`` another writer committed over ours (stock DCP records a UUID)
has none, whatever manifest ours left (:func:`committed_by_us`). A save to a
fresh URI keeps stock DCP's names, so that a checkpoint saved once looks
exactly as stock DCP's (and as every checkpoint dcpstore wrote before).

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
``.metadata``), the record's other bytes into scratch, verifies the item's
CRC32C over all of them, and proves the location from the record's own
header and trailer (:mod:`.record_zip`): the manifest locates, it does not
vouch.
Readers that predate the key ignore it; manifests without it load through
the records. A checkpoint written by plain DCP has no manifest and loads
unverified. The manifest's schema and its validation against ``.metadata``
are :mod:`.manifest`'s.

Stock DCP saving with ``use_collectives=False`` commits one
``__{rank}.metadata`` per rank instead of ``.metadata``
(:func:`is_commit_file`): dcpstore does not load such a checkpoint, but
``ls`` and ``gc`` count it as committed.

Spreading (``SaveOptions.spread_prefixes`` = P > 1): each rank's data
files go one directory down, into ``p{d}/``, where ``d`` is ``rank mod P`` in
hex digits, least significant first (``p0``, ``p1``, ... ``pf``, then
``p01``, ``p11``, ... for P = 256). An object store partitions its key space
by prefix and limits the request rate of each partition (S3: about 3,500
PUT/s); with the fastest-changing digit first, consecutive ranks land in
different partitions as soon as the store splits at that character, the way
s3torchconnector's binary and hex prefix strategies do. The directory is
part of each file's relative path in ``.metadata``, so stock ``dcp.load``
reads the result. It is added in front of whatever name the writer gives
the rank's files (the rank's DCP ``_StoragePrefix``), so it composes with
any naming of the files themselves.

Which save writes these names, in which order, and when a file counts as
committed is the commit protocol's business (:mod:`dcpstore._impl.dcp.commit`).
"""

from __future__ import annotations

import re

from dcpstore._impl.storage.posix import DIRECT_ALIGN

METADATA = ".metadata"
MANIFEST = ".dcpstore.json"
#: Written by the coordinator when a save starts, holding its save id, and
#: removed after the commit. A save whose marker was replaced by another
#: save's while it wrote refuses to commit (two writers, one URI).
INFLIGHT = ".dcpstore.inflight"
#: A tiered manager's per-rank report of the files it replicated to the
#: durable tier (``.dcpstore.replica.<rank>.<random>``; removed after that copy's commit).
REPLICA_REPORT_PREFIX = ".dcpstore.replica."
DATA_SUFFIX = ".distcp"
#: A large tensor's record starts at a multiple of this in its data file,
#: after a pad of zeros that belongs to no item: torch aligns a tensor's
#: bytes to 64 inside the record, as in memory, so the kernel's copy between
#: the page cache and the tensor runs on whole cache lines (see
#: :mod:`~dcpstore._impl.format.record`).
DATA_ALIGN = 64
#: Every pad is shorter than this, a page: where a data file is written
#: with direct I/O (``StorageOptions(direct_io=True)``), a large tensor's
#: bytes lie at the same offset modulo :data:`DIRECT_ALIGN` in the file as
#: in memory, so that the whole pages between go from the tensor's memory
#: to the disk without the page cache (see :mod:`~dcpstore._impl.format.record`).
#: A gap shorter than this between items is a pad of zeros
#: (:func:`~.manifest.check_items_listed`).
PAD_LIMIT = DIRECT_ALIGN
#: ``os.urandom(8).hex()``: what :class:`~dcpstore._impl.dcp.commit.SaveSession` makes.
SAVE_ID_LEN = 16
_SAVE_ID_RE = re.compile(rf"^[0-9a-f]{{{SAVE_ID_LEN}}}$")
TAG_LEN = 8
_DATA_RE = re.compile(r"^__\d+_(?:([0-9a-f]{8})_)?\d+\.distcp$")
_MANIFEST_RE = re.compile(r"^\.dcpstore(?:\.([0-9a-f]{8}))?\.json$")
#: A commit file's save-unique name: ``.dcpstore.side.{tag}.{name}``.
COMMIT_FILE_PREFIX = ".dcpstore.side."
_COMMIT_FILE_RE = re.compile(r"^\.dcpstore\.side\.([0-9a-f]{8})\.(.+)$")
#: What a commit file's own name may be: a plain file name that none of the
#: names above can take (no directory, no leading dot, no DCP suffix).
_COMMIT_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
#: The directory of a rank's data files when a save spreads them (``p`` +
#: up to 3 hex digits: SaveOptions.spread_prefixes <= 4096; see the
#: module doc).
SPREAD_DIR_PREFIX = "p"
_SPREAD_RE = re.compile(rf"^{SPREAD_DIR_PREFIX}[0-9a-f]{{1,3}}$")
#: Hugging Face's index of a safetensors checkpoint: tensor name -> shard file.
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: A safetensors shard, as Hugging Face and torch's ``HuggingFaceStorageWriter``
#: name them (``model-00001-of-00002.safetensors``; one rank's part of a
#: sharded save: ``shard-00001-model-...``), with the save tag before the
#: suffix for a save over a used URI.
_SAFETENSORS_RE = re.compile(r"^(?:shard-\d{5,}-)?model-\d{5,}-of-\d{5,}(?:\.([0-9a-f]{8}))?\.safetensors$")
#: Stock DCP with ``use_collectives=False`` commits one ``__{rank}.metadata`` per rank.
_RANK_METADATA_RE = re.compile(r"^__\d+\.metadata$")


def data_file_name(rank_prefix: str, index: int, tag: str = "") -> str:
    """``__{rank}_`` + ``{index}`` + ``.distcp``, as stock DCP names them;
    with a save ``tag``, ``__{rank}_{tag}_{index}.distcp``."""
    return f"{rank_prefix}{tag}_{index}{DATA_SUFFIX}" if tag else f"{rank_prefix}{index}{DATA_SUFFIX}"


def safetensors_file_name(index: int, count: int, shard: int | None = None, tag: str = "") -> str:
    """Shard file ``index`` (from 1) of ``count`` of a safetensors save
    (``shard``: the rank's part of a sharded save, from 1), with the save
    ``tag`` over a used URI: ``model-00001-of-00002.safetensors``,
    ``shard-00002-model-00001-of-00002.{tag}.safetensors``."""
    stem = f"model-{index:05d}-of-{count:05d}"
    if shard is not None:
        stem = f"shard-{shard:05d}-{stem}"
    return f"{stem}.{tag}.safetensors" if tag else f"{stem}.safetensors"


def is_safetensors_file(name: str) -> bool:
    """Whether ``name`` is named like a safetensors shard (ours or anyone's)."""
    return _SAFETENSORS_RE.match(name) is not None


def is_tagged_safetensors_file(name: str) -> bool:
    """Whether ``name`` is a safetensors shard with a save tag: only a save
    of dcpstore's writes such a name (a plain one may be anyone's weights,
    which ``gc`` never takes for a leftover)."""
    m = _SAFETENSORS_RE.match(name)
    return m is not None and m.group(1) is not None


def spread_dir(rank: int, prefixes: int) -> str:
    """The directory of ``rank``'s data files when a save spreads them over
    ``prefixes`` key prefixes (``""``: not spread, for ``prefixes`` <= 1)."""
    if prefixes <= 1:
        return ""
    width = len(f"{prefixes - 1:x}")
    return SPREAD_DIR_PREFIX + f"{rank % prefixes:0{width}x}"[::-1]


def spread_file_prefix(file_prefix: str, rank: int, prefixes: int) -> str:
    """``file_prefix`` (the names a writer gives ``rank``'s data files start
    with, e.g. ``__{rank}_``) moved into the rank's spread directory."""
    directory = spread_dir(rank, prefixes)
    return f"{directory}/{file_prefix}" if directory else file_prefix


def split_data_path(path: str) -> tuple[str, str] | None:
    """``(checkpoint directory, data file path inside it)`` if ``path`` (a
    listed path, ``/``-separated) is a DCP data file, spread or not; else None.

    A data file inside a directory named like a spread directory
    (``p3a/__0_0.distcp``) counts as spread: it belongs to the checkpoint one
    level up.
    """
    head, _, name = path.rpartition("/")
    if _DATA_RE.match(name) is None:
        return None
    parent, _, last = head.rpartition("/")
    if _SPREAD_RE.match(last) is not None:
        return parent, f"{last}/{name}"
    return head, name


def checkpoint_dir(directory: str) -> str:
    """The checkpoint directory that a listed directory (``/``-separated)
    belongs to: the one above it for a spread directory (``ck/p3a``), else
    itself. What a save leaves in ``p3a/`` (data files, temporary files,
    open uploads) is its checkpoint's."""
    parent, _, last = directory.rpartition("/")
    return parent if _SPREAD_RE.match(last) is not None else directory


def is_data_file(path: str) -> bool:
    """Whether ``path``, relative to a checkpoint, is one of its data files
    (``__{rank}_{n}.distcp`` or ``__{rank}_{tag}_{n}.distcp``, directly or
    in a spread directory)."""
    split = split_data_path(path)
    return split is not None and split[0] == ""


def is_replica_report(name: str) -> bool:
    return name.startswith(REPLICA_REPORT_PREFIX)


def save_tag(save_id: str) -> str:
    """The tag of save-unique names (:func:`data_file_name`, :func:`manifest_name`)."""
    return save_id[:TAG_LEN]


def manifest_name(tag: str = "") -> str:
    """The manifest of a save with save-unique names (``tag``), or the plain one."""
    return f".dcpstore.{tag}.json" if tag else MANIFEST


def is_manifest(name: str) -> bool:
    return _MANIFEST_RE.match(name) is not None


def commit_file_problem(name: object) -> str | None:
    """Why ``name`` cannot be a commit file's name, or None: a plain file
    name (letters, digits, ``_ . -``; no leading dot) that is no DCP data
    file or commit, so it never collides with what a save writes itself."""
    if not isinstance(name, str) or _COMMIT_FILE_NAME_RE.match(name) is None:
        return f"a commit file's name must be a plain file name (letters, digits, '_', '.', '-'; no leading dot), got {name!r}"
    if name.endswith(DATA_SUFFIX) or is_commit_file(name):
        return f"a commit file may not be named like a DCP data file or commit: {name!r}"
    return None


def commit_file_path(name: str, tag: str = "") -> str:
    """Where a save writes its commit file ``name`` before its commit: the
    name itself on a fresh URI, ``.dcpstore.side.{tag}.{name}`` for a save
    with save-unique names (an overwrite), so that the checkpoint it
    replaces keeps its own until the new ``.metadata`` lands."""
    return f"{COMMIT_FILE_PREFIX}{tag}.{name}" if tag else name


def is_commit_side_file(name: str) -> bool:
    """Whether ``name`` is a commit file's save-unique name (a save's own,
    removed with that save's other files once a later save replaces it)."""
    return _COMMIT_FILE_RE.match(name) is not None


def commit_file_of(path: str) -> str:
    """The commit file name that the recorded ``path`` holds: the name of
    a save-unique one, ``path`` itself otherwise."""
    m = _COMMIT_FILE_RE.match(path)
    return m.group(2) if m is not None else path


def name_tag(path: str) -> str | None:
    """The save tag of a data file (``path`` relative to its checkpoint,
    spread or not), manifest or save-unique commit file name ("" for stock
    names); None for any other path."""
    if is_data_file(path):
        m = _DATA_RE.match(path.rpartition("/")[2])
    else:
        m = _MANIFEST_RE.match(path) or _COMMIT_FILE_RE.match(path)
        if m is None and is_tagged_safetensors_file(path):
            m = _SAFETENSORS_RE.match(path)
    return None if m is None else m.group(1) or ""


def manifest_names(save_id: object, data_file: object = None) -> list[str]:
    """Where the manifest of a ``.metadata`` recording ``save_id`` may be, in
    the order to try: the save-unique one and the plain one, for a save id of
    dcpstore's form; none for any other save id: that ``.metadata`` was
    committed by another writer (stock DCP records a UUID), perhaps over a
    checkpoint of ours whose manifest it left behind, and no manifest there
    describes it. ``None`` (a ``.metadata`` recording no save id, as torch
    before 2.4 writes): the plain one. Nothing else read from storage ever
    becomes a file name.

    ``data_file``, one data file that ``.metadata`` names, says which comes
    first: a save gives its manifest save-unique names exactly when it gives
    them to its data files, so the right name is usually tried first (on an
    object store each miss is a round trip)."""
    if save_id is None:
        return [MANIFEST]
    if not (isinstance(save_id, str) and _SAVE_ID_RE.match(save_id)):
        return []  # another writer's (or damaged: committed_by_us says which)
    tagged = manifest_name(save_tag(save_id))
    plain_first = isinstance(data_file, str) and name_tag(data_file) == ""
    return [MANIFEST, tagged] if plain_first else [tagged, MANIFEST]


def committed_by_us(save_id: object) -> bool:
    """Whether a ``.metadata`` recording ``save_id`` was committed by
    dcpstore: its save ids are 16 characters (16 hex digits; one damaged is
    still 16 characters), stock DCP's and its subclasses' are 36-character
    UUIDs. A commit of ours without its manifest is damaged or stripped."""
    return isinstance(save_id, str) and len(save_id) == SAVE_ID_LEN


def item_key(path: str, offset: int) -> str:
    """The manifest's key of the item at ``offset`` of data file ``path``."""
    return f"{path}@{offset}"


def is_commit_file(name: str) -> bool:
    """``.metadata``, or a rank-local ``__{rank}.metadata`` (stock DCP's commit
    with ``use_collectives=False``): a directory holding one is a checkpoint."""
    return name == METADATA or _RANK_METADATA_RE.match(name) is not None
