"""Several output files at once (zckpt.engine.lanes): the deal paces at most ``lanes`` files by their jobs, each
file's jobs in order; the threads really write different files at the same time; the CRC-32 of every slot is the
one of its bytes; a failing job leaves no file open and no job running; durable files are fsynced."""

from __future__ import annotations

import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from zckpt.engine import executor, lanes, mapped


def _targets(tmp_path, sizes, chunk=64, slot=0):
    out = []
    for k, n in enumerate(sizes):
        data = bytes((k * 31 + i) % 251 for i in range(n))
        jobs = [(slot, off, [data[off:off + chunk]], "uint8") for off in range(0, n, chunk)]
        out.append((lanes.Target(k, str(tmp_path / f"f{k}"), jobs, size=n), data))
    return out


def test_the_deal_paces_at_most_lanes_files_by_their_jobs():
    ts = [lanes.Target(k, f"f{k}", [(0, i, [], "uint8") for i in range(n)]) for k, n in enumerate((3, 1, 2, 2))]
    order = [(t.key, job[1]) for t, job in lanes._deal(ts, 2)]
    # files of most jobs first (0, 2; then 3, then 1), each file's jobs in order, the one furthest behind next
    assert order == [(0, 0), (2, 0), (0, 1), (2, 1), (3, 0), (0, 2), (1, 0), (3, 1)]
    assert [(t.key, job[1]) for t, job in lanes._deal(ts, 1)] == [(k, i) for k, n in ((0, 3), (2, 2), (3, 2), (1, 1))
                                                                   for i in range(n)]


def test_files_dealt_together_are_dealt_their_last_jobs_together():
    """A file of 8 jobs among files of 6 (reshard's 2 GB model states among its 1.5 GB optimizer files): dealt
    round-robin it was written alone at the end; paced, every file's last job is among the last four dealt."""
    ts = [lanes.Target(k, f"f{k}", [(0, i, [], "uint8") for i in range(n)]) for k, n in enumerate((6, 6, 8, 6))]
    order = [(t.key, job[1]) for t, job in lanes._deal(ts, 4)]
    assert sorted(order) == sorted((k, i) for k, n in enumerate((6, 6, 8, 6)) for i in range(n))
    assert sorted(order[-4:]) == [(0, 5), (1, 5), (2, 7), (3, 5)]
    assert sorted(k for k, _ in order[:4]) == [0, 1, 2, 3]
    # a file opened when another finishes starts level with the open ones: its jobs interleave, not in one burst
    ts = [lanes.Target(k, f"f{k}", [(0, i, [], "uint8") for i in range(n)]) for k, n in enumerate((8, 2, 4))]
    keys = [t.key for t, _ in lanes._deal(ts, 2)]
    assert keys == [0, 2, 0, 0, 2, 0, 0, 2, 0, 0, 2, 1, 0, 1]
    ts = [lanes.Target(k, f"f{k}", [(0, i, [], "uint8") for i in range(n)]) for k, n in enumerate((8, 8, 6))]
    assert "".join(str(t.key) for t, _ in lanes._deal(ts, 16)) == "012012012010120120120" + "1"


def test_files_are_written_at_once_with_their_bytes_and_crcs(tmp_path, monkeypatch):
    pairs = _targets(tmp_path, [4096, 3000, 64, 0, 2500])
    targets = [t for t, _ in pairs]
    busy, seen, lock = {}, [], threading.Lock()
    real = executor.pwrite_all

    def slow(fd, data, offset):  # which files are being written at the same moment
        with lock:
            busy[fd] = busy.get(fd, 0) + 1
            seen.append(sum(1 for v in busy.values() if v))
        time.sleep(0.002)
        real(fd, data, offset)
        with lock:
            busy[fd] -= 1

    monkeypatch.setattr(executor, "pwrite_all", slow)
    headers = {}
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(4) as pool:
            got = lanes.write_files(targets, pool, w, lanes=4,
                                    done=lambda t, fd: headers.setdefault(t.key, len(t.crcs)))
    finally:
        w.close()
    assert max(seen) >= 3  # one process, four threads, four files at once
    for t, data in pairs:
        assert (tmp_path / f"f{t.key}").read_bytes() == data
        if data:
            assert got[(t.key, 0)] == (zlib.crc32(data), len(data))
    assert sorted(headers) == [0, 1, 2, 3, 4]  # every file finished, the empty one too


def test_a_failing_job_closes_every_file_and_waits_for_the_others(tmp_path, monkeypatch):
    pairs = _targets(tmp_path, [64 * 40] * 4)
    targets = [t for t, _ in pairs]
    running, calls, real, lock = [0], [0], executor.pwrite_all, threading.Lock()

    def flaky(fd, data, offset):
        with lock:
            running[0] += 1
            calls[0] += 1
            n = calls[0]
        try:
            if n == 9:
                raise OSError(28, "No space left on device")
            time.sleep(0.003)
            real(fd, data, offset)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(executor, "pwrite_all", flaky)
    before = set(os.listdir("/proc/self/fd"))
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(4) as pool:
            with pytest.raises(OSError) as e:
                lanes.write_files(targets, pool, w)
            assert running[0] == 0  # nothing still writing when the error reached the caller
    finally:
        w.close()
    assert e.value.errno == 28
    assert set(os.listdir("/proc/self/fd")) <= before | {str(fd) for fd in range(3)}
    assert all(t.fd is None for t in targets)


def test_durable_files_are_fsynced_and_then_closed(tmp_path, monkeypatch):
    pairs = _targets(tmp_path, [640, 640, 640])
    synced, closed = [], []
    real = os.fsync
    monkeypatch.setattr(lanes.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    w = executor.Worker()
    try:
        with ThreadPoolExecutor(2) as pool:
            lanes.write_files([t for t, _ in pairs], pool, w, durable=True, closed=lambda t: closed.append(t.key))
    finally:
        w.close()
    assert len(synced) == 3 and sorted(closed) == [0, 1, 2]
    for t, data in pairs:
        assert (tmp_path / f"f{t.key}").read_bytes() == data


@pytest.mark.parametrize("job", ["merge", "merge-pt", "reshard", "convert"])
def test_several_files_at_once_write_what_one_at_a_time_writes(tmp_path, monkeypatch, job):
    """The single-process jobs with their files dealt over 4 lanes and with one lane: the same bytes in every file
    (torch's random serialization ids and DCP's save id aside), the same marker."""
    import zckpt
    from tests.test_distributed import FIX, assert_same_output

    src = str(FIX / "z2_bf16_ws4")
    trainer = str(FIX / "trainer" / "checkpoint-4")  # a Trainer folder: DCP parts for the model and the optimizer
    run = {
        "merge": lambda out: zckpt.merge(src, str(out), max_shard_size="500B", workers=4),
        "merge-pt": lambda out: zckpt.merge(src, str(out), fmt="pt", max_shard_size="500B", workers=4),
        "reshard": lambda out: zckpt.reshard(src, str(out), world_size=3, workers=4),
        "convert": lambda out: zckpt.convert(trainer, str(out), to="dcp", workers=4),
    }[job]
    dealt = []
    real = lanes._deal
    monkeypatch.setattr(lanes, "_deal", lambda ts, n, *a: (dealt.append((len(ts), n)), real(ts, n, *a))[1])
    out = tmp_path / "out"  # one path for both: DCP's .metadata records it
    monkeypatch.setattr(lanes, "FILES_AT_ONCE", 1)
    run(out)
    out.rename(tmp_path / "one")
    monkeypatch.setattr(lanes, "FILES_AT_ONCE", 4)
    run(out)
    assert dealt[0][1] == 1 and dealt[-1][1] == 4 and dealt[-1][0] > 1  # really several files, really 4 lanes
    assert_same_output(tmp_path / "one", out)


MOE = "moe_z2_bf16_ws2_ep2"  # ep 2 -> 4 rewrites the optimizer and model states, copies the 4 expert files


def test_a_copied_file_is_jobs_cut_at_its_zip_entries():
    """copy_work: jobs of at most ``chunk`` bytes, in order, covering the file; no piece crosses an entry's bounds
    (each piece read is in one entry or between two, so its CRC-32 is part of one entry's)."""
    from tests.test_distributed import FIX
    from zckpt.engine.checked import zip_entries
    from zckpt.engine.works import copy_work

    path = str(next((FIX / MOE).glob("*/layer_0_expert_1_mp_rank_00_model_states.pt")))
    size, entries = os.path.getsize(path), [e for e in zip_entries(path) if e.size]
    assert len(entries) >= 4  # data.pkl, byteorder, version, the expert's storages...
    for chunk in (100, 1000, 1 << 20):
        w = copy_work("x.pt", path, size, chunk, entries)
        pos = 0
        for slot, off, parts, dtype in w.jobs:
            assert slot == -1 and dtype == "uint8" and off == pos and 0 < sum(p.numel for p in parts) <= chunk
            for p in parts:
                assert p.path == path and p.offset == pos
                for e in entries:  # inside the entry's data or outside it
                    lo, hi = e.data_offset, e.data_offset + e.size
                    assert p.offset + p.numel <= lo or p.offset >= hi or lo <= p.offset < p.offset + p.numel <= hi
                pos += p.numel
        assert pos == size and (chunk < size) == (len(w.jobs) > 1)
    assert copy_work("x", path, size, 1 << 20).jobs == [(-1, 0, [executor.Piece(path, 0, size, "uint8")], "uint8")]


def test_reshard_ep_writes_the_expert_files_through_the_lanes(tmp_path, monkeypatch):
    """The expert files a reshard --ep keeps are written by the lanes with the new files (no copy on the main
    thread first), each byte for byte its source, every entry's CRC checked from the bytes read (none re-read)."""
    import filecmp
    import shutil

    import zckpt
    from tests.test_distributed import FIX
    from zckpt.engine import checked

    dealt, reread = [], []
    real_deal, real_read = lanes._deal, checked.InputCheck._read_crc
    monkeypatch.setattr(lanes, "_deal", lambda ts, n, *a: (dealt.extend(os.path.basename(t.path) for t in ts),
                                                           real_deal(ts, n, *a))[1])
    monkeypatch.setattr(checked.InputCheck, "_read_crc", lambda self, path, off, n: (
        reread.append((os.path.basename(path), n)), real_read(self, path, off, n))[1])
    monkeypatch.setattr(shutil, "copyfile", lambda *a, **k: pytest.fail("copied outside the lanes"))
    out = tmp_path / "out"
    zckpt.reshard(str(FIX / MOE), str(out), world_size=4, ep=4)
    tag = (FIX / MOE / "latest").read_text().strip()
    experts = sorted(n for n in os.listdir(FIX / MOE / tag) if n.startswith("layer_"))
    assert len(experts) == 4 and set(experts) <= set(dealt)
    assert "mp_rank_00_model_states.pt" in dealt  # dealt together with the files written anew
    for n in experts:
        assert filecmp.cmp(FIX / MOE / tag / n, out / tag / n, shallow=False), n
    assert not [r for r in reread if r[0].startswith("layer_")], reread


@pytest.mark.parametrize("where", ["/data/", "/.data/serialization_id"])
def test_a_flipped_byte_in_a_copied_expert_file_is_refused(tmp_path, where):
    """A flipped byte in a kept expert file (an expert's weight, or an entry the reader never reads) fails the
    entry's CRC-32 as the lanes read it: refused in one line naming the file and the entry, nothing published."""
    import shutil

    import zckpt
    from tests.test_distributed import FIX
    from zckpt.engine.checked import zip_entries
    from zckpt.errors import ZckptError

    ck = shutil.copytree(FIX / MOE, tmp_path / "ck")
    path = next(ck.glob("*/layer_0_expert_2_mp_rank_00_model_states.pt"))
    e = next(e for e in zip_entries(str(path)) if e.size > 8 and where in e.name)
    with open(path, "r+b") as f:
        f.seek(e.data_offset + e.size // 2)
        b = f.read(1)
        f.seek(e.data_offset + e.size // 2)
        f.write(bytes([b[0] ^ 0x04]))
    with pytest.raises(ZckptError) as err:
        zckpt.reshard(str(ck), str(tmp_path / "o"), world_size=4, ep=4)
    assert path.name in str(err.value) and e.name.split("/", 1)[1] in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_read_across_entry_bounds_still_checks_every_entry_it_touches(tmp_path):
    """A span that crosses a zip entry's end (headers and two tensors read as one) is not dropped: each entry it
    touches is checked from the file itself, so a flipped byte in either is refused."""
    import zipfile

    from zckpt.engine.checked import InputCheck, zip_entries
    from zckpt.errors import CorruptFile

    path = tmp_path / "two.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("a/data/0", bytes(range(200)))
        z.writestr("a/data/1", bytes(range(50, 250)))
    e0, e1 = sorted(zip_entries(str(path)), key=lambda e: e.data_offset)
    raw = bytearray(path.read_bytes())
    raw[e1.data_offset + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    check = InputCheck()
    start, end = e0.data_offset + 10, e1.data_offset + 20  # the end of entry 0, a header, the start of entry 1
    check.add(str(path), start, bytes(raw[start:end]))
    with pytest.raises(CorruptFile, match="data/1"):
        check.finish()


def test_write_workers_are_three_quarters_of_the_cpus_8_to_16(monkeypatch):
    """The writing threads' default (measured on a 16-core host, docs/benchmarks.md): 3/4 of the CPUs, at least 8
    and at most 16, never more than the CPUs; under a launcher, the same for each process's share of them."""
    from zckpt.engine import works
    assert [works.write_workers(n) for n in (1, 2, 8, 12, 16, 20, 32, 128)] == [1, 2, 8, 9, 12, 15, 16, 16]
    monkeypatch.setattr(works.os, "cpu_count", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert works.default_workers() == 12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert works.default_workers() == 2


def test_an_entry_read_twice_in_other_cuts_is_checked_without_reading_it_again(tmp_path):
    """An entry's bytes read twice in different cuts (convert --to deepspeed reads each master for the optimizer
    file and again, cut elsewhere, for the cast weights): its CRC-32 is chained through the reads, nothing read
    again; spans that leave gaps or overlap partly read only what no chain covers; a flipped byte is still found.
    Random cuts against the entry's own CRC."""
    import random
    import zipfile
    from zlib import crc32

    from zckpt.engine import checked
    from zckpt.engine.checked import InputCheck, zip_entries
    from zckpt.errors import CorruptFile

    rng = random.Random(7)
    body = rng.randbytes(1 << 16)
    path = tmp_path / "one.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("a/data/0", body)
    (e,) = zip_entries(str(path))
    raw = path.read_bytes()

    def cuts(k):  # a tiling of the entry into k random pieces
        at = sorted(rng.sample(range(1, len(body)), k - 1))
        return list(zip([0] + at, at + [len(body)]))

    reread = []
    real = checked.InputCheck._read_crc

    def counted(self, p, off, n):
        reread.append(n)
        return real(self, p, off, n)

    checked.InputCheck._read_crc = counted
    try:
        for trial in range(60):
            spans = cuts(rng.randint(1, 9)) + cuts(rng.randint(1, 9))  # two whole reads, cut differently
            kind = trial % 3
            if kind == 1:  # a few pieces of each read missing: gaps only one of them may fill
                spans = [s for s in spans if rng.random() < 0.8]
            if kind == 2:  # plus random spans overlapping anything
                spans += [(a, min(len(body), a + rng.randint(1, 5000))) for a in rng.sample(range(len(body)), 4)]
            check = InputCheck()
            for a, b in spans:
                check.add(str(path), e.data_offset + a, raw[e.data_offset + a:e.data_offset + b])
            reread.clear()
            check.finish()  # the CRC agrees
            covered = bytearray(len(body))
            for a, b in spans:
                covered[a:b] = b"\x01" * (b - a)
            if kind == 0:
                assert reread == [], (trial, reread)
            assert sum(reread) <= len(body) and sum(reread) >= covered.count(0), (trial, reread)
    finally:
        checked.InputCheck._read_crc = real
    flipped = bytearray(raw)
    flipped[e.data_offset + 100] ^= 1
    path.write_bytes(bytes(flipped))
    check = InputCheck()
    for a, b in cuts(3) + cuts(4):  # the spans' CRCs of the good bytes: the file's entry must agree with them
        check.add(str(path), e.data_offset + a, flipped[e.data_offset + a:e.data_offset + b])
    with pytest.raises(CorruptFile, match="data/0"):
        check.finish()
    assert crc32(body) == e.crc


def test_dealt_in_turn_mixes_long_runs_in_proportion_keeping_each_groups_order():
    items = [("a", i) for i in range(6)] + [("b", i) for i in range(3)] + [(None, 0)]
    got = executor.dealt_in_turn(items, lambda it: it[0])
    assert "".join(k or "-" for k, _ in got) == "ab-aabaaba"
    for k in ("a", "b"):
        assert [i for kk, i in got if kk == k] == sorted(i for kk, i in got if kk == k)
    same = [("a", 1), ("a", 2)]
    assert executor.dealt_in_turn(same, lambda it: it[0]) is same


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped"])
def test_the_input_check_combines_tiling_and_overlapping_spans_alike(tmp_path, flip):
    """checked.InputCheck: an entry read end to end in pieces (the common case, chained directly), read with
    overlaps or with gaps (the cheapest cut, the gaps read from the file): each gives the entry's own CRC-32, and a
    flipped byte is refused whichever way it was read."""
    import random
    from zckpt.engine.checked import InputCheck
    from zckpt.encoding.zipentries import ZipEntry
    from zckpt.errors import CorruptFile
    rng = random.Random(7)
    data = bytearray(rng.randbytes(300_000))
    path = tmp_path / "f"
    path.write_bytes(data)
    entry = ZipEntry("a/data/0", 0, 100, 200_000, zlib.crc32(data[100:200_100]))
    if flip:  # the file as read is damaged: its recorded CRC no longer holds
        data[150_000] ^= 1
        path.write_bytes(data)

    def spans(cuts, overlap=0, gaps=()):
        out = []
        for a, b in zip(cuts, cuts[1:]):
            a = max(100, a - overlap)
            if a not in gaps:
                out.append((str(path), a, b - a, zlib.crc32(data[a:b])))
        return out

    cuts = sorted({100, 200_100, *rng.sample(range(101, 200_100), 40)})
    for case in (spans(cuts), spans(cuts, overlap=999), spans(cuts, gaps={cuts[3], cuts[17]})):
        check = InputCheck(entries_of=lambda p: [entry])
        rng.shuffle(case)
        for s in case:
            check.add_crc(*s)
        if flip:
            with pytest.raises(CorruptFile, match="data/0"):
                check.finish()
        else:
            check.finish()
            assert check.checked == 1


def test_stop_pool_runs_what_is_queued_and_leaves_no_thread():
    """lanes.stop_pool: the pool's threads, all woken at once, finish the work still queued and are gone."""
    pool = ThreadPoolExecutor(6, thread_name_prefix="zckpt-stoptest")
    gate, done = threading.Event(), []
    futures = [pool.submit(lambda k=k: (gate.wait(5), done.append(k))) for k in range(20)]
    threading.Timer(0.2, gate.set).start()  # (14 jobs still queued behind the 6 running when it stops)
    lanes.stop_pool(pool)
    assert sorted(done) == list(range(20)) and all(f.done() for f in futures)
    assert not [t for t in threading.enumerate() if t.name.startswith("zckpt-stoptest")]
    with pytest.raises(RuntimeError):
        pool.submit(print)
