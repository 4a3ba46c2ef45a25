"""Hostile storage leaks no secret; scheme typos are caught.

An endpoint (or a proxy in front of one) that echoes the request's headers
in its 400/500 error body hands back the session token, the signature and
the access key id. A small echoing server on 127.0.0.1 plays it; saves,
loads, storage calls and every CLI command run against it through native S3
and S3 via MSC. No credential may reach an exception (the whole cause chain,
as a traceback prints it), a dcpstore log line or the CLI output. First the
test checks that the echo really carries them (plain boto3 shows them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import boto3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore.storage import StorageOptions, open_storage
from tests.support.hostile_kit import cli
from tests.support.s3_server import REGION, aws_env

KEY_ID = "AKIAECHOKEYID0000001"
SECRET = "echo/Secret+Key/never-printed-0009"
TOKEN = "FwoGZXIvYXdzEchoSessionToken//never+printed=="
OPTIONS = StorageOptions(max_attempts=2, connect_timeout_s=5, read_timeout_s=10, op_timeout_s=30)


class _Echo(BaseHTTPRequestHandler):
    server: EchoServer

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append(dict(self.headers))
        headers = {
            "lines": "; ".join(f"{k}: {v}" for k, v in self.headers.items()),
            "repr": repr(dict(self.headers)),
        }[self.server.mode]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidRequest</Code>'
            f"<Message>you sent {escape(headers)}</Message><RequestId>echo</RequestId></Error>"
        ).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _reply

    def log_message(self, *args: Any) -> None:
        pass


class EchoServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Echo)
        self.seen: list[dict[str, str]] = []
        self.status, self.mode = 400, "lines"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def secrets(self) -> list[str]:
        """Everything secret the server was sent: the token, and every
        signature and credential scope of the Authorization headers."""
        found = {TOKEN, SECRET, KEY_ID}
        for headers in self.seen:
            auth = headers.get("Authorization", "")
            found.update(re.findall(r"Signature=([0-9a-f]+)", auth))
            found.update(re.findall(r"Credential=([^,\s]+)", auth))
        return sorted(found)


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Iterator[EchoServer]:
    server = EchoServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for key, value in aws_env(server.url).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _chain(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_the_echo_really_carries_the_secrets(echo: EchoServer) -> None:
    """Without dcpstore in the way, boto3's own error shows them: the test
    below can fail."""
    client = boto3.session.Session().client("s3", endpoint_url=echo.url, region_name=REGION)
    with pytest.raises(Exception) as info:
        client.get_object(Bucket="b", Key="k")
    assert TOKEN in str(info.value) and "Signature=" in str(info.value)


def _cases() -> list[Any]:
    """Every backend x echo format x status. The quick suite runs each
    backend, each format and the retried 500 (backoff: MSC by its own
    settings) once; the slow run every combination."""
    quick = {("s3", "lines", 500), ("s3", "repr", 400), ("s3+msc", "lines", 400)}
    cases = []
    for backend in ("s3", "s3+msc"):
        for mode in ("lines", "repr"):
            for status in (400, 500):
                marks = [] if (backend, mode, status) in quick else [pytest.mark.slow]
                cases.append(pytest.param(backend, mode, status, id=f"{backend}-{mode}-{status}", marks=marks))
    return cases


@pytest.mark.parametrize("backend,mode,status", _cases())
def test_echoed_credentials_reach_no_message_log_or_output(
    echo: EchoServer, caplog: pytest.LogCaptureFixture, status: int, mode: str, backend: str
) -> None:
    echo.status, echo.mode = status, mode
    kwargs: dict[str, Any] = {"storage_options": OPTIONS, "enable_msc": backend == "s3+msc"}
    uri = f"s3://echo-{backend.replace('+', '-')}-{status}-{mode}/run/ck"
    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    for action in (
        lambda: dcpstore.save({"w": torch.ones(4)}, uri, **kwargs),
        lambda: dcpstore.load({"w": torch.zeros(4)}, uri, **kwargs),
        lambda: open_storage(uri, **kwargs).read_range(".metadata", 0, 10),
        lambda: list(open_storage(uri, **kwargs).list()),
        lambda: open_storage(uri, **kwargs).put("x", b"y"),
    ):
        with pytest.raises(dcpstore.CheckpointError) as info:
            action()
        errors.append(info.value)
    outputs = []
    msc = ["--enable-msc"] if backend == "s3+msc" else []
    # The CLI runs with default retries (8 attempts, backing off): against a
    # 500 that takes minutes, so it meets the 400 (not retried) only.
    commands = [["ls"], ["inspect"], ["inspect", "--json"], ["verify", "-q"], ["gc", "--older-than", "0"]]
    for command in commands if status == 400 else []:
        code, out, err = cli(*command, *msc, uri)
        assert code != 0 and "Traceback" not in err, (command, out, err)
        outputs.append(out + err)
    secrets = echo.secrets()
    assert len(secrets) > 3, "the endpoint was never asked anything signed"
    ours = [r.getMessage() for r in caplog.records if r.name.startswith(("dcpstore", "multistorageclient"))]
    ours += [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    for text in [*map(_chain, errors), *outputs, *ours]:
        for secret in secrets:
            assert secret not in text, (secret, text[-2000:])
    assert any("InvalidRequest" in _chain(e) or str(status) in _chain(e) for e in errors)  # the cause is still named


@pytest.mark.parametrize(
    "uri,fix",
    [
        ("s3:bucket/x", "s3://bucket/x"),
        ("msc:profile/run", "msc://profile/run"),
        ("gs:bucket/x", "gs://bucket/x"),
        ("file:ckpt", "file:///abs/path"),
        ("S3:bucket", "S3://bucket"),
    ],
)
def test_scheme_typos_are_invalid_uris_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str, fix: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for action in (
        lambda: dcpstore.save({"w": torch.ones(2)}, uri),
        lambda: dcpstore.load({"w": torch.ones(2)}, uri),
        lambda: dcpstore.open_storage(uri),
    ):
        with pytest.raises(dcpstore.InvalidURI) as info:
            action()
        assert f"write '{fix}'" in str(info.value) and f"'./{uri}'" in str(info.value)
    code, _, err = cli("ls", uri)
    assert code == 2 and fix in err
    assert os.listdir(tmp_path) == []  # nothing saved into a local directory named like the URI
    # What the message offers for a real local directory of that name works.
    dcpstore.save({"w": torch.ones(2)}, f"./{uri}").result()
    with contextlib.suppress(FileNotFoundError):
        assert os.listdir(tmp_path) == [uri.split("/")[0]]


def test_credentials_typed_into_a_scheme_typo_are_not_echoed() -> None:
    with pytest.raises(dcpstore.InvalidURI) as info:
        dcpstore.open_storage(f"s3:{KEY_ID}:{SECRET}@bucket/x")
    assert SECRET not in str(info.value) and KEY_ID not in str(info.value)


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
_SEPARATORS = st.sampled_from([": ", "=", "': b'", '": "', ":", " = "])
_AROUND = st.text(alphabet=" ;,\n\t<>()[]{}", max_size=10)


@settings(max_examples=100, deadline=None)
@given(
    value=st.text(alphabet=_B64, min_size=16, max_size=80),
    name=st.sampled_from(["X-Amz-Security-Token", "x-amz-signature", "Signature", "AWS_SESSION_TOKEN", "sig"]),
    sep=_SEPARATORS,
    before=_AROUND,
    after=_AROUND,
)
def test_credential_shaped_fields_are_scrubbed(value: str, name: str, sep: str, before: str, after: str) -> None:
    """Whatever an echo looks like, a credential-shaped field loses its value,
    and a value this process holds goes wherever it appears."""
    from dcpstore._impl.storage import secrets
    from dcpstore._impl.storage.secrets import REDACTED, remember, scrub

    text = f"{before}{name}{sep}{value}{after}"
    assert value not in scrub(text) and REDACTED in scrub(text)
    # Hypothesis also draws string constants from our own source (S3 error
    # codes such as "AllAccessDisabled"): a remembered one would be scrubbed
    # from every later test's messages, so the process-wide set is restored.
    held = dict(secrets._remembered)
    try:
        remember(value)
        assert value not in scrub(f"{before}{value}{after}{value}")
    finally:
        with secrets._lock:
            secrets._remembered.clear()
            secrets._remembered.update(held)
