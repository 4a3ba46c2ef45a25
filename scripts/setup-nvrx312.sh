#!/usr/bin/env bash
# Create .venv312 (Python 3.12) for the Megatron/NVRx tests against NVIDIA
# Resiliency Extension 0.6.0 and 0.7.0, and unpack those two releases side by
# side into .nvrx/0.6.0 and .nvrx/0.7.0; a test run picks one with
# PYTHONPATH=.nvrx/<release> (.ci/run does). NVRx 0.4.1 is tested in .venv
# (Python 3.11, scripts/setup.sh).
#
# Why not `pip install nvidia-resiliency-ext==0.6.0`: 0.6 and 0.7 are published
# only as cp312 wheels tagged manylinux_2_39, and this machine's glibc is 2.36,
# so pip refuses them. Their tag is owed to one compiled module
# (nvrx_cupti_module, the straggler detector's CUPTI binding); the package
# dcpstore uses, nvidia_resiliency_ext.checkpointing, is pure Python and imports
# only torch, numpy and psutil. So the wheels are downloaded for that platform
# with --no-deps and unpacked (a wheel is a zip; its .dist-info comes along,
# so importlib.metadata still finds the release), and the checkpointing
# package's runtime deps are installed into .venv312 by the ordinary route.
# Two releases cannot share one site-packages, hence one target dir each.
#
# torch: PyPI has only the CUDA build for cp312 (the CPU wheels on disk are
# cp311; pytorch's own CPU index is not reachable here); it runs on CPU. Its
# version is constraints.txt's pin. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
# A pyenv shim named python3.12 exists whether or not 3.12 is selected: ask
# the interpreter itself, not the PATH.
works() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }
PY=${PYTHON312:-python3.12}
if ! works "$PY"; then
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    works "$candidate" && PY=$candidate
  done
fi
if ! works "$PY"; then
  echo "setup-nvrx312.sh needs Python 3.12: none on PATH or under pyenv; set PYTHON312=/path/to/python3.12" >&2
  exit 1
fi
NVRX_RELEASES=(0.6.0 0.7.0)

if [ ! -x .venv312/bin/python ]; then
  "$PY" -m venv .venv312
  .venv312/bin/python -m pip install -q --upgrade pip
fi
pip_() { .venv312/bin/python -m pip "$@"; }
pip_ install -q -c constraints.txt "torch==2.13.0"
# dcpstore with the backends the Megatron tests save to (local, S3, MSC), the
# S3 test server, pytest, and what NVRx's checkpointing package imports
# besides torch (numpy comes with dcpstore; psutil NVRx's writer calls).
# .ci/run runs this beside setup.sh: one editable install at a time writes dcpstore.egg-info.
locked() { if command -v flock >/dev/null; then flock pyproject.toml "$@"; else "$@"; fi; }
locked .venv312/bin/python -m pip install -q -c constraints.txt -e ".[s3,msc]" "moto[server]" pytest pytest-timeout psutil pyyaml

for release in "${NVRX_RELEASES[@]}"; do
  target=.nvrx/$release
  if [ -f "$target/.complete" ]; then continue; fi
  rm -rf "$target" "$target.download"
  mkdir -p "$target.download"
  pip_ download -q --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
    --python-version 3.12 --implementation cp -d "$target.download" "nvidia-resiliency-ext==$release"
  .venv312/bin/python - "$target.download" "$target" <<'EOF'
import pathlib, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("nvidia_resiliency_ext-*.whl")
zipfile.ZipFile(wheel).extractall(dest)
EOF
  rm -rf "$target.download"
  touch "$target/.complete"  # only a whole unpack counts: a killed run starts this release over
done

# Each release imports from its own directory, with its own version.
for release in "${NVRX_RELEASES[@]}"; do
  PYTHONPATH=.nvrx/$release .venv312/bin/python -c "
import sys, importlib.metadata as md
import nvidia_resiliency_ext.checkpointing.async_ckpt.core as core
import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async
import nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver
want, got = sys.argv[1], md.version('nvidia-resiliency-ext')
assert got == want and '.nvrx/' + want in core.__file__, (want, got, core.__file__)
" "$release"
done
