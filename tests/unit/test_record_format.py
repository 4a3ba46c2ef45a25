"""The CRC-free torch.save records and the one-pass item/file CRC32C."""

from __future__ import annotations

import io
import os
import random
import zipfile

import crc32c
import pytest
import torch

from dcpstore._impl.format import record as torch_save
from dcpstore._impl.util.checksum import COMBINE_MIN, DualCrc, crc32c_combine


@pytest.mark.parametrize("seed", range(5))
def test_combine_equals_crc_of_concatenation(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.choice([0, 1, 7, rng.randrange(0, 70000)]))
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_dual_crc_matches_both_running_crcs_across_the_threshold() -> None:
    parts = [os.urandom(n) for n in (3, COMBINE_MIN - 1, COMBINE_MIN, 17, 2 * COMBINE_MIN + 5)]
    dual = DualCrc()
    dual.update(memoryview(b"head"))
    dual.item = 0  # a new item starts; the file CRC runs on
    for part in parts:
        dual.update(memoryview(part))
    assert dual.item == crc32c.crc32c(b"".join(parts))
    assert dual.file == crc32c.crc32c(b"head" + b"".join(parts))


def test_this_torch_gets_the_crc_free_writer() -> None:
    # If a torch release moves the private writer API this fails, telling us
    # saves fell back to torch.save (correct, but ~2x slower).
    assert torch_save.record_saver() is torch_save.save_without_crc


@pytest.mark.parametrize(
    "tensor", [torch.randn(3, 5), torch.arange(10, dtype=torch.int64)[2:7].clone(), torch.empty(0)]
)
def test_record_loads_with_stock_torch_load_and_carries_no_zip_crc(tensor: torch.Tensor) -> None:
    buf = io.BytesIO()
    torch_save.save_record(tensor, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        data = [i for i in zf.infolist() if "/data/" in i.filename]
        assert data and all(i.CRC == 0 for i in data)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True), tensor)
    # Byte for byte what torch.save writes with its (process-global) CRC-32
    # switch off: the format is torch's own. With the switch on, the CRC
    # fields and the serialization id derived from them differ.
    plain = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(tensor, plain)
    finally:
        torch.serialization.set_crc32_options(True)
    assert plain.getvalue() == buf.getvalue()


def test_large_writes_go_out_in_pieces_with_the_crcs_of_the_bytes_stored(tmp_path: object) -> None:
    # Tensors around the combine threshold and the piece size, a view of a
    # larger storage (not lent: torch writes it from a copy) and a bytes
    # item: each item's CRC32C and the file's are those of what the file holds.
    from dcpstore.storage import open_storage

    piece = torch_save.RecordStream.PIECE
    items: list[io.BytesIO | torch.Tensor] = [
        torch.randn(COMBINE_MIN // 4 - 3),
        torch.randint(0, 255, (2 * piece + 13,), dtype=torch.uint8),
        io.BytesIO(os.urandom(70_000)),
        torch.randn(piece // 4),
        torch_save.compact_cpu_tensor(torch.randn(3 * piece // 4)[5:]),
    ]
    storage = open_storage(str(tmp_path))
    with storage.open_write("data") as writer:
        stream = torch_save.RecordStream(writer)
        written = [stream.write_item(item) for item in items]
        size, file_crc = stream.finish()
    stored = storage.read("data")
    assert size == len(stored) and file_crc == crc32c.crc32c(stored)
    for item, w in zip(items, written, strict=True):
        body = stored[w.offset : w.offset + w.length]
        assert w.crc32c == crc32c.crc32c(body)
        if isinstance(item, io.BytesIO):
            assert body == item.getvalue()
        else:
            assert torch.equal(torch_save.item_tensor(memoryview(body)), item)
            assert w.raw is not None
            assert body[w.raw[0] : w.raw[0] + w.raw[1]] == item.numpy().tobytes()
