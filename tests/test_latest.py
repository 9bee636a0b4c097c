"""``--latest`` (merge, reshard, convert, verify, info on a training output folder or DeepSpeed save folder): the
newest complete checkpoint by step, never an incomplete one, said in one line; and the hint that names the
earlier checkpoint next to a damaged ``checkpoint-N`` instead of "an earlier tag"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, checkpoint_path


def cli(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, ZCKPT_DEBUG="", PYTHONPATH=str(ROOT)), timeout=300)


def outputs(tmp_path: Path, steps=(4, 9, 10, 12), incomplete=(12,)) -> Path:
    """A training output folder of copies of the Trainer fixture as checkpoint-<step>; ``incomplete`` ones lack
    trainer_state.json (the Trainer writes it last). checkpoint-9 and -10: steps sort as numbers, not names."""
    out = tmp_path / "outputs"
    for step in steps:
        shutil.copytree(checkpoint_path(FIXTURES / "trainer"), out / f"checkpoint-{step}")
        if step in incomplete:
            (out / f"checkpoint-{step}" / "trainer_state.json").unlink()
    (out / "runs").mkdir()  # (TensorBoard logs: not a checkpoint)
    return out


CHOSE_10 = ("zckpt: --latest: outputs/checkpoint-10, step 10; passed over the newer checkpoint-12, not complete: "
            "trainer_state.json missing (the Trainer writes it last)")


def test_merge_latest_takes_the_newest_complete(tmp_path):
    outputs(tmp_path)
    res = cli(tmp_path, "merge", "outputs", "--latest")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [CHOSE_10], res.stderr
    merged = tmp_path / "outputs" / "merged-checkpoint-10-fp32"  # next to the checkpoint it read
    assert merged.is_dir() and not (tmp_path / "outputs" / "merged-checkpoint-12-fp32").exists()
    ref = cli(tmp_path, "merge", "outputs/checkpoint-10", "-o", "ref")
    assert ref.returncode == 0, ref.stderr
    assert (merged / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("cmd", [["verify"], ["info"], ["reshard", "--world-size", "1", "-o", "ws1"],
                                 ["convert", "--to", "dcp", "-o", "dcp"]])
def test_every_reader_takes_latest(tmp_path, cmd):
    outputs(tmp_path)
    res = cli(tmp_path, cmd[0], "outputs", "--latest", *cmd[1:])
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == CHOSE_10, res.stderr
    if cmd[0] in ("verify", "info"):
        assert "checkpoint-10" in res.stdout and "checkpoint-12" not in res.stdout, res.stdout
    if cmd[0] == "reshard":
        assert (tmp_path / "ws1" / "global_step4").is_dir()
    # --json: the result on stdout as before, the choice still on stderr; -q: silent
    res = cli(tmp_path, cmd[0], "outputs", "--latest", *cmd[1:], "--json", *(["--overwrite"] if "-o" in cmd else []))
    assert res.returncode == 0 and res.stderr.splitlines()[0] == CHOSE_10, res.stderr
    json.loads(res.stdout.splitlines()[-1])
    res = cli(tmp_path, cmd[0], "outputs", "--latest", *cmd[1:], "-q", *(["--overwrite"] if "-o" in cmd else []))
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_latest_newest_when_complete_and_on_a_checkpoint(tmp_path):
    outputs(tmp_path, steps=(4, 12), incomplete=())
    res = cli(tmp_path, "verify", "outputs", "--latest")
    assert res.returncode == 0
    assert res.stderr.splitlines() == ["zckpt: --latest: outputs/checkpoint-12, step 12, the newest checkpoint "
                                       "(complete)"], res.stderr
    res = cli(tmp_path, "verify", "outputs/checkpoint-4", "--latest")  # a checkpoint itself: that one
    assert res.returncode == 0 and "checkpoint-4" in res.stderr, res.stderr


def test_latest_never_takes_an_incomplete_one(tmp_path):
    outputs(tmp_path, steps=(4, 12), incomplete=(4, 12))
    res = cli(tmp_path, "merge", "outputs", "--latest", "-o", "m")
    assert res.returncode == 1, res.stderr
    (line,) = res.stderr.splitlines()
    assert line == ("zckpt: error: outputs: --latest: no complete checkpoint here (2 found); the newest, "
                    "checkpoint-12: trainer_state.json missing (the Trainer writes it last) (wait for the save to "
                    "finish; zckpt verify says what is missing)"), line
    assert not (tmp_path / "m").exists()
    # a rank file missing (not only the Trainer's marker): incomplete too, by push's own rule
    outputs(tmp_path / "b", steps=(4, 8), incomplete=())
    step = (tmp_path / "b/outputs/checkpoint-8/latest").read_text().strip()
    next((tmp_path / "b/outputs/checkpoint-8" / step).glob("*optim_states.pt")).unlink()
    res = cli(tmp_path / "b", "verify", "outputs", "--latest")
    assert res.returncode == 0 and "outputs/checkpoint-4, step 4; passed over the newer checkpoint-8" in res.stderr


def test_latest_on_a_deepspeed_save_folder(tmp_path):
    save = tmp_path / "ds"
    shutil.copytree(checkpoint_path(FIXTURES / "z2_bf16_ws2"), save, ignore=shutil.ignore_patterns("expected"))
    tag = (save / "latest").read_text().strip()
    shutil.copytree(save / tag, save / "global_step100")  # newer, being written: one rank file missing
    next((save / "global_step100").glob("*optim_states.pt")).unlink()
    res = cli(tmp_path, "merge", "ds", "--latest", "-o", "m")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0].startswith(f"zckpt: --latest: ds/{tag}, step {tag[len('global_step'):]}; "
                                                 "passed over the newer global_step100"), res.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_latest_refusals(tmp_path):
    outputs(tmp_path, steps=(4,), incomplete=())
    res = cli(tmp_path, "merge", "outputs", "--latest", "--tag", "global_step4")
    assert res.returncode == 1 and res.stderr.startswith("zckpt: error: --latest and --tag do not go together")
    (tmp_path / "empty").mkdir()
    res = cli(tmp_path, "verify", "empty", "--latest")
    assert res.returncode == 1 and "no checkpoint in this folder" in res.stderr, res.stderr
    # without --latest, the output folder's error says that --latest exists
    res = cli(tmp_path, "merge", "outputs")
    assert res.returncode == 1 and "--latest picks the newest complete one" in res.stderr, res.stderr


def test_damaged_checkpoint_n_names_the_earlier_checkpoint(tmp_path):
    """A rank file missing in outputs/checkpoint-12: the hint is the complete checkpoint next to it, not "an
    earlier tag with --tag" (a checkpoint-N holds one tag); in the CLI and in verify's checks."""
    out = outputs(tmp_path, steps=(4, 8, 12), incomplete=())
    (out / "checkpoint-8" / "trainer_state.json").unlink()  # incomplete: not the one to use
    tag_dir = out / "checkpoint-12" / (out / "checkpoint-12" / "latest").read_text().strip()
    (tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    for cmd in (["merge", "outputs/checkpoint-12", "-o", "m"], ["info", "outputs/checkpoint-12"]):
        res = cli(tmp_path, *cmd)
        (line,) = res.stderr.splitlines()
        assert res.returncode == 1 and f"use the earlier checkpoint {out / 'checkpoint-4'}" in line, line
        assert "--tag" not in line, line
    # no complete earlier one: said so
    shutil.rmtree(out / "checkpoint-4")
    res = cli(tmp_path, "merge", "outputs/checkpoint-12", "-o", "m")
    assert "no earlier checkpoint next to it is complete" in res.stderr and "--tag" not in res.stderr, res.stderr


def test_python_hints_name_keywords_as_python_passes_them():
    from zckpt.errors import IncompleteCheckpoint, InvalidArgument, OutputExists
    assert str(IncompleteCheckpoint("gone", path="/x")).endswith("use an earlier tag with tag=...)")
    assert str(OutputExists("there", path="/o")) == "/o: there (pass overwrite=True or choose another out=...)"
    err = InvalidArgument("no latest", hint="choose one with `tag`, e.g. `tag`=global_step9")
    assert str(err) == "no latest (choose one with tag=..., e.g. tag='global_step9')"
    from zckpt.cli._errors import default_name
    assert err.render(default_name) == "no latest (choose one with --tag, e.g. --tag global_step9)"
