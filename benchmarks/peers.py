"""The peers: other ways to put a DCP checkpoint on storage, driven as their
documentation says, on the same state dict.

* ``dcp.save`` / ``dcp.async_save`` with ``FileSystemWriter`` (local files,
  ``sync_files=True``, thread_count 1 or ``workers``); loads with
  ``FileSystemReader``.
* DCP's ``FsspecWriter`` / ``FsspecReader`` with s3fs.
* MSC's ``MultiStorageFileSystemWriter`` / ``Reader`` (``msc://profile/...``).
* NVRx's ``FileSystemWriterAsync`` driven directly: plan with
  ``save_state_dict_async_plan``, stage with its ``preload_tensors``, write
  with ``write_preloaded_data_multiproc`` (one forked process per bucket)
  in a background thread, then ``save_state_dict_async_finalize``.
* s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader``.

Object-store peers run with ``sync_files=False``: an object is durable once
its upload completes, and with ``True`` DCP falls back to ``os.sync()`` of
the whole machine for streams without a file descriptor.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from servers import FAKE_CREDENTIALS, admin_client, free_port

from dcpstore._impl.bench import Entry, SaveOutcome, Skip, Waiter, done
from dcpstore._impl.util.distributed import is_distributed


def _delete_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    client = admin_client(endpoint)
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    finally:
        client.close()


class DcpFileSystem(Entry):
    """``dcp.save`` (or ``dcp.async_save``) with ``FileSystemWriter``."""

    group = "peer"
    backend = "local"

    def __init__(self, root: str, thread_count: int, *, async_: bool = False) -> None:
        self.workers = thread_count
        self.mode = "async" if async_ else "sync"
        self.engine = "dcp.async_save" if async_ else "dcp.save"
        self.name = f"{self.engine} FileSystemWriter threads={thread_count}"
        self.path = os.path.join(root, f"dcp-{self.mode}-t{thread_count}")

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(self.path, thread_count=self.workers, sync_files=True)
        if self.mode == "sync":
            dcp.save(state, storage_writer=writer, no_dist=True)
            return done()
        response = dcp.async_save(state, storage_writer=writer, no_dist=True)
        future = getattr(response, "upload_completion", response)  # 2.8+: AsyncSaveResponse

        def wait() -> SaveOutcome:
            future.result()
            return SaveOutcome()

        return wait

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        dcp.load(dest, storage_reader=FileSystemReader(self.path), no_dist=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class FsspecS3(Entry):
    """DCP's ``FsspecWriter`` / ``FsspecReader`` over s3fs."""

    group = "peer"
    engine = "FsspecWriter+s3fs"
    page_cached = False

    def __init__(self, endpoint: str, bucket: str, thread_count: int, *, backend: str = "s3") -> None:
        self.endpoint, self.bucket, self.workers, self.backend = endpoint, bucket, thread_count, backend
        self.prefix = f"fsspec-{backend}-t{thread_count}"
        self.name = f"dcp FsspecWriter+s3fs ({backend}) threads={thread_count}"
        self.opts: dict[str, Any] = {}

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            import s3fs  # noqa: F401
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: F401
        except ImportError as e:
            raise Skip(f"s3fs or DCP's fsspec support is not installed ({e})") from e
        self.opts = {
            "key": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(
            f"s3://{self.bucket}/{self.prefix}", thread_count=self.workers, sync_files=False, **self.opts
        )
        dcp.save(state, storage_writer=writer, no_dist=True)
        return done()

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(dest, storage_reader=FsspecReader(f"s3://{self.bucket}/{self.prefix}", **self.opts), no_dist=True)

    def cleanup(self) -> None:
        _delete_prefix(self.endpoint, self.bucket, self.prefix)


class MscWriter(Entry):
    """MSC's ``MultiStorageFileSystemWriter`` / ``Reader`` on an MSC profile."""

    group = "peer"
    engine = "MSC FileSystemWriter"
    page_cached = False

    def __init__(self, profile: str, endpoint: str, bucket: str, thread_count: int, *, backend: str = "s3") -> None:
        self.profile, self.endpoint, self.bucket = profile, endpoint, bucket
        self.workers, self.backend = thread_count, backend
        self.prefix = f"msc-{backend}-t{thread_count}"
        self.uri = f"msc://{profile}/{self.prefix}"
        self.name = f"MSC MultiStorageFileSystemWriter ({backend}) threads={thread_count}"

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter  # noqa: F401
        except ImportError as e:
            raise Skip(f"multi-storage-client is not installed ({e})") from e

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter

        writer = MultiStorageFileSystemWriter(self.uri, thread_count=self.workers, sync_files=False)
        dcp.save(state, storage_writer=writer, no_dist=True)
        return done()

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

        dcp.load(dest, storage_reader=MultiStorageFileSystemReader(self.uri, thread_count=self.workers), no_dist=True)

    def cleanup(self) -> None:
        _delete_prefix(self.endpoint, self.bucket, self.prefix)


class S3TorchConnector(Entry):
    """s3torchconnector's DCP ``S3StorageWriter`` / ``S3StorageReader``."""

    group = "peer"
    engine = "s3torchconnector"
    page_cached = False

    def __init__(self, endpoint: str, bucket: str, thread_count: int, *, backend: str = "s3") -> None:
        self.endpoint, self.bucket, self.workers, self.backend = endpoint, bucket, thread_count, backend
        self.prefix = f"s3tc-{backend}-t{thread_count}"
        self.uri = f"s3://{bucket}/{self.prefix}"
        self.name = f"s3torchconnector S3StorageWriter ({backend}) threads={thread_count}"

    def _fs(self) -> Any:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        # The writer/reader take no endpoint; give their filesystem a client
        # pointed at the local endpoint (moto needs path-style addressing).
        client = S3Client("us-east-1", endpoint=self.endpoint, s3client_config=S3ClientConfig(force_path_style=True))
        return S3FileSystem("us-east-1", s3_client=client)

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            from s3torchconnector.dcp import S3StorageWriter  # noqa: F401
        except ImportError as e:
            raise Skip(f"s3torchconnector[dcp] is not installed ({e})") from e
        for k, v in FAKE_CREDENTIALS.items():  # the CRT client reads only the environment
            os.environ.setdefault(k, v)

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter("us-east-1", self.uri, thread_count=self.workers)
        writer.fs = self._fs()
        writer.path = writer.fs.init_path(self.uri)
        dcp.save(state, storage_writer=writer, no_dist=True)
        return done()

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader("us-east-1", self.uri)
        reader.fs = self._fs()
        reader.path = reader.fs.init_path(self.uri)
        dcp.load(dest, storage_reader=reader, no_dist=True)

    def cleanup(self) -> None:
        _delete_prefix(self.endpoint, self.bucket, self.prefix)


class NvrxDirect(Entry):
    """NVRx 0.4.x ``FileSystemWriterAsync`` driven by hand on the CPU.

    Its ``preload_tensors`` calls ``torch.cuda.synchronize()`` when
    ``non_blocking`` is set, so it is called with ``non_blocking=False``; on
    CPU tensors ``tensor.to("cpu")`` returns the tensor itself, so the
    "staged" state *aliases* the caller's tensors (NVIDIA/nvidia-resiliency-ext
    PR #376): its blocked time is a lower bound that a correct snapshot cannot
    reach. The write forks one process per bucket, as NVRx does.
    """

    group = "peer"
    backend = "local"
    engine = "nvrx FileSystemWriterAsync"
    mode = "async"

    def __init__(self, root: str, thread_count: int) -> None:
        self.workers = thread_count
        self.path = os.path.join(root, f"nvrx-t{thread_count}")
        self.name = f"NVRx FileSystemWriterAsync (direct) threads={thread_count}"
        self._own_group = False

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async, state_dict_saver  # noqa: F401
        except ImportError as e:
            raise Skip(f"nvidia-resiliency-ext is not installed ({e})") from e
        for needed in ("save_state_dict_async_plan", "save_state_dict_async_finalize"):
            if not hasattr(state_dict_saver, needed):
                raise Skip(f"this NVRx has no {needed} (API changed); drive it through dcpstore's nvrx engine")
        if not is_distributed():  # NVRx asks torch.distributed for the rank
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            self._own_group = True

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )

        os.makedirs(self.path, exist_ok=True)
        writer = FileSystemWriterAsync(self.path, thread_count=self.workers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer, metadata, dist_wrapper = save_state_dict_async_plan(state, writer)
        save_fn, _preload_fn, args = writer.get_save_function_and_args()
        staged = FileSystemWriterAsync.preload_tensors(writer.write_buckets, non_blocking=False)
        failure: list[BaseException] = []

        def write() -> None:
            try:
                if save_fn is not None:
                    save_fn(args[0], staged, args[2])
            except BaseException as e:
                failure.append(e)

        thread = threading.Thread(target=write, name="nvrx-write")
        thread.start()

        def wait() -> SaveOutcome:
            thread.join()
            if failure:
                raise failure[0]
            save_state_dict_async_finalize(writer, metadata, dist_wrapper)
            return SaveOutcome()

        return wait

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        dcp.load(dest, storage_reader=FileSystemReader(self.path))

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def close(self) -> None:
        if self._own_group and is_distributed():
            dist.destroy_process_group()
