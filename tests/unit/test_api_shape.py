"""One consistent API: keyword mistakes named with their fix, the state first
everywhere, and every public function and class documented (Args, Returns,
Raises)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.util.keyword_hints import FRAMEWORK_NAMES, unknown_keyword_message
from dcpstore.adapters import fsdp, megatron


@pytest.fixture
def calls(tmp_path: Path) -> Iterator[dict[str, Callable[..., Any]]]:
    """Each public entry point, to be called with one extra keyword."""
    uri = str(tmp_path / "c")
    state = {"w": torch.ones(4)}
    saver = dcpstore.AsyncSaver()
    mgr = dcpstore.CheckpointManager(str(tmp_path / "run"), options=dcpstore.SaveOptions(async_=True, engine="native"))
    yield {
        "save": lambda **kw: dcpstore.save(state, uri, **kw),
        "load": lambda **kw: dcpstore.load(state, uri, **kw),
        "AsyncSaver": lambda **kw: dcpstore.AsyncSaver(**kw),
        "AsyncSaver.save": lambda **kw: saver.save(state, uri, **kw),
        "CheckpointManager": lambda **kw: dcpstore.CheckpointManager(uri, **kw),
        "CheckpointManager.save": lambda **kw: mgr.save(state, 1, **kw),
        "CheckpointManager.load": lambda **kw: mgr.load(state, **kw),
    }
    saver.close()
    mgr.close()


ASYNC_HINT = "did you mean 'async_'? ('async' is a reserved word"
MISTAKES = [
    ("save", {"async": True}, ASYNC_HINT),
    ("save", {"workes": 4}, "did you mean 'workers'?"),
    ("save", {"storage_option": None}, "did you mean 'storage_options'?"),
    ("save", {"max_inflight": 2}, "did you mean 'max_in_flight'?"),
    ("load", {"veryfy": False}, "did you mean 'verify'?"),
    ("load", {"workes": 4}, "did you mean 'workers'?"),
    ("AsyncSaver", {"max_inflight": 2}, "did you mean 'max_in_flight'?"),
    ("AsyncSaver.save", {"workes": 4}, "did you mean 'workers'? pass options=dcpstore.SaveOptions(workers=...)"),
    ("AsyncSaver.save", {"engin": "native"}, "did you mean 'engine'? pass options=dcpstore.SaveOptions(engine=...)"),
    (
        "save",
        {"executor": "process"},
        "did you mean 'engine'? (engine='process' runs the save in a checkpoint process)",
    ),
    ("save", {"options": dcpstore.SaveOptions()}, "dcpstore.save takes each option as a keyword"),
    ("load", {"options": dcpstore.LoadOptions()}, "dcpstore.load takes each option as a keyword"),
    (
        "CheckpointManager",
        {"executor": "process"},
        "'executor' is dcpstore's 'engine' (its name in torch's dcp.async_save): "
        "pass options=dcpstore.SaveOptions(async_=True, engine=...)",
    ),
    ("CheckpointManager", {"async": True}, ASYNC_HINT),
    ("CheckpointManager", {"kep": 3}, "did you mean 'keep'?"),
    ("CheckpointManager.save", {"overwirte": True}, "did you mean 'overwrite'?"),
    ("CheckpointManager.load", {"stp": 3}, "did you mean 'step'?"),
    # Other frameworks' names say what they are, not which of ours they look like.
    ("CheckpointManager", {"max_to_keep": 3}, "did you mean 'keep'? ('max_to_keep' is its name in Orbax's"),
    ("CheckpointManager", {"save_interval": 5}, "not an option of dcpstore's (the training loop decides when"),
    ("load", {"strict": False}, "'strict' is torch's load_state_dict's name, not an option of dcpstore's"),
    ("save", {"max_to_keep": 3}, "dcpstore's 'keep', which save() does not take"),
]


@pytest.mark.parametrize(("name", "kwargs", "hint"), MISTAKES, ids=[f"{m[0]}-{next(iter(m[1]))}" for m in MISTAKES])
def test_keyword_mistakes_name_the_fix(
    calls: dict[str, Callable[..., Any]], name: str, kwargs: dict[str, Any], hint: str
) -> None:
    with pytest.raises(TypeError) as info:
        calls[name](**kwargs)
    message = str(info.value)
    function = name if "." in name or name in ("save", "load") else f"{name}.__init__"
    assert message.startswith(f"{function}() got an unexpected keyword argument"), message
    assert hint in message, message


def test_a_keyword_with_no_close_match_lists_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'colour' \(it accepts .*workers"):
        dcpstore.save({"w": torch.ones(1)}, str(tmp_path / "c"), colour="blue")


def test_the_message_names_every_unknown_keyword() -> None:
    message = unknown_keyword_message("save", ["workes", "zzz"], ["workers", "uri"])
    assert message == (
        "save() got an unexpected keyword argument 'workes': did you mean 'workers'?; "
        "an unexpected keyword argument 'zzz'"
    )


def test_valid_keywords_pass_through_untouched(tmp_path: Path) -> None:
    info = dcpstore.save({"w": torch.ones(3)}, str(tmp_path / "c"), workers=1, engine="native").result()
    assert info.bytes_written > 0
    assert list(inspect.signature(dcpstore.save).parameters)[:2] == ["state_dict", "uri"]


#: Each stand-in for another framework's class, and the arguments that are
#: dcpstore's own (every other one is the framework's, in FRAMEWORK_NAMES).
STAND_INS: dict[str, tuple[Any, set[str]]] = {
    "StorageWriter": (dcpstore.StorageWriter, {"path", "commit_files", "options"}),
    "StorageReader": (dcpstore.StorageReader, {"path", "options"}),
    "FileSystemWriterAsync": (megatron.FileSystemWriterAsync, {"path", "storage_options", "process_group"}),
    "CheckpointConfig": (megatron.CheckpointConfig, set(megatron.DCPSTORE_FIELDS)),
}


@pytest.mark.parametrize("entry", sorted(STAND_INS))
def test_the_framework_names_a_stand_in_takes_are_the_tables(entry: str) -> None:
    """FRAMEWORK_NAMES is the one table of other frameworks' names: what a
    stand-in takes beyond its own arguments is exactly its rows."""
    cls, own = STAND_INS[entry]
    taken = set(_params(cls)) - own
    assert taken == {name for name, f in FRAMEWORK_NAMES.items() if entry in f.taken_by}


def test_another_frameworks_name_elsewhere_is_named_as_ours(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError,
        match=r"'thread_count': did you mean 'workers'\? \('thread_count' is its name in torch's FileSystemWriter",
    ):
        dcpstore.save({"w": torch.ones(1)}, str(tmp_path / "c"), thread_count=2)
    with pytest.raises(TypeError, match=r"'dist_ckpt_workers': did you mean 'workers'\? .*Megatron-Bridge"):
        dcpstore.load({"w": torch.ones(1)}, str(tmp_path / "c"), dist_ckpt_workers=2)


# -- the manager's argument order ------------------------------------------------


def test_manager_takes_the_state_first_like_save_and_load(tmp_path: Path) -> None:
    with dcpstore.CheckpointManager(str(tmp_path / "run"), async_=False) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the natural orders warn about nothing
            mgr.save({"w": torch.full((4,), 1.0)}, 1)
            mgr.save({"w": torch.full((4,), 2.0)}, step=2)
            mgr.save(state_dict={"w": torch.full((4,), 3.0)}, step=3)
        out = {"w": torch.zeros(4)}
        assert mgr.load(out, 2) == 2 and out["w"].tolist() == [2.0] * 4
        assert mgr.all_steps() == [1, 2, 3]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (({"w": torch.ones(1)}, "3"), "step must be"),
        (("3", {"w": torch.ones(1)}), "state_dict must be a dict"),
        ((True, {"w": torch.ones(1)}), "state_dict must be a dict"),
        ((7, {"w": torch.ones(1)}), r"save\(state_dict, step\): state_dict must be a dict, got int"),  # the step first
    ],
)
def test_manager_refuses_what_is_not_state_then_step(tmp_path: Path, args: tuple[Any, Any], needle: str) -> None:
    with dcpstore.CheckpointManager(str(tmp_path / "run"), async_=False) as mgr:
        with pytest.raises(dcpstore.InvalidArgument, match=needle):
            mgr.save(*args)


# -- docstrings -------------------------------------------------------------------

#: Public functions and classes whose docstrings must be complete.
PUBLIC: list[Any] = [getattr(dcpstore, name) for name in dcpstore.__all__] + [
    fsdp.save_app_state,
    fsdp.load_app_state,
    fsdp.get_app_state,
    fsdp.set_app_state,
    megatron.CheckpointConfig,
]


def _documented() -> list[tuple[str, Any]]:
    """(name, callable) of every public function, class and public method."""
    found: list[tuple[str, Any]] = []
    for obj in PUBLIC:
        if isinstance(obj, type) and issubclass(obj, (BaseException, Warning)):
            continue
        found.append((obj.__qualname__, obj))
        if isinstance(obj, type):
            for name, member in vars(obj).items():
                if name.startswith("_") or not callable(member) or isinstance(member, type):
                    continue
                found.append((f"{obj.__qualname__}.{name}", member))
    return found


def _params(fn: Any) -> list[str]:
    target = fn.__init__ if isinstance(fn, type) else fn
    if isinstance(fn, type) and target is object.__init__:
        return []
    params = inspect.signature(target).parameters.values()
    return [p.name for p in params if p.name not in ("self", "cls") and p.kind is not p.VAR_KEYWORD]


#: The entry points whose failures users handle: each says what it raises.
RAISES = {
    "save",
    "load",
    "open_storage",
    "AsyncSaver",
    "AsyncSaver.save",
    "AsyncSaver.close",
    "AsyncSaver.wait",
    "CheckpointManager",
    "CheckpointManager.save",
    "CheckpointManager.load",
    "CheckpointManager.wait",
    "CheckpointManager.close",
    "CheckpointManager.resolve_step",
    "SaveHandle.result",
    "SaveHandle.exception",
    "StorageOptions",
    "save_app_state",
    "load_app_state",
    "get_app_state",
    "CheckpointConfig",
}


@pytest.mark.parametrize(("name", "fn"), _documented(), ids=[n for n, _ in _documented()])
def test_public_docstrings_say_args_returns_raises(name: str, fn: Any) -> None:
    doc = inspect.getdoc(fn)
    assert doc, f"{name} has no docstring"
    params = _params(fn)
    if len(params) > 1 or (params and len(doc.splitlines()) > 3):
        # A dataclass's fields are its arguments: "Attributes:" names them.
        assert "Args:" in doc or "Attributes:" in doc or all(f"``{p}``" in doc for p in params), f"{name}: no Args"
    if not isinstance(fn, type):
        returns = inspect.signature(fn).return_annotation
        if returns not in (None, "None", inspect.Signature.empty) and len(doc.splitlines()) > 3:
            assert "Returns:" in doc, f"{name}: no Returns section"
    if name in RAISES:
        assert "Raises:" in doc, f"{name}: no Raises section"


def test_every_entry_point_that_must_say_what_it_raises_is_checked() -> None:
    assert RAISES <= {name for name, _ in _documented()}


#: Keyword options of the entry points: each has a row in docs/options.md's table.
OPTION_TAKERS = [
    dcpstore.save,
    dcpstore.load,
    dcpstore.AsyncSaver.__init__,
    dcpstore.AsyncSaver.save,
    dcpstore.CheckpointManager.__init__,
    dcpstore.CheckpointManager.save,
    dcpstore.CheckpointManager.load,
]


def test_every_option_has_a_row_in_the_options_table() -> None:
    table = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    options = {
        p.name for fn in OPTION_TAKERS for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY
    }
    assert options <= rows, f"options without a row in docs/options.md's table: {sorted(options - rows)}"
