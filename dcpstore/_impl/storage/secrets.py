"""Credentials out of every message: the one scrubber that error mappings,
log lines and the command line pass text through.

Two kinds of secret are removed, whatever produced the text (a message we
wrote, a backend's exception, an error body an endpoint or proxy echoed):

- the *values* this process holds: the AWS secret key and session token of
  the environment, and those a backend resolved and registered with
  :func:`remember` (from a profile, a credentials file, instance metadata);
- anything *shaped* like a credential in HTTP traffic: ``Authorization``
  headers, SigV4 signatures and credentials, security-token headers and
  query parameters, token and secret elements of XML bodies.

URIs have their own, structural redaction (:func:`dcpstore._impl.storage.uri.redact`);
this module is for free text.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

REDACTED = "<redacted>"
_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
#: Shorter values would match ordinary words; real keys and tokens are longer.
_MIN_LEN = 8
_MAX_REMEMBERED = 64

_remembered: dict[str, None] = {}  # insertion-ordered: the oldest go first
_lock = threading.Lock()

_NAMES = (
    r"x-amz-security-token|x-amz-signature|x-amz-credential|x-goog-signature|x-goog-credential|"
    r"aws_secret_access_key|aws_session_token|aws_security_token|secret_?access_?key|session_?token|"
    r"security_?token|secret_?key|signature|credential|sig"
)
_PATTERNS = (
    # Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*b?['\"]?)[^\r\n'\"<]+"), rf"\1{REDACTED}"),
    # name: value, name=value, 'name': b'value', "name": "value"
    (re.compile(rf"(?i)\b({_NAMES})(['\"]?\s*[:=]\s*b?['\"]?)[^\s'\"&<>,;)}}\]]+"), rf"\1\2{REDACTED}"),
    # <SessionToken>value</SessionToken> and friends
    (
        re.compile(r"(?i)(<(?:\w+:)?(?:SessionToken|SecretAccessKey|Signature|Token|Credential)>)[^<]*"),
        rf"\1{REDACTED}",
    ),
)


def remember(*values: str | None) -> None:
    """Register credential values this process holds (a backend's resolved
    secret key and session token) so that :func:`scrub` removes them too.
    Bounded: the oldest are forgotten past a few dozen (tokens rotate)."""
    with _lock:
        for value in values:
            if isinstance(value, str) and len(value) >= _MIN_LEN and value not in _remembered:
                _remembered[value] = None
                while len(_remembered) > _MAX_REMEMBERED:
                    del _remembered[next(iter(_remembered))]


def _values() -> list[str]:
    env = [os.environ.get(name, "") for name in _ENV_SECRETS]
    with _lock:
        held = list(_remembered)
    # Longest first: a token that contains another value is removed whole.
    return sorted({v for v in (*env, *held) if len(v) >= _MIN_LEN}, key=len, reverse=True)


def scrub(text: str) -> str:
    """``text`` without any credential value or credential-shaped field."""
    for value in _values():
        if value in text:
            text = text.replace(value, REDACTED)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _scrub_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, bytes) and depth:
        return scrub(value.decode("utf-8", "replace")).encode()
    if isinstance(value, dict) and depth < 4:
        return {k: _scrub_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and depth < 4:
        return type(value)(_scrub_value(v, depth + 1) for v in value)
    return value


def scrub_exception(e: BaseException | None) -> None:
    """Scrub, in place, an exception and every exception it was raised from
    or during: their arguments (what ``str()`` and tracebacks show) and a
    botocore-style ``response`` dict (error code and message, headers). Call
    it on a backend's exception before chaining ours to it (``from e``)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            e.args = tuple(_scrub_value(a) for a in e.args)
            response = getattr(e, "response", None)
            if isinstance(response, dict):
                for key in ("Error", "ResponseMetadata"):
                    if isinstance(response.get(key), dict):
                        response[key] = _scrub_value(response[key], 1)
        except (AttributeError, TypeError):  # an exception type with read-only args
            pass
        e = e.__cause__ or e.__context__


def remember_boto_credentials(session: Any, client: Any) -> None:
    """Register what a boto3 ``session`` resolved (secret key, session
    token), and every security token ``client`` later signs with (they
    rotate), for :func:`scrub`."""
    credentials = session.get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        remember(frozen.secret_key, frozen.token)

    def on_request_created(request: Any, **_: Any) -> None:  # runs after signing
        token = request.headers.get("X-Amz-Security-Token")
        if token:
            remember(token.decode("ascii", "replace") if isinstance(token, bytes) else str(token))

    client.meta.events.register("request-created.s3", on_request_created)
