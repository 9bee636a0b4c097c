"""Where a reader must not infer which optimizer entry belongs to which name: real DeepSpeed 0.19.8 runs.

Each case is a checkpoint DeepSpeed wrote on CPU ranks (``fixtures/generate.py``; the ones zckpt must refuse live
in ``fixtures/ambiguous/``, outside the generic fixture tests), compared with the live engine's state captured
right after the save (``expected/oracle.safetensors``):

* ZeRO-0 with a param group listed in another order than the model (two same-shaped LayerNorm weights swapped):
  the values place the masters (``z0_bf16_ws1_swap``); where both round to the same bf16 values the
  ``param_names`` torch saves place them (``z0_bf16_ws1_swap_named``, fp32: ``z0_fp32_ws2``); without names
  the bf16 checkpoint is refused in one line and the fp32 one is read without its moments (``ambiguous/``).
  zckpt before this change returned each one's master under the other's name, exit 0.
* a frozen ``TiedLayerSpec`` module in a pipeline: nothing in the files names it; refused (it was written as
  ``0.weight``, ``PipelineModule.state_dict()`` has ``tied_modules.embed.weight``).
* MoE with ``use_data_before_expert_parallelism``: the expert-data-parallel groups are blocks of ranks
  (``moe_z2_bf16_ws4_ep2_dbe``, also run by ``tests/test_layouts_pp_moe.py``); merge equals the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.deepspeed.model import declared_ties
from zckpt.errors import UnsupportedLayout
from zckpt.encoding.tensors import load_pieces
from zckpt.ops.info import info as info_of
from tests.conftest import FIXTURES, checkpoint_path
from tests.test_merge import _merged

ROOT = Path(__file__).resolve().parents[1]
AMBIGUOUS = FIXTURES / "ambiguous"
SWAPPED = ("blocks.0.ln.weight", "blocks.1.ln.weight")


def _oracle(d: Path) -> tuple[dict, dict]:
    return (load_file(str(d / "expected" / "oracle.safetensors")),
            json.loads((d / "expected" / "oracle.json").read_text()))


def _spec(d: Path) -> dict:
    return json.loads((d / "expected" / "spec.json").read_text())


def _need(d: Path) -> Path:
    if not (d / "expected" / "spec.json").exists():
        pytest.fail(f"fixture {d.relative_to(ROOT)} missing (python fixtures/generate.py --only ...)")
    return d


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


# ------------------------------------------------------------------------------------------------ ZeRO-0

@pytest.mark.parametrize("name", ["z0_bf16_ws1_swap", "z0_bf16_ws1_swap_named", "z0_fp32_ws2"])
def test_zero0_group_out_of_model_order_merges_exactly(name, tmp_path):
    fx = _need(FIXTURES / name)
    oracle, info = _oracle(fx)
    swap = _spec(fx)["group_swap"]
    # the run really listed the pair in another order than the model, and their masters differ
    group = next(g["names"] for g in info["param_groups"] if swap[0] in g["names"])
    model_order = [n for n in info["trainable"] if n in group]
    assert group != model_order
    assert not torch.equal(oracle[f"fp32/{swap[0]}"], oracle[f"fp32/{swap[1]}"])
    if name.endswith("_named"):  # the values cannot tell them apart: both round to the same bf16 weights
        assert torch.equal(oracle[f"module/{swap[0]}"], oracle[f"module/{swap[1]}"])
    zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype="fp32")
    got = _merged(tmp_path / "out")
    for n in info["trainable"]:
        assert torch.equal(got[n], oracle[f"fp32/{n}"]), n
    sd = zckpt.load_state_dict(str(checkpoint_path(fx)))
    for n in swap:
        assert torch.equal(sd[n], oracle[f"fp32/{n}"]), n
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    for n in info["trainable"]:  # and the Adam moments went with their params
        rec = ckpt.by_name()[n]
        for kind in ("exp_avg", "exp_avg_sq"):
            t = load_pieces(getattr(rec, kind), rec.state_dtype, rec.shape)
            assert torch.equal(t, oracle[f"{kind}/{n}"].reshape(t.shape)), (kind, n)
    assert [g.names for g in ckpt.groups] == [g["names"] for g in info["param_groups"]]


def test_zero0_indistinguishable_masters_refused_in_one_line(tmp_path):
    fx = _need(AMBIGUOUS / "z0_bf16_ws1_swap_unnamed")
    oracle, _ = _oracle(fx)
    a, b = SWAPPED
    assert torch.equal(oracle[f"module/{a}"], oracle[f"module/{b}"])  # what the cross-check sees
    assert not torch.equal(oracle[f"fp32/{a}"], oracle[f"fp32/{b}"])  # what a guess would swap
    ck = str(checkpoint_path(fx))
    for call in (lambda: zckpt.open_checkpoint(ck), lambda: info_of(ck),
                 lambda: zckpt.merge(ck, str(tmp_path / "out")), lambda: zckpt.load_state_dict(ck)):
        with pytest.raises(UnsupportedLayout, match=f"cannot tell which parameter.*'{a}' or '{b}'"):
            call()
    assert not (tmp_path / "out").exists()
    for cmd in (["info", ck], ["merge", ck, "-o", str(tmp_path / "cli")], ["verify", ck]):
        res = _cli(*cmd)
        assert res.returncode != 0 and "cannot tell which parameter" in res.stderr, (cmd, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "cli").exists()


def test_zero0_fp32_without_names_leaves_the_moments_out(tmp_path):
    """fp32: the module weights are the masters (exact by name); the moments of same-shaped params cannot be
    placed, so none are read (a note says why), never someone else's."""
    fx = _need(AMBIGUOUS / "z0_fp32_ws1_swap_unnamed")
    oracle, info = _oracle(fx)
    ck = str(checkpoint_path(fx))
    ckpt = zckpt.open_checkpoint(ck)
    assert not any(r.exp_avg or r.exp_avg_sq for r in ckpt.records)
    assert any("Adam moments not read" in n and "cannot tell" in n for n in ckpt.notes)
    zckpt.merge(ck, str(tmp_path / "out"), dtype="fp32")
    got = _merged(tmp_path / "out")
    for n in info["trainable"]:
        assert torch.equal(got[n], oracle[f"fp32/{n}"]), n
    assert zckpt.verify(ck, deep=True).ok
    # what carries the whole training state refuses rather than write it without the moments, exit 0
    assert ckpt.state_refusal and "cannot tell" in ckpt.state_refusal
    with pytest.raises(UnsupportedLayout, match="optimizer state cannot be carried"):
        zckpt.convert(ck, to="dcp", out=str(tmp_path / "dcp"))
    assert not (tmp_path / "dcp").exists()


def test_zero0_unplaced_state_is_said_as_trainable_in_info():
    """info does not call the parameters whose Adam moments cannot be placed "frozen": they are trainable (the live
    engine's optimizer held them); said with the note, in the text and in --json (it said "0 trainable, 8
    frozen")."""
    fx = _need(AMBIGUOUS / "z0_fp32_ws1_swap_unnamed")
    _, info = _oracle(fx)
    trainable, frozen = len(info["trainable"]), len(info["frozen"])
    assert trainable and frozen  # (7 and 1: which one is frozen, the files do not say)
    res = _cli("info", str(checkpoint_path(fx)), "--json")
    doc = json.loads(res.stdout)
    # one truth in both: the parameters the files do not tell apart are counted as such, never as frozen
    assert doc["state_not_placed"] == trainable and doc["counts"]["not_told_apart"] == trainable + frozen \
        and doc["counts"]["frozen"] == doc["counts"]["trainable"] == 0, doc["counts"]
    assert doc["numel"]["not_told_apart"] == doc["parameters"], doc["numel"]
    assert any("Adam moments not read" in n for n in doc["notes"])
    res = _cli("info", str(checkpoint_path(fx)))
    line = next(x for x in res.stdout.splitlines() if x.startswith("parameters"))
    assert f"{trainable + frozen} not told apart" in line and f"{trainable} trainable whose optimizer state cannot " \
        f"be placed, {frozen} frozen" in line and "0 trainable" not in line, line
    assert any(x.startswith("note ") and "Adam moments not read" in x for x in res.stdout.splitlines()), res.stdout
    # a checkpoint whose state is placed: as before
    res = _cli("info", str(checkpoint_path(FIXTURES / "z0_bf16_ws1_swap")), "--json")
    assert json.loads(res.stdout)["state_not_placed"] is None


# ------------------------------------------------------------------------------------------------ pipeline

def test_frozen_tied_pipeline_module_refused(tmp_path):
    fx = _need(AMBIGUOUS / "pp2_z1_bf16_ws2_frozen_tied")
    oracle, info = _oracle(fx)
    assert "tied_modules.embed.weight" in info["frozen"]  # the live PipelineModule's name for it
    ck = str(checkpoint_path(fx))
    with pytest.raises(UnsupportedLayout, match="layer 0 holds only frozen tensors.*tied_modules"):
        zckpt.open_checkpoint(ck)
    res = _cli("merge", ck, "-o", str(tmp_path / "out"))
    assert res.returncode != 0 and "holds only frozen tensors" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ MoE

def test_moe_data_before_expert_parallelism_merges_exactly(tmp_path):
    fx = _need(FIXTURES / "moe_z2_bf16_ws4_ep2_dbe")
    oracle, info = _oracle(fx)
    assert info["ep_ranks"] == [0, 0, 1, 1]  # blocks of ranks, not R % ep
    ck = str(checkpoint_path(fx))
    zckpt.merge(ck, str(tmp_path / "out"), dtype="fp32")
    got = _merged(tmp_path / "out")
    masters = {k[5:]: v for k, v in oracle.items() if k.startswith("fp32/")}
    assert masters and all(torch.equal(got[n], t) for n, t in masters.items())
    d = info_of(ck)
    assert (d["dp_world_size"], d["ep_world_size"], d["pp_world_size"], d["tp_world_size"]) == (4, 2, 1, 1)
    assert zckpt.verify(ck, deep=True).ok


# ------------------------------------------------------------------------------------------------ ZeRO-2 ties

def _without_recorded_tie(tmp_path: Path, change=None) -> Path:
    """``z2_bf16_ws2`` as DeepSpeed writes a tie it did not record (AutoEP's router alias, 0.19.8: ``shared_params``
    empty, the alias a separate copy in ``module``): ``head.weight`` cloned, its ``shared_params`` entry gone."""
    import shutil
    src = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("expected"))
    f = ck / (ck / "latest").read_text().strip() / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["shared_params"].pop("head.weight")
    sd["module"]["head.weight"] = sd["module"]["head.weight"].clone()
    if change is not None:
        change(sd["module"]["head.weight"])
    torch.save(sd, f)
    return ck


def test_zero2_unrecorded_tie_is_never_guessed_from_its_bytes(tmp_path):
    """An entry in no optimizer group holding the very bytes of a trainable parameter's bf16 copy, no tie recorded:
    a second name of it (its value the master) or a parameter of its own (its value that bf16 copy) cannot be told
    apart, and the two read differently. Reading values is refused in one line naming the flags (zckpt tied it by
    its bytes, exit 0: a guess); declared, each reads as said."""
    oracle, _ = _oracle(FIXTURES / "z2_bf16_ws2")
    ck = _without_recorded_tie(tmp_path)
    ckpt = zckpt.open_checkpoint(str(ck))
    assert ckpt.ambiguous_ties == [("head.weight", "emb.weight")] and ckpt.by_name()["head.weight"].kind != "tied"
    with pytest.raises(UnsupportedLayout, match="--no-tie head.weight.*--tie head.weight=emb.weight"):
        zckpt.load_state_dict(str(ck))
    assert zckpt.verify(str(ck)).ok  # reported, not failed
    with declared_ties({"head.weight": "emb.weight"}):
        rec = zckpt.open_checkpoint(str(ck)).by_name()["head.weight"]
        sd = zckpt.load_state_dict(str(ck))
    assert rec.kind == "tied" and rec.tied_to == "emb.weight"
    assert torch.equal(sd["head.weight"], oracle["fp32/emb.weight"])  # the master, not its bf16 copy
    with declared_ties({"head.weight": None}):
        sd = zckpt.load_state_dict(str(ck))
    assert torch.equal(sd["head.weight"], oracle["module/head.weight"].float())


def test_zero2_unlisted_entry_matching_no_parameter_is_a_parameter_outside_the_optimizer(tmp_path):
    """The same entry with other bytes: a parameter in no optimizer group (DeepSpeed loads it from 'module'), read
    as saved (zckpt refused it: 'a parameter shared under a second name')."""
    ck = _without_recorded_tie(tmp_path, change=lambda t: t.view(-1)[0].add_(1.0))
    ckpt = zckpt.open_checkpoint(str(ck))
    rec = ckpt.by_name()["head.weight"]
    assert rec.kind == "frozen" and rec.no_group and rec.dtype == "bfloat16" and not ckpt.ambiguous_ties
    saved = torch.load(next(ck.glob("*/mp_rank_00_model_states.pt")), weights_only=False)["module"]["head.weight"]
    assert torch.equal(zckpt.load_state_dict(str(ck))["head.weight"], saved.float())
