"""The boto3 side of the native S3 backend: clients, retries, error mapping.

Retries are botocore's own (``standard`` mode, or ``adaptive`` when
``AWS_RETRY_MODE`` says so) with ``max_attempts`` attempts per request and the
connect/read timeouts from :class:`~dcpstore._impl.storage.storage_options.StorageOptions`; on
top of that a request gives up once it has spent ``op_timeout_s`` retrying
(:func:`_install_deadline`). One client per process and configuration is
shared by every :class:`~dcpstore._impl.storage.backends.s3.storage.S3Storage` (:func:`s3_client`).
Retries are not silent: the first retry of a burst logs one WARNING with its
cause, and a burst that goes on logs a reminder every
:data:`RetryBursts.REMIND_S` seconds (:class:`RetryBursts`).

Errors after the retries are mapped to the :mod:`dcpstore._impl.util.errors` family by
:func:`map_error`, classified by the shared S3 code table
(:mod:`dcpstore._impl.storage.backends.s3.error_codes`) and chained to the botocore exception.
Endpoint, region and credentials come from the standard AWS sources
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, ...); no message or
log line here ever contains a credential.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import boto3
import botocore.exceptions as bexc
from botocore.config import Config
from botocore.utils import determine_content_length

from dcpstore._impl.storage.backends.s3.aws_env import aws_retry_mode, client_key
from dcpstore._impl.storage.backends.s3.error_codes import Meaning, meaning
from dcpstore._impl.storage.concurrency import http_pool_size
from dcpstore._impl.storage.error_mapping import library_detail, library_text
from dcpstore._impl.storage.secrets import remember_boto_credentials
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.util.errors import (
    CheckpointError,
    InvalidURI,
    StorageError,
    StorageNotFound,
    StoragePermissionError,
)

log = logging.getLogger(__name__)


class OperationTimeout(Exception):
    """Raised from a botocore hook when a request has retried past op_timeout_s."""

    def __init__(self, limit_s: float, elapsed_s: float, attempts: int, last: str) -> None:
        super().__init__(
            f"gave up after {elapsed_s:.1f}s and {attempts} attempts (op_timeout_s={limit_s:g}); last error: {last}"
        )


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def s3_client(options: StorageOptions) -> Any:
    """The boto3 S3 client for this process and configuration (cached).

    Creating a client costs tens of milliseconds and a connection pool, so
    every :class:`S3Storage` with the same options (and the same AWS
    environment) in one process shares one; boto3 clients are thread-safe.
    The key includes the pid: a forked child builds its own.
    """
    key = client_key(options, options.max_concurrency, options.op_timeout_s, options.region)
    client = _clients.get(key)
    if client is not None:
        return client
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _make_client(options)
            _clients[key] = client
        return client


def _make_client(options: StorageOptions) -> Any:
    config = Config(
        # total_max_attempts counts the first try, like StorageOptions.max_attempts
        # (botocore's "max_attempts" would count retries only).
        retries={"mode": aws_retry_mode(), "total_max_attempts": options.max_attempts},
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        # One connection per request the storage may have in flight.
        max_pool_connections=http_pool_size(options.max_concurrency),
        tcp_keepalive=True,
    )
    # A Session per client: sessions are not thread-safe, clients are.
    session = boto3.session.Session()
    client = session.client("s3", config=config, region_name=options.region)
    one_digest = _one_digest(client)
    if one_digest is not None:
        client.close()  # it only told where the endpoint is and what the profile says: no request was sent
        client = session.client("s3", config=config.merge(one_digest), region_name=options.region)
    _install_deadline(client, options)
    _continue_only_for_large_bodies(client)
    remember_boto_credentials(session, client)  # so that no message ever shows them
    return client


def signs_payloads(client: Any) -> bool:
    """Whether botocore puts the SHA-256 of every request body into the
    request's signature, which S3 verifies before it accepts the bytes:
    where the profile's ``s3.payload_signing_enabled`` says so, else over
    plain HTTP (botocore's ``S3SigV4Auth._should_sha256_sign_payload``; over
    HTTPS it also does where a request carries no checksum header, which
    :func:`_one_digest` sees to)."""
    explicit = (getattr(client.meta.config, "s3", None) or {}).get("payload_signing_enabled")
    if explicit is not None:
        return bool(explicit)
    return not str(client.meta.endpoint_url).lower().startswith("https:")


def sends_checksums(client: Any) -> bool:
    """Whether a writer sends a CRC32C with every PUT and part (``client``
    checksums every request that may carry one, botocore's default, rather
    than only where the API demands; :func:`s3_client`'s clients do so
    exactly where the payload is not signed)."""
    return str(getattr(client.meta.config, "request_checksum_calculation", "when_supported")) != "when_required"


def _one_digest(client: Any) -> Config | None:
    """What to change in ``client``'s configuration so that every request
    body gets one digest that S3 verifies, not two, or None.

    Over plain HTTP botocore SHA-256-signs every payload whatever else is
    sent: that signature is the digest, and also guards the bytes against
    tampering, which only TLS would do otherwise. A checksum beside it (our
    CRC32C, or botocore's own software CRC32) would check the same bytes a
    second time: checksums are asked only where the API requires them.

    Over HTTPS, TLS guards against tampering and the writer's hardware
    CRC32C against corruption; botocore would still SHA-256 the payload
    (about nine times the CRC32C's CPU) because a checksum the caller
    computes does not count as one for its signing rule: payload signing is
    turned off. A profile that sets ``s3.payload_signing_enabled`` either way
    is followed, and AWS_REQUEST_CHECKSUM_CALCULATION=when_required keeps
    the writer's CRC32C off."""
    if not sends_checksums(client):
        return None
    if signs_payloads(client):
        return Config(request_checksum_calculation="when_required")
    explicit = (getattr(client.meta.config, "s3", None) or {}).get("payload_signing_enabled")
    return Config(s3={"payload_signing_enabled": False}) if explicit is None else None


#: A PUT body of at least this many bytes waits for the endpoint's
#: ``100 Continue`` before it is sent; a smaller one goes with its headers
#: (the threshold aws-sdk-go-v2's S3 client uses by default,
#: ``ContinueHeaderThresholdBytes``).
CONTINUE_MIN = 2 * 1024 * 1024


def _continue_only_for_large_bodies(client: Any) -> None:
    """botocore sends every S3 PUT with a body as ``Expect: 100-continue``:
    the body waits one round trip for the endpoint's go-ahead. That is
    worth it for a large part (a request the endpoint refuses -- a
    redirect, an expired credential -- is refused before megabytes go out),
    not for a small file: a save's commit writes four of them one after
    the other (the alive file, the in-flight marker, the manifest,
    ``.metadata``), each then two round trips instead of one. Runs after
    botocore's own ``before-call`` handler, and drops the header only where
    the body's length is known and below :data:`CONTINUE_MIN`."""

    def drop_small(params: dict[str, Any], **_: Any) -> None:
        headers = params.get("headers")
        if not headers or "Expect" not in headers:
            return
        length = determine_content_length(params.get("body"))
        if length is not None and length < CONTINUE_MIN:
            del headers["Expect"]

    client.meta.events.register_last("before-call.s3", drop_small)


class RetryBursts:
    """Says, on the ``dcpstore`` logger, that requests are being retried.

    A *burst* is a run of retries (any request of one client) with no gap
    longer than :attr:`QUIET_S`. Its first retry logs one WARNING naming the
    operation and the cause; while it lasts, a reminder with the count follows
    every :attr:`REMIND_S` seconds, so an unreachable endpoint is never a
    silent wait. Causes are error codes and exception class names (never a
    message body, which an endpoint may fill with anything); the endpoint is
    redacted. Thread-safe: every request thread of the client reports here.
    """

    QUIET_S = 30.0
    REMIND_S = 30.0

    def __init__(self, endpoint: str, max_attempts: int, op_timeout_s: float) -> None:
        self.endpoint = library_text(endpoint)  # redacted and scrubbed
        self.max_attempts = max_attempts
        self.op_timeout_s = op_timeout_s
        self._lock = threading.Lock()
        self._last = -float("inf")  # monotonic time of the last retry
        self._reminded = 0.0
        self._started = 0.0
        self._count = 0

    def retrying(self, operation: str, attempt: int, cause: str, now: float | None = None) -> None:
        """Attempt number ``attempt`` (2 or more) of ``operation`` is starting
        because the previous one failed with ``cause``."""
        now = time.monotonic() if now is None else now
        cause = library_text(cause)
        with self._lock:
            new_burst = now - self._last > self.QUIET_S
            self._last = now
            if new_burst:
                self._started = self._reminded = now
                self._count = 1
                log.warning(
                    "S3 %s to %s failed (%s); retrying (attempt %d of %d; a request gives up after op_timeout_s=%g s)",
                    operation,
                    self.endpoint,
                    cause,
                    attempt,
                    self.max_attempts,
                    self.op_timeout_s,
                )
                return
            self._count += 1
            if now - self._reminded >= self.REMIND_S:
                self._reminded = now
                log.warning(
                    "still retrying S3 requests to %s: %d retries in the last %.0f s, the latest of %s after %s",
                    self.endpoint,
                    self._count,
                    now - self._started,
                    operation,
                    cause,
                )


def _install_deadline(client: Any, options: StorageOptions) -> None:
    """Bound the time one request may spend retrying (botocore has no such
    knob), and report retries (:class:`RetryBursts`).

    botocore creates a fresh request object for every attempt and emits
    ``request-created``; the per-request ``context`` dict survives retries, so
    it carries the start time and the last failure for the message. A second
    ``request-created`` for one context is botocore's retry handler at work.
    """
    limit_s = options.op_timeout_s
    bursts = RetryBursts(str(client.meta.endpoint_url), options.max_attempts, limit_s)

    def on_request_created(request: Any, event_name: str = "", **_: Any) -> None:
        ctx = request.context
        now = time.monotonic()
        ctx["dcpstore_attempts"] = ctx.get("dcpstore_attempts", 0) + 1
        started = ctx.setdefault("dcpstore_t0", now)
        if now - started > limit_s:
            raise OperationTimeout(limit_s, now - started, ctx["dcpstore_attempts"] - 1, ctx.get("dcpstore_last", "?"))
        if ctx["dcpstore_attempts"] > 1:
            operation = event_name.rsplit(".", 1)[-1] or "request"
            bursts.retrying(operation, ctx["dcpstore_attempts"], ctx.get("dcpstore_last", "?"), now)

    def on_needs_retry(response: Any = None, caught_exception: Any = None, request_dict: Any = None, **_: Any) -> None:
        if request_dict is None:
            return None
        if caught_exception is not None:
            request_dict["context"]["dcpstore_last"] = type(caught_exception).__name__
        elif response is not None and response[0].status_code >= 300:
            code = response[1].get("Error", {}).get("Code", "")
            request_dict["context"]["dcpstore_last"] = f"{code} (HTTP {response[0].status_code})"
        return None  # never decides about retrying: botocore's handler does

    client.meta.events.register("request-created.s3", on_request_created)
    client.meta.events.register("needs-retry.s3", on_needs_retry)


# ---------------------------------------------------------------------------
# Error mapping
# ---------------------------------------------------------------------------


def client_error(e: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status of a botocore ``ClientError`` (else ``("", 0)``)."""
    if isinstance(e, bexc.ClientError):
        code, status, _, _ = _client_error_parts(e)
        return code, status
    return "", 0


def _client_error_parts(e: bexc.ClientError) -> tuple[str, int, str, int]:
    err = e.response.get("Error", {})
    meta = e.response.get("ResponseMetadata", {})
    return (
        str(err.get("Code", "")),
        int(meta.get("HTTPStatusCode", 0) or 0),
        str(err.get("Message", "")),
        int(meta.get("RetryAttempts", 0) or 0),
    )


def map_error(e: BaseException, what: str, bucket: str, endpoint: str) -> CheckpointError:
    """Translate a botocore exception into the dcpstore family (raise it ``from e``).

    ``what`` names the operation and the URI; ``bucket`` is named when it is
    the bucket that is missing.
    """
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, bexc.ClientError):
        code, status, message, retries = _client_error_parts(e)
        return map_code(code, status, message, retries, what, bucket, endpoint)
    if isinstance(e, bexc.NoCredentialsError | bexc.PartialCredentialsError):
        return StoragePermissionError(
            f"{what}: no usable AWS credentials found (environment, shared credentials file, "
            "profile or instance metadata)"
        )
    if isinstance(e, OperationTimeout):
        return StorageError(f"{what}: {e}")
    if isinstance(e, bexc.ParamValidationError):  # refused by botocore before any request: no retry, say why
        return InvalidURI(f"{what}: {library_text(' '.join(str(e).split()))}")
    if isinstance(e, bexc.EndpointConnectionError | bexc.ConnectTimeoutError):
        return StorageError(
            f"{what}: cannot connect to the S3 endpoint {endpoint} ({type(e).__name__}), retries exhausted"
        )
    if isinstance(e, bexc.BotoCoreError | OSError):
        return StorageError(f"{what}: {type(e).__name__} talking to the S3 endpoint {endpoint}, retries exhausted")
    return StorageError(f"{what}: unexpected {library_detail(e)}")


def map_code(
    code: str, status: int, message: str, retries: int, what: str, bucket: str, endpoint: str
) -> CheckpointError:
    """Map one S3 error code (a request's, or one key's in DeleteObjects)."""
    found = meaning(code, status)
    if found is Meaning.NO_BUCKET:
        return StorageNotFound(f"{what}: bucket {bucket!r} does not exist (S3 endpoint {endpoint})")
    if found is Meaning.NOT_FOUND:
        return StorageNotFound(f"{what}: no such object")
    if found is Meaning.BAD_CREDENTIALS:
        return StoragePermissionError(
            f"{what}: the S3 endpoint {endpoint} refused the credentials ({code}); check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or the AWS profile"
        )
    if found is Meaning.DENIED:
        return StoragePermissionError(
            f"{what}: access denied by the S3 endpoint {endpoint} ({code or status}): the credentials "
            "were refused or lack permission for this bucket/key"
        )
    tries = f" after {retries + 1} attempts" if retries else ""
    http = f" (HTTP {status})" if status else ""
    return StorageError(f"{what}: S3 error {library_text(code) or '?'}{http}{tries}: {library_text(message)}")
