"""A real S3 endpoint for the tests: ``moto_server`` on loopback, in its own process.

The session fixture :func:`s3_endpoint` starts one server on a free
``127.0.0.1`` port, creates the test bucket, and points the standard AWS
environment at it **for the rest of the test session** (``AWS_ENDPOINT_URL``,
fake ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, region; the user's
``~/.aws`` files are masked). It is requested lazily by the object-store
targets in ``backends.py``, so a local-only run starts nothing and changes no
environment; the variables are restored when the session ends. Tests stay
independent through unique key prefixes (``ckpt-<random>``), not resets.

:func:`msc_config` writes an MSC config file whose profile points at the same
endpoint and sets ``MSC_CONFIG`` for the session, likewise.

Everything here talks to loopback only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dcpstore.storage import StorageOptions

LOOPBACK = "127.0.0.1"
BUCKET = "dcpstore-test"
MSC_PROFILE = "dcpstore-s3"
#: ``s3://BUCKET/<this>/...`` with ``enable_msc=True`` resolves, through the
#: MSC config's ``path_mapping``, to profile ``MSC_MAPPED_PROFILE`` (base path
#: ``BUCKET/<this>``): the suites' ``s3+msc`` target. Other keys get MSC's
#: implicit profile, whose 64 MiB multipart threshold no config can change.
MSC_MAPPED_PREFIX = "msc-mapped"
MSC_MAPPED_PROFILE = "dcpstore-s3-mapped"
# Distinctive, so that tests can assert they never show up in output or logs.
FAKE_KEY_ID = "AKIADCPSTORESESSION1"
FAKE_SECRET = "dcpstore/session+SECRET/never-printed-0001"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _moto_command(port: int) -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        found = shutil.which("moto_server")
        exe = Path(found) if found else exe
    if exe.exists():
        return [str(exe), "-H", LOOPBACK, "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]


@dataclass(frozen=True)
class Tls:
    """A self-signed certificate for the loopback address, and its key (PEM
    files): a TLS endpoint that clients trust through ``AWS_CA_BUNDLE``."""

    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> Tls:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, LOOPBACK)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        tls = cls(directory / "cert.pem", directory / "key.pem")
        tls.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        tls.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return tls


_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MotoServer:
    """One ``moto_server`` process on a free loopback port (HTTPS with ``tls``)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, tls: Tls | None = None) -> None:
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://{LOOPBACK}:{self.port}"
        self.tls = tls
        self._log_path = log_dir / f"moto-{self.port}.log"
        self._env = {**os.environ, **(env or {})}
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: tuple[int, Any] | None = None
        self._opener = _no_proxy
        if tls:
            trust = ssl.create_default_context(cafile=str(tls.cert))
            self._opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=trust)
            )

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        command = _moto_command(self.port)
        if self.tls:
            command += ["-c", str(self.tls.cert), "-k", str(self.tls.key)]
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                with self._opener.open(f"{self.url}/moto-api/data.json", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.url} within {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_text(errors="replace")[-n:]
        return ""

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with self._opener.open(req, timeout=10):
            pass

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def client(self, **kwargs: Any) -> Any:
        """A plain boto3 client for this server (test setup and inspection).
        Without arguments, one shared client: building one costs ~0.15 s,
        and every object-store test's cleanup needs one."""
        import boto3

        if not kwargs and self._client is not None and self._client[0] == os.getpid():
            return self._client[1]
        shared = not kwargs
        kwargs.setdefault("aws_access_key_id", FAKE_KEY_ID)
        kwargs.setdefault("aws_secret_access_key", FAKE_SECRET)
        if self.tls:
            kwargs.setdefault("verify", str(self.tls.cert))
        client = boto3.session.Session().client("s3", endpoint_url=self.url, region_name=REGION, **kwargs)
        if shared:
            self._client = (os.getpid(), client)  # thread-safe; a forked child builds its own
        return client


@dataclass(frozen=True)
class S3Endpoint:
    server: MotoServer
    bucket: str

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kwargs: Any) -> Any:
        return self.server.client(**kwargs)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object and open upload under ``prefix`` (test cleanup)."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        for upload in self.open_uploads(prefix):
            client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    def open_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Multipart uploads still open under ``prefix`` (for leak checks)."""
        resp = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads", []))


def aws_env(url: str) -> dict[str, str | None]:
    """The AWS environment that points boto3 (and MSC, s3fs) at ``url``; None unsets."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ENDPOINT_URL_S3": None,
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_SESSION_TOKEN": None,
        "AWS_SECURITY_TOKEN": None,
        "AWS_PROFILE": None,
        "AWS_DEFAULT_PROFILE": None,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": f"{LOOPBACK},localhost",
        "no_proxy": f"{LOOPBACK},localhost",
    }


def export_aws_env(url: str) -> None:
    """Point this process (and the processes it starts) at the endpoint ``url``."""
    for key, value in aws_env(url).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def apply_env(mp: pytest.MonkeyPatch, env: dict[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            mp.delenv(key, raising=False)
        else:
            mp.setenv(key, value)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """A moto S3 server for the session, with the AWS environment pointing at it."""
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    mp = pytest.MonkeyPatch()
    try:
        apply_env(mp, aws_env(server.url))
        server.client().create_bucket(Bucket=BUCKET)
        yield S3Endpoint(server, BUCKET)
    finally:
        mp.undo()
        server.stop()


@pytest.fixture(scope="session")
def msc_config(s3_endpoint: S3Endpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An MSC config file on the session's endpoint; sets MSC_CONFIG. Profile
    ``dcpstore-s3`` (base path: the bucket), and ``dcpstore-s3-mapped`` that
    ``s3://BUCKET/msc-mapped/`` maps to. Both use 5 MiB parts, so that the
    suites' multi-MiB objects really go up as multipart uploads, and as many
    attempts per request as the native backend's default: moto closes a
    replaced object's file while a GET may still be reading it and answers
    that GET with a 500, which S3 documents as retriable, and MSC's default of
    3 attempts lost that race about once in 8 runs of the contract suite."""
    path = tmp_path_factory.mktemp("msc") / "msc_config.yaml"
    profiles = {MSC_PROFILE: s3_endpoint.bucket, MSC_MAPPED_PROFILE: f"{s3_endpoint.bucket}/{MSC_MAPPED_PREFIX}"}
    text = "profiles:\n"
    for name, base_path in profiles.items():
        text += (
            f"  {name}:\n"
            "    storage_provider:\n"
            "      type: s3\n"
            "      options:\n"
            f"        base_path: {base_path}\n"
            f"        endpoint_url: {s3_endpoint.url}\n"
            f"        region_name: {REGION}\n"
            "        multipart_threshold: 5242880\n"
            "        multipart_chunksize: 5242880\n"
            "        retries:\n"
            "          mode: standard\n"
            f"          total_max_attempts: {StorageOptions().max_attempts}\n"
        )
    text += f"path_mapping:\n  s3://{s3_endpoint.bucket}/{MSC_MAPPED_PREFIX}/: msc://{MSC_MAPPED_PROFILE}/\n"
    path.write_text(text)
    mp = pytest.MonkeyPatch()
    mp.setenv("MSC_CONFIG", str(path))
    try:
        yield MSC_PROFILE
    finally:
        mp.undo()
