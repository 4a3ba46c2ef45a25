"""Real model sizes (slow run): a 600 MiB tensor, a 2.2 GiB one, a 4.1 GiB one.

600 MiB is past 2^29 bytes, where the old CRC32C combine went wrong (no item
of 512 MiB or more could be loaded back); 2.2 GiB is past 2^31, where 32-bit
sizes, offsets and single-call I/O limits (a pread returns at most
0x7ffff000 bytes) break; 4.1 GiB is past 2^32 (zip64 offsets, 32-bit
unsigned sizes). The first two round-trip on the local backend with every
engine and on S3 (moto) with the native engine, the third with a sync save
on the local backend (what this machine's memory affords), and
``dcpstore verify`` says OK. Every size is odd (not a multiple of 1 MiB).

Memory: a test holds the source and, for async saves, one staging copy
(a private AsyncSaver with no staging cache, closed after the save); the
source is dropped before the load, whose destination is compared block by
block against the regenerated pattern, never against a second full copy.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl import cli
from dcpstore._impl.tools import maintenance
from dcpstore.storage import MiB, StorageOptions
from tests.support.backends import Target, make_target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SIZES = {"600MiB": 600 * MiB + 12_345, "2.2GiB": (int(2.2 * 1024) * MiB) + 54_321}
PAST_4_GIB = (int(4.1 * 1024) * MiB) + 777
_BLOCK_SEED = 11


def _block() -> torch.Tensor:
    g = torch.Generator().manual_seed(_BLOCK_SEED)
    return torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=g)


def _expected(first: int, count: int, block: torch.Tensor) -> torch.Tensor:
    """Blocks ``first .. first+count-1`` of the pattern: the random block,
    each copy stamped with its index in its first 8 bytes (so a block read
    from the wrong place cannot pass)."""
    rows = block.expand(count, MiB).clone()
    rows[:, :8] = torch.arange(first, first + count, dtype=torch.int64).view(torch.uint8).view(count, 8)
    return rows


def _pattern(n: int) -> torch.Tensor:
    block, full = _block(), n // MiB
    t = torch.empty(n, dtype=torch.uint8)
    rows = t[: full * MiB].view(full, MiB)
    for first in range(0, full, 64):
        count = min(64, full - first)
        rows[first : first + count] = _expected(first, count, block)
    t[full * MiB :] = block[: n - full * MiB]
    return t


def _assert_pattern(t: torch.Tensor, n: int) -> None:
    assert t.dtype == torch.uint8 and t.numel() == n
    block, full = _block(), n // MiB
    rows = t[: full * MiB].view(full, MiB)
    for first in range(0, full, 64):
        count = min(64, full - first)
        assert torch.equal(rows[first : first + count], _expected(first, count, block)), f"blocks from {first}"
    assert torch.equal(t[full * MiB :], block[: n - full * MiB]), "tail"


def _save(engine: str, state: dict[str, Any], target: Target) -> None:
    if engine == "sync":
        dcpstore.save(state, target.uri, **target.kwargs).result()
        return
    with dcpstore.AsyncSaver(staging_cache=0) as saver:  # keeps no staging copy afterwards
        saver.save(state, target.uri, options=target.save_options(engine=engine)).result(timeout=1200)


def _verify_cli(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    """``dcpstore verify URI``, run in this process (a fresh interpreter
    would spend longer importing torch than verifying)."""
    capsys.readouterr()
    code = cli.main(["verify", target.uri])
    out = capsys.readouterr()
    assert code == 0 and "OK" in out.out, out.out + out.err


def _round_trip(
    engine: str, target: Target, n: int, capsys: pytest.CaptureFixture[str], *, cli_verify: bool = True
) -> None:
    state: dict[str, Any] = {"big": _pattern(n), "small": torch.arange(10), "step": 3}
    _save(engine, state, target)
    del state
    gc.collect()
    dest: dict[str, Any] = {
        "big": torch.zeros(n, dtype=torch.uint8),
        "small": torch.zeros(10, dtype=torch.int64),
        "step": None,
    }
    dcpstore.load(dest, target.uri, **target.kwargs)
    _assert_pattern(dest["big"], n)
    assert torch.equal(dest["small"], torch.arange(10)) and dest["step"] == 3
    del dest
    gc.collect()
    if cli_verify:
        _verify_cli(target, capsys)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("engine", ["sync", "native", "nvrx"])
def test_large_tensor_round_trips_on_local(
    local_target: Target, engine: str, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if engine == "nvrx":
        pytest.importorskip("nvidia_resiliency_ext")
    _round_trip(engine, local_target, SIZES[size], capsys)


def test_tensor_past_4_gib_round_trips_on_local_sync(local_target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    _round_trip("sync", local_target, PAST_4_GIB, capsys)


@pytest.mark.parametrize("size", list(SIZES))
def test_large_tensor_round_trips_on_s3_native(
    request: pytest.FixtureRequest, size: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # moto answers every ranged GET by reading the whole object into memory
    # first (a real S3 serves a range in O(range)): with the usual 8-64 MiB
    # ranges, 8 at a time, a 2.2 GiB object costs minutes and ~20 GB in the
    # moto process. Few large ranges, two at a time, keep it to about a
    # minute and a few GB. The load verifies every item's CRC32C and every
    # file's size as it reads; ``dcpstore verify`` (sequential ranges, each
    # a whole-object copy in moto) runs on the 600 MiB object here and on
    # both sizes on the local backend.
    monkeypatch.setattr(maintenance, "VERIFY_CHUNK", 256 * MiB)
    target = make_target("s3", request)
    target.kwargs["storage_options"] = StorageOptions(
        part_size=256 * MiB, max_concurrency=2, max_attempts=5, read_timeout_s=300.0, op_timeout_s=900.0
    )
    _round_trip("native", target, SIZES[size], capsys, cli_verify=SIZES[size] < 1 << 30)


@pytest.mark.parametrize("size", list(SIZES))
def test_verify_of_a_large_stock_dcp_checkpoint(
    local_target: Target, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint written by stock ``dcp.save`` has no checksums; ``dcpstore
    verify`` decodes every item, a large tensor record included, and says so."""
    n = SIZES[size]
    state: dict[str, Any] = {"big": _pattern(n), "small": torch.arange(10), "step": 3}
    dcp.save(state, checkpoint_id=local_target.uri, no_dist=True)
    del state
    gc.collect()
    capsys.readouterr()
    code = cli.main(["verify", "-q", local_target.uri])
    out = capsys.readouterr().out
    assert (
        code == 0
        and out.startswith("OK")
        and "no checksums (written by stock DCP, or its integrity manifest is gone)" in out
    ), out
