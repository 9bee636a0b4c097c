"""Pickle streams walked without being run: where one ends, and whether its memo use is forged.

Used by :mod:`zckpt.encoding.safeload` (``data.pkl`` of a torch zip) and :mod:`zckpt.encoding.legacy` (the five
pickles a legacy torch file starts with, one after another, their lengths written nowhere). One pass over the
opcodes (the walk of ``pickletools.genops`` without building its argument objects: about twice as fast).
"""

from __future__ import annotations

import functools
import gc
import io
import pickle
import pickletools
import re
import sys
from collections import Counter

from zckpt.errors import CorruptFile, UnsafePickle

_MEMO_OPS = ("PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET")
_STOP = 0x2E


def _opcode_table() -> dict[int, tuple[int, int, bool]]:
    """opcode byte -> (argument size code as in pickletools, lines to skip for text arguments, is a memo op)."""
    table = {}
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        lines = 2 if op.arg is not None and op.arg.name == "stringnl_noescape_pair" else 1
        table[ord(op.code)] = (n, lines, op.name in _MEMO_OPS)
    return table


_OPCODES = _opcode_table()
_LENGTH_BYTES = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
                 pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}


def _cls(codes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in sorted(codes)) + b"]"


def _lengths(width: int) -> bytes:
    """A length field of ``width`` bytes holding 0..255, then that many bytes (one branch per length)."""
    pad = b"\x00" * (width - 1)
    return b"(?:" + b"|".join(re.escape(bytes([n]) + pad) + (b"[\\s\\S]{%d}" % n if n else b"")
                             for n in range(256)) + b")"


def _memo_index(width: int, bits: int) -> bytes | None:
    """A little-endian memo index of ``width`` bytes below ``2**bits``, or None."""
    if bits <= 0:
        return None
    full, part = divmod(min(bits, 8 * width), 8)
    out = b"[\\s\\S]" * full
    if full < width:
        out += b"[\\x00-\\x%02x]" % ((1 << part) - 1) if part else b"\\x00"
        out += b"\\x00" * (width - full - 1)
    return out


# One run of opcodes: possessive where ``re`` has it (Python 3.11+: no backtracking state kept per opcode); on
# 3.10 a greedy run of at most 2**13 opcodes (its backtracking stack bounded; :func:`scan` walks the opcode the
# run stops at and resumes). The branches are disjoint (one opcode byte, one branch) and nothing follows the run,
# so both match the same opcodes. The text branches need no possessive ``[^\n]*``: a newline must follow.
_RUN = b"*+" if sys.version_info >= (3, 11) else b"{0,8192}"


@functools.lru_cache(maxsize=None)
def _run_pattern(bits: int) -> re.Pattern:
    """Runs of opcodes whose walk needs no Python: everything but STOP, unknown opcodes, the text memo ops, length
    fields of 256 or more, and memo indices of ``2**bits`` or more (those are walked one by one by :func:`scan`)."""
    groups: dict[str, set[int]] = {"none": set(), "len1": set(), "len4": set(), "text1": set(), "text2": set()}
    fixed: dict[int, set[int]] = {}
    memo: dict[int, set[int]] = {}
    for code, (n, lines, is_memo) in _OPCODES.items():
        if code == _STOP:
            continue
        if n == 0:
            groups["none"].add(code)
        elif n > 0:
            (memo if is_memo else fixed).setdefault(n, set()).add(code)
        elif n == pickletools.UP_TO_NEWLINE:
            if not is_memo:
                groups["text2" if lines == 2 else "text1"].add(code)
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            groups["len1"].add(code)
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            groups["len4"].add(code)
    branches = [_cls(groups["none"]), _cls(groups["len1"]) + _lengths(1)]
    for n, codes in sorted(memo.items()):
        index = _memo_index(n, bits)
        if index is not None:
            branches.append(_cls(codes) + index)
    branches += [_cls(codes) + b"[\\s\\S]{%d}" % n for n, codes in sorted(fixed.items())]
    branches += [_cls(groups["len4"]) + _lengths(4), _cls(groups["text1"]) + b"[^\\n]*\\n",
                 _cls(groups["text2"]) + b"[^\\n]*\\n[^\\n]*\\n"]
    return re.compile(b"(?:" + b"|".join(branches) + b")" + _RUN)


def _bits_below(bound: int) -> int:
    """The largest ``b`` (at most 32) with every index below ``2**b`` at most ``bound``."""
    return min(32, (bound + 1).bit_length() - 1) if bound >= 0 else 0


REGEX_FROM = 1 << 14  # data of fewer bytes is walked one opcode at a time (faster than compiling the expression;
#                       the compiled expressions are kept, so many files of one size pay it once)

#: bytes walked one opcode at a time, per expression (its memo-index bound), before compiling that expression pays:
#: compiling one takes about 15 ms on the 2-core box, as long as walking ~90 KB of pickle one opcode at a time
#: (0.17 us a byte; a DeepSpeed merge's one 29 KB model-states pickle paid 15 ms to save 5). Data of this size
#: compiles at once; smaller data is walked here until the bytes walked reach it (paying at most twice the best).
COMPILE_AFTER = 1 << 16
_walked: dict[int, int] = {}  # bits -> bytes walked one by one while that expression was not compiled
_compiled: set[int] = set()


def _pattern(bits: int, size: int):
    """The compiled run expression for ``bits``, or None to walk ``size`` bytes one opcode at a time instead
    (:data:`COMPILE_AFTER`). Threads may race on the counts: a walk more or a compile sooner, the same result."""
    if bits not in _compiled:
        walked = _walked.get(bits, 0) + size
        if walked < COMPILE_AFTER:
            _walked[bits] = walked
            return None
        _compiled.add(bits)
    return _run_pattern(bits).match


class Truncated(CorruptFile):
    """The data ends before the pickle's STOP opcode (a reader with more of the file may read on)."""


def scan(data, start: int = 0, path: str | None = None, what: str = "data.pkl", limit: int | None = None) -> int:
    """The offset just after the STOP opcode of the pickle starting at ``data[start]``.

    Refuses (:class:`~zckpt.errors.CorruptFile`) an unknown opcode and a memo index past the pickle's own length:
    ``LONG_BINPUT 678654301`` (5 bytes) makes CPython grow its memo table to that index (gigabytes), and a real
    memo index is below the number of opcodes. ``limit``: the largest memo index allowed (default: the pickle's
    own length, known at its STOP). Raises :class:`Truncated` when ``data`` ends first.

    The walk: a regular expression (:func:`_run_pattern`, run by ``re`` in C) consumes whole opcodes with their
    arguments as long as it can; what it stops at (STOP, an unknown opcode, a long string, a large memo index, a
    truncated argument) is walked here, one opcode, and the expression resumes after it. Data of fewer than
    :data:`REGEX_FROM` bytes is walked here alone (compiling the expression costs more than its walk), and so is
    data of that expression until :data:`COMPILE_AFTER` bytes were walked without it."""
    end, pos = len(data), start
    bound = limit if limit is not None else end - start
    bits = _bits_below(bound) if end - start >= REGEX_FROM else 0
    run = _pattern(bits, end - start) if bits else None
    bits = bits if run is not None else 0
    table, lengths = _OPCODES, _LENGTH_BYTES
    top = (1 << bits) - 1 if bits else 0  # the largest memo index the runs may have used

    def damaged(why: str, cls=CorruptFile):
        return cls(f"damaged pickle in {what} ({why} at byte {pos})", path=path)

    while pos < end:
        if run is not None:
            pos = run(data, pos).end()
            if pos >= end:
                break
        code = data[pos]
        entry = table.get(code)
        if entry is None:
            raise damaged(f"unknown opcode {code:#04x}")
        pos += 1
        n, lines, memo = entry
        if code == _STOP:
            own = limit if limit is not None else pos - start
            if top > own:
                if limit is None and bits and _bits_below(own) < bits:  # the runs' bound was the data's end:
                    return scan(data[start:pos], 0, path, what, limit=own) + start  # again with the pickle's own
                raise CorruptFile(f"pickle uses memo slot {top} in a {own}-byte pickle", path=path)
            return pos
        if n > 0:
            if pos + n > end:
                raise damaged("truncated argument", Truncated)
            if memo:
                top = max(top, int.from_bytes(data[pos:pos + n], "little"))
            pos += n
        elif n == pickletools.UP_TO_NEWLINE:
            begin = pos
            for _ in range(lines):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise damaged("unterminated text argument", Truncated)
                pos = nl + 1
            if memo:
                text = bytes(data[begin:pos - 1])
                if not text.isdigit():
                    raise damaged("memo index is not a number")
                top = max(top, int(text))
        elif n < 0:
            width, signed = lengths[n]
            if pos + width > end:
                raise damaged("truncated length", Truncated)
            size = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            if size < 0:
                raise damaged("negative length")
            if pos + width + size > end:
                raise damaged("length past the end", Truncated)
            pos += width + size
        if top > bound:  # forged: the pickle cannot be that long
            raise CorruptFile(f"pickle uses memo slot {top} in a {bound}-byte pickle", path=path)
    raise Truncated(f"damaged pickle in {what} (no STOP opcode)", path=path)


MAX_NESTING = 200  # containers in containers: real checkpoints nest about a dozen levels
_LEAF_TYPES = frozenset({str, int, float, bool, type(None), bytes, complex, type})


def check_nesting(obj, path: str | None = None, what: str = "pickle", limit: int = MAX_NESTING,
                  budget: int | None = None, paths: int | None = None) -> None:
    """Refuse (:class:`~zckpt.errors.CorruptFile`) an unpickled object whose containers nest deeper than ``limit``
    levels (or hold themselves: a cycle never ends): whatever walks it recursively (``repr``, a reader, ``json``)
    would fail with a RecursionError. Unpickling builds any depth without recursion: ``]]]...aaa`` is 10**6 nested
    lists in 2 MB, and memo references can hang a deep chain from a shallow place.

    Walked level by level, each level the distinct objects reached by a path of that length (``gc.get_referents``:
    the items, keys, values and stand-ins' state, in C): as many levels as the longest path, each object once per
    level. ``budget`` (default: ``limit`` times the objects of the first levels, at least 10**6) bounds the visits a
    crafted sharing of deep chains could multiply; past it the pickle is refused too.

    ``paths``: the most containers a walk that does not remember what it has seen (``repr``, ``json``, a
    converter) may reach, every path counted: 40 tuples that each hold the one before twice are a pickle of a few
    hundred bytes and 2**40 paths (a "billion laughs"), refused. The paths are counted only from a level where some
    object is reached twice (in C until then)."""
    get, leaves = gc.get_referents, _LEAF_TYPES
    level, depth, visits, reached = [obj], 0, 0, 0
    heavy: dict = {}  # id -> paths reaching it, for the objects of this level reached by more than one
    while level:
        depth += 1
        if depth > limit:
            raise CorruptFile(f"{what} nests containers deeper than {limit} levels (or holds itself): not a "
                              "checkpoint's metadata", path=path)
        visits += len(level)
        if budget is None and depth == 4:
            budget = max(10**6, 8 * visits)
        if budget is not None and visits > budget:
            raise CorruptFile(f"{what} reaches its containers by too many paths ({visits} visits): not a "
                              "checkpoint's metadata", path=path)
        reached += len(level) + sum(heavy.values()) - len(heavy)
        if paths is not None and reached > paths:
            raise CorruptFile(f"{what} shares its containers so that a walk of it would reach more than {paths} of "
                              "them (a pickle bomb): not a checkpoint's metadata", path=path)
        if not heavy:  # one path to each: the next level's counts are how often each child is referred to
            refs = [x for x in get(*level) if type(x) not in leaves]
            nxt = {id(x): x for x in refs}
            if paths is not None and len(nxt) < len(refs):
                heavy = {k: v for k, v in Counter(map(id, refs)).items() if v > 1}
            level = list(nxt.values())
            continue
        ones = [x for x in level if id(x) not in heavy]
        refs = [x for x in get(*ones) if type(x) not in leaves]
        counts = Counter(map(id, refs))
        nxt = {id(x): x for x in refs}
        for x in [x for x in level if id(x) in heavy]:  # (each reached by several paths: its children by as many)
            c = heavy[id(x)]
            for y in get(x):
                if type(y) not in leaves:
                    counts[id(y)] += c
                    nxt[id(y)] = y
        heavy = {k: v for k, v in counts.items() if v > 1}
        level = list(nxt.values())


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise UnsafePickle(f"pickle names the global '{module}.{name}' where only plain data belongs")

    def persistent_load(self, pid):
        raise CorruptFile("unexpected persistent id in a plain-data pickle")


def plain_loads(data: bytes, path: str | None = None, what: str = "pickle"):
    """Unpickle ``data`` (already :func:`scan` ned) that may hold only ints, strings, lists, dicts, tuples, bools:
    no global is resolved and no persistent id answered."""
    try:
        obj = _PlainUnpickler(io.BytesIO(data), encoding="utf-8").load()
        check_nesting(obj, path, what, budget=2 * len(data) + 10**6, paths=64 * len(data) + 10**7)
        return obj
    except (CorruptFile, UnsafePickle) as exc:
        if exc.path is None:
            exc.path = path
        raise
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError ...
        raise CorruptFile(f"damaged {what} ({type(exc).__name__}: {exc})"[:300], path=path) from None
