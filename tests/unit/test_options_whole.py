"""One options value, one way to pass each option per entry point.

``dcpstore.save`` / ``load`` take each option as a keyword (and no
``options=``); ``AsyncSaver.save``, ``CheckpointManager``, the drop-in
``StorageWriter`` / ``StorageReader`` and Megatron's ``CheckpointConfig``
take the options whole, as ``options=``, plus only what is theirs (and the
names of the framework they stand in for). What must hold: the options
passed whole do what the keywords do; an option passed the other way is a
``TypeError`` saying how to pass it (nothing is deprecated: 0.1.0 is the
first release); a framework's name that disagrees with the options is an
``InvalidArgument`` naming both; and
``enable_msc`` with ``storage_options`` is one value (``StorageOptions``),
as ``spread_prefixes`` is now a save option.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import dcpstore
from dcpstore import LoadOptions, SaveOptions, StorageOptions
from dcpstore._impl.engines.saver import AsyncSaver, default_saver
from dcpstore.adapters.megatron import CheckpointConfig

TUNED = StorageOptions(max_attempts=3)
MSC = StorageOptions(enable_msc=True)


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "b": torch.arange(8.0) * value, "step": 3}


def _loads(uri: str, value: float, **kwargs: Any) -> None:
    out = {"w": torch.zeros(64), "b": torch.zeros(8), "step": 0}
    dcpstore.load(out, uri, **kwargs)
    assert torch.equal(out["w"], torch.full((64,), value)) and out["step"] == 3


def _data_files(uri: str) -> list[str]:
    return sorted(o["path"] for o in dcpstore.open_storage(uri).list() if o["path"].endswith(".distcp"))


# -- the options whole do what the keywords do ------------------------------------


def test_save_and_load_take_every_option_as_a_keyword(tmp_path: Path) -> None:
    whole, keywords = str(tmp_path / "whole"), str(tmp_path / "keywords")
    options = SaveOptions(engine="native", workers=2, overwrite=False, spread_prefixes=4)
    with AsyncSaver() as saver:
        a = saver.save(_state(), whole, options=options).result()
    b = dcpstore.save(_state(), keywords, engine="native", workers=2, overwrite=False, spread_prefixes=4).result()
    assert a.files == b.files and all(f.startswith("p0/__0_") for f in a.files), (a.files, b.files)
    assert _data_files(whole) == _data_files(keywords)
    for uri in (whole, keywords):
        with pytest.raises(dcpstore.CheckpointExists):
            dcpstore.save(_state(2.0), uri, **options.as_kwargs())  # a SaveOptions held, passed to save
        _loads(uri, 1.0, workers=2, verify=True)


@pytest.mark.parametrize("call", [dcpstore.save, dcpstore.load], ids=["save", "load"])
def test_save_and_load_take_no_options_whole(tmp_path: Path, call: Callable[..., Any]) -> None:
    with pytest.raises(
        TypeError,
        match=rf"^{call.__name__}\(\) got an unexpected keyword argument 'options': "
        rf"dcpstore\.{call.__name__} takes each option as a keyword",
    ):
        call(_state(), str(tmp_path / "c"), options=SaveOptions())


def test_the_async_saver_takes_the_options_whole(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    with AsyncSaver() as saver:
        # A saver's saves run in the background whatever options.async_ says.
        info = saver.save(_state(), uri, options=SaveOptions(engine="native", workers=2, overwrite=False)).result()
        assert info.engine == "native" and len(info.files) == 2  # a file per writer thread
        with pytest.raises(dcpstore.CheckpointExists):
            saver.save(_state(2.0), uri, options=SaveOptions(engine="native", overwrite=False)).result()
    _loads(uri, 1.0)


def test_the_manager_takes_the_options_whole(tmp_path: Path) -> None:
    options = SaveOptions(async_=True, engine="native", workers=2, spread_prefixes=2)
    with dcpstore.CheckpointManager(str(tmp_path / "run"), keep=1, options=options) as mgr:
        assert mgr.options is options
        handle = mgr.save(_state(), 1)
        info = handle.result()
        assert info.engine == "native" and all(f.startswith("p0/") for f in info.files), info.files
        mgr.save(_state(2.0), 2)
        mgr.wait()
        assert mgr.all_steps() == [2]
    # The manager's own async_ fills what the options leave at their default.
    with dcpstore.CheckpointManager(str(tmp_path / "run"), async_=True, options=SaveOptions(engine="native")) as mgr:
        assert mgr.options == SaveOptions(async_=True, engine="native")


def test_the_drop_ins_take_the_options_whole(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    writer = dcpstore.StorageWriter(
        uri, options=SaveOptions(workers=3, spread_prefixes=4, overwrite=False, storage_options=TUNED)
    )
    assert (writer.workers, writer.spread_prefixes, writer.overwrite) == (3, 4, False)
    assert writer.storage.options == TUNED
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert _data_files(uri) and all(f.startswith("p0/") for f in _data_files(uri))
    reader = dcpstore.StorageReader(
        uri, options=LoadOptions(workers=2, verify=False, trusted=True, storage_options=TUNED)
    )
    assert (reader.workers, reader.verify, reader.storage.options) == (2, False, TUNED)
    out = {"w": torch.zeros(64), "b": torch.zeros(8), "step": 0}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], torch.full((64,), 1.0))
    # FileSystemWriter's own names stay: thread_count is options.workers.
    assert dcpstore.StorageWriter(uri, thread_count=2, options=SaveOptions(spread_prefixes=4)).workers == 2


REFUSED: list[tuple[Callable[..., Any], Any, str]] = [
    (
        dcpstore.StorageWriter,
        SaveOptions(planner=DefaultSavePlanner()),
        r"options\.planner=.* pass planner= to dcp\.save",
    ),
    (dcpstore.StorageWriter, SaveOptions(progress=True), r"options\.progress=True"),
    (dcpstore.StorageWriter, SaveOptions(engine="nvrx"), r"options\.engine='nvrx'"),
    (dcpstore.StorageWriter, SaveOptions(save_id="0123456789abcdef"), r"options\.save_id="),
    (dcpstore.StorageWriter, LoadOptions(), r"options must be a dcpstore\.SaveOptions"),
    (
        dcpstore.StorageReader,
        LoadOptions(planner=DefaultLoadPlanner()),
        r"options\.planner=.* pass planner= to dcp\.save / dcp\.load",
    ),
    (dcpstore.StorageReader, SaveOptions(), r"options must be a dcpstore\.LoadOptions"),
]


@pytest.mark.parametrize(
    ("cls", "options", "named"), REFUSED, ids=[f"{r[0].__name__}-{i}" for i, r in enumerate(REFUSED)]
)
def test_the_drop_ins_refuse_what_dcps_call_decides(
    tmp_path: Path, cls: Callable[..., Any], options: Any, named: str
) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=named):
        cls(str(tmp_path), options=options)


def test_the_config_takes_the_options_whole(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    options = SaveOptions(engine="native", storage_options=TUNED)
    cfg = CheckpointConfig(save=root, async_save=True, dist_ckpt_workers=2, options=options)
    want = SaveOptions(async_=True, engine="native", workers=2, storage_options=TUNED)
    assert cfg.options == cfg.save_options() == want
    # Bridge's fields read what the saves run with, whichever spelled it.
    from_options = CheckpointConfig(save=root, options=SaveOptions(async_=True, workers=2))
    assert (from_options.async_save, from_options.dist_ckpt_workers) == (True, 2)
    with cfg.manager() as mgr:
        assert mgr.options == want
        mgr.save(_state(), 1)
    _loads(f"{root}/step_00000001", 1.0)
    assert cfg.save_kwargs()["storage_options"] == TUNED and cfg.load_kwargs()["storage_options"] == TUNED


def test_enable_msc_is_where_the_storage_options_say(tmp_path: Path) -> None:
    """The MSC choice and the tuning are one value: the keyword shortcut
    folds into it, and every entry point reads it from there."""
    uri = str(tmp_path / "c")
    assert dcpstore.open_storage(uri, enable_msc=True).backend == "msc"
    assert dcpstore.open_storage(uri, storage_options=MSC).backend == "msc"
    folded = dcpstore.open_storage(uri, enable_msc=True, storage_options=TUNED)
    assert folded.backend == "msc" and folded.options == StorageOptions(max_attempts=3, enable_msc=True)
    assert SaveOptions(storage_options=MSC).enable_msc and not SaveOptions().enable_msc
    info = dcpstore.save(_state(), uri, enable_msc=True).result()
    assert info.backend == "msc"
    assert dcpstore.StorageWriter(uri, options=SaveOptions(storage_options=MSC)).storage.backend == "msc"
    _loads(uri, 1.0, storage_options=MSC)
    with pytest.raises(dcpstore.InvalidArgument, match="enable_msc must be a bool"):
        StorageOptions(enable_msc=1)  # type: ignore[arg-type]


# -- an option passed as a keyword where the options are taken whole ---------------


@pytest.fixture
def saver() -> Iterator[AsyncSaver]:
    with AsyncSaver() as s:
        yield s


ONE_WAY: list[tuple[str, Callable[[Path], Any], str]] = [
    (
        "AsyncSaver.save",
        lambda p: default_saver().save(_state(), str(p), engine="native"),
        r"^AsyncSaver\.save\(\) got an unexpected keyword argument 'engine': pass options=dcpstore\.SaveOptions\(engine=\.\.\.\)$",
    ),
    (
        "CheckpointManager",
        lambda p: dcpstore.CheckpointManager(str(p), workers=2),
        r"^CheckpointManager\.__init__\(\) got an unexpected keyword argument 'workers': "
        r"pass options=dcpstore\.SaveOptions\(async_=True, workers=\.\.\.\)$",
    ),
    (
        "StorageWriter",
        lambda p: dcpstore.StorageWriter(str(p), storage_options=TUNED),
        r"^StorageWriter\.__init__\(\) got an unexpected keyword argument 'storage_options': "
        r"pass options=dcpstore\.SaveOptions\(storage_options=\.\.\.\)$",
    ),
    (
        "StorageReader",
        lambda p: dcpstore.StorageReader(str(p), verify=False),
        r"^StorageReader\.__init__\(\) got an unexpected keyword argument 'verify': pass options=dcpstore\.LoadOptions\(verify=\.\.\.\)$",
    ),
    (
        "CheckpointConfig.from_bridge",
        lambda p: CheckpointConfig.from_bridge({}, engine="native"),
        r"^CheckpointConfig\.from_bridge\(\) got an unexpected keyword argument 'engine': pass options=dcpstore\.SaveOptions\(engine=\.\.\.\)$",
    ),
]


@pytest.mark.parametrize(("entry", "call", "match"), ONE_WAY, ids=[c[0] for c in ONE_WAY])
def test_an_option_as_a_keyword_is_a_type_error_saying_how_to_pass_it(
    tmp_path: Path, entry: str, call: Callable[[Path], Any], match: str
) -> None:
    """One way per entry point: an entry point that takes the options whole
    takes none of them as a keyword (and nothing is deprecated: 0.1.0 is
    the first release)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(TypeError, match=match):
            call(tmp_path / "c")


def test_an_unknown_keyword_is_named_with_its_fix(tmp_path: Path, saver: AsyncSaver) -> None:
    with pytest.raises(
        TypeError,
        match=r"^AsyncSaver\.save\(\) got an unexpected keyword argument 'workes': "
        r"did you mean 'workers'\? pass options=dcpstore\.SaveOptions\(workers=\.\.\.\)",
    ):
        saver.save(_state(), str(tmp_path / "c"), workes=2)
    with pytest.raises(
        TypeError,
        match=r"^StorageWriter\.__init__\(\) got an unexpected keyword argument 'thread_cont': "
        r"did you mean 'thread_count'\?",
    ):
        dcpstore.StorageWriter(str(tmp_path), thread_cont=2)
    with pytest.raises(
        TypeError, match=r"'spread_prefixes': pass options=dcpstore\.SaveOptions\(spread_prefixes=\.\.\.\)"
    ):
        saver.save(_state(), str(tmp_path / "c"), spread_prefixes=2)


# -- a keyword that disagrees with the options: refused, naming both ------------------

CONFLICTS: list[tuple[str, Callable[[Path], Any], str]] = [
    (
        "CheckpointManager",
        lambda p: dcpstore.CheckpointManager(str(p), async_=False, options=SaveOptions(async_=True)),
        r"^CheckpointManager: async_=False and options\.async_=True disagree",
    ),
    (
        "StorageWriter",
        lambda p: dcpstore.StorageWriter(str(p), thread_count=2, options=SaveOptions(workers=3)),
        r"^StorageWriter: thread_count=2 and options\.workers=3 disagree",
    ),
    (
        "StorageReader",
        lambda p: dcpstore.StorageReader(str(p), thread_count=2, options=LoadOptions(workers=3)),
        r"^StorageReader: thread_count=2 and options\.workers=3 disagree",
    ),
    (
        "CheckpointConfig",
        lambda p: CheckpointConfig(save=str(p), dist_ckpt_workers=2, options=SaveOptions(workers=3)),
        r"^CheckpointConfig\.options: dist_ckpt_workers=2 and options\.workers=3 disagree",
    ),
    (
        "CheckpointConfig.save_options",
        lambda p: CheckpointConfig(options=SaveOptions(storage_options=TUNED)).save_options(
            storage_options=StorageOptions()
        ),
        r"^CheckpointConfig\.save_options: storage_options=.* and options\.storage_options=.* disagree",
    ),
    (
        "AsyncSaver.save, wrong type",
        lambda p: default_saver().save(_state(), str(p), options=LoadOptions()),  # type: ignore[arg-type]
        r"^AsyncSaver\.save: options must be a dcpstore\.SaveOptions",
    ),
]


@pytest.mark.parametrize(("entry", "call", "match"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_a_keyword_that_disagrees_with_the_options_is_refused_naming_both(
    tmp_path: Path, entry: str, call: Callable[[Path], Any], match: str
) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        call(tmp_path / "c")


# -- a bad value is named as the caller spelt it -------------------------------------

#: Entry points that take an option under a keyword of their own (the FileSystemWriter
#: family's thread_count, Bridge's dist_ckpt_workers for workers): the error must name
#: that keyword, never the options' field the caller did not pass (issue #38).
SPELLED: list[tuple[str, Callable[[Path, Any], Any], str]] = [
    ("StorageWriter", lambda p, v: dcpstore.StorageWriter(str(p), thread_count=v), r"^StorageWriter: thread_count "),
    ("StorageReader", lambda p, v: dcpstore.StorageReader(str(p), thread_count=v), r"^StorageReader: thread_count "),
    (
        "FileSystemWriterAsync",
        lambda p, v: _nvrx_writer(str(p), thread_count=v),
        r"^FileSystemWriterAsync: thread_count ",
    ),
    (
        "CheckpointConfig",
        lambda p, v: CheckpointConfig(save=str(p), dist_ckpt_workers=v),
        r"^CheckpointConfig\.dist_ckpt_workers: ",
    ),
]


def _nvrx_writer(path: str, **kwargs: Any) -> Any:
    from dcpstore.adapters.megatron import FileSystemWriterAsync

    return FileSystemWriterAsync(path, **kwargs)


@pytest.mark.parametrize("value", [0, -1, 2.5, "2", True])
@pytest.mark.parametrize(("entry", "call", "match"), SPELLED, ids=[c[0] for c in SPELLED])
def test_a_bad_value_is_named_as_the_caller_spelt_it(
    tmp_path: Path, entry: str, call: Callable[[Path, Any], Any], match: str, value: Any
) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=match) as info:
        call(tmp_path / "c", value)
    message = str(info.value)
    assert f"must be a positive int, got {value!r}" in message and "workers must" not in message, message


def test_the_options_still_name_their_own_fields() -> None:
    """What a caller passed as the options' field is named as the field, with the entry point."""
    with pytest.raises(dcpstore.InvalidArgument, match=r"^workers must be a positive int, got 0$"):
        SaveOptions(workers=0)
    with pytest.raises(dcpstore.InvalidArgument, match=r"^save: workers must be a positive int, got 0$"):
        dcpstore.save(_state(), "/nonexistent/never-written", workers=0)
    with pytest.raises(dcpstore.InvalidArgument, match=r"^load: progress must be a bool, got 1$"):
        dcpstore.load(_state(), "/nonexistent/never-written", progress=1)  # type: ignore[arg-type]
