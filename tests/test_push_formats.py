"""``zckpt push`` (and ``--latest``) of what FSDP2, torchtitan and Megatron-LM save, not only DeepSpeed and the Trainer.

The checkpoints are real: DCP folders written by torch's own ``torch.distributed.checkpoint.save`` (the writer FSDP2
and torchtitan call; torchtitan keeps them as ``outputs/checkpoint/step-N``), and Megatron-LM save folders made by
``pretrain_gpt.py`` (fixtures/megatron/lm16_*, lm19_*: ``iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt``).
Each push is checked file by file against what was there, and with ``zckpt diff``; saves that have not finished
(no ``.metadata`` yet, a data file cut short, an iteration newer than the tracker file) are never pushed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zckpt.backup import latest
from zckpt.backup.find import find_checkpoints
from zckpt.backup.manifest import MANIFEST_NAME, RECORD_NAME
from zckpt.backup.push import push

ROOT = Path(__file__).resolve().parent.parent
MEGATRON = ROOT / "fixtures" / "megatron"
OURS = (MANIFEST_NAME, RECORD_NAME)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _same(src: Path, dest: Path) -> None:
    """Every file of ``src`` arrived at ``dest`` byte for byte, and nothing else but push's own two files."""
    a = _files(src)
    b = {k: v for k, v in _files(dest).items() if k.rsplit("/", 1)[-1] not in OURS}
    assert a == b


def _dcp_save(folder: Path, step: int) -> None:
    """What torchtitan's CheckpointManager leaves for one step: torch's own dcp.save of a model + optimizer (its
    OptimizersContainer's state: get_state_dict, flattened), one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {"model": msd, "optimizer": osd, "train_state": {"step": step}}  # as torchtitan's containers give them
    dcp.save(state, checkpoint_id=str(folder))


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> Path:
    """outputs/checkpoint with step-10 and step-20, as torchtitan saves them."""
    root = tmp_path_factory.mktemp("titan") / "checkpoint"
    for step in (10, 20):
        _dcp_save(root / f"step-{step}", step)
    return root


def test_torchtitan_folder_pushed_file_by_file(titan, tmp_path):
    found, roots = find_checkpoints(str(titan))
    assert [(c.name, c.kind, c.step) for c in found] == [("step-10", "dcp", 10), ("step-20", "dcp", 20)]
    assert roots == []
    result = push(str(titan), str(tmp_path / "dest"), settle=0)
    assert [(c.name, c.status) for c in result.checkpoints] == [("step-20", "pushed"), ("step-10", "pushed")]
    for step in (10, 20):
        _same(titan / f"step-{step}", tmp_path / "dest" / f"step-{step}")


def test_unfinished_dcp_saves_are_not_pushed(titan, tmp_path):
    src = tmp_path / "checkpoint"
    shutil.copytree(titan, src)
    shutil.copytree(titan / "step-20", src / "step-30")
    (src / "step-30" / ".metadata").unlink()  # dcp.save writes it last: this save has not finished
    shutil.copytree(titan / "step-20", src / "step-40")
    data = next(p for p in (src / "step-40").iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)  # cut short: the metadata names bytes past its end
    result = push(str(src), str(tmp_path / "dest"), settle=0)
    status = {c.name: (c.status, c.reason) for c in result.checkpoints}
    assert status["step-10"][0] == status["step-20"][0] == "pushed"
    assert status["step-30"][0] == "incomplete" and ".metadata missing" in status["step-30"][1]
    assert status["step-40"][0] == "incomplete" and "past its end" in status["step-40"][1]
    assert sorted(os.listdir(tmp_path / "dest")) == ["step-10", "step-20"]
    choice = latest.newest_complete(str(src))  # --latest passes over both
    assert choice.name == "step-20" and [n for n, _ in choice.passed_over] == ["step-40", "step-30"]


def test_keep_last_counts_torchtitan_steps(titan, tmp_path):
    dest = tmp_path / "dest"
    push(str(titan), str(dest), settle=0)
    src = tmp_path / "checkpoint"
    shutil.copytree(titan, src)
    shutil.copytree(titan / "step-20", src / "step-30")
    result = push(str(src), str(dest), settle=0, keep_last=2)
    assert result.removed == ["step-10"]
    assert sorted(os.listdir(dest)) == ["step-20", "step-30"]


def test_one_dcp_folder_is_one_checkpoint(titan, tmp_path):
    out = subprocess.run([sys.executable, "-m", "zckpt", "push", str(titan / "step-10"), str(tmp_path / "d"),
                          "--settle", "0", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(c["name"], c["status"], c["step"]) for c in doc["checkpoints"]] == [("", "pushed", 10)]
    _same(titan / "step-10", tmp_path / "d")


@pytest.mark.parametrize("fixture", ["lm16_tp2_pp1_dp2", "lm19_tp2_pp1_dp2"])
def test_megatron_save_folder_pushed_tracker_last(fixture, tmp_path):
    src = MEGATRON / fixture
    found, roots = find_checkpoints(str(src))
    iters = sorted(n for n in os.listdir(src) if n.startswith("iter_"))
    assert [(c.name, c.kind, c.step) for c in found] == [(n, "megatron", int(n[5:])) for n in iters]
    assert roots == ["latest_checkpointed_iteration.txt"]
    out = subprocess.run([sys.executable, "-m", "zckpt", "push", str(src), str(tmp_path / "dest"), "--settle", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    _same(src, tmp_path / "dest")
    diff = subprocess.run([sys.executable, "-m", "zckpt", "diff", str(src), str(tmp_path / "dest"), "--json"],
                          capture_output=True, text=True)
    assert diff.returncode == 0 and json.loads(diff.stdout)["summary"].startswith("SAME"), diff.stdout + diff.stderr


def test_megatron_save_in_progress(tmp_path):
    src = tmp_path / "save"
    shutil.copytree(MEGATRON / "lm16_tp2_pp1_dp2", src)
    shutil.copytree(src / "iter_0000004", src / "iter_0000006")  # written, but the tracker still says 4
    (src / "notes").mkdir()
    result = push(str(src), str(tmp_path / "dest"), settle=0)
    status = {c.name: (c.status, c.reason) for c in result.checkpoints}
    assert status["iter_0000006"][0] == "incomplete" and "newer than iter_0000004" in status["iter_0000006"][1]
    assert status["notes"][0] == "skipped"
    assert status["iter_0000004"][0] == status["iter_0000002"][0] == "pushed"
    assert (tmp_path / "dest" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not (tmp_path / "dest" / "iter_0000006").exists()
    (src / "iter_0000006" / "metadata.json").unlink()  # megatron-core writes it after the tensors
    (src / "latest_checkpointed_iteration.txt").write_text("6")
    result = push(str(src), str(tmp_path / "dest"), settle=0)
    status = {c.name: (c.status, c.reason) for c in result.checkpoints}
    assert status["iter_0000006"] == ("incomplete", "metadata.json missing (megatron-core writes it after the "
                                                    "tensors)")
    # the tracker names an iteration DEST does not hold complete: DEST's tracker stays at 4
    assert (tmp_path / "dest" / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_megatron_save_without_tracker(tmp_path):
    src = tmp_path / "save"
    shutil.copytree(MEGATRON / "lm16_tp2_pp1_dp2", src)
    (src / "latest_checkpointed_iteration.txt").unlink()
    out = subprocess.run([sys.executable, "-m", "zckpt", "push", str(src), str(tmp_path / "dest"), "--settle", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "latest_checkpointed_iteration.txt" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


def test_verify_a_torchtitan_checkpoint_folder(titan, tmp_path):
    """`zckpt verify outputs/checkpoint` verifies each step-N, and names the one whose save has not finished."""
    src = tmp_path / "checkpoint"
    shutil.copytree(titan, src)
    ok = subprocess.run([sys.executable, "-m", "zckpt", "verify", str(src), "-v"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "ok   step-10: metadata" in ok.stdout and "ok   step-20: metadata" in ok.stdout
    (src / "step-20" / ".metadata").unlink()
    bad = subprocess.run([sys.executable, "-m", "zckpt", "verify", str(src)], capture_output=True, text=True)
    assert bad.returncode == 1 and "step-20" in bad.stderr and "Traceback" not in bad.stderr


def test_optimizer_state_by_index_is_refused_naming_the_fix(tmp_path):
    """dcp.save of optimizer.state_dict() (torch's own index keys): which parameter each index is, the files do not
    say; refused in one line with the fix, by info and by push's reader-free check alike (push checks bytes only)."""
    import torch
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-m", "zckpt", "info", str(tmp_path / "run")], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "keyed by parameter index" in out.stderr and "get_state_dict" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
