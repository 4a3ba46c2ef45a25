#!/usr/bin/env bash
# Create .venv-torch-VERSION: dcpstore under torch VERSION instead of the
# release constraints.txt pins (2.13.0, in .venv), for the ends of the torch
# range pyproject.toml declares; .ci/run tests each end in one (it says what
# runs where). Usage: scripts/setup-torch.sh 2.14.1
#
# torch comes from the registry, pinned. PyPI's Linux wheels of torch are the
# CUDA builds: they run on CPU, but libtorch_cuda.so must load, so they bring
# the nvidia-* libraries they declare (some GB). --no-compile: byte-compiling
# every module of torch and its deps on install costs ~40 s a venv; Python
# compiles the few a run imports. The other pins hold (constraints.txt less
# its torch line). Installed with dcpstore: its backends (the all extra) and
# what the subset .ci/run picks needs, not the whole dev extra: torchtitan 0.3
# requires torch>=2.11 (through torch-checkpointing), which a floor below
# that cannot have. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/setup-torch.sh TORCH_VERSION}
VENV=.venv-torch-$VERSION
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# constraints.txt pins torch (and would pin torchvision, torchaudio or triton,
# which move with it): this venv's torch replaces that pin.
grep -v -E '^(torch|torchvision|torchaudio|triton)==' constraints.txt >"$VENV/constraints.txt"
pip_() { "$VENV/bin/python" -m pip "$@"; }
pip_ install -q --no-compile -c "$VENV/constraints.txt" "torch==$VERSION"
# The editable install writes dcpstore.egg-info into this checkout: .ci/run runs
# this script for both ends beside scripts/setup.sh, and each takes its turn.
locked() { if command -v flock >/dev/null; then flock pyproject.toml "$@"; else "$@"; fi; }
locked "$VENV/bin/python" -m pip install -q --no-compile -c "$VENV/constraints.txt" \
  "torch==$VERSION" -e ".[all,bench,crt]" "s3torchconnector[dcp]" "moto[server]" pytest pytest-timeout hypothesis
# The venv runs the release it is named for (a local tag such as +cu128 aside).
"$VENV/bin/python" -c "
import sys, torch
assert torch.__version__.split('+')[0] == sys.argv[1], (sys.argv[1], torch.__version__)" "$VERSION"
