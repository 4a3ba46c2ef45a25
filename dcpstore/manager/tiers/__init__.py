"""Tiered checkpoints: a local tier that saves commit to, replicated in the
background to the durable root (:class:`~.tiered.TieredRoots`, a
:class:`~dcpstore.manager.roots.Roots`); the replication's commit protocol
(:mod:`.replicate`), how ranks share ``local_dir`` (:mod:`.nodes`) and the
leases the tiers hold (:mod:`.leases`). The manager uses it only for a
manager made with ``local_dir=``.
"""

from .tiered import REPLICATE_TIMEOUT_S, TieredRoots, check_tier_options

__all__ = ["REPLICATE_TIMEOUT_S", "TieredRoots", "check_tier_options"]
