"""Bytes behind one interface: where a checkpoint's objects live.

Owns the :class:`Storage` interface that the DCP writer and reader call
(:mod:`.base`), URIs (:mod:`.uri`), the backend registry (:mod:`.registry`),
the backend kit that every backend builds on so that nothing is written
twice (:mod:`.buffered`: the object writer with position, ``tell`` and part
buffering; :mod:`.kit`: shared helpers and error mapping for built-in
exceptions; :mod:`.codes`: the one S3 error-code table; :mod:`.secrets`:
the one scrubber that keeps credentials out of every message; :mod:`.overlap`:
whether two roots are one directory; :mod:`.pending`: what writes leave
behind), and one module per
backend: :mod:`.local`, :mod:`.s3` (with :mod:`.s3_client` and
:mod:`.s3_upload`), :mod:`.msc`, :mod:`.fsspec`.

It knows nothing of what the bytes mean (no DCP, no manifest, no torch).

May import: :mod:`dcpstore._impl.errors`, the standard library and each backend's
own library (boto3, multistorageclient, fsspec), those only in that backend's
modules, which the registry imports on first use. Nothing else of dcpstore.
"""

from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter, Storage
from dcpstore._impl.storage.options import MiB, StorageOptions, check_spread_prefixes
from dcpstore._impl.storage.pending import IncompleteWrite
from dcpstore._impl.storage.registry import BACKENDS, BackendSpec, backend_class, backend_name, open_storage, with_msc
from dcpstore._impl.storage.uri import StorageURL, join_uri, parse_uri, redact

__all__ = [
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
    "backend_name",
    "check_spread_prefixes",
    "join_uri",
    "open_storage",
    "parse_uri",
    "redact",
    "with_msc",
]
