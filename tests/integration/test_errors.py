"""Bad input gets a clear dcpstore exception naming the URI or argument."""

from __future__ import annotations

import os

import pytest
import torch

import dcpstore
from dcpstore._impl.storage import join_uri, parse_uri, redact


def test_missing_checkpoint(tmp_path) -> None:
    uri = str(tmp_path / "nothing-here")
    with pytest.raises(dcpstore.CheckpointNotFound) as info:
        dcpstore.load({"a": torch.zeros(1)}, uri)
    assert uri in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_interrupted_save_is_reported_as_incomplete(tmp_path) -> None:
    root = tmp_path / "ck"
    dcpstore.save({"a": torch.ones(3)}, str(root)).result()
    os.unlink(root / ".metadata")
    with pytest.raises(dcpstore.CheckpointNotFound, match="interrupted save"):
        dcpstore.load({"a": torch.zeros(3)}, str(root))


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(dcpstore.InvalidURI, match="nosuchscheme"):
        dcpstore.save({"a": torch.ones(1)}, "nosuchscheme://x/y")


@pytest.mark.parametrize("uri", ["", "   ", "s3://", "s3:///key", "msc://", "s3:/bucket/x", "file://host/x", "a\x00b"])
def test_malformed_uris(uri: str) -> None:
    with pytest.raises(dcpstore.InvalidURI):
        dcpstore.save({"a": torch.ones(1)}, uri)


def test_credentials_in_uri_are_refused_and_not_echoed() -> None:
    with pytest.raises(dcpstore.InvalidURI) as info:
        parse_uri("s3://AKIAFAKE:SUPERSECRET@bucket/x")
    assert "SUPERSECRET" not in str(info.value) and "AKIAFAKE" not in str(info.value)
    assert "SUPERSECRET" not in redact("s3://AKIAFAKE:SUPERSECRET@bucket/x?X-Amz-Signature=abc")


def test_path_that_is_a_file(tmp_path) -> None:
    f = tmp_path / "plainfile"
    f.write_text("not a directory")
    with pytest.raises(dcpstore.SaveError) as info:
        dcpstore.save({"a": torch.ones(1)}, str(f))
    assert str(f) in str(info.value) and "file" in str(info.value)
    with pytest.raises(dcpstore.CheckpointNotFound):
        dcpstore.load({"a": torch.zeros(1)}, str(f))


@pytest.mark.parametrize("workers", [0, -1, 1.5, "4", True])
def test_bad_workers(tmp_path, workers) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="workers"):
        dcpstore.save({"a": torch.ones(1)}, str(tmp_path / "w"), workers=workers)


def test_state_dict_must_be_a_dict(tmp_path) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="state_dict"):
        dcpstore.save([torch.ones(1)], str(tmp_path / "x"))  # type: ignore[arg-type]


def test_unknown_engine(tmp_path) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="engine"):
        dcpstore.save({"a": torch.ones(1)}, str(tmp_path / "x"), engine="turbo")


def test_relative_and_file_uris_are_the_same_place(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    dcpstore.save({"a": torch.full((2,), 7.0)}, "rel/ck").result()
    out = {"a": torch.zeros(2)}
    dcpstore.load(out, f"file://{tmp_path}/rel/ck")
    assert torch.equal(out["a"], torch.full((2,), 7.0))


def test_join_uri_refuses_escapes() -> None:
    assert join_uri("s3://b/root", "step_1") == "s3://b/root/step_1"
    for bad in ["..", "../x", "a/../../b", "/abs", ""]:
        with pytest.raises(dcpstore.InvalidURI):
            join_uri("/tmp/root", bad)


def test_unwritable_location_names_the_cause(tmp_path) -> None:
    if os.geteuid() == 0:
        target = "/sys/dcpstore-ck"  # refused even to root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = str(ro / "ck")
    with pytest.raises(dcpstore.SaveError, match="permission denied") as info:
        dcpstore.save({"a": torch.ones(1)}, target)
    assert target in str(info.value)
