"""A backend of a user's own, for ``register_backend``'s tests: ``mirror://NAME/PATH``
lives in the local directory ``$DCPSTORE_TEST_MIRROR_ROOT/NAME/PATH``. At
module level, so that another process (the process engine's checkpoint
process, DCP's process executor) imports it by name."""

from __future__ import annotations

import os

from dcpstore._impl.storage.backends.local import LocalStorage

#: Where every mirror:// URI of this process and its children lives.
ROOT_VARIABLE = "DCPSTORE_TEST_MIRROR_ROOT"


class MirrorStorage(LocalStorage):
    backend = "mirror"

    @property
    def root(self) -> str:
        return os.path.join(os.environ[ROOT_VARIABLE], self.url.netloc, self.url.path)
