"""The Python half of scripts/gpu-check.sh: what the machine is, and the summary.

    python scripts/gpu_check.py env OUT_DIR
        write OUT_DIR/env.json (interpreter, torch and CUDA, the GPU, host
        memory and cores, the carried packages, which record writer this
        torch allows) and print it; exit 1 if dcpstore cannot be imported.
    python scripts/gpu_check.py summary OUT_DIR --tests-rc N --bench-rc N [--interference-rc N] [--dry-run]
        read env.json, cuda-tests.xml (pytest's JUnit report),
        gpu_stage.json and interference.json, write OUT_DIR/summary.json,
        print a short table; exit 0 only if the tests passed and the
        benchmarks ran.

Nothing here needs a GPU: the dry run (``gpu-check.sh --dry-run``) runs both
on a CPU box, which is how tests/ci/test_gpu_check.py covers them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

#: The oldest torch the GPU machine is known to run; dcpstore must work there.
MIN_TORCH = (2, 11)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _host_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    """The commit measured: ``DCPSTORE_GIT_COMMIT`` where the sender of this
    copy set it (the copy's own git directory may be missing or stale),
    else git's answer."""
    given = os.environ.get("DCPSTORE_GIT_COMMIT")
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _nccl_version() -> str | None:
    import torch

    if not torch.distributed.is_nccl_available():
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def collect_env() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "host_memory_bytes": _host_memory_bytes(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_at_least": ".".join(map(str, MIN_TORCH)),
        "torch_ok": _version_tuple(torch.__version__) >= MIN_TORCH,
        "cuda_available": torch.cuda.is_available(),
        "commit": _git_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
            nccl=_nccl_version(),
        )
    for name in ("crc32c", "awscrt", "nvidia-resiliency-ext", "pytest", "hypothesis", "numpy"):
        env[f"pkg:{name}"] = _dist_version(name)
    try:
        import crc32c

        env["crc32c_hardware"] = bool(getattr(crc32c, "hardware_based", False))
        import dcpstore
        from dcpstore._impl.engines import nvrx
        from dcpstore._impl.util.checksum import CRC32C_LIBRARY

        env["crc32c_library"] = CRC32C_LIBRARY
        from dcpstore._impl.format.record import record_saver

        env["dcpstore"] = dcpstore.__version__
        env["dcpstore_path"] = os.path.dirname(dcpstore.__file__)
        env["nvrx"] = nvrx.import_error() or "importable"
        env["record_writer"] = record_saver().__name__  # save_without_crc, or the slower torch.save fallback
    except Exception as e:  # reported, and the check stops: nothing else can run
        env["import_error"] = f"{type(e).__name__}: {e}"
    return env


def junit_counts(path: str) -> dict[str, Any]:
    """Counts from pytest's JUnit XML, and the names of the tests that did
    not pass (failed, errored, or skipped with the reason)."""
    if not os.path.exists(path):
        return {"found": False}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"found": True, "tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    not_passed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                not_passed.append({"test": case.get("name"), "outcome": kind, "message": message})
    counts["not_passed"] = not_passed
    return counts


def _load_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (OSError, ValueError):
        return None


def interference_summary(out_dir: str, rc: int | None) -> dict[str, Any] | None:
    """interference.json's rows, as the summary shows them (None: the step did not run)."""
    if rc is None:
        return None
    doc = _load_json(os.path.join(out_dir, "interference.json"))
    keys = (
        "name",
        "target",
        "executor",
        "status",
        "reason",
        "blocked_s",
        "save_s",
        "baseline_s",
        "lost_s",
        "peak_inflation",
        "lost_s_per_gb",
        "cpu_threads_s_per_gb",
        "cpu_children_s_per_gb",
        "gil_s_per_gb",
        "gil_note",
    )
    return {
        "rc": rc,
        "ok": rc == 0 and doc is not None,
        "describe": (doc or {}).get("meta", {}).get("describe"),
        "rows": [{k: r.get(k) for k in keys} for r in (doc or {}).get("results", [])],
    }


def summarise(
    out_dir: str, tests_rc: int, bench_rc: int, dry_run: bool, interference_rc: int | None = None
) -> dict[str, Any]:
    env = _load_json(os.path.join(out_dir, "env.json")) or {}
    tests = junit_counts(os.path.join(out_dir, "cuda-tests.xml"))
    bench = _load_json(os.path.join(out_dir, "gpu_stage.json"))
    tests_ok = (
        tests_rc == 0 and tests.get("found", False) and tests.get("failures", 1) == 0 and tests.get("errors", 1) == 0
    )
    if not dry_run:  # on a GPU every cuda test must have run, not been skipped
        tests_ok = tests_ok and tests.get("skipped", 1) == 0 and tests.get("passed", 0) > 0
    bench_ok = bench_rc == 0 and bench is not None
    interference = interference_summary(out_dir, interference_rc)
    return {
        "dry_run": dry_run,
        "ok": bool(tests_ok and bench_ok and (interference is None or interference["ok"])),
        "interference": interference,
        "env": env,
        "tests": {"rc": tests_rc, "ok": bool(tests_ok), **tests},
        "benchmark": {
            "rc": bench_rc,
            "ok": bench_ok,
            "goals": (bench or {}).get("goals"),
            "staging": [
                {k: r[k] for k in ("bytes", "stage_gbps", "limit_gbps", "ratio", "stage_first_s")}
                | {"limit": f"{r['limit']['layout']}, {r['limit']['streams']} stream(s)"}
                for r in (bench or {}).get("staging", [])
            ],
            "blocked": [
                {
                    "bytes": r["bytes"],
                    "best_dcp": r.get("best_dcp"),
                    "ratio_vs_best_dcp": r.get("ratio_vs_best_dcp"),
                    "ratio_vs_dcp_default": r.get("ratio_vs_dcp_default"),
                    "steady_s": {x["name"]: x.get("steady_s") for x in r["rows"]},
                }
                for r in (bench or {}).get("blocked", [])
            ],
            "skipped": (bench or {}).get("skipped", []),
            "pinned_overhead": (bench or {}).get("pinned_overhead"),
        },
    }


def print_summary(s: dict[str, Any]) -> None:
    env, tests, bench = s["env"], s["tests"], s["benchmark"]
    print("=" * 72)
    print(
        f"GPU check{' (DRY RUN: CPU plumbing only, nothing measured)' if s['dry_run'] else ''}: {'OK' if s['ok'] else 'FAILED'}"
    )
    print(
        f"  machine: {env.get('gpu', 'no GPU')}, {env.get('cpus')} cores, python {env.get('python')}, "
        f"torch {env.get('torch')} (cuda {env.get('torch_cuda')}), commit {str(env.get('commit'))[:12]}"
    )
    print(
        f"  nvrx: {env.get('nvrx')}; crc32c {env.get('pkg:crc32c')} (hardware: {env.get('crc32c_hardware')}, checksums by {env.get('crc32c_library')}); record writer: {env.get('record_writer')}"
    )
    if not env.get("torch_ok", True):
        print(f"  WARNING: torch {env.get('torch')} is older than {env.get('torch_at_least')}")
    if tests.get("found"):
        print(
            f"  cuda tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
            f"{tests['skipped']} skipped (rc {tests['rc']})"
        )
        for item in tests["not_passed"][:12]:
            print(f"    {item['outcome']:8} {item['test']}: {item['message']}")
    else:
        print(f"  cuda tests: no report (rc {tests['rc']})")
    for row in bench["staging"]:
        print(
            f"  staging {row['bytes'] / 2**30:7.3f} GiB: {row['stage_gbps']:6.2f} GB/s vs pinned copy "
            f"{row['limit_gbps']:6.2f} GB/s ({row['limit']}) = {row['ratio']:.2f}x"
        )
    for row in bench["blocked"]:
        ratio = row["ratio_vs_best_dcp"]
        print(
            f"  blocked {row['bytes'] / 2**30:7.3f} GiB: dcpstore / best dcp.async_save ({row['best_dcp']}) = "
            + (f"{ratio:.2f}x" if ratio is not None else "not measured")
        )
    overhead = bench.get("pinned_overhead")
    if overhead:
        print(
            f"  pinned host memory held by staging: {overhead['ratio']:.2f}x the state's bytes (tensors of {overhead['tensor_mib']} MiB)"
        )
    for name, g in (bench["goals"] or {}).items():
        verdict = "not judged" if g["met"] is None else ("MET" if g["met"] else "MISSED")
        worst = "-" if g["worst"] is None else f"{g['worst']:.2f}x"
        print(f"  goal {name}: {verdict} (worst {worst}; goal {g['goal']})")
    if bench["skipped"]:
        print(f"  skipped for time: {bench['skipped']}")
    if not bench["ok"]:
        print(f"  benchmark did not finish (rc {bench['rc']})")
    intf = s.get("interference")
    if intf is not None:
        print(f"  interference: {intf.get('describe') or 'no results'}")
        for r in intf["rows"]:
            if r["status"] != "ok":
                print(f"    {r['name']} -> {r['target']}: {r['status']}: {r['reason']}")
                continue
            gil = f"{r['gil_s_per_gb']:.3f}" if r.get("gil_s_per_gb") is not None else (r.get("gil_note") or "-")
            print(
                f"    {r['name']} -> {r['target']} ({r['executor']}): lost {r['lost_s']:.3f} step-s, peak "
                f"{r['peak_inflation']:.2f}x, blocked {r['blocked_s']:.3f} s; per GB: CPU {r['cpu_threads_s_per_gb']:.2f} "
                f"threads / {r['cpu_children_s_per_gb']:.2f} children, GIL {gil}"
            )
        if not intf["ok"]:
            print(f"  interference benchmark did not finish cleanly (rc {intf['rc']})")
    print("=" * 72)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="env and summary steps of scripts/gpu-check.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("out_dir")
    m = sub.add_parser("summary")
    m.add_argument("out_dir")
    m.add_argument("--tests-rc", type=int, required=True)
    m.add_argument("--bench-rc", type=int, required=True)
    m.add_argument("--interference-rc", type=int)
    m.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "env":
        env = collect_env()
        with open(os.path.join(args.out_dir, "env.json"), "w") as f:
            json.dump(env, f, indent=1)
        print(json.dumps(env, indent=1))
        return 1 if "import_error" in env else 0
    summary = summarise(args.out_dir, args.tests_rc, args.bench_rc, args.dry_run, args.interference_rc)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print_summary(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
