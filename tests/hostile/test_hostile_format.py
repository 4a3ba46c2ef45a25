"""Hostile checkpoints, part two: malformed manifests and metadata, names that
climb out of the checkpoint, symlinks and FIFOs.

The rule checked throughout: ``load``, ``verify`` and ``inspect`` share one
validation, so every malformed field is a :class:`CheckpointCorrupt` naming
the file and the field (never an ``AttributeError`` or a ``RecursionError``),
the CLI prints one line (never a traceback), and ``verify`` says OK exactly
when a load succeeds -- also for random damage (hypothesis).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpstore
from tests.support.hostile_kit import (
    MANIFEST,
    METADATA,
    cli,
    fresh,
    good,
    read_manifest,
    replace_data_files,
    state,
    write_metadata,
)


def load_ok(ckpt: Path) -> bool:
    try:
        dcpstore.load(fresh(), str(ckpt))
    except dcpstore.CheckpointError:
        return False
    return True


def verify_ok(ckpt: Path) -> bool:
    code, out, err = cli("verify", "-q", str(ckpt))
    assert "Traceback" not in out + err and code in (0, 1), (code, out, err)
    return code == 0


def _mutations() -> dict[str, tuple[Any, str]]:
    """name -> (change to the manifest dict, the field the error names)."""

    def first_file(m: dict[str, Any]) -> str:
        return sorted(m["files"])[0]

    def first_item(m: dict[str, Any]) -> str:
        return sorted(m["items"])[0]

    return {
        "items is a list": (lambda m: m.update(items=list(m["items"].items())), "items"),
        "tensors is a list": (lambda m: m.update(tensors=[1, 2]), "tensors"),
        "tensor entry is a str": (lambda m: m["tensors"].update({sorted(m["tensors"])[0]: "x"}), "tensors["),
        "tensor entry past its item": (
            lambda m: m["tensors"].update({sorted(m["tensors"])[0]: [0, 1 << 40]}),
            "tensor location",
        ),
        "item crc is a str": (lambda m: m["items"].update({first_item(m): "0"}), "items["),
        "item crc is wrong": (
            lambda m: m["items"].update({first_item(m): (m["items"][first_item(m)] + 1) % 2**32}),
            "checksum mismatch in item",
        ),
        "item of an unlisted file": (lambda m: m["items"].update({"__9_9.distcp@0": 1}), "items key"),
        "file size missing": (lambda m: m["files"][first_file(m)].pop("size"), ".size"),
        "file size negative": (lambda m: m["files"][first_file(m)].update(size=-1), ".size"),
        "file size a float": (lambda m: m["files"][first_file(m)].update(size=1.5), ".size"),
        "file size a bool": (lambda m: m["files"][first_file(m)].update(size=True), ".size"),
        "file crc too large": (lambda m: m["files"][first_file(m)].update(crc32c=2**40), ".crc32c"),
        "file entry a list": (lambda m: m["files"].update({first_file(m): [1, 2]}), "files["),
        "file climbs out": (lambda m: m["files"].update({"../outside.distcp": {"size": 1, "crc32c": 0}}), "files key"),
        "file is absolute": (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "crc32c": 0}}), "files key"),
        "files missing": (lambda m: m.pop("files"), "files"),
        "unknown format": (lambda m: m.update(format="dcpstore-manifest/9"), "format"),
        "metadata crc a str": (lambda m: m.update(metadata_crc32c="1"), "metadata_crc32c"),
    }


MUTATIONS = _mutations()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return good(tmp_path_factory.mktemp("pristine") / "ck")


def _copy(pristine: Path, where: Path) -> Path:
    shutil.copytree(pristine, where)
    return where


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_malformed_manifest_is_named_by_every_tool(pristine: Path, tmp_path: Path, name: str) -> None:
    ckpt = _copy(pristine, tmp_path / "ck")
    change, field = MUTATIONS[name]
    manifest = read_manifest(ckpt)
    change(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(dcpstore.CheckpointCorrupt) as info:
        dcpstore.load(fresh(), str(ckpt))
    assert field in str(info.value) and (MANIFEST in str(info.value) or ".distcp" in str(info.value)), info.value
    code, out, err = cli("verify", "-q", str(ckpt))
    assert code == 1 and "DAMAGED" in out and field in out, out + err
    code, out, err = cli("inspect", str(ckpt))
    assert code in (0, 2) and "Traceback" not in err and err.count("\n") <= 1, err


def test_deeply_nested_manifest_is_corrupt_not_a_recursion_error(pristine: Path, tmp_path: Path) -> None:
    ckpt = _copy(pristine, tmp_path / "ck")
    (ckpt / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(dcpstore.CheckpointCorrupt, match="nested too deeply"):
        dcpstore.load(fresh(), str(ckpt))
    for command in ("inspect", "verify"):
        code, out, err = cli(command, str(ckpt))
        assert code in (1, 2) and MANIFEST in out + err and "Traceback" not in out + err


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20))
    return st.recursive(
        scalars, lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=8), v, max_size=3), max_leaves=6
    )


def _paths(manifest: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(manifest, dict):
        for k, v in manifest.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(manifest, list):
        for i, v in enumerate(manifest):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_verify_says_ok_exactly_when_load_succeeds(pristine: Path, data: st.DataObject) -> None:
    """Random damage to the manifest: a value replaced, a key dropped or
    renamed. Load and verify never raise anything but a dcpstore error, and
    agree on whether the checkpoint is good."""
    manifest = read_manifest(pristine)
    path = data.draw(st.sampled_from(_paths(manifest)[1:]), label="where")
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "drop", "rename"]), label="action")
    if action == "replace":
        parent[path[-1]] = data.draw(_json_values(), label="value")
    elif isinstance(parent, dict):
        value = parent.pop(path[-1])
        if action == "rename":
            parent[data.draw(st.text(max_size=12), label="new key")] = value
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _copy(pristine, Path(tmp) / "ck")
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
        assert load_ok(ckpt) == verify_ok(ckpt), (path, action, manifest)


def _metadata_mutations() -> dict[str, tuple[Any, str]]:
    def storage_info(md: Any, fqn: str) -> Any:
        return next(info for index, info in md.storage_data.items() if index.fqn == fqn)

    def chunk(md: Any) -> Any:
        return md.state_dict_metadata["w"].chunks[0]

    return {
        "storage_data a list": (lambda md: setattr(md, "storage_data", list(md.storage_data.items())), "storage_data"),
        "relative_path climbs out": (
            lambda md: setattr(storage_info(md, "w"), "relative_path", "../../etc/passwd"),
            "relative_path",
        ),
        "relative_path absolute": (
            lambda md: setattr(storage_info(md, "w"), "relative_path", "/etc/passwd"),
            "relative_path",
        ),
        "offset negative": (lambda md: setattr(storage_info(md, "w"), "offset", -5), ".offset"),
        "length a str": (lambda md: setattr(storage_info(md, "w"), "length", "12"), ".length"),
        "chunk outside its tensor": (lambda md: setattr(chunk(md), "offsets", torch.Size([2, 0])), "chunks[0]"),
        "chunk of other rank": (lambda md: setattr(chunk(md), "sizes", torch.Size([3])), "chunks[0].sizes"),
        "dtype a str": (lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"), "dtype"),
        "entry a dict": (lambda md: md.state_dict_metadata.update(w={}), "state_dict_metadata['w']"),
        "chunk without storage": (
            lambda md: md.storage_data.__delitem__(next(i for i in md.storage_data if i.fqn == "w")),
            "no storage entry",
        ),
        "item larger than its tensor": (lambda md: setattr(storage_info(md, "w"), "length", 1 << 30), "declared"),
        "not Metadata": (lambda md: [md], "holds a list"),
    }


METADATA_MUTATIONS = _metadata_mutations()


@pytest.mark.parametrize("name", list(METADATA_MUTATIONS))
def test_malformed_metadata_is_named_by_every_tool(pristine: Path, tmp_path: Path, name: str) -> None:
    ckpt = _copy(pristine, tmp_path / "ck")
    change, field = METADATA_MUTATIONS[name]
    md = pickle.loads((ckpt / METADATA).read_bytes())
    replaced = change(md)
    write_metadata(ckpt, replaced if replaced is not None else md)
    with pytest.raises(dcpstore.CheckpointCorrupt) as info:
        dcpstore.load(fresh(), str(ckpt))
    assert field in str(info.value) and METADATA in str(info.value), info.value
    code, out, err = cli("verify", "-q", str(ckpt))
    assert code == 1 and field in out, out + err
    code, out, err = cli("inspect", "--json", str(ckpt))
    assert code == 2 and field in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------
# Names, symlinks, FIFOs
# ---------------------------------------------------------------------------


def test_symlinked_data_file_is_never_written_through(tmp_path: Path) -> None:
    """A checkpoint whose data file is a symlink to a file elsewhere: a save
    over it replaces the link, gc removes links not targets."""
    ckpt = good(tmp_path / "root" / "ck")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    replace_data_files(ckpt, lambda path: os.symlink(victim, path))
    (ckpt / "__7_7.distcp").symlink_to(victim)  # a stale data file the next commit deletes
    dcpstore.save(state(), str(ckpt)).result()
    assert victim.read_bytes() == b"precious"
    assert not any((ckpt / n).is_symlink() for n in os.listdir(ckpt))
    loaded = fresh()
    dcpstore.load(loaded, str(ckpt))
    assert torch.equal(loaded["w"], state()["w"])
    # An uncommitted directory of links: gc removes the links, not their targets.
    wreck = tmp_path / "root" / "wreck"
    wreck.mkdir()
    (wreck / "__0_0.distcp").symlink_to(victim)
    assert cli("gc", "--older-than", "0", str(tmp_path / "root"))[0] == 0
    assert not (wreck / "__0_0.distcp").is_symlink() and victim.read_bytes() == b"precious"


def test_symlinked_directory_is_not_followed_by_gc(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_bytes(b"someone else's")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    assert cli("gc", "--older-than", "0", str(root))[0] == 0
    assert (outside / "__0_0.distcp").read_bytes() == b"someone else's"


_SPECIAL_CHILD = """
import contextlib, io, json, sys, dcpstore, torch
from dcpstore._impl.cli import main
out = {}
for ckpt in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes = [main(["inspect", ckpt]), main(["verify", ckpt])]
    try:
        dcpstore.load({"w": torch.zeros(3, 4)}, ckpt)
        outcome = "loaded"
    except dcpstore.CheckpointError as e:
        outcome = f"{type(e).__name__}: {e}"
    out[ckpt] = [codes, outcome]
print(json.dumps(out))
"""
SPECIALS = [(s, w) for s in ("fifo", "dev-zero") for w in ("data", "data-no-manifest", "metadata")]


@pytest.fixture(scope="module")
def specials(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Checkpoints whose data files or .metadata are FIFOs or /dev/zero, every
    tool run on each in one child with a timeout (a hang fails the test)."""
    root = tmp_path_factory.mktemp("specials")
    paths = {}
    for special, which in SPECIALS:
        ckpt = good(root / f"{special}-{which}")
        targets = [n for n in os.listdir(ckpt) if n.endswith(".distcp")] if which != "metadata" else [METADATA]
        if which == "data-no-manifest":  # a stock-DCP-like checkpoint: nothing to compare sizes with
            os.unlink(ckpt / MANIFEST)
        for name in targets:
            os.unlink(ckpt / name)
            if special == "fifo":
                os.mkfifo(ckpt / name)
            else:
                os.symlink("/dev/zero", ckpt / name)
        paths[(special, which)] = str(ckpt)
    proc = subprocess.run(
        [sys.executable, "-c", _SPECIAL_CHILD, json.dumps(list(paths.values()))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {key: results[path] for key, path in paths.items()}


@pytest.mark.parametrize("special,which", SPECIALS)
def test_special_files_are_refused_not_read(specials: dict[tuple[str, str], Any], special: str, which: str) -> None:
    """A FIFO blocks whoever opens it; /dev/zero never ends. Neither is read:
    a size check comes first."""
    codes, outcome = specials[(special, which)]
    if which.startswith("data"):
        assert codes == [0, 1] and outcome.startswith("CheckpointCorrupt") and "missing" in outcome, outcome
    else:
        assert codes == [1, 1] and outcome.startswith("CheckpointNotFound"), outcome
