"""Byte sizes as users write them: ``512MB``, ``4GiB``, ``1.5 GB``, ``1048576``.

Decimal units (KB, MB, GB, TB = 10^3...) and binary units (KiB, MiB, GiB, TiB = 2^10...) are both
accepted, case-insensitively; a bare number is bytes.
"""
from __future__ import annotations

import re

from apt_model.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Parse a byte size; returns bytes (int, > 0).

    Raises:
        ConfigError: for anything that is not a positive number with an optional unit, naming
            ``name`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size; write e.g. 512MB, 4GiB or 1048576 (bytes)")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _PATTERN.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size; write a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K/M/G/T mean KiB/MiB/GiB/TiB), e.g. 512MB or 4GiB"
            )
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive size")
    return size


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
