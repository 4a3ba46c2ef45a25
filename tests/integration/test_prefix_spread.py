"""Spreading data files over key prefixes (``SaveOptions.spread_prefixes``).

Many ranks writing one checkpoint under one key prefix meet an object
store's per-partition request limit; a spread save puts rank ``r``'s files in
``p{r mod N, hex digits reversed}/``. What must hold: every rank's files land
where the layout says, stock ``dcp.load`` reads the result (``.metadata``
records the relative paths), dcpstore loads and verifies it on every
backend, and the tools that list checkpoints (``ls``, ``gc``, the claim's
clean-up) treat the spread files as the checkpoint's own.
"""

from __future__ import annotations

import collections
import json
import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore._impl.dcp.liveness import alive_file
from dcpstore._impl.dcp.liveness.alive_file import ALIVE_PREFIX
from dcpstore._impl.format.layout import (
    INFLIGHT,
    MANIFEST,
    METADATA,
    manifest_name,
    name_tag,
    split_data_path,
    spread_dir,
    spread_file_prefix,
)
from dcpstore._impl.storage.backends.local import _TMP_MARK
from dcpstore._impl.storage.storage_options import AUTO_RANKS_PER_PREFIX, MAX_SPREAD_PREFIXES, auto_spread_prefixes
from dcpstore._impl.tools.maintenance import gc, list_checkpoints
from dcpstore.storage import StorageOptions
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks
from tests.support.oracle import needs_nvrx

FULL = torch.arange(96 * 40, dtype=torch.float32).reshape(96, 40)


def _spread(target: Target, prefixes: int) -> dict[str, Any]:
    """``save``'s keywords for ``target``, spread over ``prefixes``."""
    return {**target.kwargs, "spread_prefixes": prefixes}


# -- the layout's arithmetic ---------------------------------------------------


@given(prefixes=st.integers(2, 4096), rank=st.integers(0, 1 << 20))
def test_spread_dirs_name_one_of_n_prefixes(prefixes: int, rank: int) -> None:
    d = spread_dir(rank, prefixes)
    assert d == spread_dir(rank % prefixes, prefixes)
    assert re.fullmatch(r"p[0-9a-f]{1,3}", d)
    digits = d[1:][::-1]  # stored least significant first
    assert int(digits, 16) == rank % prefixes and len(digits) == len(f"{prefixes - 1:x}")
    name = spread_file_prefix(f"__{rank}_", rank, prefixes) + "0.distcp"
    assert split_data_path(name) == ("", name)
    assert split_data_path(f"step_00000007/{name}") == ("step_00000007", name)


@given(prefixes=st.sampled_from([16, 256, 4096]), start=st.integers(0, 10_000))
def test_consecutive_ranks_differ_in_the_first_character(prefixes: int, start: int) -> None:
    """The fastest-changing digit first: any 16 consecutive ranks use all 16
    first characters, so a store that splits a hot prefix at that character
    halves the load on it at once."""
    assert {spread_dir(r, prefixes)[1] for r in range(start, start + 16)} == set("0123456789abcdef")


@given(prefixes=st.integers(2, 4096))
def test_the_ranks_of_one_round_fill_every_prefix_once(prefixes: int) -> None:
    assert len({spread_dir(r, prefixes) for r in range(prefixes)}) == prefixes


@settings(deadline=None)  # up to 2**17 ranks counted per example: its time is the box's, not a result
@given(ranks=st.integers(1, 1 << 20))
def test_the_auto_spread_keeps_at_most_16_ranks_on_a_prefix(ranks: int) -> None:
    """A power of two, the fewest that leave 16 ranks or fewer on each
    prefix, up to the most prefixes a save may spread over."""
    spread = auto_spread_prefixes(ranks)
    assert spread & (spread - 1) == 0 and spread <= MAX_SPREAD_PREFIXES
    per_prefix = max(collections.Counter(spread_dir(r, spread) for r in range(min(ranks, 1 << 17))).values())
    assert per_prefix <= AUTO_RANKS_PER_PREFIX or spread == MAX_SPREAD_PREFIXES
    assert spread == 1 or ranks > AUTO_RANKS_PER_PREFIX * spread // 2


@pytest.mark.parametrize(
    "ranks, spread", [(1, 1), (16, 1), (17, 2), (1024, 64), (4096, 256), (16384, 1024), (1 << 20, 4096)]
)
def test_the_auto_spread_at_a_few_world_sizes(ranks: int, spread: int) -> None:
    assert auto_spread_prefixes(ranks) == spread


def test_one_prefix_is_the_stock_layout() -> None:
    assert spread_dir(5, 1) == "" and spread_file_prefix("__5_", 5, 1) == "__5_"


@pytest.mark.parametrize("bad", [0, -1, 4097, 2.0, True, "16", "AUTO"])
def test_bad_spread_is_refused_naming_the_option(tmp_path: Any, bad: Any) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="spread_prefixes"):
        dcpstore.SaveOptions(spread_prefixes=bad)
    with pytest.raises(dcpstore.InvalidArgument, match="spread_prefixes"):
        dcpstore.save({"w": torch.ones(1)}, str(tmp_path / "c"), spread_prefixes=bad)
    assert not (tmp_path / "c").exists()


def test_spreading_is_a_save_option_not_a_storage_option() -> None:
    """How a save lays out its files, not how the storage is reached: only
    SaveOptions (and save's keyword) take it."""
    with pytest.raises(TypeError, match="spread_prefixes"):
        StorageOptions(spread_prefixes=4)  # type: ignore[call-arg]


# -- saves and loads -----------------------------------------------------------


def test_spread_save_loads_everywhere(target: Target) -> None:
    """One process, 4 writer threads, 16 prefixes: rank 0's files are in p0/;
    dcpstore loads it verified; on a POSIX path stock dcp.load reads it too."""
    state = {"w": FULL.clone(), "b": FULL[:, 0] * 2, "step": 7}
    kwargs = _spread(target, 16)
    info = dcpstore.save(state, target.uri, workers=4, **kwargs).result()
    assert info.files and all(f.startswith("p0/__0_") for f in info.files), info.files
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    listed = sorted(o["path"] for o in storage.list())
    assert [p for p in listed if p.endswith(".distcp")] == sorted(info.files)
    manifest = json.loads(storage.read(MANIFEST))
    assert set(manifest["files"]) == set(info.files)
    dest: dict[str, Any] = {"w": torch.zeros(96, 40), "b": torch.zeros(96), "step": 0}
    dcpstore.load(dest, target.uri, **target.kwargs)  # loads need no spread setting
    assert torch.equal(dest["w"], FULL) and torch.equal(dest["b"], FULL[:, 0] * 2) and dest["step"] == 7
    if target.name in ("local", "local+direct", "local+msc"):
        plain: dict[str, Any] = {"w": torch.zeros(96, 40), "b": torch.zeros(96), "step": 0}
        dcp.load(plain, checkpoint_id=target.uri)
        assert torch.equal(plain["w"], FULL) and plain["step"] == 7


def _save_spread(rank: int, world_size: int, uri: str, kwargs: dict[str, Any]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), f"rank{rank}": torch.full((5,), float(rank))}
    info = dcpstore.save(state, uri, workers=2, **kwargs).result()
    want = spread_file_prefix(f"__{rank}_", rank, kwargs["spread_prefixes"])
    assert info.files and all(f.startswith(want) for f in info.files), (rank, info.files)


@pytest.mark.parametrize("target", ["local", "s3"], indirect=True)
def test_four_ranks_spread_over_four_prefixes(target: Target) -> None:
    """Real gloo ranks: each rank's files in its own prefix; one process
    reads the whole checkpoint back (stock dcp.load on the POSIX path)."""
    run_ranks(_save_spread, 4, target.uri, _spread(target, 4))
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    by_dir: dict[str, set[str]] = {}
    for o in storage.list():
        head, _, name = o["path"].rpartition("/")
        if name.endswith(".distcp"):
            by_dir.setdefault(head, set()).add(name.split("_")[2])
    assert by_dir == {"p0": {"0"}, "p1": {"1"}, "p2": {"2"}, "p3": {"3"}}
    dest = {"w": torch.zeros(96, 40), **{f"rank{r}": torch.zeros(5) for r in range(4)}}
    dcpstore.load(dest, target.uri, **target.kwargs)
    assert torch.equal(dest["w"], FULL) and all(
        torch.equal(dest[f"rank{r}"], torch.full((5,), float(r))) for r in range(4)
    )
    if target.name == "local":
        plain = {"w": torch.zeros(96, 40), "rank3": torch.zeros(5)}
        dcp.load(plain, checkpoint_id=target.uri)
        assert torch.equal(plain["w"], FULL) and torch.equal(plain["rank3"], torch.full((5,), 3.0))


def _save_by_hand(ranks: int, uri: str) -> None:
    """``ranks`` ranks in this process, each with its own row of FULL,
    through DCP's save protocol step by step (as ``dcp.save`` drives it,
    each rank's calls on its own writer and planner), with every option at
    its default."""
    writers, planners, plans = [], [], []
    for rank in range(ranks):
        writer = dcpstore.StorageWriter(uri)
        planner = DefaultSavePlanner()
        planner.set_up_planner({f"row{rank}": FULL[rank].clone()}, is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        writers.append(writer)
        planners.append(planner)
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = [
        writers[r].write_data(planners[r].finish_plan(global_plans[r]), planners[r]).wait() for r in range(ranks)
    ]
    writers[0].finish(metadata, results)


def test_an_auto_spread_save_of_40_ranks_loads_with_stock_dcp(tmp_path: Any) -> None:
    """40 ranks spread over 4 prefixes by default (16 ranks per prefix at
    most): rank r's file in p{r mod 4}/, recorded in .metadata, so stock
    dcp.load reads every row back."""
    uri = str(tmp_path / "ck")
    _save_by_hand(40, uri)
    dirs = {
        os.path.relpath(d, uri): sorted(f.split("_")[2] for f in fs if f.endswith(".distcp"))
        for d, _, fs in os.walk(uri)
        if d != uri
    }
    assert dirs == {f"p{d}": sorted(str(r) for r in range(d, 40, 4)) for d in range(4)}
    plain = {f"row{r}": torch.zeros(40) for r in range(40)}
    dcp.load(plain, checkpoint_id=uri)
    assert all(torch.equal(plain[f"row{r}"], FULL[r]) for r in range(40))


def _on_disk(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _committed_files(info: Any) -> list[str]:
    """A save's whole commit: its data files, its manifest (save-unique when
    its data files are: saved over a used URI), ``.metadata``."""
    tags = {name_tag(f) for f in info.files}
    assert len(tags) == 1, info.files
    return sorted([*info.files, manifest_name(tags.pop() or ""), METADATA])


def test_a_flat_save_over_a_spread_one_leaves_no_spread_files(local_target: Target) -> None:
    """The claim finds the old checkpoint's files wherever they lie and the
    commit removes them; the other way round too. Over a used URI the new
    files carry the save's tag, spread or not."""
    uri = local_target.uri
    dcpstore.save({"w": FULL.clone()}, uri, workers=3, **_spread(local_target, 16)).result()
    info = dcpstore.save({"w": FULL * 2}, uri, workers=2).result()
    assert all("/" not in f and name_tag(f) for f in info.files), info.files
    assert _on_disk(uri) == _committed_files(info)
    info = dcpstore.save({"w": FULL * 3}, uri, workers=2, **_spread(local_target, 16)).result()
    assert _on_disk(uri) == _committed_files(info)
    assert all(f.startswith("p0/__0_") and name_tag(f) for f in info.files), info.files
    dest = {"w": torch.zeros(96, 40)}
    dcpstore.load(dest, uri)
    assert torch.equal(dest["w"], FULL * 3)


@pytest.mark.parametrize("first_spread", [16, 1], ids=["over-spread", "over-flat"])
def test_a_spread_overwrite_killed_before_its_clean_up_loads_and_gcs(local_target: Target, first_spread: int) -> None:
    """A spread save over a committed checkpoint (spread or flat) whose
    clean-up never ran (killed right after its commit): the new one loads,
    ls sees one mixed committed entry, and gc removes exactly the old
    checkpoint's files, in or out of spread directories; the new commit's
    spread files stay and still load. A later spread overwrite does the same
    from a URI holding tagged spread files."""
    uri = local_target.uri
    old = dcpstore.save({"w": FULL.clone()}, uri, workers=3, **_spread(local_target, first_spread)).result()
    old_disk = _on_disk(uri)
    # Keep a copy of the old checkpoint's files, save over it, then put them
    # back: what an overwrite killed between its commit and its clean-up leaves.
    kept = {f: open(os.path.join(uri, f), "rb").read() for f in old_disk if f != METADATA}
    new = dcpstore.save({"w": FULL * 2}, uri, workers=2, **_spread(local_target, 4)).result()
    assert all(f.startswith("p0/") and name_tag(f) for f in new.files), new.files
    assert _on_disk(uri) == _committed_files(new)
    for f, blob in kept.items():
        os.makedirs(os.path.dirname(os.path.join(uri, f)), exist_ok=True)
        with open(os.path.join(uri, f), "wb") as out:
            out.write(blob)
    storage = dcpstore.open_storage(uri)
    (entry,) = list_checkpoints(storage)
    assert entry.committed and entry.mixed
    dest = {"w": torch.zeros(96, 40)}
    dcpstore.load(dest, uri)
    assert torch.equal(dest["w"], FULL * 2)
    report = gc(storage, older_than_s=0)
    assert sorted(report.removed) == sorted(kept), report.removed
    assert _on_disk(uri) == _committed_files(new)
    dest = {"w": torch.zeros(96, 40)}
    dcpstore.load(dest, uri)
    assert torch.equal(dest["w"], FULL * 2)
    third = dcpstore.save({"w": FULL * 3}, uri, workers=2, **_spread(local_target, 4)).result()
    assert {name_tag(f) for f in third.files}.isdisjoint({name_tag(f) for f in new.files})
    assert _on_disk(uri) == _committed_files(third)
    dcpstore.load(dest, uri)
    assert torch.equal(dest["w"], FULL * 3)
    assert old.files  # the first save wrote something that the overwrites replaced


def test_ls_and_gc_treat_spread_files_as_the_checkpoints_own(tmp_path: Any) -> None:
    """A committed spread checkpoint is one committed entry and gc never
    touches its files; an interrupted one (no .metadata) is one uncommitted
    entry and gc removes all of it."""
    root = str(tmp_path / "run")
    spread = {"spread_prefixes": 16}
    dcpstore.save({"w": FULL.clone()}, f"{root}/good", workers=2, **spread).result()
    dcpstore.save({"w": FULL.clone()}, f"{root}/broken", workers=2, **spread).result()
    os.remove(f"{root}/broken/{METADATA}")
    storage = dcpstore.open_storage(root)
    entries = {e.path: e for e in list_checkpoints(storage)}
    assert set(entries) == {"good", "broken"}
    assert entries["good"].committed and not entries["broken"].committed
    assert entries["good"].files == 3  # .metadata, the manifest, p0/__0_0.distcp
    assert sorted(entries["broken"].leftovers) == ["broken/.dcpstore.json", "broken/p0/__0_0.distcp"]
    report = gc(storage, older_than_s=0)
    assert report.removed == ["broken"]
    assert not os.path.exists(f"{root}/broken")
    dest = {"w": torch.zeros(96, 40)}
    dcpstore.load(dest, f"{root}/good")
    assert torch.equal(dest["w"], FULL)


@needs_nvrx
def test_nvrx_engine_spreads_too(local_target: Target) -> None:
    state = {"w": FULL.clone(), "b": torch.ones(100)}
    info = dcpstore.save(
        state, local_target.uri, async_=True, engine="nvrx", workers=2, **_spread(local_target, 256)
    ).result(timeout=60)
    assert info.files and all(f.startswith("p00/__0_") for f in info.files), info.files
    plain = {"w": torch.zeros(96, 40), "b": torch.zeros(100)}
    dcp.load(plain, checkpoint_id=local_target.uri)
    assert torch.equal(plain["w"], FULL) and torch.equal(plain["b"], torch.ones(100))
    dest = {"w": torch.zeros(96, 40), "b": torch.zeros(100)}
    dcpstore.load(dest, local_target.uri)
    assert torch.equal(dest["w"], FULL)


def test_gc_leaves_a_running_spread_saves_temporary_files_alone(tmp_path: Any) -> None:
    """The temporary files of a running save's spread data files lie one
    directory down (p1/): gc must see them as that save's, not as an idle
    directory's leftovers, however old they are."""
    ckpt = tmp_path / "root" / "mine"
    (ckpt / "p1").mkdir(parents=True)
    token = "0123456789abcdef"
    (ckpt / INFLIGHT).write_text(token)
    (ckpt / f"{ALIVE_PREFIX}{token}").write_bytes(alive_file.encode_alive(token, alive_file.Owner.current()))
    temp = ckpt / "p1" / f".__1_0.distcp{_TMP_MARK}x"
    temp.write_bytes(b"partial")
    old = time.time() - 600
    os.utime(temp, (old, old))
    report = gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=300)
    assert report.kept_running == ["mine"]
    assert temp.exists() and report.incomplete_uploads == 0
