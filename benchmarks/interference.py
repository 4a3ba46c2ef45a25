"""What one background save costs the training loop, per way of saving.

    python benchmarks/interference.py --size 256MiB --repeat 3 --json benchmarks/results/interference.json
    python benchmarks/interference.py --device cuda --size 1GiB ...        # on a GPU: a real device-to-host path

A training step of fixed work runs with no save, then during one async save;
the figures are the save's lost step-seconds, its peak step inflation, and
per GB saved: CPU seconds of the training process's other threads and of
child processes, and GIL-held seconds of the other threads (py-spy, in a
pass of its own). See dcpstore/_impl/bench/interference.py for the method.

Rows (each saves the same state to its own directory or key prefix):

* ``dcpstore native`` and ``dcpstore NVRx`` -- ``dcpstore.save(async_=True)``
  on each engine (background threads of the training process), and
  ``dcpstore process`` (``engine="process"``: a checkpoint process per rank),
  and ``dcpstore default (engine='auto')``: what a user gets, on whichever
  engine auto chooses on this machine (its "runs on" column);
* ``dcp.async_save`` with the thread and the process executor
  (``AsyncCheckpointerType``), with ``FileSystemWriter`` and with
  ``dcpstore.StorageWriter``;
* the same dcpstore and ``dcpstore.StorageWriter`` rows to S3: a moto server
  this script starts on loopback (skipped where boto3 or moto_server is not
  installed); NVRx reaches S3 through MSC.

A later way of saving is one more entry in :func:`rows` (for dcpstore's own
options, a :class:`~dcpstore._impl.bench.interference.DcpstoreRow` with other
``dcpstore.save`` keywords).

A single-rank gloo process group is initialised first: ``dcp.async_save``'s
process executor needs one (and every row then runs with it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import dcpstore  # noqa: E402
from dcpstore._impl.bench import make_state, parse_size  # noqa: E402
from dcpstore._impl.bench.interference import (  # noqa: E402
    DEFAULT_ROW,
    DcpstoreRow,
    Pending,
    Result,
    Row,
    StepWork,
    describe,
    measure,
    remove_uri,
    table_rows,
    text_table,
)
from dcpstore._impl.bench.report import git_commit, machine  # noqa: E402

BUCKET = "dcpstore-interference"


class DcpAsyncRow(Row):
    """``dcp.async_save`` with ``writer(path)`` and the ``executor``
    (``"thread"`` or ``"process"``: ``AsyncCheckpointerType``)."""

    def __init__(
        self,
        name: str,
        root: str,
        target: str,
        executor: str,
        writer: Callable[[str], Any],
        *,
        enable_msc: bool = False,
    ) -> None:
        self.name, self.root, self.target = name, root, target
        self.kind = executor
        self.executor = "process" if executor == "process" else "threads"
        self.writer = writer
        self.enable_msc = enable_msc
        self._paths: list[str] = []

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: F401

    def start(self, state: dict[str, torch.Tensor], n: int) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = f"{self.root.rstrip('/')}/save-{n}"
        self._paths.append(path)
        kind = AsyncCheckpointerType.PROCESS if self.kind == "process" else AsyncCheckpointerType.THREAD
        response = dcp.async_save(state, storage_writer=self.writer(path), async_checkpointer_type=kind)
        future: Pending = getattr(response, "upload_completion", response)  # torch 2.8+: AsyncSaveResponse
        return future

    def cleanup(self) -> None:
        for path in self._paths:
            remove_uri(path, enable_msc=self.enable_msc)
        self._paths = []


def _fs_writer(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, sync_files=True)


def _dcpstore_writer(path: str) -> Any:
    return dcpstore.StorageWriter(path)


def rows(local: str, s3: str | None) -> list[Row]:
    """Every row, local first; ``s3``: the S3 root (None: no S3 rows)."""
    out: list[Row] = [
        DcpstoreRow("dcpstore native", f"{local}/native", "local", engine="native"),
        DcpstoreRow("dcpstore NVRx", f"{local}/nvrx", "local", engine="nvrx"),
        DcpstoreRow("dcpstore process", f"{local}/process", "local", executor="process", engine="process"),
        DcpstoreRow(DEFAULT_ROW, f"{local}/default", "local"),
        DcpAsyncRow(
            "dcp.async_save thread + FileSystemWriter", f"{local}/dcp-thread-fs", "local", "thread", _fs_writer
        ),
        DcpAsyncRow(
            "dcp.async_save process + FileSystemWriter", f"{local}/dcp-process-fs", "local", "process", _fs_writer
        ),
        DcpAsyncRow(
            "dcp.async_save thread + dcpstore.StorageWriter",
            f"{local}/dcp-thread-ds",
            "local",
            "thread",
            _dcpstore_writer,
        ),
        DcpAsyncRow(
            "dcp.async_save process + dcpstore.StorageWriter",
            f"{local}/dcp-process-ds",
            "local",
            "process",
            _dcpstore_writer,
        ),
    ]
    if s3 is not None:
        out += [
            DcpstoreRow("dcpstore native", f"{s3}/native", "s3", engine="native"),
            DcpstoreRow("dcpstore NVRx (through MSC)", f"{s3}/nvrx", "s3", engine="nvrx", enable_msc=True),
            DcpstoreRow("dcpstore process", f"{s3}/process", "s3", executor="process", engine="process"),
            DcpstoreRow(DEFAULT_ROW, f"{s3}/default", "s3"),
            DcpAsyncRow(
                "dcp.async_save thread + dcpstore.StorageWriter",
                f"{s3}/dcp-thread-ds",
                "s3",
                "thread",
                _dcpstore_writer,
            ),
            DcpAsyncRow(
                "dcp.async_save process + dcpstore.StorageWriter",
                f"{s3}/dcp-process-ds",
                "s3",
                "process",
                _dcpstore_writer,
            ),
        ]
    return out


@contextlib.contextmanager
def s3_endpoint(workdir: str, pids: set[int]) -> Iterator[str | None]:
    """A moto server on loopback with the AWS (and MSC) environment pointed
    at it; yields the S3 root URI, or None where boto3 or moto is missing."""
    import servers

    try:
        import boto3  # noqa: F401

        servers._moto_binary()
    except (ImportError, FileNotFoundError) as e:
        print(f"interference: no S3 rows ({e})", file=sys.stderr)
        yield None
        return
    with servers.moto_server(pids) as endpoint:
        servers.create_bucket(endpoint, BUCKET)
        config = servers.write_msc_config(os.path.join(workdir, "msc.json"), {"interference": (endpoint, BUCKET)})
        with servers.env({**servers.s3_env(endpoint), "MSC_CONFIG": config}):
            yield f"s3://{BUCKET}/run"


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A world of one gloo rank (``dcp.async_save``'s process executor needs a group)."""
    import servers

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(servers.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def markdown(doc: dict[str, Any]) -> str:
    """The result file as a markdown table (benchmarks/report.py's ``interference`` blocks)."""
    from dcpstore._impl.bench.interference import TABLE_HEAD

    results = [Result(**{k: v for k, v in r.items() if k in Result.__dataclass_fields__}) for r in doc["results"]]
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join("---" for _ in TABLE_HEAD) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_rows(results)]
    m = doc["meta"]
    lines.append("")
    lines.append(
        f"_{m['describe']}; baseline step {_step_ms(results)}; `{m['command']}`, commit `{m.get('git_commit')}`, "
        f"{m['date']}_"
    )
    return "\n".join(lines)


def _step_ms(results: Sequence[Result]) -> str:
    steps = [r.baseline_s for r in results if r.baseline_s is not None]
    return f"{1e3 * min(steps):.2f}-{1e3 * max(steps):.2f} ms" if steps else "-"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="256MiB", help="state size (default 256MiB)")
    p.add_argument("--tensors", type=int, default=32, help="float32 tensors (default 32)")
    p.add_argument("--device", default="cpu", help="where the state and the training step live (cpu, cuda)")
    p.add_argument("--repeat", type=int, default=3, help="measured saves per row (median reported; default 3)")
    p.add_argument("--step-ops", type=int, default=200, help="small ops per training step (default 200)")
    p.add_argument("--step-size", type=int, default=64, help="their tensors' side (default 64)")
    p.add_argument("--intra-op-threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--pin-training", type=int, metavar="CPU", help="keep the training thread on this CPU")
    p.add_argument("--targets", default="local,s3", help="which of local,s3 to save to")
    p.add_argument("--only", help="regular expression: run only rows whose name matches")
    p.add_argument("--no-gil", action="store_true", help="skip the py-spy pass")
    p.add_argument("--budget-s", type=float, help="start no repeat (and no GIL pass) after this many seconds")
    p.add_argument("--root", help="directory for local saves (default: a temporary one under /tmp)")
    p.add_argument("--label", default="", help="free text stored with the results")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.intra_op_threads)
    wanted = set(args.targets.split(","))
    root = tempfile.mkdtemp(prefix="dcpstore-interference-", dir=args.root)
    state = {k: v.to(args.device) for k, v in make_state(parse_size(args.size), args.tensors).items()}
    step = StepWork(args.step_ops, args.step_size, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    text = describe(step, nbytes, args.repeat, args.pin_training)
    print(text, flush=True)
    servers_up: set[int] = set()
    try:
        with one_rank_group(), s3_endpoint(root, servers_up) if "s3" in wanted else contextlib.nullcontext(None) as s3:
            chosen = [
                r
                for r in rows(os.path.join(root, "local"), s3)
                if r.target in wanted and (not args.only or re.search(args.only, r.name))
            ]
            results = measure(
                chosen,
                state,
                step,
                repeat=args.repeat,
                pin_cpu=args.pin_training,
                gil=not args.no_gil,
                budget_s=args.budget_s,
                ignore_pids=servers_up,
                on_result=lambda r: print(f"  {r.name} -> {r.target}: {r.status}", flush=True),
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(text_table(results))
    if args.json:
        doc = {
            "meta": {
                "date": _now(),
                "git_commit": git_commit(),
                "machine": machine(),
                "label": args.label,
                "command": shlex.join(
                    ["python", "benchmarks/interference.py", *(argv if argv is not None else sys.argv[1:])]
                ),
                "describe": text,
                "size": nbytes,
                "tensors": args.tensors,
                "device": args.device,
                "step": {"ops": args.step_ops, "size": args.step_size, "intra_op_threads": args.intra_op_threads},
                "pin_training": args.pin_training,
                "repeat": args.repeat,
            },
            "results": [r.to_json() for r in results],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 1 if any(r.status == "failed" for r in results) else 0


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    sys.exit(main())
