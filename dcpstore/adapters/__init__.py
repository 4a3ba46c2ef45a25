"""Seams to other projects: FSDP2 state dicts (:mod:`.fsdp`), Megatron-style
configuration (:mod:`.megatron`). Third-party version churn stays here."""
