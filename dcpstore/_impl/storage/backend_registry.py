"""The one table from backend name to implementation, and URI -> backend.

Backends are imported lazily (``module:Class``) so that ``import dcpstore``
needs neither boto3 nor MSC nor fsspec; a missing optional dependency raises
:class:`~dcpstore._impl.util.errors.BackendUnavailable` with the ``pip install`` hint.
This table is the single source of truth for backend names: the CLI, the
benchmarks and the tests all read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from dcpstore._impl.storage.base import Storage
from dcpstore._impl.storage.storage_options import StorageOptions, check_storage_options
from dcpstore._impl.storage.uri import StorageURL, parse_uri, redact
from dcpstore._impl.util.errors import BackendUnavailable, InvalidArgument, InvalidURI


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
        BackendSpec("local", "dcpstore._impl.storage.backends.local:LocalStorage", None, "local POSIX filesystem"),
        BackendSpec(
            "s3", "dcpstore._impl.storage.backends.s3.storage:S3Storage", "s3", "Amazon S3 and compatibles, via boto3"
        ),
        BackendSpec("msc", "dcpstore._impl.storage.backends.msc:MSCStorage", "msc", "NVIDIA Multi-Storage-Client"),
        BackendSpec(
            "fsspec", "dcpstore._impl.storage.backends.fsspec:FsspecStorage", "fsspec", "any fsspec filesystem"
        ),
    )
}

#: Schemes with a native backend; any other scheme goes to a registered
#: backend (:func:`register_backend`), else to fsspec if it knows it.
_NATIVE_SCHEMES = {"file": "local", "s3": "s3", "msc": "msc"}

#: Backends registered at run time, by the scheme they serve.
_REGISTERED: dict[str, BackendSpec] = {}
_REGISTER_LOCK = threading.Lock()


def register_backend(scheme: str, target: type[Storage] | str, *, summary: str = "", clobber: bool = False) -> None:
    """Serve ``scheme://`` URIs with ``target`` (as fsspec's
    ``register_implementation``): every ``dcpstore.save``, ``load``, drop-in
    and tool opens such a URI with it.

    Args:
        scheme: the URI scheme, lower case (``"gs"``, ``"myfs"``); the
            built-in ones (``file``, ``s3``, ``msc``) cannot be taken.
        target: a :class:`Storage` subclass, or ``"module:Class"`` naming
            one (imported at first use, so that registering costs nothing).
        summary: what it is, for messages.
        clobber: replace another backend registered for ``scheme``.

    Raises:
        InvalidArgument: a scheme that is not one, a built-in scheme, a
            target that is no Storage subclass, or a scheme registered
            already to another target without ``clobber``.
    """
    if (
        not isinstance(scheme, str)
        or not scheme.isascii()
        or not scheme[:1].isalpha()
        or scheme != scheme.lower()
        or not all(c.isalnum() or c in "+.-" for c in scheme)
    ):
        raise InvalidArgument(f"register_backend: scheme must be a lower-case URI scheme like 'gs', got {scheme!r}")
    if scheme in _NATIVE_SCHEMES:
        raise InvalidArgument(
            f"register_backend: {scheme}:// is served by the built-in {_NATIVE_SCHEMES[scheme]} backend"
        )
    if isinstance(target, str):
        if target.count(":") != 1 or not all(target.split(":")):
            raise InvalidArgument(
                f"register_backend: target must be a Storage subclass or 'module:Class', got {target!r}"
            )
        spec_target = target
    elif isinstance(target, type) and issubclass(target, Storage):
        spec_target = f"{target.__module__}:{target.__qualname__}"
    else:
        raise InvalidArgument(f"register_backend: target must be a Storage subclass or 'module:Class', got {target!r}")
    spec = BackendSpec(f"registered:{scheme}", spec_target, None, summary or f"{scheme}:// ({spec_target})")
    with _REGISTER_LOCK:
        old = _REGISTERED.get(scheme)
        if old is not None and old.target != spec.target and not clobber:
            raise InvalidArgument(
                f"register_backend: {scheme}:// is registered to {old.target} already; pass clobber=True to replace it"
            )
        _REGISTERED[scheme] = spec
        if isinstance(target, type):
            _CLASSES[spec.name] = target
        else:
            _CLASSES.pop(spec.name, None)  # imported by its name at first use


#: Registered classes given as classes (they may not be importable by name).
_CLASSES: dict[str, type[Storage]] = {}


def registered_backends() -> dict[str, str]:
    """The backends registered in this process, scheme -> ``"module:Class"``:
    what another process of the same job needs to serve the same URIs (the
    process engine's checkpoint process, DCP's process executor), given to
    :func:`restore_backends` there."""
    with _REGISTER_LOCK:
        return {scheme: spec.target for scheme, spec in _REGISTERED.items()}


def restore_backends(table: Mapping[str, str]) -> None:
    """Register ``table`` (from :func:`registered_backends` in another
    process) here; a class that cannot be imported by its name fails where
    a URI of its scheme is opened, naming it."""
    for scheme, target in table.items():
        with _REGISTER_LOCK:
            if scheme in _REGISTERED and _REGISTERED[scheme].target == target:
                continue
        register_backend(scheme, target, clobber=True)


def backend_name(url: StorageURL, *, enable_msc: bool = False) -> str:
    """Choose the backend for a parsed URI.

    ``enable_msc=True`` routes ``s3://`` and local paths through MSC, like
    Megatron's ``--enable-msc``; ``msc://`` always goes through MSC.
    """
    if enable_msc and url.scheme in ("file", "s3"):
        return "msc"
    if url.scheme in _NATIVE_SCHEMES:
        return _NATIVE_SCHEMES[url.scheme]
    registered = _REGISTERED.get(url.scheme)
    if registered is not None:
        return registered.name
    if _fsspec_knows(url.scheme):
        return "fsspec"
    raise InvalidURI(
        f"unknown URI scheme {url.scheme!r} in {redact(url.original)!r}: "
        "dcpstore serves local paths, file://, s3://, msc://, the schemes of backends given to "
        "dcpstore.storage.register_backend, and those of installed fsspec filesystems "
        "(pip install 'dcpstore[fsspec]' plus e.g. gcsfs for gs://)"
    )


def _fsspec_knows(scheme: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in registry or scheme in known_implementations


def backend_class(name: str) -> type[Storage]:
    """Import and return the :class:`Storage` class registered as ``name``."""
    if name in _CLASSES:
        return _CLASSES[name]
    spec = BACKENDS.get(name) or next((s for s in _REGISTERED.values() if s.name == name), None)
    if spec is None:
        raise InvalidURI(
            f"unknown backend {name!r}; known: {', '.join([*BACKENDS, *(s.name for s in _REGISTERED.values())])}"
        )
    module_name, _, class_name = spec.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = f"pip install 'dcpstore[{spec.extra}]'" if spec.extra else "reinstall dcpstore"
        raise BackendUnavailable(
            f"the {name} backend ({spec.summary}) needs a package that is not installed ({e.name or e}); {hint}"
        ) from e
    return cast(type[Storage], getattr(module, class_name))


@contextlib.contextmanager
def opened(uri: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> Iterator[Storage]:
    """:func:`open_storage` for the length of a ``with`` block, closed after it."""
    storage = open_storage(uri, storage_options=storage_options)
    try:
        yield storage
    finally:
        storage.close()


def with_msc(options: StorageOptions | None, enable_msc: bool) -> StorageOptions | None:
    """``options`` with ``enable_msc=True`` folded in when ``enable_msc``
    (the keyword of :func:`dcpstore.save`, ``load`` and ``open_storage``):
    either one routes through MSC."""
    if not isinstance(enable_msc, bool):
        raise InvalidArgument(f"enable_msc must be a bool, got {enable_msc!r}")
    check_storage_options(options)
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
            (docs/uris.md's table says which backend each selects).
        enable_msc: route ``s3://`` and local paths through MSC (a
            shortcut for ``storage_options.enable_msc``).
        storage_options: which client and its tuning
            (:class:`~dcpstore.StorageOptions`).

    Returns:
        The :class:`~dcpstore._impl.storage.base.Storage` rooted at ``uri``; close
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
