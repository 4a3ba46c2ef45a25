"""Value objects passed down every layer: what a save or load is asked to
do (:mod:`.options`: SaveOptions, LoadOptions, the engine table), where
keywords meet ``options=`` (:mod:`.keywords`) and what a save or load
reports (:mod:`.results`: SaveStats, CheckpointInfo, SaveHandle, LoadStats)."""
