"""The limits: what the hardware / endpoint gives to the plainest code.

* :class:`RawFiles` -- ``workers`` threads each write their share of the
  tensors' bytes straight from tensor memory into one file (``os.write``,
  which releases the GIL), ``fsync`` and close it; the load reads the files
  back with ``readinto`` straight into the destination tensors. No
  serialisation, no checksums, no rename: the raw write and raw read limit.
* :class:`RawS3` -- the same bytes as 32 MiB PUTs (multipart uploads of
  one object per share, every part of every object in one pool of
  ``workers`` threads) and ranged GETs into the destination, with boto3 and
  nothing else (request checksums off: the raw HTTP limit of the endpoint).
* :class:`Clone` -- ``tensor.clone()`` of every tensor: the least an async
  save must block to take a consistent snapshot on the CPU.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dcpstore.bench import Entry, SaveOutcome, Skip, Waiter, done

MiB = 1 << 20


def shares(state: dict[str, torch.Tensor], workers: int) -> list[list[str]]:
    """Size-balanced groups of keys: largest tensor first into the lightest group."""
    groups: list[list[str]] = [[] for _ in range(workers)]
    sizes = [0] * workers
    for key in sorted(state, key=lambda k: state[k].nbytes, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(key)
        sizes[i] += state[key].nbytes
    return [g for g in groups if g]


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (contiguous CPU tensors only)."""
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


class RawFiles(Entry):
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
                    view = view[os.write(fd, view):]
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


class Clone(Entry):
    group = "limit"
    backend = "memory"
    engine = "clone"
    reads = False
    page_cached = False
    name = "clone() of every tensor"

    def __init__(self) -> None:
        self._copies: dict[str, torch.Tensor] = {}

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        self._copies = {k: v.clone() for k, v in state.items()}
        return done(SaveOutcome(phases={"stage": 0.0}))

    def cleanup(self) -> None:
        self._copies = {}


def s3_client(endpoint: str, workers: int) -> Any:
    import boto3
    from botocore.config import Config

    from servers import FAKE_CREDENTIALS

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(max_pool_connections=max(10, workers * 2), retries={"max_attempts": 3, "mode": "standard"},
                      request_checksum_calculation="when_required", response_checksum_validation="when_required"),
    )  # fmt: skip


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
    group = "limit"
    engine = "boto3"
    page_cached = False

    def __init__(self, endpoint: str, bucket: str, workers: int, *, backend: str = "s3", part_size: int = 32 * MiB) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.workers, self.backend, self.part_size = workers, backend, part_size
        self.prefix = f"raw-{backend}-w{workers}"
        self.name = f"raw PUT/GET ({backend}), {workers} thread(s)"
        self._objects: list[_Parts] = []
        self._client: Any = None

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            self._client = s3_client(self.endpoint, self.workers)
        except ImportError as e:
            raise Skip(f"boto3 is not installed ({e})") from e
        self._objects = [_Parts(keys, state, self.part_size) for keys in shares(state, self.workers)]

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

            jobs = {(i, n): pool.submit(put, i, n, off, ln)
                    for i, obj in enumerate(self._objects) for n, (off, ln) in enumerate(obj.ranges, 1)}  # fmt: skip
            parts = {key: f.result() for key, f in jobs.items()}
            for i, upload_id in uploads.items():
                done_parts = [parts[(i, n)] for n in range(1, len(self._objects[i].ranges) + 1)]
                c.complete_multipart_upload(Bucket=self.bucket, Key=self._key(i), UploadId=upload_id,
                                            MultipartUpload={"Parts": done_parts})  # fmt: skip
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
