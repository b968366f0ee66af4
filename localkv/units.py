"""Sizes in bytes: parsing what users type and printing what they read."""

import re

from localkv.errors import LocalkvError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """'512MiB', '1G', '2GB', '1048576' -> bytes."""
    if isinstance(text, int):
        if text < 0:
            raise LocalkvError(f"invalid size {text}: must be >= 0")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise LocalkvError(f"invalid size {text!r}: use e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: float) -> str:
    """Bytes for people: '512 B', '94.0 MiB', '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise RuntimeError("unreachable")
