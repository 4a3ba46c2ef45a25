"""Lightning's ``ModelParallelStrategy`` (FSDP2) sharded checkpoints on
dcpstore: one call, :func:`install`.

Lightning 2.6 saves a sharded checkpoint with ``dcp_save(state,
checkpoint_id=path)`` (its writer left to DCP, its ``storage_options``
refused) and then, on rank 0, ``torch.save(metadata, path / "meta.pt")``:
after DCP's commit and outside it, so a crash between the two leaves a
checkpoint whose ``meta.pt`` (epoch, step, loops, callbacks, the user's
extra state) is missing or belongs to the previous save. :func:`install`
puts dcpstore beneath one strategy object, Fabric's or the Trainer's::

    from dcpstore.adapters import lightning as dcpstore_lightning

    strategy = ModelParallelStrategy(parallelize_fn)     # lightning.fabric or lightning.pytorch
    dcpstore_lightning.install(strategy)                  # before the first save or load
    fabric = Fabric(strategy=strategy, ...)               # or Trainer(strategy=strategy, ...)

Paths may then be local or any URI dcpstore serves
(``fabric.save("s3://bucket/run/step-100", state)``,
``ModelCheckpoint(dirpath="s3://bucket/run")``,
``trainer.fit(model, ckpt_path="s3://bucket/run/epoch=0-step=4.ckpt")``).

What changes on that one object (instance attributes shadowing its
methods; the class and Lightning's modules are untouched, and
:meth:`Installed.uninstall` restores it):

``save_checkpoint``
    a sharded save (``save_distributed_checkpoint=True``, the default) is one
    ``dcp.save`` through :class:`dcpstore.StorageWriter` whose commit
    carries ``meta.pt``: written after every rank's data and before
    ``.metadata``, recorded with its CRC32C in the manifest, so the
    checkpoint appears with its ``meta.pt`` or not at all, and saving over
    one never pairs its shards with another save's ``meta.pt``
    (:mod:`dcpstore._impl.dcp.commit`). The layout stays Lightning's: stock
    Lightning loads it (and dcpstore loads stock Lightning's).
``load_checkpoint``
    a sharded checkpoint loads through :class:`dcpstore.StorageReader`
    (checksums verified), ``meta.pt`` the copy the commit records, checked
    against its CRC32C, then ``torch.load(..., weights_only=...)`` as
    Lightning does.
``remove_checkpoint`` (Trainer)
    ``ModelCheckpoint``'s rotation deletes a sharded checkpoint through
    dcpstore's storage, ``.metadata`` first (on S3 a fresh listing, where
    fsspec's cache may not see dcpstore's objects), then its temporary
    files and open multipart uploads, and, on a local filesystem, its
    directory: nothing of it is left, as with stock Lightning, so its name
    is free again.

Left to Lightning: full-state checkpoints (``save_distributed_checkpoint=False``,
a single ``torch.save`` file), ``load_raw``, and ``ModelCheckpoint``'s own
probes (``-v1`` version suffixes, ``ckpt_path="last"``, ``best_k_models.yaml``),
which go through fsspec.

Lightning itself is not imported: a strategy is recognised by its class
(either package layout: ``lightning`` or ``lightning_fabric`` /
``pytorch_lightning``).
"""

from __future__ import annotations

from dcpstore._impl.adapters.lightning import (
    FLAVOURS,
    META,
    PATCHED,
    Installed,
    flavour,
    install,
)

__all__ = [
    "FLAVOURS",
    "Installed",
    "META",
    "PATCHED",
    "flavour",
    "install",
]
