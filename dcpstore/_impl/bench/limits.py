"""The limit rows: what a storage gives to the plainest code, at its best.

A ratio against a limit is only honest if the limit is the best the storage
gives, not one arbitrary way of driving it. So the limits are swept:

* :class:`RawFiles` -- local disks: ``workers`` threads each write their
  share of the tensors' bytes straight from tensor memory into one file
  (``os.write``, which releases the GIL), ``fsync`` and close it; the load
  reads the files back with ``readinto`` straight into the destination
  tensors. No serialisation, no checksums, no rename. One row per thread
  count.
* :class:`RawS3` -- object stores: the same bytes as ``objects`` objects,
  each a multipart upload of ``part_size`` parts (one PUT when smaller), all
  parts of all objects on one pool of ``connections`` threads; the load as
  ranged GETs of ``part_size`` into the destination. boto3 and nothing
  else, request checksums off. :func:`s3_sweep` makes one row per
  (connections, part size) worth measuring.

:func:`best_limits` then keeps, per direction, the best row that ran, and
:func:`limit_ratios` puts every other row against it: ``dcpstore bench``
and the comparison tables print those ratios.

A limit measured through an emulated network is the network's only if the
emulation itself (the shaping proxy and the endpoint behind it, on the same
machine) is not what stops it. :class:`HarnessRaw` rows -- the widest raw
row of each part size, through the same proxy with its shaping off -- say
how far the harness goes, and :func:`harness_verdicts` calls a direction
*network-bound* only where that is at least :data:`HARNESS_MARGIN` times the
best row measured through the shaping; otherwise *harness-bound*, and no
row of that direction may be called at the limit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dcpstore._impl.bench.runner import Entry, Skip, Waiter, done
from dcpstore._impl.storage.byte_ranges import ceil_div
from dcpstore._impl.util.units import human_bytes

MiB = 1 << 20

#: Connections and part/range sizes the S3 limit is swept over.
SWEEP_CONNECTIONS = (1, 2, 4, 8, 16, 32)
SWEEP_PART_SIZES = (8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB)
#: Objects the raw S3 rows split the bytes into.
RAW_OBJECTS = 4

Row = dict[str, Any]


def shares(state: dict[str, torch.Tensor], n: int) -> list[list[str]]:
    """Size-balanced groups of keys: largest tensor first into the lightest group."""
    groups: list[list[str]] = [[] for _ in range(n)]
    sizes = [0] * n
    for key in sorted(state, key=lambda k: state[k].nbytes, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(key)
        sizes[i] += state[key].nbytes
    return [g for g in groups if g]


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (contiguous CPU tensors only)."""
    array: Any = t.detach().contiguous().view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class RawFiles(Entry):
    """Threads writing and reading plain files: a local disk's limit."""

    group = "limit"
    backend = "local"
    engine = "threads"

    def __init__(self, root: str, workers: int) -> None:
        self.root = os.path.join(root, f"raw-w{workers}")
        self.workers = workers
        self.name = f"raw write+fsync / read, {workers} thread(s)"
        self._shares: list[list[str]] = []

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        self._shares = shares(state, self.workers)

    def _write(self, i: int, keys: list[str], state: dict[str, torch.Tensor]) -> None:
        fd = os.open(os.path.join(self.root, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for key in keys:
                view = byte_view(state[key])
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        os.makedirs(self.root, exist_ok=True)
        with ThreadPoolExecutor(self.workers) as pool:
            for f in [pool.submit(self._write, i, keys, state) for i, keys in enumerate(self._shares)]:
                f.result()
        return done()

    def _read(self, i: int, keys: list[str], dest: dict[str, torch.Tensor]) -> None:
        with open(os.path.join(self.root, f"{i}.bin"), "rb", buffering=0) as f:
            for key in keys:
                view = byte_view(dest[key])
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{f.name} is short")
                    view = view[n:]

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        with ThreadPoolExecutor(self.workers) as pool:
            for f in [pool.submit(self._read, i, keys, dest) for i, keys in enumerate(self._shares)]:
                f.result()

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def raw_s3_client(endpoint: str | None, connections: int) -> Any:
    """A plain boto3 client: endpoint and credentials from the standard AWS
    sources (``endpoint`` overrides), one pooled connection per thread,
    request checksums only where the API requires them."""
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max(10, connections),
        retries={"max_attempts": 3, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


class _Parts:
    """One object's bytes as part-sized pieces of a list of tensors."""

    def __init__(self, keys: list[str], state: dict[str, torch.Tensor], part_size: int) -> None:
        self.keys = keys
        self.size = sum(state[k].nbytes for k in keys)
        self.ranges = [(off, min(part_size, self.size - off)) for off in range(0, self.size, part_size)]

    def views(self, tensors: dict[str, torch.Tensor], offset: int, length: int) -> list[memoryview]:
        out, pos = [], 0
        for key in self.keys:
            view = byte_view(tensors[key])
            lo, hi = max(offset, pos), min(offset + length, pos + len(view))
            if lo < hi:
                out.append(view[lo - pos : hi - pos])
            pos += len(view)
        return out


class RawS3(Entry):
    """boto3 alone, at one (connections, part size): an object store's limit
    for that setting (:func:`s3_sweep` makes the rows of a sweep)."""

    group = "limit"
    engine = "boto3"
    page_cached = False

    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        connections: int,
        part_size: int,
        *,
        prefix: str = "",
        backend: str = "s3",
        objects: int = RAW_OBJECTS,
    ) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.workers, self.part_size, self.objects, self.backend = connections, part_size, objects, backend
        tag = f"raw-{backend}-c{connections}-p{part_size >> 20}"
        self.prefix = f"{prefix.strip('/')}/{tag}" if prefix.strip("/") else tag
        self.name = raw_s3_name(backend, connections, part_size)
        self._objects: list[_Parts] = []
        self._client: Any = None

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            self._client = raw_s3_client(self.endpoint, self.workers)
        except ImportError as e:
            raise Skip(f"boto3 is not installed ({e})") from e
        self._objects = [_Parts(keys, state, self.part_size) for keys in shares(state, self.objects)]

    def _key(self, i: int) -> str:
        return f"{self.prefix}/{i}.bin"

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        c, pool = self._client, ThreadPoolExecutor(self.workers)
        try:
            uploads = {}
            for i, obj in enumerate(self._objects):
                if len(obj.ranges) > 1:
                    uploads[i] = c.create_multipart_upload(Bucket=self.bucket, Key=self._key(i))["UploadId"]

            def put(i: int, n: int, off: int, length: int) -> dict[str, Any]:
                body = b"".join(self._objects[i].views(state, off, length))
                if i not in uploads:
                    c.put_object(Bucket=self.bucket, Key=self._key(i), Body=body)
                    return {}
                r = c.upload_part(Bucket=self.bucket, Key=self._key(i), UploadId=uploads[i], PartNumber=n, Body=body)
                return {"PartNumber": n, "ETag": r["ETag"]}

            jobs = {
                (i, n): pool.submit(put, i, n, off, ln)
                for i, obj in enumerate(self._objects)
                for n, (off, ln) in enumerate(obj.ranges, 1)
            }
            parts = {key: f.result() for key, f in jobs.items()}

            def complete(i: int, upload_id: str) -> None:
                done_parts = [parts[(i, n)] for n in range(1, len(self._objects[i].ranges) + 1)]
                c.complete_multipart_upload(
                    Bucket=self.bucket, Key=self._key(i), UploadId=upload_id, MultipartUpload={"Parts": done_parts}
                )

            for f in [pool.submit(complete, i, u) for i, u in uploads.items()]:
                f.result()
        finally:
            pool.shutdown()
        return done()

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        def get(i: int, off: int, length: int) -> None:
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(i), Range=f"bytes={off}-{off + length - 1}")
            body = memoryview(r["Body"].read())
            pos = 0
            for view in self._objects[i].views(dest, off, length):
                view[:] = body[pos : pos + len(view)]
                pos += len(view)

        with ThreadPoolExecutor(self.workers) as pool:
            jobs = [pool.submit(get, i, off, ln) for i, obj in enumerate(self._objects) for off, ln in obj.ranges]
            for f in jobs:
                f.result()

    def cleanup(self) -> None:
        keys = [{"Key": self._key(i)} for i in range(len(self._objects))]
        if keys and self._client is not None:
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class HarnessRaw(RawS3):
    """A :class:`RawS3` row through the emulation with its shaping off: what
    the harness (proxy and endpoint, on this machine) passes at most. Not a
    limit row: :func:`best_limits` never takes it."""

    group = "harness"

    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        connections: int,
        part_size: int,
        *,
        prefix: str = "",
        backend: str = "s3",
    ) -> None:
        super().__init__(
            endpoint, bucket, connections, part_size, prefix=f"{prefix.strip('/')}/harness", backend=backend
        )
        self.name = f"harness: {raw_s3_name(backend, connections, part_size)}, shaping off"


def harness_points(
    nbytes: int,
    connections: Sequence[int] = SWEEP_CONNECTIONS,
    objects: int = RAW_OBJECTS,
    part_sizes: Sequence[int] = SWEEP_PART_SIZES,
) -> list[tuple[int, int]]:
    """The widest (connections, part size) of the sweep for each part size:
    the points where a harness would show its ceiling first."""
    widest: dict[int, int] = {}
    for c, p in sweep_points(nbytes, objects, connections, part_sizes):
        widest[p] = max(widest.get(p, 0), c)
    return [(c, p) for p, c in sorted(widest.items())]


#: How much faster than the best measured row the harness must go, with its
#: shaping off, for that row to be the emulated network's limit and not the
#: harness's.
HARNESS_MARGIN = 2.0


def harness_verdicts(rows: Iterable[Row], margin: float = HARNESS_MARGIN) -> dict[str, Row]:
    """Per direction: the fastest harness row (group ``"harness"``), the
    fastest other row that ran, their ratio, and ``bound``: ``"network"``
    when the harness passes at least ``margin`` times that row, else
    ``"harness"``. A direction without harness rows is left out (nothing
    says the harness is not the limit, and nothing says it is)."""
    rows = [r for r in rows if r.get("status") == "ok"]
    out: dict[str, Row] = {}
    for direction in ("write", "read"):
        key = f"{direction}_gbps"
        harness = [r for r in rows if r.get("group") == "harness" and r.get(key)]
        measured = [r for r in rows if r.get("group") != "harness" and r.get(key)]
        if not harness or not measured:
            continue
        top, best = max(harness, key=lambda r: r[key]), max(measured, key=lambda r: r[key])
        ratio = top[key] / best[key]
        out[direction] = {
            "harness": top["name"],
            "harness_gbps": top[key],
            "best": best["name"],
            "best_gbps": best[key],
            "ratio": ratio,
            "margin": margin,
            "bound": "network" if ratio >= margin else "harness",
        }
    return out


def raw_s3_name(backend: str, connections: int, part_size: int) -> str:
    return f"raw PUT/GET ({backend}) c={connections} part={human_bytes(part_size)}"


def pieces(nbytes: int, objects: int, part_size: int) -> int:
    """Requests one direction of a :class:`RawS3` row makes: the parts (or
    ranges) of ``objects`` near-equal objects holding ``nbytes``."""
    each = ceil_div(nbytes, objects)
    return objects * max(1, ceil_div(each, part_size))


def sweep_points(
    nbytes: int,
    objects: int = RAW_OBJECTS,
    connections: Sequence[int] = SWEEP_CONNECTIONS,
    part_sizes: Sequence[int] = SWEEP_PART_SIZES,
) -> list[tuple[int, int]]:
    """The (connections, part size) points worth measuring for ``nbytes``:
    part sizes that give a distinct split, and for each only connection
    counts up to the first that covers every piece (more threads than
    requests add nothing)."""
    points: list[tuple[int, int]] = []
    splits: set[int] = set()
    for part in sorted(part_sizes):
        n = pieces(nbytes, objects, part)
        if n in splits:
            continue  # a larger part that splits the objects no differently
        splits.add(n)
        for c in sorted(connections):
            points.append((c, part))
            if c >= n:
                break
    return points


def s3_sweep(
    endpoint: str | None,
    bucket: str,
    nbytes: int,
    *,
    prefix: str = "",
    backend: str = "s3",
    objects: int = RAW_OBJECTS,
    connections: Sequence[int] = SWEEP_CONNECTIONS,
    part_sizes: Sequence[int] = SWEEP_PART_SIZES,
) -> list[RawS3]:
    """One :class:`RawS3` row per point of :func:`sweep_points`."""
    return [
        RawS3(endpoint, bucket, c, p, prefix=prefix, backend=backend, objects=objects)
        for c, p in sweep_points(nbytes, objects, connections, part_sizes)
    ]


# ---------------------------------------------------------------------------
# The best of a sweep, and ratios against it
# ---------------------------------------------------------------------------


def best_limits(rows: Iterable[Row]) -> dict[str, Row]:
    """Per direction (``"write"``, ``"read"``), the limit row (``group``
    ``"limit"``, with that direction's GB/s) that went fastest; a direction
    without any is left out."""
    best: dict[str, Row] = {}
    for r in rows:
        if r.get("group") != "limit" or r.get("status") != "ok":
            continue
        for direction in ("write", "read"):
            value = r.get(f"{direction}_gbps")
            if value and (direction not in best or value > best[direction][f"{direction}_gbps"]):
                best[direction] = r
    return best


def limit_ratios(rows: Sequence[Row]) -> list[Row]:
    """``rows`` with ``write_vs_limit`` / ``read_vs_limit`` added to every
    row outside the limit group: its GB/s over the best limit row's (see
    :func:`best_limits`; ``None`` where no limit was measured) and
    ``limit_write`` / ``limit_read``, those rows' names."""
    best = best_limits(rows)
    out = []
    for r in rows:
        r = dict(r)
        if r.get("group") != "limit":
            for direction in ("write", "read"):
                ref = best.get(direction)
                ours = r.get(f"{direction}_gbps")
                ok = ref is not None and ours is not None and r.get("status") == "ok"
                r[f"{direction}_vs_limit"] = ours / ref[f"{direction}_gbps"] if ok and ref is not None else None
                r[f"limit_{direction}"] = ref["name"] if ref is not None else None
        out.append(r)
    return out
