"""The command line as a newcomer meets it (issue 50): output names the Trainer's rotation would delete, default
output names for ``.``, options that do not apply, one answer to one mistake, the step push reports."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from zckpt.cli import main
from tests.conftest import FIXTURES, checkpoint_path

TRAINER = checkpoint_path(FIXTURES / "trainer")  # outputs/checkpoint-4 of a real Trainer + DeepSpeed ZeRO-2 run
SAVE = checkpoint_path(FIXTURES / "z2_bf16_ws2")  # a DeepSpeed save folder (latest, global_step3)
MEGATRON = FIXTURES / "megatron" / "gpt_tp2_pp1_dp2"


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """A training output folder: checkpoint-4 (the real Trainer fixture) and checkpoint-2 (a copy)."""
    out = tmp_path_factory.mktemp("run") / "outputs"
    shutil.copytree(TRAINER, out / "checkpoint-4")
    shutil.copytree(TRAINER, out / "checkpoint-2")
    return out


# ------------------------------------------------------------------ item 2: names the Trainer's rotation deletes

def _trainer_sorted(output_dir: Path) -> list[str]:
    """What transformers' own rotation takes for checkpoints in ``output_dir``."""
    from transformers.trainer_utils import sort_checkpoints
    return [Path(p).name for p in sort_checkpoints(str(output_dir))]


@pytest.mark.parametrize("name", ["checkpoint-4-ws2", "checkpoint-4.merged", "checkpoint-4-fsdp", "checkpoint-40x"])
def test_outputs_the_rotation_would_delete_are_refused(outputs, name, tmp_path):
    # the oracle: transformers' sort_checkpoints lists such a folder (so save_total_limit deletes it)
    probe = tmp_path / "probe"
    (probe / "checkpoint-4").mkdir(parents=True)
    (probe / name).mkdir()
    assert name in _trainer_sorted(probe)
    for command in (["merge", outputs / "checkpoint-4"], ["reshard", outputs / "checkpoint-4", "-w", "2"],
                    ["convert", outputs / "checkpoint-4", "--to", "dcp"]):
        code, out, err = run(*command, "-o", outputs / name, "-q")
        (line,) = err.splitlines()
        assert code == 2 and "rotation" in line and str(outputs / name) in line, (command, err)
        word = {"merge": "merged", "reshard": "resharded", "convert": "converted"}[command[0]]
        assert f"-o {outputs / (word + '-' + name)}" in line, line  # a safe name, said
        assert not (outputs / name).exists()
    # in a folder the rotation never sees (no checkpoint-N there, not the source's parent) the name is the user's
    fresh = tmp_path / "new-run"
    code, _, err = run("reshard", outputs / "checkpoint-4", "-w", "2", "-o", fresh / name, "-q")
    assert code == 0, err
    # and in a training output folder that is not the source's parent, too
    other = tmp_path / "other-run"
    (other / "checkpoint-10").mkdir(parents=True)
    code, _, err = run("merge", outputs / "checkpoint-4", "-o", other / name, "-q", "--dry-run")
    assert code == 2 and "rotation" in err, err


def test_safe_names_are_safe_for_the_rotation(outputs, tmp_path):
    """The names zckpt suggests and its defaults: transformers' sort_checkpoints leaves them alone."""
    probe = tmp_path / "probe"
    (probe / "checkpoint-4").mkdir(parents=True)
    names = []
    for command in (["merge"], ["reshard", "-w", "2"], ["reshard", "-w", "2", "--stage", "3"],
                    ["convert", "--to", "dcp"]):
        code, out, err = run(command[0], outputs / "checkpoint-4", *command[1:], "--dry-run", "--json")
        assert code == 0, err
        names.append(Path(json.loads(out)["output"]).name)
        code, _, err = run(command[0], outputs / "checkpoint-4", *command[1:], "--dry-run",
                           "-o", outputs / "checkpoint-4-x")
        names.append(re.search(r"-o (\S+?)\)", err).group(1).rsplit("/", 1)[-1])
    for name in names:
        (probe / name).mkdir(exist_ok=True)
    assert _trainer_sorted(probe) == ["checkpoint-4"], names
    assert "merged-checkpoint-4-fp32" in names and "resharded-checkpoint-4-ws2-z3" in names, names


def test_documented_outputs_are_safe():
    """Every ``-o`` of an example in README.md, docs/*.md and the --help texts (the rotation rule itself aside)."""
    from zckpt.io.publish import rotation_deletes
    root = Path(__file__).resolve().parent.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "zckpt" / "cli").glob("*.py"))]
    bad = []
    for path in texts:
        for line in path.read_text().splitlines():
            for out in re.findall(r"(?:^|\s)(?:-o|--output)[ =](\S+)", line):
                name = out.strip("`'\"").rstrip("/").rsplit("/", 1)[-1]
                if rotation_deletes("outputs", name) and "rotation" not in line and "refused" not in line:
                    bad.append(f"{path.name}: {line.strip()}")
    assert not bad, bad


# ------------------------------------------------------------------------------ item 4: default names for "."

def test_default_output_names_use_the_folder_name(outputs, tmp_path, monkeypatch):
    save = tmp_path / "ckpts"
    shutil.copytree(SAVE, save)
    tag = (save / "latest").read_text().strip()
    cases = [(outputs / "checkpoint-4", ["merge", "."], outputs / "merged-checkpoint-4-fp32"),
             (outputs / "checkpoint-4", ["merge", "./"], outputs / "merged-checkpoint-4-fp32"),
             (outputs / "checkpoint-4", ["reshard", ".", "-w", "4"], outputs / "resharded-checkpoint-4-ws4"),
             (outputs / "checkpoint-4", ["convert", ".", "--to", "dcp"], outputs / "converted-checkpoint-4-dcp"),
             (outputs / "checkpoint-4" / "global_step4", ["merge", "."],
              outputs / "merged-checkpoint-4-global_step4-fp32"),
             (outputs / "checkpoint-4" / "global_step4", ["merge", ".."], outputs / "merged-checkpoint-4-fp32"),
             (save / tag, ["reshard", "../", "-w", "3"], tmp_path / "resharded-ckpts-ws3"),
             (save / tag, ["merge", "."], tmp_path / f"merged-ckpts-{tag}-fp32")]
    for cwd, args, want in cases:
        monkeypatch.chdir(cwd)
        code, out, err = run(*args, "--dry-run", "--json")
        assert code == 0, (args, err)
        doc = json.loads(out)
        assert Path(doc["output"]).resolve() == want.resolve(), (cwd, args, doc["output"])
        assert doc.get("tag") in (None, "global_step4", tag), doc  # never "."
    monkeypatch.chdir(MEGATRON)
    code, out, err = run("merge", ".", "--dry-run", "--json")
    assert code == 0 and Path(json.loads(out)["output"]).name == "merged-gpt_tp2_pp1_dp2-fp32", (err, out)
