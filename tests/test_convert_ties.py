"""Ties without flags where the files say so, refused where they do not; nothing left out without a word.

- zckpt's own DCP output records its ties (``zckpt.tied``, a key torch's ``dcp.load`` never asks for): converting
  it back to DeepSpeed needs no ``--tied`` and gives the source's parameter count, ``info`` reports the tie;
- a Hugging Face ``config.json`` with ``tie_word_embeddings: true`` names the tie of a torch-written DCP (the
  alias found by identical bytes);
- a torch-written DCP whose stateless tensor has the bytes of a trainable one is refused with ``--tied a=b`` in
  the hint, also when the equal bytes are a frozen copy; ``--tied ''`` says nothing is tied;
- ``--layout dcp`` of a Trainer ``checkpoint-N`` carries the Trainer's files, DCP -> DeepSpeed carries
  ``global_samples`` and the other counters; ``--json`` lists what was carried and what was not, and ``stats``."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")
TRAINER = FIXTURES / "trainer" / "checkpoint-4"


def zckpt(*args):
    from zckpt.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ties")
    res = {}
    for layout in ("trainer", "dcp"):
        r = zckpt("convert", TRAINER, "--to", "dcp", "--layout", layout, "-o", base / layout, "--json")
        assert r.exit_code == 0, r.output
        res[layout] = (base / layout, json.loads(r.stdout))
    return res


class Tied(torch.nn.Module):
    def __init__(self, tie=True, frozen_copy=False):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        if frozen_copy:  # a frozen weight that equals a trainable one, untied
            self.copy = torch.nn.Linear(4, 6, bias=False)
            self.copy.weight.requires_grad_(False)


def torch_dcp(path: Path, model, config: dict | None = None, steps: int = 1) -> Path:
    """A DCP folder saved by torch's own dcp.save of get_state_dict (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        model.head(model.norm(model.emb(torch.tensor([1, 2, 3])))).sum().backward()
        opt.step()
    if hasattr(model, "copy"):
        with torch.no_grad():
            model.copy.weight.copy_(model.head.weight)
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


TO_DS = ("--to", "deepspeed", "--world-size", "2", "--stage", "2", "--dtype", "fp32")


@pytest.mark.parametrize("layout", ["trainer", "dcp"])
def test_zckpts_own_dcp_output_keeps_its_tie(outputs, tmp_path, layout):
    from zckpt.state.open import open_checkpoint
    folder, _ = outputs[layout]
    model_part = folder / "pytorch_model_fsdp_0" if layout == "trainer" else folder
    meta = pickle.loads((model_part / ".metadata").read_bytes())
    assert meta.planner_data["zckpt.tied"] == ("zckpt", "tied")
    info = zckpt("info", folder, "--json")
    assert info.exit_code == 0, info.output
    doc = json.loads(info.stdout)
    assert "1 tied" in zckpt("info", folder).stdout
    assert json.dumps(doc).count("lm_head.weight") >= 1
    r = zckpt("convert", folder, *TO_DS, "-o", tmp_path / "ds")  # no --tied, no --buffers: the files say
    assert r.exit_code == 0, r.output
    ds = open_checkpoint(str(tmp_path / "ds"))
    src = open_checkpoint(str(TRAINER))
    assert ds.by_name()["lm_head.weight"].kind == "tied"
    assert ds.by_name()["lm_head.weight"].tied_to == "model.embed_tokens.weight"
    count = lambda c: sum(r.numel for r in c.records if r.kind != "tied")  # noqa: E731
    assert count(ds) == count(src) == 6736


def test_torch_written_tie_is_refused_until_named(tmp_path):
    from zckpt.state.open import open_checkpoint
    src = torch_dcp(tmp_path / "t", Tied())
    r = zckpt("convert", src, *TO_DS, "-o", tmp_path / "o")
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "'head.weight' has no optimizer state and the same bytes as the trainable 'emb.weight'" in r.stderr
    assert "--tied head.weight=emb.weight" in r.stderr and not (tmp_path / "o").exists()
    assert "likely tied" in zckpt("info", src).stdout
    r = zckpt("convert", src, *TO_DS, "--tied", "head.weight=emb.weight", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert open_checkpoint(str(tmp_path / "o")).by_name()["head.weight"].tied_to == "emb.weight"
    r = zckpt("convert", src, *TO_DS, "--tied", "", "--buffers", "", "-o", tmp_path / "f")
    assert r.exit_code == 0, r.output
    assert open_checkpoint(str(tmp_path / "f")).by_name()["head.weight"].kind == "frozen"


def test_a_frozen_copy_with_equal_bytes_is_never_assumed(tmp_path):
    src = torch_dcp(tmp_path / "t", Tied(tie=False, frozen_copy=True))
    r = zckpt("convert", src, *TO_DS, "--buffers", "", "-o", tmp_path / "o")
    assert r.exit_code == 1 and "--tied copy.weight=head.weight" in r.stderr, r.output
    r = zckpt("convert", src, *TO_DS, "--buffers", "", "--tied", "", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output


def test_config_tie_word_embeddings_names_the_tie(tmp_path):
    from zckpt.state.open import open_checkpoint
    src = torch_dcp(tmp_path / "t", Tied(), {"model_type": "llama", "tie_word_embeddings": True})
    assert "1 tied" in zckpt("info", src).stdout
    r = zckpt("convert", src, *TO_DS, "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert open_checkpoint(str(tmp_path / "o")).by_name()["head.weight"].tied_to == "emb.weight"
    # the config says tied, but nothing without state equals a trainable tensor: nothing is made up
    src2 = torch_dcp(tmp_path / "u", Tied(tie=False), {"tie_word_embeddings": True})
    assert "0 tied" in zckpt("info", src2).stdout


def test_layout_dcp_carries_the_trainers_files(outputs):
    folder, doc = outputs["dcp"]
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "config.json"):
        assert (folder / name).read_bytes() == (TRAINER / name).read_bytes(), name
        assert name in doc["carried"]
    assert not (folder / "latest").exists()
    assert doc["not_carried"] == {"latest, zero_to_fp32.py": "DeepSpeed's own files"}
    assert doc["stats"]["ranks"] == 1
    tr_folder, tr_doc = outputs["trainer"]  # the Trainer's layout: model and optimizer only, said
    assert any(k.startswith("train_state.") for k in tr_doc["not_carried"])
    assert any("left out train_state" in n for n in tr_doc["notes"])


def test_dcp_to_deepspeed_carries_the_counters(outputs, tmp_path):
    from zckpt.state.open import open_checkpoint
    folder, _ = outputs["dcp"]
    r = zckpt("convert", folder, *TO_DS, "-o", tmp_path / "ds", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {"train_state.global_steps", "train_state.global_samples", "train_state.skipped_steps"} <= \
        set(doc["carried"])
    assert doc["stats"]["ranks"] == 1 and "loss_scaler" in doc["not_carried"]
    stats = doc["stats"]  # where the command's seconds went: planning, the casts' imports, the writing
    assert 0 < stats["write_seconds"] and 0 <= stats["imports_seconds"]
    assert stats["plan_seconds"] + stats["imports_seconds"] + stats["write_seconds"] <= doc["seconds"]
    ds = open_checkpoint(str(tmp_path / "ds"))
    src = open_checkpoint(str(TRAINER))
    for k in ("global_steps", "global_samples", "skipped_steps"):
        assert ds.model_state[k] == src.model_state[k], k
    assert ds.model_state["global_samples"] == 16
    assert "global_samples=16" in zckpt("info", tmp_path / "ds").stdout


def test_same_bytes_compares_every_byte_across_differently_cut_pieces(tmp_path):
    """The tie check reads both tensors in full (a first 64 KiB, then 8 MiB blocks), whatever their pieces."""
    import os
    from zckpt.dcp.reader import same_bytes
    from zckpt.engine.segments import Piece
    data = os.urandom(200_000)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(b"xx" + data)
    a = [Piece(str(tmp_path / "a"), 0, 70_000, "uint8"), Piece(str(tmp_path / "a"), 70_000, 130_000, "uint8")]
    b = [Piece(str(tmp_path / "b"), 2, 1, "uint8"), Piece(str(tmp_path / "b"), 3, 199_999, "uint8")]
    assert same_bytes(a, b, None)
    late = bytearray(b"xx" + data)
    late[-1] ^= 1
    (tmp_path / "c").write_bytes(bytes(late))
    c = [Piece(str(tmp_path / "c"), 2, 200_000, "uint8")]
    assert not same_bytes(a, c, None)
    assert not same_bytes(a, c[:0] + [Piece(str(tmp_path / "c"), 2, 199_999, "uint8")], None)
