"""``dcpstore bench`` on two checkouts, back to back, alternating: a regression check.

    python benchmarks/ab_bench.py --a main=/path/to/main --b branch=. \\
        [--backends local,s3] [--size 64MiB] [--tensors 16] [--workers 1,4] \\
        [--repeat 3] [--rounds 5] [--limit] [--cold] [--label TEXT] [--json FILE]

Each round runs one ``python -m dcpstore._impl.cli bench URI -q --repeat
N --json ...`` process per side (``dcpstore.cli`` in a checkout from before
the private tree; ``--warm`` in one from before ``--drop-caches``, whose
loads were cold unless told) with ``PYTHONPATH`` set to the checkout, so
both sides run on this interpreter and its installed packages and differ
only in dcpstore's code. The first repeat of each process warms it up
(imports, first allocations) and is not counted. Rounds alternate the order (A B, then B A, ...) so that a
slow spell of a shared machine lands on both alike. ``s3`` is a moto server
on loopback (``benchmarks/servers.py``), started once for all runs.

Local loads read the page cache (warm), or with ``--cold`` the disk: each
side's ``dcpstore bench`` then drops the page cache before every local
load, its own raw reader's too (root only: it empties the whole host's
cache).

Prints, per backend and worker count, the median save and load GB/s of each
side, the client CPU seconds (steadier than wall time on a busy machine), and
B/A ratios (> 1: B is faster, or for CPU, costs more).

``--limit`` runs ``dcpstore bench --limit`` on each side: the storage's
raw limit rows (for a local path, threads ``os.write`` the tensors' bytes
and ``fsync``; loads ``readinto`` the destinations) are measured in the same
process, interleaved with dcpstore's rows, so each side's ratio to the raw
writer -- time and CPU seconds per GB -- comes from one run on one box.
The JSON (``--json``) then records the commit of each side and of this
checkout, as the report's result files do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import servers

BUCKET = "dcpstore-ab"
METRICS = (
    "write_gbps",
    "read_gbps",
    "write_cpu_s",
    "read_cpu_s",
    "write_cpu_s_per_gb",
    "read_cpu_s_per_gb",
    "rss_growth_mib",
)
#: What the printed table shows of :data:`METRICS`.
SHOWN = ("write_gbps", "read_gbps", "write_cpu_s", "read_cpu_s")


def _side(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not os.path.isdir(os.path.join(path, "dcpstore")):
        raise argparse.ArgumentTypeError(f"expected NAME=CHECKOUT (a directory holding dcpstore/), got {text!r}")
    return name, os.path.abspath(path)


def _env(checkout: str, extra: dict[str, str | None]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": checkout}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _which_dcpstore(checkout: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import dcpstore; print(dcpstore.__file__)"],
        cwd=tempfile.gettempdir(),
        env=_env(checkout, {}),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _cli_module(checkout: str) -> str:
    """The command's module in ``checkout``: ``dcpstore._impl.cli``, or
    ``dcpstore.cli`` in a checkout from before the private tree."""
    return (
        "dcpstore._impl.cli"
        if os.path.exists(os.path.join(checkout, "dcpstore", "_impl", "cli.py"))
        else "dcpstore.cli"
    )


def _cache_flags(checkout: str, cold: bool) -> list[str]:
    """The flags that make ``checkout``'s local loads warm, or cold
    (``cold``), as both sides' must be: since ``--drop-caches``, warm is the
    default and that flag makes them cold; before it, cold was the default
    and ``--warm`` kept them warm."""
    source = os.path.join(checkout, *_cli_module(checkout).split(".")) + ".py"
    with open(source, encoding="utf-8") as f:
        has_drop = '"--drop-caches"' in f.read()
    if has_drop:
        return ["--drop-caches"] if cold else []
    return [] if cold else ["--warm"]


def _bench(checkout: str, uri: str, args: argparse.Namespace, env: dict[str, str | None]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="dcpstore-ab-") as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            "-m",
            _cli_module(checkout),
            "bench",
            uri,
            "--size",
            args.size,
            "--tensors",
            str(args.tensors),
            "--workers",
            args.workers,
            "--repeat",
            str(args.repeat),
            *_cache_flags(checkout, args.cold),
            *(["--limit"] if args.limit else []),
            "-q",
            "--json",
            out,
        ]
        # cwd: not a checkout, whose dcpstore/ "-m" would put ahead of PYTHONPATH.
        proc = subprocess.run(cmd, cwd=tmp, env=_env(checkout, env), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with open(out) as f:
            records: list[dict[str, Any]] = json.load(f)["records"]
    bad = [r for r in records if r["status"] != "ok"]
    if bad:
        raise RuntimeError(f"{uri}: {bad[0]['name']}: {bad[0]['status']}: {bad[0]['reason']}")
    if args.cold and any(r["backend"] == "local" and r.get("cold_read") is False for r in records):
        raise RuntimeError(
            f"--cold: {uri}: the page cache could not be dropped (it needs root: /proc/sys/vm/drop_caches)"
        )
    return records


@contextlib.contextmanager
def _targets(backends: list[str]) -> Iterator[dict[str, tuple[str, dict[str, str | None]]]]:
    """backend -> (root URI, environment) for the runs."""
    with contextlib.ExitStack() as stack:
        found: dict[str, tuple[str, dict[str, str | None]]] = {}
        if "local" in backends:
            found["local"] = (stack.enter_context(tempfile.TemporaryDirectory(prefix="dcpstore-ab-local-")), {})
        if "s3" in backends:
            endpoint = stack.enter_context(servers.moto_server())
            servers.create_bucket(endpoint, BUCKET)
            found["s3"] = (f"s3://{BUCKET}/ab", servers.s3_env(endpoint))
        yield found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=_side, required=True, metavar="NAME=CHECKOUT")
    p.add_argument("--b", type=_side, required=True, metavar="NAME=CHECKOUT")
    p.add_argument("--backends", default="local,s3")
    p.add_argument("--size", default="64MiB")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--workers", default="1,4")
    p.add_argument("--repeat", type=int, default=3, help="saves per worker count per process; the first is warm-up")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--limit", action="store_true", help="also the storage's raw limit rows, in the same processes")
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each local load (root only; empties the whole host's cache)",
    )
    p.add_argument("--label", default="", help="what this run measures (recorded in the JSON)")
    p.add_argument("--json", metavar="FILE")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"local", "s3"}
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: expected local and/or s3")
    sides = [args.a, args.b]
    for name, checkout in sides:
        print(f"{name}: {_which_dcpstore(checkout)}", file=sys.stderr)

    # rows[(backend, group, workers)][side][metric] -> values; group: "dcpstore" or "limit" (--limit)
    rows: dict[tuple[str, str, int], dict[str, dict[str, list[float]]]] = {}
    with _targets(backends) as targets:
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for backend in backends:
                root, env = targets[backend]
                for name, checkout in order:
                    uri = f"{root.rstrip('/')}/{name}-{uuid.uuid4().hex[:6]}"
                    for rec in _bench(checkout, uri, args, env):
                        if args.repeat > 1 and rec["repeat"] == 0:
                            continue  # warm-up
                        cell = rows.setdefault((backend, rec["group"], rec["workers"]), {}).setdefault(name, {})
                        for m, value in _metrics(rec).items():
                            cell.setdefault(m, []).append(value)
                    print(f"  round {r + 1}/{args.rounds} {backend} {name} done", file=sys.stderr)

    a, b = args.a[0], args.b[0]
    print(
        f"dcpstore bench --size {args.size} --tensors {args.tensors} --workers {args.workers} --repeat {args.repeat} "
        f"({'cold' if args.cold else 'warm'} loads); {args.rounds} rounds alternating {a}/{b}; medians, B/A = {b}/{a}"
    )
    labels = ("save GB/s", "load GB/s", "save cpu s", "load cpu s")
    print(f"{'':20}" + "".join(f"{label:^25}" for label in labels))
    print(f"{'backend':8} {'group':8} {'w':>2}" + f"  {a[:7]:>7} {b[:7]:>7} {'B/A':>6} " * len(labels))
    summary = []
    for (backend, group, workers), cell in sorted(rows.items()):
        med = {side: {m: statistics.median(cell[side][m]) for m in METRICS} for side in (a, b)}
        line = f"{backend:8} {group:8} {workers:>2}"
        for m in SHOWN:
            ratio = med[b][m] / med[a][m] if med[a][m] else float("nan")
            line += f"  {med[a][m]:7.3f} {med[b][m]:7.3f} {ratio:6.2f} "
        print(line.rstrip())
        summary.append({"backend": backend, "group": group, "workers": workers, "median": med, "all": cell})
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from dcpstore._impl.bench.report import checkout_commit, result_meta

        meta = result_meta("ab_bench.py", argv, args.label, sides={name: checkout_commit(path) for name, path in sides})
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "args": vars(args), "rows": summary}, f, indent=1, default=str)
            f.write("\n")


def _metrics(rec: dict[str, Any]) -> dict[str, float]:
    """One bench record's figures: :data:`METRICS`."""
    gb = rec["bytes"] / 1e9
    return {
        "write_gbps": float(rec["write_gbps"]),
        "read_gbps": float(rec["read_gbps"]),
        "write_cpu_s": float(rec["write_cpu_s"]),
        "read_cpu_s": float(rec["read_cpu_s"]),
        "write_cpu_s_per_gb": float(rec["write_cpu_s"]) / gb,
        "read_cpu_s_per_gb": float(rec["read_cpu_s"]) / gb,
        "rss_growth_mib": float(rec.get("rss_growth_bytes") or 0) / 2**20,
    }


if __name__ == "__main__":
    main()
