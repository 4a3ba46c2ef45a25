"""CUDA paths: staging from GPU memory, both async engines on CUDA state,
loads into CUDA tensors in place, FSDP2 over NCCL, and a manager resume.

Marked ``cuda`` and skipped without a CUDA device (CI has none);
``scripts/gpu-check.sh`` runs them on a GPU machine. Expected values are
taken on the host (a blocking ``.cpu()``) before each save, and stock DCP
saving the same state is the second oracle.

The stream tests are built to fail if staging broke: the next step mutates
the tensors on a stream that does *not* wait for the caller's stream, so
only ``save()``'s own wait orders the device-to-host copies before it, and
the background write is held until that mutation has run, so any alias of
GPU memory would write the mutated values.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.engines import nvrx as nvrx_adapter
from dcpstore._impl.engines import selection
from dcpstore._impl.engines.staging import Stager, StagingPool
from tests.support.async_helpers import ENGINES, GatedPlanner, assert_same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1 << 20
#: Where the test state lives. Only this module's own checks of its
#: device-independent plumbing set it to "cpu".
DEVICE = "cuda"


def _need_engine(engine: str) -> None:
    if engine == "nvrx" and nvrx_adapter.import_error() is not None:
        pytest.skip(nvrx_adapter.import_error() or "")


def cuda_state() -> dict[str, Any]:
    """Several dtypes and layouts, made on the GPU: views of a larger
    storage, permuted and strided tensors, conjugate and negative views, a
    tied tensor, an item over 1 MiB (the loader's view path), containers and
    plain values."""
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(256, 256, device=dev, generator=g)
    z = torch.randn(64, 33, dtype=torch.complex64, device=dev, generator=g)
    tied = torch.randn(1000, device=dev, generator=g)
    return {
        "f32": torch.randn(512, 129, device=dev, generator=g),
        "bf16": torch.randn(128, 8, device=dev, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, 9, device=dev, generator=g).to(torch.float16),
        "i64": torch.arange(5000, device=dev),
        "u8": torch.randint(0, 255, (4099,), dtype=torch.uint8, device=dev, generator=g),
        "bool": torch.rand(77, device=dev, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, device=dev),
        "empty": torch.empty(0, 4, device=dev),
        "big": torch.randn(3 * MiB // 4 + 5, device=dev, generator=g),
        "slice_view": base[10:20],
        "strided_view": base[:, ::3],
        "transposed": torch.randn(12, 40, device=dev, generator=g).t(),
        "conj": z.conj(),
        "neg": z.conj().imag,  # a negative view: is_neg()
        "tied_a": tied,
        "tied_b": tied,
        "nested": {"inner": torch.ones(5, 5, device=dev), "list": [torch.zeros(3, device=dev), 4, "text"]},
        "meta": {"step": 10, "lr": 0.1, "name": "run"},
    }


def host_values(obj: Any) -> Any:
    """The values as they are now, on the host (blocking copies; view bits
    resolved), to compare with later."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().resolve_conj().resolve_neg().cpu().clone()
    if isinstance(obj, dict):
        return {k: host_values(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_values(v) for v in obj]
    return obj


def template(obj: Any, device: str) -> Any:
    """Zeros of the same shapes and dtypes on ``device``; None for plain values."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype, device=device)
    if isinstance(obj, dict):
        return {k: template(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [template(v, device) for v in obj]
    return None


def delay_current_stream(ms: float = 20.0) -> None:
    """Queue ``ms`` of busy work on the current stream, so that what is
    queued next starts well after the host has moved on."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:  # spins for a number of GPU cycles (~1-2 GHz)
        sleep(int(ms * 2e6))
        return
    spin = torch.empty(64 * MiB, device="cuda")
    for _ in range(int(ms)):
        spin.add_(1)


#: Keys whose stock-DCP result is not an oracle: stock DCP moves CUDA
#: tensors to the host with non-blocking copies, so it meets the torch race
#: that test_conjugate_and_negative_cuda_views_stage_as_their_values guards
#: against. Those keys are checked against host values only.
VIEW_BIT_KEYS = ("conj", "neg")


def stock_dcp_values(state: dict[str, Any], path: str) -> dict[str, Any]:
    """What stock ``dcp.save`` + ``dcp.load`` make of ``state``."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    back = template(state, "cpu")
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return back


# -- staging ----------------------------------------------------------------


def test_staging_copies_cuda_tensors_into_reused_pinned_buffers() -> None:
    state = {"a": torch.randn(MiB, device="cuda"), "b": torch.randn(33, 7, device="cuda").t()}
    stager = Stager(StagingPool())
    staged = stager.stage(state)
    for key, value in state.items():
        got = staged.state_dict[key]
        assert got.device.type == "cpu" and got.is_pinned(), key
        assert got.stride() == value.stride(), key  # a dense permuted tensor keeps its layout
        assert torch.equal(got, value.cpu()), key
    ptrs = [t.data_ptr() for t in staged.state_dict.values()]
    staged.release()
    state["a"].add_(1)
    again = stager.stage(state)
    assert [t.data_ptr() for t in again.state_dict.values()] == ptrs  # same buffers, no new pinned memory
    assert torch.equal(again.state_dict["a"], state["a"].cpu())
    again.release()


def test_staging_waits_for_the_callers_current_stream() -> None:
    """Values produced on a non-default stream, staged from inside it
    without any synchronisation by the caller: the copy must be ordered
    after that stream's work and waited for on it."""
    producer = torch.cuda.Stream()
    n = 64 * MiB // 4
    with torch.cuda.stream(producer):
        x = torch.zeros(n, device="cuda")
        delay_current_stream()  # a copy not ordered after this stream would read zeros
        x.fill_(50.0)
        staged = Stager(StagingPool()).stage({"x": x})
    assert torch.equal(staged.state_dict["x"], torch.full((n,), 50.0))
    staged.release()


def test_conjugate_and_negative_cuda_views_stage_as_their_values() -> None:
    """torch fixes up a conjugate or negative view's bits on the host right
    after queuing a non-blocking device-to-host copy; staging must not
    inherit that race (large tensors, so the copy is still in flight)."""
    z = torch.randn(1024, 1024, dtype=torch.complex64, device="cuda")  # 8 MiB
    state = {"conj": z.conj(), "neg": z.conj().imag, "neg_t": z.conj().imag.t()}
    assert state["conj"].is_conj() and state["neg"].is_neg() and state["neg_t"].is_neg()
    want = host_values(state)
    stager = Stager(StagingPool())
    for _ in range(2):  # fresh buffers, then pooled ones
        # Busy work ahead of the copies: a host-side fix-up would run long
        # before the bytes arrive, so the race cannot hide.
        delay_current_stream()
        staged = stager.stage(state)
        for key in state:
            assert torch.equal(staged.state_dict[key], want[key]), key
        staged.release()


# -- async saves of CUDA state ------------------------------------------------


def test_auto_sees_cuda_in_use(tmp_path: Any) -> None:
    """A process holding CUDA state saves object stores from a checkpoint
    process under engine="auto" (whatever its core count), local paths on
    threads; the save says so."""
    state = cuda_state()
    assert selection.cuda_in_use()
    order, reason = selection.auto_engine("s3", "s3://bucket/step1")
    assert order[0] == "process" and "CUDA in use" in reason
    with dcpstore.AsyncSaver() as saver:
        info = saver.save(state, str(tmp_path / "ckpt")).result(timeout=120)
    assert info.engine == "native" and info.engine_reason.startswith("engine='auto': local storage")


@pytest.mark.parametrize("engine", ENGINES)
def test_async_save_of_cuda_state_matches_stock_dcp(engine: str, tmp_path: Any) -> None:
    _need_engine(engine)
    state = cuda_state()
    expected = host_values(state)
    oracle = stock_dcp_values({k: v for k, v in state.items() if k not in VIEW_BIT_KEYS}, str(tmp_path / "stock"))
    uri = str(tmp_path / "ckpt")
    with dcpstore.AsyncSaver() as saver:
        info = saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine)).result(timeout=120)
    assert info.engine == engine and info.phases["stage"] > 0
    loaded = template(state, "cpu")
    dcpstore.load(loaded, uri)
    assert_same(loaded, expected)
    assert_same({k: v for k, v in loaded.items() if k not in VIEW_BIT_KEYS}, oracle)


@pytest.mark.parametrize("engine", ENGINES)
def test_snapshot_holds_while_the_next_step_mutates_on_another_stream(engine: str, tmp_path: Any) -> None:
    _need_engine(engine)
    g = torch.Generator(device="cuda").manual_seed(1)
    state: dict[str, Any] = {f"w{i}": torch.randn(8 * MiB, device="cuda", generator=g) for i in range(16)}
    state["bf16"] = torch.randn(4096, 4096, device="cuda", generator=g).to(torch.bfloat16)
    torch.cuda.synchronize()
    expected = {k: v.cpu() for k, v in state.items()}  # 544 MiB
    side = torch.cuda.Stream()  # the next step's stream: it does not wait for the caller's
    planner = GatedPlanner("setup")  # holds the background save before it reads anything
    uri = str(tmp_path / "ckpt")
    with dcpstore.AsyncSaver() as saver:
        handle = saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine, planner=planner, workers=4))
        with torch.cuda.stream(side):
            for t in state.values():
                t.mul_(-1.5).add_(1.0)  # changes every element
        assert planner.reached.wait(60)
        side.synchronize()
        assert not handle.done()
        with torch.cuda.stream(side):  # and keeps changing them while the write runs
            for _ in range(20):
                for t in state.values():
                    t.add_(1.0)
        planner.gate.set()
        info = handle.result(timeout=90)
    side.synchronize()
    assert info.bytes_written >= sum(v.nbytes for v in expected.values())
    assert not torch.equal(state["w0"].cpu(), expected["w0"])  # the mutation really happened
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcpstore.load(loaded, uri)
    for key, want in expected.items():
        assert torch.equal(loaded[key].cpu(), want), key


# -- loads into CUDA tensors --------------------------------------------------


@pytest.mark.parametrize("engine", ["sync", *ENGINES])
def test_load_fills_cuda_tensors_in_place(engine: str, tmp_path: Any) -> None:
    if engine != "sync":
        _need_engine(engine)
    state = cuda_state()
    expected = host_values(state)
    uri = str(tmp_path / "ckpt")
    if engine == "sync":
        dcpstore.save(state, uri)
    else:
        dcpstore.save(state, uri, async_=True, engine=engine).result(timeout=120)

    dest = template(state, DEVICE)
    # Destinations that are not plain contiguous tensors: a transposed one,
    # and a window of a larger buffer whose other rows must stay untouched.
    dest["transposed"] = torch.zeros(12, 40, device=DEVICE).t()
    outer = torch.zeros(30, 256, device=DEVICE)
    dest["slice_view"] = outer[5:15]
    before = {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)}
    dcpstore.load(dest, uri)

    assert {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)} == before
    assert all(v.device.type == DEVICE for v in dest.values() if isinstance(v, torch.Tensor))
    assert_same(host_values(dest), expected)
    assert not outer[:5].any() and not outer[15:].any()

    # Stock dcp.load into the same kind of destinations agrees.
    stock_dest = template(state, DEVICE)
    dcp.load(stock_dest, storage_reader=dcp.FileSystemReader(uri), no_dist=True)
    assert_same(host_values(stock_dest), expected)


# -- FSDP2 over NCCL, and the manager ------------------------------------------


def job_fsdp_nccl(rank: int, world: int, root: str, engine: str, device: str = "cuda") -> None:
    """FSDP2 on CUDA over NCCL: async saves through a manager while training
    goes on, then a resume into a fresh model from the newest step."""
    from dcpstore.adapters import fsdp
    from tests.support.fsdp_jobs import assert_same as assert_same_state
    from tests.support.fsdp_jobs import build, differs, full_state, train

    model, optim = build(0, device=device)
    mgr = dcpstore.CheckpointManager(root, keep=2, async_=True, options=dcpstore.SaveOptions(engine=engine))
    refs: dict[int, dict[str, Any]] = {}
    for step in range(1, 4):
        train(model, optim, 1, seed=step)
        refs[step] = full_state(model, optim)
        fsdp.save_app_state(model, optim, mgr, step=step, extra={"step": step})
        # The next step runs while this save is in flight.
    train(model, optim, 1, seed=99)
    mgr.close()
    assert [saved.step for saved in mgr.history] == [1, 2, 3]

    fresh, fresh_optim = build(1, device=device)
    before = full_state(fresh, fresh_optim)
    extra: dict[str, Any] = {"step": -1}
    with dcpstore.CheckpointManager(root, keep=2, async_=True, options=dcpstore.SaveOptions(engine=engine)) as again:
        assert again.all_steps() == [2, 3]
        report = fsdp.load_app_state(fresh, fresh_optim, again, extra=extra)
    assert report.ok and report.step == 3 and extra["step"] == 3, (report.describe(), extra)
    after = full_state(fresh, fresh_optim)
    if rank == 0:
        assert differs(refs[3], before), "fresh model already equals the reference: the check would be vacuous"
        assert_same_state(refs[3], after, f"FSDP2/NCCL resume ({engine})")
    assert all(p.device.type == device for p in fresh.parameters())
    train(fresh, fresh_optim, 1)  # the restored state is usable on the GPU


@pytest.mark.parametrize("engine", ENGINES)
def test_fsdp2_over_nccl_async_save_and_resume(engine: str, tmp_path: Any) -> None:
    _need_engine(engine)
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    from tests.support.dist_utils import run_ranks

    run_ranks(job_fsdp_nccl, 1, str(tmp_path / "run"), engine, backend="nccl", timeout=90)


def test_manager_resumes_cuda_training_from_the_newest_step(tmp_path: Any) -> None:
    """One process, no torch.distributed: async saves while the optimizer
    keeps stepping, retention, and a resume into a fresh CUDA model."""
    from dcpstore.adapters import fsdp
    from tests.support.fsdp_jobs import assert_same as assert_same_state
    from tests.support.fsdp_jobs import build, differs, full_state, train

    root = str(tmp_path / "run")
    model, optim = build(0, sharded=False, device=DEVICE)
    refs: dict[int, dict[str, Any]] = {}
    with dcpstore.CheckpointManager(root, keep=2, async_=True, options=dcpstore.SaveOptions(engine="native")) as mgr:
        for step in range(1, 5):
            train(model, optim, 1, seed=step)
            refs[step] = full_state(model, optim)
            fsdp.save_app_state(model, optim, mgr, step=step, extra={"step": step})
        train(model, optim, 1, seed=99)  # after the last save: must not reach it
    fresh, fresh_optim = build(1, sharded=False, device=DEVICE)
    before = full_state(fresh, fresh_optim)
    extra: dict[str, Any] = {"step": -1}
    with dcpstore.CheckpointManager(root) as again:
        assert again.all_steps() == [3, 4] and again.latest_step() == 4
        report = fsdp.load_app_state(fresh, fresh_optim, again, extra=extra)
    assert report.ok and report.step == 4 and extra["step"] == 4, (report.describe(), extra)
    assert differs(refs[4], before)
    assert_same_state(refs[4], full_state(fresh, fresh_optim), "manager resume on CUDA")
    assert all(p.device.type == DEVICE for p in fresh.parameters())
    assert os.path.isdir(os.path.join(root, "step_00000004"))
