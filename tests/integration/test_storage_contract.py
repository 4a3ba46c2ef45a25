"""The byte-level contract every backend honours (one suite, all backends):
dcpstore.storage.testing's suite, run on each target of tests/support/backends.py
and on the user-written backend of tests/support/user_backend.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import dcpstore
from dcpstore._impl.storage import backend_registry as registry
from dcpstore.storage import Storage, register_backend
from dcpstore.storage.testing import StorageContract
from tests.support.backends import Target
from tests.support.user_backend import ROOT_VARIABLE, MirrorStorage


class TestEveryBackend(StorageContract):
    @pytest.fixture
    def storage(self, target: Target) -> Iterator[Storage]:
        st = dcpstore.open_storage(target.uri, **target.kwargs)
        st.makedirs()
        yield st
        st.close()


class TestUserBackend(StorageContract):
    """A backend registered as a user registers one (``mirror://``)."""

    @pytest.fixture
    def storage(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Storage]:
        monkeypatch.setattr(registry, "_REGISTERED", {})
        monkeypatch.setattr(registry, "_CLASSES", {})
        monkeypatch.setenv(ROOT_VARIABLE, str(tmp_path / "mirror-root"))
        register_backend("mirror", MirrorStorage)
        st = dcpstore.open_storage("mirror://bucket/ckpt")
        assert isinstance(st, MirrorStorage)
        st.makedirs()
        yield st
        st.close()
