"""The engine's small helpers against plain references: chunks() of segments (cut on the file's grid, a whole piece
taken as it is), works.joined() (a file's jobs joined inside one cell of that grid)
and pwrite_pieces() (runs of adjacent pieces written as one)."""

from __future__ import annotations

import os
import random

import pytest

from zckpt.engine import executor, works
from zckpt.engine.executor import chunks, pwrite_pieces
from zckpt.engine.segments import Cast, Fill, Piece, seg_numel, slice_segments


SIZE = {"float32": 4, "bfloat16": 2}


def _elements(segs, dtype):
    """One token per output element: where it comes from (file and byte, zero, cast source, literal byte run)."""
    out = []
    for g in segs:
        if isinstance(g, (bytes, bytearray)):
            out += [("bytes", id(g), i) for i in range(len(g) // SIZE[dtype])]
        elif isinstance(g, Fill):
            out += [("zero", g.dtype)] * g.numel
        elif isinstance(g, Piece):
            out += [(g.path, g.offset + i * SIZE[g.dtype], g.dtype) for i in range(g.numel)]
        else:
            out += [("cast", g.src_dtype, *e) for e in _elements(g.pieces, g.src_dtype)]
    return out


def _random_segments(rng, dtype):
    other = "bfloat16" if dtype == "float32" else "float32"
    segs = []
    for _ in range(rng.randint(1, 6)):
        kind, n = rng.random(), rng.choice([0, 1, 3, 255, 256, 257, 1000, 4096])
        if kind < 0.5:
            segs.append(Piece(f"/r{rng.randint(0, 2)}", rng.randint(0, 99) * SIZE[dtype], n, dtype))
        elif kind < 0.65:
            segs.append(Fill(n, dtype))
        elif kind < 0.8:
            segs.append(Cast([Piece("/b", SIZE[other] * rng.randint(0, 50), n, other)], other))
        elif kind < 0.9:
            cut = rng.randint(0, n)
            segs.append(Cast([Piece("/c", 0, cut, other), Piece("/d", 8 * rng.randint(0, 9), n - cut, other)],
                             other))
        else:
            segs.append(bytes(SIZE[dtype] * (n % 16)))
    return segs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_cut_on_the_files_grid(dtype):
    """Pieces, fills, casts of one or several pieces and literal bytes, the tensor at any offset of its file: the
    jobs hold the segments' elements in order, each job's offset is where the ones before it end, every cut but
    those after literal bytes falls on the file's grid of a job's bytes, no job is longer than one cell of it
    (unless literal bytes made it so), and a segment that fits one job is taken as it is."""
    rng = random.Random(5)
    for _ in range(400):
        segs = _random_segments(rng, dtype)
        chunk = rng.choice([4, 64, 1024, 4096, 1 << 20] if sum(seg_numel(g, dtype) for g in segs) < 5000 else
                           [1024, 4096, 1 << 20])
        start = rng.choice([0, SIZE[dtype] * rng.randint(0, 5000), 14064])
        jobs = list(chunks(segs, dtype, chunk, start))
        grid = max(1, chunk // max(SIZE[dtype], 4)) * SIZE[dtype]
        got = [e for _, parts in jobs for e in _elements(parts, dtype)]
        assert got == _elements(segs, dtype)
        pos = 0
        for k, (off, parts) in enumerate(jobs):
            assert off == pos
            n = sum(seg_numel(p, dtype) for p in parts) * SIZE[dtype]
            literal = any(isinstance(p, (bytes, bytearray)) for p in parts)
            after_literal = k and any(isinstance(p, (bytes, bytearray)) for p in jobs[k - 1][1])
            if k and not after_literal and executor.ALIGN_JOBS:
                assert (start + off) % grid == 0, (k, off, start, grid)
            if not literal:
                assert 0 < n <= grid
            pos += n
        whole = {id(p) for _, parts in jobs for p in parts}
        for g in segs:
            n = seg_numel(g, dtype)
            if isinstance(g, Piece) and 0 < n and any(p is g for _, parts in jobs for p in parts):
                assert id(g) in whole
        assert all(p.numel for _, parts in jobs for p in parts if not isinstance(p, (bytes, bytearray)))


@pytest.mark.skipif(not executor.ALIGN_JOBS, reason="ZCKPT_ALIGN_JOBS=0: cut from each tensor's start")
def test_a_tensor_on_the_grid_is_cut_as_from_its_start():
    p = Piece("/r", 12, 10_000, "float32")
    assert [off for off, _ in chunks([p], "float32", 4096, 8192)] == list(range(0, 40_000, 4096))
    first = [off for off, _ in chunks([p], "float32", 4096, 8192 + 100)]
    assert first[:3] == [0, 3996, 3996 + 4096]


def test_a_files_jobs_join_inside_one_cell_of_the_grid():
    """Small tensors and the heads and tails of long ones, back to back in a file, are joined into the job of
    their grid cell; never across a cell, a dtype or a CRC slot."""
    f32 = "float32"
    tensors = [(100, [Piece("/a", 0, 10, f32)]), (140, [Piece("/a", 40, 2000, f32)]),
               (8140, [Piece("/b", 0, 5, f32)]), (8160, [Piece("/b", 20, 3, f32)])]
    jobs = [(-1, off + s, parts, f32) for off, segs in tensors for s, parts in chunks(segs, f32, 4096, off)]
    got = works.joined(jobs, 4096)
    if not executor.ALIGN_JOBS:
        assert got == jobs
        return
    # cells [0, 4096) and [4096, 8192): the first tensor with the long one's head; its tail with the two small ones
    assert [(off, works.job_bytes(parts, f32)) for _, off, parts, _ in got] == [(100, 3996), (4096, 8172 - 4096)]
    assert [len(parts) for _, _, parts, _ in got] == [2, 3]
    assert sum(works.job_bytes(parts, f32) for _, _, parts, _ in got) == 40 + 8000 + 20 + 12
    for _, off, parts, _ in got:
        assert off // 4096 == (off + works.job_bytes(parts, f32) - 1) // 4096
    other = [(-1, 0, [Piece("/a", 0, 10, f32)], f32), (-1, 40, [Piece("/a", 0, 10, "bfloat16")], "bfloat16"),
             (3, 60, [Piece("/a", 0, 10, "bfloat16")], "bfloat16"), (3, 80, [Piece("/a", 0, 1, "bfloat16")],
                                                                      "bfloat16")]
    assert [j[1] for j in works.joined(other, 4096)] == [0, 40, 60]


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
