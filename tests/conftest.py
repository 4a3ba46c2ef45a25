from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import reliability
from tests.support.backends import TARGETS, Target, make_target
from tests.support.faultproxy import FaultProxy
from tests.support.s3_server import S3Endpoint, msc_config, s3_endpoint  # noqa: F401  (session fixtures, requested lazily)

#: Targets whose code path another quick target already takes, so that the
#: shared suites run them in the slow run only: ``s3+msc`` is the MSC backend
#: over MSC's S3 provider, as ``msc`` is; only how its ``s3://`` URI finds the
#: profile differs (MSC's ``path_mapping``). The quick run still saves, loads
#: and aborts through ``s3+msc`` by name (test_object_stores.py), and reaches
#: MSC's implicit S3 profile in test_object_store_errors.py,
#: test_secrets_echo.py and test_s3_faults.py.
SLOW_TARGETS = {"s3+msc"}


@pytest.fixture(
    params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_TARGETS else name for name in TARGETS]
)
def target(request: pytest.FixtureRequest) -> Target:
    """A fresh checkpoint location on each backend in turn (see SLOW_TARGETS)."""
    return make_target(request.param, request)


@pytest.fixture
def local_target(request: pytest.FixtureRequest) -> Target:
    return make_target("local", request)


@pytest.fixture
def proxy(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A proxy in front of the session's moto server; dcpstore's S3 traffic goes through it."""
    with FaultProxy(s3_endpoint.url) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Before -m 'not slow' drops any: tests/docs checks RELIABILITY.md against
    # every test, and a whole-suite run need not collect them a second time.
    reliability.record(config, items)
