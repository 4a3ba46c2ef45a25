"""Where keywords meet an ``options=``: :func:`resolve_options`, the one
place an entry point's option keywords are mapped onto its
:class:`~dcpstore.SaveOptions` / :class:`~dcpstore.LoadOptions`.

Each option is passed one way per entry point: :func:`dcpstore.save` and
:func:`dcpstore.load` take them as keywords (and no ``options=``); every
other entry point takes them whole, as ``options=``, beside what is its own
(a manager's ``async_``, its mode) and the names of the framework it
stands in for (the drop-ins' ``thread_count``, Bridge's ``async_save``:
:data:`dcpstore._impl.util.keyword_hints.FRAMEWORK_NAMES`, the one table of them).
Those fill what the options leave at their defaults; one that disagrees
with a value the options set is an :class:`~dcpstore.InvalidArgument`
naming both, and a bad value is named as the caller spelt it. A keyword an
entry point does not take is the ``TypeError`` Python raises, naming the
likely fix (:mod:`dcpstore._impl.util.keyword_hints`), and, for an option it takes
only inside ``options=``, how to pass it there (:func:`pass_whole`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from dcpstore._impl.storage import StorageOptions, with_msc
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.keyword_hints import foreign_names
from dcpstore._impl.values.options import OPTION_DEFAULTS, InvalidOption, LoadOptions, SaveOptions

OptionsT = TypeVar("OptionsT", SaveOptions, LoadOptions)


@functools.cache
def _keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name != "options"
    }


def given_keywords(fn: Callable[..., Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword-only arguments of ``fn`` (but ``options``) that ``values``
    (its ``locals()``) holds at other than their defaults: the options a
    caller set (``True`` for a default of 1 too, so that it is refused)."""
    return {
        name: values[name]
        for name, default in _keyword_defaults(fn).items()
        if values[name] != default or type(values[name]) is not type(default)
    }


def _display(fn: Callable[..., Any]) -> str:
    return fn.__qualname__.removesuffix(".__init__")


def _same(value: Any, current: Any) -> bool:
    return bool(value == current and type(value) is type(current)) or (
        isinstance(value, list) and tuple(value) == current
    )


def resolve_options(
    fn: Callable[..., Any], options: OptionsT | None, *, base: OptionsT, given: Mapping[str, Any] | None = None
) -> OptionsT:
    """The options ``fn`` runs with: ``options`` (``None``: ``base``, the
    entry point's defaults) with the option keywords its caller gave.

    Args:
        fn: the entry point (its name goes into every message, and picks
            the names it takes for options under another framework's name:
            :func:`dcpstore._impl.util.keyword_hints.foreign_names`).
        options: its ``options=`` argument.
        base: its defaults, when ``options`` is ``None``.
        given: keywords of ``fn`` that stand for an option (``save``'s, a
            manager's ``async_``, the drop-ins' ``thread_count``) and were
            set: option name -> value.

    Returns:
        The options, validated.

    Raises:
        InvalidArgument: ``options`` of the wrong type, a keyword that
            disagrees with a value ``options`` sets (naming both), or a bad
            value (named as the caller spelt it).
    """
    given = dict(given or {})
    where = _display(fn)
    spelled_as = {ours: theirs for theirs, ours in foreign_names(where).items()}
    kind = type(base)
    if options is not None and not isinstance(options, kind):
        raise InvalidArgument(f"{where}: options must be a dcpstore.{kind.__name__}, got {options!r}")
    target = options if options is not None else base
    changes: dict[str, Any] = {}
    for name, value in given.items():
        current = getattr(target, name)
        if _same(value, current):
            continue
        if options is not None and current != OPTION_DEFAULTS[kind][name]:
            keyword = spelled_as.get(name, name)
            raise InvalidArgument(
                f"{where}: {keyword}={value!r} and options.{name}={current!r} disagree; pass it once, "
                f"as {keyword}= or in options="
            )
        changes[name] = value
    if "enable_msc" in changes:
        changes["storage_options"] = with_msc(
            changes.get("storage_options", target.storage_options), changes.pop("enable_msc")
        )
    try:
        return dataclasses.replace(target, **changes) if changes else target
    except InvalidOption as e:
        if e.option not in changes:  # the options' own value: they say so themselves
            raise
        # The options validate under their field names; the caller gave the
        # value under fn's keyword (thread_count, not workers): name that.
        keyword = spelled_as.get(e.option, e.option)
        raise InvalidArgument(f"{where}: {keyword} {e.why}") from None


def pass_whole(base: SaveOptions | LoadOptions) -> dict[str, str]:
    """For an entry point that takes its options whole (``options=``, with
    ``base`` when it is given none): each option, and each field of
    :class:`~dcpstore.StorageOptions`, -> how to pass it there, for the
    ``TypeError`` of a caller who passed it as a keyword
    (:func:`dcpstore._impl.util.keyword_hints.hint_keywords_with`). What ``base``
    sets (a manager's ``async_=True``) is kept in the hint, since options
    passed whole are used as they are."""
    kind, defaults = type(base), OPTION_DEFAULTS[type(base)]
    kept = {
        f.name: getattr(base, f.name) for f in dataclasses.fields(base) if getattr(base, f.name) != defaults[f.name]
    }

    def spelled(name: str, inner: str) -> str:
        fields = [f"{k}={v!r}" for k, v in kept.items() if k != name]
        return f"pass options=dcpstore.{kind.__name__}({', '.join([*fields, inner])})"

    whole = {f.name: spelled(f.name, f"{f.name}=...") for f in dataclasses.fields(base)}
    for f in dataclasses.fields(StorageOptions):
        whole.setdefault(f.name, spelled("storage_options", f"storage_options=dcpstore.StorageOptions({f.name}=...)"))
    return whole
