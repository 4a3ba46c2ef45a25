"""The limit rows: the sweep's points, the best of a sweep, ratios against it,
the comparison's targets that use them, and ``dcpstore bench --limit`` on a
real disk and a real (moto) S3 endpoint. Also the scale simulation, end to
end on a few ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpstore.bench.limits import SWEEP_CONNECTIONS, best_limits, limit_ratios, pieces, sweep_points
from s3_server import S3Endpoint
from test_cli import run_cli

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(1, 64 << 30),
    objects=st.integers(1, 8),
    parts=st.lists(st.sampled_from([5, 8, 16, 32, 64, 128]), min_size=1, max_size=4, unique=True),
)
def test_sweep_points_cover_each_split_up_to_enough_connections(nbytes: int, objects: int, parts: list[int]) -> None:
    part_sizes = [p * MiB for p in parts]
    points = sweep_points(nbytes, objects, SWEEP_CONNECTIONS, part_sizes)
    assert len(points) == len(set(points))
    by_part: dict[int, list[int]] = {}
    for c, p in points:
        by_part.setdefault(p, []).append(c)
    # One part size per distinct split of the bytes (the smallest that gives it).
    splits = {pieces(nbytes, objects, p) for p in part_sizes}
    assert sorted(pieces(nbytes, objects, p) for p in by_part) == sorted(splits)
    for p, conns in by_part.items():
        assert p == min(q for q in part_sizes if pieces(nbytes, objects, q) == pieces(nbytes, objects, p))
        n = pieces(nbytes, objects, p)
        # Connection counts in order, up to the first that covers every piece.
        assert conns == sorted(conns) and conns == list(SWEEP_CONNECTIONS[: len(conns)])
        assert all(c < n for c in conns[:-1])
        assert conns[-1] >= n or conns[-1] == max(SWEEP_CONNECTIONS)


def _row(name: str, group: str, w: float | None, r: float | None, backend: str = "s3", status: str = "ok") -> dict:
    return {"name": name, "group": group, "backend": backend, "status": status, "write_gbps": w, "read_gbps": r}


def test_best_limits_per_direction_and_ratios_against_them() -> None:
    rows = [
        _row("raw c=4", "limit", 0.10, 0.30),
        _row("raw c=16", "limit", 0.20, 0.25),
        _row("raw broken", "limit", 9.0, 9.0, status="failed"),
        _row("clone", "reference", 50.0, None),
        _row("ours", "dcpstore", 0.18, 0.27),
        _row("peer", "peer", 0.05, None),
    ]
    best = best_limits(rows)
    assert best["write"]["name"] == "raw c=16" and best["read"]["name"] == "raw c=4"
    out = {r["name"]: r for r in limit_ratios(rows)}
    assert out["ours"]["write_vs_limit"] == pytest.approx(0.9) and out["ours"]["read_vs_limit"] == pytest.approx(0.9)
    assert out["ours"]["limit_write"] == "raw c=16" and out["ours"]["limit_read"] == "raw c=4"
    assert out["peer"]["read_vs_limit"] is None
    assert "write_vs_limit" not in out["raw c=4"]  # limit rows are not put against themselves
    assert best_limits([_row("ours", "dcpstore", 1.0, 1.0)]) == {}


def test_targets_take_the_best_limit_and_the_best_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import targets

    rows = [dict(r, bytes=10**9, write_cpu_s=c, read_cpu_s=c) for r, c in [
        (_row("raw c=4", "limit", 0.10, 0.30, "s3-wan"), 2.0),
        (_row("raw c=16", "limit", 0.20, 0.25, "s3-wan"), 4.0),
        (_row("raw local", "limit", 9.0, 9.0, "local"), 1.0),
        (_row("s3tc t=1", "peer", 0.05, 0.05, "s3-wan"), 1.0),
        (_row("s3tc t=8", "peer", 0.12, 0.05, "s3-wan"), 1.0),
        (_row("ours", "dcpstore", 0.18, 0.27, "s3-wan"), 5.0),
    ]]  # fmt: skip
    limit = targets.Target("t", "ours", f"{targets.LIMIT}s3-wan", "write_gbps", 0.85)
    got = targets.evaluate(limit, rows)
    assert got["ref"] == "raw c=16" and got["ratio"] == pytest.approx(0.9) and got["status"] == "met"
    cpu = targets.Target("t", "ours", f"{targets.LIMIT}s3-wan", "read_cpu_per_gb", 1.3)
    got = targets.evaluate(cpu, rows)  # the best GET row (c=4) and its CPU per GB
    assert got["ref"] == "raw c=4" and got["ratio"] == pytest.approx(2.5) and got["status"] == "missed"
    peer = targets.Target("t", "ours", f"{targets.BEST}s3tc", "write_gbps", 1.3)
    got = targets.evaluate(peer, rows)
    assert got["ref"] == "s3tc t=8" and got["ratio"] == pytest.approx(1.5) and got["status"] == "met"


def test_cli_bench_limit_on_a_disk(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    out_json = tmp_path / "r.json"
    out = run_cli("bench", str(root), "--size", "8MiB", "--tensors", "4", "--workers", "1,2", "--limit",
                  "--json", str(out_json), "-q", "--warm")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SAVE/LIMIT" in out.stdout and "LOAD/LIMIT" in out.stdout
    rows = json.loads(out_json.read_text())["summary"]
    assert [r["name"] for r in rows if r["group"] == "limit"] == [
        "raw write+fsync / read, 1 thread(s)", "raw write+fsync / read, 2 thread(s)"]  # fmt: skip
    best = max(r["write_gbps"] for r in rows if r["group"] == "limit")
    ours = next(r for r in rows if r["name"] == "dcpstore sync w=1")
    line = next(l for l in out.stdout.splitlines() if l.startswith("dcpstore sync w=1"))
    assert f"{ours['write_gbps'] / best:.2f}x" in line
    assert os.listdir(root) == []  # the limit rows' files are gone too


def test_cli_bench_limit_on_s3_sweeps_raw_boto3(s3_endpoint: S3Endpoint) -> None:
    prefix = "bench-limit"
    out = run_cli("bench", f"s3://{s3_endpoint.bucket}/{prefix}", "--size", "16MiB", "--tensors", "4",
                  "--workers", "2", "--limit", "-q")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # 16 MiB in 4 objects is 4 pieces at every part size: 1, 2 and 4 connections.
    for c in (1, 2, 4):
        assert f"raw PUT/GET (s3) c={c} part=8.0 MiB" in out.stdout
    assert "c=8 " not in out.stdout and "part=16.0 MiB" not in out.stdout
    line = next(l for l in out.stdout.splitlines() if l.startswith("dcpstore sync w=2"))
    assert line.count("x ") >= 2  # save/limit and load/limit
    left = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=f"{prefix}/")
    assert left.get("KeyCount", 0) == 0, left.get("Contents")


@pytest.mark.slow  # the scale model, run for real
def test_scale_simulation_counts_what_dcpstore_sends(tmp_path: Path) -> None:
    out_json = tmp_path / "sim.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "scale_sim.py"), "--ranks", "1,4", "--size", "24MiB", "--tensors", "4",
         "--workers", "2", "--spread", "1,4", "--json", str(out_json), "--quiet"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    every = json.loads(out_json.read_text())["points"]
    points = {p["ranks"]: p for p in every if p["extra"]["spread"] == 1}
    spread = {p["ranks"]: p["model"] for p in every if p["extra"]["spread"] == 4}
    one, four = points[1]["model"], points[4]["model"]
    # Each rank writes 2 files of 12 MiB: multipart in 8 MiB parts (2 each).
    assert one["by_kind"]["UploadPart"] == 4 and four["by_kind"]["UploadPart"] == 16
    assert one["by_kind"]["CreateMultipartUpload"] == 2 and four["by_kind"]["CompleteMultipartUpload"] == 8
    assert four["data_bytes"] >= 4 * 24 * MiB
    # One prefix: every rank's files and the commit objects lie under the checkpoint's.
    assert one["prefixes"] == four["prefixes"] == 1 and four["busiest_prefix"] == "run1/step100/"
    assert four["busiest_rate"] > one["busiest_rate"]
    assert points[4]["measured"]["manifest_bytes"] > points[1]["measured"]["manifest_bytes"]
    assert four["write_s_throttled"] >= four["write_s"] > 0
    # Spread over 4 prefixes: the same requests, each rank's data under its own
    # prefix, the commit objects under the checkpoint's; the busiest prefix's
    # data writes drop to one rank's.
    assert spread[4]["requests"] == four["requests"] and spread[4]["prefixes"] == 5
    assert {p.rsplit("/", 2)[-2] for p in spread[4]["write_prefixes"]} >= {"p0", "p1", "p2", "p3"}
    assert spread[4]["busiest_write_requests"] * 4 <= four["busiest_write_requests"] + 8
