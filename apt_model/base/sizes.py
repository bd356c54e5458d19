"""Byte sizes as users write them: ``512MB``, ``4GiB``, ``1.5 GB``, ``1048576``.

Decimal units (KB, MB, GB, TB = 10^3...) and binary units (KiB, MiB, GiB, TiB = 2^10...) are both
accepted, case-insensitively; a bare number is bytes. A size is a whole number of bytes, at
least 1: fractions of a byte, NaN, infinities and bools are refused with the accepted forms.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from apt_model.base.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # ASCII digits only: "١٦MB" is no size


_FORMS = "write a whole number of bytes with an optional unit, e.g. 512MB, 4GiB, 1.5GB or 1048576"


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Parse a byte size; returns a whole number of bytes (int, >= 1).

    Accepts ints, floats and strings with an optional unit (decimal KB/MB/GB/TB, binary
    KiB/MiB/GiB/TiB, K/M/G/T meaning the binary ones, B or none for bytes), as long as the result
    is a whole number of bytes: ``"1.5GB"`` and ``"1.5KiB"`` (1536) are sizes, ``3.5`` and
    ``"0.5B"`` are not — a fraction of a byte is never silently cut off.

    Raises:
        ConfigError: for bools, NaN, infinities, negative or zero sizes, fractions of a byte, and
            anything that is not a number with an optional unit — naming ``name``, the value and
            the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size; {_FORMS}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} is not a size; {_FORMS}")
    else:
        m = _PATTERN.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size; write a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K/M/G/T mean KiB/MiB/GiB/TiB), e.g. 512MB or 4GiB"
            )
        number, unit = m.group(1), m.group(2).lower()
    exact = Fraction(number) * _UNITS[unit]  # exact: 1.1KiB is 1126.4 bytes, not a rounding of it
    if exact.denominator != 1:
        near = int(exact)  # rounded down: never cut off silently, but offered (1.2GiB is a common way to write it)
        hint = f" ({near} would be)" if near >= 1 else ""
        raise ConfigError(
            f"{name}={value!r} is {float(exact):.1f} bytes, not a whole number of bytes{hint}; {_FORMS}"
        )
    size = int(exact)
    if size <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive size (at least 1 byte); {_FORMS}")
    return size


def format_size_at_least(n: int) -> str:
    """A size to type that is at least ``n`` bytes: a whole number of the largest binary unit in
    which it is 10 or more, rounded up (``307277 -> '301KiB'``, ``5.3 MiB -> '5428KiB'``). For
    messages that tell the user what to set: ``format_size`` rounds to one decimal, which may be
    below ``n`` and is often not a whole number of bytes (``parse_size`` refuses ``300.1KiB``)."""
    n = max(int(math.ceil(n)), 1)
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= 10 * factor:
            return f"{-(-n // factor)}{unit}"
    return f"{n}B"


def format_size(n: int | float | None) -> str:
    """``1536 -> '1.5KiB'``; binary units, one decimal; None -> 'n/a'."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"
