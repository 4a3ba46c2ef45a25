"""How a storage is reached, and how its transfers are cut: :class:`StorageOptions`.

One frozen value, validated once, handed to a backend's constructor; the
automatic part and range sizes (:meth:`StorageOptions.part_size_for`,
:meth:`StorageOptions.upload_part_size`) and the bounds they keep to are
here, beside the options that override them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcpstore._impl.storage.byte_ranges import PIECE_SLACK, ceil_div
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.units import check_seconds

MiB = 1 << 20

#: Default connection budget per storage instance (``max_concurrency``):
#: see :class:`StorageOptions`.
DEFAULT_CONNECTIONS = 16


@dataclass(frozen=True)
class StorageOptions:
    """How a storage is reached: the client (``enable_msc``) and the tuning
    shared by all backends, each of which reads the fields that apply to it.

    One value wherever a URI is opened (:func:`dcpstore.open_storage`,
    :func:`dcpstore.save`, :class:`dcpstore.SaveOptions`, the drop-ins).
    Parsed and validated once (here), then handed to the backend constructor.
    Each field's comment below says what it does and its default.

    Args:
        enable_msc: route ``s3://`` and local paths through NVIDIA
            Multi-Storage-Client (``msc://`` always goes through it).
        part_size: object stores: multipart part and ranged-read size
            (``None``: chosen per object, :meth:`part_size_for`).
        max_concurrency: object stores: requests in flight per storage
            instance (one rank's connection budget, shared by all its files).
        max_attempts: object stores: attempts per request, the first included.
        connect_timeout_s, read_timeout_s: socket timeouts, seconds.
        op_timeout_s: most seconds one object operation may take, retries
            included.
        direct_io: local disks: write tensors' bytes from memory straight
            to the disk, and read them from the disk into their
            destinations, past the page cache (``O_DIRECT``).

    Raises:
        InvalidArgument: a value out of range (the message names the field).
    """

    #: Object stores: objects larger than this go up as multipart uploads in
    #: parts of this size; reads larger than this are split into parallel
    #: ranged GETs of this size. None (default): chosen per object or read
    #: from its size (:meth:`part_size_for`).
    part_size: int | None = None
    #: Object stores: requests in flight at once per storage instance -- one
    #: rank's connection budget, shared by part uploads and ranged GETs of
    #: all its files (see :mod:`dcpstore._impl.storage.request_pool`); the HTTP connection
    #: pool is sized to match. It also bounds the parts buffered for upload
    #: (``max_concurrency`` x the part size).
    max_concurrency: int = DEFAULT_CONNECTIONS
    #: Object stores: attempts per request (the first try included).
    max_attempts: int = 8
    #: Seconds for connecting and for each read from the socket.
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    #: Upper bound on the time one object operation may take, retries included.
    op_timeout_s: float = 600.0
    #: Native S3 backend: the AWS region of the bucket. None (default): from
    #: the standard AWS sources (``AWS_REGION``, the profile, ...). MSC takes
    #: its region from its profile, fsspec from its own options.
    region: str | None = None
    #: Route ``s3://`` and local paths through NVIDIA Multi-Storage-Client
    #: (like Megatron's ``--enable-msc``); ``msc://`` always goes through it.
    enable_msc: bool = False
    #: Local disks: a save writes the whole pages of each large tensor's
    #: bytes with ``O_DIRECT``, from the tensor's memory to the disk, instead
    #: of copying them into the page cache first: the kernel's copy, the
    #: largest CPU cost of a buffered save, goes, and the save does not fill
    #: the page cache with a checkpoint that nothing reads soon (a load of it
    #: then reads from the disk). A load reads each large tensor's whole
    #: pages with ``O_DIRECT`` from the disk into its destination (through a
    #: page-aligned bounce buffer where the destination lies elsewhere in a
    #: page than the bytes in the file), whatever the page cache holds.
    #: Record headers and the ragged ends of each tensor are read and
    #: written as usual; a filesystem that refuses ``O_DIRECT`` gets every
    #: byte buffered. fsync, the checksums and the commit are unchanged.
    #: Default False. Ignored by object stores.
    direct_io: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_msc", "direct_io"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.region is not None and (not isinstance(self.region, str) or not self.region.strip()):
            raise InvalidArgument(f"region must be None or a non-empty AWS region name, got {self.region!r}")
        if self.part_size is not None and (not isinstance(self.part_size, int) or self.part_size < 5 * MiB):
            raise InvalidArgument(
                f"part_size must be None (automatic) or an int >= 5 MiB (S3's minimum part), got {self.part_size!r}"
            )
        for name in ("max_concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "op_timeout_s"):
            # Finite: a socket's timeout must fit the platform's time_t.
            check_seconds(name, getattr(self, name))

    def part_size_for(self, nbytes: int | None) -> int:
        """The part (upload) or range (read) size, in bytes, for an object or
        read of ``nbytes`` bytes (``None`` or 0: unknown).

        ``part_size`` if set. Automatic: about :data:`AUTO_PIECES` pieces per
        object or read, so that one object alone keeps several connections
        busy (an object store's throughput is per connection) and the few
        files of a rank fill its budget together, in whole MiB between 8 MiB
        (the range size AWS recommends; S3's minimum part is 5 MiB) and
        64 MiB (few requests for large objects: request rates, not bytes,
        are what a busy prefix runs out of); 16 MiB for a stream of unknown
        size. A last piece of under 1/8 of the others is shared out over
        them instead (one request fewer).

        Returns:
            The size in bytes.
        """
        if self.part_size is not None:
            return self.part_size
        if not nbytes:
            return AUTO_PART_UNKNOWN
        per_piece = ceil_div(nbytes, AUTO_PIECES)
        size = min(AUTO_PART_MAX, max(AUTO_PART_MIN, ceil_div(per_piece, MiB) * MiB))
        count = ceil_div(nbytes, size)
        if count > 1 and nbytes - (count - 1) * size < size // PIECE_SLACK:
            # A last part of a few KiB (a file's record headers past a round
            # tensor size) would be a request of its own: one part fewer.
            size = min(AUTO_PART_MAX, ceil_div(ceil_div(nbytes, count - 1), MiB) * MiB)
        return size

    def transfer_pieces(self, nbytes: int, batch_hint: int | None = None) -> int:
        """How many pieces (parts of an upload, ranges of a read) an
        automatically sized transfer of ``nbytes`` is cut into, when it is
        one of several that make a batch of ``batch_hint`` bytes in all (this
        one included; ``None``: it is the only one).

        The *batch*, not each transfer, is cut into about
        :data:`UPLOAD_ROUNDS` x ``max_concurrency`` pieces: a rank writing
        or reading few files still keeps its whole connection budget busy
        (one transfer alone: up to twice the budget in pieces), and one
        moving many makes no more requests than the budget needs. Each
        piece between :data:`AUTO_PART_MIN` and :data:`AUTO_PART_MAX`; a
        transfer under twice the minimum is one piece.

        Returns:
            The number of pieces, at least 1.
        """
        batch = max(batch_hint or 0, nbytes)
        aim = min(AUTO_PART_MAX, max(AUTO_PART_MIN, ceil_div(batch, UPLOAD_ROUNDS * self.max_concurrency)))
        return max(ceil_div(nbytes, AUTO_PART_MAX), min(round(nbytes / aim), nbytes // AUTO_PART_MIN), 1)

    def upload_part_size(self, size_hint: int | None, batch_hint: int | None = None) -> int:
        """The part size of a multipart upload of an object of about
        ``size_hint`` bytes in a batch of ``batch_hint`` (see
        :meth:`transfer_pieces`).

        ``part_size`` if set; :data:`AUTO_PART_UNKNOWN` for a stream of
        unknown size. Automatic: ``size_hint`` over its
        :meth:`transfer_pieces`, to the byte, so that the object goes up in
        equal parts (its last one no larger, and not a sliver). One piece is
        a single PUT (an object that outgrows its hint goes up in parts of at
        least the minimum).

        Returns:
            The size in bytes.
        """
        if self.part_size is not None:
            return self.part_size
        if not size_hint:
            return AUTO_PART_UNKNOWN
        # One part is a single PUT up to the hint; past it (a hint too low)
        # the object still goes up in parts S3 accepts (5 MiB or more).
        return max(AUTO_PART_MIN, ceil_div(size_hint, self.transfer_pieces(size_hint, batch_hint)))


#: Most key prefixes a save may spread its data files over (3 hex digits).
MAX_SPREAD_PREFIXES = 4096
#: ``spread_prefixes="auto"`` (the default): as many prefixes as the number
#: of ranks needs (:func:`auto_spread_prefixes`).
AUTO_SPREAD = "auto"
#: Ranks per key prefix that the automatic spread aims at, from the figures
#: of ``benchmarks/scale_sim.py``'s model: a rank sends PUTs no faster than
#: its :data:`DEFAULT_CONNECTIONS` connections, each busy for a round trip
#: (20 ms) plus the smallest automatic part (:data:`AUTO_PART_MIN`, 8 MiB)
#: at 80 MB/s: 16 / 0.125 s = 128 PUT/s (smaller files are single PUTs,
#: ``workers`` of them per save: fewer). 16 such ranks send 2,048 PUT/s,
#: under S3's 3,500 PUT/s per prefix with room for the retries of a 503.
AUTO_RANKS_PER_PREFIX = 16


def check_storage_options(value: Any) -> StorageOptions | None:
    """``value`` if it is a :class:`StorageOptions` or ``None``, else
    InvalidArgument naming ``storage_options`` (a dict or another options
    class would otherwise fail deep in a backend, on its first field)."""
    if value is not None and not isinstance(value, StorageOptions):
        got = f"a {type(value).__name__}" if not isinstance(value, (str, int, float)) else repr(value)
        raise InvalidArgument(f"storage_options must be a dcpstore.StorageOptions or None, got {got}")
    return value


def check_spread_prefixes(spread: Any) -> int | str:
    """``spread`` if it is ``"auto"`` or an int from 1 to
    :data:`MAX_SPREAD_PREFIXES`, else
    :class:`~dcpstore._impl.util.errors.InvalidArgument` naming ``spread_prefixes``."""
    if spread == AUTO_SPREAD and isinstance(spread, str):
        return spread
    if not isinstance(spread, int) or isinstance(spread, bool) or not 1 <= spread <= MAX_SPREAD_PREFIXES:
        raise InvalidArgument(
            f"spread_prefixes must be 'auto' or an int from 1 to {MAX_SPREAD_PREFIXES}, got {spread!r}"
        )
    return spread


def auto_spread_prefixes(ranks: int) -> int:
    """The prefixes ``ranks`` ranks spread their data files over by
    default: the fewest, a power of two, that leave at most
    :data:`AUTO_RANKS_PER_PREFIX` ranks on each (1 -- stock DCP's flat
    layout -- up to 16 ranks; 1,024 at 16,384; at most
    :data:`MAX_SPREAD_PREFIXES`).

    This assumes what S3 documents and does: its request rates are per
    partition of the key space, and it splits a partition under sustained
    load at the characters where keys differ, so that each spread
    directory (``p{d}/``, the fastest-changing hex digit first:
    :mod:`dcpstore._impl.format.layout`) becomes a partition of its own
    once a job has checkpointed that layout for some minutes. Until then
    the new directories share their parent's partition and S3 answers
    ``503 SlowDown``, which the backend retries with backoff. A power of
    two keeps the digits of consecutive spreads aligned, so a job that
    grows keeps the partitions it already has."""
    spread = 1
    while spread * AUTO_RANKS_PER_PREFIX < ranks and spread < MAX_SPREAD_PREFIXES:
        spread *= 2
    return spread


def resolve_spread_prefixes(spread: int | str, ranks: int) -> int:
    """The number of prefixes a save of ``ranks`` ranks spreads over when
    asked for ``spread`` (an int: that; ``"auto"``: :func:`auto_spread_prefixes`)."""
    return auto_spread_prefixes(ranks) if spread == AUTO_SPREAD else int(spread)


#: Writer/reader threads per rank on an object store (see Storage.default_workers).
OBJECT_STORE_WORKERS = 4
#: Pieces per object or read that the automatic part size aims at.
AUTO_PIECES = 8
#: Bounds of the automatic part size (see StorageOptions.part_size_for).
AUTO_PART_MIN = 8 * MiB
AUTO_PART_MAX = 64 * MiB
AUTO_PART_UNKNOWN = 16 * MiB
#: Rounds of the connection budget an upload batch is cut into (see
#: StorageOptions.upload_part_size): two, so that at most half a rank's
#: batch is buffered in parts at once, and a part that finishes early
#: frees its connection for another.
UPLOAD_ROUNDS = 2
