"""Processes a comparison needs: a moto S3 server and the WAN proxy, both on
loopback, plus environment scopes that point clients at them.

Both run as separate processes (real HTTP, and no competition with the
benchmark for the GIL) and are stopped by their context managers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: Credentials moto accepts; they are test values, never real secrets.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_binary() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "moto_server")
    found = beside if os.path.exists(beside) else shutil.which("moto_server")
    if not found:
        raise FileNotFoundError("moto_server not found (pip install 'moto[server]')")
    return found


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before serving {url}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def moto_server(pids: set[int] | None = None) -> Iterator[str]:
    """A moto S3 server on a free loopback port; yields its endpoint URL.
    Its pid goes into ``pids`` (to leave the server out of RSS figures)."""
    port = free_port()
    proc = subprocess.Popen(
        [_moto_binary(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if pids is not None:
        pids.add(proc.pid)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc)
        yield url
    finally:
        _stop(proc)


@contextlib.contextmanager
def wan_proxy(
    endpoint: str,
    *,
    latency_ms: float,
    rate_mbps: float,
    pids: set[int] | None = None,
    count: str | None = None,
    total_mbps: float = 0.0,
) -> Iterator[str]:
    """The shaping proxy (benchmarks/wanproxy.py) in front of ``endpoint``;
    ``count``: a file it keeps the bytes the endpoint sent in;
    ``total_mbps``: what the endpoint sends in all (0: no limit)."""
    upstream = endpoint.split("://", 1)[-1].rstrip("/")
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "wanproxy.py"),
            "--upstream",
            upstream,
            "--latency-ms",
            str(latency_ms),
            "--rate-mbps",
            str(rate_mbps),
            *(["--count", count] if count else []),
            *(["--total-mbps", str(total_mbps)] if total_mbps else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    if pids is not None:
        pids.add(proc.pid)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("listening "):
            raise RuntimeError(f"wanproxy did not start (said {line!r})")
        yield f"http://{line.split()[1]}"
    finally:
        _stop(proc)


@contextlib.contextmanager
def env(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(old)


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def s3_env(endpoint: str) -> dict[str, str | None]:
    """What makes boto3 (and dcpstore's s3 backend) talk to ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, **FAKE_CREDENTIALS}


def admin_client(endpoint: str) -> Any:
    """A plain boto3 client for setting up and cleaning ``endpoint`` (not what is measured)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


def create_bucket(endpoint: str, bucket: str) -> None:
    admin_client(endpoint).create_bucket(Bucket=bucket)


def write_msc_config(path: str, profiles: dict[str, tuple[str, str]]) -> str:
    """An MSC config with one S3 profile per ``name -> (endpoint, bucket)``.

    Credentials are not written: MSC's S3 provider takes them from the
    environment like boto3 does.
    """
    config = {
        "profiles": {
            name: {
                "storage_provider": {
                    "type": "s3",
                    "options": {"base_path": bucket, "endpoint_url": endpoint, "region_name": "us-east-1"},
                }
            }
            for name, (endpoint, bucket) in profiles.items()
        }
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path
