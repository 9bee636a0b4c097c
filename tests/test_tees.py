"""Input bytes read once for a cast and a copy (zckpt.engine.tees): the cast job writes the source bytes a plain copy
would read again. Every file's bytes and every slot's CRC-32 are the ones written without sharing, whatever the cut
of either side's jobs; the shared bytes are read once; a failure in a shared write closes every file; and convert
--to deepspeed, whose masters are both copied and cast, writes what it wrote before."""

from __future__ import annotations

import os
import random
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from zckpt.encoding import tensors
from zckpt.engine import executor, lanes, tees
from zckpt.engine.segments import Cast, Fill, Piece


def _cuts(rng, lo, hi, most):
    """[lo, hi) cut into runs of 1..most elements."""
    out = []
    while lo < hi:
        n = min(hi - lo, rng.randint(1, most))
        out.append((lo, lo + n))
        lo += n
    return out


def _plan(tmp_path, seed):
    """A source file of fp32 values (some NaN) and three outputs: two of plain copies of runs of it (zero fill and
    literal bytes between, one run copied into both), one of fp32 -> bf16 casts of runs that overlap them, cut
    elsewhere."""
    rng = random.Random(seed)
    vals = np.random.default_rng(seed).standard_normal(3000).astype(np.float32)
    vals[rng.sample(range(3000), 5)] = np.nan
    src = tmp_path / f"src{seed}"
    base = rng.choice([0, 8, 64])  # the values' offset in the file
    src.write_bytes(bytes(base) + vals.tobytes())
    p = str(src)

    def piece(a, b):
        return Piece(p, base + 4 * a, b - a, "float32")

    def copy_jobs(runs):
        jobs, pos = [], 0
        for k, (a, b) in enumerate(runs):
            parts = [piece(x, y) for x, y in _cuts(rng, a, b, 97)]
            if k % 3 == 1:
                parts.insert(rng.randrange(len(parts) + 1), Fill(rng.randint(1, 9), "float32"))
            if k % 4 == 2:
                parts.insert(0, bytes(4 * rng.randint(1, 3)))
            n = sum(len(x) if isinstance(x, bytes) else x.nbytes for x in parts)
            jobs.append((k % 2, pos, parts, "float32"))
            pos += n
        return jobs, pos

    jobs_a, size_a = copy_jobs(_cuts(rng, 0, 1800, 400))
    jobs_b, size_b = copy_jobs(_cuts(rng, 1500, 2600, 300))  # 1500-1800 copied into both
    casts, pos = [], 0
    for a, b in _cuts(rng, 200, 3000, 500):  # 2600-3000: cast only
        pieces = [piece(x, y) for x, y in _cuts(rng, a, b, 150)]
        casts.append((0, pos, [Cast(pieces, "float32")], "bfloat16"))
        pos += 2 * (b - a)
    return [("a", jobs_a, size_a), ("b", jobs_b, size_b), ("c", casts, pos)]


def _write(tmp_path, plan, name, share):
    targets = []
    for k, (fname, jobs, size) in enumerate(plan):
        path = tmp_path / f"{name}-{fname}"
        lanes.create(str(path), size)
        targets.append(lanes.Target(k, str(path), list(jobs)))
    shared = tees.share_reads(targets) if share else 0
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(3) as pool:
            got = lanes.write_files(targets, pool, w, lanes=3)
    finally:
        w.close()
    return shared, got, [(tmp_path / f"{name}-{f}").read_bytes() for f, _, _ in plan]


@pytest.mark.parametrize("seed", range(6))
def test_shared_reads_write_the_bytes_and_crcs_of_separate_reads(tmp_path, monkeypatch, seed):
    plan = _plan(tmp_path, seed)
    read = [0]
    real = tensors.Reader.read_raw
    lock = threading.Lock()

    def counted(self, piece, buf):
        with lock:
            read[0] += piece.nbytes
        return real(self, piece, buf)

    monkeypatch.setattr(tensors.Reader, "read_raw", counted)
    _, crcs, files = _write(tmp_path, plan, "apart", share=False)
    apart = read[0]
    read[0] = 0
    shared, crcs2, files2 = _write(tmp_path, plan, "shared", share=True)
    assert files2 == files and crcs2 == crcs
    # the casts read 200-3000, the copies 0-1800 and 1500-2600: 200-2600 is written from the casts' reads (where
    # two copies' pieces overlap in 1500-1800, the part of the second the first does not hold may be read again)
    assert 4 * 2100 <= shared <= 4 * 2400
    assert read[0] == apart - shared
    for (k, slot), (crc, n) in crcs.items():  # each slot's CRC is the one of its bytes, in file order
        data = b"".join(files[k][off:off + _job_bytes(parts, dtype)] for s, off, parts, dtype in plan[k][1]
                        if s == slot)
        assert (zlib.crc32(data), len(data)) == (crc, n)


def _job_bytes(parts, dtype):
    size = 2 if dtype == "bfloat16" else 4
    return sum(len(x) if isinstance(x, bytes) else x.numel * size for x in parts)


def test_a_failed_shared_write_closes_every_file(tmp_path, monkeypatch):
    plan = _plan(tmp_path, 7)
    calls, real = [0], executor.pwrite_all

    def flaky(fd, data, offset):
        calls[0] += 1
        if calls[0] == 12:
            raise OSError(28, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(tees, "pwrite_all", flaky)
    monkeypatch.setattr(executor, "pwrite_all", flaky)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as e:
        _write(tmp_path, plan, "x", share=True)
    assert e.value.errno == 28
    assert set(os.listdir("/proc/self/fd")) <= before | {str(fd) for fd in range(3)}


def test_copies_of_other_dtypes_or_misaligned_bytes_are_not_shared(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(bytes(range(256)) * 16)
    p = str(src)
    copy16 = lanes.Target(0, "a", [(0, 0, [Piece(p, 0, 512, "bfloat16")], "bfloat16")])  # the same bytes as bf16
    copy32 = lanes.Target(1, "b", [(0, 0, [Piece(p, 2, 100, "float32")], "float32")])  # 2 bytes off the cast's
    cast = lanes.Target(2, "c", [(0, 0, [Cast([Piece(p, 0, 256, "float32")], "float32")], "bfloat16")])
    assert tees.share_reads([copy16, copy32, cast]) == 0
    assert type(cast.jobs[0][2][0]) is Cast and [t.tee_in for t in (copy16, copy32, cast)] == [0, 0, 0]


def test_convert_to_deepspeed_reads_each_master_once_and_writes_what_it_wrote(tmp_path, monkeypatch):
    import zckpt
    from tests.test_distributed import FIX, assert_same_output

    dcp = tmp_path / "dcp"
    zckpt.convert(str(FIX / "z2_bf16_ws2"), str(dcp), to="dcp")
    monkeypatch.setattr(tees, "SHARE_READS", True)  # (opt-in: ZCKPT_SHARE_READS=1)
    got, real = [], tees.share_reads
    monkeypatch.setattr(tees, "share_reads", lambda targets: got.append(real(targets)) or got[-1])
    out = tmp_path / "out"
    args = dict(to="deepspeed", world_size=3, stage=2, dtype="bf16", buffers=[])
    res = zckpt.convert(str(dcp), str(out), **args)
    monkeypatch.setattr(tees, "share_reads", lambda targets: 0)
    zckpt.convert(str(dcp), str(tmp_path / "apart"), **args)
    masters = sum(p.nbytes for r in zckpt.open_checkpoint(str(dcp)).records if r.kind == "trainable"
                  for p in r.value)
    assert got == [masters] and masters > 0  # every master read once, for its copy and its cast
    assert res.to_json()["stats"]["read_once_bytes"] == masters
    assert_same_output(tmp_path / "apart", out)


def test_a_file_written_by_tees_alone_is_finished_once_with_its_crc(tmp_path):
    """Every byte of a copied file is also cast elsewhere: it has no job of its own left, and is still written,
    given its headers once (with the CRC-32 of its bytes) and closed, after the last tee into it."""
    vals = (np.arange(4096) % 256).astype(np.float32).tobytes()  # exact in bf16: the upper half of their bits
    (tmp_path / "src").write_bytes(vals)
    p = str(tmp_path / "src")
    copy = lanes.Target(0, str(tmp_path / "copy"), [(0, off, [Piece(p, off, 256, "float32")], "float32")
                                                    for off in range(0, len(vals), 1024)])
    cast = lanes.Target(1, str(tmp_path / "cast"), [(0, 2 * a, [Cast([Piece(p, 4 * a, b - a, "float32")], "float32")],
                                                     "bfloat16") for a, b in ((0, 1000), (1000, 3000), (3000, 4096))])
    for t, size in ((copy, len(vals)), (cast, len(vals) // 2)):
        lanes.create(t.path, size)
    assert tees.share_reads([copy, cast]) == len(vals) and copy.jobs == [] and copy.tee_in == 3
    done = []
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(2) as pool:
            got = lanes.write_files([copy, cast], pool, w, done=lambda t, fd: done.append((t.key, dict(t.crcs))))
    finally:
        w.close()
    assert (tmp_path / "copy").read_bytes() == vals
    assert sorted(k for k, _ in done) == [0, 1]
    assert dict(done)[0] == {0: (zlib.crc32(vals), len(vals))} and got[(0, 0)] == (zlib.crc32(vals), len(vals))
    assert (tmp_path / "cast").read_bytes() == (np.frombuffer(vals, np.uint32) >> 16).astype(np.uint16).tobytes()


def test_cast_jobs_are_dealt_in_turn_by_the_file_their_tees_write(tmp_path):
    """In plan order the casts in flight would all tee into one rank's optimizer file (the masters of one rank lie
    together); after sharing, the cast target's jobs alternate between the files their tees write into, in
    proportion to their numbers, each file's jobs in their order; the bytes written are those of plan order."""
    vals = np.random.default_rng(3).standard_normal(6000).astype(np.float32)
    (tmp_path / "src").write_bytes(vals.tobytes())
    p = str(tmp_path / "src")
    split = 4000  # file A copies the first 4000 values, B the last 2000: casts of 500 values, 8 into A, 4 into B
    copies = [lanes.Target(k, str(tmp_path / name), [(0, off, [Piece(p, 4 * (lo + off // 4), 250, "float32")],
                                                      "float32") for off in range(0, 4 * (hi - lo), 1000)])
              for k, (name, lo, hi) in enumerate((("A", 0, split), ("B", split, 6000)))]
    cast = lanes.Target(2, str(tmp_path / "cast"), [(0, 2 * a, [Cast([Piece(p, 4 * a, 500, "float32")], "float32")],
                                                     "bfloat16") for a in range(0, 6000, 500)])
    planned = list(cast.jobs)
    assert tees.share_reads([*copies, cast]) == 4 * 6000
    into = ["AB"[copies.index(job[2][0].tees[0].target)] for job in cast.jobs]
    assert "".join(into) == "ABAABAABAABA"  # (in plan order: AAAAAAAABBBB)
    offsets = [job[1] for job in cast.jobs]
    assert sorted(offsets) == [job[1] for job in planned]
    assert [o for o, f in zip(offsets, into) if f == "A"] == sorted(o for o, f in zip(offsets, into) if f == "A")
    for t, size in ((copies[0], 4 * split), (copies[1], 4 * (6000 - split)), (cast, 2 * 6000)):
        lanes.create(t.path, size)
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(2) as pool:
            lanes.write_files([*copies, cast], pool, w)
    finally:
        w.close()
    assert (tmp_path / "A").read_bytes() == vals[:split].tobytes()
    assert (tmp_path / "B").read_bytes() == vals[split:].tobytes()
    want = (vals.view(np.uint32).astype(np.uint64) + 0x7FFF + ((vals.view(np.uint32) >> 16) & 1)) >> 16
    assert (tmp_path / "cast").read_bytes() == want.astype(np.uint16).tobytes()
