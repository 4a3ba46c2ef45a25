"""Checkpoints at rest, behind :mod:`dcpstore.tools` and the CLI: ``ls``
and ``gc``, which read no content and never import torch
(:mod:`.listing`), and ``inspect`` / ``verify`` (:mod:`.maintenance`)."""
