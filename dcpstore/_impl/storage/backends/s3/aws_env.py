"""The AWS environment a boto3 client reads: the native S3 and the MSC
backends build their clients alike, and reuse one only while it and the
options it was built with are unchanged (:func:`client_key`)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from dcpstore._impl.storage.storage_options import StorageOptions

#: Environment variables that change which endpoint, region or credentials a
#: new client gets; a client is reused only while they are unchanged.
AWS_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_RETRY_MODE",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_CA_BUNDLE",
)


def aws_env_fingerprint() -> str:
    """A digest of the AWS environment a new boto3 client would read: a
    cached client is reused only while it is unchanged."""
    # Hashed so that the cache key never holds a credential in clear text.
    digest = hashlib.sha256()
    for key in AWS_ENV_KEYS:
        digest.update(f"{key}={os.environ.get(key, '<unset>')}\n".encode())
    return digest.hexdigest()


def client_key(options: StorageOptions, *built_from: Any) -> tuple[Any, ...]:
    """What a cached boto3 client is reused for: this process (a forked
    child builds its own), the AWS environment it read
    (:func:`aws_env_fingerprint`), the timeouts and attempts it was built
    with from ``options``, and whatever else the caller built it from
    (``built_from``)."""
    return (
        os.getpid(),
        aws_env_fingerprint(),
        options.max_attempts,
        options.connect_timeout_s,
        options.read_timeout_s,
        *built_from,
    )


def aws_retry_mode() -> str:
    """botocore's retry mode for dcpstore's clients: ``standard``, or the
    user's explicit ``adaptive`` (``AWS_RETRY_MODE``)."""
    mode = os.environ.get("AWS_RETRY_MODE", "").strip().lower()
    # "legacy" (botocore's default when unset) retries fewer errors and has no
    # retry quota; we want standard (or the user's explicit adaptive).
    return mode if mode in ("standard", "adaptive") else "standard"
