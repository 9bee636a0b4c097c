"""Segments: what one output byte range is made of. Plain data, no I/O (see :mod:`zckpt.engine.executor`).

    Piece(path, offset, numel, dtype)   bytes of an input file (a slice of a rank file's tensor)
    Fill(numel, dtype)                  zeros (partition padding)
    Cast(pieces, src_dtype)             input bytes converted to the output dtype (torch's rounding)
    bytes                               literal bytes (headers, pickles)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zckpt.encoding.safeload import DTYPE_SIZES


class Shaped:
    """``numel`` and ``nbytes`` of an output tensor description with ``shape`` and ``dtype`` fields."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(unsafe_hash=True, slots=True)
class Piece:
    """``numel`` contiguous elements of ``dtype`` at byte ``offset`` of ``path``. Never changed once made (hashed by
    its fields; not ``frozen``: a frozen dataclass is built 3.5x slower, and a tensor-parallel checkpoint has a
    piece per row and chunk, 10**7 for a 70B model)."""

    path: str
    offset: int
    numel: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class Fill:
    """``numel`` elements of value zero."""

    numel: int
    dtype: str

    @property
    def nbytes(self):
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class Cast:
    """Input pieces (``src_dtype``) converted to the output's dtype with torch's ``Tensor.to`` rounding."""

    pieces: list
    src_dtype: str

    @property
    def numel(self):
        return sum(p.numel for p in self.pieces)


def seg_numel(seg, dtype: str) -> int:
    if isinstance(seg, (bytes, bytearray)):
        return len(seg) // DTYPE_SIZES[dtype]
    return seg.numel


def slice_pieces(pieces: list[Piece], start: int, length: int) -> list[Piece]:
    """Elements [start, start+length) of the concatenation of ``pieces``."""
    out, pos = [], 0
    end = start + length
    for p in pieces:
        lo, hi = max(start, pos), min(end, pos + p.numel)
        if lo < hi:
            size = DTYPE_SIZES[p.dtype]
            out.append(Piece(p.path, p.offset + (lo - pos) * size, hi - lo, p.dtype))
        pos += p.numel
        if pos >= end:
            break
    return out


def slice_segments(segs: list, start: int, length: int) -> list:
    """Elements [start, start+length) of the concatenation of Piece / Fill / Cast segments."""
    out, pos, end = [], 0, start + length
    for s in segs:
        n = s.numel
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            if isinstance(s, Fill):
                out.append(Fill(hi - lo, s.dtype))
            elif isinstance(s, Piece):
                out.extend(slice_pieces([s], lo - pos, hi - lo))
            elif isinstance(s, Cast):
                out.append(Cast(slice_pieces(s.pieces, lo - pos, hi - lo), s.src_dtype))
            else:
                raise TypeError(type(s))
        pos += n
        if pos >= end:
            break
    return out


def coalesce(segs: list) -> list:
    """Merge neighbouring pieces that are contiguous in the same file (and neighbouring zero fills)."""
    out: list = []
    for s in segs:
        last = out[-1] if out else None
        if isinstance(s, Piece) and isinstance(last, Piece) and last.path == s.path and last.dtype == s.dtype \
                and last.offset + last.nbytes == s.offset:
            out[-1] = Piece(last.path, last.offset, last.numel + s.numel, s.dtype)
        elif isinstance(s, Fill) and isinstance(last, Fill) and last.dtype == s.dtype:
            out[-1] = Fill(last.numel + s.numel, s.dtype)
        elif not (isinstance(s, (Piece, Fill)) and s.numel == 0):
            out.append(s)
    return out


def source_segments(pieces: list[Piece], src_dtype: str, dtype: str) -> list:
    """The segments of a tensor stored as ``pieces`` of ``src_dtype`` and written as ``dtype``."""
    return list(pieces) if src_dtype == dtype else [Cast(list(pieces), src_dtype)]
