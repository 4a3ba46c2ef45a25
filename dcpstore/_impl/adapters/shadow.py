"""Methods of one object shadowed by an installation's own, and given back.

The torchtitan and Lightning adapters put dcpstore beneath an object the
trainer has built (its checkpoint manager, its strategy) without replacing
its class: each method they take over gets an instance attribute of that
name, bound to the installation, which shadows the class's method; the
object keeps its installation as ``_dcpstore``, so that installing again
replaces it. Uninstalling drops those attributes, and the class's methods
show through again.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: The attribute under which an object keeps the installation shadowing its methods.
INSTALLED = "_dcpstore"


def shadow(target: Any, installation: object, methods: Mapping[str, Callable[..., Any]]) -> None:
    """Shadow ``target``'s method of each name in ``methods`` with the
    function there, bound to ``installation``; ``target`` keeps
    ``installation`` as its ``_dcpstore``."""
    for name, function in methods.items():
        setattr(target, name, types.MethodType(function, installation))
    setattr(target, INSTALLED, installation)


def unshadow(target: Any, names: Iterable[str]) -> None:
    """Give ``target`` back its own methods of ``names`` (its class's, no
    longer shadowed) and drop its ``_dcpstore``."""
    for name in names:
        target.__dict__.pop(name, None)
    target.__dict__.pop(INSTALLED, None)


def uninstall_previous(target: Any) -> None:
    """Undo the installation ``target`` keeps, if any: installing again
    replaces it."""
    previous = target.__dict__.get(INSTALLED)
    if previous is not None:
        previous.uninstall()
