"""Output files written through a map of them (zckpt.engine.mapped, ZCKPT_MAP_WRITES=1): every file's bytes and
every slot's CRC-32 are the ones pwrite gives, whatever the jobs (copies with zero fill and literal bytes between,
casts with NaN); a file whose blocks are not all allocated is not mapped; a failure midway leaves no map and no file
open; a damaged input is still refused; and the real jobs write what they write without maps."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from zckpt.engine import executor, lanes, mapped
from tests.test_tees import _plan


def _targets(tmp_path, plan, name):
    targets = []
    for k, (fname, jobs, size) in enumerate(plan):
        path = tmp_path / f"{name}-{fname}"
        lanes.create(str(path), size)
        targets.append(lanes.Target(k, str(path), list(jobs)))
    return targets


def _write(tmp_path, plan, name, workers=3):
    targets = _targets(tmp_path, plan, name)
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(workers) as pool:
            got = lanes.write_files(targets, pool, w, lanes=3)
    finally:
        w.close()
    assert all(t.map is None and t.fd is None for t in targets)
    return got, [(tmp_path / f"{name}-{f}").read_bytes() for f, _, _ in plan]


def _count_mapped(monkeypatch):
    took, lock, real = [0], threading.Lock(), mapped.write

    def counted(*a, **k):
        got = real(*a, **k)
        with lock:
            took[0] += got is not None
        return got

    monkeypatch.setattr(mapped, "write", counted)
    return took


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drop", [False, True])
def test_mapped_writes_give_the_bytes_and_crcs_of_pwrite(tmp_path, monkeypatch, seed, drop):
    plan = _plan(tmp_path, seed)
    monkeypatch.setattr(mapped, "MAP_WRITES", False)
    crcs, files = _write(tmp_path, plan, "pwrite")
    monkeypatch.setattr(mapped, "MAP_WRITES", True)
    monkeypatch.setattr(mapped, "MAP_DROP", drop)
    took = _count_mapped(monkeypatch)
    crcs2, files2 = _write(tmp_path, plan, "mapped")
    assert files2 == files and crcs2 == crcs
    literal = sum(1 for _, jobs, _ in plan for _, _, parts, _ in jobs if any(isinstance(p, bytes) for p in parts))
    assert took[0] == sum(len(jobs) for _, jobs, _ in plan) - literal  # every job but those with literal bytes


def test_only_files_with_every_block_allocated_are_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "MAP_WRITES", True)
    sparse, full, empty = (str(tmp_path / n) for n in ("sparse", "full", "empty"))
    with open(sparse, "wb") as f:
        f.truncate(1 << 20)  # no block: a full disk would meet a page of it as SIGBUS
    lanes.create(full, 1 << 20)
    lanes.create(empty, 0)
    for path, want in ((sparse, False), (full, os.fstat(os.open(full, os.O_RDONLY)).st_blocks * 512 >= 1 << 20),
                       (empty, False)):
        fd = os.open(path, os.O_RDWR)
        try:
            view = mapped.open_map(fd)
            assert (view is not None) == want, path
            mapped.close_map(view)
        finally:
            os.close(fd)
    fd = os.open(full, os.O_RDWR)
    try:
        monkeypatch.setattr(mapped, "_MAP_FS", set())  # a filesystem not known to map so (NFS, Lustre...)
        assert mapped.open_map(fd) is None
        monkeypatch.undo()
        monkeypatch.setattr(mapped, "MAP_WRITES", False)
        assert mapped.open_map(fd) is None
    finally:
        os.close(fd)


def test_a_failure_in_a_mapped_job_leaves_no_map_and_no_file_open(tmp_path, monkeypatch):
    from zckpt.encoding import tensors
    plan = _plan(tmp_path, 5)
    monkeypatch.setattr(mapped, "MAP_WRITES", True)
    calls, real, lock = [0], tensors.Reader.read_raw, threading.Lock()

    def flaky(self, piece, buf):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 15:
            raise OSError(5, "Input/output error")
        return real(self, piece, buf)

    monkeypatch.setattr(tensors.Reader, "read_raw", flaky)
    before = set(os.listdir("/proc/self/fd"))
    targets = _targets(tmp_path, plan, "x")
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(3) as pool:
            with pytest.raises(OSError) as e:
                lanes.write_files(targets, pool, w, lanes=3)
    finally:
        w.close()
    assert e.value.errno == 5
    assert all(t.map is None and t.fd is None for t in targets)
    assert set(os.listdir("/proc/self/fd")) <= before | {str(fd) for fd in range(3)}
    maps = open("/proc/self/maps").read()
    assert not any(f"x-{f}" in maps for f, _, _ in plan)  # every map of them unmapped


@pytest.mark.parametrize("job", ["merge-fp32", "merge-bf16", "reshard", "convert-dcp", "convert-ds"])
def test_the_jobs_write_through_maps_what_they_write_with_pwrite(tmp_path, monkeypatch, job):
    import zckpt
    from tests.test_distributed import FIX, assert_same_output

    src = str(FIX / "z2_bf16_ws4")
    dcp = tmp_path / "dcp"
    if job == "convert-ds":
        zckpt.convert(src, str(dcp), to="dcp")
    run = {
        "merge-fp32": lambda out: zckpt.merge(src, str(out), max_shard_size="500B", workers=4),
        "merge-bf16": lambda out: zckpt.merge(src, str(out), dtype="bf16", workers=4),
        "reshard": lambda out: zckpt.reshard(src, str(out), world_size=3, workers=4),
        "convert-dcp": lambda out: zckpt.convert(src, str(out), to="dcp", workers=4),
        "convert-ds": lambda out: zckpt.convert(str(dcp), str(out), to="deepspeed", world_size=3, stage=2,
                                                dtype="bf16", buffers=[], workers=4),
    }[job]
    out = tmp_path / "out"  # one path for both: DCP's .metadata records it
    monkeypatch.setattr(mapped, "MAP_WRITES", False)
    run(out)
    out.rename(tmp_path / "pwrite")
    monkeypatch.setattr(mapped, "MAP_WRITES", True)
    took = _count_mapped(monkeypatch)
    run(out)
    assert took[0] > 0
    assert_same_output(tmp_path / "pwrite", out)
    r = zckpt.diff(str(tmp_path / "pwrite"), str(out))
    assert r.ok and r.counts["differ"] == 0, r.summary()


def test_a_flipped_master_is_refused_through_a_map(tmp_path, monkeypatch):
    import shutil
    import zckpt
    from zckpt.errors import CorruptFile
    from tests.test_distributed import FIX

    src = tmp_path / "src"
    shutil.copytree(FIX / "z2_bf16_ws4", src)
    ckpt = zckpt.open_checkpoint(str(src))
    piece = next(p for r in ckpt.records if r.kind == "trainable" for p in r.value)
    with open(piece.path, "r+b") as f:  # one byte of a master flipped (its zip entry's CRC-32 no longer holds)
        f.seek(piece.offset)
        b = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([b[0] ^ 0x10]))
    monkeypatch.setattr(mapped, "MAP_WRITES", True)
    took = _count_mapped(monkeypatch)
    with pytest.raises(CorruptFile):
        zckpt.merge(str(src), str(tmp_path / "out"), workers=4)
    assert took[0] > 0 and not (tmp_path / "out").exists()
