"""SaveOptions: one value, validated once, passed down by every layer.

dcpstore.save, AsyncSaver.save, CheckpointManager and CheckpointConfig all
build (or take) one SaveOptions and hand it down; these tests check that a
bad value is refused on construction naming the option, that the manager and
the config hold the same value the saves run with, and that validating a
config opens no storage (it used to build a boto3 client to check a URI).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.values.options import LoadOptions, SaveOptions
from dcpstore.adapters.megatron import CheckpointConfig
from dcpstore.storage import Storage


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"async_": 1}, "async_ must be a bool"),
        ({"engine": "turbo"}, "engine must be one of auto, native, nvrx"),
        ({"engine": ["native"]}, "engine must be one of"),
        ({"workers": 0}, "workers must be a positive int"),
        ({"workers": True}, "workers must be a positive int"),
        ({"max_in_flight": 0}, "max_in_flight must be a positive int"),
        ({"process_group": object()}, "process_group was given but torch.distributed is not initialised"),
    ],
)
def test_bad_options_are_refused_on_construction(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=needle):
        SaveOptions(**kwargs)


def test_options_are_frozen_values() -> None:
    options = SaveOptions(async_=True, workers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.workers = 3  # type: ignore[misc]
    assert options == SaveOptions(async_=True, workers=2)
    assert options.for_load() == LoadOptions(workers=2)
    assert set(options.as_kwargs()) <= set(inspect.signature(dcpstore.save).parameters)  # save's own keywords


def test_the_manager_saves_with_the_options_it_holds(tmp_path: Path) -> None:
    options = SaveOptions(async_=False, engine="native", workers=2)
    mgr = dcpstore.CheckpointManager(str(tmp_path / "run"), keep=1, options=options)
    assert mgr.options is options and mgr.async_ is False and mgr.engine == "native"
    info = mgr.save({"w": torch.ones(4)}, 1).result()
    assert info.engine == "sync" and mgr.all_steps() == [1]
    mgr.close()
    with pytest.raises(dcpstore.InvalidArgument, match=r"async_=False and options\.async_=True disagree; pass it once"):
        dcpstore.CheckpointManager(
            str(tmp_path / "run"), async_=False, options=dataclasses.replace(options, async_=True)
        )
    # One id for every step would collide with itself on the first overwrite.
    fixed = dataclasses.replace(options, save_id="0123456789abcdef")
    with pytest.raises(dcpstore.InvalidArgument, match="save_id='0123456789abcdef'.*own id"):
        dcpstore.CheckpointManager(str(tmp_path / "run"), options=fixed)


@pytest.mark.parametrize("bad", ["short", "0123456789ABCDEF", 123, "../../../etc/passwd0"])
def test_a_save_id_must_have_the_form_files_are_named_by(bad: object) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="save_id must be None or 16 lowercase hex digits"):
        SaveOptions(save_id=bad)  # type: ignore[arg-type]


def test_the_config_hands_its_options_to_the_manager(tmp_path: Path) -> None:
    cfg = CheckpointConfig(
        save=str(tmp_path / "run"), async_save=True, options=SaveOptions(engine="native"), dist_ckpt_workers=3
    )
    mgr = cfg.manager()
    assert mgr.options == cfg.save_options() == SaveOptions(async_=True, engine="native", workers=3)
    assert cfg.save_kwargs() == {"async_": True, "workers": 3, "enable_msc": False, "engine": "native"}
    mgr.close()


def test_validating_a_config_opens_no_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Storage, *args: object, **kwargs: object) -> None:
        raise AssertionError("CheckpointConfig opened a storage to validate itself")

    monkeypatch.setattr(Storage, "__init__", refuse)
    CheckpointConfig(
        save="s3://bucket/run", load="s3://bucket/run", options=SaveOptions(engine="native"), async_save=True
    )
    with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.options\.engine: "):
        CheckpointConfig(save="s3://bucket/run", options=SaveOptions(engine="nvrx"))
