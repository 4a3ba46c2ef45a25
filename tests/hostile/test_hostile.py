"""Hostile checkpoints: crafted by an attacker, run against every tool.

Each case is a checkpoint directory someone could hand over: a ``.metadata``
whose pickle runs code, a fully checksum-valid checkpoint whose non-tensor
item runs code, sizes declared far beyond what a file holds (sparse files:
nothing on disk), malformed manifests and metadata, names that climb out of
the checkpoint, symlinks and FIFOs. Every case runs against ``load``, the
manager's ``load``, the CLI (``inspect`` with and without ``--json``,
``verify``, ``ls``, ``gc``) and a save over the crafted checkpoint; where it
is the point, stock DCP runs it too (the oracle the table in RELIABILITY.md
quotes). A payload writes a marker file: its absence is the assertion.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore._impl.dcp.reader import DcpStorageReader
from dcpstore._impl.manager import CheckpointManager, step_dir
from dcpstore.storage import open_storage
from tests.support.hostile_kit import (
    MANIFEST,
    METADATA,
    Payload,
    cli,
    declare,
    fresh,
    good,
    record_with_deflated_entry,
    replace_item,
    state,
    write_metadata,
)
from tests.support.rss import PEAK_MIB_SOURCE


def assert_untouched(marker: Path) -> None:
    assert not marker.exists(), "the checkpoint's payload ran"


def every_tool_refuses(ckpt: Path, marker: Path, match: str) -> None:
    """load, inspect (text and JSON), verify: a clear error, never the payload;
    ls and gc: fine, and the checkpoint is still there."""
    with pytest.raises(dcpstore.CheckpointError, match=match):
        dcpstore.load(fresh(), str(ckpt))
    assert_untouched(marker)
    for args in (["inspect", str(ckpt)], ["inspect", "--json", str(ckpt)]):
        code, out, err = cli(*args)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert_untouched(marker)
    code, out, err = cli("verify", "-q", str(ckpt))
    assert code == 1 and ("REFUSED" in out or "DAMAGED" in out) and "Traceback" not in out + err, out + err
    assert_untouched(marker)
    for args in (["ls", str(ckpt.parent)], ["gc", "--older-than", "0", str(ckpt.parent)]):
        assert cli(*args)[0] == 0
    assert (ckpt / METADATA).exists()
    assert_untouched(marker)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest-rewritten", "manifest-deleted"])
def test_metadata_payload_never_runs(tmp_path: Path, manifest: bool) -> None:
    ckpt, marker = good(tmp_path / "root" / "ck"), tmp_path / "pwned"
    md = pickle.loads((ckpt / METADATA).read_bytes())
    md.planner_data = Payload(marker)
    write_metadata(ckpt, md, manifest=manifest)
    every_tool_refuses(ckpt, marker, r"\.metadata holds class builtins\.exec")
    with pytest.raises(dcpstore.UnsafeCheckpoint, match="tools never unpickle"):
        dcpstore._impl.tools.maintenance.inspect_checkpoint(dcpstore.open_storage(str(ckpt)))
    # A save over the crafted checkpoint never reads it, and replaces it.
    dcpstore.save(state(), str(ckpt)).result()
    loaded = fresh()
    dcpstore.load(loaded, str(ckpt))
    assert torch.equal(loaded["w"], state()["w"]) and loaded["step"] == 5
    assert_untouched(marker)


def test_metadata_payload_through_the_manager(tmp_path: Path) -> None:
    root, marker = tmp_path / "run", tmp_path / "pwned"
    ckpt = good(root / step_dir(3))
    md = pickle.loads((ckpt / METADATA).read_bytes())
    md.planner_data = Payload(marker)
    write_metadata(ckpt, md)
    with CheckpointManager(str(root), async_=False) as manager:
        assert manager.all_steps() == [3]  # listing never reads content
        with pytest.raises(dcpstore.UnsafeCheckpoint, match="builtins.exec"):
            manager.load(fresh())
        assert_untouched(marker)
        manager.save(state(), 4)  # a save next to it, and retention, never read it either
    assert_untouched(marker)


def test_stock_dcp_runs_the_metadata_payload(tmp_path: Path) -> None:
    """The oracle: stock ``dcp.load`` executes it (pytorch issue #189308)."""
    ckpt, marker = good(tmp_path / "ck"), tmp_path / "pwned"
    md = pickle.loads((ckpt / METADATA).read_bytes())
    md.planner_data = Payload(marker)
    write_metadata(ckpt, md, manifest=False)
    with contextlib.suppress(Exception):
        dcp.load(fresh(), checkpoint_id=str(ckpt), no_dist=True)
    assert marker.read_text() == "pwned"


def test_trusted_is_an_explicit_opt_in(tmp_path: Path) -> None:
    ckpt, marker = good(tmp_path / "ck"), tmp_path / "pwned"
    md = pickle.loads((ckpt / METADATA).read_bytes())
    md.planner_data = Payload(marker)
    write_metadata(ckpt, md)
    dcpstore.load(fresh(), str(ckpt), trusted=True)
    assert marker.exists()  # what the caller asked for, and only then


def item_payload(tmp_path: Path) -> tuple[Path, Path]:
    """A fully checksum-valid checkpoint whose non-tensor item runs code:
    DCP's planner torch.saves the object, the payload rides along."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "root" / step_dir(1)
    dcpstore.save({**state(), "sched": Payload(marker)}, str(ckpt)).result()
    assert_untouched(marker)
    return ckpt, marker


def test_item_payload_never_runs(tmp_path: Path) -> None:
    ckpt, marker = item_payload(tmp_path)
    expected = "checkpoint item 'sched' holds class builtins.exec: pass safe_globals=.builtins.exec."
    with pytest.raises(dcpstore.UnsafeCheckpoint, match=expected):
        dcpstore.load({**fresh(), "sched": None}, str(ckpt))
    assert_untouched(marker)
    # Where the caller expected a tensor, the mismatch is found from .metadata
    # alone, before any item is read: the payload never runs either.
    with pytest.raises(dcpstore.StateDictMismatch, match="'sched': the checkpoint holds a non-tensor object"):
        dcpstore.load({**fresh(), "sched": torch.zeros(2)}, str(ckpt))
    assert_untouched(marker)
    # DCP's own load with our reader (no destination check) refuses it too.
    with pytest.raises(CheckpointException, match="UnsafeCheckpoint: " + expected):
        dcp.load(
            {**fresh(), "sched": torch.zeros(2)}, storage_reader=DcpStorageReader(open_storage(str(ckpt))), no_dist=True
        )
    assert_untouched(marker)
    with CheckpointManager(str(ckpt.parent), async_=False) as manager:
        with pytest.raises(dcpstore.UnsafeCheckpoint, match=expected):
            manager.load({**fresh(), "sched": None})
    code, out, err = cli("verify", "-q", str(ckpt))
    assert code == 1 and "REFUSED  checkpoint item 'sched' holds class builtins.exec" in out, out + err
    code, out, err = cli("inspect", "--json", str(ckpt))
    assert code == 0 and json.loads(out)["keys"]["sched"] == {"kind": "object"}
    assert cli("gc", "--older-than", "0", str(ckpt.parent))[0] == 0 and (ckpt / METADATA).exists()
    assert_untouched(marker)
    dcpstore.save(state(), str(ckpt)).result()  # a save over it
    assert_untouched(marker)


def test_stock_dcp_runs_the_item_payload(tmp_path: Path) -> None:
    ckpt, marker = item_payload(tmp_path)
    dcp.load({**fresh(), "sched": None}, checkpoint_id=str(ckpt), no_dist=True)
    assert marker.read_text() == "pwned"


# ---------------------------------------------------------------------------
# Memory amplification: sizes declared far beyond what a (sparse) file holds
# ---------------------------------------------------------------------------

_PEAKS = (
    PEAK_MIB_SOURCE
    + """
import contextlib, io, json, resource, sys, dcpstore, torch
from dcpstore._impl.cli import main
from dcpstore._impl.dcp.reader import DcpStorageReader
outcomes = {}
for name, action in json.loads(sys.argv[1]).items():
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(out):
            result = eval(action)
        outcomes[name] = f"returned {result!r}: {out.getvalue()}"
    except Exception as e:
        outcomes[name] = f"{type(e).__name__}: {e}"
outcomes["peak_mib"] = peak_mib()
print(json.dumps(outcomes))
"""
)
GiB = 1 << 30
#: Importing torch and dcpstore costs ~300 MiB here; one bomb that worked costs GiBs.
RSS_BOUND_MIB = 900


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every size bomb, each tool on it, all in one fresh interpreter (one
    torch import for all): the outcome of each, and the peak RSS of all."""
    root = tmp_path_factory.mktemp("bombs")
    tensor, blob = good(root / "tensor"), good(root / "bytes")
    declare(tensor, "b", 3 * GiB)  # a 4-element tensor declared as a 3 GiB item
    declare(blob, "step", 3 * GiB)  # a non-tensor item declared over a hole
    # Issue 29 item 8: compressed record entries, and transforms naming sizes.
    deflated_object, deflated_tensor = good(root / "deflated-object"), good(root / "deflated-tensor")
    replace_item(deflated_object, "step", record_with_deflated_entry(5, "data.pkl", 1024))
    replace_item(deflated_tensor, "b", record_with_deflated_entry(torch.ones(4), "data/0", 900))
    transformed_tensor, transformed_blob = good(root / "transformed-tensor"), good(root / "transformed-bytes")
    declare(transformed_tensor, "b", 3 * GiB, ["zstandard/1"])
    declare(transformed_blob, "step", GiB, ["zstandard/1"])
    sparse = {name: good(root / f"sparse{name}") for name in (METADATA, MANIFEST)}
    for name, ckpt in sparse.items():
        os.truncate(ckpt / name, 2 * GiB)
    actions = {
        "tensor load": f"dcpstore.load({{'b': torch.zeros(4)}}, {str(tensor)!r})",
        "tensor verify": f"main(['verify', '-q', {str(tensor)!r}])",
        "bytes load": f"dcpstore.load({{'step': 0}}, {str(blob)!r})",
        "deflated object load": f"dcpstore.load({{'step': 0}}, {str(deflated_object)!r})",
        "deflated object verify": f"main(['verify', '-q', {str(deflated_object)!r}])",
        "deflated tensor load": f"dcpstore.load({{'b': torch.zeros(4)}}, {str(deflated_tensor)!r})",
        "deflated tensor verify": f"main(['verify', '-q', {str(deflated_tensor)!r}])",
        "transformed tensor load": f"dcpstore.load({{'b': torch.zeros(4)}}, {str(transformed_tensor)!r})",
        "transformed tensor verify": f"main(['verify', '-q', {str(transformed_tensor)!r}])",
        "transformed bytes load": f"dcpstore.load({{'step': 0}}, {str(transformed_blob)!r})",
        "transformed bytes verify": f"main(['verify', '-q', {str(transformed_blob)!r}])",
    }
    for name, ckpt in sparse.items():
        for command in ("inspect", "verify"):
            actions[f"{name} {command}"] = f"main([{command!r}, {str(ckpt)!r}])"
        actions[f"{name} load"] = f"dcpstore.load({{'b': torch.zeros(4)}}, {str(ckpt)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", _PEAKS, json.dumps(actions)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    outcomes: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return outcomes


def test_size_bombs_never_allocate_what_they_declare(bombs: dict[str, Any]) -> None:
    assert bombs["peak_mib"] < RSS_BOUND_MIB, bombs


def test_tensor_declared_as_3_gib_item_is_refused_before_reading(bombs: dict[str, Any]) -> None:
    assert bombs["tensor load"].startswith("CheckpointCorrupt") and "declared" in bombs["tensor load"]
    assert bombs["tensor verify"].startswith("returned 1") and "DAMAGED" in bombs["tensor verify"]
    assert "declared" in bombs["tensor verify"]


def test_bytes_item_declared_over_a_hole_is_refused_before_reading(bombs: dict[str, Any]) -> None:
    assert bombs["bytes load"].startswith("CheckpointCorrupt"), bombs["bytes load"]
    assert "does not end as a torch.save record" in bombs["bytes load"]


@pytest.mark.parametrize("what", ["object", "tensor"])
def test_compressed_record_entries_are_refused_before_inflating(bombs: dict[str, Any], what: str) -> None:
    """Issue 29 item 8: a 1 KiB-per-MiB DEFLATE entry took load to 4.1 GiB
    and verify to 1.8 GiB. torch.save never compresses an entry."""
    load, verify = bombs[f"deflated {what} load"], bombs[f"deflated {what} verify"]
    assert load.startswith("CheckpointCorrupt") and "compressed (method 8)" in load, load
    assert verify.startswith("returned 1") and "DAMAGED" in verify and "compressed (method 8)" in verify, verify


def test_items_under_transforms_declared_over_a_hole_are_refused_before_reading(bombs: dict[str, Any]) -> None:
    """Issue 29 item 8: the declared-size check was skipped when transforms
    were named; a non-tensor item is decoded from its first bytes before it
    is read whole."""
    for action in ("transformed tensor load", "transformed tensor verify"):
        assert "declared 3221225472 bytes" in bombs[action] and "stream transforms" in bombs[action], bombs[action]
    for action in ("transformed bytes load", "transformed bytes verify"):
        assert "cannot be decoded with its stream transforms ['zstandard/1']" in bombs[action], bombs[action]


@pytest.mark.parametrize("name", [METADATA, MANIFEST])
def test_sparse_2_gib_commit_file_is_refused_before_reading(bombs: dict[str, Any], name: str) -> None:
    for command in ("inspect", "verify", "load"):
        outcome = bombs[f"{name} {command}"]
        assert "more than any real checkpoint's" in outcome and name in outcome, outcome
        assert "Traceback" not in outcome
