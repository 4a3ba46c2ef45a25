"""dcpstore demo, POSIX and S3 side by side: only the URI changes.

    python examples/s3_demo.py

Starts a local S3 endpoint (``moto_server`` on a free 127.0.0.1 port, a
separate process), points the standard AWS variables of *this* process at it
(``AWS_ENDPOINT_URL``, fake credentials), then saves the same model and
optimizer state to a local directory, to ``s3://`` natively (boto3) and to
``s3://`` through NVIDIA Multi-Storage-Client (``enable_msc=True``), loads
each back into a fresh model and checks the weights. Stops the server at the end.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import dcpstore
from dcpstore import tools

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for tests.support
from demo import build, state_of, train  # noqa: E402  (the POSIX demo's model)

from tests.support.s3_server import MotoServer, export_aws_env  # noqa: E402  (the tests' moto launcher)


def roundtrip(uri: str, state: dict, model: torch.nn.Module, **kwargs: object) -> None:
    info = dcpstore.save(state, uri, workers=4, **kwargs).result()
    fresh_model, fresh_opt = build(1)
    train(fresh_model, fresh_opt, 1)  # materialise optimizer state to load into
    target = state_of(fresh_model, fresh_opt, 0)
    t0 = time.perf_counter()
    dcpstore.load(target, uri, **kwargs)
    load_ms = (time.perf_counter() - t0) * 1e3
    fresh_model.load_state_dict(target["model"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
    via = " (enable_msc)" if kwargs.get("enable_msc") else ""
    print(
        f"{info.backend:6s} {uri + via:45s} save {info.total_s * 1e3:5.0f} ms  "
        f"({info.bytes_written / 1e6:.1f} MB, {len(info.files)} files)  load {load_ms:5.0f} ms  identical: {same}"
    )
    if not same:
        raise SystemExit(f"demo failed: weights loaded from {uri} differ")


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="dcpstore-s3-demo-"))
    server = MotoServer(workdir).start()
    try:
        export_aws_env(server.url)
        server.client().create_bucket(Bucket="demo")
        print(f"local S3 endpoint: {server.url} (moto_server)\n")
        model, opt = build(0)
        train(model, opt, 10)
        state = state_of(model, opt, 10)
        roundtrip(str(workdir / "run1" / "step_10"), state, model)
        roundtrip("s3://demo/run1/step_10", state, model)
        roundtrip("s3://demo/run1-msc/step_10", state, model, enable_msc=True)
        print("\ndcpstore ls s3://demo/run1:")
        for entry in tools.ls("s3://demo/run1"):
            print(
                f"  {entry.path or '.'}  {'committed' if entry.committed else 'incomplete'}  "
                f"{entry.files} files  {entry.bytes / 1e6:.1f} MB"
            )
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
