"""Other projects' shapes, mapped onto dcpstore: FSDP2 model + optimizer
state (:mod:`.fsdp`), Megatron's ``torch_dist`` format and a
Megatron-Bridge-style configuration (:mod:`.megatron`); beneath torchtitan's
``CheckpointManager`` (:mod:`.torchtitan`, the ``torchtitan`` extra) and
Lightning's ``ModelParallelStrategy`` (:mod:`.lightning`, the ``lightning``
extra); a ``Storage`` for torch_checkpointing's ``CheckpointManager``
(:mod:`.torch_checkpointing`, the ``torch-checkpointing`` extra). Nothing
imports the framework adapters unless asked for.
"""
