"""`dcpstore bench`, the benchmark harness and its helpers, on small sizes.

Real saves and loads on real files; the full comparison (benchmarks/compare.py
at hundreds of MiB) is not part of the test run -- only a tiny smoke of it.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from dcpstore._impl.bench import (
    RECORD_KEYS,
    Entry,
    SaveOutcome,
    Skip,
    done,
    make_state,
    measure_all,
    parse_size,
    run_entry,
    zeros_like_state,
)
from dcpstore._impl.bench.measure import PeakRSS, parse_int_list
from dcpstore._impl.cli import main
from dcpstore._impl.util.errors import InvalidArgument
from tests.support.cli_run import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_cli_bench_measures_verifies_and_cleans_up(tmp_path) -> None:
    root = tmp_path / "bench-root"
    root.mkdir()
    (root / "keep.txt").write_text("not the benchmark's")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    out = run_cli(
        "bench",
        str(root),
        "--size",
        "16MiB",
        "--tensors",
        "8",
        "--workers",
        "1,2",
        "--repeat",
        "2",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "-q",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dcpstore sync w=1" in out.stdout and "dcpstore sync w=2" in out.stdout

    doc = _load_json(str(out_json))
    records = doc["records"]
    assert [(r["workers"], r["repeat"]) for r in records] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in records:
        assert set(RECORD_KEYS) <= r.keys()
        assert r["status"] == "ok" and r["verified"] is True
        assert r["backend"] == "local" and r["engine"] == "sync" and r["mode"] == "sync"
        assert r["bytes"] == 16 * 2**20 and r["tensors"] == 8
        assert r["bytes_written"] >= r["bytes"]  # torch.save framing on top of the payload
        assert r["write_s"] > 0 and r["read_s"] > 0 and r["write_cpu_s"] > 0 and r["read_cpu_s"] > 0
        assert r["write_gbps"] == pytest.approx(r["bytes"] / r["write_s"] / 1e9)
        assert r["read_gbps"] == pytest.approx(r["bytes"] / r["read_s"] / 1e9)
        assert r["blocked_s"] == pytest.approx(r["write_s"], rel=0.05, abs=0.01)  # sync: blocks for the whole save
        assert set(r["phases"]) == {"plan", "stage", "write", "commit"}
        assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
    assert [s["workers"] for s in doc["summary"]] == [1, 2] and all(s["repeats"] == 2 for s in doc["summary"])
    assert doc["meta"]["machine"]["cpus"] >= 1 and doc["meta"]["size"] == 16 * 2**20

    with open(out_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Everything the benchmark wrote is gone; what was there before is not.
    assert sorted(os.listdir(root)) == ["keep.txt"]


def test_cli_bench_removes_a_root_it_created(tmp_path) -> None:
    root = tmp_path / "fresh"
    out = run_cli("bench", str(root), "--size", "1MiB", "--tensors", "2", "--workers", "1", "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not root.exists()


def test_cli_bench_async_measures_and_verifies(tmp_path) -> None:
    out_json = tmp_path / "a.json"
    out = run_cli(
        "bench",
        str(tmp_path / "a"),
        "--size",
        "4MiB",
        "--tensors",
        "4",
        "--workers",
        "2",
        "--async",
        "--engine",
        "native",
        "--json",
        str(out_json),
        "-q",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [rec] = _load_json(str(out_json))["records"]
    assert rec["status"] == "ok" and rec["verified"] is True, rec
    assert rec["mode"] == "async" and rec["engine"] == "native" and rec["workers"] == 2
    assert 0 < rec["blocked_s"] <= rec["write_s"]  # returns once staged; the write goes on after
    assert rec["phases"]["stage"] > 0


def test_cli_bench_tiered_compares_with_both_baselines(tmp_path) -> None:
    out_json = tmp_path / "t.json"
    durable, local = tmp_path / "durable", tmp_path / "local"
    out = run_cli(
        "bench",
        str(durable),
        "--tiered",
        str(local),
        "--size",
        "4MiB",
        "--tensors",
        "4",
        "--workers",
        "2",
        "--engine",
        "native",
        "--json",
        str(out_json),
        "-q",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    records = {r["name"]: r for r in _load_json(str(out_json))["records"]}
    assert set(records) == {"local async/native w=2", "dcpstore tiered/native w=2", "direct async/native w=2"}
    assert all(r["status"] == "ok" and r["verified"] is True for r in records.values()), records
    tiered = records["dcpstore tiered/native w=2"]
    assert tiered["backend"] == "local+local" and tiered["mode"] == "async"
    # blocked <= local commit <= durable commit (= write_s), all from the start of save
    assert (
        0 < tiered["blocked_s"] <= tiered["phases"]["local_commit"] <= tiered["phases"]["durable"] <= tiered["write_s"]
    )
    assert "x plain local async" in out.stdout and "x direct async save" in out.stdout, out.stdout
    # Everything the entries wrote is gone from both tiers.
    assert not [p for p in (*durable.rglob("*"), *local.rglob("*")) if p.is_file()]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--size", "lots"], "size 'lots'"),
        (["--workers", "0,2"], "workers '0,2'"),
        (["--tensors", "0"], "--tensors"),
        (["--warm"], "unrecognized arguments: --warm"),  # warm loads are the default; --drop-caches asks for cold ones
    ],
)
def test_cli_bench_bad_arguments(tmp_path, capsys, args, needle) -> None:
    try:
        code = main(["bench", str(tmp_path / "x"), *args])
    except SystemExit as e:  # argparse's own validation
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_parse_size_and_lists() -> None:
    assert parse_size("64MiB") == 64 * 2**20 and parse_size("1GiB") == 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size("4096") == 4096 and parse_size("1.5k") == 1536
    assert parse_int_list("1,2,4,8") == [1, 2, 4, 8] and parse_int_list("2, 2,1") == [2, 1]
    for bad in ("", "12 parsecs", "-1MiB", "0"):
        with pytest.raises(InvalidArgument):
            parse_size(bad)


def test_make_state_is_deterministic_and_exact() -> None:
    a, b = make_state(10_000, 3, seed=1), make_state(10_000, 3, seed=1)
    assert list(a) == ["t0", "t1", "t2"] and sum(t.nbytes for t in a.values()) == 10_000
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["t0"], make_state(10_000, 3, seed=2)["t0"])
    with pytest.raises(InvalidArgument, match="too small"):
        make_state(8, 3)


def test_peak_rss_sees_an_allocation() -> None:
    with PeakRSS() as rss:
        block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
        del block
    assert rss.peak - rss.before >= 60 * 2**20


class _Scripted(Entry):
    """An entry that saves into memory and can be told to misbehave."""

    group, backend, engine = "limit", "memory", "test"

    def __init__(
        self,
        name: str,
        *,
        setup_error: BaseException | None = None,
        save_error: BaseException | None = None,
        corrupt: bool = False,
    ) -> None:
        self.name, self.setup_error, self.save_error, self.corrupt = name, setup_error, save_error, corrupt
        self.page_cached = False
        self.saved: dict[str, torch.Tensor] = {}
        self.cleanups = 0

    def setup(self, state):
        if self.setup_error:
            raise self.setup_error

    def save(self, state):
        if self.save_error:
            raise self.save_error
        self.saved = {k: v.clone() for k, v in state.items()}
        return done(SaveOutcome(phases={"write": 0.0}, bytes_written=123))

    def load(self, dest):
        for k, v in self.saved.items():
            dest[k].copy_(v)
        if self.corrupt:
            next(iter(dest.values())).add_(1)

    def cleanup(self):
        self.cleanups += 1


@pytest.mark.parametrize(
    "entry, status, reason",
    [
        (_Scripted("ok"), "ok", ""),
        (_Scripted("missing", setup_error=Skip("peer x is not installed")), "skipped", "peer x is not installed"),
        (_Scripted("import", setup_error=ImportError("no module y")), "skipped", "ImportError: no module y"),
        (
            _Scripted("nyi", save_error=NotImplementedError("async_ later")),
            "skipped",
            "NotImplementedError: async_ later",
        ),
        (_Scripted("boom", save_error=RuntimeError("disk on fire")), "failed", "RuntimeError: disk on fire"),
        (_Scripted("wrong", corrupt=True), "failed", "differ"),
    ],
)
def test_run_entry_outcomes(entry: _Scripted, status: str, reason: str) -> None:
    state = make_state(1 << 16, 4)
    records = run_entry(entry, state, zeros_like_state(state), repeat=2)
    assert records[-1].status == status and reason in records[-1].reason
    if status == "ok":
        assert len(records) == 2 and all(r.verified and r.bytes_written == 123 for r in records)
        assert entry.cleanups == 2
    elif entry.setup_error is None:
        assert len(records) == 1 and entry.cleanups == 1  # stops at the first bad repeat, still cleans up


def test_measure_all_interleaves_repeats_and_groups_records() -> None:
    order: list[str] = []

    class Logged(_Scripted):
        def save(self, state):
            order.append(self.name)
            return super().save(state)

    a, b, c = Logged("a"), Logged("b", save_error=RuntimeError("x")), Logged("c")
    state = make_state(1 << 12, 2)
    records = measure_all([a, b, c], state, zeros_like_state(state), repeat=3)
    assert order == ["a", "b", "c", "a", "c", "a", "c"]  # b broke in round 1 and left the rotation
    assert [(r.name, r.repeat, r.status) for r in records] == [
        ("a", 0, "ok"),
        ("a", 1, "ok"),
        ("a", 2, "ok"),
        ("b", 0, "failed"),
        ("c", 0, "ok"),
        ("c", 1, "ok"),
        ("c", 2, "ok"),
    ]


# ---------------------------------------------------------------------------
# benchmarks/: the WAN proxy and a tiny comparison
# ---------------------------------------------------------------------------


@pytest.fixture
def http_origin(tmp_path):
    """A plain HTTP server on loopback serving a 2 MB file."""
    payload = os.urandom(2_000_000)
    (tmp_path / "blob").write_bytes(payload)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", payload
    server.shutdown()


def test_wan_proxy_shapes_bandwidth_and_latency(http_origin) -> None:
    origin, payload = http_origin
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "wanproxy.py"),
            "--upstream",
            origin,
            "--latency-ms",
            "100",
            "--rate-mbps",
            "4",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode().split()
        assert line[0] == "listening"
        url = f"http://{line[1]}/blob"
        t0 = time.perf_counter()
        body = urllib.request.urlopen(url, timeout=30).read()
        elapsed = time.perf_counter() - t0
        assert body == payload
        # 2 MB at 4 MB/s is >= 0.5 s, plus 100 ms for the request.
        assert 0.55 <= elapsed < 5, elapsed
        t0 = time.perf_counter()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "-missing", timeout=30)
        assert time.perf_counter() - t0 >= 0.1  # a tiny request still pays the latency
    finally:
        proc.terminate()
        proc.wait(10)


def test_wan_proxy_refuses_non_loopback() -> None:
    out = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "wanproxy.py"), "--upstream", "10.1.2.3:80"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "not a loopback address" in out.stderr


@pytest.mark.slow  # the whole comparison, end to end
def test_compare_smoke_local_section(tmp_path) -> None:
    """The comparison runs end to end on a few MiB and writes ratios."""
    out_json = tmp_path / "compare.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "compare.py"),
            "--size",
            "4MiB",
            "--tensors",
            "4",
            "--workers",
            "2",
            "--repeat",
            "1",
            "--sections",
            "local",
            "--quiet",
            "--warm",
            "--root",
            str(tmp_path),
            "--only",
            r"raw|clone|dcp\.save FileSystemWriter threads=2|dcpstore local",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = _load_json(str(out_json))
    by_name = {r["name"]: r for r in doc["summary"]}
    for name in (
        "raw write+fsync / read, 2 thread(s)",
        "clone() of every tensor",
        "dcp.save FileSystemWriter threads=2",
        "dcpstore local sync w=2",
        "dcpstore local async/native w=2",
    ):
        assert by_name[name]["status"] == "ok", by_name[name]
    assert by_name["dcpstore local sync w=2"]["verified"] is True
    targets = {t["target"]: t for t in doc["meta"]["targets"]}
    # Each target ran (met or missed, never skipped or pending) and its ratio
    # is the one its two rows give.
    for title, ours, ref, metric in [
        (
            "local save >= 0.95x raw write+fsync (best thread count)",
            "dcpstore local sync w=2",
            "raw write+fsync / read, 2 thread(s)",
            "write_gbps",
        ),
        (
            "local load >= 0.9x raw read (cold cache, best thread count)",
            "dcpstore local sync w=2",
            "raw write+fsync / read, 2 thread(s)",
            "read_gbps",
        ),
        (
            "async stall <= 1.0x clone() (native)",
            "dcpstore local async/native w=2",
            "clone() of every tensor",
            "blocked_s",
        ),
    ]:
        target = targets[title]
        assert target["status"] in ("met", "missed"), target
        assert target["ref"] == ref  # the only (hence best) limit row of the run
        assert by_name[ours]["status"] == "ok" and by_name[ref]["status"] == "ok"
        assert target["ratio"] == pytest.approx(by_name[ours][metric] / by_name[ref][metric]), target
    assert os.listdir(tmp_path) == ["compare.json"]  # its scratch directory is gone

    # benchmarks/report.py fills the page's generated blocks from that JSON.
    page = tmp_path / "PAGE.md"
    page.write_text(
        "intro\n<!-- BEGIN generated:local -->\nSTALE-ROW\n<!-- END generated:local -->\n"
        "<!-- BEGIN generated:targets -->\n<!-- END generated:targets -->\noutro\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "report.py"),
            "--compare",
            str(out_json),
            "--scaling",
            str(tmp_path / "none.json"),
            "--page",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = page.read_text()
    assert "STALE-ROW" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| dcpstore local sync w=2 | local | 2 |" in text
    assert "| local save >= 0.95x raw write+fsync (best thread count) |" in text


def test_cli_bench_drops_the_page_cache_only_when_asked(tmp_path, monkeypatch) -> None:
    # The one privileged call is replaced: this test runs as root, and the
    # real one would empty the whole host's page cache.
    import dcpstore._impl.bench.runner as runner

    drops: list[int] = []

    def fake_drop() -> bool:
        drops.append(1)
        return True

    monkeypatch.setattr(runner, "drop_page_cache", fake_drop)
    args = ("bench", str(tmp_path / "b"), "--size", "1MiB", "--tensors", "2", "--workers", "1", "-q")
    warm = run_cli(*args)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert drops == [] and "loads were warm: the page cache was not dropped" in warm.stdout
    cold = run_cli(*args, "--drop-caches")
    assert cold.returncode == 0, cold.stdout + cold.stderr
    assert drops == [1] and "loads were cold" in cold.stdout
    monkeypatch.setattr(runner, "drop_page_cache", lambda: False)  # not root
    denied = run_cli(*args, "--drop-caches")
    assert "could not drop the page cache" in denied.stdout


@pytest.mark.slow  # two WAN regimes end to end, each with its proxies and peers
def test_compare_wan_regimes_carry_their_harness_self_test(tmp_path) -> None:
    """Each ``--wan-regimes`` entry is a section of its own, with harness
    rows through an unshaping proxy beside the sweep; the targets are
    judged per regime (never ``met`` against a limit the harness caps), and
    report.py renders each section's self-test."""
    out_json = tmp_path / "compare.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "compare.py"),
            "--size",
            "1MiB",
            "--sections",
            "wan",
            "--wan-size",
            "16MiB",
            "--wan-tensors",
            "4",
            "--wan-regimes",
            "slow:20,fast:80",
            "--wan-connections",
            "2,4",
            "--wan-peer-workers",
            "1",
            "--repeat",
            "1",
            "--quiet",
            "--root",
            str(tmp_path),
            "--only",
            "raw|harness|dcpstore",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=480,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = _load_json(str(out_json))
    assert set(doc["meta"]["wan"]["regimes"]) == {"slow", "fast"}
    for regime in ("slow", "fast"):
        rows = [r for r in doc["summary"] if r["extra"]["section"] == f"wan-{regime}"]
        groups = {r["group"] for r in rows if r["status"] == "ok"}
        assert groups == {"harness", "limit", "dcpstore"}, rows
        assert all(r["backend"] == f"s3-wan-{regime}" for r in rows)
        results = [t for t in doc["meta"]["targets"] if t["target"].startswith(f"WAN/{regime}:")]
        limit_rows = [t for t in results if "best raw" in t["target"]]
        assert limit_rows and all(t["status"] in ("met", "missed", "harness-bound") for t in limit_rows), limit_rows
    page = tmp_path / "PAGE.md"
    page.write_text("<!-- BEGIN generated:harness-wan-slow -->\n<!-- END generated:harness-wan-slow -->\n")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "report.py"),
            "--compare",
            str(out_json),
            "--scaling",
            str(tmp_path / "none.json"),
            "--page",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "-bound** (needs 2x)" in page.read_text()


@pytest.mark.slow  # a WAN section through its proxy, its targets' rows measured again
def test_compare_measures_the_wan_targets_rows_again(tmp_path) -> None:
    """``--wan-pair-repeat N`` measures again, interleaved, exactly the rows a
    WAN section's targets against the limit compare -- dcpstore at its
    defaults and the sweep's best raw PUT and GET rows -- until each has N
    repeats; every other row keeps ``--repeat``."""
    out_json = tmp_path / "compare.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "compare.py"),
            "--size",
            "1MiB",
            "--sections",
            "wan",
            "--wan-size",
            "8MiB",
            "--wan-tensors",
            "4",
            "--wan-regimes",
            "fast:80",
            "--wan-connections",
            "1,2,4",
            "--wan-peer-workers",
            "1",
            "--repeat",
            "1",
            "--wan-pair-repeat",
            "3",
            "--quiet",
            "--root",
            str(tmp_path),
            "--only",
            "^(raw PUT|dcpstore)",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=480,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = _load_json(str(out_json))
    first = [r for r in doc["records"] if r["repeat"] == 0 and r["status"] == "ok"]
    raw = [r for r in first if r["group"] == "limit"]
    assert len(raw) >= 3  # the sweep ran
    best = {max(raw, key=lambda r: r[f"{d}_gbps"])["name"] for d in ("write", "read")}
    expected = best | {"dcpstore s3-wan-fast sync default"}
    repeats: dict[str, list[int]] = {}
    for r in doc["records"]:
        repeats.setdefault(r["name"], []).append(r["repeat"])
    assert {name for name, rs in repeats.items() if len(rs) > 1} == expected, repeats
    assert all(sorted(repeats[name]) == [0, 1, 2] for name in expected), repeats
    assert all(rs == [0] for name, rs in repeats.items() if name not in expected), repeats
    assert {r["name"]: r["repeats"] for r in doc["summary"] if r["name"] in expected} == dict.fromkeys(expected, 3)


def test_a_result_files_meta_says_how_to_run_it_again_and_on_what() -> None:
    from dcpstore._impl.bench.report import git_commit, result_meta
    from dcpstore._impl.util.checksum import CRC32C_LIBRARY

    meta = result_meta("local_costs.py", ["--label", "two words", "--rounds", "3"], "two words", rounds=3)
    assert meta["command"] == "python benchmarks/local_costs.py --label 'two words' --rounds 3"
    assert meta["label"] == "two words" and meta["rounds"] == 3
    assert meta["git_commit"] == git_commit()  # None in a copy without git: a test runs from any copy
    assert meta["machine"]["cpus"] and meta["machine"]["crc32c"] == CRC32C_LIBRARY
    assert time.strptime(meta["date"], "%Y-%m-%dT%H:%M:%S%z")
