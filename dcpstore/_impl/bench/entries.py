"""The dcpstore entries: ``dcpstore.save`` / ``dcpstore.load`` at a URI, and
a tiered :class:`~dcpstore.CheckpointManager` (local commit, then
replication to the URI).

Each entry writes its checkpoint under ``<root>/<run_id>/<slug>`` and deletes
exactly those objects afterwards through the same :class:`Storage` (so the
cleanup works on every backend and never touches anything else under the
root the user named).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from dcpstore._impl.api import load, save
from dcpstore._impl.bench.runner import Entry, SaveOutcome, Skip, Waiter
from dcpstore._impl.dcp.commit import delete_everything
from dcpstore._impl.engines.saver import AsyncSaver
from dcpstore._impl.manager import CheckpointManager
from dcpstore._impl.storage import Storage, StorageOptions, join_uri, open_storage, with_msc
from dcpstore._impl.util.errors import BackendUnavailable, InvalidArgument
from dcpstore._impl.values.options import SaveOptions


def _not_built(e: BackendUnavailable) -> str | None:
    """The dcpstore module behind a backend is absent (a branch not merged yet)."""
    missing = getattr(e.__cause__, "name", None) or ""
    return missing if missing.startswith("dcpstore.") else None


def open_root(uri: str, *, enable_msc: bool = False, storage_options: StorageOptions | None = None) -> Storage:
    """Open the storage at ``uri``, turning a missing backend into :class:`Skip`."""
    try:
        return open_storage(uri, storage_options=with_msc(storage_options, enable_msc))
    except BackendUnavailable as e:
        module = _not_built(e)
        if module:
            raise Skip(f"backend not built yet ({module} is not in this tree)") from e
        raise Skip(str(e)) from e


class DcpstoreEntry(Entry):
    """dcpstore on one backend, engine, mode and worker count."""

    group = "dcpstore"

    def __init__(
        self,
        root_uri: str,
        run_id: str,
        *,
        workers: int | None,
        engine: str = "auto",
        async_: bool = False,
        enable_msc: bool = False,
        backend: str | None = None,
        name: str | None = None,
        storage_options: StorageOptions | None = None,
        save_kwargs: dict[str, Any] | None = None,
        own_saver: bool = False,
    ) -> None:
        self.root_uri = os.fspath(root_uri)
        #: Each async save through an AsyncSaver of its own, so that it
        #: allocates its staging buffers (the default saver keeps them for
        #: every later save of the same structure, in any entry).
        self.own_saver = own_saver
        #: None: the backend's default (``self.workers`` shows it once set up).
        self.requested_workers = workers
        self.workers = workers or 0
        self.requested_engine = engine
        self.async_ = async_
        self.mode = "async" if async_ else "sync"
        self.engine = engine if async_ else "sync"
        self.enable_msc = enable_msc
        self.backend = backend or ""
        self.storage_options = storage_options
        self.where = with_msc(storage_options, enable_msc)
        self.save_kwargs = save_kwargs or {}
        part = f"-p{storage_options.part_size >> 20}" if storage_options and storage_options.part_size else ""
        w = "default" if workers is None else f"w={workers}"
        self.slug = f"{run_id}/{self.mode}-{engine}-{w.replace('=', '')}{part}"
        self.name = name or f"dcpstore {self.mode}{'/' + engine if async_ else ''} {w}"
        self.uri = join_uri(self.root_uri, *self.slug.split("/"))
        self._root: Storage | None = None

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        self._root = open_root(self.root_uri, storage_options=self.where)
        self.backend = self.backend or self._root.backend
        if self.requested_workers is None:
            self.workers = self._root.default_workers()
        self.page_cached = self._root.backend == "local"

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        saver = AsyncSaver() if self.own_saver and self.async_ else None
        kwargs = dict(
            workers=self.requested_workers, engine=self.requested_engine, storage_options=self.where, **self.save_kwargs
        )
        try:
            if saver:
                handle = saver.save(state, self.uri, options=SaveOptions(async_=True, **kwargs))
            else:
                handle = save(state, self.uri, async_=self.async_, **kwargs)
        except InvalidArgument as e:
            if saver:
                saver.close()
            if str(e).startswith("engine="):  # a combination refused by design (nvrx on native s3): n/a here
                raise Skip(str(e)) from e
            raise

        def wait() -> SaveOutcome:
            try:
                info = handle.result()
            finally:
                if saver:
                    saver.close()
            engine = info.engine if self.async_ else "sync"
            return SaveOutcome(phases=dict(info.phases), bytes_written=info.bytes_written, engine=engine)

        return wait

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        load(dest, self.uri, workers=self.requested_workers, storage_options=self.where)

    def cleanup(self) -> None:
        if self._root is not None:
            delete_everything(self._root, self.slug)

    def close(self) -> None:
        if self._root is not None:
            self._root.close()
            self._root = None


class TieredEntry(Entry):
    """A tiered manager: each save commits to ``local_dir`` and is replicated
    to the root URI. ``write_s`` is the time to the durable commit (compare
    with a direct async save to the URI); ``phases["local_commit"]`` the time
    to the local commit (compare with a plain async save to ``local_dir``),
    both from the start of ``save``; ``blocked_s`` as for every entry."""

    group = "dcpstore"
    mode = "async"

    def __init__(
        self,
        root_uri: str,
        local_dir: str,
        run_id: str,
        *,
        workers: int,
        engine: str = "auto",
        enable_msc: bool = False,
        storage_options: StorageOptions | None = None,
    ) -> None:
        self.workers = workers
        self.engine = engine
        self.where = with_msc(storage_options, enable_msc)
        self.slug = f"{run_id}/tiered-{engine}-w{workers}"
        self.name = f"dcpstore tiered/{engine} w={workers}"
        self.root_uri = join_uri(os.fspath(root_uri), *self.slug.split("/"))
        self.local_uri = join_uri(os.fspath(local_dir), *self.slug.split("/"))
        self._durable_root: Storage | None = None
        self._local_root: Storage | None = None
        self._manager: CheckpointManager | None = None
        self._step = 0

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        self._durable_root = open_root(self.root_uri, storage_options=self.where)
        self._local_root = open_root(self.local_uri)
        self.backend = f"local+{self._durable_root.backend}"
        options = SaveOptions(async_=True, workers=self.workers, engine=self.engine, storage_options=self.where)
        self._manager = CheckpointManager(self.root_uri, local_dir=self.local_uri, options=options)

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        assert self._manager is not None
        self._step += 1
        t0 = time.perf_counter()
        handle = self._manager.save(state, self._step)

        def wait() -> SaveOutcome:
            assert self._manager is not None
            info = handle.result()
            local_commit = time.perf_counter() - t0
            self._manager.wait()
            phases = dict(info.phases, local_commit=local_commit, durable=time.perf_counter() - t0)
            return SaveOutcome(phases=phases, bytes_written=info.bytes_written, engine=info.engine)

        return wait

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        assert self._manager is not None
        self._manager.load(dest, self._step)

    def cleanup(self) -> None:
        for root in (self._durable_root, self._local_root):
            if root is not None:
                delete_everything(root)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        for root in (self._durable_root, self._local_root):
            if root is not None:
                root.close()
        self._durable_root = self._local_root = None
