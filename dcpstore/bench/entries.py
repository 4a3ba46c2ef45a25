"""The dcpstore entry: ``dcpstore.save`` / ``dcpstore.load`` at a URI.

Each entry writes its checkpoint under ``<root>/<run_id>/<slug>`` and deletes
exactly those objects afterwards through the same :class:`Storage` (so the
cleanup works on every backend and never touches anything else under the
root the user named).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import load, save
from ..errors import BackendUnavailable, InvalidArgument
from ..storage import Storage, StorageOptions, join_uri, open_storage
from .runner import Entry, SaveOutcome, Skip, Waiter


def _not_built(e: BackendUnavailable) -> str | None:
    """The dcpstore module behind a backend is absent (a branch not merged yet)."""
    missing = getattr(e.__cause__, "name", None) or ""
    return missing if missing.startswith("dcpstore.") else None


def open_root(uri: str, *, enable_msc: bool = False, storage_options: StorageOptions | None = None) -> Storage:
    """Open the storage at ``uri``, turning a missing backend into :class:`Skip`."""
    try:
        return open_storage(uri, enable_msc=enable_msc, storage_options=storage_options)
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
    ) -> None:
        self.root_uri = os.fspath(root_uri)
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
        self.save_kwargs = save_kwargs or {}
        part = f"-p{storage_options.part_size >> 20}" if storage_options and storage_options.part_size else ""
        w = "default" if workers is None else f"w={workers}"
        self.slug = f"{run_id}/{self.mode}-{engine}-{w.replace('=', '')}{part}"
        self.name = name or f"dcpstore {self.mode}{'/' + engine if async_ else ''} {w}"
        self.uri = join_uri(self.root_uri, *self.slug.split("/"))
        self._root: Storage | None = None

    def setup(self, state: dict[str, torch.Tensor]) -> None:
        self._root = open_root(self.root_uri, enable_msc=self.enable_msc, storage_options=self.storage_options)
        self.backend = self.backend or self._root.backend
        if self.requested_workers is None:
            self.workers = self._root.default_workers()
        self.page_cached = self._root.backend == "local"

    def save(self, state: dict[str, torch.Tensor]) -> Waiter:
        try:
            handle = save(
                state,
                self.uri,
                async_=self.async_,
                workers=self.requested_workers,
                engine=self.requested_engine,
                enable_msc=self.enable_msc,
                storage_options=self.storage_options,
                **self.save_kwargs,
            )
        except InvalidArgument as e:
            if str(e).startswith("engine="):  # a combination refused by design (nvrx on native s3): n/a here
                raise Skip(str(e)) from e
            raise

        def wait() -> SaveOutcome:
            info = handle.result()
            engine = info.engine if self.async_ else "sync"
            return SaveOutcome(phases=dict(info.phases), bytes_written=info.bytes_written, engine=engine)

        return wait

    def load(self, dest: dict[str, torch.Tensor]) -> None:
        load(dest, self.uri, workers=self.requested_workers, enable_msc=self.enable_msc,
                      storage_options=self.storage_options)  # fmt: skip

    def cleanup(self) -> None:
        if self._root is not None:
            self._root.delete([o["path"] for o in self._root.list(self.slug)])

    def close(self) -> None:
        if self._root is not None:
            self._root.close()
            self._root = None
