"""Bytes behind one interface: where a checkpoint's objects live.

Owns the :class:`Storage` contract that the DCP writer and reader call
(:mod:`.base`), URIs (:mod:`.uri`), how a storage is reached and its
transfers cut (:mod:`.storage_options`), the backend registry
(:mod:`.backend_registry`), one module per backend (:mod:`.backends`), and
what every backend is built from, so that nothing is written twice:

* :mod:`.backend_base`: :class:`~.backend_base.BackendBase`, the built-in
  backends' base (root containment, error mapping, a request pool);
* :mod:`.buffered`: the object writer with position, ``tell`` and part
  buffering; :mod:`.lending_writer`: parts that send lent bytes in place;
* :mod:`.byte_ranges`: cutting a read into requests; :mod:`.concurrency`:
  connections and threads per storage; :mod:`.request_pool`: one
  connection budget per storage instance;
* :mod:`.error_mapping`: built-in and library errors as dcpstore's;
  :mod:`.secrets`: the one scrubber that keeps credentials out of every
  message;
* :mod:`.posix`: what a local read may resolve to, directory fsync;
  :mod:`.overlap`: whether two roots are one directory;
* :mod:`.incomplete`: what writes leave behind (incomplete writes,
  clean-ups to retry).

It knows nothing of what the bytes mean (no DCP, no manifest, no torch).

May import: :mod:`dcpstore._impl.util.errors`, the standard library and each backend's
own library (boto3, multistorageclient, fsspec), those only in that backend's
modules, which the registry imports on first use. Nothing else of dcpstore.
"""

from dcpstore._impl.storage.backend_registry import (
    BACKENDS,
    BackendSpec,
    backend_class,
    backend_name,
    open_storage,
    with_msc,
)
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter, Storage
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.storage_options import (
    AUTO_SPREAD,
    MiB,
    StorageOptions,
    auto_spread_prefixes,
    check_spread_prefixes,
    check_storage_options,
    resolve_spread_prefixes,
)
from dcpstore._impl.storage.uri import StorageURL, join_uri, parse_uri, redact

__all__ = [
    "AUTO_SPREAD",
    "BACKENDS",
    "BackendSpec",
    "IncompleteWrite",
    "MiB",
    "ObjectInfo",
    "ObjectWriter",
    "Storage",
    "StorageOptions",
    "StorageURL",
    "backend_class",
    "auto_spread_prefixes",
    "backend_name",
    "check_spread_prefixes",
    "check_storage_options",
    "join_uri",
    "open_storage",
    "parse_uri",
    "redact",
    "resolve_spread_prefixes",
    "with_msc",
]
