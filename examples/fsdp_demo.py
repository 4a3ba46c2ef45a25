"""dcpstore FSDP2 demo: train, checkpoint, crash, resume on another world size.

    python examples/fsdp_demo.py            # ~30 s: 2 ranks train, crash, resume on 4
    python examples/fsdp_demo.py --fast     # ~15 s (CI): smaller model, resume on 1
    python examples/fsdp_demo.py --sync     # checkpoint synchronously (default: async)
    python examples/fsdp_demo.py --s3       # also checkpoint to a local S3 endpoint (moto)

It launches its own ranks (gloo on CPU, one process per rank), so no
torchrun is needed:

1. ``--world`` ranks train a small FSDP2 (``fully_shard``) model with AdamW
   and checkpoint model + optimizer every few steps through a
   :class:`~dcpstore.CheckpointManager` (built from a Megatron-style
   :class:`~dcpstore.adapters.megatron.CheckpointConfig`, keeping the newest
   2 steps). At each save rank 0 also keeps the gathered full state, to
   check the resume against.
2. Rank 1 is killed (SIGKILL, like a lost node) as the next save begins.
3. ``--resume-world`` ranks (a different world size) resume from the newest
   *committed* step, check that model and optimizer state equal what was
   saved there, train on and save again.
4. A summary table: per backend, steps saved, bytes, how long training
   waited for that backend's previous save and how long its save() call
   itself blocked (the snapshot), write time, resume load time.

Each rank's two managers share the process's one background saver
(dcpstore's default, one thread): each is given a save slot of its own
(``max_in_flight`` = the number of managers), so neither save() waits for
the other backend's save; the S3 save's writing starts once the local one's
is done, and a save that is still writing when the same backend's next one
is due is what the ``wait`` column shows.

With no ``--root`` everything goes to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore
from dcpstore.adapters import fsdp
from dcpstore.adapters.megatron import CheckpointConfig

CRASH_RANK = 1


@dataclass(frozen=True)
class Plan:
    width: int
    depth: int
    steps: int
    every: int
    crash_at: int  # rank CRASH_RANK dies as this step's save begins


FAST = Plan(width=64, depth=3, steps=8, every=2, crash_at=8)
FULL = Plan(width=1024, depth=4, steps=24, every=4, crash_at=20)


# ---------------------------------------------------------------------------
# Model and training (runs in every rank)
# ---------------------------------------------------------------------------


def build(plan: Plan, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(plan.depth):
        layers += [nn.Linear(plan.width, plan.width), nn.GELU()] if i < plan.depth - 1 else [nn.Linear(plan.width, 10)]
    model = nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, plan: Plan, step: int) -> float:
    g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
    x = torch.randn(32, plan.width, generator=g)
    loss = (model(x) - x[:, :10]).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.item())


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model + optimizer gathered on rank 0 (collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    return {"model": model_sd, "optimizer": optim_sd}


def configs(args: argparse.Namespace) -> dict[str, CheckpointConfig]:
    """One Megatron-style config per backend (the same code for each)."""
    roots = {"local": os.path.join(args.root, "ckpt")}
    if args.s3_uri:
        roots["s3"] = args.s3_uri
    # engine="auto" (the default) picks per backend: threads for the local
    # path, a checkpoint process for S3 on a GPU node (docs/engines.md).
    return {
        name: CheckpointConfig(
            save=root,
            load=root,
            save_interval=args.plan.every,
            async_save=args.async_save,
            ckpt_format="fsdp_dtensor",
            most_recent_k=2,
            dist_ckpt_workers=2,
        )
        for name, root in roots.items()
    }


def _stats_file(args: argparse.Namespace, name: str) -> str:
    return os.path.join(args.root, f"stats-{name}.jsonl")


def managers_for(cfgs: dict[str, CheckpointConfig]) -> dict[str, dcpstore.CheckpointManager]:
    """One manager per backend, each with a save slot of its own on the
    process's background saver (see the module docstring)."""
    return {
        name: dcpstore.CheckpointManager(
            cfg.save, keep=cfg.keep, options=replace(cfg.save_options(), max_in_flight=len(cfgs))
        )
        for name, cfg in cfgs.items()
        if cfg.save is not None
    }


def run_training(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """Phase 1 (every rank): train and checkpoint until the crash."""
    _init(rank, world, port)
    plan = args.plan
    model, optim = build(plan, seed=0)
    managers = managers_for(configs(args))
    written = {name: 0 for name in managers}
    for step in range(1, plan.steps + 1):
        loss = train_step(model, optim, plan, step)
        if not any(cfg.should_save(step) for cfg in configs(args).values()):
            continue
        if step == plan.crash_at and rank == CRASH_RANK:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node, just as a save begins
        expected = full_state(model, optim)
        if rank == 0:
            torch.save(expected, os.path.join(args.root, f"expected-{step}.pt"))
        for name, mgr in managers.items():
            t0 = time.perf_counter()
            mgr.wait()  # this backend's previous save, if it is still writing
            t1 = time.perf_counter()
            fsdp.save_app_state(model, optim, mgr, step=step, extra={"step": step})
            stall = time.perf_counter() - t1
            if rank == 0:
                written[name] = _record(args, name, mgr, written[name], {step: (t1 - t0, stall)})
        if rank == 0:
            committed = ", ".join(f"{name} {mgr.all_steps()}" for name, mgr in managers.items())
            print(f"  step {step:3d}  loss {loss:.4f}  saved; committed steps: {committed}", flush=True)
    raise SystemExit("the crash did not happen")


_STALLS: dict[str, dict[int, tuple[float, float]]] = {}


def _record(
    args: argparse.Namespace,
    name: str,
    mgr: dcpstore.CheckpointManager,
    done: int,
    stalls: dict[int, tuple[float, float]],
) -> int:
    """Append finished saves (their info arrives later when async) to stats-<backend>.jsonl."""
    _STALLS.setdefault(name, {}).update(stalls)
    with open(_stats_file(args, name), "a") as f:
        for saved in mgr.history[done:]:
            info = saved.info
            wait_s, stall_s = _STALLS[name].get(saved.step, (0.0, 0.0))
            f.write(
                json.dumps(
                    {
                        "step": saved.step,
                        "bytes": info.bytes_written,
                        "wait_s": wait_s,
                        "stall_s": stall_s,
                        "write_s": info.phases.get("write", 0.0),
                        "commit_s": info.phases.get("commit", 0.0),
                    }
                )
                + "\n"
            )
    return len(mgr.history)


def run_resume(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """Phase 2 (every rank, another world size): resume, check, train on."""
    _init(rank, world, port)
    plan = args.plan
    for name, cfg in configs(args).items():
        model, optim = build(plan, seed=123)  # different weights, fresh optimizer
        loader = cfg.load_manager()
        assert loader is not None
        t0 = time.perf_counter()
        extra: dict[str, Any] = {"step": -1}
        report = fsdp.load_app_state(model, optim, loader, format=cfg.ckpt_format, extra=extra)
        load_s = time.perf_counter() - t0
        assert report.step is not None  # loads through a manager always name their step
        got = full_state(model, optim)
        if rank == 0:
            expected = torch.load(os.path.join(args.root, f"expected-{report.step}.pt"), weights_only=False)
            mismatches = _compare(expected, got)
            with open(os.path.join(args.root, f"resume-{name}.json"), "w") as f:
                json.dump(
                    {
                        "step": report.step,
                        "extra_step": extra["step"],
                        "load_s": load_s,
                        "world": world,
                        "keys": len(report.loaded_keys),
                        "mismatches": mismatches,
                    },
                    f,
                )
        # Training continues from there and checkpoints again.
        for step in range(report.step + 1, report.step + plan.every + 1):
            train_step(model, optim, plan, step)
        loader.close()
        with cfg.manager() as saver:  # saves go to cfg.save, with its retention
            next_step = report.step + plan.every
            fsdp.save_app_state(model, optim, saver, step=next_step, extra={"step": next_step})


def _compare(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    bad = []
    for section in ("model", "optimizer"):
        for key, want in expected[section].items():
            have = got[section].get(key)
            same = torch.equal(want, have) if isinstance(want, torch.Tensor) else _plain(want) == _plain(have)
            if not same:
                bad.append(f"{section}.{key}")
    return bad


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # ranks share a few cores


# ---------------------------------------------------------------------------
# The launcher (parent process)
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(fn: Any, world: int, args: argparse.Namespace) -> int | None:
    """Run ``fn`` on ``world`` ranks; return the signal that killed a rank, if one did."""
    ctx = tmp.start_processes(fn, args=(world, _free_port(), args), nprocs=world, join=False, start_method="forkserver")
    try:
        while not ctx.join(timeout=1):
            pass
    except tmp.ProcessExitedException as e:
        if e.signal_name is not None:  # the simulated crash; the other ranks are stopped by start_processes
            return int(getattr(signal, e.signal_name))
        raise
    return None


@contextlib.contextmanager
def local_s3_endpoint(workdir: str) -> Iterator[str]:
    """For ``--s3``: a moto S3 server on loopback (the test suite's launcher,
    as examples/s3_demo.py uses it), with this process's AWS environment
    pointed at it before any rank starts; yields the checkpoint root URI."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root
    from tests.support.s3_server import MotoServer, export_aws_env

    server = MotoServer(Path(workdir)).start()
    try:
        export_aws_env(server.url)
        server.client().create_bucket(Bucket="dcpstore-demo")
        yield "s3://dcpstore-demo/run"
    finally:
        server.stop()


def report_crash(args: argparse.Namespace, resume_world: int) -> None:
    """What each backend has committed after the crash, and why one may be behind."""
    print(f"crash: rank {CRASH_RANK} was killed at step {args.plan.crash_at}, as its save began; committed steps left:")
    left = {}
    for name, cfg in configs(args).items():
        assert cfg.save is not None
        with dcpstore.CheckpointManager(cfg.save, async_=False) as survivor:
            left[name] = survivor.all_steps()
        print(f"  {name + ':':<6} {left[name]}")
    newest = max((steps[-1] for steps in left.values() if steps), default=None)
    for name, steps in left.items():
        if newest is not None and (not steps or steps[-1] < newest):
            print(
                f"  note: {name} is a step behind: its save of step {newest} was still being written when rank "
                f"{CRASH_RANK} died, so it never committed (each rank writes the backends' saves in turn, on "
                f"one background thread, and {name} is the slower)"
            )
    print("  note: keep=2 retires old steps once a save is finished, at the next save, so 3 can be left")
    print(f"resuming on {resume_world} rank(s), each backend from its own newest committed step")


def summary(args: argparse.Namespace, names: list[str]) -> bool:
    print("\n  backend  saves  MB/ckpt  wait ms  stall ms  write ms  commit ms  resumed  on  load ms  state")
    print("  " + "-" * 93)
    ok = True
    for name in names:
        rows = [json.loads(line) for line in open(_stats_file(args, name))]
        with open(os.path.join(args.root, f"resume-{name}.json")) as f:
            resume = json.load(f)
        match = not resume["mismatches"] and resume["extra_step"] == resume["step"]
        ok &= match
        med = lambda k: 1e3 * statistics.median(r[k] for r in rows)  # noqa: E731, B023 (used in this iteration)
        print(
            f"  {name:<7}  {len(rows):>5}  {sum(r['bytes'] for r in rows) / len(rows) / 1e6:>7.2f}  "
            f"{med('wait_s'):>7.1f}  {med('stall_s'):>8.1f}  {med('write_s'):>8.1f}  {med('commit_s'):>9.1f}  "
            f"{resume['step']:>7}  {resume['world']:>2}  {resume['load_s'] * 1e3:>7.1f}  "
            f"{'match' if match else 'MISMATCH: ' + ', '.join(resume['mismatches'][:5])}"
        )
    print(
        "  (saves: those rank 0 saw finish before the crash; medians over them. wait: time training waited"
        " for this backend's previous save to finish; stall: time save() itself blocked (the snapshot);"
        " write: time to make the data durable; bytes and write are rank 0's)"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="small model, few steps, resume on 1 rank (CI)")
    parser.add_argument("--root", help="working directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--world", type=int, default=2, help="ranks that train (default 2)")
    parser.add_argument("--resume-world", type=int, help="ranks that resume (default 4; 1 with --fast)")
    parser.add_argument("--sync", dest="async_save", action="store_false", help="save synchronously (default: async)")
    parser.add_argument("--s3", action="store_true", help="also checkpoint to a local S3 endpoint (moto)")
    args = parser.parse_args()
    args.plan = FAST if args.fast else FULL
    resume_world = args.resume_world or (1 if args.fast else 4)
    if args.world < 2 or resume_world == args.world:
        parser.error("--world must be >= 2 (rank 1 crashes) and --resume-world must differ from it")
    keep_root = bool(args.root)
    args.root = os.path.abspath(args.root or tempfile.mkdtemp(prefix="dcpstore-fsdp-demo-"))
    os.makedirs(args.root, exist_ok=True)
    multiprocessing.set_forkserver_preload(
        ["torch", "torch._dynamo", "torch.distributed.fsdp", "dcpstore.adapters.fsdp"]
    )
    t0 = time.perf_counter()
    try:
        with local_s3_endpoint(args.root) if args.s3 else contextlib.nullcontext(None) as s3_uri:
            args.s3_uri = s3_uri
            try:
                names = list(configs(args))  # validates the configs before any rank starts
            except dcpstore.InvalidArgument as e:
                raise SystemExit(f"demo: {e}") from e
            print(
                f"training on {args.world} ranks, checkpointing every {args.plan.every} steps to {', '.join(names)} "
                f"({'async' if args.async_save else 'sync'}); rank {CRASH_RANK} will die at step {args.plan.crash_at}"
            )
            killed = launch(run_training, args.world, args)
            if killed != signal.SIGKILL:
                raise SystemExit(f"expected rank {CRASH_RANK} to be SIGKILLed, got {killed}")
            report_crash(args, resume_world)
            launch(run_resume, resume_world, args)
            ok = summary(args, names)
    finally:
        if not keep_root:
            shutil.rmtree(args.root, ignore_errors=True)
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
