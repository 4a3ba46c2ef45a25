"""What a framework adapter hands dcpstore's DCP drop-ins: one value,
:class:`DropinOptions`, checked once when the adapter is installed, that
builds the writers, readers and storages the adapter's saves and loads use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dcpstore._impl.dropin import StorageReader, StorageWriter
from dcpstore._impl.storage import Storage, StorageOptions, open_storage, with_msc
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.values.options import LoadOptions, SaveOptions


@dataclass(frozen=True)
class DropinOptions:
    """The keywords the adapters' ``install()`` takes.

    Args:
        enable_msc, storage_options: as for :func:`dcpstore.save` (the URI
            picks the backend: a local path, ``s3://``, ...).
        thread_count: writer and reader threads per rank (default: dcpstore's).
        verify, safe_globals, trusted: as for :func:`dcpstore.load`.
    """

    enable_msc: bool = False
    storage_options: StorageOptions | None = None
    thread_count: int | None = None
    verify: bool = True
    safe_globals: Sequence[Any] | None = None
    trusted: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_msc", "verify", "trusted"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, StorageOptions):
            raise InvalidArgument(
                f"storage_options must be a dcpstore.StorageOptions, got {type(self.storage_options).__name__}"
            )

    @property
    def where(self) -> StorageOptions | None:
        """Where the bytes go: ``storage_options`` with ``enable_msc`` folded in."""
        return with_msc(self.storage_options, self.enable_msc)

    def open(self, uri: str | os.PathLike[str]) -> Storage:
        return open_storage(uri, storage_options=self.where)

    def writer(self, uri: str | os.PathLike[str], commit_files: Mapping[str, bytes] | None = None) -> StorageWriter:
        options = SaveOptions(storage_options=self.where)
        return StorageWriter(uri, thread_count=self.thread_count, commit_files=commit_files, options=options)

    def reader(self, uri: str | os.PathLike[str]) -> StorageReader:
        options = LoadOptions(
            storage_options=self.where, verify=self.verify, safe_globals=self.safe_globals or (), trusted=self.trusted
        )
        return StorageReader(uri, thread_count=self.thread_count, options=options)
