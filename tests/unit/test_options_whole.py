"""One options value, passed whole: every entry point takes ``options=``.

``dcpstore.save`` / ``load`` keep their keywords (shortcuts that build the
options); ``AsyncSaver.save``, ``CheckpointManager``, the drop-in
``StorageWriter`` / ``StorageReader`` and Megatron's ``CheckpointConfig``
take the options whole plus only what is theirs. What must hold: the
options passed whole do what the keywords did; each keyword these took
before still works for one release, with one ``DeprecationWarning`` that
names its replacement and points at the caller's line; a keyword that
disagrees with the options is an ``InvalidArgument`` naming both; and
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
from dcpstore.adapters.megatron import CheckpointConfig
from dcpstore._impl.engines.saver import AsyncSaver, default_saver

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


def test_save_and_load_take_the_options_their_keywords_build(tmp_path: Path) -> None:
    whole, keywords = str(tmp_path / "whole"), str(tmp_path / "keywords")
    options = SaveOptions(engine="native", workers=2, overwrite=False, spread_prefixes=4)
    a = dcpstore.save(_state(), whole, options=options).result()
    # Keywords fill what the options leave at their defaults (spread has no keyword).
    b = dcpstore.save(_state(), keywords, engine="native", workers=2, overwrite=False,
                      options=SaveOptions(spread_prefixes=4)).result()  # fmt: skip
    assert a.files == b.files and all(f.startswith("p0/__0_") for f in a.files), (a.files, b.files)
    assert _data_files(whole) == _data_files(keywords)
    for uri in (whole, keywords):
        with pytest.raises(dcpstore.CheckpointExists):
            dcpstore.save(_state(2.0), uri, options=options)
        _loads(uri, 1.0, options=LoadOptions(workers=2, verify=True))
        _loads(uri, 1.0, workers=2, verify=True)


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
    writer = dcpstore.StorageWriter(uri, options=SaveOptions(workers=3, spread_prefixes=4, overwrite=False, storage_options=TUNED))
    assert (writer.workers, writer.spread_prefixes, writer.overwrite) == (3, 4, False)
    assert writer.storage.options == TUNED
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert _data_files(uri) and all(f.startswith("p0/") for f in _data_files(uri))
    reader = dcpstore.StorageReader(uri, options=LoadOptions(workers=2, verify=False, trusted=True, storage_options=TUNED))
    assert (reader.workers, reader.verify, reader.storage.options) == (2, False, TUNED)
    out = {"w": torch.zeros(64), "b": torch.zeros(8), "step": 0}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], torch.full((64,), 1.0))
    # FileSystemWriter's own names stay: thread_count is options.workers.
    assert dcpstore.StorageWriter(uri, thread_count=2, options=SaveOptions(spread_prefixes=4)).workers == 2


REFUSED: list[tuple[Callable[..., Any], Any, str]] = [
    (dcpstore.StorageWriter, SaveOptions(planner=DefaultSavePlanner()), r"options\.planner=.* pass planner= to dcp\.save"),
    (dcpstore.StorageWriter, SaveOptions(progress=True), r"options\.progress=True"),
    (dcpstore.StorageWriter, SaveOptions(engine="nvrx"), r"options\.engine='nvrx'"),
    (dcpstore.StorageWriter, SaveOptions(save_id="0123456789abcdef"), r"options\.save_id="),
    (dcpstore.StorageWriter, LoadOptions(), r"options must be a dcpstore\.SaveOptions"),
    (dcpstore.StorageReader, LoadOptions(planner=DefaultLoadPlanner()), r"options\.planner=.* pass planner= to dcp\.save / dcp\.load"),
    (dcpstore.StorageReader, SaveOptions(), r"options must be a dcpstore\.LoadOptions"),
]


@pytest.mark.parametrize(("cls", "options", "named"), REFUSED, ids=[f"{r[0].__name__}-{i}" for i, r in enumerate(REFUSED)])
def test_the_drop_ins_refuse_what_dcps_call_decides(tmp_path: Path, cls: Callable[..., Any], options: Any, named: str) -> None:
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
    _loads(uri, 1.0, options=LoadOptions(storage_options=MSC))
    with pytest.raises(dcpstore.InvalidArgument, match="enable_msc must be a bool"):
        StorageOptions(enable_msc=1)  # type: ignore[arg-type]


# -- the keywords these took before: still working, each warning once ------------------


def _one_warning(record: pytest.WarningsRecorder) -> str:
    ours = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert ours[0].filename == __file__, ours[0].filename  # the caller's line
    return str(ours[0].message)


@pytest.fixture
def saver() -> Iterator[AsyncSaver]:
    with AsyncSaver() as s:
        yield s


SAVER_KEYWORDS: list[tuple[str, Any, str]] = [
    # keyword, value, what options= then holds (as spelled in the warning)
    ("workers", 2, "workers=2"),
    ("enable_msc", True, "enable_msc=True"),
    ("engine", "native", "engine='native'"),
    ("process_group", None, "SaveOptions("),
    ("planner", None, "SaveOptions("),
    ("storage_options", TUNED, "storage_options=StorageOptions("),
    ("max_in_flight", 2, "max_in_flight=2"),
    ("overwrite", False, "overwrite=False"),
    ("progress", True, "progress=True"),
]


@pytest.mark.parametrize(("keyword", "value", "spelled"), SAVER_KEYWORDS, ids=[k[0] for k in SAVER_KEYWORDS])
def test_each_keyword_the_saver_took_still_works_and_warns_once(
    tmp_path: Path, saver: AsyncSaver, monkeypatch: pytest.MonkeyPatch, keyword: str, value: Any, spelled: str
) -> None:
    seen: list[SaveOptions] = []
    monkeypatch.setattr(AsyncSaver, "submit", lambda self, sd, uri, options: seen.append(options))
    with pytest.warns(DeprecationWarning) as record:
        saver.save(_state(), str(tmp_path / "c"), **{keyword: value})
    message = _one_warning(record)
    assert message.startswith(f"AsyncSaver.save's keyword {keyword}= is deprecated"), message
    assert "options=dcpstore.SaveOptions(" in message and spelled in message, message
    assert getattr(seen[0], keyword) == value and seen[0].async_ is True


def test_the_savers_old_keywords_save_for_real(tmp_path: Path, saver: AsyncSaver) -> None:
    uri = str(tmp_path / "c")
    with pytest.warns(DeprecationWarning, match="keyword (engine|workers)= is deprecated"):
        info = saver.save(_state(), uri, engine="native", workers=2).result()
    assert info.engine == "native"
    _loads(uri, 1.0)


MANAGER_KEYWORDS: list[tuple[str, Any]] = [
    ("workers", 2),
    ("enable_msc", True),
    ("engine", "native"),
    ("process_group", None),
    ("planner", None),
    ("storage_options", TUNED),
    ("progress", True),
]


@pytest.mark.parametrize(("keyword", "value"), MANAGER_KEYWORDS, ids=[k[0] for k in MANAGER_KEYWORDS])
def test_each_keyword_the_manager_took_still_works_and_warns_once(tmp_path: Path, keyword: str, value: Any) -> None:
    with pytest.warns(DeprecationWarning) as record:
        mgr = dcpstore.CheckpointManager(str(tmp_path / "run"), async_=False, **{keyword: value})
    message = _one_warning(record)
    assert message.startswith(f"CheckpointManager's keyword {keyword}= is deprecated"), message
    # The replacement keeps the manager's own mode: a manager is async unless told not to.
    assert "options=dcpstore.SaveOptions(" in message
    with mgr:
        assert getattr(mgr.options, keyword) == value and mgr.async_ is False
        mgr.save(_state(), 1)
    _loads(mgr.step_uri(1), 1.0, enable_msc=keyword == "enable_msc")


def test_the_managers_replacement_keeps_it_async(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"options=dcpstore\.SaveOptions\(async_=True, engine='native'\)"):
        mgr = dcpstore.CheckpointManager(str(tmp_path / "run"), engine="native")
    with mgr:
        assert mgr.async_ is True and mgr.engine == "native"


DROPIN_KEYWORDS: list[tuple[Callable[..., Any], str, Any, Callable[[Any], Any]]] = [
    (dcpstore.StorageWriter, "enable_msc", True, lambda w: w.storage.backend == "msc"),
    (dcpstore.StorageWriter, "storage_options", TUNED, lambda w: w.storage.options == TUNED),
    (dcpstore.StorageReader, "enable_msc", True, lambda r: r.storage.backend == "msc"),
    (dcpstore.StorageReader, "storage_options", TUNED, lambda r: r.storage.options == TUNED),
    (dcpstore.StorageReader, "verify", False, lambda r: r.verify is False),
    (dcpstore.StorageReader, "trusted", True, lambda r: r._trust.trusted is True),
    (dcpstore.StorageReader, "safe_globals", [Path], lambda r: "pathlib.Path" in r._trust.extra),
]


@pytest.mark.parametrize(
    ("cls", "keyword", "value", "honoured"), DROPIN_KEYWORDS, ids=[f"{d[0].__name__}-{d[1]}" for d in DROPIN_KEYWORDS]
)
def test_each_keyword_the_drop_ins_took_still_works_and_warns_once(
    tmp_path: Path, cls: Callable[..., Any], keyword: str, value: Any, honoured: Callable[[Any], Any]
) -> None:
    with pytest.warns(DeprecationWarning) as record:
        made = cls(str(tmp_path), **{keyword: value})
    message = _one_warning(record)
    kind = "SaveOptions" if cls is dcpstore.StorageWriter else "LoadOptions"
    assert message.startswith(f"{cls.__name__}'s keyword {keyword}= is deprecated"), message
    assert f"options=dcpstore.{kind}(" in message
    assert honoured(made)


@pytest.mark.parametrize(("field", "value"), [("engine", "native"), ("enable_msc", True)])
def test_each_config_field_now_the_options_still_works_and_warns_once(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.warns(DeprecationWarning) as record:
        cfg = CheckpointConfig(save=str(tmp_path / "run"), **{field: value})
    message = _one_warning(record)
    assert message.startswith(f"CheckpointConfig's keyword {field}= is deprecated"), message
    assert getattr(cfg.options, field) == value
    with pytest.warns(DeprecationWarning) as record:
        bridged = CheckpointConfig.from_bridge({"save": str(tmp_path / "run")}, **{field: value})
    _one_warning(record)
    assert getattr(bridged.options, field) == value


def test_spread_prefixes_in_the_storage_options_still_spreads_and_warns_once(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    with pytest.warns(DeprecationWarning) as record:
        info = dcpstore.save(_state(), uri, workers=2, storage_options=StorageOptions(spread_prefixes=4)).result()
    message = _one_warning(record)
    assert "StorageOptions(spread_prefixes=4) is deprecated" in message and "SaveOptions(spread_prefixes=4)" in message
    assert info.files and all(f.startswith("p0/") for f in info.files), info.files
    with pytest.warns(DeprecationWarning):
        moved = SaveOptions(storage_options=StorageOptions(spread_prefixes=4, max_attempts=3))
    assert moved == SaveOptions(spread_prefixes=4, storage_options=StorageOptions(max_attempts=3))
    _loads(uri, 1.0)


def test_an_unknown_keyword_is_still_named_with_its_fix(tmp_path: Path, saver: AsyncSaver) -> None:
    with pytest.raises(TypeError, match=r"^AsyncSaver\.save\(\) got an unexpected keyword argument 'workes': did you mean 'workers'\?"):
        saver.save(_state(), str(tmp_path / "c"), workes=2)
    with pytest.raises(TypeError, match=r"^StorageWriter\.__init__\(\) got an unexpected keyword argument 'thread_cont'"):
        dcpstore.StorageWriter(str(tmp_path), thread_cont=2)
    with pytest.raises(TypeError, match="spread_prefixes"):  # never a keyword of the saver: no deprecation path
        saver.save(_state(), str(tmp_path / "c"), spread_prefixes=2)


# -- a keyword that disagrees with the options: refused, naming both ------------------

CONFLICTS: list[tuple[str, Callable[[Path], Any], str]] = [
    ("save", lambda p: dcpstore.save(_state(), str(p), workers=2, options=SaveOptions(workers=3)),
     r"^save: workers=2 and options\.workers=3 disagree"),
    ("load", lambda p: dcpstore.load(_state(), str(p), workers=2, options=LoadOptions(workers=3)),
     r"^load: workers=2 and options\.workers=3 disagree"),
    ("AsyncSaver.save", lambda p: default_saver().save(_state(), str(p), engine="nvrx", options=SaveOptions(engine="native")),
     r"^AsyncSaver\.save: engine='nvrx' and options\.engine='native' disagree"),
    ("CheckpointManager", lambda p: dcpstore.CheckpointManager(str(p), async_=False, options=SaveOptions(async_=True)),
     r"^CheckpointManager: async_=False and options\.async_=True disagree"),
    ("StorageWriter", lambda p: dcpstore.StorageWriter(str(p), thread_count=2, options=SaveOptions(workers=3)),
     r"^StorageWriter: thread_count=2 and options\.workers=3 disagree"),
    ("StorageReader", lambda p: dcpstore.StorageReader(str(p), thread_count=2, options=LoadOptions(workers=3)),
     r"^StorageReader: thread_count=2 and options\.workers=3 disagree"),
    ("CheckpointConfig", lambda p: CheckpointConfig(save=str(p), dist_ckpt_workers=2, options=SaveOptions(workers=3)),
     r"^CheckpointConfig\.options: dist_ckpt_workers=2 and options\.workers=3 disagree"),
    ("CheckpointConfig.save_options",
     lambda p: CheckpointConfig(options=SaveOptions(storage_options=TUNED)).save_options(storage_options=StorageOptions()),
     r"^CheckpointConfig\.save_options: storage_options=.* and options\.storage_options=.* disagree"),
    ("save, wrong type", lambda p: dcpstore.save(_state(), str(p), options=LoadOptions()),  # type: ignore[arg-type]
     r"^save: options must be a dcpstore\.SaveOptions"),
]  # fmt: skip


@pytest.mark.parametrize(("entry", "call", "match"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_a_keyword_that_disagrees_with_the_options_is_refused_naming_both(
    tmp_path: Path, entry: str, call: Callable[[Path], Any], match: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # AsyncSaver.save's engine= also warns; not the point here
        with pytest.raises(dcpstore.InvalidArgument, match=match):
            call(tmp_path / "c")


# -- a bad value is named as the caller spelt it -------------------------------------

#: Entry points that take an option under a keyword of their own (the FileSystemWriter
#: family's thread_count, Bridge's dist_ckpt_workers for workers): the error must name
#: that keyword, never the options' field the caller did not pass (issue #38).
SPELLED: list[tuple[str, Callable[[Path, Any], Any], str]] = [
    ("StorageWriter", lambda p, v: dcpstore.StorageWriter(str(p), thread_count=v), r"^StorageWriter: thread_count "),
    ("StorageReader", lambda p, v: dcpstore.StorageReader(str(p), thread_count=v), r"^StorageReader: thread_count "),
    ("FileSystemWriterAsync", lambda p, v: _nvrx_writer(str(p), thread_count=v), r"^FileSystemWriterAsync: thread_count "),
    ("CheckpointConfig", lambda p, v: CheckpointConfig(save=str(p), dist_ckpt_workers=v), r"^CheckpointConfig\.dist_ckpt_workers: "),
]  # fmt: skip


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
