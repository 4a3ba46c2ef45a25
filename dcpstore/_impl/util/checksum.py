"""CRC32C: the one checksum dcpstore writes and verifies, and its helpers.

:func:`crc32c` is the only function that checksums bytes; every module calls
it from here. It runs on one of two libraries, which compute the same CRC-32C
(iSCSI) and release the GIL:

* ``awscrt`` (AWS's common runtime, ``pip install dcpstore[crt]`` or
  ``boto3[crt]``) when it is installed: where the CPU has VPCLMULQDQ it folds
  with carry-less multiplies, about twice the ``crc32c`` package's speed on a
  buffer in cache (BENCHMARKS.md's checksum table), which took about a tenth
  off a local save's or load's CPU in an A/B (``local_disk_ab.json`` as of
  commit ``fe0916f``; BENCHMARKS.md, "The local disk at its limit");
* the ``crc32c`` package otherwise (a dependency): the hardware ``crc32`` loop.

``awscrt`` is not a dependency because its presence changes botocore: botocore
then signs every request with the CRT's signer, and boto3's transfer manager
(``upload_fileobj``, which MSC calls) switches to the CRT's S3 client on the
instance types AWS optimises for. That is the user's choice to make.

One pass over the bytes serves both the item and the file CRC. The writer
records a CRC32C per item and per data file. Feeding every byte to
two running CRCs costs two passes over the data; instead a large write is
checksummed once and its CRC is *appended* to the running CRCs with
:func:`crc32c_combine` -- the GF(2) polynomial arithmetic of zlib's
``crc32_combine``, for the Castagnoli polynomial (without zlib's period-32
shortcut, which holds only for CRC-32's polynomial). Combining costs
O(log n) 32-bit steps in Python (~tens of microseconds), so it only pays for
writes of about a MiB and more; smaller writes just update both CRCs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any

from typing_extensions import Buffer

_compute: Callable[[Any, int], int]
try:
    from awscrt import checksums as _crt

    _compute = _crt.crc32c
    #: The library :func:`crc32c` runs on (benchmark results record it).
    CRC32C_LIBRARY = "awscrt"
except ImportError:
    import crc32c as _crc32c_package

    _compute = _crc32c_package.crc32c
    CRC32C_LIBRARY = "crc32c"


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing a running ``crc``.

    ``data`` is any C-contiguous buffer (bytes, a memoryview of a tensor's
    storage, an mmap); the GIL is released while it is read.
    """
    return _compute(data, crc)


#: CRC-32C (Castagnoli), bit-reversed, as the hardware instruction uses it.
_POLY = 0x82F63B78
#: x^0 in the bit-reversed representation.
_ONE = 1 << 31


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (both bit-reversed)."""
    product = 0
    mask = _ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


#: Lengths up to 2**61 bytes (x^(8n) needs x^(2^k) for k < 64).
_TABLE_SIZE = 64


@cache
def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..63 (x^1 is ``1 << 30``).

    zlib keeps 32 entries and indexes them ``k & 31``: that relies on
    x^(2^32) = x modulo the CRC-32 polynomial. It does not hold for the
    Castagnoli polynomial, so every power a length needs gets its own entry.
    """
    table = [1 << 30]
    for _ in range(_TABLE_SIZE - 1):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


def _x8nmodp(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: shifting a CRC past n bytes."""
    if not 0 <= nbytes < 1 << (_TABLE_SIZE - 3):
        raise ValueError(f"cannot combine a CRC32C over {nbytes} bytes")
    table = _x2n_table()
    power = _ONE
    k = 3  # 8 * n = n << 3
    while nbytes:
        if nbytes & 1:
            power = _multmodp(table[k], power)
        nbytes >>= 1
        k += 1
    return power


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    return _multmodp(_x8nmodp(len_b), crc_a) ^ crc_b


#: Zeros to shift a CRC over (below :data:`_ZEROS_MAX` bytes, two hardware
#: CRC calls over zeros cost less than the polynomial arithmetic).
_ZEROS_MAX = 1 << 16
_ZEROS = memoryview(bytes(_ZEROS_MAX))


def crc32c_concat(parts: Iterable[tuple[int, int]]) -> int:
    """CRC32C of consecutive pieces from their ``(crc32c, length)``."""
    crc = 0
    for part_crc, length in parts:
        if length < _ZEROS_MAX:
            # crc(A + B) = crc(zeros(len B), crc(A)) ^ crc(zeros(len B)) ^ crc(B): CRCs are affine.
            zeros = _ZEROS[:length]
            crc = crc32c(zeros, crc) ^ crc32c(zeros) ^ part_crc
        else:
            crc = crc32c_combine(crc, part_crc, length)
    return crc


#: Writes at least this large are checksummed once and combined.
COMBINE_MIN = 1 << 20


class DualCrc:
    """Running CRC32Cs of the current item and of the whole file."""

    __slots__ = ("file", "item")

    def __init__(self) -> None:
        self.file = 0
        self.item = 0

    def start_item(self) -> None:
        """A new item starts here; the file CRC runs on."""
        self.item = 0

    def update(self, data: memoryview) -> int | None:
        """Append ``data`` to both CRCs; return its own CRC32C if a large
        write needed it anyway (None for small writes)."""
        if data.nbytes < COMBINE_MIN:
            self.item = crc32c(data, self.item)
            self.file = crc32c(data, self.file)
            return None
        crc: int = crc32c(data)
        self.append(crc, data.nbytes)
        return crc

    def append(self, crc: int, nbytes: int) -> None:
        """Append ``nbytes`` bytes whose own CRC32C is ``crc`` (computed by
        the caller, e.g. piece by piece while the bytes were in cache)."""
        if nbytes:
            self.item = crc32c_combine(self.item, crc, nbytes)
            self.file = crc32c_combine(self.file, crc, nbytes)


def file_and_span_crcs(
    read: Callable[[int, int], bytes], size: int, spans: Sequence[tuple[int, int]], chunk: int = 16 << 20
) -> tuple[int, list[int], int]:
    """Read a file of ``size`` bytes once, front to back, through
    ``read(offset, length)`` in ``chunk``-byte pieces, and return its CRC32C,
    the CRC32C of each ``(offset, length)`` span in it (in the order given),
    and how many bytes were read (less than ``size`` if a read came back
    empty). For a file another writer produced (NVRx), so that its manifest
    entries are computed from what is actually stored.
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    crcs = [0] * len(spans)
    file_crc = 0
    pos = first = 0  # spans before ``first`` (in offset order) end before ``pos``
    while pos < size:
        piece = memoryview(read(pos, min(chunk, size - pos)))
        if not piece:
            break
        file_crc = crc32c(piece, file_crc)
        end = pos + len(piece)
        while first < len(order) and sum(spans[order[first]]) <= pos:
            first += 1
        k = first
        while k < len(order) and spans[order[k]][0] < end:
            offset, length = spans[order[k]]
            lo, hi = max(pos, offset), min(end, offset + length)
            if lo < hi:
                crcs[order[k]] = crc32c(piece[lo - pos : hi - pos], crcs[order[k]])
            k += 1
        pos = end
    return file_crc, crcs, pos
