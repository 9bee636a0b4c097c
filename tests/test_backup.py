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
from zckpt.backup import scan
from zckpt.backup.files import NotBackedUp, checkpoint_files

ROOT = Path(__file__).resolve().parent.parent
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
SAVE = FIXTURES / "z2_bf16_ws2"  # a DeepSpeed save folder: latest, global_step3/, zero_to_*.py
MANIFEST, RECORD = "zckpt-manifest.json", ".zckpt-push.json"  # push's commit (written last) and record (first)
PUSH_FILES = {MANIFEST, RECORD}


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
    manifests = [k for k in got if k.rsplit("/", 1)[-1] == MANIFEST]
    assert manifests, f"{name}: no manifest at DEST"
    for m in manifests:
        base = m[: -len(MANIFEST)]
        assert base + RECORD in got, f"{name}: {m} without its push record"
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


def test_a_training_output_folder_with_a_renamed_checkpoint_and_a_saved_model(tmp_path):
    """Inside a training output folder a renamed Trainer checkpoint (trainer_state.json) is one; a model saved with
    trainer.save_model() (training_args.bin, no trainer_state.json) is not, like runs/."""
    outputs = tmp_path / "outputs"
    shutil.copytree(TRAINER, outputs / "checkpoint-4")
    shutil.copytree(TRAINER, outputs / "best-run")
    final = outputs / "final"
    final.mkdir()
    for name in ("config.json", "model.safetensors", "training_args.bin"):
        shutil.copyfile(TRAINER / name, final / name)
    result = zckpt.push(str(outputs), str(tmp_path / "dest"), settle=0)
    assert {c.name: c.status for c in result.checkpoints} == {"checkpoint-4": "pushed", "best-run": "pushed"}
    assert without_push_files(tree(tmp_path / "dest" / "best-run")) == tree(outputs / "best-run")


def test_checkpoint_files_refuses_what_it_cannot_copy(tmp_path):
    ck = tmp_path / "checkpoint-4"
    shutil.copytree(TRAINER, ck)
    names = [f.rel for f in checkpoint_files(str(ck))]
    assert names == sorted(tree(ck)) and len(names) == 16
    (ck / "extra").mkdir()
    (ck / "extra" / "notes.txt").write_text("mine")
    os.symlink(ck / "config.json", ck / "config-link.json")  # links are followed: the bytes are backed up
    names = [f.rel for f in checkpoint_files(str(ck))]
    assert "extra/notes.txt" in names and "config-link.json" in names
    os.symlink(tmp_path / "nowhere", ck / "dangling.bin")
    with pytest.raises(NotBackedUp, match="dangling.bin"):
        checkpoint_files(str(ck))
    ok, reason = scan.check_complete(str(ck))
    assert not ok and "dangling.bin" in reason
    proc = cli("push", ck, tmp_path / "dest", "--settle", "0")
    assert proc.returncode != 0 and "dangling.bin" in proc.stdout + proc.stderr
    os.unlink(ck / "dangling.bin")
    os.symlink(ck, ck / "extra" / "loop")
    with pytest.raises(NotBackedUp, match="loop"):
        checkpoint_files(str(ck))


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
    for rel in (MANIFEST, RECORD):
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
        assert proc.returncode == 2 and "named like a checkpoint" in proc.stderr, (command, proc.stderr)
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


# ============================================================================================ verify


def flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = min(len(data) - 1, int(len(data) * where))
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


def _pushed(tmp_path: Path) -> dict[str, Path]:
    """A Trainer output folder and a DeepSpeed save folder, pushed to local folders."""
    outputs = tmp_path / "outputs"
    shutil.copytree(TRAINER, outputs / "checkpoint-4")
    save = _save_folder(tmp_path)
    zckpt.push(str(outputs), str(tmp_path / "dest-trainer"), settle=0)
    zckpt.push(str(save), str(tmp_path / "dest-save"), settle=0)
    return {"trainer": tmp_path / "dest-trainer", "save": tmp_path / "dest-save", "outputs": outputs, "src": save}


#: the levels a user verifies a backup at: (which push, path below its DEST)
TRAINER_LEVELS = ["", "checkpoint-4", "checkpoint-4/global_step4"]  # a push destination, checkpoint-N, a tag
SAVE_LEVELS = ["", "global_step3"]  # a save folder, a tag


def _damaged_copy(dests: dict, which: str, tmp_path: Path, damage) -> Path:
    copy = tmp_path / f"damaged-{uuid.uuid4().hex[:6]}"
    shutil.copytree(dests[which], copy)
    damage(copy)
    return copy


def _caught(folder: Path, level: str, deep: bool) -> tuple[bool, str]:
    report = zckpt.verify(str(folder / level) if level else str(folder), deep=deep)
    bad = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
    return not report.ok, "; ".join(bad)


def test_verify_checks_every_level_of_an_intact_backup(tmp_path):
    dests = _pushed(tmp_path)
    for which, levels in (("trainer", TRAINER_LEVELS), ("save", SAVE_LEVELS)):
        for level in levels:
            for deep in (False, True):
                report = zckpt.verify(str(dests[which] / level), deep=deep)
                assert report.ok, (which, level, deep, [c for c in report.checks if not c.ok])
                names = {c.name.split(": ", 1)[-1] for c in report.checks}
                assert "manifest" in names, (which, level, names)  # found and checked at every level
                if deep:
                    assert report.bytes_read >= sum(f.stat().st_size for f in (dests[which] / level).rglob("*.pt"))


@pytest.mark.parametrize("damage", ["rng_state_0.pth", "scheduler.pt", "model.safetensors", "edited manifest",
                                    "deleted manifest"])
def test_verify_deep_catches_damage_to_a_pushed_trainer_checkpoint_at_every_level(tmp_path, damage):
    dests = _pushed(tmp_path)

    def do(folder: Path) -> None:
        ck = folder / "checkpoint-4"
        if damage == "edited manifest":
            doc = json.loads((ck / MANIFEST).read_text())
            entry = next(f for f in doc["files"] if f["path"] == "global_step4/mp_rank_00_model_states.pt")
            entry["sha256"] = "0" * 64
            (ck / MANIFEST).write_text(json.dumps(doc))
        elif damage == "deleted manifest":
            (ck / MANIFEST).unlink()
        else:
            flip(ck / damage, 0.98 if damage == "model.safetensors" else 0.5)  # tensor data, not the header

    copy = _damaged_copy(dests, "trainer", tmp_path, do)
    for level in TRAINER_LEVELS:
        caught, why = _caught(copy, level, deep=True)
        assert caught, (damage, level)
        if damage == "deleted manifest":
            assert "not complete" in why and _caught(copy, level, deep=False)[0], (level, why)
        elif damage != "edited manifest":
            assert damage in why or "sha256" in why, (level, why)
    proc = cli("verify", copy / "checkpoint-4", "--deep")
    assert proc.returncode == 1 and "NOT consistent" in proc.stderr and proc.stderr.count("\n") == 1  # one line


@pytest.mark.parametrize("damage", ["rank file", "edited manifest", "deleted manifest", "zero_to_fp32.py"])
def test_verify_catches_damage_to_a_pushed_save_folder_at_every_level(tmp_path, damage):
    dests = _pushed(tmp_path)

    def do(folder: Path) -> None:
        tag = folder / "global_step3"
        if damage == "edited manifest":
            doc = json.loads((tag / MANIFEST).read_text())
            doc["files"][0]["sha256"] = "f" * 64
            (tag / MANIFEST).write_text(json.dumps(doc))
        elif damage == "deleted manifest":
            (tag / MANIFEST).unlink()
        elif damage == "rank file":
            flip(next(tag.glob("*optim_states.pt")))
        else:
            (folder / "zero_to_fp32.py").unlink()

    copy = _damaged_copy(dests, "save", tmp_path, do)
    for level in SAVE_LEVELS:
        if damage == "zero_to_fp32.py":  # top-level files of a save folder are not in a tag's manifest: said
            assert zckpt.verify(str(copy / level), deep=True).ok
            continue
        assert _caught(copy, level, deep=True)[0], (damage, level)
        if damage == "deleted manifest":
            assert _caught(copy, level, deep=False)[0], level


def test_verify_deep_reads_every_file_of_a_source_checkpoint(tmp_path):
    """No manifest at the source: torch zips (rng states, scheduler, training args) are caught by their CRCs; a
    safetensors file's data has no checksum (its header is checked)."""
    from zckpt.encoding.zipentries import read_file_entries

    for damage in ("rng_state_0.pth", "scheduler.pt", "training_args.bin"):
        ck = tmp_path / damage / "checkpoint-4"
        shutil.copytree(TRAINER, ck)
        entry = max(read_file_entries(str(ck / damage)).values(), key=lambda e: e.size)  # inside an entry's data
        data = bytearray((ck / damage).read_bytes())  # (the padding between entries has no CRC)
        data[entry.data_offset + entry.size // 2] ^= 0x40
        (ck / damage).write_bytes(bytes(data))
        report = zckpt.verify(str(ck), deep=True)
        assert not report.ok and damage in str([c.detail for c in report.checks if not c.ok]), damage
        assert report.bytes_read >= sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
    ck = tmp_path / "header" / "checkpoint-4"
    shutil.copytree(TRAINER, ck)
    with open(ck / "model.safetensors", "ab") as f:
        f.write(b"x")  # longer than its header says
    assert not zckpt.verify(str(ck)).ok and not zckpt.verify(str(ck), deep=True).ok


def test_verify_a_push_that_did_not_finish(tmp_path):
    """The push record is written before any file: a killed push (no manifest) is reported as not complete at DEST,
    even when every rank file had arrived; an ordinary checkpoint (no record) needs no manifest."""
    src = tmp_path / "outputs" / "checkpoint-4"
    shutil.copytree(TRAINER, src)
    dest = tmp_path / "dest"
    zckpt.push(str(tmp_path / "outputs"), str(dest), settle=0)
    (dest / "checkpoint-4" / MANIFEST).unlink()
    (dest / "checkpoint-4" / "scheduler.pt").unlink()  # what had not arrived yet
    proc = cli("verify", dest / "checkpoint-4")
    assert proc.returncode == 1 and "not complete" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    shutil.rmtree(dest / "checkpoint-4" / "global_step4")  # not even the rank files: still said the same way
    proc = cli("verify", dest / "checkpoint-4")
    assert proc.returncode == 1 and "not complete" in proc.stdout + proc.stderr, proc
    assert zckpt.verify(str(src), deep=True).ok


def test_verify_a_backup_on_s3(s3_server, tmp_path):
    outputs = tmp_path / "outputs"
    shutil.copytree(TRAINER, outputs / "checkpoint-4")
    with s3_server.environ():
        prefix = f"verify-{uuid.uuid4().hex[:10]}"
        dest = s3_server.url(prefix)
        zckpt.push(str(outputs), dest, settle=0)
        for level in ("", "checkpoint-4", "checkpoint-4/global_step4"):
            url = s3_server.url(prefix, *level.split("/")) if level else dest
            assert zckpt.verify(url, deep=True).ok, level
        from zckpt.io import storage
        key = storage.join(dest, "checkpoint-4", "rng_state_0.pth")
        data = bytearray(storage.read_bytes(key))
        data[len(data) // 2] ^= 1
        storage.write_bytes_atomic(key, bytes(data))
        for level in ("checkpoint-4", "checkpoint-4/global_step4"):
            assert not zckpt.verify(s3_server.url(prefix, *level.split("/")), deep=True).ok, level
        storage.remove(storage.join(dest, "checkpoint-4", MANIFEST))
        assert not zckpt.verify(s3_server.url(prefix, "checkpoint-4")).ok
