"""Checkpoints shaped like DeepSpeed's own tests, all real (``fixtures/``, DeepSpeed 0.19.8 on CPU ranks):

* parameters outside the optimizer: ``z2_bf16_ws2_emptygroup`` (an empty param group and one of the 1-D params only:
  every weight trainable but in no group, as in DeepSpeed's ``TestEmptyParameterGroup``), ``z2_bf16_ws2_late`` (an fp32
  module attached after ``deepspeed.initialize``: ``test_zero_late_module_attach``), ``z2_bf16_ws2_subset`` (one group
  of the blocks' parameters, LoRA-style; the tied embedding trainable but not optimized). They are in neither
  ``param_shapes`` (the optimizer's parameters) nor ``frozen_param_shapes`` (``requires_grad=False``); DeepSpeed loads
  them from ``module``. zckpt read every one of them as an unrecorded tie and refused all commands;
* ``z2_bf16_ws2_twin``: a parameter in no group holding, at the save, the very bf16 bytes of a trainable one. Not a
  tie: the engine has the twin's bf16 value. zckpt tied it, exit 0, and merged the other's fp32 master;
* other optimizers' per-element state: ``z2_bf16_ws2_sgd`` (``momentum_buffer``), ``z2_bf16_ws2_lion`` (a client
  optimizer with ``exp_avg`` only and an int counter). zckpt refused to reshard them.

Each is resharded and loaded by DeepSpeed at another size; the live engine's state (masters, every per-element
optimizer state, module values, steps) equals the source engine's, bit for bit, and DeepSpeed saves the same files.
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
from tests import ds_oracle
from tests.test_reshard import fixture_dir, run_case  # noqa: F401 - the session fixture of committed fixtures
from zckpt.state.open import open_checkpoint
from zckpt.deepspeed.model import declared_ties
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.encoding.tensors import load_pieces
from zckpt.ops.info import info as info_of

ROOT = Path(__file__).resolve().parent.parent
FX = ROOT / "fixtures"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=str(ROOT))


def _oracle(name):
    return load_file(str(FX / name / "expected" / "oracle.safetensors")), \
        json.loads((FX / name / "expected" / "oracle.json").read_text())


# ------------------------------------------------------------------------------------------ parameters in no group

OUTSIDE = {  # fixture -> the trainable parameters it has in no optimizer group
    "z2_bf16_ws2_emptygroup": ["emb.weight", "blocks.0.up.weight", "blocks.0.down.weight"],
    "z2_bf16_ws2_late": ["late.weight", "late.bias"],
    "z2_bf16_ws2_subset": ["emb.weight"],
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_parameters_in_no_group_read_as_module_values(name, tmp_path):
    """Each is read from ``module`` in its dtype (bf16, fp32 for the late module) = the engine's parameter; the
    optimizer's ones are its masters; info, verify and merge succeed (they all failed)."""
    oracle, info = _oracle(name)
    ckpt = open_checkpoint(str(FX / name))
    byname = ckpt.by_name()
    assert sorted(r.name for r in ckpt.no_group) == sorted(OUTSIDE[name])
    for n in OUTSIDE[name]:
        rec = byname[n]
        assert rec.kind == "frozen" and rec.no_group and not rec.exp_avg
        assert rec.dtype == info["module_dtypes"][n]
    sd = zckpt.load_state_dict(str(FX / name))
    for n in info["param_names"]:
        src = dict(info["tied"]).get(n, n)
        if src in OUTSIDE[name]:  # the engine's parameter, as it holds it (its dtype checked above; fp32 is exact)
            assert torch.equal(sd[n], oracle[f"module/{n}"].float()), n
        elif f"fp32/{src}" in oracle:  # an optimized one: its master
            assert torch.equal(sd[n], oracle[f"fp32/{src}"]), n
    assert set(sd) == set(info["param_names"]) | set(info["buffers"])
    d = info_of(str(FX / name))
    assert sorted(d["no_optimizer_group"]) == sorted(OUTSIDE[name]) and d["ambiguous_ties"] == []
    r = _cli("info", FX / name)
    assert r.returncode == 0 and f"{len(OUTSIDE[name])} parameters in no optimizer group" in r.stdout, r.stderr
    assert zckpt.verify(str(FX / name), deep=True).ok
    assert _cli("verify", FX / name).returncode == 0
    assert _cli("merge", FX / name, "-o", tmp_path / "m").returncode == 0
    # to DCP: each as a model tensor in its dtype, with no optimizer state (what FSDP2 + AdamW saves for it)
    zckpt.convert(str(FX / name), to="dcp", out=str(tmp_path / "d"))
    dcp = open_checkpoint(str(tmp_path / "d")).by_name()
    for n in OUTSIDE[name]:
        assert dcp[n].kind == "frozen" and dcp[n].dtype == info["module_dtypes"][n]
        assert torch.equal(load_pieces(dcp[n].value, dcp[n].dtype, dcp[n].shape), oracle[f"module/{n}"]), n


@pytest.mark.parametrize("name,ws", [("z2_bf16_ws2_emptygroup", 3), ("z2_bf16_ws2_late", 3),
                                     ("z2_bf16_ws2_subset", 1), ("z1_bf16_ws2_emptygroup", 3)], ids=str)
def test_deepspeed_loads_resharded_outside_optimizer(fixture_dir, tmp_path, name, ws):  # noqa: F811
    """Resharded, loaded by DeepSpeed at another size: the engine's state equals the source's, bit for bit (the
    parameters in no group from ``module``), and DeepSpeed saves the same files again (no frozen_param_shapes
    entry for them)."""
    run_case(fixture_dir, tmp_path, name, ws)


def test_zero1_empty_group_read_from_module(tmp_path):
    """ZeRO-1 lists no frozen parameters: the weights in no group read as the module holds them, like frozen ones
    (the files cannot tell the two apart, and both read the same); info, verify and merge succeed."""
    oracle, info = _oracle("z1_bf16_ws2_emptygroup")
    src = FX / "z1_bf16_ws2_emptygroup"
    byname = open_checkpoint(str(src)).by_name()
    sd = zckpt.load_state_dict(str(src))
    for n in OUTSIDE["z2_bf16_ws2_emptygroup"]:
        assert byname[n].kind == "frozen" and byname[n].dtype == "bfloat16"
        assert torch.equal(sd[n], oracle[f"module/{n}"].float()), n
    assert _cli("info", src).returncode == 0 and zckpt.verify(str(src)).ok
    assert _cli("merge", src, "-o", tmp_path / "m").returncode == 0


def test_zero3_full_module_entry_is_a_parameter_in_no_group(tmp_path):
    """ZeRO-3's ``module`` holds 0-element placeholders for partitioned parameters; an unlisted full tensor is a
    parameter DeepSpeed never partitioned (DeepSpeed 0.19.8 itself cannot save one attached late at ZeRO-3, see
    fixtures/generate.py, so ``z3_bf16_ws2`` is given one): read as saved, never dropped (zckpt dropped it)."""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(FX / "z3_bf16_ws2", ck, ignore=shutil.ignore_patterns("expected"))
    tag = (ck / "latest").read_text().strip()
    extra = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for r in (0, 1):
        f = ck / tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        sd = torch.load(f, weights_only=False)
        sd["module"]["late.weight"] = extra
        torch.save(sd, f)
    ckpt = open_checkpoint(str(ck))
    rec = ckpt.by_name()["late.weight"]
    assert rec.kind == "frozen" and rec.no_group and rec.dtype == "float32"
    assert torch.equal(zckpt.load_state_dict(str(ck))["late.weight"], extra)
    assert info_of(str(ck))["no_optimizer_group"] == ["late.weight"]


def test_no_group_refused_at_zero3_target(tmp_path):
    with pytest.raises(UnsupportedLayout, match="no optimizer group.*late.weight") as err:
        zckpt.reshard(str(FX / "z2_bf16_ws2_late"), str(tmp_path / "o"), world_size=2, stage=3)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ equal bytes

def test_equal_bytes_never_make_a_tie(tmp_path):
    """``twin`` (in no group) holds at the save the bf16 bytes of the trainable ``blocks.0.up.weight``; no tie is
    recorded. A tie and a separate parameter read differently (the master vs the bf16 copy): what reads values is
    refused in one line naming the flags, info and verify report it; declared, each reads as the engine has it."""
    oracle, _ = _oracle("z2_bf16_ws2_twin")
    src = FX / "z2_bf16_ws2_twin"
    assert torch.equal(oracle["module/twin"], oracle["module/blocks.0.up.weight"])  # the fixture's premise
    ckpt = open_checkpoint(str(src))
    assert ckpt.ambiguous_ties == [("twin", "blocks.0.up.weight")]
    assert ckpt.by_name()["twin"].kind == "frozen"  # never taken for a tie
    for call in (lambda: zckpt.load_state_dict(str(src)),
                 lambda: zckpt.merge(str(src), str(tmp_path / "m")),
                 lambda: zckpt.reshard(str(src), str(tmp_path / "r"), world_size=3),
                 lambda: zckpt.convert(str(src), to="dcp", out=str(tmp_path / "c"))):
        with pytest.raises(UnsupportedLayout, match="--no-tie twin.*--tie twin=blocks.0.up.weight") as err:
            call()
        assert "\n" not in str(err.value)
    assert not any((tmp_path / n).exists() for n in ("m", "r", "c"))
    for cmd in (["merge", src, "-o", tmp_path / "m"], ["reshard", src, "-w", "3", "-o", tmp_path / "r"]):
        r = _cli(*cmd)
        assert r.returncode == 1 and "--no-tie twin" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    d = info_of(str(src))
    assert d["ambiguous_ties"] == [["twin", "blocks.0.up.weight"]] and "twin" in d["no_optimizer_group"]
    r = _cli("info", "--json", src)
    assert r.returncode == 0 and json.loads(r.stdout)["ambiguous_ties"] == [["twin", "blocks.0.up.weight"]]
    rep = zckpt.verify(str(src))
    assert rep.ok and any("--no-tie twin" in c.detail for c in rep.checks)
    # declared a parameter of its own: the engine's bf16 value
    with declared_ties({"twin": None}):
        sd = zckpt.load_state_dict(str(src))
    assert torch.equal(sd["twin"], oracle["module/twin"].float())
    assert not torch.equal(sd["twin"], oracle["fp32/blocks.0.up.weight"])  # what the old guess gave
    assert _cli("merge", src, "--no-tie", "twin", "-o", tmp_path / "m").returncode == 0
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert torch.equal(got["twin"], oracle["module/twin"].float())
    assert torch.equal(got["blocks.0.up.weight"], oracle["fp32/blocks.0.up.weight"])
    # declared a tie: the other's master (what a second name of it would be)
    with declared_ties({"twin": "blocks.0.up.weight"}):
        rec = open_checkpoint(str(src)).by_name()["twin"]
        sd = zckpt.load_state_dict(str(src))
    assert rec.kind == "tied" and torch.equal(sd["twin"], oracle["fp32/blocks.0.up.weight"])
    # a declaration naming nothing the files leave open is a usage error, not ignored
    with declared_ties({"emb.weight": None}), pytest.raises(InvalidArgument, match="emb.weight"):
        open_checkpoint(str(src))
    r = _cli("info", src, "--tie", "twin")
    # a malformed value: exit 1, one line, as --storage-option
    assert r.returncode == 1 and "NAME=PARAM" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_deepspeed_loads_resharded_twin(fixture_dir, tmp_path):  # noqa: F811
    """With ``twin`` declared a parameter of its own, the resharded checkpoint loads into DeepSpeed at 3 ranks with
    the engine's state, bit for bit (the twin's bf16 value from ``module``)."""
    with declared_ties({"twin": None}):
        run_case(fixture_dir, tmp_path, "z2_bf16_ws2_twin", 3)


# ------------------------------------------------------------------------------------- other optimizers' state

@pytest.mark.parametrize("name,key", [("z2_bf16_ws2_sgd", "momentum_buffer"), ("z2_bf16_ws2_lion", "exp_avg")])
def test_elementwise_state_read_like_adam_moments(name, key, tmp_path):
    oracle, _ = _oracle(name)
    ckpt = open_checkpoint(str(FX / name))
    assert ckpt.other_state_keys == [key] and ckpt.state_refusal is None
    checked = 0
    for rec in ckpt.of_kind("trainable"):
        assert not rec.exp_avg and list(rec.other_state) == [key]
        got = load_pieces(rec.other_state[key], rec.other_state[key][0].dtype, rec.shape)
        assert torch.equal(got, oracle[f"{key}/{rec.name}"].reshape(rec.shape)), rec.name
        checked += 1
    assert checked == 7
    assert info_of(str(FX / name))["optimizer_state_keys"] == [key]
    with pytest.raises(UnsupportedLayout, match=f"'{key}' is not Adam"):  # torch's AdamW cannot continue it
        zckpt.convert(str(FX / name), to="dcp", out=str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name,ws,stage", [("z2_bf16_ws2_sgd", 3, None), ("z2_bf16_ws2_sgd", 1, 1),
                                           ("z2_bf16_ws2_lion", 3, None), ("z2_bf16_ws2_lion", 3, 3)], ids=str)
def test_deepspeed_loads_resharded_elementwise_state(fixture_dir, tmp_path, name, ws, stage):  # noqa: F811
    """SGD's momentum and the Lion-like optimizer's exp_avg (and its int counter, carried as saved) resharded like
    Adam's moments: DeepSpeed's engine at the new size holds the source engine's state bit for bit (every
    per-element key, through ``safe_get_full_optimizer_state``) and saves the very files zckpt wrote."""
    run_case(fixture_dir, tmp_path, name, ws, stage)


def test_counter_carried_as_saved(tmp_path):
    zckpt.reshard(str(FX / "z2_bf16_ws2_lion"), str(tmp_path / "o"), world_size=3)
    st = torch.load(tmp_path / "o" / "global_step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
                    weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"]
    assert [list(s) for s in st.values()] == [["exp_avg", "updates"]] * 2
    assert [s["updates"] for s in st.values()] == [3, 3]


def test_state_not_elementwise_refused_naming_the_key(tmp_path):
    """A per-parameter tensor of another size than the partition (a factored second moment, as Adafactor keeps)
    cannot be re-partitioned: reshard refuses in one line naming the key, nothing written; merge still reads the
    weights. (The Lion fixture with its exp_avg replaced by a [2, P/2] tensor, as a factored row/column pair.)"""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(FX / "z2_bf16_ws2_lion", ck, ignore=shutil.ignore_patterns("expected"))
    for r in (0, 1):
        f = ck / "global_step3" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        sd = torch.load(f, weights_only=False)
        st = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        st["exp_avg_sq_row"] = torch.zeros(2, 3)
        torch.save(sd, f)
    with pytest.raises(UnsupportedLayout, match="'exp_avg_sq_row' of param group 0 is not elementwise") as err:
        zckpt.reshard(str(ck), str(tmp_path / "o"), world_size=3)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
    r = _cli("reshard", ck, "-w", "3", "-o", tmp_path / "o")
    assert r.returncode == 1 and "exp_avg_sq_row" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert zckpt.verify(str(ck)).ok and _cli("merge", ck, "-o", tmp_path / "m").returncode == 0


def test_resume_plans_elementwise_state():
    """A resume's per-rank plan (``zckpt.deepspeed.load_checkpoint``) carries the momentum as reshard does."""
    from zckpt.ops.reshard import plan_ranks
    plan = plan_ranks(open_checkpoint(str(FX / "z2_bf16_ws2_sgd")), 3, [1])
    optim = next(f.obj for f in plan.files if f.relpath.endswith("optim_states.pt"))
    state = optim["optimizer_state_dict"]["base_optimizer_state"]["state"]
    assert [list(s) for s in state.values()] == [["momentum_buffer"]] * 2
    spec = ds_oracle.generate_module().fixture_spec("z2_bf16_ws2_sgd")
    assert spec["optimizer"] == "sgd"


@pytest.mark.parametrize("name,ws", [("z2_bf16_ws2_emptygroup", 3), ("z2_bf16_ws2_late", 1), ("z2_bf16_ws2_sgd", 3),
                                     ("z2_bf16_ws2_lion", 3)], ids=str)
def test_resume_at_another_size(fixture_dir, tmp_path, name, ws):  # noqa: F811
    """``zckpt.deepspeed.load_checkpoint`` in a job at another size: the same state as DeepSpeed loading the
    offline reshard, bit for bit, on every rank; two training steps give the same losses; the live engine's
    state equals the source engine's (parameters in no group, momentum / exp_avg included)."""
    from tests.test_resume import resume_case
    resume_case(fixture_dir, tmp_path, name, ws)
