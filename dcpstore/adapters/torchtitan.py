"""torchtitan's ``CheckpointManager`` on dcpstore: one call, :func:`install`.

torchtitan 0.3.0 leaves the DCP writer to DCP (``storage_writer=None``,
``dcp_load(..., checkpoint_id=...)``) and finds, checks and purges its
``step-N`` directories through ``os`` or fsspec. On S3, fsspec's listing
cache never sees objects another client (dcpstore's boto3) wrote, so in one
process a resume misses steps and ``keep_latest_k`` stops deleting.
:func:`install` puts dcpstore beneath one manager::

    from dcpstore.adapters import torchtitan as dcpstore_titan

    trainer = Trainer(config)                       # builds trainer.checkpointer
    dcpstore_titan.install(trainer.checkpointer)    # before the first load or save
    trainer.train()

What changes on that one object (instance attributes shadowing its
methods; the class, the other managers and torchtitan's modules are left
alone, and :meth:`Installed.uninstall` restores it):

``dcp_save``
    every DCP save -- each ``async_mode`` (``disabled``, ``async``,
    ``async_with_pinned_mem``, whose process executor and stager stay
    torchtitan's) and the final model-only export -- through one
    :class:`dcpstore.StorageWriter` (commit protocol, checksums, overwrite
    safety). The Hugging Face export (``last_save_in_hf``) through
    :class:`dcpstore.SafetensorsWriter`, FSDP's shards consolidated into
    the model's files on the same storage.
``dcp_load``
    through :class:`dcpstore.StorageReader` (checksums verified, nothing in
    the checkpoint executed); ``initial_load_in_hf`` of an export dcpstore
    wrote through :class:`dcpstore.SafetensorsReader`. Other Hugging Face
    weights (a hub download, quantized) stay torchtitan's.
``_find_load_step``, ``_load``
    which steps exist comes from one listing of the folder through
    dcpstore's storage (:mod:`dcpstore._impl.manager.steps`): ``step-N`` exists once
    ``step-N/.metadata`` is listed. Rank 0 lists and broadcasts, so every
    rank resumes the same step. ``load_step=N`` of a step that is not
    committed raises :class:`~dcpstore.CheckpointNotFound` (a
    ``FileNotFoundError``, as torchtitan raises). With no committed step,
    torchtitan's own initial-load logic runs unchanged.
``_purge_stale_checkpoints``, ``_wait_for_saving``
    ``keep_latest_k`` counts *committed* steps (torchtitan counts every
    ``step-N`` directory, the save in flight included): the newest ``k``
    are kept, older ones are deleted ``.metadata`` first through dcpstore's
    storage on torchtitan's purge thread (restarted with dcpstore's
    deleter). Retention runs where torchtitan runs it (after a save is
    dispatched) and again once an async save has committed
    (``maybe_wait_for_saving``), so a finished run keeps exactly ``k``.
    Uncommitted directories (an interrupted save) are left to
    ``dcpstore gc``.
``_close``
    torchtitan's, then the storage this module opened is closed.

Needs torchtitan itself (the ``torchtitan`` extra).
"""

from __future__ import annotations

from dcpstore._impl.adapters.torchtitan import (
    PATCHED,
    TORCHTITAN,
    Installed,
    install,
    parse_step,
)

__all__ = [
    "Installed",
    "PATCHED",
    "TORCHTITAN",
    "install",
    "parse_step",
]
