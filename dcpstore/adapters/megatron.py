"""Megatron and Megatron-Bridge beneath dcpstore.

- :class:`BridgeCheckpointManager`: Bridge 0.6.2's ``CheckpointManager``
  protocol over dcpstore, enabled by one config field,
  ``checkpoint.custom_manager_class`` (:mod:`dcpstore._impl.adapters.megatron_manager`
  says what each call does).
- :class:`CheckpointConfig`: Bridge's checkpoint fields under their names,
  mapped onto dcpstore's options and :class:`~dcpstore.CheckpointManager`
  (:mod:`dcpstore._impl.adapters.megatron_config`).
- :class:`FileSystemWriterAsync`: the drop-in for NVRx's writer of Bridge's
  async ``fsdp_dtensor`` saves, and :func:`install_in_bridge`, which puts it,
  dcpstore's sync writer and its reader beneath Bridge's checkpointing module.
- Megatron's state-dict formats (:data:`FORMATS`: ``torch_dist``,
  ``fsdp_dtensor``).
"""

from __future__ import annotations

from dcpstore._impl.adapters.megatron_async import FileSystemWriterAsync
from dcpstore._impl.adapters.megatron_bridge import BRIDGE_HOOKS, install_in_bridge, megatron_msc_enabled
from dcpstore._impl.adapters.megatron_config import (
    BRIDGE_FIELDS,
    DCPSTORE_FIELDS,
    CheckpointConfig,
    plan_caching_supported,
)
from dcpstore._impl.adapters.megatron_formats import DEFAULT_FORMAT, FORMATS, StateDictFormat, check_format
from dcpstore._impl.adapters.megatron_manager import BridgeCheckpointManager

__all__ = [
    "BRIDGE_FIELDS",
    "BRIDGE_HOOKS",
    "DCPSTORE_FIELDS",
    "DEFAULT_FORMAT",
    "FORMATS",
    "BridgeCheckpointManager",
    "CheckpointConfig",
    "FileSystemWriterAsync",
    "StateDictFormat",
    "check_format",
    "install_in_bridge",
    "megatron_msc_enabled",
    "plan_caching_supported",
]
