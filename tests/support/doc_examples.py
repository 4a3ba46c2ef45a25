"""The code blocks of README.md and docs/, and the runner that runs them
(tests/docs/test_doc_examples.py says what is checked).

A fenced block's language says what it is:

* ``python``: run, in a fresh namespace, in a directory of its own;
* ``bash``: run with ``bash -euo pipefail`` (every line a user types must
  exit 0), the venv's ``bin`` first on ``PATH``;
* ``yaml``: parsed, and every ``dcpstore.…`` name in it imported (a config
  that names a class must name one that exists);
* ``text`` (a listing, such as the layout tree): not code, nothing to run.

Any other language, or none, is refused: a block the test cannot classify
would be one nobody checks.

The nearest non-blank line before a fence may be an HTML comment (shown
nowhere but in the page's source) that says what the block needs:

* ``<!-- setup: NAME ... -->``: run :data:`SETUPS` ``NAME`` first, in the
  block's namespace and directory (``slow``: run the block only in the slow
  run, ``pytest -m slow``);
* ``<!-- fragment: REASON -->``: not runnable alone, for the reason given (a
  Python fragment must still compile).

Every block runs with a local S3 endpoint (moto) whose buckets are
:data:`BUCKETS`, and with the example roots :data:`ROOTS` (``/ckpt``,
``/nvme``) mapped into the page's temporary directory: the pages write
``/ckpt/run1/step100`` as a user would, and the test never writes there.

Run as a script (``python doc_examples.py LOG``) it is the runner: it runs
the pages it is sent, one after another, each page's blocks in order, each
block in a fresh namespace and directory; a block that fails does not stop
the next. One interpreter serves every page (torch is imported once), but a
page whose set-up changes the process for good (Lightning's starts a
process group: :data:`ISOLATED`) gets an interpreter of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


#: The pages whose code blocks are tested.
def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


RUN = {"python", "bash"}
CONFIG = {"yaml"}
LISTING = {"text"}
LANGUAGES = RUN | CONFIG | LISTING

#: Absolute example roots the pages use, mapped into the page's temporary directory.
ROOTS = ("/ckpt", "/nvme")
_ROOT_RE = re.compile(r"(?<![\w./:~-])(/(?:ckpt|nvme))(?=[/\s\"'`]|$)", re.M)
#: Buckets the S3 examples name; created empty for each page.
BUCKETS = ("bucket",)

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*(setup|fragment):\s*(.*?)\s*-->$")


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    source: str
    setup: list[str] = field(default_factory=list)
    fragment: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def slow(self) -> bool:
        return "slow" in self.setup


def extract(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, with the marker before each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code fence is never closed")
        block = Block(str(path.relative_to(ROOT)), start + 1, fence.group(1), "\n".join(lines[start + 1 : j]) + "\n")
        before = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = _MARK.match(before)
        if mark and mark.group(1) == "setup":
            block.setup = mark.group(2).split()
        elif mark:
            block.fragment = mark.group(2)
        blocks.append(block)
        i = j + 1
    return blocks


def map_roots(source: str, tmp: str) -> str:
    return _ROOT_RE.sub(lambda m: tmp + m.group(1), source)


# -- what blocks need ----------------------------------------------------------------

#: Python run before a block, in its namespace and directory: what the page's
#: text around the block has already introduced.
SETUPS: dict[str, str] = {
    # A model and optimizer with state, and the state dict the pages save.
    "state": """
import torch, dcpstore
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).sum().backward()
optim.step()
step = 100
state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
uri = "/ckpt/run1/step100"
""",
    # A checkpoint holding an instance of a class of the user's own (mypkg.Config).
    "mypkg": """
import sys, pathlib, dataclasses, torch, dcpstore
pathlib.Path("mypkg.py").write_text(
    "import dataclasses\\n@dataclasses.dataclass\\nclass Config:\\n    lr: float = 0.1\\n")
sys.path.insert(0, ".")
import mypkg
uri = "/ckpt/run1/step100"
dcpstore.save({"w": torch.ones(4), "cfg": mypkg.Config(lr=0.5)}, uri)
state = {"w": torch.zeros(4), "cfg": None}
""",
    # What the CLI page lists: a checkpoint under /ckpt/run1, and a tiered
    # manager's step under s3://bucket/run1 with its local tier in /nvme/run1.
    "cli": """
import torch, dcpstore
dcpstore.save({"w": torch.arange(8.0), "step": 100}, "/ckpt/run1/step100")
mgr = dcpstore.CheckpointManager("s3://bucket/run1", local_dir="/nvme/run1")
mgr.save({"w": torch.arange(8.0)}, 100)
mgr.close()
del mgr
""",
    # Lightning's names, a function that shards a model with FSDP2, and a model.
    "lightning": """
import torch
from torch.distributed.fsdp import fully_shard
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy

def parallelize_fn(model, device_mesh):
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
""",
    # Nothing to define: marks a page that needs the torch-checkpointing extra.
    "torch-checkpointing": "",
    # The Megatron config's name, as the page's text introduces it.
    "megatron": """
import dcpstore
from dcpstore.adapters.megatron import CheckpointConfig
""",
    # A backend of the reader's own: the tests' user-written one, over a temporary
    # directory (tests/integration/test_storage_contract.py runs the whole
    # contract on it, as the page's example does).
    "mystorage": """
import os, tempfile
from tests.support.user_backend import ROOT_VARIABLE, MirrorStorage as MyStorage
os.environ[ROOT_VARIABLE] = tempfile.mkdtemp()
""",
    # Not code: the block runs only in the slow run (``pytest -m slow``).
    "slow": "",
}

#: Set-ups after which the interpreter is not what the next page expects.
ISOLATED = {"lightning"}


# -- the runner (one page, in its own interpreter) ------------------------------------


def _finish(namespace: dict[str, Any]) -> None:
    """What a program's exit would report: close what the block left open
    (managers, savers, the per-process saver), so that a background save that
    failed fails the block instead of an exit hook's log line."""
    if "dcpstore._impl.engines.saver" not in sys.modules:
        return
    import dcpstore
    from dcpstore._impl.engines.saver import default_saver

    for value in list(namespace.values()):
        if isinstance(value, (dcpstore.CheckpointManager, dcpstore.AsyncSaver)):
            value.close()
    default_saver().close()


def _run_python(block: Block, namespace: dict[str, Any], tmp: str) -> None:
    for name in block.setup:
        exec(compile(map_roots(SETUPS[name], tmp), f"<setup {name}>", "exec"), namespace)
    # Padded so that a traceback's line numbers are the page's.
    code = compile("\n" * block.line + map_roots(block.source, tmp), block.page, "exec")
    with warnings.catch_warnings():
        # A deprecated form shown on a page would teach it: the block's own calls may not warn.
        warnings.filterwarnings("error", category=DeprecationWarning, module="doc_example")
        exec(code, namespace)
    _finish(namespace)


def _run_bash(block: Block, namespace: dict[str, Any], tmp: str) -> None:
    for name in block.setup:
        exec(compile(map_roots(SETUPS[name], tmp), f"<setup {name}>", "exec"), namespace)
    _finish(namespace)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", map_roots(block.source, tmp)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )


def run_page(blocks: list[Block], tmp: str) -> list[dict[str, Any]]:
    results = []
    home = os.getcwd()
    for block in blocks:
        workdir = Path(tmp) / f"block-{block.line}"
        workdir.mkdir(parents=True)
        os.chdir(workdir)
        namespace: dict[str, Any] = {"__name__": "doc_example"}
        error = None
        print(f"=== {block.where} ({block.lang})", flush=True)
        try:
            (_run_python if block.lang == "python" else _run_bash)(block, namespace, tmp)
        except BaseException:  # noqa: BLE001  (reported, and the next block still runs)
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
        finally:
            os.chdir(home)
            namespace.clear()
        results.append({"where": block.where, "error": error})
    return results


def serve(log_path: str) -> None:
    """Run pages as they are asked for: one request per line on stdin (a
    page's :func:`spec`), one line of outcomes back on stdout. What the blocks
    print goes to ``log_path``, never into the answers."""
    answers = os.fdopen(os.dup(1), "w")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for line in sys.stdin:
        request = json.loads(line)
        results = run_page([Block(**b) for b in request["blocks"]], request["tmp"])
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps(results) + "\n")
        answers.flush()
    # Asked for nothing more: leave without waiting for what an example left
    # behind (a framework's process group, a daemon thread).
    os._exit(0)


def spec(blocks: list[Block], tmp: str) -> str:
    """One page's request to :func:`serve`: one line of JSON."""
    return json.dumps({"tmp": tmp, "blocks": [asdict(b) for b in blocks]})


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        serve(sys.argv[1])
