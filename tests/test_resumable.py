"""Complete means resumable, and links stay inside the checkpoint (zckpt issue 27, items 2 and 3).

Real checkpoints only: the committed fixtures (the Trainer's ``checkpoint-4``, the DeepSpeed save folder
``z2_bf16_ws2``) copied to a temporary folder and altered there, and a DCP folder written by torch's own
``dcp.save``. Exit statuses come from the CLI run as a subprocess.

* ``latest`` missing, flipped, naming a missing tag, or naming another tag than the checkpoint's: ``verify`` exits 1
  with one line saying so (and the fix); ``push`` holds the checkpoint back (nothing of it at DEST, the others
  arrive file by file); a tag chosen (``--tag``, a tag folder) is a note; zckpt's own outputs stay complete.
* A link out of the checkpoint folder (a rank file, a ``.distcp``, ``latest``, a Trainer side file, a tag folder) is
  refused by info, verify, merge and convert in one line naming the link; push refuses that checkpoint and its
  target's bytes are nowhere at DEST; ``--follow-links`` / ``ZCKPT_FOLLOW_LINKS=1`` follow it; a link inside the
  folder is read and pushed as the file it points to.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from zckpt.io import links
from zckpt.backup import scan
from zckpt.backup.files import checkpoint_files
from zckpt.backup.manifest import PUSH_FILES

ROOT = Path(__file__).resolve().parents[1]
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
SAVE = FIXTURES / "z2_bf16_ws2"  # latest -> global_step3
OPTIM = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def cli(*args, env=None) -> subprocess.CompletedProcess:
    environ = dict(os.environ, ZCKPT_DEBUG="", ZCKPT_FOLLOW_LINKS="", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**environ, **(env or {})})


def one_line_error(proc, *must_name) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error:"), proc.stderr
    for text in must_name:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def bad_lines(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("BAD")]


def copy(src: Path, dst: Path) -> Path:
    """A copy of a committed checkpoint (without the fixture's expected answers)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected"))
    return dst


def tree(folder: Path) -> dict[str, str]:
    """rel -> sha256 of every file (links followed), push's own records left out."""
    out = {}
    for dirpath, _dirs, files in os.walk(folder, followlinks=True):
        for name in files:
            p = Path(dirpath) / name
            if name not in PUSH_FILES:
                out[p.relative_to(folder).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def push(src: Path, dest: Path, *args) -> subprocess.CompletedProcess:
    return cli("push", src, dest, "--settle", "0", *args)


# ============================================================================== complete means resumable


@pytest.mark.parametrize("shape", ["trainer", "save"])
def test_verify_without_latest_is_not_resumable(tmp_path, shape):
    ck = copy(TRAINER if shape == "trainer" else SAVE, tmp_path / "ck")
    tag = (ck / "latest").read_text().strip()
    assert cli("verify", ck).returncode == 0
    (ck / "latest").unlink()
    proc = cli("verify", ck)  # one error line on stderr, naming the failed check and the fix
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "latest: not resumable: no 'latest' file" in err[0] and "--tag" in err[0], err
    proc = cli("verify", ck, "-v")  # -v: the checklist
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = bad_lines(proc)
    assert len(bad) == 1 and bad[0].startswith("BAD  latest: not resumable: no 'latest' file"), proc.stdout
    assert tag in bad[0] and "--tag" in bad[0] and "printf TAG > latest" in bad[0]
    assert proc.stdout.strip().splitlines()[-1] == f"{ck}: NOT consistent"
    # the tag chosen: how it will be loaded (load_checkpoint(dir, tag=...)); what latest says is a note
    for args in (("--tag", tag), ()):
        target = ck if args else ck / tag
        proc = cli("verify", target, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        note = [line for line in proc.stdout.splitlines() if line.startswith("ok   latest:")]
        assert len(note) == 1 and f"tag {tag} chosen" in note[0] and "no 'latest' file" in note[0], proc.stdout
    # --json says the same
    import json
    doc = json.loads(cli("verify", ck, "--json").stdout)
    assert not doc["ok"] and [c["name"] for c in doc["checks"] if not c["ok"]] == ["latest"]
    (ck / "latest").write_text(tag)  # the fix the line names
    assert cli("verify", ck).returncode == 0


@pytest.mark.parametrize("content", [b"global_step9", b"global_stfp4", b"glob\xffl_step4", b""])
def test_verify_latest_flipped_or_naming_a_missing_tag(tmp_path, content):
    """A flipped byte in 'latest' (still text, or not UTF-8), a missing tag, an empty file: one line, exit 1."""
    ck = copy(TRAINER, tmp_path / "checkpoint-4")
    (ck / "latest").write_bytes(content)
    one_line_error(cli("verify", ck), "'latest'", str(ck))
    proc = cli("verify", ck, "--tag", "global_step4")  # the tag chosen: 'latest' is a note
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note = [line for line in proc.stdout.splitlines() if line.startswith("ok   latest:")]
    assert len(note) == 1 and "'latest'" in note[0] and "tag='global_step4'" in note[0], proc.stdout
    ok, reason = scan.check_complete(str(ck))
    assert not ok and reason.startswith("not resumable: 'latest'"), reason


def test_verify_trainer_latest_naming_another_tag(tmp_path):
    """checkpoint-4 holding a stale global_step2 and 'latest' naming it: the Trainer would resume step 2's weights
    with step 4's state (trainer_state.json): not resumable, exit 1, one BAD line."""
    ck = copy(TRAINER, tmp_path / "checkpoint-4")
    shutil.copytree(ck / "global_step4", ck / "global_step2")
    (ck / "latest").write_text("global_step2")
    proc = cli("verify", ck)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "'latest' names 'global_step2'" in proc.stderr
    proc = cli("verify", ck, "-v")
    assert proc.returncode == 1
    bad = bad_lines(proc)
    assert len(bad) == 1 and "'latest' names 'global_step2'" in bad[0] and "step 4" in bad[0], proc.stdout
    assert cli("verify", ck, "--tag", "global_step4").returncode == 0
    ok, reason = scan.check_complete(str(ck))
    assert not ok and "'latest' names 'global_step2'" in reason


def test_verify_a_tag_that_latest_does_not_name(tmp_path):
    """A save folder's older tag, named as a tag folder: resumable with its tag, 'latest' (naming the newer one)
    said as it is (before: 'names existing tag global_step2', which it does not)."""
    save = copy(SAVE, tmp_path / "save")
    shutil.copytree(save / "global_step3", save / "global_step2")
    proc = cli("verify", save / "global_step2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("ok   latest:")][0]
    assert "names 'global_step3', not this tag" in line and "tag='global_step2'" in line, line
    assert cli("verify", save).returncode == 0  # latest's own tag


def test_zckpt_outputs_stay_resumable(tmp_path):
    """reshard and convert write 'latest' (DeepSpeed) or none is needed (DCP): complete for verify and push."""
    out = tmp_path / "resharded"
    assert cli("reshard", SAVE, "--world-size", "1", "-o", out).returncode == 0
    assert cli("verify", out).returncode == 0 and scan.check_complete(str(out))[0]
    dcp = tmp_path / "dcp"
    assert cli("convert", SAVE, "--to", "dcp", "-o", dcp).returncode == 0
    proc = cli("verify", dcp)
    assert proc.returncode == 0 and "latest" not in proc.stdout, proc.stdout


def test_push_holds_back_a_checkpoint_without_latest(tmp_path):
    out = tmp_path / "out"
    good = copy(TRAINER, out / "checkpoint-6")
    bad = copy(TRAINER, out / "checkpoint-4")
    (bad / "latest").unlink()
    flipped = copy(TRAINER, out / "checkpoint-8")
    (flipped / "latest").write_bytes(b"global_stfp4")
    dest = tmp_path / "dest"
    proc = push(out, dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split(":", 1)[0]: line for line in proc.stdout.splitlines()}
    assert "incomplete: not resumable: no 'latest' file" in lines["checkpoint-4"], proc.stdout
    assert "'latest' names 'global_stfp4', which is missing" in lines["checkpoint-8"], proc.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoint-6"]  # nothing of the two held back
    assert tree(dest / "checkpoint-6") == tree(good)
    assert cli("verify", dest / "checkpoint-6").returncode == 0
    proc = push(bad, tmp_path / "dest2")  # alone: nothing pushed, exit 1, one line
    one_line_error(proc, "nothing pushed", "'latest'")
    assert not (tmp_path / "dest2").exists() or not any((tmp_path / "dest2").iterdir())
    (bad / "latest").write_text("global_step4")
    assert push(out, dest).returncode == 0 and tree(dest / "checkpoint-4") == tree(bad)


def test_push_save_folder_follows_latest(tmp_path):
    """A save folder: without 'latest' no tag is pushed (nor its scripts); a tag newer than the one 'latest' names
    is a save that has not finished (DeepSpeed writes 'latest' last): held back, the older one pushed."""
    save = copy(SAVE, tmp_path / "save")
    (save / "latest").unlink()
    dest = tmp_path / "dest"
    proc = push(save, dest)
    one_line_error(proc, "nothing pushed", "no 'latest' file")
    assert not dest.exists() or not any(dest.rglob("*"))
    (save / "latest").write_text("global_step3")
    shutil.copytree(save / "global_step3", save / "global_step5")
    proc = push(save, dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "global_step5: incomplete: newer than 'global_step3'" in proc.stdout, proc.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert tree(dest) == {k: v for k, v in tree(save).items() if not k.startswith("global_step5/")}
    (save / "latest").write_text("global_step5")
    assert push(save, dest).returncode == 0
    assert tree(dest) == tree(save)


# ============================================================================================ links


@pytest.fixture()
def outside(tmp_path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "id_rsa").write_bytes(b"-----BEGIN PRIVATE KEY----- not for upload\n")
    return folder


def link_out(path: Path, outside: Path) -> Path:
    """Move ``path`` outside the checkpoint and leave a symlink to it in its place."""
    target = outside / path.name
    shutil.move(str(path), target)
    os.symlink(target, path)
    return target


def read_commands(ck: Path, tmp_path: Path, tag_dir: str | None = "global_step4"):
    yield "info", ("info", ck)
    yield "verify", ("verify", ck)
    yield "merge", ("merge", ck, "-o", tmp_path / "merged")
    if tag_dir:
        yield "reshard", ("reshard", ck, "--world-size", "1", "-o", tmp_path / "converted")
        yield "convert", ("convert", ck, "--to", "dcp", "-o", tmp_path / "converted")
    else:
        yield "convert", ("convert", ck, "--to", "deepspeed", "--world-size", "1", "--stage", "2", "--dtype",
                          "fp32", "-o", tmp_path / "converted")


def nowhere_at(dest: Path, target: Path) -> None:
    secret = target.read_bytes()
    for p in dest.rglob("*") if dest.exists() else []:
        if p.is_file():
            assert p.read_bytes() != secret, p


@pytest.mark.parametrize("which", ["rank file", "side file", "tag folder"])
def test_trainer_link_out_of_the_folder_refused(tmp_path, outside, which):
    out = tmp_path / "out"
    ck = copy(TRAINER, out / "checkpoint-4")
    if which == "rank file":
        link, target = ck / "global_step4" / OPTIM, link_out(ck / "global_step4" / OPTIM, outside)
    elif which == "side file":  # a tokenizer file replaced by a link to a private file
        (ck / "tokenizer.json").unlink()
        link, target = ck / "tokenizer.json", outside / "id_rsa"
        os.symlink(target, link)
    else:
        link, target = ck / "global_step4", link_out(ck / "global_step4", outside)
    for name, args in read_commands(ck, tmp_path):
        line = one_line_error(cli(*args), str(link), "symbolic link", "--follow-links")
        assert "outside the checkpoint folder" in line, (name, line)
        assert not (tmp_path / "merged").exists() and not (tmp_path / "converted").exists()
    good = copy(TRAINER, out / "checkpoint-6")
    dest = tmp_path / "dest"
    proc = push(out, dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"checkpoint-4: incomplete: {link}: a symbolic link" in proc.stdout, proc.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoint-6"]  # nothing of checkpoint-4
    assert tree(dest / "checkpoint-6") == tree(good)
    one_line_error(push(ck, tmp_path / "dest2"), str(link))
    nowhere_at(tmp_path / "dest2", target if target.is_file() else target / OPTIM)
    # allowed on request: read, and pushed as the files they point to
    assert cli("verify", ck, "--follow-links").returncode == 0
    assert cli("merge", ck, "-o", tmp_path / "merged", env={"ZCKPT_FOLLOW_LINKS": "1"}).returncode == 0
    assert push(ck, tmp_path / "dest3", "--follow-links").returncode == 0
    assert tree(tmp_path / "dest3") == tree(ck)


def test_dcp_distcp_link_out_refused(tmp_path, outside):
    import torch
    import torch.distributed.checkpoint as dcp
    ck = tmp_path / "dcp"
    sd = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3)},
          "optim": {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3),
                                    "exp_avg_sq": torch.zeros(4, 3)}},
                    "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    data = sorted(ck.glob("*.distcp"))[0]
    assert cli("merge", ck, "-o", tmp_path / "before").returncode == 0
    target = link_out(data, outside)
    for name, args in read_commands(ck, tmp_path, tag_dir=None):
        line = one_line_error(cli(*args), str(data), "symbolic link")
        assert not (tmp_path / "merged").exists() and not (tmp_path / "converted").exists(), name
    trainer = tmp_path / "out" / "checkpoint-2"  # push takes DCP folders inside a Trainer checkpoint
    shutil.copytree(ck, trainer / "pytorch_model_fsdp_0", symlinks=True)
    (trainer / "trainer_state.json").write_text('{"global_step": 2}')
    dest = tmp_path / "dest"
    one_line_error(push(trainer, dest), str(trainer / "pytorch_model_fsdp_0" / data.name), "symbolic link")
    proc = push(trainer.parent, dest, "--allow-empty")
    assert proc.returncode == 0 and "checkpoint-2: incomplete:" in proc.stdout and data.name in proc.stdout
    nowhere_at(dest, target)
    assert not dest.exists() or not any(dest.rglob("*"))
    proc = cli("merge", ck, "-o", tmp_path / "merged", "--follow-links")
    assert proc.returncode == 0, proc.stderr
    assert tree(tmp_path / "merged").keys() == tree(tmp_path / "before").keys()
    assert {k: v for k, v in tree(tmp_path / "merged").items() if k.endswith(".safetensors")} == \
        {k: v for k, v in tree(tmp_path / "before").items() if k.endswith(".safetensors")}


def test_latest_link_out_refused(tmp_path, outside):
    save = copy(SAVE, tmp_path / "save")
    link_out(save / "latest", outside)
    for name, args in read_commands(save, tmp_path, tag_dir="global_step3"):
        one_line_error(cli(*args), str(save / "latest"), "symbolic link")
    dest = tmp_path / "dest"
    one_line_error(push(save, dest), str(save / "latest"), "not uploaded")
    assert not dest.exists() or not any(dest.rglob("*"))


def test_links_inside_the_folder_are_followed(tmp_path):
    """A rank file kept elsewhere in the same checkpoint, a side file linking to another: read and pushed as the
    bytes they point to; verify and merge agree with the untouched copy."""
    ck = copy(TRAINER, tmp_path / "out" / "checkpoint-4")
    (ck / "store").mkdir()
    shutil.move(str(ck / "global_step4" / OPTIM), ck / "store" / "rank0.bin")
    os.symlink(Path("..") / "store" / "rank0.bin", ck / "global_step4" / OPTIM)  # relative, inside
    os.symlink(ck / "config.json", ck / "config-copy.json")
    os.symlink(ck / "store", ck / "store-link")  # a folder link inside, and a link through it
    os.symlink(ck / "store-link" / "rank0.bin", ck / "via-folder-link.pt")
    assert links.leaving(str(ck / "via-folder-link.pt"), str(ck)) is None
    assert cli("verify", ck).returncode == 0
    assert cli("merge", ck, "-o", tmp_path / "merged").returncode == 0
    assert cli("merge", TRAINER, "-o", tmp_path / "plain").returncode == 0
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == \
        (tmp_path / "plain" / "model.safetensors").read_bytes()
    dest = tmp_path / "dest"
    assert push(ck, dest).returncode == 0
    assert tree(dest) == tree(ck) and not any(p.is_symlink() for p in dest.rglob("*"))


def test_leaving_names_the_first_link_out(tmp_path, outside):
    ck = tmp_path / "ck"
    (ck / "inner").mkdir(parents=True)
    (outside / "deep").mkdir()
    (outside / "deep" / "f.pt").write_bytes(b"x")
    os.symlink(outside / "deep", ck / "inner" / "away")
    assert links.leaving(str(ck / "inner" / "away" / "f.pt"), str(ck)) == \
        (str(ck / "inner" / "away"), str(outside / "deep"))
    os.symlink(ck / "inner", ck / "alias")  # inside, then out through the link below it
    assert links.leaving(str(ck / "alias" / "away" / "f.pt"), str(ck))[0] == str(ck / "alias" / "away")
    with pytest.raises(scan.LinkOutside, match="away"):
        checkpoint_files(str(ck))
