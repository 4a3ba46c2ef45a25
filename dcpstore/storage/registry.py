"""The one table from backend name to implementation, and URI -> backend.

Backends are imported lazily (``module:Class``) so that ``import dcpstore``
needs neither boto3 nor MSC nor fsspec; a missing optional dependency raises
:class:`~dcpstore.errors.BackendUnavailable` with the ``pip install`` hint.
This table is the single source of truth for backend names: the CLI, the
benchmarks and the tests all read it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from ..errors import BackendUnavailable, InvalidArgument, InvalidURI
from .base import Storage, StorageOptions
from .uri import StorageURL, parse_uri, redact


@dataclass(frozen=True)
class BackendSpec:
    name: str
    #: ``"module:Class"`` of the :class:`Storage` subclass.
    target: str
    #: The pip extra that installs its dependencies (``None``: always present).
    extra: str | None
    summary: str


BACKENDS: Mapping[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("local", "dcpstore.storage.local:LocalStorage", None, "local POSIX filesystem"),
        BackendSpec("s3", "dcpstore.storage.s3:S3Storage", "s3", "Amazon S3 and compatibles, via boto3"),
        BackendSpec("msc", "dcpstore.storage.msc:MSCStorage", "msc", "NVIDIA Multi-Storage-Client"),
        BackendSpec("fsspec", "dcpstore.storage.fsspec:FsspecStorage", "fsspec", "any fsspec filesystem"),
    )
}

#: Schemes with a native backend; any other scheme goes to fsspec if it knows it.
_NATIVE_SCHEMES = {"file": "local", "s3": "s3", "msc": "msc"}


def backend_name(url: StorageURL, *, enable_msc: bool = False) -> str:
    """Choose the backend for a parsed URI.

    ``enable_msc=True`` routes ``s3://`` and local paths through MSC, like
    Megatron's ``--enable-msc``; ``msc://`` always goes through MSC.
    """
    if enable_msc and url.scheme in ("file", "s3"):
        return "msc"
    if url.scheme in _NATIVE_SCHEMES:
        return _NATIVE_SCHEMES[url.scheme]
    if _fsspec_knows(url.scheme):
        return "fsspec"
    raise InvalidURI(
        f"unknown URI scheme {url.scheme!r} in {redact(url.original)!r}: "
        f"dcpstore serves local paths, file://, s3://, msc:// and the schemes of installed "
        f"fsspec filesystems (pip install 'dcpstore[fsspec]' plus e.g. gcsfs for gs://)"
    )


def _fsspec_knows(scheme: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in registry or scheme in known_implementations


def backend_class(name: str) -> type[Storage]:
    """Import and return the :class:`Storage` class registered as ``name``."""
    try:
        spec = BACKENDS[name]
    except KeyError:
        raise InvalidURI(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None
    module_name, _, class_name = spec.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = f"pip install 'dcpstore[{spec.extra}]'" if spec.extra else "reinstall dcpstore"
        raise BackendUnavailable(
            f"the {name} backend ({spec.summary}) needs a package that is not installed "
            f"({e.name or e}); {hint}"
        ) from e
    return cast(type[Storage], getattr(module, class_name))


def with_msc(options: StorageOptions | None, enable_msc: bool) -> StorageOptions | None:
    """``options`` with ``enable_msc=True`` folded in when ``enable_msc``
    (the keyword of :func:`dcpstore.save`, ``load`` and ``open_storage``):
    either one routes through MSC."""
    if not isinstance(enable_msc, bool):
        raise InvalidArgument(f"enable_msc must be a bool, got {enable_msc!r}")
    if not enable_msc or (options is not None and options.enable_msc):
        return options
    return dataclasses.replace(options or StorageOptions(), enable_msc=True)


def open_storage(
    uri: str | os.PathLike[str] | StorageURL,
    *,
    enable_msc: bool = False,
    storage_options: StorageOptions | None = None,
) -> Storage:
    """Open the storage a checkpoint URI names, on the backend it selects.

    Args:
        uri: a local path, ``file://``, ``s3://``, ``msc://`` or fsspec URL
            (the README's "URIs" table says which backend each selects).
        enable_msc: route ``s3://`` and local paths through MSC (a
            shortcut for ``storage_options.enable_msc``).
        storage_options: which client and its tuning
            (:class:`~dcpstore.StorageOptions`).

    Returns:
        The :class:`~dcpstore.storage.base.Storage` rooted at ``uri``; close
        it when done.

    Raises:
        InvalidURI: the URI cannot be parsed, embeds credentials, or names
            no backend.
        BackendUnavailable: the backend's optional package is not installed.
    """
    url = uri if isinstance(uri, StorageURL) else parse_uri(uri)
    options = with_msc(storage_options, enable_msc)
    routed = options is not None and options.enable_msc
    return backend_class(backend_name(url, enable_msc=routed))(url, options)
