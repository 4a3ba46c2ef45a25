"""Side-by-side comparison: dcpstore vs the limits vs the peers, one run, same bytes.

    python benchmarks/compare.py --size 512MiB --json benchmarks/results/compare.json

Sections (each a list of entries measured one after the other on the same
state dict; see dcpstore/_impl/bench/runner.py for how each is timed):

* local: raw threads write+fsync / read (the disk limit), ``clone()`` (the
  async stall limit), ``dcp.save`` / ``dcp.async_save`` with
  ``FileSystemWriter``, NVRx ``FileSystemWriterAsync``, and dcpstore sync
  and async (native, nvrx) per worker count;
* s3: a moto server this script starts on loopback: raw parallel PUT/GET,
  DCP ``FsspecWriter`` + s3fs, MSC's writer, s3torchconnector, and dcpstore
  on every object-store route (native s3, s3 via MSC, msc://, memory://);
* wan: the same endpoint behind benchmarks/wanproxy.py (its own process:
  latency per request + bandwidth per connection), one section
  ``wan-<regime>`` per ``--wan-regimes`` entry (default ``network`` at 5
  MB/s per connection, where the emulated network is the limit, and ``cpu``
  at 25 MB/s, where this machine's CPUs are). Each section has its harness
  self-test (the widest raw rows through a second proxy with shaping off:
  dcpstore._impl.bench.limits.harness_verdicts says whether the section is
  network- or harness-bound), the raw sweep, dcpstore at its defaults, and
  s3torchconnector, MSC and s3fs.

Entries whose dependency is absent (a backend not merged, ``async_``
raising NotImplementedError, a peer not installed) are reported as
``skipped: <reason>``; the targets they feed say ``pending merge``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import limits  # noqa: E402
import peers  # noqa: E402
import servers  # noqa: E402
import targets  # noqa: E402
import torch  # noqa: E402

from dcpstore._impl.bench import (  # noqa: E402
    Entry,
    Record,
    Waiter,
    make_state,
    parse_int_list,
    parse_size,
    run_entries,
    summarize,
    zeros_like_state,
)
from dcpstore._impl.bench.entries import DcpstoreEntry, TieredEntry  # noqa: E402
from dcpstore._impl.bench.limits import best_limits  # noqa: E402
from dcpstore._impl.bench.report import format_table, write_json  # noqa: E402
from dcpstore._impl.util.units import human_bytes  # noqa: E402
from dcpstore.storage import StorageOptions  # noqa: E402

BUCKET = "dcpstore-bench"
ENGINES = ("native", "nvrx")


class WithEnv(Entry):
    """Runs another entry with environment variables set (e.g. the S3 endpoint
    for dcpstore's s3 backend, which reads AWS_ENDPOINT_URL like boto3)."""

    def __init__(self, inner: Entry, values: dict[str, str | None]) -> None:
        self.inner, self.values = inner, values
        for attr in ("name", "group", "backend", "engine", "mode", "workers", "ranks", "reads", "page_cached"):
            setattr(self, attr, getattr(inner, attr))

    def _sync_labels(self) -> None:
        self.backend, self.page_cached, self.workers = self.inner.backend, self.inner.page_cached, self.inner.workers

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        with servers.env(self.values):
            self.inner.setup(state)
        self._sync_labels()

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        with servers.env(self.values):
            wait = self.inner.save(state)

        def waiter() -> Any:
            with servers.env(self.values):
                return wait()

        return waiter

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        with servers.env(self.values):
            self.inner.load(dest)

    def cleanup(self) -> None:
        with servers.env(self.values):
            self.inner.cleanup()

    def close(self) -> None:
        with servers.env(self.values):
            self.inner.close()


def dcpstore_entries(
    label: str,
    uri: str,
    run_id: str,
    workers: Sequence[int | None],
    *,
    async_workers: int | None,
    enable_msc: bool = False,
    backend: str | None = None,
) -> Iterator[DcpstoreEntry]:
    """dcpstore sync at every worker count (None: the backend's default),
    plus async per engine at ``async_workers``."""
    for w in workers:
        size = "default" if w is None else f"w={w}"
        yield DcpstoreEntry(
            uri, run_id, workers=w, enable_msc=enable_msc, backend=backend, name=f"dcpstore {label} sync {size}"
        )
    if async_workers:
        for engine in ENGINES:
            yield DcpstoreEntry(
                uri,
                run_id,
                workers=async_workers,
                engine=engine,
                async_=True,
                enable_msc=enable_msc,
                backend=backend,
                name=f"dcpstore {label} async/{engine} w={async_workers}",
            )


def local_section(root: str, run_id: str, workers: Sequence[int]) -> list[Entry]:
    w = max(workers)
    entries: list[Entry] = [limits.RawFiles(root, n) for n in workers]
    entries.append(limits.Clone())
    entries += [peers.DcpFileSystem(root, 1), peers.DcpFileSystem(root, w), peers.DcpFileSystem(root, w, async_=True)]
    entries.append(peers.NvrxDirect(root, w))
    entries += dcpstore_entries("local", os.path.join(root, "dcpstore"), run_id, workers, async_workers=w)
    # The staging cap: each save with a saver of its own allocates its buffers while measured.
    entries.append(
        DcpstoreEntry(
            os.path.join(root, "dcpstore"),
            run_id,
            workers=w,
            engine="native",
            async_=True,
            own_saver=True,
            name=f"dcpstore local async/native w={w} own saver",
        )
    )
    return entries


def tiered_section(root: str, endpoint: str, run_id: str, workers: Sequence[int]) -> list[Entry]:
    """A tiered manager (local commit, then replication to moto) between its
    two baselines, as ``dcpstore bench URI --tiered LOCAL_DIR`` runs them."""
    w = max(workers)
    env = servers.s3_env(endpoint)
    local = os.path.join(root, "tiered-local")
    return [
        DcpstoreEntry(local, run_id, workers=w, engine="native", async_=True, name=f"local async/native w={w}"),
        WithEnv(TieredEntry(f"s3://{BUCKET}/tiered", local, run_id, workers=w, engine="native"), env),
        WithEnv(
            DcpstoreEntry(
                f"s3://{BUCKET}/tiered-direct",
                run_id,
                workers=w,
                engine="native",
                async_=True,
                name=f"direct async/native w={w}",
            ),
            env,
        ),
    ]


def raw_sweep(endpoint: str, run_id: str, nbytes: int, backend: str) -> list[Entry]:
    """The endpoint's limit: raw boto3 over every (connections, part size)
    worth measuring (dcpstore._impl.bench.limits.s3_sweep), credentials from the
    environment like every other client here."""
    env = servers.s3_env(endpoint)
    return [WithEnv(e, env) for e in limits.s3_sweep(endpoint, BUCKET, nbytes, prefix=run_id, backend=backend)]


def s3_section(
    endpoint: str, run_id: str, workers: Sequence[int], msc_profile: str, part_size: int | None, nbytes: int
) -> list[Entry]:
    w = max(workers)
    env = servers.s3_env(endpoint)
    entries: list[Entry] = raw_sweep(endpoint, run_id, nbytes, "s3")
    entries += [
        peers.FsspecS3(endpoint, BUCKET, w),
        peers.MscWriter(msc_profile, endpoint, BUCKET, w),
        peers.S3TorchConnector(endpoint, BUCKET, w),
    ]
    routes = [
        ("s3", f"s3://{BUCKET}/dcpstore", False),
        ("s3+msc", f"s3://{BUCKET}/dcpstore-msc", True),
        ("msc", f"msc://{msc_profile}/dcpstore-mscuri", False),
    ]
    for label, uri, enable_msc in routes:
        sizes: list[int | None] = [None, w] if label == "s3" else [w]
        entries += [
            WithEnv(e, env)
            for e in dcpstore_entries(label, uri, run_id, sizes, async_workers=w, enable_msc=enable_msc, backend=label)
        ]
    if part_size:  # a fixed part size beside the automatic one
        options = StorageOptions(part_size=part_size)
        entries.append(
            WithEnv(
                DcpstoreEntry(
                    f"s3://{BUCKET}/dcpstore",
                    run_id,
                    workers=w,
                    backend="s3",
                    storage_options=options,
                    name=f"dcpstore s3 sync w={w} part={human_bytes(part_size)}",
                ),
                env,
            )
        )
    entries += dcpstore_entries(
        "memory", f"memory://{BUCKET}/dcpstore", run_id, [w], async_workers=None, backend="memory"
    )
    return entries


def wan_section(
    proxy: str,
    unshaped: str,
    run_id: str,
    regime: str,
    msc_profile: str,
    nbytes: int,
    connections: Sequence[int],
    peer_workers: Sequence[int],
) -> list[Entry]:
    """One regime of the emulated WAN (backend ``s3-wan-<regime>``): the
    harness self-test (the widest raw rows through the proxy with its
    shaping off, ``unshaped``), the raw sweep through the shaping proxy,
    dcpstore at its defaults, and the peers: s3torchconnector at every
    ``peer_workers`` count (its best is the reference), MSC and s3fs at the
    largest."""
    backend = f"s3-wan-{regime}"
    env = servers.s3_env(proxy)
    harness_env = servers.s3_env(unshaped)
    entries: list[Entry] = [
        WithEnv(limits.HarnessRaw(unshaped, BUCKET, c, p, prefix=run_id, backend=backend), harness_env)
        for c, p in limits.harness_points(nbytes, connections)
    ]
    entries += [
        WithEnv(e, env)
        for e in limits.s3_sweep(proxy, BUCKET, nbytes, prefix=run_id, backend=backend, connections=connections)
    ]
    entries += [
        WithEnv(e, env)
        for e in dcpstore_entries(
            backend, f"s3://{BUCKET}/dcpstore-{backend}", run_id, [None], async_workers=None, backend=backend
        )
    ]
    entries += [peers.S3TorchConnector(proxy, BUCKET, w, backend=backend) for w in peer_workers]
    w = max(peer_workers)
    entries += [
        peers.MscWriter(msc_profile, proxy, BUCKET, w, backend=backend),
        peers.FsspecS3(proxy, BUCKET, w, backend=backend),
    ]
    return entries


def parse_regimes(text: str) -> list[tuple[str, float]]:
    """``network:5,cpu:25`` -> ``[("network", 5.0), ("cpu", 25.0)]`` (name: MB/s per connection)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, rate = item.partition(":")
        if not re.fullmatch(r"[a-z0-9]+", name) or not rate:
            raise ValueError(f"--wan-regimes: {item!r} is not NAME:MBPS (NAME in a-z0-9)")
        out.append((name, float(rate)))
    return out


def _select(entries: list[Entry], only: str | None) -> list[Entry]:
    return [e for e in entries if not only or re.search(only, e.name)]


def _pair(entries: list[Entry], records: list[Record]) -> list[Entry]:
    """The entries a WAN section's targets against the limit compare: the
    sweep's best raw PUT and GET rows (:func:`best_limits`, as the
    targets pick them) and dcpstore at its defaults."""
    rows = summarize(records)
    names = {row["name"] for row in best_limits(rows).values()}
    names |= {row["name"] for row in rows if row["group"] == "dcpstore" and row["name"].endswith(" sync default")}
    return [e for e in entries if e.name in names]


def _refine(
    entries: list[Entry],
    records: list[Record],
    state: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    title: str,
    done: int,
    total: int,
    common: dict[str, Any],
) -> list[Record]:
    """Measure ``entries`` again, interleaved, until each has ``total``
    repeats (``done`` so far): the medians a target compares then rest on
    more than one run's few repeats, the rest of the section's rows do
    not cost as much again. Records carry on ``records``' extra fields."""
    if len(entries) < 2:
        return []  # nothing to compare: an entry failed or was not selected
    extra = run_entries(entries, state, dest, desc=f"{title} (targets' rows)", **{**common, "repeat": total - done})
    fields = {r.name: r.extra for r in records}
    for r in extra:
        r.repeat += done
        r.extra.update(fields.get(r.name, {}))
    return extra


def _print_section(title: str, records: list[Record]) -> None:
    print(f"\n== {title}")
    print(format_table(summarize(records)), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="512MiB", help="state size (default 512MiB)")
    p.add_argument("--tensors", type=int, default=64, help="number of float32 tensors (default 64)")
    p.add_argument("--wan-tensors", type=int, default=32, help="float32 tensors of the WAN state (default 32)")
    p.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4); peers use the largest")
    p.add_argument("--repeat", type=int, default=3, help="measurements per entry (median reported; default 3)")
    p.add_argument(
        "--wan-pair-repeat",
        type=int,
        default=0,
        help="measurements, in all, of the rows each WAN section's targets against the limit compare: "
        "dcpstore at its defaults and the sweep's best raw PUT and GET rows, measured again "
        "(interleaved) after the section up to this many (default: --repeat, no more)",
    )
    p.add_argument("--sections", default="local,s3,wan", help="which of local,s3,wan,tiered to run, in this order")
    p.add_argument("--tiered-size", default="256MiB", help="state size for the tiered section (default 256MiB)")
    p.add_argument("--wan-size", default="128MiB", help="state size for the WAN sections (default 128MiB)")
    p.add_argument("--wan-latency-ms", type=float, default=20.0)
    p.add_argument(
        "--wan-regimes",
        default="network:5,cpu:25",
        help="one WAN section per NAME:MBPS (bandwidth per connection and direction); default "
        "network:5 (the emulated network is the limit) and cpu:25 (the 2 CPUs are)",
    )
    p.add_argument(
        "--wan-connections",
        default="4,8,16,32",
        help="connection counts of the WAN sections' raw sweep (default 4,8,16,32: one or two "
        "connections are never the best of a per-connection-bound network, and take minutes)",
    )
    p.add_argument(
        "--wan-peer-workers",
        default="1,2,4",
        help="thread counts for s3torchconnector in the WAN sections (MSC and s3fs: the largest)",
    )
    p.add_argument(
        "--s3-part-size",
        default="32MiB",
        help="also run dcpstore s3 (4 workers) with this fixed part size ('' to skip; default 32MiB, "
        "the raw rows' part size)",
    )
    p.add_argument("--only", help="regular expression: run only entries whose name matches")
    p.add_argument("--root", help="directory for local files (default: a temporary directory under /tmp)")
    p.add_argument("--label", default="", help="free text stored with the results (e.g. 'pre-merge')")
    p.add_argument("--json", help="write records, summary and targets here")
    p.add_argument("--plot", help="PNG of the local and S3 sections")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before loads (it needs root)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    size, workers = parse_size(args.size), parse_int_list(args.workers)
    sections = list(dict.fromkeys(args.sections.split(",")))
    unknown = set(sections) - {"local", "s3", "wan", "tiered"}
    if unknown:
        p.error(f"--sections: unknown section(s) {sorted(unknown)}; choose from local, s3, wan, tiered")
    try:
        regimes = parse_regimes(args.wan_regimes)
    except ValueError as e:
        p.error(str(e))
    wan_conns = parse_int_list(args.wan_connections, "connections")
    peer_workers = parse_int_list(args.wan_peer_workers)
    run_id = f"compare-{uuid.uuid4().hex[:6]}"
    root = tempfile.mkdtemp(prefix="dcpstore-compare-", dir=args.root)
    print(
        f"compare: {human_bytes(size)} in {args.tensors} tensors, workers {workers}, repeat {args.repeat}, "
        f"files under {root}",
        flush=True,
    )
    state = make_state(size, args.tensors)
    dest = zeros_like_state(state)
    all_records: list[Record] = []
    server_pids: set[int] = set()  # moto and the proxy: their memory is the storage's, not the client's
    common = {
        "repeat": args.repeat,
        "progress": not args.quiet,
        "drop_caches": not args.warm,
        "rss_ignore_pids": server_pids,
    }

    def run(title: str, entries: list[Entry], st: dict[str, torch.Tensor], de: dict[str, torch.Tensor]) -> None:
        chosen = _select(entries, args.only)
        recs = run_entries(chosen, st, de, desc=title, **common)
        raw = {e.name: getattr(e, "inner", e) for e in chosen}
        for r in recs:
            r.extra["section"] = title
            if isinstance(raw.get(r.name), limits.RawS3):  # where the row sits in the sweep grid
                r.extra["part_size"] = raw[r.name].part_size
            if getattr(raw.get(r.name), "own_saver", False):  # its saves allocated their staging
                r.extra["fresh_staging"] = True
        if title.startswith("wan-") and args.wan_pair_repeat > args.repeat:
            recs += _refine(_pair(chosen, recs), recs, st, de, title, args.repeat, args.wan_pair_repeat, common)
        all_records.extend(recs)
        _print_section(title, recs)

    try:
        with contextlib.ExitStack() as servers_up:
            endpoint = None
            for section in sections:  # in the order given: the one that matters most can go first
                if section == "local":
                    run("local", local_section(root, run_id, workers), state, dest)
                    continue
                if endpoint is None:  # one moto server for the S3 and WAN sections
                    endpoint = servers_up.enter_context(servers.moto_server(server_pids))
                    servers.create_bucket(endpoint, BUCKET)
                msc_config = os.path.join(root, "msc.json")
                if section == "tiered":
                    tiered_state = make_state(parse_size(args.tiered_size), args.tensors)
                    with servers.env(servers.FAKE_CREDENTIALS):
                        run(
                            "tiered",
                            tiered_section(root, endpoint, run_id, workers),
                            tiered_state,
                            zeros_like_state(tiered_state),
                        )
                    del tiered_state
                elif section == "s3":
                    servers.write_msc_config(msc_config, {"bench": (endpoint, BUCKET)})
                    with servers.env({"MSC_CONFIG": msc_config, **servers.FAKE_CREDENTIALS}):
                        part = parse_size(args.s3_part_size) if args.s3_part_size else None
                        run("s3", s3_section(endpoint, run_id, workers, "bench", part, size), state, dest)
                else:
                    wan_bytes = parse_size(args.wan_size)
                    wan_state = make_state(wan_bytes, args.wan_tensors)
                    wan_dest = zeros_like_state(wan_state)
                    for regime, rate in regimes:
                        # Two proxy processes: the shaping one, and the same with shaping off (the self-test).
                        with (
                            servers.wan_proxy(
                                endpoint, latency_ms=args.wan_latency_ms, rate_mbps=rate, pids=server_pids
                            ) as proxy,
                            servers.wan_proxy(endpoint, latency_ms=0, rate_mbps=0, pids=server_pids) as unshaped,
                        ):
                            profile = f"wan{regime}"
                            servers.write_msc_config(msc_config, {profile: (proxy, BUCKET)})
                            with servers.env({"MSC_CONFIG": msc_config, **servers.FAKE_CREDENTIALS}):
                                run(
                                    f"wan-{regime}",
                                    wan_section(
                                        proxy, unshaped, run_id, regime, profile, wan_bytes, wan_conns, peer_workers
                                    ),
                                    wan_state,
                                    wan_dest,
                                )
                    del wan_state, wan_dest
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)

    rows = summarize(all_records)
    results = targets.evaluate_all(targets.compare_targets(max(workers), [name for name, _ in regimes]), rows)
    print("\n== targets (ratios within this run)")
    print(targets.format_targets(results, targets.text_table))
    if args.json:
        write_json(
            args.json,
            all_records,
            {
                "command": shlex.join(
                    ["python", "benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])]
                ),
                "label": args.label,
                "size": size,
                "tensors": args.tensors,
                "workers": workers,
                "wan": {
                    "size": parse_size(args.wan_size),
                    "tensors": args.wan_tensors,
                    "latency_ms": args.wan_latency_ms,
                    "regimes": {name: {"rate_mbps": rate} for name, rate in regimes},
                    "connections": wan_conns,
                    "peer_workers": peer_workers,
                },
                "s3_part_size": args.s3_part_size,
                "tiered_size": parse_size(args.tiered_size),
                "targets": results,
            },
        )
        print(f"wrote {args.json}")
    if args.plot:
        import plots

        plots.compare_plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 1 if any(r.status == "failed" for r in all_records) else 0


if __name__ == "__main__":
    sys.exit(main())
