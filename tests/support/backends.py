"""Backend targets for the shared suites.

Every suite that should hold on every backend takes the ``target`` fixture
(see conftest.py), which is parametrised over ``TARGETS``: one entry per way
of reaching storage. A target is a URI plus the keyword arguments that
``dcpstore.save`` / ``load`` / ``open_storage`` need with it (e.g.
``enable_msc=True``, ``storage_options=``); ``save_options()`` /
``load_options()`` give them as the one value the other entry points take
(``options=``). Object-store targets pull in the session's S3 endpoint
fixture (tests/support/s3_server.py) lazily, so local-only runs start no server.

Object-store targets use a small part size (5 MiB, S3's minimum) so that the
suites' multi-MiB objects really go up as multipart uploads and come back as
parallel ranged reads: ``OBJECT_STORE_OPTIONS`` for the native S3 backend,
and the MSC profiles' own ``multipart_threshold`` for MSC (tests/support/s3_server.py:
``s3+msc`` resolves through the MSC config's ``path_mapping``, since MSC's
implicit profile keeps its 64 MiB threshold). test_object_stores.py checks
that each object-store target really uploads a multi-MiB file in parts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from dcpstore import LoadOptions, SaveOptions
from dcpstore._impl.storage import MiB, StorageOptions, with_msc
from tests.support.s3_server import MSC_MAPPED_PREFIX

#: Tuning for the object-store targets: multipart from 5 MiB, bounded retries.
OBJECT_STORE_OPTIONS = StorageOptions(
    part_size=5 * MiB,
    max_concurrency=4,
    max_attempts=5,
    connect_timeout_s=5.0,
    read_timeout_s=30.0,
    op_timeout_s=60.0,
)


@dataclass
class Target:
    name: str
    uri: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def child(self, name: str) -> Target:
        """The same backend, at ``uri/name``."""
        return Target(self.name, f"{self.uri.rstrip('/')}/{name}", dict(self.kwargs))

    def save_options(self, **more: Any) -> SaveOptions:
        """``SaveOptions`` reaching this target, with ``more`` fields."""
        return save_options(self.kwargs, **more)

    def load_options(self, **more: Any) -> LoadOptions:
        """``LoadOptions`` reaching this target, with ``more`` fields."""
        return load_options(self.kwargs, **more)


def save_options(kwargs: dict[str, Any], **more: Any) -> SaveOptions:
    """Keywords of ``dcpstore.save`` (``enable_msc`` among them) as the one
    value the other entry points take, with ``more`` fields."""
    return SaveOptions(**_where(kwargs), **more)


def load_options(kwargs: dict[str, Any], **more: Any) -> LoadOptions:
    """As :func:`save_options`, for loads."""
    return LoadOptions(**_where(kwargs), **more)


def _where(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``enable_msc`` folded into ``storage_options``: one value for where the bytes go."""
    rest = {k: v for k, v in kwargs.items() if k != "enable_msc"}
    rest["storage_options"] = with_msc(rest.get("storage_options"), kwargs.get("enable_msc", False))
    return rest


def _local(request: pytest.FixtureRequest, unique: str) -> Target:
    tmp_path = request.getfixturevalue("tmp_path")
    return Target("local", str(tmp_path / unique))


def _s3_endpoint(request: pytest.FixtureRequest, key_prefix: str) -> Any:
    """The session's S3 endpoint; the test's objects (under ``key_prefix``)
    are deleted when it ends (moto keeps everything in memory)."""
    endpoint = request.getfixturevalue("s3_endpoint")
    request.addfinalizer(lambda: endpoint.delete_prefix(f"{key_prefix}/"))
    return endpoint


def _s3(request: pytest.FixtureRequest, unique: str) -> Target:
    endpoint = _s3_endpoint(request, unique)
    return Target("s3", f"s3://{endpoint.bucket}/{unique}", {"storage_options": OBJECT_STORE_OPTIONS})


def _s3_msc(request: pytest.FixtureRequest, unique: str) -> Target:
    request.getfixturevalue("msc_config")  # its path_mapping sets MSC's part size
    key_prefix = f"{MSC_MAPPED_PREFIX}/{unique}"
    endpoint = _s3_endpoint(request, key_prefix)
    kwargs = {"enable_msc": True, "storage_options": OBJECT_STORE_OPTIONS}
    return Target("s3+msc", f"s3://{endpoint.bucket}/{key_prefix}", kwargs)


def _msc(request: pytest.FixtureRequest, unique: str) -> Target:
    profile = request.getfixturevalue("msc_config")
    _s3_endpoint(request, unique)  # the profile's base_path is the session bucket
    return Target("msc", f"msc://{profile}/{unique}", {"storage_options": OBJECT_STORE_OPTIONS})


def _local_direct(request: pytest.FixtureRequest, unique: str) -> Target:
    # Large tensors' whole pages written with O_DIRECT, the rest buffered.
    tmp_path = request.getfixturevalue("tmp_path")
    return Target("local+direct", str(tmp_path / unique), {"storage_options": StorageOptions(direct_io=True)})


def _local_msc(request: pytest.FixtureRequest, unique: str) -> Target:
    # A plain path with enable_msc=True: MSC's POSIX profile (Megatron's --enable-msc).
    tmp_path = request.getfixturevalue("tmp_path")
    return Target("local+msc", str(tmp_path / unique), {"enable_msc": True})


def _memory(request: pytest.FixtureRequest, unique: str) -> Target:
    def drop() -> None:  # memory:// is one process-wide store
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{unique}"):
            fs.rm(f"/{unique}", recursive=True)

    request.addfinalizer(drop)
    return Target("memory", f"memory://{unique}")


#: name -> factory(request, unique_name) -> Target. Keep "local" first.
TARGETS: dict[str, Callable[[pytest.FixtureRequest, str], Target]] = {
    "local": _local,
    "local+direct": _local_direct,
    "s3": _s3,
    "s3+msc": _s3_msc,
    "msc": _msc,
    "local+msc": _local_msc,
    "memory": _memory,
}


def make_target(name: str, request: pytest.FixtureRequest) -> Target:
    return TARGETS[name](request, f"ckpt-{uuid.uuid4().hex[:8]}")
