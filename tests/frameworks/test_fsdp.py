"""FSDP2 model + optimizer state through dcpstore: formats, resharding,
strict and partial loads.

Multi-rank jobs are gloo on CPU (tests/support/dist_utils.py); each compares against
the full state rank 0 gathered at save time (tests/support/fsdp_jobs.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dcpstore
from dcpstore.adapters import fsdp
from tests.support import fsdp_jobs
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks

# torch_dist hands DCP ShardedTensors, which torch marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")


def test_fsdp2_saved_on_2_loads_on_1_2_4_and_4_loads_on_1_2(tmp_path) -> None:
    root = str(tmp_path)
    # 2 ranks: train, save fsdp_dtensor / torch_dist / full-state, reload on 2.
    run_ranks(fsdp_jobs.job_save, 2, root)
    # 4 ranks: each 2-rank checkpoint, in both formats and as a full-state
    # load; then save a 4-rank torch_dist checkpoint.
    cases = [
        ("dt2", "fsdp_dtensor", False),
        ("td2", "fsdp_dtensor", False),
        ("dt2", "torch_dist", False),
        ("full2", "fsdp_dtensor", True),
    ]
    run_ranks(fsdp_jobs.job_load, 4, root, cases, True)
    # 1 process without torch.distributed, plain model: 2 -> 1 and 4 -> 1.
    fsdp_jobs.load_unsharded(root, "dt2")
    fsdp_jobs.load_unsharded(root, "td4")
    # 4 -> 2.
    run_ranks(fsdp_jobs.job_load, 2, root, [("td4", "fsdp_dtensor", False)], False)


# memory:// is left out: its store lives inside one process, so ranks in
# other processes cannot share it. The quick run takes one native and one MSC
# route to object storage; the other MSC routes run with the slow mark.
_MULTIRANK_TARGETS = [
    "local",
    "s3",
    "msc",
    pytest.param("s3+msc", marks=pytest.mark.slow),
    pytest.param("local+msc", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("target", _MULTIRANK_TARGETS, indirect=True)
def test_fsdp2_checkpoint_on_every_backend_target(target: Target, tmp_path) -> None:
    """One resharding combination (2 ranks -> 1 process) per backend; the
    full world-size matrix above runs on the local backend."""
    ref = str(tmp_path / "ref.pt")
    run_ranks(fsdp_jobs.job_save_to, 2, target.uri, target.kwargs, ref)
    fsdp_jobs.load_unsharded_from(target.uri, target.kwargs, ref)


def test_manager_saves_retains_and_resumes_on_two_ranks(tmp_path) -> None:
    run_ranks(fsdp_jobs.job_manager, 2, str(tmp_path / "run"))
    mgr = dcpstore.CheckpointManager(str(tmp_path / "run"), async_=False)
    assert mgr.all_steps() == [3, 4] and mgr.read_pointer() == 4
    mgr.close()


# -- single process: key reports ------------------------------------------------


def _model(*widths: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(2, widths[0])).sum().backward()
    optim.step()
    return model, optim


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(local_target: Target) -> tuple[str, dict[str, torch.Tensor]]:
    model, optim = _model(4, 3, 2)
    fsdp.save_app_state(model, optim, local_target.uri, extra={"step": 7}).result()
    return local_target.uri, _params(model)


def test_exact_match_loads_everything(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    uri, want = saved
    model, optim = _model(4, 3, 2, seed=1)
    extra: dict[str, Any] = {"step": 0}
    report = fsdp.load_app_state(model, optim, uri, extra=extra)
    assert report.ok and extra == {"step": 7}
    assert "model.0.weight" in report.loaded_keys and "optimizer.state.1.bias.exp_avg" in report.loaded_keys
    for key, value in _params(model).items():
        assert torch.equal(value, want[key]), key


def test_strict_load_names_missing_keys_and_changes_nothing(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    uri, _ = saved
    model, optim = _model(4, 3, 2, 2, seed=1)  # one layer more than saved
    before = _params(model)
    with pytest.raises(dcpstore.StateDictMismatch, match=r"missing: .*model\.2\.bias, model\.2\.weight") as info:
        fsdp.load_app_state(model, optim, uri)
    report = info.value.report
    assert isinstance(report, fsdp.LoadReport)
    assert {"model.2.weight", "model.2.bias", "optimizer.state.2.weight.exp_avg"} <= set(report.missing_keys)
    assert not report.unexpected_keys
    for key, value in _params(model).items():
        assert torch.equal(value, before[key]), f"{key} changed by a refused load"


def test_partial_load_reports_and_loads_the_rest(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    uri, want = saved
    model, optim = _model(4, 3, 2, 2, seed=1)
    before = _params(model)
    report = fsdp.load_app_state(model, optim, uri, strict=False)
    assert not report.ok and set(report.missing_keys) >= {"model.2.weight", "model.2.bias"}
    after = _params(model)
    for key in ("0.weight", "0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[key], want[key]), key
    for key in ("2.weight", "2.bias"):
        assert torch.equal(after[key], before[key]), f"{key} should keep its value"
    exp_avg = optim.state[model[0].weight]["exp_avg"]
    assert exp_avg.abs().sum() > 0  # optimizer state came from the checkpoint, not zeros
    model(torch.randn(2, 4)).sum().backward()
    optim.step()  # and the mixed state is usable


def test_unexpected_and_mismatched_keys(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    uri, want = saved
    smaller, smaller_optim = _model(4, 3, seed=1)
    with pytest.raises(dcpstore.StateDictMismatch, match=r"unexpected: .*model\.1\.bias"):
        fsdp.load_app_state(smaller, smaller_optim, uri)
    report = fsdp.load_app_state(smaller, smaller_optim, uri, strict=False)
    assert {"model.1.weight", "model.1.bias"} <= set(report.unexpected_keys) and not report.missing_keys
    assert torch.equal(smaller.state_dict()["0.weight"], want["0.weight"])

    wider, wider_optim = _model(4, 5, 2, seed=1)  # 0.weight is 5x4 here, 3x4 saved
    report = fsdp.load_app_state(wider, wider_optim, uri, strict=False)
    bad = {m.key: m for m in report.mismatched_keys}
    assert bad["model.0.weight"].saved == "tensor(3, 4)" and bad["model.0.weight"].expected == "tensor(5, 4)"
    assert "mismatched" in report.describe()


def test_model_only_and_bad_arguments(saved: tuple[str, dict[str, torch.Tensor]], tmp_path) -> None:
    uri, want = saved
    model, _ = _model(4, 3, 2, seed=1)
    report = fsdp.load_app_state(model, None, uri)  # optimizer entries are neither missing nor unexpected
    assert report.ok and torch.equal(model.state_dict()["1.weight"], want["1.weight"])
    with pytest.raises(dcpstore.InvalidArgument, match="format"):
        fsdp.get_app_state(model, None, format="zarr")
    with pytest.raises(dcpstore.InvalidArgument, match="reserved"):
        fsdp.get_app_state(model, None, extra={"model": 1})
    with pytest.raises(dcpstore.CheckpointNotFound):
        fsdp.load_app_state(model, None, str(tmp_path / "nothing"))
