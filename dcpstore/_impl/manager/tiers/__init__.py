"""Tiered checkpoints: commit to a local directory at disk speed, replicate
to the durable root in the background, resume from the nearest good copy.

Layout: the same step directories in both tiers::

    local_dir/step_00000100/...    committed by the save itself (its handle
                                   completes here)
    root_uri/step_00000100/...     the replica: data files, manifest,
                                   .metadata last (:mod:`.replicate`)

Which rank does what (every rank constructs the manager alike):

* **Saving**: every rank saves to ``local_dir/step_N`` through the ordinary
  save path (same layout and commit protocol as any dcpstore checkpoint).
  When its save commits, each rank queues the step on its own replicator
  thread, which uploads the data files *this rank* wrote; the coordinator
  commits the replica once every file arrived (:mod:`.replicate`). Steps are
  replicated one at a time, in the order they were committed.
  ``replicate_every=N``: only steps divisible by N are replicated (``step %
  N == 0``: the same choice on every rank and after a restart).
* **Retention** (coordinator, on the replicator thread, after each step):
  the durable tier keeps the ``keep`` newest committed steps (as a plain
  manager does); the local tier the ``local_keep`` newest committed, but a
  local step that still needs replicating is never deleted (one replication
  failed: it stays until a later manager replicates it).
* **Overwrites**: saving a step again (``overwrite=True``) never loses its
  durable copy: the new replica commits over it as an overwrite save does
  (save-unique names, ``.metadata`` last, then the old files go; see
  :meth:`~.tiered.TieredRoots.before_save` and :mod:`.replicate`).
* **Catch-up**: a new manager's coordinator queues the committed local steps
  that need replicating (selected; missing from the durable tier and not
  older than the durable tier's ``keep`` newest, or there as an older
  commit: an overwrite whose replication did not finish), so that a crash
  during replication loses nothing that was committed locally (from its
  whole local copy: every file the manifest names). Local retention keeps
  such steps too.
* **One directory, or one per node** (:mod:`.nodes`; found when the
  manager is made, a collective then; each is a strategy,
  :class:`~.local_tier.SharedDir` and :class:`~.nodes.NodeDirs`). Node-local: each node holds the
  files its ranks wrote; its leader puts the in-flight marker with the
  manager's save id there before each save and commits the coordinator's
  manifest and ``.metadata`` (broadcast on the replicator's own gloo group:
  every rank's replicator handles the same jobs in the same order, so those
  collectives pair up) after it, and applies local retention there.
  Catch-up broadcasts the coordinator's commits when the manager is made;
  each leader uploads what its node holds of them (a step no node holds
  whole stays local, logged).
* **Peer copies** (:mod:`.peers`, ``local_replicas=N``, node-local only):
  after each save each node's share is also committed in N-1 other nodes'
  ``local_dir/peers/node_<i>/``; a new manager first writes a lost
  node's share back from a peer's copy (where none holds it, from the
  durable tier: that node's files only), and remakes the missing copies
  on the replicator.
* **Loading** (collective): the step is the newest committed one in either
  tier (every rank holds a local commit of it, or the durable tier does);
  it is read from the local tier if every rank's local copy holds what it
  reads (one directory: a *whole* copy, every file the manifest names at its
  size; node-local: the files this rank's load plan reads, at their sizes;
  DCP puts a replicated item in one rank's file only, so a load that
  reshards or reads such an item from another node reads the durable
  copy), else by every rank from the durable tier; a step neither serves
  (a lost node, not yet replicated) gives way to the next older one. A fresh
  node with an empty ``local_dir`` thus resumes from the durable tier; DCP
  resharding works from either, since every rank reads one whole checkpoint.
* **gc**: every writer of a step directory holds a lease there
  (:mod:`.kept_leases`), so ``dcpstore gc`` on either tier never takes a step
  in progress.
* **Errors**: a failed replication is logged when it happens and raised
  from the next ``wait()`` or ``close()``; saves keep committing locally.
  ``close()`` waits for the queue at most ``replicate_timeout_s``.

The modules: :mod:`.tiered` (:class:`~.tiered.TieredRoots`, the manager's
:class:`~dcpstore._impl.manager.roots.Roots` with ``local_dir=``: the replicator,
retention, loads), :mod:`.local_tier` (the :class:`~.local_tier.LocalTier` strategy
and :class:`~.local_tier.SharedDir`), :mod:`.nodes` (:class:`~.nodes.NodeDirs`
and the node detection), :mod:`.peers` (the copies kept on peer nodes), :mod:`.replicate` (copying a step, its commit by
the commit protocol) and :mod:`.kept_leases` (the leases the tiers hold).
"""

from dcpstore._impl.manager.roots import REPLICATE_TIMEOUT_S
from dcpstore._impl.manager.tiers.tiered import TieredRoots, check_tier_options

__all__ = ["REPLICATE_TIMEOUT_S", "TieredRoots", "check_tier_options"]
