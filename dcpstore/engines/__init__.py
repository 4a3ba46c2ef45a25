"""When a save runs: async saves, the engines, and the exit hook.

Owns everything about *when*: staging a consistent host snapshot
(:mod:`.staging`), the background saver (:mod:`.saver`: one thread, bounded
in-flight saves, the per-process default saver) and its dedicated background
process groups (:mod:`.groups`), the choice of engine (:mod:`.choice`), the
NVRx engine (:mod:`.nvrx`; all that depends on the NVRx release in
:mod:`.nvrx_release`, its write streams in :mod:`.nvrx_stream`; the native
engine is DCP's own save with dcpstore's writer,
:func:`dcpstore.dcp.writer.save_state_dict`), and the one interpreter-exit
hook (:mod:`.exit`).

Layer: engines. May import :mod:`dcpstore.dcp`, :mod:`dcpstore.format`, the
value objects, :mod:`dcpstore.storage` and the foundation; nothing above.
"""
