"""Names a package re-exports but imports only when first used (PEP 562):
what needs torch, behind a surface that torch-free tools import too
(``import dcpstore``; :mod:`dcpstore._impl.dcp.commit`, whose rules ``ls`` and
``gc`` use)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def first_use(names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` that imports each of ``names`` (name -> the
    module that defines it) when first looked up, and keeps it in
    ``namespace`` (the module's globals), so that later lookups are plain
    attribute reads."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
