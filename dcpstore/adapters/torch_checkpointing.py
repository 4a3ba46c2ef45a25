"""torch_checkpointing 0.1.1 on dcpstore: :class:`DcpstoreStorageConfig`.

torch_checkpointing writes through a ``Storage`` it builds from
``CheckpointManager.Config.storage_config``; this one puts its files on any
dcpstore backend (a local path, ``s3://``, ``msc://``, an fsspec URL)::

    from torch_checkpointing import CheckpointManager
    from dcpstore.adapters.torch_checkpointing import DcpstoreStorageConfig

    manager = CheckpointManager(CheckpointManager.Config(
        storage_config=DcpstoreStorageConfig("s3://bucket/run1"),
    ))
    manager.save("step_100", {"model": model.state_dict()})   # s3://bucket/run1/step_100

Checkpoint ids are relative to the ``uri`` or spelt from it
(``"s3://bucket/run1/step_100"``, or for a local root its absolute path);
one that leaves it (another absolute path, ``..``) is refused naming it.

**The commit.** torch_checkpointing commits a save by writing every rank's
files under ``tmp_<id>``, meeting at a barrier, and then renaming that
folder onto ``<id>`` on rank 0; its contract for ``rename`` refuses an
occupied destination, so saving over a checkpoint raises and keeps it. A
local folder renames atomically; an object store has no rename, and a copy
that dies half way would leave half a checkpoint at ``<id>``. So a folder
is *committed* here exactly when its commit record (``.dcpstore-commit.json``,
every file's size and CRC32C) is in it, and every read checks the file
against it:

* each file is written through dcpstore's atomic writer (an object appears
  whole or not at all), its CRC32C computed from the bytes as they pass,
  and then a small record of size and CRC32C beside it;
* ``rename`` of the staging folder refuses a destination that holds any
  object, gathers the records into the commit record (a file without one
  never finished: the commit is refused), then locally writes it into the
  staging folder and renames the folder (``os.rename``, then an fsync of the
  parent); on an object store it copies each file, checking its CRC32C on
  the way, and writes the commit record *last*;
* a read finds the commit record of the nearest folder above the file that
  has one and checks size and CRC32C of the whole file; a folder without
  one (a copy cut short) reads as corrupt, never as a checkpoint. A file
  written outside the commit (``write_to_temp_dir=False``, a callback's)
  is checked against its own record.

Mapping the commit onto dcpstore's own DCP commit (``.dcpstore.json`` then
``.metadata``) was not done: torch_checkpointing's files are not DCP's
(``.metadata`` there is torch_checkpointing's pickle), so dcpstore's reader
and ``dcpstore verify`` would misread them.

**Costs.** Every read reads its file whole to check it (torch_checkpointing's
offset reads, which a resharding load makes, included), so a load holds one
file at a time in memory per reading thread; on an object store a save is
written twice (the copy) and the staging objects are deleted after the commit.
"""

from __future__ import annotations

from dcpstore._impl.adapters.torch_checkpointing import (
    CHECKSUM_SUFFIX,
    COMMIT_FILE,
    DcpstoreStorage,
    DcpstoreStorageConfig,
)

__all__ = [
    "CHECKSUM_SUFFIX",
    "COMMIT_FILE",
    "DcpstoreStorage",
    "DcpstoreStorageConfig",
]
