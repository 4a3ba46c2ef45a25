"""Keyword mistakes named with their fix: ``async`` for ``async_``, ``workes`` for ``workers``.

Python's own ``TypeError`` for an unknown keyword says only that it is
unknown. :func:`hint_keywords` wraps a public function or method so that the
error also says what was probably meant: ``async_`` for ``async`` (a
reserved word, which is why the option has its trailing underscore, PEP 8),
the closest accepted name for a misspelling (``difflib``), or else the list of
accepted names; a name another library uses for one of ours
(:data:`ELSEWHERE`: ``executor``) names ours. The check is one set difference
per call; the error stays a ``TypeError``, as Python's is.

Foundation layer: imports nothing of dcpstore's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import keyword
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def keyword_names(fn: Callable[..., object]) -> frozenset[str] | None:
    """The keyword arguments ``fn`` accepts; ``None`` if it takes ``**kwargs``."""
    names = set()
    for param in inspect.signature(fn).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(param.name)
    names.discard("self")
    return frozenset(names)


#: Keywords other libraries (and our own issue tracker) spell differently:
#: name -> (ours, what to pass). torch's ``dcp.async_save`` chooses a
#: checkpoint process with ``async_checkpointer_type``; dcpstore with its
#: one option for what runs a save, ``engine``.
ELSEWHERE = {
    "executor": ("engine", "engine='process' runs the save in a checkpoint process"),
    "async_checkpointer_type": ("engine", "engine='process' runs the save in a checkpoint process"),
}


def unknown_keyword_message(function: str, unknown: Iterable[str], accepted: Iterable[str]) -> str:
    """The message for unknown keyword arguments of ``function``, each with a
    suggestion where one is likely."""
    accepted = sorted(accepted)
    parts = []
    for name in sorted(unknown):
        text = f"an unexpected keyword argument {name!r}"
        ours = ELSEWHERE.get(name)
        if keyword.iskeyword(name) and f"{name}_" in accepted:
            text += f": did you mean {name + '_'!r}? ({name!r} is a reserved word in Python, hence the underscore)"
        elif ours is not None and ours[0] in accepted:
            text += f": did you mean {ours[0]!r}? ({ours[1]})"
        else:
            close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
            if close:
                text += f": did you mean {close[0]!r}?"
        parts.append(text)
    if not any("did you mean" in p for p in parts):
        parts[-1] += f" (it accepts {', '.join(accepted)})"
    return f"{function}() got " + "; ".join(parts)


def hint_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so that an unknown keyword argument raises a ``TypeError``
    that names the likely fix (see the module docstring)."""
    accepted = keyword_names(fn)
    if accepted is None:
        return fn
    name = fn.__qualname__

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = kwargs.keys() - accepted
        if unknown:
            raise TypeError(unknown_keyword_message(name, unknown, accepted))
        return fn(*args, **kwargs)

    return checked
