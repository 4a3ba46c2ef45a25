from __future__ import annotations

import pytest

from backends import TARGETS, Target, make_target
from s3_server import msc_config, s3_endpoint  # noqa: F401  (session fixtures, requested lazily)


@pytest.fixture(params=list(TARGETS))
def target(request: pytest.FixtureRequest) -> Target:
    """A fresh checkpoint location on each backend in turn."""
    return make_target(request.param, request)


@pytest.fixture
def local_target(request: pytest.FixtureRequest) -> Target:
    return make_target("local", request)
