"""One vocabulary for sizes and durations, shared by every command and the library. No torch, no numpy.

Sizes (:func:`parse_size`), the same rule for ``merge --max-shard-size``, ``push --part-size``,
``estimate --gpu-memory`` / ``--headroom`` and the Python API:

=================================  ========================================  ===========================
written                            means                                     as in
=================================  ========================================  ===========================
``5000000``, ``5_000_000``         bytes (a bare number is always bytes)
``5K`` ``5KB``, ``5M`` ``5MB``,    powers of 1000 (SI): ``5G`` = ``5GB`` =   huggingface_hub's
``5G`` ``5GB``, ``5T`` ``5TB``     5 * 10**9 bytes                           ``max_shard_size``, disks
``5KiB``, ``5MiB``, ``5GiB``,      powers of 1024 (IEC): ``5GiB`` =          nvidia-smi's MiB, DeepSpeed's
``5TiB``                           5 * 2**30 bytes                           "GB" column
=================================  ========================================  ===========================

Units are case-insensitive (``5gib``, ``5 GB``); ``B`` alone is bytes; decimals are exact (``1.5GiB`` =
1610612736, rounded half-even to a whole byte); the size must be positive. Exponents (``1e9``), ``nan``
and negative sizes are refused.

Sizes are printed by :func:`format_size` in binary units with one decimal (``26.3 KiB``, ``1.5 GiB``), the
one style of info, merge, reshard and push; JSON output always carries exact byte counts.

Durations (:func:`parse_duration`, for ``push --every`` / ``--settle``): ``90s``, ``30m``, ``2h``, ``1d``,
``500ms``, ``1h30m``, ``1.5h``; a bare number is seconds; ``0`` is zero (refused for an interval such as
``--every``, whose examples leave it out).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from zckpt.errors import InvalidArgument

__all__ = ["SIZE_UNITS", "parse_size", "format_size", "parse_duration"]

SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_EXAMPLES = "examples: 5GB = 5*10**9, 5GiB = 5*2**30, 500MB, 1048576"

_NUMBER = r"([0-9][0-9_,]*(?:\.[0-9]*)?|\.[0-9]+)"
_SIZE_RE = re.compile(_NUMBER + r"\s*([a-z]*)")


def parse_size(text, flag: str | None = None, what: str = "a size") -> int:
    """``'5GB'`` -> 5*10**9, ``'5G'`` -> 5*10**9, ``'5GiB'`` -> 5*2**30, ``'1024'`` / 1024 -> 1024 (bytes).

    ``flag``: the parameter the text was given as (``"max_shard_size"``; the CLI's own checks pass the flag), named
    by the error (``exc.param``); raises :class:`InvalidArgument`."""
    if isinstance(text, bool):
        raise InvalidArgument(f"cannot read {text!r} as {what} ({SIZE_EXAMPLES})", param=flag)
    if isinstance(text, int):
        value = Decimal(text)
    else:
        m = _SIZE_RE.fullmatch(str(text).strip().lower())
        if not m or m.group(2) not in SIZE_UNITS:
            raise InvalidArgument(f"cannot read {text!r} as {what} ({SIZE_EXAMPLES})", param=flag)
        try:
            value = Decimal(m.group(1).replace("_", "").replace(",", "")) * SIZE_UNITS[m.group(2)]
        except InvalidOperation:
            raise InvalidArgument(f"cannot read {text!r} as {what} ({SIZE_EXAMPLES})", param=flag) from None
    nbytes = int(value.to_integral_value())  # round half even to a whole byte
    if nbytes <= 0:
        raise InvalidArgument(f"{what} must be positive, got {text!r}", param=flag)
    return nbytes


def counted(n: int, word: str, words: str | None = None) -> str:
    """``1 rank``, ``2 ranks``, ``0 files``: a count and its noun, singular only for one (``words``: an irregular
    plural)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def format_size(nbytes: int | float | None) -> str:
    """``512 B``, ``26.3 KiB``, ``1.5 GiB``: binary units, one decimal; ``?`` for an unknown size."""
    if nbytes is None:
        return "?"
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
DURATION_EXAMPLES = "examples: 90s, 30m, 2h, 1h30m, 0"
INTERVAL_EXAMPLES = "examples: 90s, 30m, 2h, 1h30m"


def parse_duration(text, flag: str | None = None, positive: bool = False) -> float:
    """``'90s'`` -> 90, ``'30m'`` -> 1800, ``'1h30m'`` -> 5400, ``'0'`` / ``'15'`` -> seconds.

    ``positive``: zero is refused too (an interval), and the examples offered say so."""
    examples = INTERVAL_EXAMPLES if positive else DURATION_EXAMPLES
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text >= 0:
        if positive and not text > 0:
            raise InvalidArgument(f"must be more than zero, got {text!r} ({examples})", param=flag)
        return float(text)
    s = str(text).strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _SECONDS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise InvalidArgument(f"cannot read {text!r} as a duration ({examples})", param=flag)
    if positive and not total > 0:
        raise InvalidArgument(f"must be more than zero, got {text!r} ({examples})", param=flag)
    return total

