"""Running the dcpstore CLI in-process, as a test would run it as a command.

Shared by tests/integration/test_cli.py and the suites that check what the
CLI says about their checkpoints (tests/bench, tests/frameworks).
"""

from __future__ import annotations

import contextlib
import io
import subprocess

from dcpstore._impl.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in-process (torch imports once), capturing its output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
