"""One command, many processes (zckpt.engine.distributed): merge and reshard under ``torchrun`` (gloo, CPU), local and
with the S3 server on loopback as the shared store, compared byte for byte with the single-process output; a rank
that dies or fails publishes nothing and a re-run completes. Plus the pieces as plain data: launcher detection,
the split by bytes, the coalesced ranged GETs of remote sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from zckpt.engine import executor
from zckpt.io import allocation
from zckpt.engine.segments import Piece
from zckpt.errors import InvalidArgument
from zckpt.io import publish, storage
from zckpt.engine import distributed
from zckpt.engine.distributed import FileWork, split_files, split_ranges
from zckpt.engine.launch import launcher_env

pytest_plugins = ["tests.s3server"]

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"


# ------------------------------------------------------------------------------------------------ helpers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", ZCKPT_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m zckpt ARGS``; a hang kills the whole process group and fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "zckpt", *args]
    proc = subprocess.Popen(cmd, env=_env(env), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun hung (> {timeout}s):\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def zckpt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], env=_env(env), cwd=str(ROOT), capture_output=True,
                          text=True, timeout=240)


_SID = b".data/serialization_id"
_UUID = rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _normalized(path: Path) -> bytes:
    """The file's bytes with what differs between any two runs zeroed: in torch zips (one, or many concatenated in
    a DCP ``.distcp``) the random ``.data/serialization_id`` and its CRCs (torch.save draws it per file); in DCP's
    ``.metadata`` the random ``save_id``."""
    raw = bytearray(path.read_bytes())
    if path.name == ".metadata":
        return re.sub(_UUID, b"0" * 36, bytes(raw))
    for m in re.finditer(rb"PK\x03\x04", bytes(raw)):  # local headers
        at = m.start()
        n, e = struct.unpack("<HH", raw[at + 26:at + 30])
        if raw[at + 30:at + 30 + n].endswith(_SID):
            raw[at + 14:at + 18] = bytes(4)
            raw[at + 30 + n + e:at + 30 + n + e + 20] = bytes(20)
    for m in re.finditer(rb"PK\x01\x02", bytes(raw)):  # central directory records
        at = m.start()
        n = struct.unpack("<H", raw[at + 28:at + 30])[0]
        if raw[at + 46:at + 46 + n].endswith(_SID):
            raw[at + 16:at + 20] = bytes(4)
    return bytes(raw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): _normalized(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != publish.MARKER}


def assert_same_output(single: Path, multi: Path) -> None:
    a, b = _files(single), _files(multi)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{name} differs from the single-process output"
    marker = json.loads((multi / publish.MARKER).read_text())
    assert marker["state"] == "complete" and marker["files"] == json.loads((single / publish.MARKER).read_text())[
        "files"]


def _scratch(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".zckpt-" in p.name]


def _json_line(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, text  # only rank 0 prints the result
    return json.loads(lines[0])


# ------------------------------------------------------------------------------------------------ plain data

def test_launcher_detection():
    assert launcher_env({}) is None
    assert launcher_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"}) is None  # one process: as before
    got = launcher_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                        "TORCHELASTIC_RUN_ID": "x"})
    assert got == {"rank": 2, "world_size": 4, "local_rank": 0, "launcher": "torchrun"}
    srun = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node1"}
    assert launcher_env(srun) == {"rank": 3, "world_size": 8, "local_rank": 1, "launcher": "srun"}
    # sbatch's batch script: SLURM_PROCID=0 and SLURM_NTASKS set, but it is one process, not a step of N tasks
    assert launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "MASTER_ADDR": "node1"}) is None
    assert launcher_env({**srun, "ZCKPT_DISTRIBUTED": "0"}) is None
    with pytest.raises(InvalidArgument, match="MASTER_ADDR"):
        launcher_env({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"})


def _work(name, sizes):
    return FileWork(name, sum(sizes), [(-1, 0, [b"x" * n], "uint8") for n in sizes])


def test_split_by_bytes_is_balanced_contiguous_and_complete():
    works = [_work("a", [100] * 30), FileWork("c", 250, src="/x"), _work("b", [7] * 100 + [300])]
    for world in (1, 2, 3, 4, 7):
        shares = split_ranges(works, world)
        flat = [item for share in shares for item in share]
        assert flat == [(0, j) for j in range(30)] + [(1, -1)] + [(2, j) for j in range(101)]  # in plan order
        loads = [sum(works[f].size if j < 0 else distributed.job_bytes(works[f].jobs[j][2], "uint8")
                     for f, j in share) for share in shares]
        assert sum(loads) == 4250
        assert max(loads) - min(loads) <= 2 * 300, loads  # within the largest job (the copied file, a 300 B job)


def test_split_whole_files_largest_first():
    works = [FileWork(n, s) for n, s in (("a", 5), ("b", 9), ("c", 4), ("d", 4), ("e", 1))]
    assert split_files(works, 2) == [[1, 3], [0, 2, 4]]  # b, a, c, then d on the tie's lower rank, e: 13 / 10
    assert split_files(works, 8)[5:] == [[], [], []]


def test_remote_ranges_coalesce_into_few_requests():
    ps = [Piece("s3://b/r0", 1000 * i, 250, "float32") for i in range(64)]  # 64 x 1000 B, each 1000 B apart
    ps += [Piece("s3://b/r1", 0, 10, "uint8"), Piece("/local", 0, 10, "uint8")]
    ranges = [r for p in ps for r in executor.remote_ranges([p])]
    assert len(ranges) == 65  # the local piece is not fetched
    reqs = executor.plan_requests(ranges, max_request=16_000)
    assert sorted(reqs) == [("s3://b/r0", s, 16_000) for s in range(0, 64_000, 16_000)] + [("s3://b/r1", 0, 10)]
    cache = executor.RangeCache()
    blob = bytes(range(256)) * 250
    for path, off, n in reqs:
        cache.add(path, off, (blob if path.endswith("r0") else bytes(10))[off:off + n])
    buf = bytearray(3000)
    assert cache.read_into("s3://b/r0", 15_000, memoryview(buf))  # across two requests
    assert bytes(buf) == blob[15_000:18_000]
    assert not cache.read_into("s3://b/r0", 63_000, memoryview(bytearray(2000)))  # past what was fetched
    assert not cache.read_into("s3://b/zz", 0, memoryview(bytearray(1)))


def test_without_a_launcher_nothing_changes_and_torch_is_not_imported(tmp_path):
    code = ("import sys; from zckpt.cli import main\n"
            f"try:\n    main(['merge', {str(FIX / 'z2_bf16_ws2')!r}, '-o', {str(tmp_path / 'o')!r}, '-q'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = _env({"RANK": "0", "WORLD_SIZE": "1"})
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------ torchrun, local

@pytest.mark.slow
def test_merge_two_ranks_sharded_safetensors(tmp_path):
    src = str(FIX / "z3_bf16_ws2")
    args = ["merge", src, "--max-shard-size", "600B"]
    assert zckpt(*args, "-o", str(tmp_path / "single"), "-q").returncode == 0
    res = torchrun(2, *args, "-o", str(tmp_path / "multi"), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = _json_line(res.stdout)
    assert doc["stats"]["ranks"] == 2 and doc["stats"]["bytes_per_second"] > 0
    assert len(doc["files"]) > 2  # several shards and the index
    assert_same_output(tmp_path / "single", tmp_path / "multi")
    assert _scratch(tmp_path) == []


@pytest.mark.slow
def test_merge_three_ranks_pt_with_casts_and_reshard(tmp_path):
    src = str(FIX / "z2_bf16_ws2")
    args = ["merge", src, "--to", "pt", "--dtype", "bf16"]  # fp32 masters cast to bf16 on the way
    assert zckpt(*args, "-o", str(tmp_path / "single"), "-q").returncode == 0
    res = torchrun(3, *args, "-o", str(tmp_path / "multi"), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert _json_line(res.stdout)["stats"]["ranks"] == 3
    assert_same_output(tmp_path / "single", tmp_path / "multi")

    src3 = tmp_path / "z3_fp32_ws3"  # without its recovery scripts (38 kB copied whole) the rank files are split
    shutil.copytree(FIX / "z3_fp32_ws3", src3, ignore=shutil.ignore_patterns("*.py", "expected"))
    src3 = str(src3)
    rargs = ["reshard", src3, "-w", "2", "--stage", "2"]
    assert zckpt(*rargs, "-o", str(tmp_path / "rs"), "-q").returncode == 0
    res = torchrun(3, *rargs, "-o", str(tmp_path / "rm"), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = _json_line(res.stdout)
    assert doc["stats"]["ranks"] == 3 and doc["stats"]["split_entries"] > 0  # entries' CRCs combined across ranks
    phases = doc["stats"]["phases"]  # rank 0's seconds per step, and the slowest rank's writing
    steps = {"agree_plan", "scratch", "write", "crcs", "headers", "publish"}
    assert set(phases) == steps | {"write_max", "write_min", "start_spread"}
    assert all(v >= 0 for v in phases.values()) and sum(phases[k] for k in steps) <= doc["seconds"]
    assert phases["write_min"] <= phases["write_max"] <= doc["seconds"]
    assert_same_output(tmp_path / "rs", tmp_path / "rm")


@pytest.mark.slow
def test_reshard_two_ranks_trainer_checkpoint(tmp_path):
    src = str(FIX / "trainer" / "checkpoint-4")
    args = ["reshard", src, "-w", "3"]
    assert zckpt(*args, "-o", str(tmp_path / "single"), "-q").returncode == 0
    res = torchrun(2, *args, "-o", str(tmp_path / "multi"), "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_output(tmp_path / "single", tmp_path / "multi")  # copied side files (config, rng states) too


@pytest.mark.slow
def test_convert_to_dcp_three_ranks(tmp_path):
    """DeepSpeed -> DCP: many small zips per .distcp file, split by bytes like any other file; .metadata last."""
    src = tmp_path / "z3_fp32_ws3"
    shutil.copytree(FIX / "z3_fp32_ws3", src, ignore=shutil.ignore_patterns("*.py", "expected"))
    out = tmp_path / "dcp"  # the same OUT for both runs: DCP's metadata names it (checkpoint_id)
    assert zckpt("convert", str(src), "--to", "dcp", "-o", str(out), "-q").returncode == 0
    out.rename(tmp_path / "single")
    res = torchrun(3, "convert", str(src), "--to", "dcp", "-o", str(out), "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_output(tmp_path / "single", out)

    # a Trainer checkpoint-N: the Trainer / Accelerate layout (two DCP folders and the Trainer's files, copied)
    trainer = str(FIX / "trainer" / "checkpoint-4")
    out2 = tmp_path / "trainer-dcp"
    assert zckpt("convert", trainer, "--to", "dcp", "-o", str(out2), "-q").returncode == 0
    out2.rename(tmp_path / "trainer-single")
    res = torchrun(2, "convert", trainer, "--to", "dcp", "-o", str(out2), "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out2 / "optimizer_0" / ".metadata").is_file()
    assert_same_output(tmp_path / "trainer-single", out2)


@pytest.mark.slow
def test_a_rank_that_dies_publishes_nothing_and_a_rerun_completes(tmp_path):
    src = str(FIX / "z3_bf16_ws2")
    out = tmp_path / "multi"
    res = torchrun(2, "merge", src, "-o", str(out), "-q", env={"ZCKPT_TEST_RANK_EXIT": "1"})
    assert res.returncode != 0
    assert not out.exists()
    res = torchrun(2, "merge", src, "-o", str(out), "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    assert zckpt("merge", src, "-o", str(tmp_path / "single"), "-q").returncode == 0
    assert_same_output(tmp_path / "single", out)
    assert _scratch(tmp_path) == []  # the killed run's scratch folder was swept


@pytest.mark.slow
def test_a_rank_that_fails_fails_every_rank_with_one_error(tmp_path):
    out = tmp_path / "multi"
    res = torchrun(3, "reshard", str(FIX / "z2_bf16_ws2"), "-w", "3", "-o", str(out),
                   env={"ZCKPT_TEST_RANK_FAIL": "2"})
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("zckpt: error:")]
    assert len(lines) == 3 and len(set(lines)) == 1, res.stderr[-3000:]  # every rank, the same line
    assert "injected failure on rank 2" in lines[0]
    assert not out.exists() and _scratch(tmp_path) == []

    # a refusal on rank 0 (the output check) reads on every rank exactly as the single-process command says it
    exists = tmp_path / "exists"
    assert zckpt("merge", str(FIX / "z2_bf16_ws2"), "-o", str(exists), "-q").returncode == 0
    single = zckpt("merge", str(FIX / "z2_bf16_ws2"), "-o", str(exists))
    res = torchrun(2, "merge", str(FIX / "z2_bf16_ws2"), "-o", str(exists))
    assert res.returncode != 0 and single.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("zckpt: error:")]
    assert lines == single.stderr.splitlines() * 2, (lines, single.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["convert", "reshard", "merge"])
def test_a_flipped_tensor_byte_fails_every_rank_and_publishes_nothing(tmp_path, command):
    """One byte of tensor data flipped in each of the last rank file's large tensors (fp32 masters, both Adam
    moments; whichever rank reads them): every rank exits 1 with the same one line naming the file and its
    CRC-32, no output, no scratch left."""
    src = tmp_path / "z2_bf16_ws2"
    shutil.copytree(FIX / "z2_bf16_ws2", src, ignore=shutil.ignore_patterns("*.py", "expected"))
    victim = sorted(src.rglob("*optim_states.pt"))[-1]
    with zipfile.ZipFile(victim) as zf:
        infos = zf.infolist()
    largest = max(i.file_size for i in infos if "/data/" in i.filename)
    data = bytearray(victim.read_bytes())
    for info in (i for i in infos if "/data/" in i.filename and i.file_size == largest):
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        data[info.header_offset + 30 + name_len + extra_len + info.file_size * 3 // 4] ^= 0x10
    assert data != victim.read_bytes()
    victim.write_bytes(bytes(data))
    args = {"convert": ["convert", str(src), "--to", "dcp"], "reshard": ["reshard", str(src), "-w", "3"],
            "merge": ["merge", str(src), "--dtype", "fp32"]}[command]
    out = tmp_path / "out"
    res = torchrun(2, *args, "-o", str(out))
    assert res.returncode == 1, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("zckpt: error:")]
    assert len(lines) == 2 and len(set(lines)) == 1, res.stderr[-3000:]
    assert str(victim) in lines[0] and "CRC-32" in lines[0], lines[0]
    assert not out.exists() and _scratch(tmp_path) == []


# ------------------------------------------------------------------------------------------------ S3 on loopback

def _upload(local: Path, url: str, options: dict) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file() and "expected" not in p.relative_to(local).parts:
            storage.put_file(str(p), storage.join(url, p.relative_to(local).as_posix()), storage_options=options)


def _download(url: str, dest: Path, options: dict) -> None:
    for rel in storage.list_files(url, options):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(storage.read_bytes(storage.join(url, rel), options))


@pytest.mark.slow
def test_s3_source_and_output_two_and_three_ranks(s3_server, tmp_path):
    opts = s3_server.storage_options()
    src = s3_server.url("dist", "z3_bf16_ws2")
    _upload(FIX / "z3_bf16_ws2", src, opts)
    env = s3_server.env()
    assert zckpt("merge", str(FIX / "z3_bf16_ws2"), "--to", "pt", "--max-shard-size", "900B", "-o",
                 str(tmp_path / "single"), "-q").returncode == 0

    # merge s3:// -> s3:// with two ranks: whole shards dealt out by bytes, the commit marker last
    out = s3_server.url("dist", "merged")
    res = torchrun(2, "merge", src, "--to", "pt", "--max-shard-size", "900B", "-o", out, "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = _json_line(res.stdout)
    assert doc["stats"]["remote_requests"] > 0
    assert publish.output_state(out, opts)[0]
    _download(out, tmp_path / "multi", opts)
    assert_same_output(tmp_path / "single", tmp_path / "multi")

    # a rank that dies: the output stays uncommitted (its marker says "writing"); a re-run completes and sweeps the
    # dead rank's local scratch (a shard on its way up)
    out2 = s3_server.url("dist", "merged2")
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    res = torchrun(2, "merge", src, "--to", "pt", "--max-shard-size", "900B", "-o", out2, "-q",
                   env={**env, "ZCKPT_TEST_RANK_EXIT": "1", "TMPDIR": str(scratch)})
    assert res.returncode != 0 and not publish.output_state(out2, opts)[0]
    assert [p.name for p in scratch.iterdir() if p.name.startswith(".zckpt-rank1-")], list(scratch.iterdir())
    res = torchrun(2, "merge", src, "--to", "pt", "--max-shard-size", "900B", "-o", out2, "-q", "--overwrite",
                   env={**env, "TMPDIR": str(scratch)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert publish.output_state(out2, opts)[0]
    assert [p.name for p in scratch.iterdir() if p.name.startswith(".zckpt-")] == []  # (torchrun's own stay)

    # reshard s3:// -> local with three ranks, each reading only its ranges
    assert zckpt("reshard", str(FIX / "z3_bf16_ws2"), "-w", "3", "-o", str(tmp_path / "rs"), "-q").returncode == 0
    res = torchrun(3, "reshard", src, "-w", "3", "-o", str(tmp_path / "rm"), "-q", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_output(tmp_path / "rs", tmp_path / "rm")


def test_remote_merge_reads_coalesced_ranges(s3_server, tmp_path):
    """A single-process merge from s3:// fetches its pieces in a few coalesced ranged GETs, not one per piece,
    and reports them; the output is the local merge's."""
    from zckpt.state.open import open_checkpoint
    from zckpt.ops.merge import merge
    opts = s3_server.storage_options()
    src = s3_server.url("coalesce", "z2_bf16_ws4")
    _upload(FIX / "z2_bf16_ws4", src, opts)
    records = [r for r in open_checkpoint(str(FIX / "z2_bf16_ws4")).records if r.kind != "tied"]
    pieces, files = sum(len(r.value) for r in records), len({p.path for r in records for p in r.value})
    res = merge(src, str(tmp_path / "remote"), storage_options=opts)
    merge(str(FIX / "z2_bf16_ws4"), str(tmp_path / "local"))
    assert_same_output(tmp_path / "local", tmp_path / "remote")
    stats = res.to_json()["stats"]
    assert 0 < stats["remote_requests"] <= files < pieces, (stats, files, pieces)  # one GET per source file
    assert stats["remote_bytes"] >= res.plan.total_size // 2


def test_allocate_gives_the_final_size_and_reports_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        allocation.allocate(fd, 3 << 20)
        assert os.fstat(fd).st_size == 3 << 20
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(3 << 20)
    fd = os.open(tmp_path / "empty.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        allocation.allocate(fd, 0)  # an empty file: nothing to allocate, no error
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    if allocation._fallocate_fn():  # Linux: a filesystem's "no space" is an error, not a sparse file
        ctypes, _, fstatfs = allocation._fallocate_fn()

        def full(fd, mode, off, size):
            ctypes.set_errno(28)  # ENOSPC
            return -1
        monkeypatch.setattr(allocation, "_libc", (ctypes, full, fstatfs))
        monkeypatch.setattr(allocation, "NO_FALLOCATE_FS", set())
        fd = os.open(tmp_path / "g.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as e:
                allocation.allocate(fd, 1 << 20)
            assert e.value.errno == 28
        finally:
            os.close(fd)


def test_ranks_sharing_a_file_share_its_write_slots(tmp_path):
    from zckpt.engine import lanes
    targets = [lanes.Target(k, str(tmp_path / f"f{k}"), [], size=0, writers=w)
               for k, w in enumerate((1, 4, 10 * executor.WRITE_STREAMS))]
    w = executor.Worker()
    try:
        lanes.write_files(targets, None, w)
    finally:
        w.close()
    assert [t.slots._value for t in targets] == [executor.WRITE_STREAMS, max(1, executor.WRITE_STREAMS // 4), 1]


def test_a_bad_knob_in_the_environment_is_ignored(monkeypatch):
    for value, want in (("", 5), ("x", 5), ("0", 1), ("-3", 1), ("12", 12)):
        monkeypatch.setenv("ZCKPT_TEST_KNOB", value)
        assert executor.env_int("ZCKPT_TEST_KNOB", 5) == want
    monkeypatch.delenv("ZCKPT_TEST_KNOB")
    assert executor.env_int("ZCKPT_TEST_KNOB", 5) == 5
