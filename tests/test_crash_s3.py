"""SIGKILL a save to native ``s3://`` (moto over HTTP) at >= 20 points, sync and async.

Kill points (crashkit.py) include every S3 request, before it is sent and
after its reply (``CreateMultipartUpload``, each ``UploadPart`` on the part
pool's threads, ``CompleteMultipartUpload``, the ``PutObject`` of the
manifest and of ``.metadata``, ``DeleteObjects`` of the claim, the marker
and retention), the storage calls around them and, for async saves, staging.

The child saves through ``CheckpointManager(keep=1)``
(crashkit.run_managed_crashes): step 2 beside a committed step 1 (retention
races the kill) or step 1 over itself. Afterwards, exactly: the new step
loads iff its ``.metadata`` ``PutObject`` was answered; step 1 loads until
retention's ``DeleteObjects`` of it was answered; an overwrite leaves the
old state, the new one or (after the claim's retraction) none, never a
mixture; ``all_steps()`` and the ``dcpstore ls`` listing show exactly the
committed steps; some kills left multipart uploads open (checked with
``ListMultipartUploads``) and ``dcpstore gc URI`` aborts every one of them
and removes the uncommitted prefixes, leaving the committed steps loadable.
"""

from __future__ import annotations

import uuid

import pytest

from backends import OBJECT_STORE_OPTIONS
from crashkit import Managed, forkserver, run_managed_crashes
from dcpstore.storage import MiB
from dcpstore.format.layout import METADATA
from s3_server import S3Endpoint, aws_env

#: S3 events always killed at (the rest is thinned to the budget).
KEEP = ("s3:CreateMultipartUpload", "s3:UploadPart", "s3:CompleteMultipartUpload", f"commit:{METADATA}", "s3:PutObject-done")
REQUIRED = ("s3:UploadPart", "s3:CompleteMultipartUpload", f"commit:{METADATA}")
#: mode, scenario, kill-point budget (None: every point); all slow (~moto).
CASES = [
    pytest.param("sync", "next", 20, id="sync-next"),
    pytest.param("sync", "overwrite", 20, id="sync-overwrite"),
    pytest.param("async", "next", None, id="async-next"),
    pytest.param("async", "overwrite", 30, id="async-overwrite"),
]


@pytest.fixture(scope="module")
def ctx():
    return forkserver()


@pytest.fixture
def prefix(s3_endpoint: S3Endpoint):
    name = f"crash-{uuid.uuid4().hex[:8]}"
    yield name
    s3_endpoint.delete_prefix(f"{name}/")


@pytest.mark.slow  # against moto: CI's slow pass runs it, the quick run stays under 5 min
@pytest.mark.parametrize(("mode", "scenario", "budget"), CASES)
def test_kill_anywhere_in_an_s3_save(
    ctx, s3_endpoint: S3Endpoint, prefix: str, mode: str, scenario: str, budget: int | None
) -> None:
    # One data file of 5.5 MiB (a two-part multipart upload at 5 MiB parts) and one small one.
    how = Managed(
        {"async_": mode == "async", "engine": "native", "workers": 2, "storage_options": OBJECT_STORE_OPTIONS},
        big=int(5.5 * MiB) // 4,
        env=aws_env(s3_endpoint.url),
    )

    def uploads_left_open() -> None:
        assert s3_endpoint.open_uploads(f"{prefix}/"), "no kill left a multipart upload open: the suite lost its point"

    base = f"s3://{s3_endpoint.bucket}/{prefix}"
    run_managed_crashes(ctx, base, scenario, how, budget=budget, keep=KEEP, required=REQUIRED, before_gc=uploads_left_open)
    assert s3_endpoint.open_uploads(f"{prefix}/") == []
