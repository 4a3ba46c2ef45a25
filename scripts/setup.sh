#!/usr/bin/env bash
# Create .venv and install dcpstore with every backend and test dependency, and
# what builds the docs site (the dev extra includes the docs extra).
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
# The editable install writes dcpstore.egg-info into this checkout: scripts/setup-torch.sh,
# which .ci/run runs beside this script, takes the same lock on pyproject.toml.
locked() { if command -v flock >/dev/null; then flock pyproject.toml "$@"; else "$@"; fi; }
locked .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
# Megatron-Bridge 0.6.2 cannot be imported without CUDA; the tests compile the
# functions they need from its wheel's source, and megatron-core's allowlist
# from its wheel (tests/support/bridge_wheel.py). Downloaded, never installed.
for spec in "megatron-bridge==0.6.2" "megatron-core==0.19.2"; do
  name=${spec%%==*}; version=${spec##*==}
  if ! ls ".cache/wheels/${name//-/_}-${version}-"*.whl >/dev/null 2>&1; then
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform any -d .cache/wheels "$spec"
  fi
done
