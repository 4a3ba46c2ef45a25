"""SIGKILL a save to native ``s3://`` (moto over HTTP) at >= 20 points, sync and async.

Kill points (crashkit.py) include every S3 request, before it is sent and
after its reply (``CreateMultipartUpload``, each ``UploadPart`` on the part
pool's threads, ``CompleteMultipartUpload``, the ``PutObject`` of the
manifest and of ``.metadata``, the marker's ``DeleteObjects``), the storage
calls around them and, for async saves, staging.

Afterwards: the previous checkpoint loads exactly; each interrupted one
loads exactly or is absent; ``CheckpointManager.all_steps()`` and the
``dcpstore ls`` listing show exactly the committed ones; some kills left multipart
uploads open (checked with ``ListMultipartUploads``) and ``dcpstore gc URI``
aborts every one of them and removes the uncommitted prefixes, leaving the
committed checkpoints loadable.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from backends import OBJECT_STORE_OPTIONS
from crashkit import (
    commit_index,
    crash,
    crash_state,
    forkserver,
    instrument_s3,
    instrument_staging,
    kill_points,
    mutate,
    outcome,
)
from dcpstore.cli import main as cli_main
from dcpstore.maintenance import list_checkpoints
from dcpstore.manager import step_dir
from dcpstore.storage import MiB, open_storage
from dcpstore.dcp.writer import DcpStorageWriter
from dcpstore.format.layout import METADATA
from faults import EventStorage, KillAt, Recorder, hook_all_storage
from s3_server import S3Endpoint, aws_env

OPTS = OBJECT_STORE_OPTIONS  # 5 MiB parts
#: One data file of 5.5 MiB (a two-part multipart upload) and one small one.
BIG = int(5.5 * MiB) // 4
#: S3 events always killed at (the rest is thinned to the budget).
KEEP = ("s3:CreateMultipartUpload", "s3:UploadPart", "s3:CompleteMultipartUpload", "commit:.metadata", "s3:PutObject-done")


def _state(seed: int) -> dict:
    return crash_state(seed, big=BIG)


def _save(env: dict, uri: str, seed: int, mode: str, hook) -> None:
    for key, value in env.items():  # the forkserver predates the test's environment
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    instrument_s3(hook, OPTS)
    state = _state(seed)
    if mode == "sync":
        storage = EventStorage(open_storage(uri, storage_options=OPTS), hook)
        dcp_save(state, storage_writer=DcpStorageWriter(storage, workers=2), no_dist=True)
        return
    instrument_staging(hook)
    hook_all_storage(hook)
    with dcpstore.AsyncSaver() as saver:
        handle = saver.save(state, uri, engine="native", workers=2, storage_options=OPTS)
        mutate(state)
        handle.result(timeout=120)


def _child(env: dict, uri: str, seed: int, mode: str, kill_at: int) -> None:
    _save(env, uri, seed, mode, KillAt(kill_at))


def _probe(env: dict, uri: str, mode: str, queue) -> None:
    recorder = Recorder()
    _save(env, uri, 2, mode, recorder)
    queue.put(recorder.events)


@pytest.fixture(scope="module")
def ctx():
    return forkserver()


@pytest.fixture
def root(s3_endpoint: S3Endpoint):
    prefix = f"crash-{uuid.uuid4().hex[:8]}"
    yield f"s3://{s3_endpoint.bucket}/{prefix}"
    s3_endpoint.delete_prefix(f"{prefix}/")


def _run(ctx, s3_endpoint: S3Endpoint, root: str, mode: str, total: int | None) -> None:
    env = aws_env(s3_endpoint.url)
    manager = dcpstore.CheckpointManager(root, storage_options=OPTS)
    previous = manager.step_uri(1)
    dcpstore.save(_state(1), previous, storage_options=OPTS)
    queue = ctx.Queue()
    assert crash(ctx, _probe, env, f"{root}/probe", mode, queue) == 0
    events = queue.get(timeout=30)
    points = kill_points(events, total=total, keep=KEEP)
    assert len(points) >= 20, events
    killed = [events[k] for k in points]
    assert "s3:UploadPart" in killed and "s3:CompleteMultipartUpload" in killed and f"commit:{METADATA}" in killed
    landed = commit_index(events)
    assert points[0] < landed <= points[-1]
    step = {k: 100 + k for k in points}  # kill point -> the step directory its child saves to
    for k in points:
        uri = manager.step_uri(step[k])
        code = crash(ctx, _child, env, uri, 2, mode, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        expected = "complete" if k >= landed else "absent"
        assert outcome(uri, _state(2), storage_options=OPTS) == expected, f"kill point {k} ({events[k]})"
    assert outcome(previous, _state(1), storage_options=OPTS) == "complete"
    committed = [1] + [step[k] for k in points if k >= landed]
    assert manager.all_steps() == committed
    storage = open_storage(root, storage_options=OPTS)
    listed = {e.path: e.committed for e in list_checkpoints(storage)}
    for k in points:
        assert listed.get(step_dir(step[k]), False) == (k >= landed), step_dir(step[k])
    prefix = root.split("/", 3)[3] + "/"
    assert s3_endpoint.open_uploads(prefix), "no kill left a multipart upload open: the suite lost its point"
    assert cli_main(["gc", "--older-than", "0", root]) == 0
    assert s3_endpoint.open_uploads(prefix) == []
    after = list_checkpoints(storage)
    assert all(e.committed for e in after) and {e.path for e in after} == {n for n, c in listed.items() if c}
    assert manager.all_steps() == committed
    assert outcome(previous, _state(1), storage_options=OPTS) == "complete"


@pytest.mark.slow  # ~20 s against moto: CI's slow pass runs it, the quick run stays under 5 min
def test_kill_anywhere_in_a_sync_s3_save(ctx, s3_endpoint: S3Endpoint, root: str) -> None:
    _run(ctx, s3_endpoint, root, "sync", total=20)


@pytest.mark.slow
def test_kill_anywhere_in_an_async_s3_save(ctx, s3_endpoint: S3Endpoint, root: str) -> None:
    _run(ctx, s3_endpoint, root, "async", total=None)
