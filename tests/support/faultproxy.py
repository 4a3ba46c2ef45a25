"""A fault-injecting HTTP proxy for S3 tests (loopback only).

Sits between a client and an upstream S3 endpoint (the moto server) and, per
request, either forwards it or injects a fault:

* ``slowdown``: answer ``503 SlowDown`` with S3's XML error body (the request
  body is read first, so the connection stays usable, as with real S3);
* ``internal_error``: the same with ``500 InternalError``;
* ``drop``: read the request headers and half the body, then reset the
  connection (the client sees a connection error mid-request);
* ``drop_response``: forward the request, relay half of the response body,
  then reset (the client sees an incomplete read);
* ``answer``: a canned response of the test's choosing (e.g. S3's
  ``NoSuchUpload`` for a retried ``CompleteMultipartUpload``);
* ``delay_s``: hold matching requests that long before forwarding them: a
  slow response, or a stall when longer than the client's read timeout;
* ``hold_applies``: hold matching requests (their bodies received) until
  :meth:`FaultProxy.release`: :meth:`FaultProxy.wait_held` then proves how
  many a client keeps in flight at once, without timing anything.

Shares are probabilities per request, drawn from a seeded RNG; ``applies``
restricts faults to some requests (e.g. only ``UploadPart``). Counters record
what happened, and the peak number of requests in flight per operation kind
(to check concurrency bounds from the outside).

It speaks just enough HTTP/1.1 for botocore: keep-alive, ``Content-Length``
and ``chunked`` bodies, ``Expect: 100-continue`` (answered by the proxy
itself and stripped upstream), bodiless responses to ``HEAD``/204/304. Every
loop is bounded: socket timeouts, a cap on requests per connection, and
``stop()`` closes every socket.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

LOOPBACK = "127.0.0.1"
_MAX_REQUESTS_PER_CONNECTION = 10_000
_SOCKET_TIMEOUT_S = 60.0
_MAX_HEADER_BYTES = 64 * 1024


def s3_error(status: int, reason: str, code: str, message: str) -> bytes:
    """A complete HTTP response carrying an S3 XML error body."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>faultproxy</RequestId><HostId>faultproxy</HostId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "x-amz-request-id: faultproxy\r\n"
        "Connection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


SLOWDOWN = s3_error(503, "Slow Down", "SlowDown", "Please reduce your request rate.")
INTERNAL_ERROR = s3_error(
    500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."
)


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query, keep_blank_values=True)

    @property
    def kind(self) -> str:
        """A coarse S3 operation name, for counters and fault rules."""
        q = self.query
        if "partNumber" in q and self.method == "PUT":
            return "UploadPart"
        if "uploads" in q:
            return "CreateMultipartUpload" if self.method == "POST" else "ListMultipartUploads"
        if "uploadId" in q:
            return {"POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(self.method, "ListParts")
        if "delete" in q:
            return "DeleteObjects"
        if "list-type" in q:
            return "ListObjectsV2"
        return {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(
            self.method, self.method
        )


@dataclass
class FaultConfig:
    slowdown: float = 0.0
    internal_error: float = 0.0
    drop: float = 0.0
    drop_response: float = 0.0
    #: Only requests for which this returns True can get a fault.
    applies: Callable[[Request], bool] = lambda req: True
    #: A canned raw HTTP response for a request, instead of forwarding it
    #: (e.g. ``s3_error(404, ..., "NoSuchUpload", ...)``); None forwards.
    answer: Callable[[Request], bytes | None] = lambda req: None
    #: Seconds to hold each forwarded request matching ``delay_applies``.
    delay_s: float = 0.0
    delay_applies: Callable[[Request], bool] = lambda req: False
    #: Requests held (after their body arrived) until FaultProxy.release().
    hold_applies: Callable[[Request], bool] = lambda req: False


@dataclass
class Stats:
    requests: Counter[str] = field(default_factory=Counter)
    #: Requests by (kind, path without the query): which keys were asked for.
    by_key: Counter[tuple[str, str]] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    peak_inflight: Counter[str] = field(default_factory=Counter)
    #: Bytes of GetObject response bodies relayed, per object path (``/bucket/key``).
    got: Counter[str] = field(default_factory=Counter)


class _ConnectionClosed(Exception):
    pass


class _UpstreamClosed(Exception):
    """The upstream closed a kept-alive connection before answering."""


def _recv_until(sock: socket.socket, buf: bytearray, marker: bytes, limit: int) -> int:
    """Read into ``buf`` until ``marker`` appears; return the index after it."""
    while True:
        idx = buf.find(marker)
        if idx >= 0:
            return idx + len(marker)
        if len(buf) > limit:
            raise _ConnectionClosed("header too large")
        chunk = sock.recv(65536)
        if not chunk:
            raise _ConnectionClosed("peer closed")
        buf += chunk


def _recv_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(max(65536, n - len(buf)))
        if not chunk:
            raise _ConnectionClosed("peer closed mid-body")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_chunked(sock: socket.socket, buf: bytearray) -> bytes:
    """Read a chunked body; return it re-encoded verbatim (chunks + trailers)."""
    out = bytearray()
    while True:
        end = _recv_until(sock, buf, b"\r\n", _MAX_HEADER_BYTES)
        line = bytes(buf[:end])
        del buf[:end]
        out += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            # Trailers until an empty line.
            while True:
                end = _recv_until(sock, buf, b"\r\n", _MAX_HEADER_BYTES)
                trailer = bytes(buf[:end])
                del buf[:end]
                out += trailer
                if trailer == b"\r\n":
                    return bytes(out)
        out += _recv_exact(sock, buf, size + 2)


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers.append((key.strip(), value.strip()))
    return lines[0], headers


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name.lower():
            return value
    return None


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): an abrupt drop, not a clean FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream`` (``http://127.0.0.1:PORT``), injecting faults."""

    def __init__(self, upstream: str, config: FaultConfig | None = None, seed: int = 1234) -> None:
        parts = urlsplit(upstream)
        if parts.hostname not in (LOOPBACK, "localhost"):
            raise ValueError(f"faultproxy forwards to loopback only, not {parts.hostname!r}")
        self._upstream = (LOOPBACK, int(parts.port or 80))
        self.config = config or FaultConfig()
        self.stats = Stats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()
        self._held = 0
        self._held_changed = threading.Condition(self._lock)
        self._released = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)  # accept() wakes up to notice stop()
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._acceptor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_held(self, count: int, timeout_s: float = 60.0) -> int:
        """Wait until ``count`` requests are held at once (``hold_applies``),
        or ``timeout_s``; return how many are held then."""
        with self._held_changed:
            self._held_changed.wait_for(lambda: self._held >= count, timeout_s)
            return self._held

    def release(self) -> None:
        """Forward every held request, and hold no more from now on."""
        self._released.set()

    def stop(self) -> None:
        self._released.set()
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv (close alone does not)
            with contextlib.suppress(OSError):
                s.close()
        self._acceptor.join(5)

    # -- plumbing ------------------------------------------------------------
    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._sockets.add if add else self._sockets.discard)(sock)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(_SOCKET_TIMEOUT_S)
            self._track(client, True)
            threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn", daemon=True).start()

    def _draw(self, req: Request) -> str:
        cfg = self.config
        if not cfg.applies(req):
            return "forward"
        with self._lock:
            x = self._rng.random()
        for action in ("slowdown", "internal_error", "drop", "drop_response"):
            share = getattr(cfg, action)
            if x < share:
                return action
            x -= share
        return "forward"

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        buf = bytearray()
        try:
            for _ in range(_MAX_REQUESTS_PER_CONNECTION):
                if self._stopping.is_set():
                    return
                end = _recv_until(client, buf, b"\r\n\r\n", _MAX_HEADER_BYTES)
                request_line, headers = _parse_head(bytes(buf[:end]))
                del buf[:end]
                method, target, _ = request_line.split(" ", 2)
                req = Request(method, target, headers)
                action = self._draw(req)
                with self._lock:
                    self.stats.requests[req.kind] += 1
                    self.stats.by_key[(req.kind, urlsplit(req.target).path)] += 1
                if action == "drop":
                    self._drop_mid_request(client, req, buf)
                    return
                if (req.header("Expect") or "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                req.body = self._read_body(client, buf, req.headers)
                if action in ("slowdown", "internal_error"):
                    with self._lock:
                        self.stats.faults[action] += 1
                    client.sendall(SLOWDOWN if action == "slowdown" else INTERNAL_ERROR)
                    continue
                canned = self.config.answer(req)
                if canned is not None:
                    with self._lock:
                        self.stats.faults["answer"] += 1
                    client.sendall(canned)
                    continue
                try:
                    upstream = upstream or self._connect()
                    keep = self._forward(client, upstream, req, truncate=action == "drop_response")
                except _UpstreamClosed:
                    # The upstream dropped an idle keep-alive connection: once more, fresh.
                    if upstream is not None:
                        self._track(upstream, False)
                        upstream.close()
                    upstream = self._connect()
                    keep = self._forward(client, upstream, req, truncate=action == "drop_response")
                if not keep:
                    return
        except (_ConnectionClosed, OSError, ValueError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    self._track(s, False)
                    with contextlib.suppress(OSError):
                        s.close()

    def _drop_mid_request(self, client: socket.socket, req: Request, buf: bytearray) -> None:
        # With "Expect: 100-continue" the client holds the body back: drop
        # after the headers. Otherwise take about half the body first.
        length = int(req.header("Content-Length") or 0)
        if length > 1 and (req.header("Expect") or "").lower() != "100-continue":
            with contextlib.suppress(OSError):
                while len(buf) < length // 2:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        with self._lock:
            self.stats.faults["drop"] += 1
        _reset(client)

    @staticmethod
    def _read_body(sock: socket.socket, buf: bytearray, headers: list[tuple[str, str]]) -> bytes:
        if (_get(headers, "Transfer-Encoding") or "").lower() == "chunked":
            return _read_chunked(sock, buf)
        length = int(_get(headers, "Content-Length") or 0)
        return _recv_exact(sock, buf, length) if length else b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self._upstream, timeout=_SOCKET_TIMEOUT_S)
        self._track(sock, True)
        return sock

    def _forward(self, client: socket.socket, upstream: socket.socket, req: Request, *, truncate: bool) -> bool:
        """Send ``req`` upstream and relay the response; False to close the connection."""
        kind = req.kind
        with self._lock:
            self._inflight[kind] += 1
            self.stats.peak_inflight[kind] = max(self.stats.peak_inflight[kind], self._inflight[kind])
        try:
            if not self._released.is_set() and self.config.hold_applies(req):
                with self._held_changed:
                    self._held += 1
                    self._held_changed.notify_all()
                try:
                    self._released.wait(_SOCKET_TIMEOUT_S)
                finally:
                    with self._held_changed:
                        self._held -= 1
            if self.config.delay_s and self.config.delay_applies(req):
                with self._lock:
                    self.stats.faults["delay"] += 1
                # Not a plain sleep: stop() ends the hold, so that no connection
                # thread outlives the proxy by the stall (and counts in a later
                # test's threads).
                self._stopping.wait(self.config.delay_s)
            head = f"{req.method} {req.target} HTTP/1.1\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in req.headers if k.lower() != "expect"
            )
            upstream.sendall(head.encode("latin-1") + b"\r\n" + req.body)
            ubuf = bytearray()
            try:
                end = _recv_until(upstream, ubuf, b"\r\n\r\n", _MAX_HEADER_BYTES)
            except (_ConnectionClosed, ConnectionResetError) as e:
                if not ubuf:
                    raise _UpstreamClosed() from e
                raise
            status_line, headers = _parse_head(bytes(ubuf[:end]))
            raw_head = bytes(ubuf[:end])
            del ubuf[:end]
            status = int(status_line.split(" ", 2)[1])
            if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                body = b""
            else:
                body = self._read_body(upstream, ubuf, headers)
                if kind == "GetObject":
                    with self._lock:
                        self.stats.got[urlsplit(req.target).path] += len(body)
        finally:
            with self._lock:
                self._inflight[kind] -= 1
        if truncate and len(body) > 1:
            with self._lock:
                self.stats.faults["drop_response"] += 1
            client.sendall(raw_head + body[: len(body) // 2])
            _reset(client)
            return False
        client.sendall(raw_head + body)
        return (_get(headers, "Connection") or "").lower() != "close"
