"""URI parsing, joining and redaction.

A checkpoint is addressed by one URI. Plain paths (absolute or relative) and
``file://`` URIs are local; everything else keeps its scheme and is resolved
to a backend by :mod:`dcpstore._impl.storage.backend_registry`.

Redaction is here too so that every error message can name a URI without ever
printing credentials embedded in it (``s3://KEY:SECRET@bucket``, signed query
strings).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from dcpstore._impl.util.errors import InvalidURI

#: Schemes whose authority is a bucket (or MSC profile) name.
_OBJECT_SCHEMES = ("s3", "msc", "gs", "gcs", "az", "abfs")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Scheme names a path is never meant to start with: ``s3:bucket/x`` is a
#: typo of ``s3://bucket/x``, not a local directory named ``s3:bucket``.
_KNOWN_SCHEMES = frozenset(
    (
        *_OBJECT_SCHEMES,
        "file",
        "s3a",
        "abfss",
        "adl",
        "hdfs",
        "webhdfs",
        "http",
        "https",
        "memory",
        "ftp",
        "sftp",
        "ssh",
        "hf",
        "oci",
        "oss",
        "r2",
    )
)


@dataclass(frozen=True)
class StorageURL:
    """A parsed checkpoint URI.

    ``scheme`` is ``"file"`` for local paths. ``netloc`` is the bucket (s3),
    the profile (msc) or the host part of other schemes. ``path`` has no
    leading or trailing slash for object stores, and is absolute for ``file``.
    """

    scheme: str
    netloc: str
    path: str
    original: str

    @property
    def uri(self) -> str:
        """The canonical form of this URI."""
        if self.scheme == "file":
            return self.path
        tail = f"/{self.path}" if self.path else ""
        return f"{self.scheme}://{self.netloc}{tail}"

    def __str__(self) -> str:  # never print credentials
        return redact(self.uri)


def redact(uri: str) -> str:
    """Return ``uri`` with any user info, query string and fragment removed.

    Textual on purpose (no URL parser that could reject odd input): it must
    be safe to call on anything a user passed in.
    """
    match = _SCHEME_RE.match(uri)
    if not match:
        return uri
    rest = uri[match.end() :]
    authority, slash, path = rest.partition("/")
    if ":" in authority and "@" in rest and "@" not in authority:
        # "s3://KEY:SECRET@bucket/..." where the secret contains "/" (AWS
        # secrets may): the user info runs past the first "/". Cut it there.
        authority, slash, path = rest.split("@", 1)[1].partition("/")
    authority = authority.rsplit("@", 1)[-1]
    path, hook, _ = (slash + path).partition("?")
    path = path.split("#", 1)[0]
    if not hook and "?" in authority:
        authority, hook = authority.split("?", 1)[0], "?"
    return f"{match.group(0)}{authority.split('#', 1)[0]}{path}{'?<redacted>' if hook else ''}"


def parse_uri(uri: str | os.PathLike[str]) -> StorageURL:
    """Parse a checkpoint URI or path into a :class:`StorageURL`.

    Raises :class:`InvalidURI` for empty input, embedded NULs, credentials in
    the URI, a query or fragment, or object-store URIs without a bucket.
    """
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise InvalidURI(f"checkpoint URI must be a str or os.PathLike, got {type(uri).__name__}")
    if not uri.strip():
        raise InvalidURI("checkpoint URI is empty")
    if "\x00" in uri:
        raise InvalidURI(f"checkpoint URI {redact(uri)!r} contains a NUL byte")
    match = _SCHEME_RE.match(uri)
    if match is None:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:/", uri):
            raise InvalidURI(f"malformed URI {redact(uri)!r}: expected 'scheme://...'")
        scheme, colon, rest = uri.partition(":")
        if colon and scheme.lower() in _KNOWN_SCHEMES:
            rest = redact(f"{scheme}://{rest}").partition("://")[2]  # no user info, no query
            fix = "file:///abs/path" if scheme.lower() == "file" else f"{scheme}://{rest}"
            raise InvalidURI(
                f"URI '{scheme}:{rest}' is missing '//' after '{scheme}:'; write '{fix}', "
                f"or './{scheme}:{rest}' for a local path that really is named so"
            )
        return StorageURL("file", "", os.path.abspath(os.path.expanduser(uri)), uri)
    scheme = match.group(1).lower()
    try:
        parts = urlsplit(uri)
    except ValueError as e:  # e.g. an unbalanced '[' in the authority
        raise InvalidURI(f"malformed URI {redact(uri)!r}: {e}") from e
    # Bucket and profile names never hold ':'; there it starts "KEY:SECRET@"
    # whose secret contained '/' and so ran into the path.
    if "@" in parts.netloc or (scheme in _OBJECT_SCHEMES and ":" in parts.netloc):
        raise InvalidURI(
            f"URI {redact(uri)!r} embeds credentials; pass them through the "
            "backend's standard sources (environment, profile, config file) instead"
        )
    if parts.query or parts.fragment or uri.endswith(("?", "#")):
        # No backend reads them; dropping them would save to another place
        # than the one written (a key or file name holding '?' or '#').
        what = "a query ('?...')" if "?" in uri.split("#", 1)[0] else "a fragment ('#...')"
        raise InvalidURI(
            f"URI {redact(uri)!r} ends in {what}, which no dcpstore backend reads: a checkpoint URI "
            "names a place, nothing more (a local path holding '?' or '#' is passed as a plain path)"
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidURI(f"file URI {uri!r} names host {parts.netloc!r}; use file:///abs/path")
        if not parts.path:
            raise InvalidURI(f"file URI {uri!r} has no path")
        return StorageURL("file", "", os.path.abspath(parts.path), uri)
    path = parts.path.strip("/")
    if scheme in _OBJECT_SCHEMES and not parts.netloc:
        what = "profile" if scheme == "msc" else "bucket"
        raise InvalidURI(f"URI {redact(uri)!r} has no {what}: expected {scheme}://{what}/path")
    return StorageURL(scheme, parts.netloc, path, uri)


def join_uri(base: str, *names: str) -> str:
    """Join path components onto a checkpoint URI (or local path).

    Components must be plain names: ``..``, empty names and absolute paths
    are refused so that a name can never escape ``base``.
    """
    for name in names:
        if not name or name in (".", "..") or name.startswith("/") or "\x00" in name:
            raise InvalidURI(f"invalid path component {name!r} under {redact(base)!r}")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise InvalidURI(f"path component {name!r} under {redact(base)!r} may not contain '..' or empty parts")
    url = parse_uri(base)
    if url.scheme == "file":
        return os.path.join(url.path, *names)
    return "/".join([url.uri.rstrip("/"), *names])
