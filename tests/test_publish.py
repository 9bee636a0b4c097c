"""Publishing outputs (zckpt/io/publish.py): where merge/reshard may write, --overwrite, atomic replacement, commit
markers on object stores, and push never taking a zckpt output for a checkpoint.

Each test reproduces a defect that shipped once (issue 12):
- ``merge outputs/checkpoint-4 -o outputs --overwrite`` deleted checkpoint-2/ and checkpoint-4/;
- ``-o <the source itself> --overwrite`` deleted the rank files;
- ``merge`` without ``-o`` wrote into the checkpoint (checkpoint-4/merged-fp32/) and ``push`` uploaded it;
- ``reshard`` refused the parent case with a message that did not fit it.
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
import uuid
from pathlib import Path

import pytest

import zckpt
from zckpt.io import publish, storage
from zckpt.errors import InvalidArgument, OutputExists
from zckpt.ops.verify import verify
from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
SAVE = FIXTURES / "z2_bf16_ws2"  # a DeepSpeed save folder: latest, global_step3/, scripts


def tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def outputs(tmp_path) -> Path:
    """A Trainer output folder with two checkpoints (copies of the committed Trainer fixture)."""
    out = tmp_path / "outputs"
    shutil.copytree(TRAINER, out / "checkpoint-4")
    shutil.copytree(TRAINER, out / "checkpoint-2")
    return out


@pytest.fixture
def save_dir(tmp_path) -> Path:
    dst = tmp_path / "run" / "ckpts"
    shutil.copytree(SAVE, dst, ignore=shutil.ignore_patterns("expected"))
    return dst


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


# ======================================================================= output never touches the source


def test_merge_into_parent_is_refused_and_nothing_is_deleted(outputs):
    before = tree(outputs)
    proc = cli("merge", str(outputs / "checkpoint-4"), "-o", str(outputs), "--overwrite", "--quiet")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "contains the source checkpoint" in lines[0], proc.stderr
    assert tree(outputs) == before
    with pytest.raises(InvalidArgument, match="contains the source checkpoint"):
        zckpt.merge(str(outputs / "checkpoint-4"), str(outputs), overwrite=True)
    with pytest.raises(InvalidArgument, match="contains the source checkpoint"):
        zckpt.merge(str(outputs / "checkpoint-4"), str(outputs.parent), overwrite=True)
    assert tree(outputs) == before


def test_merge_and_reshard_refuse_alike(outputs):
    """The same rule and the same message in both commands (reshard's used to be wrong for the parent case)."""
    src = str(outputs / "checkpoint-4")
    for out, words in ((outputs, "contains the source checkpoint"), (outputs / "checkpoint-4", "source checkpoint itself"),
                       (outputs / "checkpoint-4" / "m", "inside the source checkpoint"),
                       (outputs / "checkpoint-4" / "global_step4", "source checkpoint itself"),
                       (outputs / "checkpoint-2", "next to the source"),
                       (outputs / "checkpoint-2" / "x", "inside checkpoint")):
        with pytest.raises(InvalidArgument) as merge_err:
            zckpt.merge(src, str(out), overwrite=True)
        with pytest.raises(InvalidArgument) as reshard_err:
            zckpt.reshard(src, str(out), world_size=3, overwrite=True)
        assert words in str(merge_err.value)
        assert str(merge_err.value) == str(reshard_err.value)
        assert str(out) in str(merge_err.value)


def test_output_is_the_source_or_inside_it(outputs, save_dir):
    before = tree(outputs)
    for out in (outputs / "checkpoint-4", outputs / "checkpoint-4" / "merged-fp32"):
        proc = cli("merge", str(outputs / "checkpoint-4"), "-o", str(out), "--overwrite", "--quiet")
        assert proc.returncode != 0 and "source checkpoint" in proc.stderr, proc.stderr
    assert tree(outputs) == before
    # a tag folder given directly: its save folder (with latest and every tag) is the source
    saved = tree(save_dir)
    for out in (save_dir, save_dir / "global_step3", save_dir / "other", save_dir.parent):
        with pytest.raises(InvalidArgument):
            zckpt.merge(str(save_dir / "global_step3"), str(out), overwrite=True)
        with pytest.raises(InvalidArgument):
            zckpt.reshard(str(save_dir / "global_step3"), str(out), world_size=3, overwrite=True)
    # through a symlink: compared by real path
    (save_dir.parent / "alias").symlink_to(save_dir)
    with pytest.raises(InvalidArgument):
        zckpt.merge(str(save_dir), str(save_dir.parent / "alias" / "m"))
    assert tree(save_dir) == saved


# ======================================================================================== default outputs


def test_default_outputs_lie_next_to_the_checkpoint(outputs):
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints
    from zckpt.backup.find import find_checkpoints
    before = tree(outputs / "checkpoint-4")
    res = zckpt.merge(str(outputs / "checkpoint-4"), dtype="bf16")
    assert Path(res.output) == outputs / "merged-checkpoint-4-bf16"
    assert (outputs / "merged-checkpoint-4-bf16" / "model.safetensors").exists()
    assert publish.read_marker(res.output)["kind"] == "merge"
    rs = zckpt.reshard(str(outputs / "checkpoint-4"), world_size=3)
    assert Path(rs.output) == outputs / "resharded-checkpoint-4-ws3"
    assert zckpt.open_checkpoint(rs.output).world_size == 3
    assert tree(outputs / "checkpoint-4") == before  # nothing written into the checkpoint
    # neither the Trainer (rotation, resume) nor push's scanner take them for checkpoints
    assert sorted(Path(p).name for p in sort_checkpoints(str(outputs))) == ["checkpoint-2", "checkpoint-4"]
    assert Path(get_last_checkpoint(str(outputs))).name == "checkpoint-4"
    found, _ = find_checkpoints(str(outputs))
    assert [c.name for c in found if c.kind != "skip"] == ["checkpoint-2", "checkpoint-4"]
    assert {c.name: c.kind for c in found if c.kind == "skip"} == {"merged-checkpoint-4-bf16": "skip",
                                                                   "resharded-checkpoint-4-ws3": "skip"}
    # the outputs are verifiable as what they are
    assert verify(res.output).ok
    assert verify(rs.output).ok


def test_default_output_of_a_save_folder_and_a_tag(save_dir):
    res = zckpt.merge(str(save_dir))
    assert Path(res.output) == save_dir.parent / "merged-ckpts-fp32"
    res = zckpt.merge(str(save_dir / "global_step3"))
    assert Path(res.output) == save_dir.parent / "merged-ckpts-global_step3-fp32"
    rs = zckpt.reshard(str(save_dir), world_size=4, stage=3, dry_run=True)
    assert Path(rs.output) == save_dir.parent / "resharded-ckpts-ws4-z3"
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]


def test_cli_default_output(outputs):
    proc = cli("merge", str(outputs / "checkpoint-4"), "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    assert Path(json.loads(proc.stdout)["output"]) == outputs / "merged-checkpoint-4-fp32"
    assert not (outputs / "checkpoint-4" / "merged-fp32").exists()


# ============================================================================================= --overwrite


def test_overwrite_replaces_only_a_previous_output_of_the_same_kind(tmp_path, save_dir):
    out = tmp_path / "model"
    zckpt.merge(str(save_dir), str(out), dtype="bf16")
    first = tree(out)
    with pytest.raises(OutputExists, match="previous zckpt merge output"):
        zckpt.merge(str(save_dir), str(out))
    zckpt.merge(str(save_dir), str(out), overwrite=True, max_shard_size="300B")
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    assert tree(out) != first and verify(str(out)).ok
    # a reshard output is not a merge output, and the other way round
    rs = tmp_path / "rs"
    zckpt.reshard(str(save_dir), str(rs), world_size=3)
    with pytest.raises(OutputExists, match="zckpt reshard output, not a merge output"):
        zckpt.merge(str(save_dir), str(rs), overwrite=True)
    with pytest.raises(OutputExists, match="zckpt merge output, not a reshard output"):
        zckpt.reshard(str(save_dir), str(out), world_size=3, overwrite=True)
    zckpt.reshard(str(save_dir), str(rs), world_size=4, overwrite=True)
    assert zckpt.open_checkpoint(str(rs)).world_size == 4


def test_overwrite_refuses_foreign_folders(tmp_path, save_dir, outputs):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("user data")
    proc = cli("merge", str(save_dir), "-o", str(foreign), "--overwrite", "--quiet")
    assert proc.returncode != 0
    line = proc.stderr.strip()
    assert "\n" not in line and str(foreign) in line and "no .zckpt.json" in line, proc.stderr
    # another checkpoint (not the source's neighbour) is never replaced
    other = tmp_path / "other-run"
    shutil.copytree(save_dir, other)
    with pytest.raises(OutputExists, match="holds a checkpoint"):
        zckpt.merge(str(save_dir), str(other), overwrite=True)
    with pytest.raises(OutputExists, match="holds a checkpoint"):
        zckpt.reshard(str(outputs / "checkpoint-4"), str(other), world_size=3, overwrite=True)
    # a marker zckpt did not write
    (foreign / ".zckpt.json").write_text("{}")
    with pytest.raises(OutputExists, match="did not write"):
        zckpt.merge(str(save_dir), str(foreign), overwrite=True)
    # a file
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputExists, match="not a folder"):
        zckpt.merge(str(save_dir), str(tmp_path / "f"), overwrite=True)
    assert (foreign / "notes.txt").read_text() == "user data"
    assert tree(other) == tree(save_dir)
    # an empty folder is fine without --overwrite
    (tmp_path / "empty").mkdir()
    zckpt.merge(str(save_dir), str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_unwritable_output_names_the_output(tmp_path, save_dir):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "model"
    with pytest.raises(OSError) as err:
        zckpt.merge(str(save_dir), str(out))
    assert err.value.filename == str(out)
    proc = cli("merge", str(save_dir), "-o", str(out), "--quiet")
    assert proc.returncode != 0 and str(out) in proc.stderr and "zckpt-tmp" not in proc.stderr, proc.stderr


# ============================================================================== atomic, killed runs, sweep


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "move-aside"])
def test_killed_overwrite_leaves_the_previous_output(tmp_path, save_dir, monkeypatch, exchange):
    out = tmp_path / "model"
    zckpt.merge(str(save_dir), str(out))
    good = tree(out)
    env = dict(os.environ, ZCKPT_TEST_SLOW_WRITE="0.3")
    if not exchange:
        env["ZCKPT_NO_RENAME_EXCHANGE"] = "1"
        monkeypatch.setenv("ZCKPT_NO_RENAME_EXCHANGE", "1")
    p = subprocess.Popen([sys.executable, "-m", "zckpt", "merge", str(save_dir), "-o", str(out), "--overwrite",
                          "--quiet", "--max-shard-size", "300B", "--dtype", "bf16"], env=env, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not [q for q in tmp_path.iterdir() if ".zckpt-tmp-" in q.name] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert tree(out) == good  # the previous output, whole
    assert [q for q in tmp_path.iterdir() if ".zckpt-tmp-" in q.name]  # the killed run's scratch folder
    zckpt.merge(str(save_dir), str(out), overwrite=True, dtype="bf16")  # sweeps it and replaces the output
    assert sorted(q.name for q in tmp_path.iterdir()) == ["model", "run"]
    assert publish.read_marker(str(out))["source"] == str(save_dir)
    assert verify(str(out)).ok and tree(out) != good


def test_sweep_puts_back_an_output_moved_aside_by_a_killed_run(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "model"
    aside = tmp_path / f".model.zckpt-old-{dead.pid}-abc"
    scratch = tmp_path / f".model.zckpt-tmp-{dead.pid}-def"
    aside.mkdir()
    (aside / "model.safetensors").write_text("previous")
    scratch.mkdir()
    (scratch / "model.safetensors").write_text("half")
    publish.sweep(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (out / "model.safetensors").read_text() == "previous"
    # a live process's scratch folder is left alone
    mine = tmp_path / f".model.zckpt-tmp-{os.getpid()}-x"
    mine.mkdir()
    publish.sweep(str(out))
    assert mine.exists()


# ==================================================================================== object stores


class Writes:
    """Records every object written through zckpt.io.storage, in order."""

    def __init__(self, monkeypatch):
        self.urls: list[tuple[str, bytes | None]] = []
        for name in ("put_file", "write_bytes_atomic"):
            real = getattr(storage, name)
            monkeypatch.setattr(storage, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            url = args[1] if name == "put_file" else args[0]
            self.urls.append((str(url), args[1] if name == "write_bytes_atomic" else None))
            return result
        return call


def _remote_merge_case(url: str, save_dir: Path, monkeypatch, list_keys) -> None:
    writes = Writes(monkeypatch)
    zckpt.merge(str(save_dir), url, max_shard_size="300B")
    names = [u.rsplit("/", 1)[1] for u, _ in writes.urls]
    assert names[0] == ".zckpt.json" and json.loads(writes.urls[0][1])["state"] == "writing"
    assert names[-1] == ".zckpt.json" and json.loads(writes.urls[-1][1])["state"] == "complete"
    assert names.index("model.safetensors.index.json") < len(names) - 1
    marker = json.loads(writes.urls[-1][1])
    assert set(marker["files"]) == set(list_keys()) - {".zckpt.json"}
    assert verify(url).ok
    # without its marker the output is incomplete to every reader
    storage.remove(storage.join(url, ".zckpt.json"))
    report = verify(url)
    assert not report.ok and any(c.name == "zckpt output committed" and not c.ok for c in report.checks)
    assert not publish.output_state(url)[0]
    with pytest.raises(OutputExists, match="no .zckpt.json"):  # and no longer a recognised zckpt output
        zckpt.merge(str(save_dir), url, overwrite=True)


def test_memory_output_commit_marker_last(save_dir, monkeypatch):
    url = f"memory://zckpt-publish-{uuid.uuid4().hex[:8]}/model"
    _remote_merge_case(url, save_dir, monkeypatch, lambda: storage.list_files(url))


def test_remote_interrupted_output_is_incomplete_and_replaceable(save_dir, monkeypatch):
    url = f"memory://zckpt-publish-{uuid.uuid4().hex[:8]}/model"
    zckpt.merge(str(save_dir), url, max_shard_size="300B")
    shards = sorted(n for n in storage.list_files(url) if n.endswith(".safetensors"))
    real, calls = storage.put_file, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "connection lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "put_file", failing)
    with pytest.raises(OSError):
        zckpt.merge(str(save_dir), url, overwrite=True, dtype="bf16", max_shard_size="300B")
    assert calls[0] == 2 and publish.read_marker(url)["state"] == "writing"
    assert not verify(url).ok
    monkeypatch.setattr(storage, "put_file", real)
    with pytest.raises(OutputExists):  # still a zckpt merge output: --overwrite needed, and enough
        zckpt.merge(str(save_dir), url, dtype="bf16")
    zckpt.merge(str(save_dir), url, overwrite=True, dtype="bf16")  # one file now: the old shards are removed
    assert sorted(storage.list_files(url)) == [".zckpt.json", "model.safetensors"] and shards
    assert verify(url).ok


def test_s3_output_commit_marker_last(s3_server, save_dir, monkeypatch):
    with s3_server.environ():
        prefix = f"publish-{uuid.uuid4().hex[:8]}/model"
        url = s3_server.url(prefix)
        _remote_merge_case(url, save_dir, monkeypatch,
                           lambda: [k[len(prefix) + 1:] for k in s3_server.keys(prefix + "/")])


# ============================================================================================== push


def test_push_never_takes_a_zckpt_output_for_a_checkpoint(outputs, tmp_path, monkeypatch):
    monkeypatch.setenv("ZCKPT_CACHE_DIR", str(tmp_path / "cache"))
    zckpt.merge(str(outputs / "checkpoint-4"))  # default: outputs/merged-checkpoint-4-fp32
    zckpt.reshard(str(outputs / "checkpoint-4"), world_size=3)  # outputs/resharded-checkpoint-4-ws3
    # an output left inside a checkpoint by an older zckpt that had a marker
    nested = outputs / "checkpoint-4" / "old-merge"
    shutil.copytree(outputs / "merged-checkpoint-4-fp32", nested)
    from zckpt.backup.push import push
    from zckpt.backup.scan import check_complete
    assert check_complete(str(outputs / "checkpoint-4"))[0]
    dest = tmp_path / "dest"
    result = push(str(outputs), str(dest), settle=0)
    assert {c.name: c.status for c in result.checkpoints} == {
        "checkpoint-2": "pushed", "checkpoint-4": "pushed", "merged-checkpoint-4-fp32": "skipped",
        "resharded-checkpoint-4-ws3": "skipped"}  # said, not silently left out
    assert "zckpt reshard output" in {c.name: c.reason for c in result.checkpoints}["resharded-checkpoint-4-ws3"]
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (dest / "checkpoint-4" / "old-merge").exists()
    assert (dest / "checkpoint-4" / "zckpt-manifest.json").exists()
    # a merge output given as SRC is not a checkpoint either: refused, saying why
    with pytest.raises(InvalidArgument, match="zckpt merge output"):
        push(str(outputs / "merged-checkpoint-4-fp32"), str(tmp_path / "dest2"), settle=0)
    assert not (tmp_path / "dest2").exists()
