#!/usr/bin/env bash
# Create .venv and install dcpstore with every backend and test dependency.
# Idempotent: a second run only checks. torch goes in first, with pip, so the
# CPU wheel is used (other resolvers fetch the multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
