"""Long operations are visible: an INFO line per save and load, a WARNING per
burst of S3 retries (with its cause, never a secret), progress bars on request."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import pytest
import torch

import dcpstore
from dcpstore._impl.storage.backends.s3.client import RetryBursts
from dcpstore.storage import StorageOptions
from tests.support.backends import Target
from tests.support.faultproxy import FaultConfig, FaultProxy
from tests.support.s3_server import S3Endpoint

RATE = re.compile(r"[\d.]+(e[+-]?\d+)? GB/s")


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(256, 256), "b": torch.arange(1000)}


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("dcpstore") and r.levelno == level]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_one_info_line_per_save_and_load(target: Target, async_: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dcpstore")
    state = _state()
    info = dcpstore.save(state, target.uri, async_=async_, engine="native", **target.kwargs).result(timeout=60)
    saved = [r.getMessage() for r in _records(caplog, logging.INFO) if r.getMessage().startswith("saved ")]
    assert len(saved) == 1, saved
    line = saved[0]
    assert info.uri in line and RATE.search(line), line
    for phase in ("plan", "stage", "write", "commit"):
        assert f"{phase} " in line, line
    assert f"{len(info.files)} file(s)" in line

    caplog.clear()
    dcpstore.load({"a": torch.empty(256, 256), "b": torch.empty(1000, dtype=torch.int64)}, target.uri, **target.kwargs)
    loaded = [r.getMessage() for r in _records(caplog, logging.INFO) if r.getMessage().startswith("loaded ")]
    assert len(loaded) == 1, loaded
    assert info.uri in loaded[0] and RATE.search(loaded[0]) and "metadata " in loaded[0] and "read " in loaded[0]
    # the bytes it names are the tensors' (256 KiB + 8000 B, plus record framing)
    assert re.search(r"26\d\.\d KiB", loaded[0]), loaded[0]


def test_nothing_is_logged_above_debug_for_a_quiet_run_but_the_info_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dcpstore")
    dcpstore.save(_state(), str(tmp_path / "c")).result()
    assert [r.levelno for r in caplog.records if r.name.startswith("dcpstore") and r.levelno > logging.DEBUG] == [
        logging.INFO
    ]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_progress_bars_on_request_only(tmp_path: Path, async_: bool, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"big": torch.randn(1 << 20)}  # 4 MiB
    dcpstore.save(state, str(tmp_path / "quiet"), async_=async_, engine="native").result(timeout=60)
    dcpstore.load({"big": torch.empty(1 << 20)}, str(tmp_path / "quiet"))
    assert capsys.readouterr().err == ""
    uri = str(tmp_path / "loud")
    dcpstore.save(state, uri, async_=async_, engine="native", progress=True).result(timeout=60)
    err = capsys.readouterr().err
    assert f"save {uri}" in err and "4.00M" in err, err
    dcpstore.load({"big": torch.empty(1 << 20)}, uri, progress=True)
    err = capsys.readouterr().err
    assert f"load {uri}" in err and "4.00M" in err, err


def test_progress_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="progress must be a bool"):
        dcpstore.save(_state(), str(tmp_path / "c"), progress="yes")  # type: ignore[arg-type]


# -- retries ------------------------------------------------------------------


class _Clock:
    """Retries at chosen moments, for the burst arithmetic."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.bursts = RetryBursts("http://127.0.0.1:9", max_attempts=5, op_timeout_s=120)
        self.caplog = caplog

    def warnings_after(self, *moments: float) -> list[str]:
        self.caplog.clear()
        for t in moments:
            self.bursts.retrying("PutObject", 2, "SlowDown (HTTP 503)", now=t)
        return [r.getMessage() for r in self.caplog.records if r.levelno == logging.WARNING]


def test_one_warning_per_burst_and_a_reminder_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dcpstore")
    clock = _Clock(caplog)
    quiet, remind = RetryBursts.QUIET_S, RetryBursts.REMIND_S
    # A burst of 50 retries within a few seconds: one warning, naming the cause.
    first = clock.warnings_after(*(1000 + i * 0.1 for i in range(50)))
    assert len(first) == 1 and "SlowDown (HTTP 503)" in first[0] and "PutObject" in first[0]
    assert "127.0.0.1:9" in first[0] and "attempt 2 of 5" in first[0]
    # It goes on, one retry a second for 2.5 reminder periods: two reminders, with the count.
    later = clock.warnings_after(*(1005 + i for i in range(int(2.5 * remind))))
    assert len(later) == 2 and all("still retrying" in w for w in later)
    assert re.search(r"\d+ retries in the last \d+ s", later[-1])
    # After a quiet gap, a new burst warns again at once.
    t = 1005 + 2.5 * remind + quiet + 1
    again = clock.warnings_after(t, t + 0.5)
    assert len(again) == 1 and "retrying (attempt" in again[0]


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzz" + uuid.uuid4().hex
TOKEN = "FwoGZXIvYXdzEJr//////////wEaDL" + uuid.uuid4().hex


def test_s3_retries_warn_once_per_burst_with_the_cause_and_no_secret(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG, logger="dcpstore")
    opts = StorageOptions(max_attempts=3, op_timeout_s=30)
    uri = f"s3://{s3_endpoint.bucket}/retries-{uuid.uuid4().hex[:8]}"
    proxy.config = FaultConfig(slowdown=1.0)
    with pytest.raises(dcpstore.SaveError):
        dcpstore.save({"w": torch.ones(10)}, uri, workers=1, storage_options=opts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # the whole failing save is one short burst
    assert "SlowDown (HTTP 503)" in warnings[0] and proxy.url.split("//")[1] in warnings[0]
    assert "attempt 2 of 3" in warnings[0]
    # Some retries, then success; nothing logged carries a credential.
    proxy.config = FaultConfig(slowdown=0.3)
    dcpstore.save({"w": torch.ones(10)}, uri, workers=1, storage_options=StorageOptions(max_attempts=10))
    everything = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert SECRET not in everything and TOKEN not in everything


def test_retry_warnings_pass_through_the_scrubber(caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint and the cause pass through the one scrubber (an endpoint
    URL with user info, a cause text carrying a signature), whatever made them."""
    caplog.set_level(logging.WARNING, logger="dcpstore")
    signature = "X-Amz-Signature=" + uuid.uuid4().hex
    bursts = RetryBursts(f"http://AKIDEXAMPLE:{SECRET}@127.0.0.1:9", max_attempts=5, op_timeout_s=60)
    bursts.retrying("GetObject", 2, f"EndpointConnectionError at /b/k?{signature}", now=1.0)
    [line] = [r.getMessage() for r in caplog.records]
    assert "GetObject" in line and "EndpointConnectionError" in line and "127.0.0.1:9" in line
    assert SECRET not in line and signature not in line, line
