"""Where keywords meet an ``options=``: :func:`resolve_options`, the one
place an entry point's option keywords are mapped onto its
:class:`~dcpstore.SaveOptions` / :class:`~dcpstore.LoadOptions`.

Three kinds of keyword reach it. Shortcuts (:func:`dcpstore.save`'s and
:func:`dcpstore.load`'s keywords, a manager's ``async_``, the drop-ins'
``thread_count``, Bridge's ``async_save``) fill what the options leave at
their defaults. A keyword that disagrees with a value the options set is an
:class:`~dcpstore.InvalidArgument` naming both: one value, one meaning.
And the keywords an entry point took before it took ``options=`` (its
``**deprecated``) warn once each, before anything else can fail, naming
their replacement (:func:`warn_deprecated_keyword`: the options whole, with
that value), point the warning at the caller's line
(:func:`dcpstore._impl.util.warning_filters.user_stacklevel`), and still work, for one release;
any other keyword is the ``TypeError`` Python raises, naming the likely fix
(:mod:`dcpstore._impl.util.keyword_hints`). :func:`storage_spread` is the same for the one
option that moved out of :class:`~dcpstore.StorageOptions`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.keyword_hints import unknown_keyword_message
from dcpstore._impl.values.options import OPTION_DEFAULTS, InvalidOption, LoadOptions, SaveOptions, warn_spread_deprecated
from dcpstore._impl.util.warning_filters import warn_deprecated
from dcpstore._impl.storage import StorageOptions, check_spread_prefixes, with_msc

O = TypeVar("O", SaveOptions, LoadOptions)


@functools.lru_cache(maxsize=None)
def _keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name != "options"
    }


def given_keywords(fn: Callable[..., Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword-only arguments of ``fn`` (but ``options``) that ``values``
    (its ``locals()``) holds at other than their defaults: the shortcuts a
    caller set."""
    return {name: values[name] for name, default in _keyword_defaults(fn).items() if values[name] != default}


def _display(fn: Callable[..., Any]) -> str:
    return fn.__qualname__.removesuffix(".__init__")


def _same(value: Any, current: Any) -> bool:
    return bool(value == current) or (isinstance(value, list) and tuple(value) == current)


def resolve_options(
    fn: Callable[..., Any],
    options: O | None,
    *,
    base: O,
    given: Mapping[str, Any] | None = None,
    deprecated: Mapping[str, Any] | None = None,
    deprecated_names: Collection[str] = (),
    spelled_as: Mapping[str, str] | None = None,
) -> O:
    """The options ``fn`` runs with: ``options`` (``None``: ``base``, the
    entry point's defaults) with the option keywords its caller gave.

    Args:
        fn: the entry point (its name goes into every message).
        options: its ``options=`` argument.
        base: its defaults, when ``options`` is ``None``.
        given: keywords of ``fn`` that stay (``save``'s shortcuts, a
            manager's ``async_``) and were set: option name -> value.
        deprecated: ``fn``'s ``**`` keywords: each must be one of
            ``deprecated_names`` (the options it used to take as keywords),
            warns once naming its replacement, and still works.
        deprecated_names: see ``deprecated``.
        spelled_as: option name -> the keyword ``fn`` takes for it, where
            they differ (the drop-in's ``thread_count`` for ``workers``).

    Returns:
        The options, validated.

    Raises:
        TypeError: a keyword ``fn`` never took (naming the likely fix, as
            :func:`dcpstore._impl.util.keyword_hints.hint_keywords` does).
        InvalidArgument: ``options`` of the wrong type, a keyword that
            disagrees with a value ``options`` sets (naming both), or a bad value.
    """
    given, deprecated = dict(given or {}), dict(deprecated or {})
    where = _display(fn)
    unknown = deprecated.keys() - set(deprecated_names)
    if unknown:
        params = inspect.signature(fn).parameters.values()
        named = {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
        raise TypeError(unknown_keyword_message(fn.__qualname__, unknown, named | set(deprecated_names)))
    kind = type(base)
    if options is not None and not isinstance(options, kind):
        raise InvalidArgument(f"{where}: options must be a dcpstore.{kind.__name__}, got {options!r}")
    target = options if options is not None else base
    for name, value in deprecated.items():  # first: a user whose call also fails learns of it too
        warn_deprecated_keyword(where, name, value, target)
    changes: dict[str, Any] = {}
    for name, value in {**given, **deprecated}.items():
        current = getattr(target, name)
        if _same(value, current):
            continue
        if options is not None and current != OPTION_DEFAULTS[kind][name]:
            keyword = (spelled_as or {}).get(name, name)
            raise InvalidArgument(
                f"{where}: {keyword}={value!r} and options.{name}={current!r} disagree; pass each option once, "
                "either as options= or as keywords, not both"
            )
        changes[name] = value
    if "enable_msc" in changes:
        changes["storage_options"] = with_msc(changes.get("storage_options", target.storage_options), changes.pop("enable_msc"))
    try:
        return dataclasses.replace(target, **changes) if changes else target
    except InvalidOption as e:
        if e.option not in changes:  # the options' own value: they say so themselves
            raise
        # The options validate under their field names; the caller gave the
        # value under fn's keyword (thread_count, not workers): name that.
        keyword = (spelled_as or {}).get(e.option, e.option)
        raise InvalidArgument(f"{where}: {keyword} {e.why}") from None


def warn_deprecated_keyword(where: str, name: str, value: Any, options: SaveOptions | LoadOptions) -> None:
    """The warning for ``where``'s deprecated keyword ``name``, naming its
    replacement: ``options`` with that value set, passed whole."""
    warn_deprecated(
        f"{where}'s keyword {name}= is deprecated and goes in the next release: pass the options whole "
        f"instead, options={options.spelled(**{name: value})}"
    )


def storage_spread(spread_prefixes: int | None, storage_options: StorageOptions) -> int:
    """A writer's spread: ``spread_prefixes`` as given, else the storage
    options' deprecated field (a writer built without a
    :class:`~dcpstore.SaveOptions`), with its warning."""
    if spread_prefixes is not None:
        return check_spread_prefixes(spread_prefixes)
    if storage_options.spread_prefixes != 1:
        warn_spread_deprecated(storage_options.spread_prefixes)
    return storage_options.spread_prefixes
