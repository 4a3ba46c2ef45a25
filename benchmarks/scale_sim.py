"""Scale simulation: N ranks saving one checkpoint to S3 and loading it back, up to 16,384 of them.

    python benchmarks/scale_sim.py --ranks 1,16,256,1024,4096,16384 --size 1MiB --tensors 2 \
        --json benchmarks/results/scale_sim.json

What is real and what is a model:

* **Real:** the request pattern. Every simulated rank runs dcpstore's own
  DCP writer (``DcpStorageWriter``, driven through DCP's save protocol by
  hand: plans, the coordinator's global plan and claim, each rank's
  ``write_data``, the coordinator's ``finish``) on dcpstore's own S3 backend
  (``S3Storage``: its request pool, multipart uploads, checksums, commit
  protocol), with the DCP planner and real tensors. So the requests, their
  kinds, keys and sizes are exactly what dcpstore would send. The
  coordinator's CPU time to build the manifest and ``.metadata`` is
  measured, as are their sizes. The load runs the same way: dcpstore's DCP
  reader (``DcpStorageReader``: the commit read, the listing beside it, the
  byte ranges of each rank's files) on the same backend, each rank loading
  what it saved.
* **A model:** the endpoint. boto3 is replaced by an in-process fake S3
  client (:class:`FakeS3`) that keeps small objects, counts the bytes of
  data files and records every request; the time those requests would take
  comes from a latency and throughput model (:class:`Model`): a fixed
  latency per request, a throughput per connection and per rank, and S3's
  documented request rates per prefix (3,500 PUT/POST/DELETE and 5,500
  GET/HEAD per second; beyond them S3 answers 503 SlowDown). Ranks run one
  after another here; the model puts them side by side.
* **Also a model:** what the ranks say to each other. The ranks share one
  ownership check (``DcpStorageWriter.exchange_owner_check``: a gather and
  a broadcast over the process group): here the coordinator writes last
  and makes the check, and the others take its outcome without a request,
  which is what the exchange sends S3. A load reads every rank's
  data files for real up to ``--load-sample`` ranks (and the
  coordinator's); past that, the other ranks' requests are a sampled
  rank's with their own file names, as every rank but the coordinator
  loads alike. The commit (``.metadata``, the manifest, one listing) is
  read by the coordinator alone and handed to the others
  (``DcpStorageReader.share_commit``: a broadcast over the process group).

Per N (and per ``--spread``: ``SaveOptions.spread_prefixes``, ``auto`` by
default, rank files spread over that many key prefixes) it reports the
requests (by kind),
bytes, the phases' modelled durations (claim, write, commit), the busiest
key prefix's request rate against S3's limit, and the write phase stretched
by that limit; for the load, its requests, LISTs, modelled duration and
the busiest prefix's GET rate. A prefix here is a key's directory: the
model assumes the store has already split its partitions at the spread
directories, as S3 does for a prefix under sustained load (it takes
minutes, and until then the spread keys share the checkpoint's partition;
:func:`dcpstore._impl.storage.storage_options.auto_spread_prefixes` says
the same of the default spread).
BENCHMARKS.md ("Scale") says what changes beyond this model.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import botocore.exceptions as bexc  # noqa: E402
import torch  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner  # noqa: E402

from dcpstore._impl.bench import make_state, parse_int_list, parse_size  # noqa: E402
from dcpstore._impl.bench.report import result_meta  # noqa: E402
from dcpstore._impl.dcp.reader import DcpStorageReader  # noqa: E402
from dcpstore._impl.dcp.writer import DcpStorageWriter  # noqa: E402
from dcpstore._impl.format.layout import is_data_file, spread_dir  # noqa: E402
from dcpstore._impl.storage import AUTO_SPREAD, resolve_spread_prefixes  # noqa: E402
from dcpstore._impl.util.units import human_bytes  # noqa: E402
from dcpstore.storage import StorageOptions, open_storage  # noqa: E402

#: Request kinds S3 counts against each per-prefix rate.
WRITE_KINDS = frozenset(
    {
        "PutObject",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "DeleteObjects",
    }
)
READ_KINDS = frozenset({"GetObject", "HeadObject", "ListObjectsV2", "ListMultipartUploads"})
#: A data file's rank, from its name (``__{rank}_...``).
_RANK_RE = re.compile(r"__(\d+)_")


def rank_of(key: str) -> int | None:
    """The rank whose data file ``key`` is (None: not a data file)."""
    name = key.rsplit("/", 1)[-1]
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m and is_data_file(name) else None


@dataclass(frozen=True)
class Request:
    rank: int
    phase: str  # "claim", "write", "commit"; a load's "meta" (its commit read) and "read"
    kind: str
    key: str
    nbytes: int


class Recorder:
    """Every request of every simulated rank, tagged with the current phase."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.phase = "claim"
        self._lock = threading.Lock()

    def add(self, rank: int, kind: str, key: str, nbytes: int = 0) -> None:
        with self._lock:
            self.requests.append(Request(rank, self.phase, kind, key, nbytes))


def _error(code: str, status: int, op: str) -> bexc.ClientError:
    return bexc.ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op
    )


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data, self._pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n is None or n < 0 else self._pos + n
        out = bytes(self._data[self._pos : end])
        self._pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = min(out.nbytes, len(self._data) - self._pos)
        out[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        pass


class _Paginator:
    def __init__(self, fake: FakeS3, kind: str) -> None:
        self.fake, self.kind = fake, kind

    def paginate(self, Bucket: str, Prefix: str = "") -> Any:  # noqa: N803  (boto3's names)
        if self.kind == "list_multipart_uploads":
            self.fake.rec.add(self.fake.rank, "ListMultipartUploads", Prefix)
            yield {"Uploads": []}
            return
        keys = sorted(k for k in self.fake.store.sizes if k.startswith(Prefix))
        for start in range(0, max(1, len(keys)), 1000):  # S3 lists 1,000 keys a page
            self.fake.rec.add(self.fake.rank, "ListObjectsV2", Prefix)
            page = keys[start : start + 1000]
            yield {"Contents": [{"Key": k, "Size": self.fake.store.sizes[k]} for k in page]}


class Store:
    """The bucket: every object's size; the bytes of the small control
    objects (marker, manifest, ``.metadata``), which the commit reads back,
    and of the data files of the ranks in ``kept`` (those the load reads
    for real)."""

    def __init__(self, kept: frozenset[int] = frozenset()) -> None:
        self.sizes: dict[str, int] = {}
        self.data: dict[str, bytes] = {}
        self.uploads: dict[str, tuple[str, dict[int, int]]] = {}
        self.parts: dict[str, dict[int, bytes]] = {}
        self.kept = kept
        self.lock = threading.Lock()

    def keeps(self, key: str) -> bool:
        rank = rank_of(key)
        return rank is None or rank in self.kept

    def put(self, key: str, body: Any) -> int:
        data = body if isinstance(body, (bytes, bytearray, memoryview)) else body.read()
        n = memoryview(data).nbytes
        with self.lock:
            self.sizes[key] = n
            if self.keeps(key):
                self.data[key] = bytes(data)
        return n


class FakeS3:
    """The part of boto3's S3 client that dcpstore's backend calls, in
    memory, recording each request for one simulated rank."""

    class _Config:
        request_checksum_calculation = "when_supported"

    class meta:  # noqa: N801  (boto3's attribute name)
        config: Any = None
        endpoint_url = "sim://s3"

    def __init__(self, store: Store, rec: Recorder, rank: int) -> None:
        self.store, self.rec, self.rank = store, rec, rank
        self.meta = FakeS3.meta()
        self.meta.config = FakeS3._Config()

    def put_object(self, Bucket: str, Key: str, Body: Any, **_: Any) -> dict[str, Any]:  # noqa: N803
        n = self.store.put(Key, Body)
        self.rec.add(self.rank, "PutObject", Key, n)
        return {"ETag": '"x"'}

    def create_multipart_upload(self, Bucket: str, Key: str, **_: Any) -> dict[str, Any]:  # noqa: N803
        upload = f"u{len(self.store.uploads)}-{Key}"
        with self.store.lock:
            self.store.uploads[upload] = (Key, {})
        self.rec.add(self.rank, "CreateMultipartUpload", Key)
        return {"UploadId": upload}

    def upload_part(self, Bucket: str, Key: str, UploadId: str, PartNumber: int, Body: Any, **_: Any) -> dict[str, Any]:  # noqa: N803
        data = Body if isinstance(Body, (bytes, bytearray, memoryview)) else Body.read()
        n = memoryview(data).nbytes
        with self.store.lock:
            self.store.uploads[UploadId][1][PartNumber] = n
            if self.store.keeps(Key):
                self.store.parts.setdefault(UploadId, {})[PartNumber] = bytes(data)
        self.rec.add(self.rank, "UploadPart", Key, n)
        return {"ETag": f'"p{PartNumber}"'}

    def complete_multipart_upload(self, Bucket: str, Key: str, UploadId: str, **_: Any) -> dict[str, Any]:  # noqa: N803
        with self.store.lock:
            key, parts = self.store.uploads.pop(UploadId)
            self.store.sizes[key] = sum(parts.values())
            kept = self.store.parts.pop(UploadId, None)
            if kept is not None:
                self.store.data[key] = b"".join(kept[i] for i in sorted(kept))
        self.rec.add(self.rank, "CompleteMultipartUpload", Key)
        return {}

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str, **_: Any) -> dict[str, Any]:  # noqa: N803
        with self.store.lock:
            self.store.uploads.pop(UploadId, None)
            self.store.parts.pop(UploadId, None)
        self.rec.add(self.rank, "AbortMultipartUpload", Key)
        return {}

    def get_object(self, Bucket: str, Key: str, Range: str = "", **_: Any) -> dict[str, Any]:  # noqa: N803
        if Key not in self.store.data:
            self.rec.add(self.rank, "GetObject", Key)
            raise _error("NoSuchKey", 404, "GetObject")
        data = self.store.data[Key]
        lo, _, hi = Range.removeprefix("bytes=").partition("-")
        start, end = int(lo or 0), min(len(data), int(hi) + 1 if hi else len(data))
        self.rec.add(self.rank, "GetObject", Key, max(0, end - start))
        if start >= len(data) and data:
            raise _error("InvalidRange", 416, "GetObject")
        chunk = data[start:end]
        return {
            "Body": _Body(chunk),
            "ContentLength": len(chunk),
            "ContentRange": f"bytes {start}-{end - 1}/{len(data)}",
        }

    def head_object(self, Bucket: str, Key: str, **_: Any) -> dict[str, Any]:  # noqa: N803
        self.rec.add(self.rank, "HeadObject", Key)
        if Key not in self.store.sizes:
            raise _error("404", 404, "HeadObject")
        return {"ContentLength": self.store.sizes[Key], "ETag": '"x"'}

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:  # noqa: N803
        with self.store.lock:
            for obj in Delete["Objects"]:
                self.store.sizes.pop(obj["Key"], None)
                self.store.data.pop(obj["Key"], None)
        self.rec.add(self.rank, "DeleteObjects", Delete["Objects"][0]["Key"] if Delete["Objects"] else "")
        return {}

    def list_objects_v2(self, Bucket: str, Prefix: str = "", **_: Any) -> dict[str, Any]:  # noqa: N803
        self.rec.add(self.rank, "ListObjectsV2", Prefix)
        keys = sorted(k for k in self.store.sizes if k.startswith(Prefix))[:1000]
        return {"Contents": [{"Key": k, "Size": self.store.sizes[k]} for k in keys]}

    def get_paginator(self, name: str) -> _Paginator:
        return _Paginator(self, name)


# ---------------------------------------------------------------------------
# Driving DCP's save protocol for N ranks in one process
# ---------------------------------------------------------------------------


class SimWriter(DcpStorageWriter):
    """dcpstore's writer with the ranks' exchange of the one ownership
    check modelled (ranks here share a process, not a process group): the
    coordinator, which :func:`simulate` runs last, makes the check; every
    other rank takes its outcome, which costs S3 nothing."""

    shares_owner_check = True

    def shares_check_among(self, ranks: int) -> bool:
        return ranks > 1

    def exchange_owner_check(self, ready: bool) -> BaseException | None:
        if not self._coordinator:
            return None
        try:
            self.session.check_owner()
        except Exception as e:  # noqa: BLE001 -- handed to the gate, as the real exchange does
            return e
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def load_sample(ranks: int, sample: int) -> list[int]:
    """The ranks whose load runs for real: all of them up to ``sample``,
    else the coordinator and ``sample - 1`` others spread over the job."""
    if ranks <= sample:
        return list(range(ranks))
    step = ranks / (sample - 1)
    return sorted({0, *(min(ranks - 1, int(1 + k * step)) for k in range(sample - 1))})


def simulate(
    ranks: int,
    state: dict[str, torch.Tensor],
    *,
    options: StorageOptions,
    workers: int | None,
    uri: str,
    spread: int | str = AUTO_SPREAD,
    sample: int = 16,
) -> tuple[Recorder, Recorder, dict[str, Any]]:
    """One save of ``ranks`` ranks, each saving ``state`` under its own keys
    (the same tensors: only the bytes of the ranks the load reads for real
    are kept), through dcpstore's writer and S3 backend over
    :class:`FakeS3`; then every rank loading its keys back through
    dcpstore's reader (:func:`simulate_load`). Returns the save's requests,
    the load's, and what was measured for real.

    Python's cyclic collector is off meanwhile (but for the finish): the
    heap of N simulated ranks is no rank's, and full collections over it
    would make the run, and each rank's measured CPU, grow with N."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(ranks, state, options=options, workers=workers, uri=uri, spread=spread, sample=sample)
    finally:
        gc.collect()
        if enabled:
            gc.enable()


def _simulate(
    ranks: int,
    state: dict[str, torch.Tensor],
    *,
    options: StorageOptions,
    workers: int | None,
    uri: str,
    spread: int | str,
    sample: int,
) -> tuple[Recorder, Recorder, dict[str, Any]]:
    """:func:`simulate`, the collector off."""
    sampled = load_sample(ranks, sample)
    store, rec = Store(frozenset(sampled)), Recorder()
    writers, planners, plans = [], [], []
    for rank in range(ranks):
        storage = open_storage(uri, storage_options=options)
        storage.client = FakeS3(store, rec, rank)  # type: ignore[attr-defined]
        writer = SimWriter(storage, workers=workers, spread_prefixes=spread)
        planner = DefaultSavePlanner()
        planner.set_up_planner({f"rank{rank}.{k}": v for k, v in state.items()}, is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        writers.append(writer)
        planners.append(planner)
    rec.phase = "claim"
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    rec.phase = "write"
    results: list[Any] = [None] * ranks
    cpu_write = 0.0
    for rank in [*range(1, ranks), 0]:  # the coordinator's one check after every file is written
        plan = planners[rank].finish_plan(global_plans[rank])
        t0 = time.process_time()
        results[rank] = writers[rank].write_data(plan, planners[rank]).wait()
        cpu_write += time.process_time() - t0
        if rank:
            writers[rank].storage.close()  # its request pool: one rank's threads at a time
    rec.phase = "commit"
    # The other ranks' writers and planners, and the recorded requests, are
    # this simulation's, not the coordinator's: out of the collector's way,
    # so that the finish is measured on a heap like a coordinator's (its
    # own writer, the gathered results, the metadata, the collector on)
    # and not slowed by full collections over 16,384 ranks' objects.
    del writers[1:], planners[1:], plans
    gc.collect()
    gc.freeze()
    gc.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        writers[0].finish(metadata, results)
    finally:
        c1 = time.process_time()
        gc.disable()
        gc.unfreeze()
    measured = {
        "finish_wall_s": time.perf_counter() - t0,
        "finish_cpu_s": c1 - c0,
        "write_cpu_s_per_rank": cpu_write / ranks,
        "workers": writers[0].workers,
        "spread_prefixes": resolve_spread_prefixes(spread, ranks),
        "manifest_bytes": store.sizes.get(_key(uri, ".dcpstore.json"), 0),
        "metadata_bytes": store.sizes.get(_key(uri, ".metadata"), 0),
    }
    writers[0].storage.close()
    loads, load_measured = simulate_load(
        ranks, sampled, state, store, options=options, workers=workers, uri=uri, spread=measured["spread_prefixes"]
    )
    measured.update(load_measured)
    return rec, loads, measured


def simulate_load(
    ranks: int,
    sampled: Sequence[int],
    state: dict[str, torch.Tensor],
    store: Store,
    *,
    options: StorageOptions,
    workers: int | None,
    uri: str,
    spread: int,
) -> tuple[Recorder, dict[str, Any]]:
    """Every rank loading the keys it saved, through dcpstore's reader as
    ``dcpstore.load`` drives it (the commit read on the coordinator, handed
    to the others as ``share_commit`` does; the destination check, DCP's
    plans, ``read_data``), verified. The ``sampled`` ranks run for
    real; each other rank's requests are the first sampled non-coordinator
    rank's, with that rank's file names and spread directory swapped for
    its own (``spread``: the save's spread prefixes). Returns the requests
    and the sampled ranks' measured CPU."""
    rec = Recorder()
    readers, planners, plans, dests = {}, {}, {}, {}
    cpu = 0.0
    metadata = None
    for rank in sampled:
        storage = open_storage(uri, storage_options=options)
        storage.client = FakeS3(store, rec, rank)  # type: ignore[attr-defined]
        reader = DcpStorageReader(storage, workers=workers)
        dest = {f"rank{rank}.{k}": torch.empty_like(v) for k, v in state.items()}
        rec.phase = "meta"
        c0 = time.process_time()
        if rank == sampled[0]:  # DcpStorageReader.share_commit: the coordinator reads, the others take it
            shared = reader.commit_for_sharing()
        else:
            reader.take_commit(shared)
        reader.check_destination(dest)
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, rank == 0)
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dest, metadata, rank == 0)
        plans[rank] = reader.prepare_local_plan(planner.create_local_plan())
        cpu += time.process_time() - c0
        readers[rank], planners[rank], dests[rank] = reader, planner, dest
    coordinator = planners[sampled[0]]
    global_plans = readers[sampled[0]].prepare_global_plan(coordinator.create_global_plan([plans[r] for r in sampled]))
    rec.phase = "read"
    for rank, plan in zip(sampled, global_plans):
        c0 = time.process_time()
        readers[rank].read_data(planners[rank].finish_plan(plan), planners[rank]).wait()
        cpu += time.process_time() - c0
        readers[rank].storage.close()
        if not all(torch.equal(dests[rank][f"rank{rank}.{k}"], v) for k, v in state.items()):
            raise AssertionError(f"rank {rank} loaded other bytes than it saved")
    template = next((r for r in sampled if r), None)
    if template is not None:
        like = [r for r in rec.requests if r.rank == template]
        for rank in range(ranks):
            if rank not in readers:
                rec.requests.extend(_as_rank(req, template, rank, spread) for req in like)
    return rec, {"load_cpu_s_per_rank": cpu / len(sampled), "load_sampled_ranks": len(sampled)}


def _as_rank(req: Request, template: int, rank: int, spread: int) -> Request:
    """``req`` of rank ``template``, as rank ``rank`` makes it."""
    key = req.key
    if rank_of(key) == template:
        head, _, name = key.rpartition("/")
        name = name.replace(f"__{template}_", f"__{rank}_", 1)
        if spread > 1:
            head = head.rsplit("/", 1)[0] + "/" + spread_dir(rank, spread)
        key = f"{head}/{name}"
    return Request(rank, req.phase, req.kind, key, req.nbytes)


def _key(uri: str, name: str) -> str:
    return f"{uri.split('://', 1)[1].split('/', 1)[1].strip('/')}/{name}"


# ---------------------------------------------------------------------------
# The endpoint model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """How long requests take at a far-away S3. The defaults are round
    figures for S3 in the same region: ~20 ms to the first byte, ~80 MB/s
    per connection, a rank's share of a node's network, and S3's documented
    per-prefix request rates."""

    latency_s: float = 0.020
    connection_bps: float = 80e6
    rank_bps: float = 3.0e9
    write_rate: float = 3500.0  # PUT/POST/DELETE per second per prefix
    read_rate: float = 5500.0  # GET/HEAD per second per prefix

    def request_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.connection_bps


def prefix_of(key: str) -> str:
    """The prefix S3 rates a key under: everything up to its last ``/``."""
    return key.rsplit("/", 1)[0] + "/" if "/" in key else ""


def _chain_s(model: Model, reqs: Sequence[Request]) -> float:
    """Requests made one after another."""
    return sum(model.request_s(r.nbytes) for r in reqs)


def rank_write_s(model: Model, reqs: Sequence[Request], connections: int) -> float:
    """One rank's write phase: its files' uploads side by side. Each file
    starts its upload (one round trip), streams its parts and single PUTs
    over the rank's ``connections`` (no faster than the rank's share of the
    network), then learns the save is still its own (the ranks' exchange
    around the coordinator's one read of the marker: a round trip) and
    completes (another)."""
    data = [r for r in reqs if r.kind in ("UploadPart", "PutObject")]
    if not data:
        return _chain_s(model, reqs)
    busy = sum(model.request_s(r.nbytes) for r in data) / min(connections, len(data))
    transfer = max(busy, sum(r.nbytes for r in data) / model.rank_bps)
    multipart = any(r.kind == "CreateMultipartUpload" for r in reqs)
    return transfer + model.latency_s * (3 if multipart else 2)


def evaluate(model: Model, rec: Recorder, connections: int) -> dict[str, Any]:
    """The modelled durations and request rates of one simulated save."""
    by_phase: dict[str, list[Request]] = collections.defaultdict(list)
    for r in rec.requests:
        by_phase[r.phase].append(r)
    per_rank: dict[int, list[Request]] = collections.defaultdict(list)
    for r in by_phase["write"]:
        per_rank[r.rank].append(r)
    write_s = max((rank_write_s(model, reqs, connections) for reqs in per_rank.values()), default=0.0)
    # Demand on each prefix during the write phase, by the rate it counts against.
    demand: collections.Counter[tuple[str, str]] = collections.Counter()
    for r in by_phase["write"]:
        demand[(prefix_of(r.key), "write" if r.kind in WRITE_KINDS else "read")] += 1

    def limit_of(kind: str) -> float:
        return model.write_rate if kind == "write" else model.read_rate

    # The busiest prefix: the one whose demand is the largest share of its limit.
    (busiest, kind), count = max(demand.items(), key=lambda d: d[1] / limit_of(d[0][1]), default=(("", "write"), 0))
    limit = limit_of(kind)
    throttled_s = max([write_s] + [n / limit_of(k) for (_, k), n in demand.items()])
    kinds = collections.Counter(r.kind for r in rec.requests)
    per_kind = {k: max((n for (_, kk), n in demand.items() if kk == k), default=0) for k in ("write", "read")}
    return {
        "requests": len(rec.requests),
        "by_kind": dict(sorted(kinds.items())),
        "data_bytes": sum(r.nbytes for r in rec.requests if r.kind in ("UploadPart", "PutObject")),
        "prefixes": len({p for p, _ in demand}),
        "claim_s": _chain_s(model, by_phase["claim"]),
        "write_s": write_s,
        "commit_s": _chain_s(model, by_phase["commit"]),
        "busiest_prefix": busiest,
        "busiest_kind": kind,
        "busiest_requests": count,
        "busiest_rate": count / write_s if write_s else 0.0,
        # per rate: the busiest prefix's requests and rate, writes and reads apart
        "busiest_write_requests": per_kind["write"],
        "busiest_write_rate": per_kind["write"] / write_s if write_s else 0.0,
        "busiest_read_requests": per_kind["read"],
        "busiest_read_rate": per_kind["read"] / write_s if write_s else 0.0,
        "write_prefixes": sorted({p for p, k in demand if k == "write"}),
        "rate_limit": limit,
        "write_s_throttled": throttled_s,
    }


def rank_read_s(model: Model, reqs: Sequence[Request], connections: int) -> float:
    """One rank's load: its commit read (``.metadata``, the manifest and a
    listing page, side by side), then its files' byte ranges over its
    ``connections``, no faster than the rank's share of the network."""
    meta = [r for r in reqs if r.phase == "meta"]
    data = [r for r in reqs if r.phase == "read"]
    meta_s = max((model.request_s(r.nbytes) for r in meta), default=0.0)
    if not data:
        return meta_s
    busy = sum(model.request_s(r.nbytes) for r in data) / min(connections, len(data))
    return meta_s + max(busy, sum(r.nbytes for r in data) / model.rank_bps)


def evaluate_load(model: Model, rec: Recorder, connections: int) -> dict[str, Any]:
    """The modelled duration and request rates of one simulated load: every
    rank starts at once, so each prefix's requests fall within the slowest
    rank's load."""
    per_rank: dict[int, list[Request]] = collections.defaultdict(list)
    for r in rec.requests:
        per_rank[r.rank].append(r)
    load_s = max((rank_read_s(model, reqs, connections) for reqs in per_rank.values()), default=0.0)
    demand: collections.Counter[str] = collections.Counter(prefix_of(r.key) for r in rec.requests)
    busiest, count = max(demand.items(), key=lambda d: d[1], default=("", 0))
    data = [r for r in rec.requests if rank_of(r.key) is not None]
    data_demand = collections.Counter(prefix_of(r.key) for r in data)
    kinds = collections.Counter(r.kind for r in rec.requests)
    return {
        "requests": len(rec.requests),
        "by_kind": dict(sorted(kinds.items())),
        "lists": kinds["ListObjectsV2"],
        "metadata_gets": sum(1 for r in rec.requests if r.kind == "GetObject" and r.key.endswith("/.metadata")),
        "data_bytes": sum(r.nbytes for r in data),
        "load_s": load_s,
        "busiest_prefix": busiest,
        "busiest_requests": count,
        "busiest_rate": count / load_s if load_s else 0.0,
        "busiest_data_rate": max(data_demand.values(), default=0) / load_s if load_s else 0.0,
        "rate_limit": model.read_rate,
        "load_s_throttled": max([load_s] + [n / model.read_rate for n in demand.values()]),
    }


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


@dataclass
class Point:
    ranks: int
    model: dict[str, Any]
    measured: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    #: The load's figures (:func:`evaluate_load`).
    load: dict[str, Any] = field(default_factory=dict)


def run(
    ranks: Sequence[int],
    state: dict[str, torch.Tensor],
    model: Model,
    options: StorageOptions,
    workers: int | None,
    uri: str,
    progress: bool,
    spreads: Sequence[int | str] = (AUTO_SPREAD,),
    sample: int = 16,
) -> list[Point]:
    points = []
    for spread in spreads:
        for n in ranks:
            t0 = time.perf_counter()
            rec, loads, measured = simulate(
                n, state, options=options, workers=workers, uri=uri, spread=spread, sample=sample
            )
            point = Point(n, evaluate(model, rec, options.max_concurrency), measured, {"spread": spread})
            point.load = evaluate_load(model, loads, options.max_concurrency)
            point.extra["simulated_in_s"] = time.perf_counter() - t0
            points.append(point)
            if progress:
                took = point.extra["simulated_in_s"]
                print(f"  {n} ranks, spread {spread}: simulated in {took:.1f} s", file=sys.stderr, flush=True)
    return points


def table(points: Sequence[Point]) -> list[list[str]]:
    head = [
        "ranks",
        "spread",
        "requests",
        "data",
        "prefixes",
        "claim s",
        "write s",
        "commit s",
        "busiest prefix req/s",
        "S3 limit",
        "busiest PUT/s",
        "busiest GET/s",
        "write s at the limit",
        "manifest + .metadata",
        "finish CPU s",
    ]
    body = [head]
    for p in points:
        m, x = p.model, p.measured
        body.append(
            [
                str(p.ranks),
                spread_text(p),
                f"{m['requests']:,}",
                human_bytes(m["data_bytes"]),
                str(m["prefixes"]),
                f"{m['claim_s']:.3f}",
                f"{m['write_s']:.2f}",
                f"{m['commit_s']:.3f}",
                f"{m['busiest_rate']:,.0f} ({m['busiest_kind']})",
                f"{m['rate_limit']:,.0f}",
                f"{m['busiest_write_rate']:,.0f}",
                f"{m['busiest_read_rate']:,.0f}",
                f"{m['write_s_throttled']:.2f}",
                human_bytes(x["manifest_bytes"] + x["metadata_bytes"]),
                f"{x['finish_cpu_s']:.3f}",
            ]
        )
    return body


def spread_text(p: Point) -> str:
    """The spread asked for, and what ``auto`` came to."""
    spread = p.extra.get("spread", 1)
    return f"auto: {p.measured['spread_prefixes']}" if spread == AUTO_SPREAD else str(spread)


def load_table(points: Sequence[Point]) -> list[list[str]]:
    """The loads of ``points``' checkpoints, every rank reading what it saved."""
    head = [
        "ranks",
        "spread",
        "requests",
        "LISTs",
        ".metadata GETs",
        "load s",
        "busiest prefix GET/s",
        "S3 limit",
        "busiest data prefix GET/s",
        "load s at the limit",
    ]
    body = [head]
    for p in points:
        x = p.load
        body.append(
            [
                str(p.ranks),
                spread_text(p),
                f"{x['requests']:,}",
                f"{x['lists']:,}",
                f"{x['metadata_gets']:,}",
                f"{x['load_s']:.2f}",
                f"{x['busiest_rate']:,.0f}",
                f"{x['rate_limit']:,.0f}",
                f"{x['busiest_data_rate']:,.0f}",
                f"{x['load_s_throttled']:.2f}",
            ]
        )
    return body


def _text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plot(path: str, points: Sequence[Point]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    by_spread: dict[int | str, list[Point]] = collections.defaultdict(list)
    for p in points:
        by_spread[p.extra.get("spread", 1)].append(p)
    for spread, group in sorted(by_spread.items(), key=lambda kv: str(kv[0])):
        n = [p.ranks for p in group]
        tag = "" if len(by_spread) == 1 else f", spread {spread}"
        axes[0].plot(n, [p.model["requests"] for p in group], marker="o", label=f"requests{tag}")
        axes[1].plot(n, [p.model["busiest_rate"] for p in group], marker="o", label=f"busiest prefix{tag}")
        axes[2].plot(n, [p.model["write_s"] for p in group], marker="o", label=f"write (unthrottled){tag}")
        axes[2].plot(
            n, [p.model["write_s_throttled"] for p in group], marker="o", label=f"write at the prefix limit{tag}"
        )
        axes[2].plot(n, [p.model["commit_s"] for p in group], marker="o", label=f"commit{tag}")
    n = sorted({p.ranks for p in points})
    axes[1].plot(n, [points[0].model["rate_limit"]] * len(n), linestyle="--", label="S3 limit per prefix")
    axes[0].set_title("requests per save")
    axes[1].set_title("request rate (per s)")
    axes[1].legend(fontsize=8)
    axes[2].set_title("modelled seconds")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,8,64,256,1024", help="simulated rank counts (default 1,8,64,256,1024)")
    p.add_argument("--size", default="64MiB", help="state per rank (default 64MiB)")
    p.add_argument("--tensors", type=int, default=8, help="tensors per rank (default 8)")
    p.add_argument("--workers", type=int, help="writer threads per rank (default: the S3 backend's)")
    p.add_argument("--max-concurrency", type=int, help="connections per rank (default: StorageOptions')")
    p.add_argument(
        "--spread", default=AUTO_SPREAD, help="spread_prefixes values to simulate at every rank count (default auto)"
    )
    p.add_argument(
        "--load-sample", type=int, default=16, help="ranks whose load runs for real; the others are modelled on them"
    )
    p.add_argument("--latency-ms", type=float, default=Model.latency_s * 1e3)
    p.add_argument("--connection-mbps", type=float, default=Model.connection_bps / 1e6, help="MB/s per connection")
    p.add_argument("--rank-gbps", type=float, default=Model.rank_bps / 1e9, help="GB/s per rank")
    p.add_argument("--uri", default="s3://sim-bucket/run1/step100", help="where the simulated checkpoint goes")
    p.add_argument("--json", help="write the points here")
    p.add_argument("--plot", help="PNG of requests, prefix rate and phase times against ranks")
    p.add_argument("--label", default="")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    model = Model(
        latency_s=args.latency_ms / 1e3, connection_bps=args.connection_mbps * 1e6, rank_bps=args.rank_gbps * 1e9
    )
    options = StorageOptions() if args.max_concurrency is None else StorageOptions(max_concurrency=args.max_concurrency)
    state = make_state(parse_size(args.size), args.tensors)
    ranks = parse_int_list(args.ranks, "ranks")
    points = run(
        ranks,
        state,
        model,
        options,
        args.workers,
        args.uri,
        not args.quiet,
        [AUTO_SPREAD if v.strip() == AUTO_SPREAD else parse_int_list(v, "spread")[0] for v in args.spread.split(",")],
        args.load_sample,
    )
    print(_text(table(points)))
    print()
    print(_text(load_table(points)))
    if args.json:
        doc = {
            "meta": result_meta(
                "scale_sim.py",
                argv if argv is not None else sys.argv[1:],
                args.label,
                model=asdict(model),
                max_concurrency=options.max_concurrency,
                state_bytes=parse_size(args.size),
                tensors=args.tensors,
                load_sample=args.load_sample,
            ),
            "points": [asdict(pt) for pt in points],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, points)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
