"""What runs in Megatron's async checkpoint worker for
:class:`~dcpstore._impl.adapters.megatron_async.FileSystemWriterAsync`: the
preload (:func:`stage_buckets`) and the save function (:func:`write_buckets`).

The worker is another process (NVRx's persistent caller spawns it once and
pickles each request to it), so everything here is self-contained: module
level functions, and a picklable :class:`WorkerJob` that *describes* the
storage (URI and :class:`~dcpstore.StorageOptions`), reopened in
the worker, never a live client; credentials come from the standard sources
in the worker's environment, which it inherits from the trainer.

Results travel back in a private JSON file whose path the trainer chose
(:func:`read_results`): the persistent caller has no return channel, and a
file works for each way of running the request (persistent, forked, or
``execute_sync`` in the trainer itself). JSON, not pickle: nothing read back
is executed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from dcpstore._impl.dcp.commit.session import ItemRecord, SaveSession
from dcpstore._impl.dcp.data_files import file_size_hint, write_data_file
from dcpstore._impl.dcp.failures import describe_failure
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate, run_gated
from dcpstore._impl.format.record import compact_cpu_tensor
from dcpstore._impl.storage import Storage, StorageOptions, open_storage
from dcpstore._impl.util.progress import NO_PROGRESS
from dcpstore._impl.util.torch_compat import StorageWriterTransforms, StreamTransformExtension

log = logging.getLogger(__name__)

#: NVRx's ``WriteBucket``: (file path or URI, file name, (bytes items, tensor items)).
Bucket = tuple[str, str, tuple[list[tuple[WriteItem, Any]], list[tuple[WriteItem, Any]]]]


@dataclass(frozen=True)
class WorkerJob:
    """What the save function needs in the worker, all picklable: where to
    write, the session token every rank checks ownership against, the
    stream transforms, and where to leave the write results."""

    uri: str
    #: Where the bytes go (the client, MSC or native, and its tuning).
    storage_options: StorageOptions | None
    save_id: str
    tagged: bool
    extensions: tuple[StreamTransformExtension, ...]
    results_path: str

    def open(self) -> Storage:
        return open_storage(self.uri, storage_options=self.storage_options)


def stage_buckets(buckets: Sequence[Bucket]) -> list[Bucket]:
    """The preload function: the buckets with every tensor replaced by a host
    copy of its current value (CPU tensors cloned: in NVRx's persistent
    worker they arrive in shared memory, still the trainer's; device tensors
    copied to the host). Once it returns, training may change the originals."""
    staged: list[Bucket] = []
    on_device = False
    for path, name, (blobs, tensors) in buckets:
        copies = []
        for item, tensor in tensors:
            tensor = tensor.detach()
            if tensor.device.type == "cpu":
                copies.append((item, tensor.clone()))
            else:
                on_device = True
                copies.append((item, tensor.to("cpu", non_blocking=True)))
        staged.append((path, name, (list(blobs), copies)))
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return staged


class Preload:
    """``stage_buckets(buckets)`` as the picklable callable NVRx sends to its
    worker (and calls without arguments); ``staged``: every tensor is
    already a snapshot the save owns (the writer's
    ``use_cpu_shm_for_gpu_tensors``), handed on as it is."""

    def __init__(self, buckets: list[Bucket], staged: bool = False) -> None:
        self.buckets = buckets
        self.staged = staged

    def __call__(self) -> list[Bucket]:
        return list(self.buckets) if self.staged else stage_buckets(self.buckets)


def write_buckets(job: WorkerJob, buckets: Sequence[Bucket]) -> None:
    """The save function: write every bucket (one data file each, on its own
    thread, through the native writer's :func:`write_data_file`, each
    published only once the URI is still this save's) and leave the write
    results in ``job.results_path``. Never raises: a failure is left there
    instead (an exception would end NVRx's worker loop, and the trainer
    would wait for it forever)."""
    t0 = time.perf_counter()
    try:
        results: list[WriteResult] = []
        if buckets:
            storage = job.open()
            try:
                session = SaveSession(storage, job.save_id, job.tagged)
                transforms = StorageWriterTransforms(list(job.extensions)) if job.extensions else None

                batch = sum(file_size_hint([item for item, _ in (*b[2][0], *b[2][1])]) for b in buckets)

                def one(bucket: Bucket, gate: OwnerGate) -> list[WriteResult]:
                    _, name, (blobs, tensors) = bucket
                    pairs = [*blobs, *tensors]  # NVRx's order: bytes items first
                    data = {item.index: value for item, value in pairs}
                    items = [item for item, _ in pairs]
                    return write_data_file(
                        storage, name, items, lambda it: _data(data[it.index]), transforms, NO_PROGRESS, gate, batch
                    )

                per_file = run_gated(session.check_owner, one, list(buckets), "dcpstore-megatron")
                results = [r for rs in per_file for r in rs]
            finally:
                storage.close()
        _put(job.results_path, {"results": [_encode(r) for r in results], "write_s": time.perf_counter() - t0})
    except BaseException as e:  # reported, never raised: see above
        try:
            _put(job.results_path, {"error": describe_failure(e)})
        except OSError:
            log.exception("the Megatron async save worker could not report its failure")


def read_results(path: str) -> tuple[list[WriteResult], float] | str:
    """What the worker left at ``path`` (and remove it): its write results
    and the seconds it took to write them, or the description of its failure.

    Raises:
        FileNotFoundError: it left nothing (it did not run, or died).
        ValueError: the file is not what :func:`write_buckets` writes.
    """
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    finally:
        for name in (path, f"{path}.part"):
            try:
                os.remove(name)
            except FileNotFoundError:
                pass
    if not isinstance(payload, dict):
        raise ValueError("not a JSON object")
    if "error" in payload:
        return str(payload["error"])
    rows, write_s = payload.get("results"), payload.get("write_s")
    if not isinstance(rows, list) or not isinstance(write_s, (int, float)):
        raise ValueError("no results")
    return [_decode(row) for row in rows], float(write_s)


def _data(value: Any) -> io.BytesIO | torch.Tensor:
    return value if isinstance(value, io.BytesIO) else compact_cpu_tensor(value)


def _put(path: str, payload: dict[str, Any]) -> None:
    """Atomically: the trainer finds the whole file or none."""
    part = f"{path}.part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(part, path)


def _encode(wr: WriteResult) -> list[Any]:
    rec: ItemRecord = wr.storage_data
    index = wr.index
    offset = None if index.offset is None else list(index.offset)
    raw = None if rec.raw is None else list(rec.raw)
    return [
        index.fqn,
        offset,
        index.index,
        wr.size_in_bytes,
        rec.relative_path,
        rec.offset,
        rec.length,
        rec.crc32c,
        rec.file_size,
        rec.file_crc32c,
        raw,
        list(rec.transforms),
    ]


def _decode(row: Any) -> WriteResult:
    if not isinstance(row, list) or len(row) != 12:
        raise ValueError(f"malformed write result {row!r}")
    fqn, offset, index, size, path, off, length, crc, file_size, file_crc, raw, transforms = row
    ints = (size, off, length, crc, file_size, file_crc)
    if not (isinstance(fqn, str) and isinstance(path, str) and all(isinstance(v, int) and v >= 0 for v in ints)):
        raise ValueError(f"malformed write result {row!r}")
    return WriteResult(
        index=MetadataIndex(fqn, None if offset is None else torch.Size(offset), index),
        size_in_bytes=size,
        storage_data=ItemRecord(
            path, off, length, crc, file_size, file_crc, None if raw is None else (raw[0], raw[1]), tuple(transforms)
        ),
    )
