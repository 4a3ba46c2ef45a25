"""Backend targets for the shared suites.

Every suite that should hold on every backend takes the ``target`` fixture
(see conftest.py), which is parametrised over ``TARGETS``: one entry per way
of reaching storage. A target is a URI plus the keyword arguments that
``dcpstore.save`` / ``load`` / ``open_storage`` need with it (e.g.
``enable_msc=True``). Object-store targets add themselves here and pull in the
session's S3 endpoint fixture lazily, so local-only runs start no server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Target:
    name: str
    uri: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def child(self, name: str) -> "Target":
        """The same backend, at ``uri/name``."""
        return Target(self.name, f"{self.uri.rstrip('/')}/{name}", dict(self.kwargs))


def _local(request: pytest.FixtureRequest, unique: str) -> Target:
    tmp_path = request.getfixturevalue("tmp_path")
    return Target("local", str(tmp_path / unique))


#: name -> factory(request, unique_name) -> Target. Keep "local" first.
TARGETS: dict[str, Callable[[pytest.FixtureRequest, str], Target]] = {
    "local": _local,
}


def make_target(name: str, request: pytest.FixtureRequest) -> Target:
    return TARGETS[name](request, f"ckpt-{uuid.uuid4().hex[:8]}")
