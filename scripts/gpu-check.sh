#!/usr/bin/env bash
# GPU check: the cuda-marked tests (tests/integration/test_cuda.py),
# benchmarks/gpu_stage.py, the local disk against its raw writer (dcpstore
# bench --limit) and against stock DCP (benchmarks/local_costs.py) and
# benchmarks/interference.py on one GPU machine, then a
# summary. Sized to finish in under 12 minutes on one H200 (16 cores,
# 128 GiB; about 8 typically).
#
#   bash scripts/gpu-check.sh                  on the GPU machine (no network needed)
#   bash scripts/gpu-check.sh --fetch-wheels   beforehand, where PyPI is reachable: fill .whl/
#                                              (add --with-s3: also boto3 + moto, ~30 MB, for S3 rows)
#   bash scripts/gpu-check.sh --dry-run        anywhere: the plumbing on a CPU, nothing measured
#
# The GPU machine brings Python 3.12 and a CUDA build of torch (2.11+) with
# pytest, hypothesis, numpy, psutil and tqdm, but no network. The rest travels
# as cp312 manylinux wheels in the git-ignored .whl/ (--fetch-wheels) and is
# installed into /tmp/site, put first on PYTHONPATH; dcpstore runs from this
# checkout. Logs and JSON go to $OUT when it is set (the device tool returns
# what is there), else to .out/gpu-check/. Exit status: 0 when every cuda test
# passed and both benchmarks ran (goals are reported, not enforced). Set
# DCPSTORE_GIT_COMMIT to the commit you sent: the machine's copy of the
# checkout may carry no git directory, or a stale one, and the results name
# the commit they measured.
set -uo pipefail
cd "$(dirname "$0")/.."

# What dcpstore needs on that machine beyond its image (KINDS.md lists the
# image): crc32c (a dependency), awscrt (the crt extra: the CRC32C a GPU node's
# CPU folds fastest), NVRx for the nvrx engine, and defusedxml (an
# NVRx requirement). NVRx's other requirements are in the image (psutil,
# packaging, pyyaml, nvidia-ml-py, which provides the pynvml module; the
# 'pynvml' distribution itself is only a redirector to it). py-spy (a static
# binary) samples the GIL for the interference benchmark.
WHEELS=(crc32c==2.9.post0 awscrt==0.36.0 nvidia-resiliency-ext==0.4.1 defusedxml==0.7.1 py-spy==0.4.3)
# --with-s3: the S3 rows of the interference benchmark need boto3 and a moto
# server; fetched with their dependencies into .whl/s3/ and put on the path
# of that benchmark only (so they never shadow the image's packages elsewhere).
S3_WHEELS=(boto3==1.43.117 botocore==1.43.117 "moto[s3]==5.2.5" flask flask-cors)
SITE=/tmp/site
SITE_S3=/tmp/site-s3
# Time plan (under 12 minutes at most): wheels and environment ~15 s, the
# cuda tests at most TEST_TIMEOUT (each test at most 100 s, so one hang costs
# one test), gpu_stage.py stops starting sizes at BENCH_BUDGET and is killed at
# BENCH_TIMEOUT, the local disk's rows at LOCAL_DISK_TIMEOUT and
# LOCAL_COSTS_TIMEOUT, interference.py
# likewise at INTERFERENCE_BUDGET / INTERFERENCE_TIMEOUT. Typical: about 8 minutes.
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-200}
BENCH_BUDGET=${GPU_CHECK_BENCH_BUDGET:-180}
BENCH_TIMEOUT=$((BENCH_BUDGET + 50))
# The interference benchmark starts no row and no repeat past its budget;
# killed at its timeout (a checkpoint process per executor takes ~20 s to start).
# Its rows include "dcpstore default (engine='auto')" per target beside every
# explicit engine, so each GPU run checks what engine="auto" chooses there.
INTERFERENCE_BUDGET=${GPU_CHECK_INTERFERENCE_BUDGET:-100}
INTERFERENCE_TIMEOUT=$((INTERFERENCE_BUDGET + 80))
# The local disk's save and load beside the raw writer's (about a minute on NVMe).
LOCAL_DISK_TIMEOUT=${GPU_CHECK_LOCAL_DISK_TIMEOUT:-120}
# The same disk against stock DCP, a clone and a CRC pass (local_costs.py; about 30 s on NVMe).
LOCAL_COSTS_TIMEOUT=${GPU_CHECK_LOCAL_COSTS_TIMEOUT:-120}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

dry_run=0
fetch=0
with_s3=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --fetch-wheels) fetch=1 ;;
    --with-s3) with_s3=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument: $arg" >&2; usage >&2; exit 2 ;;
  esac
done

if [ "$fetch" = 1 ]; then
  mkdir -p .whl
  platforms=()
  for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64; do
    platforms+=(--platform "$p")
  done
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}" || exit 1
  if [ "$with_s3" = 1 ]; then
    mkdir -p .whl/s3
    "${PYTHON:-python3}" -m pip download --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d .whl/s3 "${S3_WHEELS[@]}" || exit 1
  fi
  exit 0
fi

PY=${PYTHON:-python3}
if [ "$dry_run" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
fi
OUT_DIR=${OUT:-$PWD/.out/gpu-check}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# One node: keep NCCL and gloo on the loopback interface unless told otherwise.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
started=$(date +%s)

if [ "$dry_run" = 1 ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu-check.sh: no wheels in .whl/ (run 'bash scripts/gpu-check.sh --fetch-wheels' where PyPI is reachable)" >&2
    exit 1
  fi
  echo "== installing $(ls .whl/*.whl | wc -l) carried wheel(s) into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  [ -x "$SITE/bin/py-spy" ] && export DCPSTORE_PYSPY="$SITE/bin/py-spy"
  if ls .whl/s3/*.whl >/dev/null 2>&1; then
    echo "== installing $(ls .whl/s3/*.whl | wc -l) S3 wheel(s) into $SITE_S3 (interference benchmark only)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_S3" .whl/s3/*.whl \
      || echo "gpu-check.sh: the S3 wheels did not install; the interference benchmark runs without S3 rows" >&2
  fi
fi

echo "== environment"
"$PY" scripts/gpu_check.py env "$OUT_DIR" || { echo "gpu-check.sh: dcpstore cannot be imported here" >&2; exit 1; }

echo "== cuda tests (timeout ${TEST_TIMEOUT}s)"
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 100)
timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest tests/integration/test_cuda.py -m cuda -q -rA "${per_test[@]}" \
  --junitxml="$OUT_DIR/cuda-tests.xml" 2>&1 | tee "$OUT_DIR/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmarks/gpu_stage.py (budget ${BENCH_BUDGET}s)"
bench_args=(--json "$OUT_DIR/gpu_stage.json" --budget-s "$BENCH_BUDGET")
[ "$dry_run" = 1 ] && bench_args+=(--dry-run)
timeout -k 10 "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_stage.py "${bench_args[@]}" 2>&1 | tee "$OUT_DIR/gpu_stage.log"
bench_rc=${PIPESTATUS[0]}

# The local disk at its limit (issue 44): dcpstore's sync save and load beside
# the raw writer and reader on the same disk (GPU_CHECK_LOCAL_DIR: the
# machine's NVMe, or its fastest local disk), in one process, CPU seconds per
# GB included. Reported, not judged; a failure here fails nothing.
echo "== dcpstore bench --limit on the local disk (timeout ${LOCAL_DISK_TIMEOUT}s)"
local_dir=${GPU_CHECK_LOCAL_DIR:-$OUT_DIR/local-disk}
if [ "$dry_run" = 1 ]; then
  local_args=(--size 16MiB --tensors 4 --workers 2 --repeat 2)
else
  local_args=(--size 2GiB --tensors 16 --workers 4,8 --repeat 3)
fi
timeout -k 10 "$LOCAL_DISK_TIMEOUT" "$PY" -m dcpstore._impl.cli bench "$local_dir/bench" "${local_args[@]}" --limit -q \
  --json "$OUT_DIR/local_disk.json" 2>&1 | tee "$OUT_DIR/local_disk.log"

# The same disk's costs against their yardsticks (benchmarks/local_costs.py):
# the sync save against stock dcp.save, an async save against a clone, the
# load against the raw reader and a CRC32C pass, from a state in pinned host
# memory (a CUDA tensor's host copy; pageable on a dry run). Reported, not
# judged; a failure here fails nothing.
echo "== benchmarks/local_costs.py on the local disk (timeout ${LOCAL_COSTS_TIMEOUT}s)"
if [ "$dry_run" = 1 ]; then
  costs_args=(--size-mib 16 --tensors 4 --threads 2 --rounds 1 --source cpu)
else
  costs_args=(--size-mib 1024 --tensors 16 --threads 8 --rounds 2 --source pinned)
fi
mkdir -p "$local_dir"
timeout -k 10 "$LOCAL_COSTS_TIMEOUT" "$PY" benchmarks/local_costs.py "${costs_args[@]}" --root "$local_dir" \
  --label "gpu-check$([ "$dry_run" = 1 ] && echo ' dry run')" --json "$OUT_DIR/local_costs.json" 2>&1 |
  tee "$OUT_DIR/local_costs.log"

echo "== benchmarks/interference.py (budget ${INTERFERENCE_BUDGET}s)"
if [ "$dry_run" = 1 ]; then
  intf_args=(--device cpu --size 8MiB --tensors 8 --repeat 1 --targets local --only 'dcpstore (native|default)|process \+ dcpstore')
else
  intf_args=(--device cuda --size 1GiB --tensors 64 --repeat 2)
fi
intf_path=$PYTHONPATH
[ -d "$SITE_S3" ] && intf_path="$PYTHONPATH:$SITE_S3" && export PATH="$SITE_S3/bin:$PATH"  # moto_server
PYTHONPATH=$intf_path timeout -k 10 "$INTERFERENCE_TIMEOUT" "$PY" benchmarks/interference.py "${intf_args[@]}" \
  --budget-s "$INTERFERENCE_BUDGET" --label "gpu-check$([ "$dry_run" = 1 ] && echo ' dry run')" \
  --json "$OUT_DIR/interference.json" 2>&1 | tee "$OUT_DIR/interference.log"
intf_rc=${PIPESTATUS[0]}

summary_args=(--tests-rc "$tests_rc" --bench-rc "$bench_rc" --interference-rc "$intf_rc")
[ "$dry_run" = 1 ] && summary_args+=(--dry-run)
"$PY" scripts/gpu_check.py summary "$OUT_DIR" "${summary_args[@]}"
rc=$?
echo "gpu-check: $(($(date +%s) - started)) s; results in $OUT_DIR"
exit $rc
