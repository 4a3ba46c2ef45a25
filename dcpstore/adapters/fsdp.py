"""FSDP2 (``fully_shard``) model + optimizer state through dcpstore.

Thin over :func:`dcpstore.save` / :func:`dcpstore.load` and torch's
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``), which know how FSDP2, DDP and plain modules lay out
their parameters and optimizer state.

What is saved is one dict::

    {"model": {fqn: tensor}, "optimizer": {"state.<fqn>.exp_avg": ..., "param_groups.<fqn>.lr": ...}, **extra}

The optimizer half is torch's *flattened* optimizer state dict (every entry
keyed by parameter FQN), so it reshards per key and a partial load can name
exactly which entries it lacks.

Formats (:data:`FORMATS`, defined with Megatron's ``torch_dist`` format in
:mod:`dcpstore._impl.adapters.megatron_formats`; the Megatron config validates ``ckpt_format`` against the
same table): ``fsdp_dtensor`` hands DCP FSDP2's own DTensor shards
(``full_state_dict=False``; the default), ``torch_dist`` hands it torch
``ShardedTensor`` objects over the same local storage, as Megatron's ``torch_dist``
strategy does.
On storage the two are identical -- stock DCP chunked tensors with global
shapes and offsets -- so either loads into the other, on any world size.

``full_state_dict=True`` saves gathered full tensors instead of shards
(plain tensors; with ``cpu_offload=True`` only rank 0 holds and writes
them). A full-state *load* reads full tensors on every rank and keeps each
rank's shard: DCP reads directly from storage, so torch's rank-0 read and
broadcast would only add traffic (and it hangs on gloo in torch 2.13).
``cpu_offload=True`` keeps what DCP reads or writes in host memory.

Load, on every rank (collective)::

    template = get_state_dict(model, optimizer)     # shaped like *this* run
    report   = keys/shapes of template vs the checkpoint's .metadata
    strict and report not ok -> StateDictMismatch, nothing loaded
    dcpstore.load(the entries present, uri)          # in place, resharding
    set_state_dict(model, optimizer, template)       # absent entries keep their values
"""

from __future__ import annotations

from dcpstore._impl.adapters.fsdp import (
    MODEL,
    OPTIMIZER,
    SECTIONS,
    KeyMismatch,
    LoadReport,
    Optimizers,
    compare_keys,
    get_app_state,
    load_app_state,
    save_app_state,
    set_app_state,
)

__all__ = [
    "KeyMismatch",
    "LoadReport",
    "MODEL",
    "OPTIMIZER",
    "Optimizers",
    "SECTIONS",
    "compare_keys",
    "get_app_state",
    "load_app_state",
    "save_app_state",
    "set_app_state",
]
