"""What stock DCP does with each hostile checkpoint of the hostile suites.

    .venv/bin/python tests/support/hostile_stock.py

Builds the crafted checkpoints of tests/hostile/test_hostile*.py and runs stock
``torch.distributed.checkpoint`` (``FileSystemReader`` / ``FileSystemWriter``)
on each, every case in a fresh interpreter with a timeout, and prints the
outcome and the peak RSS: the "stock DCP" column of the hostile-checkpoint
table in RELIABILITY.md. Not collected by pytest (the suites assert what
dcpstore does, and where cheap what stock does too).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, where tests.* imports from
from tests.support.hostile_kit import (  # noqa: E402
    METADATA,
    Payload,
    declare,
    good,
    replace_data_files,
    replace_item,
    write_metadata,
)
from tests.support.hostile_kit import record_with_deflated_entry as deflated  # noqa: E402
from tests.support.rss import PEAK_MIB_SOURCE  # noqa: E402

GiB = 1 << 30

_CHILD = (
    PEAK_MIB_SOURCE
    + """
import json, resource, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
action = sys.argv[1]
try:
    exec(action)
    outcome = "ok"
except BaseException as e:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> cause
    if failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
print(json.dumps([outcome, peak_mib()]))
"""
)


def run(action: str, timeout: float = 120) -> str:
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, action], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout:g} s (blocked)"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    outcome, peak = json.loads(proc.stdout.strip().splitlines()[-1])
    return f"{outcome} (peak RSS {peak} MiB)"


def load(ckpt: Path, sd: str = "{'w': torch.zeros(3, 4), 'b': torch.zeros(4), 'step': 0}") -> str:
    return f"dcp.load({sd}, storage_reader=FileSystemReader({str(ckpt)!r}), no_dist=True)"


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="hostile-stock-"))
    cases: dict[str, str] = {}
    marker = root / "pwned"

    ck = good(root / "metadata-payload")
    md = pickle.loads((ck / METADATA).read_bytes())
    md.planner_data = Payload(marker)
    write_metadata(ck, md, manifest=False)
    cases[".metadata runs code"] = run(load(ck)) + f"; payload ran: {marker.exists()}"
    marker.unlink(missing_ok=True)

    ck = root / "item-payload"
    import dcpstore

    dcpstore.save({"w": torch.ones(3, 4), "sched": Payload(marker)}, str(ck)).result()
    cases["non-tensor item runs code"] = run(load(ck, "{'w': torch.zeros(3, 4), 'sched': torch.zeros(2)}"))
    cases["non-tensor item runs code"] += f"; payload ran: {marker.exists()}"

    ck = good(root / "tensor-bomb")
    declare(ck, "b", 3 * GiB)
    cases["4-element tensor declared 3 GiB (sparse)"] = run(load(ck))
    ck = good(root / "bytes-bomb")
    declare(ck, "step", 3 * GiB)
    cases["non-tensor item declared 3 GiB over a hole"] = run(load(ck))
    ck = good(root / "deflated-object")
    replace_item(ck, "step", deflated(5, "data.pkl", 1024))
    cases["object record with data.pkl DEFLATE-compressed (1 GiB)"] = run(load(ck))
    ck = good(root / "deflated-tensor")
    replace_item(ck, "b", deflated(torch.ones(4), "data/0", 900))
    cases["4-float tensor record with data/0 DEFLATE-compressed (900 MiB)"] = run(load(ck))
    ck = good(root / "transformed-bomb")
    declare(ck, "b", 3 * GiB, ["zstandard/1"])
    cases["4-element tensor declared 3 GiB, transforms named (sparse)"] = run(load(ck))
    ck = good(root / "sparse-metadata")
    os.truncate(ck / METADATA, 2 * GiB)
    cases["sparse 2 GiB .metadata"] = run(load(ck))

    for name, change in {
        "storage_data a list": lambda m: setattr(m, "storage_data", list(m.storage_data.items())),
        "relative_path '../../etc/passwd'": lambda m: [
            setattr(i, "relative_path", "../../../../../../etc/passwd")
            for k, i in m.storage_data.items()
            if k.fqn == "w"
        ],
        "chunk without storage entry": lambda m: m.storage_data.__delitem__(
            next(i for i in m.storage_data if i.fqn == "w")
        ),
    }.items():
        ck = good(root / name.replace(" ", "_").replace("/", "_").replace("'", ""))
        md = pickle.loads((ck / METADATA).read_bytes())
        change(md)
        write_metadata(ck, md)
        cases[f".metadata: {name}"] = run(load(ck))

    for special in ("fifo", "dev-zero"):
        ck = good(root / f"special-{special}")
        replace_data_files(ck, os.mkfifo if special == "fifo" else lambda path: os.symlink("/dev/zero", path))
        cases[f"data file is {special}"] = run(load(ck), timeout=60)

    ck = good(root / "symlinked")
    victim = root / "victim.bin"
    victim.write_bytes(b"precious")
    replace_data_files(ck, lambda path: os.symlink(victim, path))
    save = f"dcp.save({{'w': torch.ones(3, 4)}}, storage_writer=FileSystemWriter({str(ck)!r}), no_dist=True)"
    cases["save over a symlinked data file"] = run(save) + f"; victim now {victim.read_bytes()[:12]!r}"

    os.chdir(root)
    save = "dcp.save({'w': torch.ones(2)}, checkpoint_id='s3:bucket/x', no_dist=True)"
    cases["checkpoint_id 's3:bucket/x'"] = (
        run(save) + f"; local dir 's3:bucket' exists: {(root / 's3:bucket').exists()}"
    )
    for name, outcome in cases.items():
        print(f"{name}: {outcome}")


if __name__ == "__main__":
    main()
