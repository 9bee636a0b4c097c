"""Faults during ``zckpt push``, with real components on loopback: the SeaweedFS S3 server of
:mod:`tests.s3server` killed and restarted, connections reset or stalled and bursts of 503 SlowDown injected by
the TCP proxy of :mod:`tests.faultproxy`, and a local destination on a real tmpfs that runs out of space.

In every case: no checkpoint is marked complete (manifest) that is not, the next run finishes without resending
finished files (PUT bodies counted on the wire, by the proxy; inodes on a local disk), and the error the user
sees is one line naming the cause. Figures are printed (``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.test_push import local_files, write_trainer_checkpoint

pytest_plugins = ["tests.s3server"]

P = importlib.import_module("zckpt.backup.push")
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "zckpt-manifest.json"
RECORD = ".zckpt-push.json"  # push's "a push began here", written before any file
SIDE = (MANIFEST, RECORD)
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZCKPT_CACHE_DIR", str(tmp_path / "zckpt-cache"))


@pytest.fixture
def proxied(s3_server):
    """(server, proxy, prefix): a fault proxy in front of the session's S3 server, AWS_* set for the block."""
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    try:
        with s3_server.environ():
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            yield s3_server, proxy, f"faults-{uuid.uuid4().hex[:10]}"
    finally:
        proxy.stop()
        if not s3_server.running:
            s3_server.start()


def _objects(server, prefix: str) -> dict[str, str]:
    return {k[len(prefix) + 1:]: hashlib.sha256(server.get(k)).hexdigest() for k in server.keys(prefix + "/")}


def _checkpoint(tmp_path, step=4, ws=4, payload=3 * 256 * 1024):
    """A Trainer checkpoint with ``ws`` optimizer shards of 4*payload bytes (3 MiB by default)."""
    return write_trainer_checkpoint(tmp_path / "out", step, ws=ws, payload=payload)


def _kill9(server) -> None:
    proc, server.proc = server.proc, None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _cli(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "zckpt", *args], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(stderr: str) -> str:
    """The user's error: exactly one ``zckpt: error:`` line, no traceback; other lines are retry notices/bars."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("zckpt: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def _push_every_put_once(proxy, prefix) -> None:
    """No object was PUT whole twice (a finished file is never resent), the manifest included."""
    twice = {k: n for k, n in proxy.puts.items() if f"/{prefix}/" in k and n > 1}
    assert not twice, twice


def _figures(name: str, **values) -> None:
    print(f"\nFIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


# ============================================================================================ the server itself


def test_server_killed_mid_push_then_restarted(proxied, tmp_path):
    """kill -9 of the S3 server mid-upload, back 2 s later: the push waits it out (retries) and completes;
    nothing that had arrived is sent again."""
    server, proxy, prefix = proxied
    ckpt = _checkpoint(tmp_path, ws=6)
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    dest = server.url(prefix)
    events, outcome = [], {}

    def run():
        try:
            outcome["result"] = P.push(str(ckpt.parent), dest, settle=0, workers=2, retries=6,
                                       progress=events.append)
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(e.kind == "file-done" for e in list(events)) < 2:
        time.sleep(0.01)
    _kill9(server)
    killed = time.monotonic()
    done = {e.path for e in list(events) if e.kind == "file-done"}  # acknowledged by the server before the kill
    assert thread.is_alive() and done
    time.sleep(2.0)
    server.start()
    back = time.monotonic()
    thread.join(180)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    assert outcome["result"].checkpoints[0].status == "pushed"
    objects = _objects(server, f"{prefix}/checkpoint-4")
    assert {k: v for k, v in objects.items() if k not in SIDE} == local_files(ckpt)
    key = f"/{server.bucket}/{prefix}/checkpoint-4/"
    assert {rel: proxy.puts[key + rel] for rel in done} == {rel: 1 for rel in done}  # finished: never resent
    retries = [e for e in events if e.kind == "retry"]
    _figures("server-killed", down_s=round(back - killed, 1), zckpt_retries=len(retries),
             total_s=round(time.monotonic() - killed, 1), bytes_total=total,
             put_bytes_on_wire=proxy.put_bytes, resent_bytes=proxy.put_bytes - total)


def test_server_down_one_line_error_then_rerun_resends_nothing(proxied, tmp_path):
    """The server dies mid-push and stays down, default --retries: within tens of seconds one line naming the
    endpoint and the cause, exit 75, the older checkpoint not tried, no manifest; once the server is back the next
    run sends only what had not arrived, and the older checkpoint."""
    server, proxy, prefix = proxied
    ckpt = _checkpoint(tmp_path, ws=6)
    older = write_trainer_checkpoint(ckpt.parent, 2)
    env = {**os.environ}
    dest = server.url(prefix)
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(ckpt.parent), dest, "--settle", "0",
                             "--workers", "1"], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    # 3 PUTs on the wire (the push record, then files one by one): the first file's answer reached the client
    # before it sent the next, so the server had stored it when it is killed
    while time.monotonic() < deadline and sum(proxy.puts.values()) < 3 and proc.poll() is None:
        time.sleep(0.01)
    _kill9(server)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=240)
    detected = time.monotonic() - killed
    assert proc.returncode == 75, err
    line = _one_error_line(err)
    assert f"S3 endpoint {proxy.endpoint} unreachable (connection refused)" in line, line
    assert "finished files will not be resent" in line and f"s3://{server.bucket}/{prefix}/checkpoint-4" in line
    assert "stopped, 1 more checkpoint not tried" in line, line
    assert detected < 60
    server.start()
    arrived = {k for k in server.keys(f"{prefix}/") if not k.endswith(RECORD)}  # stored when it died
    assert arrived and not any(k.endswith(MANIFEST) for k in arrived)  # not marked complete
    assert not server.keys(f"{prefix}/checkpoint-2/")  # not tried
    before = dict(proxy.puts)
    rerun = _cli(env, "push", str(ckpt.parent), dest, "--settle", "0", "--json")
    assert rerun.returncode == 0, rerun.stderr
    c, c2 = json.loads(rerun.stdout)["checkpoints"]
    assert c["status"] == "pushed" and c["files_skipped"] == len(arrived) and c2["status"] == "pushed"
    assert {k: proxy.puts[f"/{server.bucket}/{k}"] for k in arrived} == \
        {k: before.get(f"/{server.bucket}/{k}", 0) for k in arrived}  # none of them sent again
    for folder in (ckpt, older):
        assert {k: v for k, v in _objects(server, f"{prefix}/{folder.name}").items() if k not in SIDE} == \
            local_files(folder)
    _figures("server-down", detected_s=round(detected, 1), files_there_before=len(arrived),
             files_sent_by_rerun=c["files_sent"])


# ============================================================================================ the connection


def test_connection_resets_mid_body_are_retried(proxied, tmp_path):
    """Connections reset (RST) in the middle of PUT bodies: retried, the push completes, every object arrives
    whole once; a second push sends nothing."""
    server, proxy, prefix = proxied
    ckpt = _checkpoint(tmp_path)
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    proxy.reset_puts(6, after=256 * 1024)
    events = []
    started = time.monotonic()
    result = P.push(str(ckpt.parent), server.url(prefix), settle=0, workers=2, progress=events.append)
    took = time.monotonic() - started
    assert result.checkpoints[0].status == "pushed" and proxy.pending["resets"] == 0
    assert {k: v for k, v in _objects(server, f"{prefix}/checkpoint-4").items() if k not in SIDE} == \
        local_files(ckpt)
    _push_every_put_once(proxy, prefix)
    puts = sum(proxy.puts.values())
    again = P.push(str(ckpt.parent), server.url(prefix), settle=0)
    assert again.checkpoints[0].status == "up-to-date" and sum(proxy.puts.values()) == puts
    _figures("resets", resets=6, seconds=round(took, 1), zckpt_retries=sum(e.kind == "retry" for e in events),
             resent_bytes=proxy.put_bytes - total)


def test_stalled_connection_is_detected_and_retried(proxied, tmp_path):
    """A PUT whose connection stops moving: the client gives up after its read timeout (here 2 s), retries,
    and the push completes."""
    server, proxy, prefix = proxied
    ckpt = _checkpoint(tmp_path, ws=2)
    proxy.stall_puts(1)
    options = {"config_kwargs": {"read_timeout": 2, "connect_timeout": 2}}
    started = time.monotonic()
    result = P.push(str(ckpt.parent), server.url(prefix), settle=0, workers=1, storage_options=options)
    took = time.monotonic() - started
    assert result.checkpoints[0].status == "pushed" and proxy.count("stall") == 1
    assert {k: v for k, v in _objects(server, f"{prefix}/checkpoint-4").items() if k not in SIDE} == \
        local_files(ckpt)
    _push_every_put_once(proxy, prefix)
    assert took < 60
    _figures("stall", read_timeout_s=2, seconds=round(took, 1))


def test_slowdown_bursts(proxied, tmp_path):
    """503 SlowDown: a short burst is absorbed by backoff; a long one ends in one line saying the server
    throttles, with no manifest; the next run finishes without resending what had arrived."""
    server, proxy, prefix = proxied
    ckpt = _checkpoint(tmp_path)
    proxy.slowdown(4)
    started = time.monotonic()
    result = P.push(str(ckpt.parent), server.url(prefix), settle=0)
    short = time.monotonic() - started
    assert result.checkpoints[0].status == "pushed" and proxy.count("slowdown") == 4
    _push_every_put_once(proxy, prefix)

    other = f"{prefix}-long"
    proxy.slowdown(10_000)
    env = {**os.environ}
    started = time.monotonic()
    run = _cli(env, "push", str(ckpt.parent), server.url(other), "--settle", "0", "--retries", "0")
    long_s = time.monotonic() - started
    assert run.returncode == 75  # a network/server fault: run again later
    line = _one_error_line(run.stderr)
    assert "throttled the upload (503 SlowDown)" in line and proxy.endpoint in line, line
    refused = proxy.count("slowdown") - 4
    assert not server.keys(f"{other}/")  # nothing arrived, nothing marked complete
    proxy.clear()
    rerun = _cli(env, "push", str(ckpt.parent), server.url(other), "--settle", "0")
    assert rerun.returncode == 0, rerun.stderr
    _push_every_put_once(proxy, other)
    assert {k: v for k, v in _objects(server, f"{other}/checkpoint-4").items() if k not in SIDE} == \
        local_files(ckpt)
    _figures("slowdown", short_burst=4, short_s=round(short, 1), long_refused_requests=refused,
             gave_up_after_s=round(long_s, 1))


# ============================================================================================ a full local disk


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs (root only; skipped where mounting is not allowed, as in tests/test_crash.py)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_local_destination_runs_out_of_space(small_disk, tmp_path):
    """DEST on a 1 MiB disk, the checkpoint 1.5 MiB: one line saying the disk is full, no manifest, no temp
    file left; with room made (the tmpfs grown) the next run copies only the files that were missing."""
    ckpt = _checkpoint(tmp_path, ws=3, payload=32 * 1024)  # 3 x 128 KiB shards + small files
    big = ckpt / "global_step4" / "extra_state.dat"
    big.write_bytes(os.urandom(1200 * 1024))
    os.utime(big, (time.time() - 60, time.time() - 60))
    dest = small_disk / "backup"
    run = _cli({**os.environ}, "push", str(ckpt.parent), str(dest), "--settle", "0", "--workers", "1")
    assert run.returncode == 1
    line = _one_error_line(run.stderr)
    assert "no space left at DEST" in line and "free space at DEST" in line, line
    there = {p.relative_to(dest / "checkpoint-4").as_posix(): p.stat().st_ino
             for p in (dest / "checkpoint-4").rglob("*") if p.is_file()}
    assert MANIFEST not in there and set(there) - {RECORD}  # some files arrived; not marked complete
    assert not [n for n in there if ".tmp" in n or (n.startswith(".") and n != RECORD)]  # no temp file left
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    rerun = _cli({**os.environ}, "push", str(ckpt.parent), str(dest), "--settle", "0", "--json")
    assert rerun.returncode == 0, rerun.stderr
    final = {p.relative_to(dest / "checkpoint-4").as_posix(): p.stat().st_ino
             for p in (dest / "checkpoint-4").rglob("*") if p.is_file()}
    assert {k: final[k] for k in there} == there  # finished files were not copied again
    assert {k: v for k, v in local_files(dest / "checkpoint-4").items() if k not in SIDE} == local_files(ckpt)
    _figures("enospc", files_before=len(set(there) - {RECORD}), files_sent_by_rerun=json.loads(rerun.stdout)["files_sent"])
