"""Pickle streams walked without being run: where one ends, and whether its memo use is forged.

Used by :mod:`zckpt.formats.safeload` (``data.pkl`` of a torch zip) and :mod:`zckpt.formats.legacy` (the five
pickles a legacy torch file starts with, one after another, their lengths written nowhere). One pass over the
opcodes (the walk of ``pickletools.genops`` without building its argument objects: about twice as fast).
"""

from __future__ import annotations

import io
import pickle
import pickletools

from zckpt.errors import CorruptFile, UnsafePickle

_MEMO_OPS = ("PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET")


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


class Truncated(CorruptFile):
    """The data ends before the pickle's STOP opcode (a reader with more of the file may read on)."""


def scan(data, start: int = 0, path: str | None = None, what: str = "data.pkl", limit: int | None = None) -> int:
    """The offset just after the STOP opcode of the pickle starting at ``data[start]``.

    Refuses (:class:`~zckpt.errors.CorruptFile`) an unknown opcode and a memo index past the pickle's own length:
    ``LONG_BINPUT 678654301`` (5 bytes) makes CPython grow its memo table to that index (gigabytes), and a real
    memo index is below the number of opcodes. ``limit``: the largest memo index allowed (default: the pickle's
    own length, known at its STOP). Raises :class:`Truncated` when ``data`` ends first."""
    end, pos = len(data), start
    bound = limit if limit is not None else end - start
    table, lengths = _OPCODES, _LENGTH_BYTES
    top = 0  # the largest memo index used

    def damaged(why: str, cls=CorruptFile):
        return cls(f"damaged pickle in {what} ({why} at byte {pos})", path=path)

    while pos < end:
        code = data[pos]
        entry = table.get(code)
        if entry is None:
            raise damaged(f"unknown opcode {code:#04x}")
        pos += 1
        n, lines, memo = entry
        if code == 0x2E:  # STOP
            own = limit if limit is not None else pos - start
            if top > own:
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


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise UnsafePickle(f"pickle names the global '{module}.{name}' where only plain data belongs")

    def persistent_load(self, pid):
        raise CorruptFile("unexpected persistent id in a plain-data pickle")


def plain_loads(data: bytes, path: str | None = None, what: str = "pickle"):
    """Unpickle ``data`` (already :func:`scan` ned) that may hold only ints, strings, lists, dicts, tuples, bools:
    no global is resolved and no persistent id answered."""
    try:
        return _PlainUnpickler(io.BytesIO(data), encoding="utf-8").load()
    except (CorruptFile, UnsafePickle) as exc:
        if exc.path is None:
            exc.path = path
        raise
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError ...
        raise CorruptFile(f"damaged {what} ({type(exc).__name__}: {exc})"[:300], path=path) from None
