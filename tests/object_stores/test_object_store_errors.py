"""Object-store errors name their cause; credentials never leak.

Bad credentials are checked against a second moto server with authentication
switched on (``INITIAL_NO_AUTH_ACTION_COUNT``): its first few requests create
the buckets and an IAM user with an access key but no permissions; after that
every request is authenticated, so an unknown key id, a wrong secret and a
valid key without permission each get S3's real error code.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest
import torch

import dcpstore
from dcpstore._impl.cli import main as cli_main
from dcpstore.storage import open_storage
from tests.support.backends import OBJECT_STORE_OPTIONS
from tests.support.s3_server import FAKE_KEY_ID, FAKE_SECRET, REGION, MotoServer, S3Endpoint, apply_env, aws_env

MISSING_BUCKET = "dcpstore-no-such-bucket"
BACKENDS = {"s3": {}, "s3+msc": {"enable_msc": True}}

UNKNOWN_KEY_ID = "AKIADCPSTOREUNKNOWN7"
LEAK_SECRETS = ("dcpstore/unknown+KEY/secret-0002", "dcpstore/wrong+SECRET/secret-0003")


@dataclass(frozen=True)
class AuthServer:
    server: MotoServer
    key_id: str
    secret: str


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    cases = ("unknown-key", "wrong-secret", "no-permission")
    # 3 buckets + create_user + create_access_key run unauthenticated.
    server = MotoServer(tmp_path_factory.mktemp("moto-auth"), env={"INITIAL_NO_AUTH_ACTION_COUNT": "5"}).start()
    try:
        s3 = server.client()
        for case in cases:
            s3.create_bucket(Bucket=f"auth-{case}")
        iam = boto3.session.Session().client(
            "iam",
            endpoint_url=server.url,
            region_name=REGION,
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
        )
        iam.create_user(UserName="dcpstore-nobody")
        key = iam.create_access_key(UserName="dcpstore-nobody")["AccessKey"]
        yield AuthServer(server, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()


def _all_text(exc: BaseException) -> str:
    """The exception with its whole cause chain, as a traceback prints it."""
    return "".join(traceback.format_exception(exc))


def _assert_no_leak(texts: list[str], secrets: list[str], key_ids: list[str]) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text
        for key_id in key_ids:
            assert key_id not in text


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("unknown-key", "InvalidAccessKeyId"),
        ("wrong-secret", "SignatureDoesNotMatch"),
        ("no-permission", "AccessDenied"),
    ],
)
def test_bad_credentials_say_so_and_never_leak(
    auth_server: AuthServer,
    backend: str,
    case: str,
    expect: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key_id, secret = {
        "unknown-key": (UNKNOWN_KEY_ID, LEAK_SECRETS[0]),
        "wrong-secret": (auth_server.key_id, LEAK_SECRETS[1]),
        "no-permission": (auth_server.key_id, auth_server.secret),
    }[case]
    apply_env(monkeypatch, aws_env(auth_server.server.url))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    # One bucket per case: MSC caches its implicit profile (and credentials) per bucket.
    uri = f"s3://auth-{case}/ckpt"
    kwargs = BACKENDS[backend]
    caplog.set_level(logging.DEBUG)  # every logger, botocore's wire logs included
    with pytest.raises(dcpstore.SaveError) as saved:
        dcpstore.save({"w": torch.ones(4)}, uri, storage_options=OBJECT_STORE_OPTIONS, **kwargs)
    with pytest.raises(dcpstore.StoragePermissionError) as read:
        open_storage(uri, storage_options=OBJECT_STORE_OPTIONS, **kwargs).read(".metadata")
    assert isinstance(read.value, PermissionError)
    for exc in (saved.value, read.value):
        assert uri in str(exc)
        assert "credentials" in str(exc) and expect in str(exc)
    secrets = [secret, auth_server.secret, *LEAK_SECRETS]
    texts = [_all_text(saved.value), _all_text(read.value)]
    _assert_no_leak(texts, secrets, [key_id, auth_server.key_id])
    # Logs: no secret anywhere, even at DEBUG. The access key *id* is in
    # botocore's own DEBUG wire logs (the Authorization header, by AWS's
    # design); it must not be in ours, MSC's, or anything at INFO and above.
    _assert_no_leak([r.getMessage() for r in caplog.records], secrets, [])
    ours = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.INFO or r.name.startswith(("dcpstore", "multistorageclient"))
    ]
    _assert_no_leak(ours, secrets, [key_id, auth_server.key_id])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_missing_bucket_is_named(backend: str, s3_endpoint: S3Endpoint) -> None:
    uri = f"s3://{MISSING_BUCKET}/ckpt"
    kwargs = BACKENDS[backend]
    with pytest.raises(dcpstore.SaveError, match=f"bucket '{MISSING_BUCKET}' does not exist"):
        dcpstore.save({"w": torch.ones(4)}, uri, **kwargs)
    with pytest.raises(dcpstore.StorageNotFound, match=f"bucket '{MISSING_BUCKET}' does not exist"):
        open_storage(uri, **kwargs).read(".metadata")
    with pytest.raises(dcpstore.StorageNotFound, match=f"bucket '{MISSING_BUCKET}' does not exist"):
        list(open_storage(uri, **kwargs).list())
    with pytest.raises(dcpstore.CheckpointNotFound) as info:
        dcpstore.load({"w": torch.zeros(4)}, uri, **kwargs)
    assert MISSING_BUCKET in str(info.value)
    assert f"bucket '{MISSING_BUCKET}' does not exist" in _all_text(info.value)


def test_no_credentials_at_all(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(dcpstore.StoragePermissionError, match="no usable AWS credentials"):
        open_storage(f"s3://{s3_endpoint.bucket}/x").read("y")


def test_fsspec_scheme_without_its_package_names_it() -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(dcpstore.BackendUnavailable, match="gcsfs"):
        open_storage("gs://some-bucket/ckpt")


def test_an_fsspec_filesystem_that_cannot_start_is_named_with_the_uri() -> None:
    """A filesystem whose constructor fails with an OSError (hdfs:// without
    a JVM: pyarrow lists every path it tried, one per line): one line
    naming the URI and the first line of the cause."""
    fsspec = pytest.importorskip("fsspec")

    class NoJvm(fsspec.AbstractFileSystem):
        protocol = "dcpstore-nojvm"

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise OSError("Unable to load libjvm\ndlopen(/usr/lib/jvm/libjvm.so) failed")

    fsspec.register_implementation("dcpstore-nojvm", NoJvm, clobber=True)
    with pytest.raises(dcpstore.StorageError) as info:
        open_storage("dcpstore-nojvm://x/ckpt")
    assert str(info.value) == "fsspec cannot open dcpstore-nojvm://x/ckpt: OSError: Unable to load libjvm"


def test_unknown_scheme_is_named_with_enable_msc() -> None:
    with pytest.raises(dcpstore.InvalidURI, match="'nosuchscheme'"):
        dcpstore.save({"w": torch.ones(1)}, "nosuchscheme://x/y", enable_msc=True)


def test_unknown_msc_profile_is_named(msc_config: str) -> None:
    with pytest.raises(dcpstore.InvalidURI, match="no-such-profile"):
        open_storage("msc://no-such-profile/x")


def test_cli_output_has_no_credentials(s3_endpoint: S3Endpoint, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_endpoint.bucket}/cli-secrets"
    dcpstore.save({"w": torch.ones(3)}, uri).result()
    for command in (["inspect", uri], ["ls", uri], ["verify", "-q", uri], ["inspect", f"s3://{MISSING_BUCKET}/x"]):
        cli_main(command)
    out = capsys.readouterr()
    assert "w" in out.out and "dcpstore inspect" in out.err  # it did print, and the last one failed
    _assert_no_leak([out.out, out.err], [FAKE_SECRET], [FAKE_KEY_ID])
