"""dcpstore under other code's own entry points: DCP's (the drop-in
classes, peers' writers), FSDP2, torchtitan, Lightning, Megatron-Bridge and
Megatron's config."""
