"""When a save runs: async saves, the engines, and the exit hook.

Owns everything about *when*: staging a consistent host snapshot
(:mod:`.staging`, its buffers in :mod:`.buffers`, shared memory in
:mod:`.shared_memory`), the background saver (:mod:`.saver`: one thread, bounded
in-flight saves, the per-process default saver), what an engine is (:mod:`.engine`) and
which one runs a save (:mod:`.selection`), the engines -- :mod:`.native` (DCP's
own save with dcpstore's writer), :mod:`.nvrx` (all that depends on the NVRx
release in :mod:`.nvrx_release`, its write streams in :mod:`.nvrx_stream`)
and :mod:`.process` (the native save in a checkpoint process per rank) --
and the one interpreter-exit hook (:mod:`.exit`).
"""
