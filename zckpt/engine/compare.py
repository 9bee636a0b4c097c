"""Two tensors compared element by element, streamed: what ``zckpt diff`` measures.

Each side is a list of :class:`~zckpt.engine.segments.Piece` s (however its format shards it); both are cut into the
same element ranges of at most ``chunk_bytes`` (:func:`~zckpt.engine.segments.slice_pieces`), each range read from
both sides into the thread's two reused buffers by a :class:`~zckpt.encoding.tensors.Reader` whose ``check`` (an
:class:`~zckpt.engine.checked.InputCheck`) records every span read for the CRC-32 check, and compared in numpy.
Memory is two buffers of ``CHUNK_BYTES`` per thread, and the differing elements are measured ``MEASURE_BLOCK`` at a
time, whatever the model's size. A side may first be cast to the other's dtype (``cast_to``: fp32 masters against
bf16 / fp16 weights, with torch's rounding).

Per range: the elements whose bits differ (raw integer views, so NaN payloads and -0.0 count); for those only,
|a - b|, |a - b| / |b| (``b``: the second side, as ``numpy.allclose(a, b)``), the distance in units in the last
place (both sides of one floating dtype: the ordered-integer distance of their bit patterns; integers: |a - b|),
whether each is within the tolerance, and the first one's flat index. :meth:`Stats.merge` folds ranges together.

Tolerance (:class:`Tolerance`): an element is within it when its bits are equal, or ``|a-b| <= atol + rtol*|b|``
(when ``atol`` or ``rtol`` is given), or its ULP distance is at most ``ulp`` (when given). Two NaNs are equal
values; a NaN against a number, or infinities of other signs, are never within any tolerance.

The verdict's data (plain, no I/O): :class:`TensorDiff` (one tensor's value or optimizer state), :class:`ValueDiff`
(a group's hyperparameter, a counter, a tie) and :class:`DiffResult` (what ``zckpt.diff`` returns and ``--json``
prints, :meth:`DiffResult.to_json`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from zckpt.encoding.lazytensor import DTYPE_SIZES, FLOATING
from zckpt.engine.segments import slice_pieces

CHUNK_BYTES = 16 << 20
MEASURE_BLOCK = 1 << 18  # differing elements measured at once (float64 temporaries: 2 MiB each)

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_SIGNED = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass(frozen=True)
class Tolerance:
    atol: float | None = None
    rtol: float | None = None
    ulp: int | None = None

    @property
    def exact(self) -> bool:
        return self.atol is None and self.rtol is None and self.ulp is None


@dataclass
class Stats:
    """What one tensor's compared ranges showed (see the module docstring)."""

    numel: int = 0
    differing: int = 0  # elements whose bits differ
    outside: int = 0  # of those, beyond the tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int | None = 0  # None: not measurable (two dtypes)
    first: int | None = None  # flat index of the first element whose bits differ
    first_a: float | int | None = None
    first_b: float | int | None = None
    first_outside: int | None = None  # flat index of the first element beyond the tolerance

    def merge(self, other: Stats) -> None:
        self.numel += other.numel
        self.differing += other.differing
        self.outside += other.outside
        self.max_abs = _max(self.max_abs, other.max_abs)
        self.max_rel = _max(self.max_rel, other.max_rel)
        self.max_ulp = None if self.max_ulp is None or other.max_ulp is None else max(self.max_ulp, other.max_ulp)
        if other.first is not None and (self.first is None or other.first < self.first):
            self.first, self.first_a, self.first_b = other.first, other.first_a, other.first_b
        if other.first_outside is not None and (self.first_outside is None or other.first_outside < self.first_outside):
            self.first_outside = other.first_outside


def _max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def ranges(numel: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[(start, length)] element ranges of at most ``chunk_bytes`` of the wider side."""
    step = max(1, chunk_bytes // max(itemsize, 1))
    return [(s, min(step, numel - s)) for s in range(0, numel, step)]


def _np_dtype(dtype: str):
    import numpy as np
    if dtype == "bfloat16":
        return np.uint16
    if dtype in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        return np.uint8
    return np.dtype(dtype)


def as_float64(raw, dtype: str):
    """The values of ``raw`` (a numpy array of ``dtype``'s bits or values) as float64 (bf16: exact, by bits)."""
    import numpy as np
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype.startswith("float8"):
        raise ValueError(f"{dtype} values are compared by their bits only")
    return raw.astype(np.float64)


def _ordered(bits, itemsize: int):
    """Sign-magnitude float bits as integers in the floats' order (the ULP distance is their difference)."""
    import numpy as np
    signed = bits.view(_SIGNED[itemsize]).astype(np.int64)
    magnitude = signed & ((1 << (itemsize * 8 - 1)) - 1)
    return np.where(signed < 0, -magnitude, magnitude)


def compare_range(readers, a_pieces, a_dtype: str, b_pieces, b_dtype: str, start: int, length: int,
                  tol: Tolerance, cast_to: tuple[str | None, str | None] = (None, None)) -> Stats:
    """Elements [start, start + length) of the two tensors (their whole piece lists), read (``readers``: one
    :class:`~zckpt.encoding.tensors.Reader` per side) and compared; ``cast_to``: a dtype a side is first cast to
    (fp32 masters against weights stored in the training dtype: torch's rounding, :mod:`zckpt.encoding.casting`)."""
    import numpy as np
    a = _read(readers[0], slice_pieces(a_pieces, start, length), a_dtype, length, "a")
    b = _read(readers[1], slice_pieces(b_pieces, start, length), b_dtype, length, "b")
    if cast_to[0]:
        a, a_dtype = _cast(a, a_dtype, cast_to[0]), cast_to[0]
    if cast_to[1]:
        b, b_dtype = _cast(b, b_dtype, cast_to[1]), cast_to[1]
    same = a_dtype == b_dtype
    st = Stats(numel=length, max_ulp=0 if same else None)
    if same:
        size = DTYPE_SIZES[a_dtype]
        if size not in _UINT:  # complex: compared as two halves' bits
            ne = np.flatnonzero((a.view(np.uint8).reshape(length, size) != b.view(np.uint8).reshape(length, size))
                                .any(axis=1))
        else:
            ne = np.flatnonzero(a.view(_UINT[size]) != b.view(_UINT[size]))
        blocks = (ne[i:i + MEASURE_BLOCK] for i in range(0, ne.size, MEASURE_BLOCK))
    else:  # two dtypes: every element's value
        blocks = (np.arange(lo, min(lo + MEASURE_BLOCK, length)) for lo in range(0, length, MEASURE_BLOCK))
    for idx in blocks:  # the differing elements measured a block at a time: a few MiB of temporaries per thread
        st.merge(_measure(a, b, a_dtype, b_dtype, idx, start, same, tol))
    return st


def _measure(a, b, a_dtype: str, b_dtype: str, ne, start: int, same: bool, tol: Tolerance) -> Stats:
    """The elements ``ne`` of ``a`` and ``b`` (bits differing, or any across two dtypes), measured."""
    import numpy as np
    st = Stats(differing=int(ne.size) if same else 0)
    av, bv = a[ne], b[ne]
    floating = a_dtype in FLOATING or b_dtype in FLOATING
    if a_dtype.startswith("float8") or b_dtype.startswith("float8") or "complex" in a_dtype + b_dtype:
        st.outside = int(ne.size)
        st.max_abs = st.max_rel = math.nan
        st.max_ulp = None
        _first(st, start, ne, av, bv)
        return st
    fa, fb = as_float64(av, a_dtype), as_float64(bv, b_dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        both_nan = np.isnan(fa) & np.isnan(fb)
        diff = np.where(both_nan, 0.0, np.abs(fa - fb))
        if not floating:  # integers: exact in int64 beyond float64's 53 bits
            diff = np.abs(av.astype(np.int64) - bv.astype(np.int64)).astype(np.float64)
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number, inf - inf
        rel = np.where(diff == 0, 0.0, diff / np.abs(fb))
        rel = np.where(np.isnan(rel), np.inf, rel)
    if not same:
        st.differing = int((diff != 0).sum())  # the elements whose values differ (bits cannot be compared)
    within = np.zeros(ne.size, dtype=bool)
    if same:
        if floating:
            ulp = np.abs(_ordered(av.view(_UINT[DTYPE_SIZES[a_dtype]]), DTYPE_SIZES[a_dtype])
                         - _ordered(bv.view(_UINT[DTYPE_SIZES[a_dtype]]), DTYPE_SIZES[a_dtype]))
            ulp = np.where(both_nan, 0, ulp)
            ulp = np.where(np.isnan(fa) != np.isnan(fb), np.iinfo(np.int64).max, ulp)
        else:
            ulp = diff.astype(np.int64) if ne.size else np.zeros(0, dtype=np.int64)
        st.max_ulp = int(ulp.max()) if ulp.size else 0
        if tol.ulp is not None:
            within |= ulp <= tol.ulp
        within |= both_nan
    else:
        st.max_ulp = None
        within |= diff == 0
    if tol.atol is not None or tol.rtol is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            within |= diff <= (tol.atol or 0.0) + (tol.rtol or 0.0) * np.abs(fb)
    out = ~within
    st.outside = int(out.sum())
    st.max_abs = float(diff.max()) if diff.size else 0.0
    st.max_rel = float(rel.max()) if rel.size else 0.0
    _first(st, start, ne, av, bv, None if same else diff != 0)
    if st.outside:
        st.first_outside = start + int(ne[np.argmax(out)])
    return st


def _first(st: Stats, start: int, ne, av, bv, mask=None) -> None:
    """The first differing element of the range (``mask``: which of ``ne`` differ; None: all of them)."""
    import numpy as np
    if ne.size == 0 or (mask is not None and not mask.any()):
        return
    k = int(np.argmax(mask)) if mask is not None else 0
    st.first = start + int(ne[k])
    st.first_a, st.first_b = _scalar(av[k]), _scalar(bv[k])


def _scalar(v):
    return v.item()


def decoded(value, dtype: str):
    """A first-difference value as the user reads it (bf16 bits -> the float they hold)."""
    import numpy as np
    if value is None:
        return None
    if dtype == "bfloat16":
        return float((np.array([value], dtype=np.uint32) << 16).view(np.float32)[0])
    if dtype.startswith("float8"):
        return f"0x{int(value):02x}"
    return value


def _cast(raw, src: str, dst: str):
    """``raw`` (an array of ``src``) as ``dst``, rounded as torch's ``Tensor.to`` rounds (a copy: the cast's buffer
    is the thread's own)."""
    import numpy as np
    from zckpt.encoding import casting
    return casting.cast(raw.view(np.uint8), src, dst).view(_np_dtype(dst)).copy()


_tls = threading.local()


def _read(reader, pieces, dtype: str, length: int, slot: str):
    """The pieces' bytes in this thread's buffer ``slot`` (reused range after range: no fresh pages to fault in;
    valid until the thread's next read into the same slot)."""
    import numpy as np
    nbytes = length * DTYPE_SIZES[dtype]
    raw = getattr(_tls, slot, None)
    if raw is None or raw.size < nbytes:
        raw = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_tls, slot, raw)
    buf = raw[:nbytes]
    reader.read_pieces(pieces, memoryview(buf))
    return buf.view(_np_dtype(dtype))


# ------------------------------------------------------------------------------------------ the verdict

@dataclass
class TensorDiff:
    """One tensor of both sides: a value (``state`` "value") or one per-element optimizer state."""

    name: str
    state: str  # "value", "exp_avg", "exp_avg_sq", or another optimizer state key
    part: str  # "weights", "masters" or "optimizer"
    status: str  # "equal" (same bits), "close" (bits differ, within the tolerance), "differ"
    dtype_a: str
    dtype_b: str
    shape_a: list
    shape_b: list
    reason: str | None = None  # "dtype", "shape", "values"
    stats: Stats | None = None
    cast: str | None = None  # "a" or "b": that side's fp32 values cast to the other's dtype before comparing

    @property
    def label(self) -> str:
        return self.name if self.state == "value" else f"{self.name} [{self.state}]"

    def to_json(self) -> dict:
        s = self.stats
        out = {"name": self.name, "state": self.state, "part": self.part, "status": self.status,
               "reason": self.reason, "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
               "shape_a": list(self.shape_a), "shape_b": list(self.shape_b), "numel": s.numel if s else None,
               "differing": s.differing if s else None, "outside_tolerance": s.outside if s else None,
               "max_abs_diff": _num(s.max_abs) if s else None, "max_rel_diff": _num(s.max_rel) if s else None,
               "max_ulp": s.max_ulp if s else None, "first_index": None, "first_index_nd": None,
               "first_a": None, "first_b": None, "cast": self.cast}
        if s is not None and s.first is not None:
            out.update(first_index=s.first, first_index_nd=_nd(s.first, self.shape_a),
                       first_a=_num(decoded(s.first_a, self.dtype_b if self.cast == "a" else self.dtype_a)),
                       first_b=_num(decoded(s.first_b, self.dtype_a if self.cast == "b" else self.dtype_b)))
        return out

    def line(self) -> str:
        """One line: what differs, and where first."""
        cast = f" ({self.cast.upper()}'s {self.dtype_a if self.cast == 'a' else self.dtype_b} values cast to " \
               f"{self.dtype_b if self.cast == 'a' else self.dtype_a})" if self.cast else ""
        if self.status == "equal":
            other = f" (dtype {self.dtype_a} in A, {self.dtype_b} in B: values equal)" if self.reason == "dtype" else ""
            return f"equal   {self.label}{other}{cast}"
        if self.reason == "shape":
            return f"DIFFER  {self.label}: shape {list(self.shape_a)} in A, {list(self.shape_b)} in B"
        d = self.to_json()
        where = f"first at [{', '.join(map(str, d['first_index_nd']))}] (flat {d['first_index']}): " \
                f"{d['first_a']!r} vs {d['first_b']!r}; " if d["first_index"] is not None else ""
        dtype = f"dtype {self.dtype_a} in A, {self.dtype_b} in B; " if self.reason == "dtype" else ""
        ulp = f", max ULP {d['max_ulp']}" if d["max_ulp"] is not None else ""
        word = "DIFFER " if self.status == "differ" else "close  "
        return (f"{word} {self.label}{cast}: {dtype}{where}{d['differing']:,} of {d['numel']:,} elements differ, "
                f"max |a-b| {_fmt(d['max_abs_diff'])}, max rel {_fmt(d['max_rel_diff'])}{ulp}")


@dataclass
class ValueDiff:
    """A plain value of both sides: a param group's hyperparameter, step or members, or a counter."""

    name: str  # "group 0 lr", "group 1 members", "global_steps", "lr_scheduler.last_epoch"
    part: str  # "groups" or "counters"
    status: str  # "equal" or "differ"
    a: object = None
    b: object = None

    @property
    def label(self) -> str:
        return self.name

    def to_json(self) -> dict:
        return {"name": self.name, "part": self.part, "status": self.status, "a": self.a, "b": self.b}

    def line(self) -> str:
        if self.status == "equal":
            return f"equal   {self.name}: {_short(self.a)}"
        return f"DIFFER  {self.name}: {_short(self.a)} in A, {_short(self.b)} in B"


@dataclass
class DiffResult:
    a: str
    b: str
    tag_a: str | None
    tag_b: str | None
    format_a: str
    format_b: str
    parts: list[str]
    tolerance: Tolerance
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_compared: int = 0
    crc_checked_entries: int = 0

    @property
    def counts(self) -> dict:
        items = [t.status for t in self.tensors] + [v.status for v in self.values]
        return {"equal": items.count("equal") + items.count("close"), "close": items.count("close"),
                "differ": items.count("differ"), "only_in_a": len(self.only_in_a), "only_in_b": len(self.only_in_b),
                "other_dtype": sum(t.reason == "dtype" and t.status != "differ" for t in self.tensors)}

    @property
    def ok(self) -> bool:
        c = self.counts
        return not (c["differ"] or c["only_in_a"] or c["only_in_b"])

    @property
    def differences(self) -> list:
        return [x for x in self.tensors + self.values if x.status == "differ"]

    def summary(self) -> str:
        c = self.counts
        close = f" ({c['close']} within the tolerance)" if c["close"] else ""
        if c["other_dtype"]:
            close += f" ({c['other_dtype']} in another dtype, values equal)"
        return (f"{'SAME' if self.ok else 'DIFFERENT'}: {c['equal']} equal{close}, {c['differ']} differ, "
                f"{c['only_in_a']} only in A, {c['only_in_b']} only in B")

    def to_dict(self) -> dict:
        """The fields ``--json`` prints (``to_json``, by the name every zckpt result has)."""
        return self.to_json()

    def to_json(self) -> dict:
        t = self.tolerance
        return {"ok": self.ok, "a": self.a, "b": self.b, "path": self.a, "tag": self.tag_a, "tag_a": self.tag_a,
                "tag_b": self.tag_b, "format_a": self.format_a, "format_b": self.format_b, "parts": self.parts,
                "tolerance": {"atol": t.atol, "rtol": t.rtol, "ulp": t.ulp}, "summary": self.summary(),
                "counts": self.counts, "tensor_diffs": [x.to_json() for x in self.tensors],
                "value_diffs": [x.to_json() for x in self.values], "only_in_a": self.only_in_a,
                "only_in_b": self.only_in_b,
                "not_compared": self.not_compared, "notes": self.notes, "seconds": round(self.seconds, 3),
                "compared_bytes": self.bytes_compared, "crc_checked_entries": self.crc_checked_entries}

    to_dict = to_json

    def __repr__(self) -> str:
        return f"<DiffResult {self.a!r} vs {self.b!r}: {self.summary()}>"


def _num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _nd(flat: int, shape) -> list[int]:
    out = []
    for d in reversed(list(shape) or [1]):
        out.append(flat % d if d else 0)
        flat //= d if d else 1
    return list(reversed(out)) if shape else []
