"""Bytes behind one interface: the storage a checkpoint's objects live in.

The supported surface of the storage layer, for code that opens a
checkpoint's storage itself or brings a backend of its own:

* :class:`Storage`, the contract between a backend and the DCP writer and
  reader: seven methods to implement, ten it may override (its docstring
  says which, who calls them when, and what they guarantee), with
  :class:`ObjectInfo` (what ``list`` yields), :class:`IncompleteWrite`
  (what ``incomplete_writes`` reports) and :class:`ObjectTooLarge` (what
  ``read`` raises over its ``limit``);
* :mod:`dcpstore.storage.testing`, the contract as tests: subclass its
  :class:`~dcpstore.storage.testing.StorageContract` to run them against
  your backend (dcpstore runs it against each of its own; needs pytest);
* :class:`BufferedObjectWriter`, the object writer that owns position and
  part buffering, so that a backend fills in upload, commit and discard
  (as fsspec's ``AbstractBufferedFile``), over :class:`ObjectWriter`;
* :class:`StorageOptions`, where the bytes go and the client's tuning;
* :func:`open_storage`, a URI's storage on the backend it selects, and
  :func:`register_backend`, a backend of your own for a URI scheme (as
  fsspec's ``register_implementation``); :class:`StorageURL` is a parsed URI.

The built-in backends (local POSIX, S3, MSC, fsspec) and the kit they are
built from (``BackendBase``) live in ``dcpstore._impl.storage``, free to change.
"""

from dcpstore._impl.storage.backend_registry import open_storage, register_backend
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter, Storage
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.storage_options import MiB, StorageOptions
from dcpstore._impl.storage.uri import StorageURL
from dcpstore._impl.util.errors import ObjectTooLarge

__all__ = [
    "BufferedObjectWriter",
    "IncompleteWrite",
    "MiB",
    "ObjectInfo",
    "ObjectTooLarge",
    "ObjectWriter",
    "Storage",
    "StorageOptions",
    "StorageURL",
    "open_storage",
    "register_backend",
]
