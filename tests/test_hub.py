"""``zckpt push hf://...`` and ``zckpt merge hf://...`` through the real, unmodified ``huggingface_hub`` client,
against the Hub stand-in of :mod:`tests.hubserver` on 127.0.0.1 (``HF_ENDPOINT``; ``HF_HUB_DISABLE_XET=1``, so
uploads take the LFS path: basic and multipart transfers; Xet is not exercised).

Every comparison is made with what the stand-in stored (content sha256 per file, LFS objects received per oid,
bytes of upload bodies received), never with what zckpt says it did.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_push import age_files, local_files, write_tag, write_trainer_checkpoint

pytest_plugins = ["tests.hubserver"]

ROOT = Path(__file__).resolve().parent.parent
REAL_TRAINER = ROOT / "fixtures" / "trainer" / "checkpoint-4"
MANIFEST = "zckpt-manifest.json"
REPO = "me/run1"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ZCKPT_CACHE_DIR", str(tmp_path / "zckpt-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def _env(hub, tmp_path) -> dict:
    env = hub.env()
    env.update({"PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf-home"),
                "ZCKPT_CACHE_DIR": str(tmp_path / "zckpt-cache"), "COLUMNS": "120"})
    env.pop("ZCKPT_DISABLE_PROGRESS_BARS", None)
    return env


def _zckpt(env, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "zckpt", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _hub_files(hub, prefix: str) -> dict[str, str]:
    """``{relative path: sha256}`` of what the stand-in holds under ``prefix/`` at main's head."""
    return {p[len(prefix) + 1:]: hashlib.sha256(data).hexdigest()
            for p, data in hub.files(REPO).items() if p.startswith(prefix + "/")}


def _titles(hub) -> list[str]:
    return [c.title for c in hub.repo(REPO).commits[1:]]  # after the stand-in's initial commit


def _client_bars(stderr: str) -> list[str]:
    """Lines of huggingface_hub's own tqdm bars (a file name or 'Upload N LFS files' then a percentage)."""
    return [line for line in stderr.replace("\r", "\n").splitlines()
            if "%|" in line and not line.lstrip().startswith(("checkpoint-", "global_step"))]


def test_push_keep_last_and_merge_through_the_real_client(hub_server, tmp_path):
    """A real Trainer checkpoint and a synthetic one pushed, each one commit, identical file by file; an unchanged
    push sends nothing; --keep-last removes the oldest in one commit; merge from hf:// equals a local merge."""
    if not REAL_TRAINER.is_dir():
        pytest.skip(f"{REAL_TRAINER} not generated yet")
    hub, env = hub_server, _env(hub_server, tmp_path)
    src = tmp_path / "out"
    src.mkdir()
    shutil.copytree(REAL_TRAINER, src / "checkpoint-4")
    age_files(src / "checkpoint-4", 60)
    write_trainer_checkpoint(src, 2)

    run = _zckpt(env, "push", str(src), f"hf://{REPO}", "--settle", "0")
    assert run.returncode == 0, run.stderr
    assert _titles(hub) == ["zckpt push: checkpoint-4 (step 4)", "zckpt push: checkpoint-2 (step 2)"]
    assert hub.repo(REPO).private  # the repo did not exist: created private
    for name in ("checkpoint-4", "checkpoint-2"):
        there = _hub_files(hub, name)
        manifest = json.loads(hub.files(REPO)[f"{name}/{MANIFEST}"])
        assert {k: v for k, v in there.items() if k != MANIFEST} == local_files(src / name)
        assert {f["path"]: f["sha256"] for f in manifest["files"]} == local_files(src / name)
    # the client's own calls see the same: one commit per checkpoint, the tree through HfApi
    api = hub.api()
    assert [c.title for c in api.list_repo_commits(REPO)][:2] == ["zckpt push: checkpoint-2 (step 2)",
                                                                   "zckpt push: checkpoint-4 (step 4)"]
    assert not _client_bars(run.stderr), run.stderr
    assert "checkpoint-4: pushed" in run.stdout

    received, puts = hub.received, dict(hub.puts)
    again = _zckpt(env, "push", str(src), f"hf://{REPO}", "--settle", "0", "--json")
    assert again.returncode == 0, again.stderr
    assert {c["status"] for c in json.loads(again.stdout)["checkpoints"]} == {"up-to-date"}
    assert len(_titles(hub)) == 2 and hub.received == received and hub.puts == puts

    write_trainer_checkpoint(src, 6)
    kept = _zckpt(env, "push", str(src), f"hf://{REPO}", "--settle", "0", "--keep-last", "2")
    assert kept.returncode == 0, kept.stderr
    assert _titles(hub)[2:] == ["zckpt push: checkpoint-6 (step 6)",
                                "zckpt push: remove checkpoint-2 (--keep-last)"]
    assert {p.split("/")[0] for p in hub.files(REPO)} == {"checkpoint-4", "checkpoint-6"}
    assert {k: v for k, v in _hub_files(hub, "checkpoint-6").items() if k != MANIFEST} == \
        local_files(src / "checkpoint-6")

    # merge straight from the Hub (HfFileSystem, ranged GETs of /resolve/) equals a local merge
    ranged_before = hub.ranged
    from_hub = _zckpt(env, "merge", f"hf://{REPO}/checkpoint-4", "-o", str(tmp_path / "m-hub"))
    assert from_hub.returncode == 0, from_hub.stderr
    local = _zckpt(env, "merge", str(src / "checkpoint-4"), "-o", str(tmp_path / "m-local"))
    assert local.returncode == 0, local.stderr
    assert hub.ranged > ranged_before  # read by ranges, not whole-file downloads
    hub_out, local_out = local_files(tmp_path / "m-hub"), local_files(tmp_path / "m-local")
    weights = [k for k in local_out if k.endswith(".safetensors")]
    assert weights and {k: hub_out[k] for k in weights} == {k: local_out[k] for k in weights}
    assert set(hub_out) == set(local_out)


def test_kill9_mid_upload_then_rerun_resends_nothing_finished(hub_server, tmp_path):
    """kill -9 of `zckpt push` while LFS objects are uploading (multipart and basic): no commit, nothing in the
    repo; the rerun commits everything and the Hub receives no object twice."""
    hub, env = hub_server, _env(hub_server, tmp_path)
    hub.multipart_threshold, hub.chunk_size = 2 * 1024 * 1024, 1024 * 1024
    hub.throttle = 6 * 1024 * 1024  # bytes/s: about half a second per shard
    src = tmp_path / "out"
    ckpt = write_trainer_checkpoint(src, 8, ws=6, payload=3 * 256 * 1024)  # 6 x 3 MB optimizer shards
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(src), f"hf://{REPO}", "--settle", "0",
                             "--workers", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None and len(hub.puts) < 2:
            time.sleep(0.02)
        assert proc.poll() is None, f"push ended before it could be killed: {proc.communicate()}"
        proc.kill()
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    finished = dict(hub.puts)
    assert len(finished) >= 2 and all(n == 1 for n in finished.values())
    assert _titles(hub) == [] and hub.files(REPO) == {}  # nothing is visible, nothing marked complete

    hub.throttle = None
    received = hub.received
    rerun = _zckpt(env, "push", str(src), f"hf://{REPO}", "--settle", "0", "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert _titles(hub) == ["zckpt push: checkpoint-8 (step 8)"]
    assert {k: v for k, v in _hub_files(hub, "checkpoint-8").items() if k != MANIFEST} == local_files(ckpt)
    assert all(n == 1 for n in hub.puts.values()), hub.puts  # no LFS object sent twice
    finished_bytes = sum(len(hub.lfs[oid]) for oid in finished)
    assert hub.received - received <= total - finished_bytes


def test_progress_counts_the_bytes_the_hub_receives(hub_server, tmp_path, monkeypatch):
    """zckpt's own progress events add up to the bytes that reached the Hub (LFS bodies plus the small files the
    commit carries) and arrive while uploading, before the commit; the client's bars stay off."""
    import importlib

    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    P = importlib.import_module("zckpt.backup.push")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # (read at import: the env var is too late here)
    hub = hub_server
    hub.multipart_threshold, hub.chunk_size = 2 * 1024 * 1024, 1024 * 1024
    src = tmp_path / "out"
    ckpt = write_trainer_checkpoint(src, 2, ws=3, payload=3 * 256 * 1024)
    seen: list[tuple[int, int, bool]] = []  # (nbytes, commits at the time, client bars disabled)

    def progress(ev):
        if ev.kind == "bytes":
            seen.append((ev.nbytes, len(hub.repos.get(("model", REPO)).commits) if ("model", REPO) in hub.repos
                         else 0, are_progress_bars_disabled()))

    bars_before = are_progress_bars_disabled()
    result = P.push(str(src), f"hf://{REPO}", settle=0, hub_api=hub.api(), progress=progress, workers=2)
    assert result.checkpoints[0].status == "pushed"
    stored = hub.repo(REPO).head.files
    regular = sum(e.size for p, e in stored.items() if e.lfs_oid is None and not p.endswith(MANIFEST))
    assert sum(n for n, _, _ in seen) == hub.received + regular
    assert hub.received > 0.9 * sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) - regular
    before_commit = sum(n for n, commits, _ in seen if commits <= 1)
    assert before_commit >= hub.received  # the LFS bytes were shown as they went, not at the commit
    assert all(off for _, _, off in seen)  # huggingface_hub's bars were off meanwhile ...
    assert are_progress_bars_disabled() == bars_before  # ... and are as they were afterwards


def test_file_over_the_hub_limit_is_refused_before_any_upload(hub_server, tmp_path):
    """A (sparse) file over 50 GB: one line naming it and saying to reshard; nothing read, sent or committed."""
    hub, env = hub_server, _env(hub_server, tmp_path)
    src = tmp_path / "out"
    ckpt = write_trainer_checkpoint(src, 2)
    huge = ckpt / "global_step2" / "extra_state.dat"
    with open(huge, "wb") as f:
        f.truncate(50 * 1000 ** 3 + 1)  # sparse: no disk space used
    age_files(ckpt, 60)
    started = time.monotonic()
    run = _zckpt(env, "push", str(src), f"hf://{REPO}", "--settle", "0")
    assert run.returncode == 1, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1, run.stderr
    assert "extra_state.dat" in lines[0] and "50 GB" in lines[0] and "reshard" in lines[0], lines[0]
    assert time.monotonic() - started < 60  # not hashed (50 GB would take minutes)
    assert hub.received == 0 and not hub.puts and hub.files(REPO) == {}
    assert not any(path.endswith(("/preupload/main", "/objects/batch", "/commit/main"))
                   for _, path in hub.requests)


def test_deepspeed_save_folder_latest_after_its_tag(hub_server, tmp_path):
    """A DeepSpeed save folder: each tag one commit, `latest` committed only once its tag is complete there."""
    hub, env = hub_server, _env(hub_server, tmp_path)
    src = tmp_path / "ds"
    write_tag(src / "global_step3", 3)
    (src / "latest").write_text("global_step3")
    age_files(src, 60)
    run = _zckpt(env, "push", str(src), f"hf://{REPO}/ds", "--settle", "0")
    assert run.returncode == 0, run.stderr
    assert _titles(hub) == ["zckpt push: global_step3 (step 3)", "zckpt push: latest"]
    files = hub.files(REPO)
    assert files["ds/latest"] == b"global_step3"
    assert {k: v for k, v in _hub_files(hub, "ds/global_step3").items() if k != MANIFEST} == \
        local_files(src / "global_step3")
