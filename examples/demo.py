"""dcpstore demo: save a model + optimizer, inspect, verify, load it back.

    python examples/demo.py [--root DIR]

With no arguments it writes under a fresh temporary directory and removes it
afterwards. Every step prints what it did and how long it took.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

import dcpstore
from dcpstore import tools


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(32, 512)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", help="checkpoint root (default: a temporary directory)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="dcpstore-demo-")
    uri = f"{root.rstrip('/')}/step_10"
    try:
        model, opt = build(0)
        train(model, opt, 10)
        info = dcpstore.save(state_of(model, opt, 10), uri, workers=4).result()
        print(
            f"saved    {info.uri}: {info.bytes_written / 1e6:.1f} MB in {len(info.files)} files, "
            f"write {info.phases['write'] * 1e3:.0f} ms, commit {info.phases['commit'] * 1e3:.0f} ms"
        )

        details = tools.inspect(uri)
        print(f"inspect  {len(details['keys'])} keys, {details['tensor_bytes'] / 1e6:.1f} MB of tensors")
        report = tools.verify(uri)
        print(f"verify   {'OK' if report.ok else report.problems}: {report.files_checked} files checksummed")

        fresh_model, fresh_opt = build(1)  # different weights, empty optimizer state
        train(fresh_model, fresh_opt, 1)  # materialise optimizer state to load into
        target = state_of(fresh_model, fresh_opt, 0)
        t0 = time.perf_counter()
        dcpstore.load(target, uri)
        fresh_model.load_state_dict(target["model"])
        fresh_opt.load_state_dict(target["optim"])
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
        print(f"load     {(time.perf_counter() - t0) * 1e3:.0f} ms; step={target['step']}; weights identical: {same}")
        if not same:
            raise SystemExit("demo failed: loaded weights differ")
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
