"""The dcpstore CLI on real checkpoints, run as a separate process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata
from tests.support.cli_run import run_cli


def test_python_m_dcpstore_runs_the_cli_as_a_process(tmp_path) -> None:
    """``python -m dcpstore``: the command where the venv's ``bin`` is not on PATH.
    One process (each starts torch); what ``verify`` says of a whole
    checkpoint is asserted in-process below."""
    missing = subprocess.run(
        [sys.executable, "-m", "dcpstore", "verify", str(tmp_path / "step_9"), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # main() ran (its own message, no traceback) and its exit status came through.
    assert missing.returncode == 1, missing
    assert missing.stderr.startswith("dcpstore verify: no checkpoint at") and "step_9" in missing.stderr, missing
    assert "Traceback" not in missing.stderr, missing


@pytest.fixture
def root(tmp_path) -> str:
    state = {"w": torch.randn(256, 64), "opt": {"m": torch.zeros(10, dtype=torch.bfloat16)}, "step": 7}
    dcpstore.save(state, str(tmp_path / "step_1"), workers=2).result()
    dcpstore.save(state, str(tmp_path / "step_2"), workers=2).result()
    return str(tmp_path)


def test_ls_lists_committed_and_incomplete(root: str) -> None:
    os.unlink(os.path.join(root, "step_2", ".metadata"))
    out = run_cli("ls", root)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:-1]}  # header, note
    assert lines == {"step_1": "committed", "step_2": "incomplete"}
    as_json = json.loads(run_cli("ls", root, "--json").stdout)
    assert {e["path"]: e["committed"] for e in as_json} == {"step_1": True, "step_2": False}


def test_inspect_shows_keys_shapes_dtypes(root: str) -> None:
    out = run_cli("inspect", os.path.join(root, "step_1"), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["keys"]["w"] == {"kind": "tensor", "dtype": "float32", "shape": [256, 64], "bytes": 65536, "chunks": 1}
    assert info["keys"]["opt.m"]["dtype"] == "bfloat16"
    assert info["keys"]["step"] == {"kind": "object"}
    assert len(info["files"]) == 2 and all("crc32c" in f for f in info["files"].values())
    text = run_cli("inspect", os.path.join(root, "step_1")).stdout
    assert "(256, 64)" in text and "bfloat16" in text


def test_verify_ok_then_damaged(root: str) -> None:
    ck = os.path.join(root, "step_1")
    ok = run_cli("verify", ck, "-q")
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    victim = sorted(f for f in os.listdir(ck) if f.endswith(".distcp"))[0]
    with open(os.path.join(ck, victim), "r+b") as f:
        f.seek(300)
        b = f.read(1)
        f.seek(300)
        f.write(bytes([b[0] ^ 1]))
    bad = run_cli("verify", ck, "-q")
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    damaged = [line for line in lines if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and victim in damaged[0] and "checksum" in damaged[0], bad.stdout
    assert lines[-1].startswith("FAILED  1 problem(s)") and not any(line.startswith("OK") for line in lines)


def test_verify_missing_checkpoint_exit_code(tmp_path) -> None:
    out = run_cli("verify", str(tmp_path / "none"))
    assert out.returncode == 1
    assert "no checkpoint" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("older_than", ["nan", "-5", "soon"])
def test_gc_refuses_an_age_no_rule_can_compare(tmp_path, older_than: str) -> None:
    """NaN compares false with every age: a running save's fresh alive file
    would have counted as stale. Refused before anything is listed."""
    args = [sys.executable, "-m", "dcpstore", "gc", "--older-than", older_than, str(tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)  # argparse exits
    assert out.returncode == 2 and "--older-than" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_unknown_scheme_exit_code() -> None:
    out = run_cli("ls", "bogus://x/y")
    assert out.returncode == 2 and "bogus" in out.stderr and "Traceback" not in out.stderr


def test_gc_removes_only_incomplete(root: str) -> None:
    os.unlink(os.path.join(root, "step_2", ".metadata"))
    temp = os.path.join(root, "step_1", ".__0_0.distcp.dcpstore-tmp-abc")
    with open(temp, "wb") as f:
        f.write(b"partial")
    os.utime(temp, (time.time() - 600, time.time() - 600))  # a write that stopped 10 minutes ago
    dry = run_cli("gc", root, "--older-than", "0", "--dry-run")
    assert "would remove incomplete checkpoint step_2" in dry.stdout
    assert os.path.exists(os.path.join(root, "step_2"))
    kept = run_cli("gc", root)  # default: recent leftovers may belong to a running save
    assert "kept step_2" in kept.stdout
    out = run_cli("gc", root, "--older-than", "0")
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert sorted(os.listdir(os.path.join(root, "step_1"))) == [
        ".dcpstore.json",
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
    ]
    restored = {"w": torch.zeros(256, 64)}
    dcpstore.load(restored, os.path.join(root, "step_1"))
    assert restored["w"].abs().sum() > 0


def test_help_ls_and_gc_never_import_torch(root: str) -> None:
    """The commands that read no checkpoint content (``ls --local-dir``
    too) start without torch (seconds); how much faster is
    benchmarks/cli_startup.py's to measure."""
    code = (
        "import contextlib, io, sys\n"
        "import dcpstore\n"
        "from dcpstore._impl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        main(['--help'])\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        main(['ls', '--help'])\n"
        f"    assert main(['ls', {root!r}]) == 0\n"
        f"    assert main(['ls', {root!r}, '--local-dir', {root + '-local'!r}]) == 0\n"
        f"    assert main(['gc', {root!r}, '--dry-run']) == 0\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _torch_modules_imported_by(*argv: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``python -m dcpstore ARGV`` under ``-X importtime``: the process,
    and every torch module it imported."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dcpstore", *argv], capture_output=True, text=True, timeout=120
    )
    imported = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "dcpstore._impl.cli" in imported, out.stderr[-2000:]  # the trace is read: a torch import would show
    return out, [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_python_m_dcpstore_help_ls_and_gc_never_import_torch(root: str) -> None:
    for argv, says in (
        (["--help"], "usage: dcpstore"),
        (["ls", root], "step_2      committed"),
        (["gc", root, "--dry-run"], "nothing to clean up"),
    ):
        out, torch_modules = _torch_modules_imported_by(*argv)
        assert out.returncode == 0 and says in out.stdout, (argv, out.stdout, out.stderr[-2000:])
        assert torch_modules == [], (argv, torch_modules[:5])


def test_ls_of_a_missing_or_empty_root_exits_non_zero(tmp_path) -> None:
    for root in (tmp_path / "no-such-dir", tmp_path):
        out = run_cli("ls", str(root))
        assert out.returncode == 1, out.stdout
        assert f"nothing at {root}" in out.stderr and "no such directory" in out.stderr
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    out = run_cli("ls", str(tmp_path))
    assert out.returncode == 0 and "no checkpoints under" in out.stdout, out.stdout + out.stderr


def test_ls_and_inspect_say_what_they_count(root: str) -> None:
    ck = os.path.join(root, "step_1")
    ls = run_cli("ls", root)
    assert "FILES counts every file of a checkpoint: data files, .metadata, the manifest" in ls.stdout
    inspect = run_cli("inspect", ck)
    assert "data files only (besides them: .metadata and the .dcpstore.json manifest)" in inspect.stdout
    # The two counts differ by exactly what each says it leaves out or in.
    [entry] = [e for e in json.loads(run_cli("ls", root, "--json").stdout) if e["path"] == "step_1"]
    files = json.loads(run_cli("inspect", ck, "--json").stdout)["files"]
    assert entry["files"] == len(os.listdir(ck)) == len(files) + 2


def test_gc_given_the_checkpoint_itself_names_it(root: str) -> None:
    ck = os.path.join(root, "step_2")
    os.unlink(os.path.join(ck, ".metadata"))
    out = run_cli("gc", ck, "--older-than", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"removed incomplete checkpoint {ck}", out.stdout
    assert not os.path.exists(ck) or os.listdir(ck) == []


def _stock_checkpoint(path: str) -> dict:
    state = {
        "w": torch.randn(64, 32),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "step": 7,
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path)
    return state


def test_verify_checks_what_it_can_of_a_stock_dcp_checkpoint(tmp_path) -> None:
    ck = str(tmp_path / "stock")
    _stock_checkpoint(ck)
    out = run_cli("verify", ck, "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        out.stdout.startswith("OK  1 files")
        and "no checksums (written by stock DCP, or its integrity manifest is gone)" in out.stdout
    )
    assert "none (written by stock DCP, or its manifest is gone)" in run_cli("inspect", ck).stdout


def _item(path: str, fqn: str) -> tuple[str, int, int]:
    metadata, _ = read_checkpoint_metadata(dcpstore.open_storage(path))
    [(rel, offset, length)] = [
        (i.relative_path, i.offset, i.length) for index, i in metadata.storage_data.items() if index.fqn == fqn
    ]
    return os.path.join(path, rel), offset, length


def test_verify_finds_damage_in_a_stock_dcp_checkpoint(tmp_path) -> None:
    ck = str(tmp_path / "stock")
    _stock_checkpoint(ck)
    data, offset, length = _item(ck, "w")
    with open(data, "r+b") as f:  # the tensor record's zip header: no longer a record
        f.seek(offset)
        f.write(b"\0" * 64)
    bad = run_cli("verify", ck, "-q")
    assert bad.returncode == 1, bad.stdout
    [damaged] = [line for line in bad.stdout.splitlines() if line.startswith("DAMAGED")]
    assert "'w'" in damaged and "not a readable tensor record" in damaged, bad.stdout

    _stock_checkpoint(ck)  # whole again; then cut short
    data, offset, length = _item(ck, "w")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    cut = run_cli("verify", ck, "-q")
    assert cut.returncode == 1 and "extends past the end of the file" in cut.stdout, cut.stdout
