"""The engine's small helpers against plain references: chunks() of segments (a whole piece is taken as it is, the
rest sliced) and pwrite_pieces() (runs of adjacent pieces written as one)."""

from __future__ import annotations

import os
import random

import pytest

from zckpt.engine.executor import chunks, pwrite_pieces
from zckpt.engine.segments import Cast, Fill, Piece, seg_numel, slice_segments


def _reference_chunks(segments, dtype, chunk_bytes):
    """executor.chunks as it was before whole pieces were taken unsliced."""
    per = max(1, chunk_bytes // max({"float32": 4, "bfloat16": 2}[dtype], 4))
    pos, cur, cur_n, cur_start, out = 0, [], 0, 0, []
    size = {"float32": 4, "bfloat16": 2}[dtype]
    for seg in segments:
        if isinstance(seg, (bytes, bytearray)):
            parts = [seg]
        else:
            n = seg_numel(seg, dtype)
            parts = [p for s in range(0, n, per) for p in slice_segments([seg], s, min(per, n - s))] if n else []
        for part in parts:
            pn = seg_numel(part, dtype)
            if cur and cur_n + pn > per:
                out.append((cur_start, cur))
                cur, cur_n, cur_start = [], 0, pos
            cur.append(part)
            cur_n += pn
            pos += pn * size
    if cur:
        out.append((cur_start, cur))
    return out


def test_chunks_match_the_sliced_reference():
    rng = random.Random(5)
    for _ in range(300):
        segs = []
        for _ in range(rng.randint(1, 6)):
            kind, n = rng.random(), rng.choice([0, 1, 3, 255, 256, 257, 1000, 4096])
            if kind < 0.6:
                segs.append(Piece(f"/r{rng.randint(0, 2)}", rng.randint(0, 99) * 4, n, "float32"))
            elif kind < 0.8:
                segs.append(Fill(n, "float32"))
            elif kind < 0.9:
                segs.append(Cast([Piece("/b", 2 * rng.randint(0, 50), n, "bfloat16")], "bfloat16"))
            else:
                segs.append(bytes(4 * (n % 16)))
        chunk = rng.choice([4, 64, 1024, 4096, 1 << 20])
        assert list(chunks(segs, "float32", chunk)) == _reference_chunks(segs, "float32", chunk)


def test_pwrite_pieces_writes_runs_and_leaves_gaps(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"." * 40)
    pieces = [(10, b"BB"), (0, b"AAA"), (3, b""), (3, b"aa"), (12, b"CC"), (30, b"Z")]
    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_pieces(fd, pieces, base=2)
    finally:
        os.close(fd)
    want = bytearray(b"." * 40)
    for off, data in pieces:
        want[2 + off:2 + off + len(data)] = data
    assert path.read_bytes() == bytes(want)


def test_read_crc_gives_the_pieces_bytes_and_crc(tmp_path):
    """``Reader.read_crc``: the bytes and the CRC-32 of pieces of several sizes and offsets; a file cut short is
    refused with its name."""
    import os
    import zlib
    from zckpt.encoding import tensors
    from zckpt.engine.segments import Piece
    from zckpt.errors import CorruptFile
    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    reader = tensors.Reader()
    for offset, n in ((0, 100), (7, 4096), (3, 3 * 4096), (11, 4 * 4096 + 77), (0, len(data))):
        buf = bytearray(n + 8)
        crc = reader.read_crc(Piece(str(path), offset, n, "uint8"), memoryview(buf))
        assert bytes(buf[:n]) == data[offset:offset + n] and crc == zlib.crc32(data[offset:offset + n])
    with pytest.raises(CorruptFile, match="short read") as err:
        reader.read_crc(Piece(str(path), len(data) - 10, 4096 + 20, "uint8"), memoryview(bytearray(5000)))
    assert str(path) in str(err.value) or err.value.path == str(path)
