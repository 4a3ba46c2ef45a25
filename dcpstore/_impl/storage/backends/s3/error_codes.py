"""S3 error codes: the one table of what each means to dcpstore.

Two backends meet S3's answers: the native one (:mod:`.storage`, from botocore's
``ClientError``) and MSC (:mod:`dcpstore._impl.storage.backends.msc`, whose S3 provider re-raises them as
built-ins with the ``ClientError`` in the cause chain, or only as text for
DeleteObjects' per-key errors). Both classify through :func:`meaning`, so one
server answer becomes the same dcpstore exception whichever backend got it;
each backend words the message (an endpoint, or an MSC profile).

Imports nothing of dcpstore's.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping


class Meaning(enum.Enum):
    """What an S3 error tells the caller."""

    NO_BUCKET = "the bucket does not exist"
    NOT_FOUND = "no such object"
    BAD_CREDENTIALS = "the credentials were refused"
    DENIED = "the credentials lack permission"
    #: A range that starts at or past the end of the object: no bytes, not an error.
    PAST_END = "range past the end"
    #: ``If-Match`` failed: the object changed while it was being read.
    CHANGED = "the object changed"
    OTHER = "other"


#: Error code -> meaning. Codes come first: a 404 may be NoSuchBucket or
#: NoSuchKey, a 403 a bad signature or a missing permission.
CODES: Mapping[str, Meaning] = {
    "NoSuchBucket": Meaning.NO_BUCKET,
    **dict.fromkeys(("NoSuchKey", "NotFound", "404", "NoSuchUpload", "NoSuchVersion"), Meaning.NOT_FOUND),
    **dict.fromkeys(
        (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "TokenRefreshRequired",
            "InvalidClientTokenId",
            "AuthorizationHeaderMalformed",
        ),
        Meaning.BAD_CREDENTIALS,
    ),
    **dict.fromkeys(("AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"), Meaning.DENIED),
    "InvalidRange": Meaning.PAST_END,
    "PreconditionFailed": Meaning.CHANGED,
}

#: HTTP status -> meaning, for answers without a code (a HEAD has no body).
STATUSES: Mapping[int, Meaning] = {
    404: Meaning.NOT_FOUND,
    403: Meaning.DENIED,
    416: Meaning.PAST_END,
    412: Meaning.CHANGED,
}

#: The named codes, for finding one in an error's text (``\b``: whole words only).
CODE_IN_TEXT = re.compile(r"\b(" + "|".join(sorted(c for c in CODES if not c.isdigit())) + r")\b")


def meaning(code: str, status: int = 0) -> Meaning:
    """What the S3 error ``code`` (or, without a known code, HTTP ``status``) means."""
    found = CODES.get(code)
    if found is not None:
        return found
    return STATUSES.get(status, Meaning.OTHER)


def code_in_text(text: str) -> str:
    """The first known error code named in ``text``, or ``""``."""
    match = CODE_IN_TEXT.search(text)
    return match.group(0) if match else ""
