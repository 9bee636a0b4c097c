"""Crash consistency of merge: a full disk and a failing write leave the previous result or nothing."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import zckpt
from zckpt.errors import ZckptError
from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
CKPT = FIXTURES / "z3_bf16_ws4"
import zckpt.ops.merge  # noqa: E402  (the module; zckpt.ops.merge the attribute is the function)
merge_mod = sys.modules["zckpt.ops.merge"]


@pytest.fixture
def small_fs(tmp_path):
    """A real 64 KiB tmpfs (root only); skipped where mounting is not allowed."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_enospc_on_a_real_full_filesystem(small_fs):
    prev = small_fs / "prev"
    prev.mkdir()
    (prev / "model.safetensors").write_bytes(b"previous result")
    (prev / ".zckpt.json").write_text('{"format": "zckpt-output", "kind": "merge", "state": "complete", '
                                      '"files": {"model.safetensors": 15}}')  # ours, listing what it wrote
    with open(small_fs / "ballast", "wb", buffering=0) as f:  # fill it: the merge gets its folder, then no room for bytes
        try:
            while True:
                f.write(b"\0" * 1024)
        except OSError:
            pass
    proc = subprocess.run([sys.executable, "-m", "zckpt", "merge", str(CKPT), "-o", str(prev), "--overwrite",
                           "--keep-tied", "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left" in lines[0] and "disk is full" in lines[0], proc.stderr
    assert lines[0].startswith(f"zckpt: error: {prev}: cannot write the output here"), lines  # which disk: -o's
    assert (prev / "model.safetensors").read_bytes() == b"previous result"
    assert sorted(p.name for p in small_fs.iterdir()) == ["ballast", "prev"]  # no temp folder left


def test_file_size_limit_names_the_output(tmp_path):
    """``ulimit -f`` (a batch system's file-size limit): EFBIG is one line naming the output and the limit, and
    nothing is left (it was "zckpt: error: File too large", no path, no hint)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # the merged model is 2.6 KB

    out = tmp_path / "model"
    for cmd in (["merge", str(CKPT), "-o", str(out)], ["reshard", str(CKPT), "-w", "2", "-o", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "zckpt", *cmd, "--json"], capture_output=True, text=True,
                              cwd=ROOT, preexec_fn=limit)
        assert proc.returncode == 1, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"zckpt: error: {out}: cannot write the output here: File too large"), line
        assert "ulimit -f" in line and "-o" in line, line
        err = json.loads(proc.stdout)["error"]
        assert err["path"] == str(out) and err["hint"] and "ulimit -f" in err["hint"], err
        assert list(tmp_path.iterdir()) == []


def test_interrupt_while_a_crc_is_in_flight_stays_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C during a --to pt merge unwinds while pool threads still compute CRCs on slices of the source maps:
    closing the maps must not raise (it did: "internal error: BufferError: cannot close exported pointers exist",
    exit 1, instead of "zckpt: interrupted", 130)."""
    import threading
    from zckpt.engine import checked  # where the maps' CRC function is looked up (zckpt.io.hashing's)
    from zckpt.engine.torchzip import SourceMaps

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 16))
    inside, release = threading.Event(), threading.Event()
    real = checked.crc32

    def slow_crc(data, value=0):
        inside.set()
        release.wait(10)
        return real(data, value)

    monkeypatch.setattr(checked, "crc32", slow_crc)
    maps = SourceMaps()
    worker = threading.Thread(target=maps.crc, args=(str(src), 100, 1000, 0))
    worker.start()
    assert inside.wait(10)
    try:
        maps.close()  # the interrupted main thread's cleanup, while the worker holds its slice
    finally:
        release.set()
        worker.join(10)
    monkeypatch.undo()
    assert real(src.read_bytes()[100:1100]) == SourceMaps().crc(str(src), 100, 1000, 0)  # maps work afresh


def test_injected_write_failure(tmp_path, monkeypatch):
    """Where no small filesystem can be made: a write that fails part-way (ENOSPC), via the write primitive."""
    calls = {"n": 0}
    real = os.pwrite

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    from zckpt.engine import run as run_mod  # where the merge's byte loop lives (its os is the os module)
    monkeypatch.setattr(run_mod.os, "pwrite", failing)
    monkeypatch.setattr(run_mod.os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")),
                        raising=False)
    out = tmp_path / "out"
    with pytest.raises(OSError) as err:
        zckpt.merge(str(CKPT), str(out), max_shard_size="200B", workers=1)
    assert err.value.errno == errno.ENOSPC
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_unreadable_input_is_clean(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(CKPT, ck)
    tag = (ck / "latest").read_text().strip()
    for f in (ck / tag).iterdir():
        f.chmod(0)
    with pytest.raises((ZckptError, PermissionError)):
        zckpt.merge(str(ck), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_killed_reshard_leaves_previous_or_new(tmp_path):
    """SIGKILL a reshard at several moments: OUT holds the previous complete result or the new one, never a mix."""
    import signal
    import time
    from zckpt.ops.verify import verify
    src = FIXTURES / "z2_bf16_ws2"
    out = tmp_path / "out"
    zckpt.reshard(str(src), str(out), world_size=3)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    env = dict(os.environ, ZCKPT_TEST_SLOW_WRITE="0.2")
    for delay in (0.3, 1.0, 1.8, 2.6):
        p = subprocess.Popen([sys.executable, "-m", "zckpt", "reshard", str(src), "-w", "4", "--stage", "3",
                              "-o", str(out), "--overwrite", "--quiet"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert verify(str(out)).ok
        c = zckpt.open_checkpoint(str(out))
        if c.world_size == 3:
            now = {q.relative_to(out): q.read_bytes() for q in out.rglob("*") if q.is_file()}
            assert now == before
        else:
            assert c.world_size == 4 and c.stage == 3
            zckpt.reshard(str(src), str(out), world_size=3, overwrite=True)
    # a killed run's scratch folder is swept by the next run
    zckpt.reshard(str(src), str(out), world_size=3, overwrite=True)
    assert [q.name for q in tmp_path.iterdir()] == ["out"]
