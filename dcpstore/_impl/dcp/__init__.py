"""The DCP protocol: dcpstore's ``StorageWriter`` and ``StorageReader``.

Owns how a DCP save and load run over a :class:`~dcpstore.storage.Storage`:
the commit protocol (:mod:`.commit`: every commit anyone writes, reads,
publishes or removes -- one :class:`~.commit.session.SaveSession` per save,
used by every writer, what counts as a committed checkpoint, the replicas
and node copies of a commit, markers, alive files, leftovers), the writer
(:mod:`.writer`), the reader (:mod:`.reader`) with its pure read planning
(:mod:`.read_plan`), the item checks it shares with ``verify``
(:mod:`.item_checks`) and its record of what a failed load changed
(:mod:`.load_progress`), what a state dict may hold for a save or a load
(:mod:`.state_checks`), and the one failure summariser (:mod:`.failures`).
Nothing here decides *when* a save runs (that is :mod:`dcpstore._impl.engines`)
or knows a backend by name.
"""
