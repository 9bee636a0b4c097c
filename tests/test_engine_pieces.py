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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_match_the_sliced_reference(dtype):
    """Pieces, fills, casts of one or several pieces and literal bytes: long pieces and one-piece casts are cut by
    arithmetic, the rest by slice_segments; the jobs are the reference's either way."""
    rng = random.Random(5)
    other = "bfloat16" if dtype == "float32" else "float32"
    size = {"float32": 4, "bfloat16": 2}
    for _ in range(300):
        segs = []
        for _ in range(rng.randint(1, 6)):
            kind, n = rng.random(), rng.choice([0, 1, 3, 255, 256, 257, 1000, 4096])
            if kind < 0.5:
                segs.append(Piece(f"/r{rng.randint(0, 2)}", rng.randint(0, 99) * size[dtype], n, dtype))
            elif kind < 0.65:
                segs.append(Fill(n, dtype))
            elif kind < 0.8:
                segs.append(Cast([Piece("/b", size[other] * rng.randint(0, 50), n, other)], other))
            elif kind < 0.9:
                cut = rng.randint(0, n)
                segs.append(Cast([Piece("/c", 0, cut, other), Piece("/d", 8 * rng.randint(0, 9), n - cut, other)],
                                 other))
            else:
                segs.append(bytes(size[dtype] * (n % 16)))
        chunk = rng.choice([4, 64, 1024, 4096, 1 << 20] if sum(seg_numel(g, dtype) for g in segs) < 5000 else
                           [1024, 4096, 1 << 20])
        assert list(chunks(segs, dtype, chunk)) == _reference_chunks(segs, dtype, chunk)


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
