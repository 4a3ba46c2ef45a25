"""The limit rows: the sweep's points, the best of a sweep, ratios against it,
the comparison's targets that use them, and ``dcpstore bench --limit`` on a
real disk and a real (moto) S3 endpoint. Also the scale simulation, end to
end on a few ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpstore._impl.bench.limits import (
    SWEEP_CONNECTIONS,
    best_limits,
    harness_verdicts,
    limit_ratios,
    pieces,
    sweep_points,
)
from tests.support.cli_run import run_cli
from tests.support.s3_server import S3Endpoint

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
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

    rows = [
        dict(r, bytes=10**9, write_cpu_s=c, read_cpu_s=c)
        for r, c in [
            (_row("raw c=4", "limit", 0.10, 0.30, "s3-wan"), 2.0),
            (_row("raw c=16", "limit", 0.20, 0.25, "s3-wan"), 4.0),
            (_row("raw local", "limit", 9.0, 9.0, "local"), 1.0),
            (_row("s3tc t=1", "peer", 0.05, 0.05, "s3-wan"), 1.0),
            (_row("s3tc t=8", "peer", 0.12, 0.05, "s3-wan"), 1.0),
            (_row("ours", "dcpstore", 0.18, 0.27, "s3-wan"), 5.0),
        ]
    ]
    limit = targets.Target("t", "ours", f"{targets.LIMIT}s3-wan", "write_gbps", 0.85)
    got = targets.evaluate(limit, rows)
    assert got["ref"] == "raw c=16" and got["ratio"] == pytest.approx(0.9) and got["status"] == "met"
    cpu = targets.Target("t", "ours", f"{targets.LIMIT}s3-wan", "read_cpu_per_gb", 1.3)
    got = targets.evaluate(cpu, rows)  # the best GET row (c=4) and its CPU per GB
    assert got["ref"] == "raw c=4" and got["ratio"] == pytest.approx(2.5) and got["status"] == "missed"
    peer = targets.Target("t", "ours", f"{targets.BEST}s3tc", "write_gbps", 1.3)
    got = targets.evaluate(peer, rows)
    assert got["ref"] == "s3tc t=8" and got["ratio"] == pytest.approx(1.5) and got["status"] == "met"


def test_a_section_is_network_bound_only_where_the_harness_passes_twice_its_best_row() -> None:
    """The harness self-test: per direction, the fastest shaping-off row
    against the fastest other row (any group); network-bound at 2x or more,
    else harness-bound; nothing said without harness rows, and failed rows
    count for neither side."""
    rows = [
        _row("harness c=16", "harness", 0.50, 0.30),
        _row("harness c=4", "harness", 0.40, 0.90),
        _row("harness broken", "harness", 9.0, 9.0, status="failed"),
        _row("raw c=16", "limit", 0.20, 0.35),
        _row("ours", "dcpstore", 0.24, 0.33),
    ]
    v = harness_verdicts(rows)
    assert (v["write"]["harness"], v["write"]["best"], v["write"]["bound"]) == ("harness c=16", "ours", "network")
    assert v["write"]["ratio"] == pytest.approx(0.5 / 0.24)
    assert (v["read"]["harness"], v["read"]["best"], v["read"]["bound"]) == ("harness c=4", "raw c=16", "network")
    assert harness_verdicts(rows, margin=3.0)["write"]["bound"] == "harness"
    assert harness_verdicts([r for r in rows if r["group"] != "harness"]) == {}
    assert "harness c=16" not in {r["name"] for r in best_limits(rows).values()}  # never a limit row


def test_targets_refuse_to_call_a_harness_bound_row_at_the_limit_and_see_no_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import targets

    def rows(harness_gbps: float) -> list[dict]:
        return [
            dict(r, bytes=10**9, write_cpu_s=1.0, read_cpu_s=1.0)
            for r in [
                _row("harness", "harness", harness_gbps, harness_gbps, "s3-wan-x"),
                _row("raw", "limit", 0.10, 0.10, "s3-wan-x"),
                _row("s3tc", "peer", 0.09, 0.05, "s3-wan-x"),
                _row("ours", "dcpstore", 0.095, 0.10, "s3-wan-x"),
            ]
        ]

    def target(words: str) -> targets.Target:
        (found,) = [t for t in targets.wan_targets("x") if words in t.title]
        return dataclasses.replace(found, ours="ours")

    limit, cpu = target("save >= 0.9x best raw PUT"), target("save client CPU")
    peer = dataclasses.replace(target("s3torchconnector"), ref=f"{targets.BEST}s3tc")
    got = targets.evaluate(limit, rows(0.15))  # the harness passes only 1.5x the best row
    assert got["status"] == "harness-bound" and got["ratio"] == pytest.approx(0.95), got
    assert "1.50x the best row" in got["why"]
    assert targets.evaluate(limit, rows(0.5))["status"] == "met"  # 5x: the network's limit
    assert targets.evaluate(cpu, rows(0.15))["status"] == "met"  # CPU per byte is not capped by the harness
    got = targets.evaluate(peer, rows(0.5))  # 1.3 x 0.09 is above the limit of 0.10
    assert got["status"] == "no room" and "1.17x the swept limit" in got["why"], got


def test_cli_bench_limit_on_a_disk(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    out_json = tmp_path / "r.json"
    out = run_cli(
        "bench",
        str(root),
        "--size",
        "8MiB",
        "--tensors",
        "4",
        "--workers",
        "1,2",
        "--limit",
        "--json",
        str(out_json),
        "-q",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SAVE/LIMIT" in out.stdout and "LOAD/LIMIT" in out.stdout
    rows = json.loads(out_json.read_text())["summary"]
    assert [r["name"] for r in rows if r["group"] == "limit"] == [
        "raw write+fsync / read, 1 thread(s)",
        "raw write+fsync / read, 2 thread(s)",
    ]
    best = max(r["write_gbps"] for r in rows if r["group"] == "limit")
    ours = next(r for r in rows if r["name"] == "dcpstore sync w=1")
    line = next(row for row in out.stdout.splitlines() if row.startswith("dcpstore sync w=1"))
    assert f"{ours['write_gbps'] / best:.2f}x" in line
    assert os.listdir(root) == []  # the limit rows' files are gone too


def test_cli_bench_limit_on_s3_sweeps_raw_boto3(s3_endpoint: S3Endpoint) -> None:
    prefix = "bench-limit"
    out = run_cli(
        "bench",
        f"s3://{s3_endpoint.bucket}/{prefix}",
        "--size",
        "16MiB",
        "--tensors",
        "4",
        "--workers",
        "2",
        "--limit",
        "-q",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # 16 MiB in 4 objects is 4 pieces at every part size: 1, 2 and 4 connections.
    for c in (1, 2, 4):
        assert f"raw PUT/GET (s3) c={c} part=8.0 MiB" in out.stdout
    assert "c=8 " not in out.stdout and "part=16.0 MiB" not in out.stdout
    line = next(row for row in out.stdout.splitlines() if row.startswith("dcpstore sync w=2"))
    assert line.count("x ") >= 2  # save/limit and load/limit
    left = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=f"{prefix}/")
    assert left.get("KeyCount", 0) == 0, left.get("Contents")


@pytest.mark.slow  # the scale model, run for real
def test_scale_simulation_counts_what_dcpstore_sends(tmp_path: Path) -> None:
    out_json = tmp_path / "sim.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "scale_sim.py"),
            "--ranks",
            "1,4,40",
            "--size",
            "48MiB",
            "--tensors",
            "4",
            "--workers",
            "2",
            "--spread",
            "1,4,auto",
            "--load-sample",
            "3",
            "--json",
            str(out_json),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    every = json.loads(out_json.read_text())["points"]
    points = {p["ranks"]: p for p in every if p["extra"]["spread"] == 1}
    spread = {p["ranks"]: p["model"] for p in every if p["extra"]["spread"] == 4}
    auto = {p["ranks"]: p for p in every if p["extra"]["spread"] == "auto"}
    one, four = points[1]["model"], points[4]["model"]
    # Each rank writes 2 files of 24 MiB, a batch of 48 MiB: under the budget's
    # two rounds (16 connections) each piece would be tiny, so every piece is
    # the 8 MiB minimum, 3 parts per file (a file under 16 MiB would be one PUT).
    assert one["by_kind"]["UploadPart"] == 6 and four["by_kind"]["UploadPart"] == 24
    assert one["by_kind"]["CreateMultipartUpload"] == 2 and four["by_kind"]["CompleteMultipartUpload"] == 8
    assert four["data_bytes"] >= 4 * 48 * MiB
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
    # One ownership check per save, not per rank: the coordinator's one read
    # of the marker is the write phase's only GET, at 4 ranks as at 40.
    assert four["by_kind"]["GetObject"] == one["by_kind"]["GetObject"]
    assert points[40]["model"]["busiest_read_requests"] == points[4]["model"]["busiest_read_requests"] == 1
    # auto: the flat layout up to 16 ranks, then 16 ranks or fewer per prefix.
    assert auto[4]["measured"]["spread_prefixes"] == 1 and auto[4]["model"]["prefixes"] == 1
    assert auto[40]["measured"]["spread_prefixes"] == 4 and auto[40]["model"]["prefixes"] == 5
    assert auto[40]["model"]["busiest_write_requests"] * 4 <= points[40]["model"]["busiest_write_requests"] + 8
    # The load: the coordinator alone reads the commit and lists, once
    # (DcpStorageReader.share_commit), whatever the rank count, and every
    # rank reads its own files whole (sampled ranks for real, the others
    # modelled on them).
    for ranks, p in points.items():
        load = p["load"]
        assert load["metadata_gets"] == load["lists"] == 1
        assert load["data_bytes"] >= ranks * 48 * MiB
        assert load["busiest_prefix"] == "run1/step100/" and load["busiest_rate"] > 0
    assert auto[40]["load"]["busiest_data_rate"] < points[40]["load"]["busiest_data_rate"]
