"""Backups you can trust (issue 21): push sends every file of the checkpoint whatever its folder is called,
``verify`` checks what it claims at every level, pushed and published files get ordinary permissions, and a push
that pushed nothing says so with a non-zero exit.

Each shape a user pushes is compared FILE BY FILE (name, size, sha256) with what arrived, on a local destination
and on the real S3 server of tests/s3server.py. The shapes come from the committed real fixtures (the Trainer
checkpoint and a DeepSpeed save folder) and from zckpt's own reshard output.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import zckpt
from tests.conftest import FIXTURES
from zckpt.ops import scan

ROOT = Path(__file__).resolve().parent.parent
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
SAVE = FIXTURES / "z2_bf16_ws2"  # a DeepSpeed save folder: latest, global_step3/, zero_to_*.py
PUSH_FILES = {scan.MANIFEST_NAME, scan.RECORD_NAME}


def digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def tree(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file below ``folder``: relative name -> (size, sha256)."""
    return {p.relative_to(folder).as_posix(): digest(p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def without_push_files(files: dict) -> dict:
    return {k: v for k, v in files.items() if k.rsplit("/", 1)[-1] not in PUSH_FILES}


def cli(*args, cwd=ROOT, umask: int | None = None, env=None) -> subprocess.CompletedProcess:
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=300, preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZCKPT_CACHE_DIR", str(tmp_path / "zckpt-cache"))


def _save_folder(root: Path) -> Path:
    save = root / "ds_save"
    shutil.copytree(SAVE, save, ignore=shutil.ignore_patterns("expected"))
    (save / "ds_config.json").write_text('{"train_batch_size": 4}')  # anything the user keeps there goes too
    return save


def _shapes(tmp: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (SRC to push, the folder whose every file must arrive)."""
    shapes = {}
    trainer = tmp / "outputs" / "checkpoint-4"
    shutil.copytree(TRAINER, trainer)
    shapes["checkpoint-N"] = (trainer, trainer)
    shapes["training-output-folder"] = (tmp / "outputs", trainer)
    renamed = tmp / "ren" / "my-run-final"  # the issue's example: cp -r checkpoint-4 my-run-final
    shutil.copytree(TRAINER, renamed)
    shapes["renamed-copy"] = (renamed, renamed)
    save = _save_folder(tmp)
    shapes["save-folder"] = (save, save)
    shapes["tag-folder"] = (save / "global_step3", save / "global_step3")
    resharded = Path(zckpt.reshard(str(trainer), str(tmp / "rs" / "resharded-checkpoint-4-ws2"), world_size=2).output)
    shapes["reshard-output"] = (resharded, resharded)
    return shapes


def _expected_at_dest(name: str, src: Path, whole: Path) -> dict:
    want = tree(whole)
    if name == "training-output-folder":
        want = {f"{whole.name}/{k}": v for k, v in want.items()}
    return want


def _check_manifests(name: str, got: dict, read) -> None:
    """Every pushed checkpoint has a push record and a manifest listing exactly its files, sizes and sha256."""
    manifests = [k for k in got if k.rsplit("/", 1)[-1] == scan.MANIFEST_NAME]
    assert manifests, f"{name}: no manifest at DEST"
    for m in manifests:
        base = m[: -len(scan.MANIFEST_NAME)]
        assert base + scan.RECORD_NAME in got, f"{name}: {m} without its push record"
        doc = json.loads(read(m))
        listed = {base + f["path"]: (f["size"], f["sha256"]) for f in doc["files"]}
        under = {k: v for k, v in without_push_files(got).items() if k.startswith(base)}
        assert listed == under, f"{name}: {m} does not list exactly the files under {base or '.'}"


SHAPES = ["checkpoint-N", "training-output-folder", "renamed-copy", "save-folder", "tag-folder", "reshard-output"]


def test_push_every_shape_locally_file_by_file(tmp_path):
    shapes = _shapes(tmp_path / "src")
    for name in SHAPES:
        src, whole = shapes[name]
        dest = tmp_path / "dest" / name
        proc = cli("push", src, dest, "--settle", "0", "--quiet")
        assert proc.returncode == 0, (name, proc.stderr)
        got = tree(dest)
        assert without_push_files(got) == _expected_at_dest(name, src, whole), name
        _check_manifests(name, got, lambda rel: (dest / rel).read_bytes())
        assert zckpt.verify(str(dest / ("checkpoint-4" if name == "training-output-folder" else "")), deep=True).ok


def test_push_every_shape_to_s3_file_by_file(s3_server, tmp_path):
    shapes = _shapes(tmp_path / "src")
    with s3_server.environ():
        prefix = f"backup-{uuid.uuid4().hex[:10]}"
        for name in SHAPES:
            src, whole = shapes[name]
            result = zckpt.push(str(src), s3_server.url(prefix, name), settle=0)
            assert not result.failed and result.files_sent, name
            keys = s3_server.keys(f"{prefix}/{name}/")
            got = {k[len(prefix) + len(name) + 2:]: digest(s3_server.get(k)) for k in keys}
            assert without_push_files(got) == _expected_at_dest(name, src, whole), name
            _check_manifests(name, got, lambda rel: s3_server.get(f"{prefix}/{name}/{rel}"))
            again = zckpt.push(str(src), s3_server.url(prefix, name), settle=0)
            assert again.files_sent == 0 and {c.status for c in again.checkpoints} == {"up-to-date"}, name


def test_the_issue_example_sends_the_trainer_files(tmp_path):
    """``cp -r checkpoint-4 my-run-final; zckpt push my-run-final dest --settle 0`` sent only global_step4/,
    latest and zero_to_*.py (exit 0); info called the same folder a Trainer checkpoint."""
    ren = tmp_path / "ren" / "my-run-final"
    shutil.copytree(TRAINER, ren)
    proc = cli("push", ren, "dest", "--settle", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = without_push_files(tree(tmp_path / "dest"))
    assert got == tree(ren) and len(got) == 16
    for name in ("config.json", "model.safetensors", "trainer_state.json", "scheduler.pt", "rng_state_0.pth",
                 "rng_state_1.pth", "training_args.bin", "tokenizer.json"):
        assert name in got
    assert importlib.import_module("zckpt.ops.info").info(str(ren))["trainer_checkpoint"]


def test_checkpoint_files_refuses_what_it_cannot_copy(tmp_path):
    ck = tmp_path / "checkpoint-4"
    shutil.copytree(TRAINER, ck)
    names = [f.rel for f in scan.checkpoint_files(str(ck))]
    assert names == sorted(tree(ck)) and len(names) == 16
    (ck / "extra").mkdir()
    (ck / "extra" / "notes.txt").write_text("mine")
    os.symlink(ck / "config.json", ck / "config-link.json")  # links are followed: the bytes are backed up
    names = [f.rel for f in scan.checkpoint_files(str(ck))]
    assert "extra/notes.txt" in names and "config-link.json" in names
    os.symlink(tmp_path / "nowhere", ck / "dangling.bin")
    with pytest.raises(scan.NotBackedUp, match="dangling.bin"):
        scan.checkpoint_files(str(ck))
    ok, reason = scan.check_complete(str(ck))
    assert not ok and "dangling.bin" in reason
    proc = cli("push", ck, tmp_path / "dest", "--settle", "0")
    assert proc.returncode != 0 and "dangling.bin" in proc.stdout + proc.stderr
    os.unlink(ck / "dangling.bin")
    os.symlink(ck, ck / "extra" / "loop")
    with pytest.raises(scan.NotBackedUp, match="loop"):
        scan.checkpoint_files(str(ck))


# ============================================================================================ permissions


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_pushed_and_published_files_get_ordinary_permissions(tmp_path, umask):
    """As ``cp -r`` would give under the user's umask: a pushed file gets its source's mode less the umask, a new
    folder 0777 less the umask (as ``mkdir -p``); merge/reshard outputs 0666 / 0777 less the umask. Pushed files
    were 0600 (tempfile.mkstemp), unreadable to the rest of a team."""
    src = tmp_path / "outputs" / "checkpoint-4"
    shutil.copytree(TRAINER, src)
    os.chmod(src / "zero_to_fp32.py", 0o755)
    proc = cli("push", tmp_path / "outputs", tmp_path / "dest", "--settle", "0", "--quiet", umask=umask)
    assert proc.returncode == 0, proc.stderr
    reference = tmp_path / "cp"
    subprocess.run(["sh", "-c", f"umask {umask:03o} && cp -r {src} {reference}"], check=True)
    pushed = _modes(tmp_path / "dest" / "checkpoint-4")
    cp = _modes(reference)
    for rel, mode in cp.items():  # files as cp makes them; folders as mkdir -p does
        want = 0o777 & ~umask if (reference / rel).is_dir() else mode
        assert pushed[rel] == want, (rel, oct(pushed[rel]), oct(want))
    assert pushed["zero_to_fp32.py"] == 0o755 & ~umask and pushed["config.json"] == 0o644 & ~umask
    for rel in (scan.MANIFEST_NAME, scan.RECORD_NAME):
        assert pushed[rel] == 0o666 & ~umask, rel
    # merge and reshard outputs: the published folder, its subfolders and files
    for command in (["merge", src, "-o", tmp_path / "merged"], ["reshard", src, "-w", "2", "-o", tmp_path / "rs"]):
        proc = cli(*command, "--quiet", umask=umask)
        assert proc.returncode == 0, proc.stderr
        out = Path(command[-1])
        for rel, mode in _modes(out).items():
            want = (0o777 if (out / rel).is_dir() else 0o666) & ~umask
            assert mode == want, (command[0], rel, oct(mode), oct(want))


# ============================================================================================ exit status


def test_a_one_shot_push_that_pushed_nothing_fails(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("push", empty, tmp_path / "dest", "--settle", "0")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "nothing pushed" in proc.stderr, proc
    assert "no checkpoint found" in proc.stderr
    assert cli("push", empty, tmp_path / "dest", "--settle", "0", "--allow-empty").returncode == 0
    outputs = tmp_path / "outputs"
    (outputs / "checkpoint-6" / "global_step6").mkdir(parents=True)  # being written
    proc = cli("push", outputs, tmp_path / "dest", "--settle", "0")
    assert proc.returncode == 1 and "nothing pushed" in proc.stderr and "trainer_state.json" in proc.stderr, proc
    assert "\n" not in proc.stderr.strip()
    proc = cli("push", outputs, tmp_path / "dest", "--settle", "0", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and doc["error"]["type"] == "NothingPushed"
    assert doc["result"]["checkpoints"][0]["status"] == "incomplete"
    shutil.copytree(TRAINER, outputs / "checkpoint-4")  # one complete: pushed, the incomplete one is said
    proc = cli("push", outputs, tmp_path / "dest", "--settle", "0")
    assert proc.returncode == 0 and "checkpoint-6: incomplete" in proc.stdout, proc
    assert cli("push", outputs, tmp_path / "dest", "--settle", "0").returncode == 0  # up to date: the backup is there
    # only zckpt outputs next to nothing: nothing found, said
    only = tmp_path / "only-outputs"
    zckpt.reshard(str(outputs / "checkpoint-4"), str(only / "resharded-checkpoint-4-ws3"), world_size=3)
    proc = cli("push", only, tmp_path / "dest2", "--settle", "0")
    assert proc.returncode == 1 and "no checkpoint found" in proc.stderr and "reshard output" in proc.stderr, proc


def test_push_every_goes_on_waiting_when_nothing_is_there(tmp_path):
    import signal
    import time

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(empty), str(tmp_path / "dest"), "--every",
                             "1s", "--settle", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        time.sleep(4)
        assert proc.poll() is None  # still waiting for checkpoints to appear
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "error" not in err


def test_outputs_named_like_a_checkpoint_next_to_the_source_are_refused(tmp_path):
    """The guide: ``-o outputs/checkpoint-2`` is refused, also when it does not exist yet (the Trainer's rotation
    deletes checkpoint-* folders, resuming takes the newest for a checkpoint)."""
    outputs = tmp_path / "outputs"
    shutil.copytree(TRAINER, outputs / "checkpoint-4")
    for command in (["merge", outputs / "checkpoint-4", "-o", outputs / "checkpoint-2"],
                    ["merge", outputs / "checkpoint-4", "-o", outputs / "checkpoint-40"],
                    ["reshard", outputs / "checkpoint-4", "-w", "2", "-o", outputs / "checkpoint-8"],
                    ["reshard", outputs / "checkpoint-4", "-w", "2", "-o", outputs / "global_step9"]):
        proc = cli(*command, "--quiet")
        assert proc.returncode == 1 and "named like a checkpoint" in proc.stderr, (command, proc.stderr)
        assert not Path(command[-1]).exists()
    assert sorted(p.name for p in outputs.iterdir()) == ["checkpoint-4"]
    # elsewhere the name is the user's business (a new run resuming from a resharded copy)
    proc = cli("reshard", outputs / "checkpoint-4", "-w", "2", "-o", tmp_path / "new-run" / "checkpoint-4", "--quiet")
    assert proc.returncode == 0, proc.stderr


# ============================================================================================ --overwrite


def test_overwrite_never_deletes_what_the_user_added(tmp_path):
    """``merge ... --overwrite`` deleted a README.md the user had put next to the shards, without a word."""
    src = tmp_path / "outputs" / "checkpoint-4"
    shutil.copytree(TRAINER, src)
    out = tmp_path / "model"
    zckpt.merge(str(src), str(out))
    (out / "README.md").write_text("# my model card")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    before = tree(out)
    proc = cli("merge", src, "-o", out, "--overwrite", "--dtype", "bf16", "--quiet")
    assert proc.returncode == 1 and "README.md" in proc.stderr and "\n" not in proc.stderr.strip(), proc.stderr
    assert "(and 1 more)" in proc.stderr
    assert tree(out) == before  # nothing replaced, nothing deleted
    (out / "README.md").unlink()
    shutil.rmtree(out / "eval")
    assert cli("merge", src, "-o", out, "--overwrite", "--dtype", "bf16", "--quiet").returncode == 0
    assert json.loads((out / ".zckpt.json").read_text())["kind"] == "merge"
    # reshard alike: a later DeepSpeed save into the resharded folder is the user's
    rs = tmp_path / "rs"
    zckpt.reshard(str(src), str(rs), world_size=2)
    shutil.copytree(rs / "global_step4", rs / "global_step6")
    before = tree(rs)
    proc = cli("reshard", src, "-w", "3", "-o", rs, "--overwrite", "--quiet")
    assert proc.returncode == 1 and "global_step6/" in proc.stderr, proc.stderr
    assert tree(rs) == before
    shutil.rmtree(rs / "global_step6")
    assert cli("reshard", src, "-w", "3", "-o", rs, "--overwrite", "--quiet").returncode == 0
    assert zckpt.open_checkpoint(str(rs)).world_size == 3
