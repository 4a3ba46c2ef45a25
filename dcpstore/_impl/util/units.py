"""Byte sizes for people (``parse_size("64MiB")``, ``human_bytes(67108864)``)
and durations from them (``check_seconds``).

Shared by the CLI, the options and the benchmarks; imports nothing of
dcpstore's but :mod:`dcpstore._impl.util.errors`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dcpstore._impl.util.errors import InvalidArgument

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864. Binary units (KiB, MiB, GiB, and K/M/G), decimal
    ones (KB, MB, GB), or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgument(f"size {text!r} not understood: expected e.g. 64MiB, 1GiB, 500MB or a byte count")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidArgument(f"size {text!r} must be positive")
    return size


def human_bytes(n: float) -> str:
    """``67108864`` -> ``"64.0 MiB"`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def check_seconds(name: str, value: Any, *, zero: bool = False, infinite: bool = False) -> float:
    """``value`` if it is a number of seconds above 0 (or 0 itself, with
    ``zero``; infinity only with ``infinite``), else InvalidArgument naming
    ``name`` as the caller spelt it. NaN is refused: every comparison with it
    is false, so a rule such as "younger than this is kept" would keep
    nothing."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        ok = False
    else:
        ok = (value >= 0 if zero else value > 0) and (infinite or math.isfinite(value))
    if not ok:
        least = ">= 0" if zero else "> 0"
        kind = "" if infinite else "finite "
        raise InvalidArgument(f"{name} must be a {kind}number of seconds {least}, got {value!r}")
    return float(value)
