"""The files a job only copies, written by a forked process while the zckpt program imports numpy for its casts
(zckpt.engine.forked): ``zckpt convert --to deepspeed`` of a DCP (optimizer files copied, bf16 weights cast) writes
what one process writes; a damaged byte only the child read is refused; the child's failure, its death and a Ctrl-C
each end in one line, the error table's exit status, nothing published, no scratch folder and no process left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import wait
from pathlib import Path

import pytest

import zckpt
from tests.test_checksums import flip
from tests.test_distributed import FIX, _scratch, assert_same_output
from zckpt.engine import forked, lanes
from zckpt.engine.segments import Cast, Piece

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork is Linux-only")
ARGS = ["--to", "deepspeed", "-w", "3", "--stage", "2", "--dtype", "bf16", "--buffers", ""]


@pytest.fixture(scope="module")
def dcp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("forked") / "dcp"
    zckpt.convert(str(FIX / "z2_bf16_ws2"), str(out), to="dcp")
    return out


def _convert(src: Path, out: Path, fork: str = "1", hook: str | None = None, extra=(), **popen):
    env = dict(os.environ, ZCKPT_FORK_COPIES=fork)
    env.pop("ZCKPT_TEST_FORKED", None)
    if hook:
        env["ZCKPT_TEST_FORKED"] = hook
    cmd = [sys.executable, "-m", "zckpt", "convert", str(src), *ARGS, "-o", str(out), *extra]
    if popen:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, **popen)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_copies_are_forked_and_the_output_is_one_process_s(dcp, tmp_path):
    one = _convert(dcp, tmp_path / "one", fork="0", extra=["-vv"])
    two = _convert(dcp, tmp_path / "two", extra=["-vv"])
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "written by a forked process" not in one.stderr
    assert "3 file(s) only copied written by a forked process" in two.stderr  # the 3 ranks' optimizer files
    assert_same_output(tmp_path / "one", tmp_path / "two")
    assert zckpt.verify(str(tmp_path / "two"), deep=True).ok


def test_a_damaged_byte_only_the_forked_copy_read_is_refused(dcp, tmp_path):
    """A byte of a moment (only copied, never cast): the child's spans are checked here before publishing."""
    src = tmp_path / "dcp"
    shutil.copytree(dcp, src)
    record = next(r for r in zckpt.open_checkpoint(str(src)).records if r.kind == "trainable")
    piece = record.exp_avg[0]
    flip(piece.path, piece.offset + 5)
    got = _convert(src, tmp_path / "out", extra=["-vv"])
    assert "written by a forked process" in got.stderr
    assert got.returncode == 1
    last = got.stderr.strip().splitlines()[-1]
    assert "do not match the CRC-32" in last and os.path.basename(piece.path) in last
    assert not (tmp_path / "out").exists() and _scratch(tmp_path) == []


@pytest.mark.parametrize("hook, says", [("raise", "injected failure in the forked copy"),
                                        ("exit", "ended without a result (exit status 17)")])
def test_a_failed_or_dead_forked_copy_is_one_line_and_publishes_nothing(dcp, tmp_path, hook, says):
    got = _convert(dcp, tmp_path / "out", hook=hook)
    assert got.returncode == 1
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in got.stderr, got.stderr
    assert not (tmp_path / "out").exists() and _scratch(tmp_path) == []


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_ctrl_c_stops_the_forked_copy_and_removes_everything(dcp, tmp_path):
    p = _convert(dcp, tmp_path / "out", hook="hang", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline, kids = time.monotonic() + 60, []
    while not kids and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
        kids = _children(p.pid)
    assert kids, "no forked copy started"
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and len(err.strip().splitlines()) == 1, err
    for kid in kids:
        with pytest.raises(ProcessLookupError):
            os.kill(kid, 0)
    assert not (tmp_path / "out").exists() and _scratch(tmp_path) == []


def test_no_fork_where_numpy_is_loaded_a_file_has_no_copy_or_threads_run(tmp_path, monkeypatch):
    class W:
        def cast_needs(self, jobs):
            pairs = {(p.src_dtype, d) for parts, d in jobs for p in parts if isinstance(p, Cast)}
            return pairs, 0

    src = str(tmp_path / "src")
    Path(src).write_bytes(bytes(64))
    copy = lanes.Target(0, "a", [(0, 0, [Piece(src, 0, 8, "float32")], "float32")])
    cast = lanes.Target(1, "b", [(0, 0, [Cast([Piece(src, 0, 8, "float32")], "float32")], "bfloat16")])
    import numpy  # noqa: F401 - loaded: nothing to hide
    assert forked.split([copy, cast], W(), False) is None
    monkeypatch.delitem(sys.modules, "numpy")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(forked.threading, "active_count", lambda: 1)
    assert forked.split([copy, cast], W(), False) == ([copy], [cast])
    assert forked.split([cast], W(), False) is None  # nothing only copied: nothing to do meanwhile
    assert forked.split([copy], W(), False) is None  # no cast: no import to hide
    assert forked.split([copy, cast], W(), True) is None  # remote sources
    monkeypatch.setattr(forked.threading, "active_count", lambda: 2)
    assert forked.split([copy, cast], W(), False) is None  # a running thread: no fork


def test_the_api_reports_every_byte_of_both_processes_to_progress(dcp, tmp_path):
    """From Python (a fresh interpreter, as a script runs it): the child's bytes, its files' headers included, reach
    the caller's ``progress`` in this process, up to the plan's total."""
    script = f"""
import logging, sys, zckpt
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
calls = []
res = zckpt.convert({str(dcp)!r}, {str(tmp_path / "out")!r}, to="deepspeed", world_size=3, stage=2, dtype="bf16",
                    buffers=[], progress=lambda done, total: calls.append((done, total)))
print(calls[-1][0], calls[-1][1], res.to_json()["total_bytes"], max(d for d, _ in calls))
"""
    got = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "ZCKPT_FORK_COPIES"})
    assert got.returncode == 0, got.stderr
    assert "written by a forked process" in got.stderr
    done, total, planned, most = map(int, got.stdout.split())
    assert done == total == planned == most


@pytest.mark.slow
def test_deepspeed_loads_what_the_forked_copy_wrote(dcp, tmp_path):
    """The forked conversion, loaded by DeepSpeed at 3 ranks: every master, both moments, the weights and the step
    as the fixture's own save holds them (DCP carries no DeepSpeed scheduler: the engine is built without one)."""
    from tests import ds_oracle
    from tests.test_reshard import _spec, assert_same_state
    got = _convert(dcp, tmp_path / "out", extra=["-vv"])
    assert got.returncode == 0 and "written by a forked process" in got.stderr, got.stderr
    src = FIX / "z2_bf16_ws2"
    spec = dict(ds_oracle.target_spec(_spec(src), 3, 2), scheduler=False)
    ds_oracle.load_with_deepspeed(spec, str(tmp_path / "out"), str(tmp_path / "oracle"))
    assert_same_state(src / "expected", tmp_path / "oracle", skip=("lr_scheduler", "loss_scaler"))


def test_this_process_casts_with_a_third_of_the_threads():
    assert [forked.cast_workers(n) for n in (1, 2, 3, 8, 12, 16)] == [1, 2, 2, 2, 4, 5]


def test_this_process_grows_to_the_child_s_threads_once_the_child_is_done(tmp_path):
    """While the child copies, this process writes with ``cast_workers`` threads; once the child has sent its
    result, the jobs left go to ``workers`` threads (a fresh interpreter: no thread runs beside the fork)."""
    script = """
import threading, time
from zckpt.engine import forked, lanes
copies, casts = [lanes.Target(0, "a", [])], [lanes.Target(1, "b", [])]
rounds = []
def write(targets, pool, step, closed, after_job):
    if targets is copies:  # the child
        time.sleep(2)
        return {(0, 0): (1, 1)}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = set()
        def job():
            names.add(threading.current_thread().name)
            time.sleep(0.01)
        for f in [pool.submit(job) for _ in range(36)]:
            f.result()
        rounds.append(len(names))
        if len(names) == 12:
            break
    return {(1, 0): (2, 2)}
got = forked.write_apart(copies, casts, write, 12, None, None, None, None, None)
print(rounds[0], rounds[-1], sorted(got.items()), copies[0].crcs)
"""
    got = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    first, last, *rest = got.stdout.strip().split(maxsplit=2)
    assert (int(first), int(last)) == (forked.cast_workers(12), 12)
    assert rest == ["[((0, 0), (1, 1)), ((1, 0), (2, 2))] {0: (1, 1)}"]


class _Threads:
    def __init__(self, n):
        self.threads = n

    def grow(self, n):
        self.threads = n


def test_the_balance_grows_this_side_only_while_it_would_end_after_the_child():
    """Rates over windows of SETTLE seconds: this side 100 of 1000 bytes a window, the child 200 of 1000 (its ends
    9 and 4 windows on): one more thread; in a window of its own, no second growth; at ``most``, none; where it
    keeps up, none."""
    pool = _Threads(4)
    b = forked._Balance(pool, 1000, 1000, 6)
    w = forked._Balance.SETTLE
    assert not b.step(1.0, 0, 0, 0.99)  # the first job of this side: the mark
    assert not b.step(1.0 + w / 2, 50, 100, 1.0 + w / 2)  # (half a window: no rate yet)
    assert b.step(1.0 + w, 100, 200, 1.0 + w) and pool.threads == 5
    assert not b.step(1.0 + 1.5 * w, 150, 300, 1.0 + 1.5 * w)
    assert not b.step(1.0 + 2 * w, 200, 400, 1.0 + 2 * w - 0.06)  # no message of the child since the mark
    assert b.step(1.0 + 3 * w, 300, 500, 1.0 + 3 * w) and pool.threads == 6
    assert not b.step(1.0 + 4 * w, 400, 700, 1.0 + 4 * w) and pool.threads == 6  # at most 6
    even = forked._Balance(_Threads(4), 1000, 1000, 6)
    assert [even.step(t * w, 100 * t, 100 * t, t * w) for t in range(6)] == [False] * 6  # together: no growth
    assert even.pool.threads == 4
    done = forked._Balance(_Threads(4), 1000, 1000, 6)
    assert [done.step(t * w, 10 * t, min(1000, 1000 * t), t * w) for t in range(4)] == [False] * 4  # child done
    assert not forked._Balance(_Threads(4), 0, 1000, 6).step(1.0, 0, 0, 1.0)  # sizes unknown: no balance


def test_this_side_grows_while_it_lags_the_child_and_no_further_than_half(tmp_path):
    """A child that writes its file steadily and a side that writes a tenth of its own in that time: while the
    child runs, this side's pool grows past ``cast_workers`` up to half the workers; after, to all of them."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(1000))
    b.write_bytes(bytes(10000))
    script = f"""
import os, time
from zckpt.engine import forked, lanes
copies, casts = [lanes.Target(0, {str(a)!r}, [])], [lanes.Target(1, {str(b)!r}, [])]
flag = {str(tmp_path / "child-done")!r}
seen = []
def write(targets, pool, step, closed, after_job):
    if targets is copies:  # the child: 1000 bytes over about 1.5 s
        for _ in range(50):
            time.sleep(0.03)
            step(20)
        open(flag, "w").close()
        return {{(0, 0): (1, 1)}}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for f in [pool.submit(time.sleep, 0.01) for _ in range(12)]:
            f.result()
            step(1)
            after_job()
        n = pool.threads  # (then the flag: a count read before the child's end is seen without it)
        seen.append((n, os.path.exists(flag)))
        if pool.threads == 12:
            break
    return {{(1, 0): (2, 2)}}
got = forked.write_apart(copies, casts, write, 12, None, None, None, None, None)
during = max(n for n, ended in seen if not ended)
print(forked.cast_workers(12), during, seen[-1][0])
"""
    got = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    first, during, last = map(int, got.stdout.split())
    assert first < during == 6 and last == 12


def test_the_growing_pool_runs_cancels_and_fails_as_a_pool_does():
    seen, gate = [], threading.Event()
    with forked._Pool(2, 4) as pool:
        assert pool._max_workers == 4  # (what lanes sizes its jobs in flight by)
        blocked = [pool.submit(gate.wait) for _ in range(2)]
        waiting = pool.submit(seen.append, "never")
        assert waiting.cancel()  # not started: two threads are busy
        gate.set()
        wait(blocked)
        failed = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result()
        pool.grow(8)  # at most its _max_workers
        assert len(pool._threads) == 4
        assert [pool.submit(lambda i=i: i * i).result() for i in range(6)] == [0, 1, 4, 9, 16, 25]
    assert seen == [] and not any(t.is_alive() for t in pool._threads)
    pool.grow(4)  # closed: no thread starts
    assert not any(t.is_alive() for t in pool._threads)


def test_a_damaged_zip_record_only_the_input_check_reads_is_one_line_and_publishes_nothing(dcp, tmp_path):
    """The end record of a moment's item (no byte of its tensor, never read at open) flipped: the input check's
    entries, learned while the child copies or at its finish, cannot be read; the refusal is one line naming the
    file, exit 1, and nothing is published."""
    src = tmp_path / "dcp"
    shutil.copytree(dcp, src)
    ckpt = zckpt.open_checkpoint(str(src))
    md = ckpt.extra["metadata"]
    key = next(k for k in md.tensors if k.startswith("optim.state.") and k.endswith(".exp_avg_sq")
               and md.tensors[k].chunks[0].offset > 0)
    item = md.tensors[key].chunks[-1]
    flip(str(src / item.file), item.offset + item.length - 22)  # its end-of-directory record's signature
    got = _convert(src, tmp_path / "out", extra=["-vv"])
    assert "written by a forked process" in got.stderr
    assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert item.file in last and "error" in last.lower(), last
    assert not (tmp_path / "out").exists() and _scratch(tmp_path) == []
