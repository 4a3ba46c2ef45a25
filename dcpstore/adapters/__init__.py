"""Other projects' shapes, mapped onto dcpstore: FSDP2 model + optimizer
state (:mod:`.fsdp`), Megatron's ``torch_dist`` format and a
Megatron-Bridge-style configuration (:mod:`.megatron`); beneath torchtitan's
``CheckpointManager`` (:mod:`.torchtitan`, the ``torchtitan`` extra) and
Lightning's ``ModelParallelStrategy`` (:mod:`.lightning`, the ``lightning``
extra), which nothing imports unless asked for.

Layer: adapters, above the manager and the front door :mod:`dcpstore.api`
they build on; nothing else in dcpstore imports them. (NVRx's release churn is engine internals: :mod:`dcpstore.engines.nvrx`.)
"""
