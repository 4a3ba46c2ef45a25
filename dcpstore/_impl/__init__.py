"""dcpstore's implementation: everything behind the supported surface.

The supported surface is :mod:`dcpstore`, :mod:`dcpstore.storage`,
:mod:`dcpstore.adapters` and :mod:`dcpstore.tools`; what lives here may
change between releases without notice (as Orbax's ``_src``). docs/layout.md
maps it, and ``tests/unit/test_layers.py`` holds it to that map.
"""
