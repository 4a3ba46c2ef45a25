"""The bad-input matrix: every case raises a dcpstore Exception subclass that
names the argument or URI and the cause (never a bare KeyError, never a
BaseException, never a secret). Object-store cases (missing bucket, bad
credentials) live with the S3 suite."""

from __future__ import annotations

import logging
import os
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore import tools
from dcpstore._impl.storage import join_uri, parse_uri, redact


def _save(uri: str, state=None, **kwargs):
    return dcpstore.save(state if state is not None else {"a": torch.ones(2)}, uri, **kwargs)


# (case id, callable(tmp_path), expected exception, text the message must contain)
CASES = [
    ("empty-uri", lambda p: _save(""), dcpstore.InvalidURI, "empty"),
    ("blank-uri", lambda p: _save("  "), dcpstore.InvalidURI, "empty"),
    ("nul-in-uri", lambda p: _save(f"{p}/a\x00b"), dcpstore.InvalidURI, "NUL"),
    ("s3-no-bucket", lambda p: _save("s3:///key"), dcpstore.InvalidURI, "bucket"),
    ("s3-bare", lambda p: _save("s3://"), dcpstore.InvalidURI, "bucket"),
    ("msc-no-profile", lambda p: _save("msc:///x"), dcpstore.InvalidURI, "profile"),
    ("single-slash-scheme", lambda p: _save("s3:/bucket/x"), dcpstore.InvalidURI, "malformed"),
    ("unknown-scheme", lambda p: _save("zzz://a/b"), dcpstore.InvalidURI, "'zzz'"),
    ("file-uri-with-host", lambda p: _save("file://otherhost/x"), dcpstore.InvalidURI, "otherhost"),
    ("uri-not-a-string", lambda p: _save(42), dcpstore.InvalidURI, "int"),
    ("credentials-in-uri", lambda p: _save("s3://AKIAX:s3cr3t@b/k"), dcpstore.InvalidURI, "credentials"),
    ("state-not-dict", lambda p: dcpstore.save([1], f"{p}/x"), dcpstore.InvalidArgument, "state_dict"),
    ("load-state-not-dict", lambda p: dcpstore.load(None, f"{p}/x"), dcpstore.InvalidArgument, "state_dict"),
    ("workers-zero", lambda p: _save(f"{p}/x", workers=0), dcpstore.InvalidArgument, "workers"),
    ("workers-negative", lambda p: _save(f"{p}/x", workers=-3), dcpstore.InvalidArgument, "workers"),
    ("workers-float", lambda p: _save(f"{p}/x", workers=2.5), dcpstore.InvalidArgument, "workers"),
    ("workers-str", lambda p: _save(f"{p}/x", workers="8"), dcpstore.InvalidArgument, "workers"),
    ("workers-bool", lambda p: _save(f"{p}/x", workers=True), dcpstore.InvalidArgument, "workers"),
    ("load-workers-zero", lambda p: dcpstore.load({}, f"{p}/x", workers=0), dcpstore.InvalidArgument, "workers"),
    ("engine-unknown", lambda p: _save(f"{p}/x", engine="fast"), dcpstore.InvalidArgument, "engine"),
    (
        "process-group-without-dist",
        lambda p: _save(f"{p}/x", process_group=object()),
        dcpstore.InvalidArgument,
        "process_group",
    ),
    ("part-size-too-small", lambda p: dcpstore.StorageOptions(part_size=1024), dcpstore.InvalidArgument, "part_size"),
    (
        "concurrency-zero",
        lambda p: dcpstore.StorageOptions(max_concurrency=0),
        dcpstore.InvalidArgument,
        "max_concurrency",
    ),
    ("timeout-negative", lambda p: dcpstore.StorageOptions(op_timeout_s=-1), dcpstore.InvalidArgument, "op_timeout_s"),
    ("unpicklable-value", lambda p: _save(f"{p}/x", {"fn": lambda: 1}), dcpstore.SaveError, "'fn'"),
    ("meta-tensor", lambda p: _save(f"{p}/x", {"m": torch.empty(3, device="meta")}), dcpstore.InvalidArgument, "'m'"),
    ("sparse-tensor", lambda p: _save(f"{p}/x", {"s": torch.eye(3).to_sparse()}), dcpstore.InvalidArgument, "'s'"),
    # A view whose logical size no machine can hold (2**62 bytes over a 4-byte storage).
    ("huge-view", lambda p: _save(f"{p}/x", {"h": torch.zeros(1).expand(2**60)}), dcpstore.SaveError, "'h'"),
    (
        "huge-view-async",
        lambda p: _save(f"{p}/x", {"h": torch.zeros(1).expand(2**60)}, async_=True, engine="native"),
        dcpstore.SaveError,
        "'h'",
    ),
    ("path-is-a-file", lambda p: (open(f"{p}/f", "w").close(), _save(f"{p}/f")), dcpstore.SaveError, "is a file"),
    (
        "parent-is-a-file",
        lambda p: (open(f"{p}/g", "w").close(), _save(f"{p}/g/ck")),
        dcpstore.SaveError,
        "not a directory",
    ),
    ("name-too-long", lambda p: _save(f"{p}/{'n' * 300}"), dcpstore.SaveError, "too long"),
    ("unwritable", lambda p: _save("/sys/dcpstore-x"), dcpstore.SaveError, "permission denied"),
    (
        "load-missing",
        lambda p: dcpstore.load({"a": torch.zeros(2)}, f"{p}/none"),
        dcpstore.CheckpointNotFound,
        "no checkpoint",
    ),
    ("file-uri-query", lambda p: _save(f"file://{p}/x?v=1"), dcpstore.InvalidURI, "a query"),
    ("s3-uri-fragment", lambda p: _save("s3://b/x#v1"), dcpstore.InvalidURI, "a fragment"),
    (
        "timeout-infinite",
        lambda p: dcpstore.StorageOptions(connect_timeout_s=float("inf")),
        dcpstore.InvalidArgument,
        "connect_timeout_s",
    ),
    (
        "timeout-nan",
        lambda p: dcpstore.StorageOptions(read_timeout_s=float("nan")),
        dcpstore.InvalidArgument,
        "read_timeout_s",
    ),
    ("planner-not-a-planner", lambda p: _save(f"{p}/x", planner="default"), dcpstore.InvalidArgument, "planner"),
    (
        "planner-a-class",
        lambda p: dcpstore.load({}, f"{p}/x", planner=dcp.DefaultLoadPlanner),
        dcpstore.InvalidArgument,
        "got the class DefaultLoadPlanner",
    ),
    (
        "load-planner-for-save",
        lambda p: _save(f"{p}/x", planner=dcp.DefaultLoadPlanner()),
        dcpstore.InvalidArgument,
        "SavePlanner",
    ),
    (
        "open-storage-options-dict",
        lambda p: dcpstore.open_storage(p, storage_options={}),
        dcpstore.InvalidArgument,
        "storage_options",
    ),
    ("manager-root-none", lambda p: dcpstore.CheckpointManager(None), dcpstore.InvalidURI, "root_uri"),
    (
        "collective-timeout-zero",
        lambda p: dcpstore.AsyncSaver(collective_timeout=0),
        dcpstore.InvalidArgument,
        "collective_timeout",
    ),
    ("hang-timeout-zero", lambda p: dcpstore.AsyncSaver(hang_timeout=0), dcpstore.InvalidArgument, "hang_timeout"),
    ("gc-older-than-nan", lambda p: tools.gc(p, older_than_s=float("nan")), dcpstore.InvalidArgument, "older_than_s"),
    ("gc-older-than-str", lambda p: tools.gc(p, older_than_s="300"), dcpstore.InvalidArgument, "older_than_s"),
    ("join-dotdot", lambda p: join_uri(str(p), ".."), dcpstore.InvalidURI, "'..'"),
    ("join-escape", lambda p: join_uri("s3://b/root", "a/../../etc"), dcpstore.InvalidURI, ".."),
    ("join-absolute", lambda p: join_uri(str(p), "/etc"), dcpstore.InvalidURI, "/etc"),
]


@pytest.mark.parametrize("case,call,exc,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, case, call, exc, needle) -> None:
    with pytest.raises(exc) as info:
        call(str(tmp_path))
    assert isinstance(info.value, dcpstore.CheckpointError) and isinstance(info.value, Exception)
    assert needle in str(info.value), f"{case}: {info.value}"


def test_matrix_size() -> None:
    assert len(CASES) >= 30


def test_missing_key_on_load_is_named(tmp_path) -> None:
    _save(str(tmp_path / "ck"))
    with pytest.raises(dcpstore.LoadError, match="not_saved"):
        dcpstore.load({"not_saved": torch.zeros(2)}, str(tmp_path / "ck"))


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzSECRET"
#: (case, call(tmp_path, bucket), the error it must raise). A URI's query is
#: refused before any storage is opened, its text redacted in the message.
SECRET_CASES = [
    ("credentials-in-uri", lambda p, b: _save(f"s3://AKIAFAKEKEY:{SECRET}@{b}/x"), dcpstore.InvalidURI),
    (
        "signed-query-load",
        lambda p, b: dcpstore.load({"a": torch.zeros(2)}, f"s3://{b}/none?X-Amz-Signature={SECRET}"),
        dcpstore.InvalidURI,
    ),
    (
        "signed-query-no-bucket",
        lambda p, b: _save(f"s3://dcpstore-no-such-bucket/x?X-Amz-Signature={SECRET}"),
        dcpstore.InvalidURI,
    ),
    (
        "signed-query-msc",
        lambda p, b: dcpstore.load({"a": torch.zeros(2)}, f"s3://{b}/none?sig={SECRET}", enable_msc=True),
        dcpstore.InvalidURI,
    ),
    (
        "file-uri-query",
        lambda p, b: dcpstore.load({"a": torch.zeros(2)}, f"file://{p}/none?sig={SECRET}"),
        dcpstore.InvalidURI,
    ),
    ("unknown-scheme-query", lambda p, b: _save(f"zzz://{b}/x?X-Amz-Signature={SECRET}"), dcpstore.InvalidURI),
]


def test_a_bucket_name_botocore_refuses_is_named_at_once(s3_endpoint) -> None:
    """botocore refuses the name before sending anything: its reason, not
    "retries exhausted"."""
    with pytest.raises(dcpstore.InvalidURI, match=r"s3://my bucket/x/.metadata: .*Invalid bucket name \"my bucket\""):
        dcpstore.load({"a": torch.zeros(2)}, "s3://my bucket/x")


def _chain_text(exc: BaseException) -> str:
    """Every exception of the cause/context chain: type, message and args
    (not the traceback's source lines, which quote this file)."""
    texts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        texts += ["".join(traceback.format_exception_only(cur)), repr(cur.args)]
        cur = cur.__cause__ or cur.__context__
    return "\n".join(texts)


@pytest.mark.parametrize("case,call,exc", SECRET_CASES, ids=[c[0] for c in SECRET_CASES])
def test_secrets_never_logged_or_raised(tmp_path, caplog, s3_endpoint, case, call, exc) -> None:
    """The secret is in no exception of the chain (message, cause, traceback
    text) and in no log record, at DEBUG, of any logger."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(exc) as info:
        call(str(tmp_path), s3_endpoint.bucket)
    chain = _chain_text(info.value)
    assert SECRET not in chain and "AKIAFAKEKEY" not in chain, chain
    for record in caplog.records:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        assert SECRET not in text and "AKIAFAKEKEY" not in text, text
    assert SECRET not in caplog.text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_parse_uri_never_crashes(text: str) -> None:
    """Any string parses to a URL or raises InvalidURI; nothing else."""
    try:
        url = parse_uri(text)
    except dcpstore.InvalidURI:
        return
    assert url.scheme and (url.scheme != "file" or os.path.isabs(url.path))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "/", "c/d"]), min_size=1, max_size=4).map("/".join))
def test_join_uri_never_escapes(name: str) -> None:
    try:
        joined = join_uri("s3://bucket/root", name)
    except dcpstore.InvalidURI:
        return
    assert joined.startswith("s3://bucket/root/") and "/../" not in joined + "/"


@settings(max_examples=200, deadline=None)
@given(
    st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@/?#"), min_size=1, max_size=30
    )
)
def test_redact_hides_userinfo_and_query(secret: str) -> None:
    assert redact(f"s3://user:{secret}@bucket/key") == "s3://bucket/key"
    assert redact(f"s3://bucket/key?sig={secret}") == "s3://bucket/key?<redacted>"
