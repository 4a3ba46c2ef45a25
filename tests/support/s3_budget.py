"""What the S3 connection-budget suites share: the part size they cut
objects into, and a fresh prefix per test on the session's moto server.

tests/object_stores/test_object_store_budget.py and
test_connection_budget.py; the ``proxy`` fixture that holds their requests
is in tests/conftest.py.
"""

from __future__ import annotations

import uuid

from dcpstore.storage import MiB
from tests.support.s3_server import S3Endpoint

#: S3's smallest part (but the last): the part size the budget tests cut objects into.
PART = 5 * MiB


def budget_uri(endpoint: S3Endpoint) -> str:
    """A fresh ``s3://`` prefix on ``endpoint``'s bucket, one per test."""
    return f"s3://{endpoint.bucket}/budget-{uuid.uuid4().hex[:8]}"
