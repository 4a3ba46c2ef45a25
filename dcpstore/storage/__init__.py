"""Byte-level storage backends behind one interface; see :mod:`.base`."""

from .base import MiB, ObjectInfo, ObjectWriter, Storage, StorageOptions
from .registry import BACKENDS, BackendSpec, backend_class, backend_name, open_storage
from .uri import StorageURL, join_uri, parse_uri, redact

__all__ = [
    "BACKENDS",
    "BackendSpec",
    "MiB",
    "ObjectInfo",
    "ObjectWriter",
    "Storage",
    "StorageOptions",
    "StorageURL",
    "backend_class",
    "backend_name",
    "join_uri",
    "open_storage",
    "parse_uri",
    "redact",
]
