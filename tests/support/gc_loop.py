"""``dcpstore gc --older-than 0`` in a loop, in a process of its own, beside
the saves of a test (tests/processes/test_gc_races.py).

:func:`gc_loop` starts one child that runs the CLI's ``gc`` over each root
in turn, as fast as it can, until the block ends; it then stops the child
and returns how many rounds it ran (and every line it printed, which names
what it removed). The child inherits the environment (the S3 endpoint's
variables), so it reaches the same storage the test saves to.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

_CHILD = r"""
import os, sys
from dcpstore._impl.cli import main
stop, roots, extra = sys.argv[1], sys.argv[2].split("\n"), sys.argv[3:]
rounds = 0
while not os.path.exists(stop):
    for root in roots:
        code = main(["gc", "--older-than", "0", *extra, root])
        if code not in (0, 1):
            print(f"gc exit {code}", flush=True)
    rounds += 1
    print(f"round {rounds}", flush=True)
print(f"rounds {rounds}", flush=True)
"""


@dataclass
class GcLoop:
    rounds: int = 0
    output: list[str] = field(default_factory=list)

    @property
    def removed(self) -> list[str]:
        return [line for line in self.output if line.startswith("removed")]


@contextlib.contextmanager
def gc_loop(roots: Sequence[str], *extra: str, min_rounds: int = 3) -> Iterator[GcLoop]:
    """Run ``dcpstore gc --older-than 0 ROOT`` for each of ``roots`` in a loop
    until the block ends (at least ``min_rounds`` rounds, waited for at the
    end); the loop's report is filled in on exit."""
    result = GcLoop()
    with tempfile.TemporaryDirectory() as tmp:
        stop = os.path.join(tmp, "stop")
        out_path = os.path.join(tmp, "out")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, stop, "\n".join(roots), *extra], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            _wait_first_round(out_path, proc)
            yield result
            deadline = time.monotonic() + 120
            while _rounds_so_far(out_path) < min_rounds and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            open(stop, "w").close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with open(out_path) as f:
            result.output = f.read().splitlines()
    last = [line for line in result.output if line.startswith("rounds ")]
    assert proc.returncode == 0 and last, result.output[-20:]
    result.rounds = int(last[-1].split()[1])
    assert not [line for line in result.output if line.startswith(("gc exit", "Traceback", "dcpstore gc:"))], (
        result.output[-20:]
    )
    return None


def _rounds_so_far(path: str) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.startswith("round "))


def _wait_first_round(path: str, proc: subprocess.Popen[bytes]) -> None:
    """Until the child finished its first round (it runs, and gc is warm)."""
    deadline = time.monotonic() + 120
    while _rounds_so_far(path) == 0:
        assert proc.poll() is None, "the gc loop died before its first round"
        assert time.monotonic() < deadline, "the gc loop printed nothing in 120 s"
        time.sleep(0.05)
