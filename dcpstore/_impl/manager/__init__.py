"""When and how many: step-numbered checkpoints under one root.

Owns :class:`CheckpointManager` (:mod:`.manager`: one save in flight,
retention after a commit, resume from the newest committed step) and the
step layout on any storage root (:mod:`.steps`: names -- dcpstore's
``step_*`` or Megatron-Bridge's ``iter_*`` -- listing, the pointer,
deletion, retention), and where the steps live
(:mod:`.roots`: one root; :mod:`.tiers`: a local tier that saves commit to,
replicated in the background to a durable root).
"""

from dcpstore._impl.manager.manager import CheckpointManager, SavedStep
from dcpstore._impl.manager.steps import (
    BRIDGE,
    DCPSTORE,
    LATEST,
    LAYOUTS,
    STEP_DIGITS,
    STEP_PREFIX,
    StepLayout,
    check_step,
    parse_step_dir,
    step_dir,
)

__all__ = [
    "BRIDGE",
    "DCPSTORE",
    "LATEST",
    "LAYOUTS",
    "STEP_DIGITS",
    "STEP_PREFIX",
    "CheckpointManager",
    "SavedStep",
    "StepLayout",
    "check_step",
    "parse_step_dir",
    "step_dir",
]
