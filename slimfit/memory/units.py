"""Bytes as text and text as bytes: the one formatter of every memory table and command, and the parser of
`slimfit plan --fit BUDGET`.

    format_bytes(1536)               # '1.50 KiB'
    format_bytes(3 * 2**29, 1)       # '1.50 GiB' (GiB keeps two decimals: a tenth of a GiB is 100 MiB)
    parse_bytes("24GiB")             # 25769803776
"""
from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def format_bytes(n: float, decimals: int = 2, whole_bytes: bool = True) -> str:
    """`n` bytes in the unit that keeps the number readable: B below 1 KiB (`whole_bytes`; else KiB), KiB below
    1 MiB, MiB below 1 GiB, else GiB; `decimals` places (GiB at least two), thousands separated by commas."""
    n = float(n)
    if whole_bytes and abs(n) < 1024:
        return f"{int(n)} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if abs(n) < 1024 * scale:
            return f"{n / scale:,.{decimals}f} {unit}"
    return f"{n / 2**30:,.{max(decimals, 2)}f} GiB"


def parse_bytes(text: str) -> int:
    """'24GiB' / '24G' (binary), '24GB' (decimal), '500MiB', '1e9' -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 24GiB, 500MiB, 16GB)")
    return int(float(match.group(1)) * _UNITS[unit])
