"""How long the ``dcpstore`` command takes to start, against ``import torch``.

    python benchmarks/cli_startup.py [--repeat 5]

Runs each command as a fresh process (best of ``--repeat``, interleaved so
that a busy machine slows all alike): ``python -c "import torch"``, then
``dcpstore --help``, ``ls`` and ``gc --dry-run`` on a small checkpoint root
it creates, and ``inspect`` (which needs torch, for comparison). Prints the
seconds and each command's ratio to ``import torch``; the target is a ratio
well under 0.5 for ``--help``, ``ls`` and ``gc``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time


def seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, torch, dcpstore; dcpstore.save({'w': torch.ones(4)}, sys.argv[1] + '/step_1').result()",
                root,
            ],
            check=True,
            capture_output=True,
        )
        cli = [sys.executable, "-m", "dcpstore._impl.cli"]
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            "dcpstore --help": [*cli, "--help"],
            "dcpstore ls": [*cli, "ls", root],
            "dcpstore gc --dry-run": [*cli, "gc", root, "--dry-run"],
            "dcpstore inspect (imports torch)": [*cli, "inspect", root + "/step_1"],
        }
        best = dict.fromkeys(commands, float("inf"))
        for _ in range(args.repeat):
            for name, cmd in commands.items():
                best[name] = min(best[name], seconds(cmd))
    base = best["import torch"]
    for name, s in best.items():
        print(f"{name:<34} {s:6.3f} s   {s / base:5.2f}x import torch")


if __name__ == "__main__":
    main()
