"""Mixture-of-experts checkpoints made by DeepSpeed 0.19.8 with two MoE layers of 8 experts, top-2 (issue 47).

* ``fixtures/moe_z2_bf16_ws4_ep2_ep4_mixed``: native MoE, ZeRO-2, 4 ranks, layers of ep 2 and ep 4, each rank run
  with its own ``PYTHONHASHSEED`` (``hash_seeds`` [0, 1, 1, 1]): DeepSpeed walks a ``set`` of expert-group names,
  so rank 0 saved [dense, ep_size_2, ep_size_4] and ranks 1-3 [dense, ep_size_4, ep_size_2]. Each rank's order is
  read from its own file; every master and moment equals the live engine's (``expected/oracle.safetensors``:
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` right after the save).
* ``fixtures/moe_autoep_z3_bf16_ws4_ep2_l2`` (AutoEP at ZeRO-3, Qwen3-MoE, both layers' experts in one ZeRO-3
  sub-group) and ``moe_autoep_z2_bf16_ws4_ep4_l2`` (AutoEP at ZeRO-2, Mixtral, ep 4): their merge / state /
  convert comparisons with the engine are in tests/test_layouts_autoep.py.

Coverage (:mod:`zckpt.state.experts`): info and verify report layers x experts, ep and the check on every MoE
fixture; damaged copies of the real files (one rank's expert files or rank files deleted, an expert held twice, a
stray expert beyond the layer's count) are refused by info, verify, merge, convert and reshard in one line naming
the layer and the expert, nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.encoding.tensors import load_pieces
from zckpt.errors import ZckptError
from zckpt.ops.info import info as info_of
from tests.conftest import FIXTURE_DIRS, FIXTURES, checkpoint_path
from tests.test_merge import _merged

MIXED = FIXTURES / "moe_z2_bf16_ws4_ep2_ep4_mixed"
Z3L2 = FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2"
Z2L2 = FIXTURES / "moe_autoep_z2_bf16_ws4_ep4_l2"
MOE = [d for d in FIXTURE_DIRS if d.name.startswith("moe_")]


def _oracle(fx: Path):
    return (load_file(str(fx / "expected" / "oracle.safetensors")),
            json.loads((fx / "expected" / "oracle.json").read_text()))


def _group_names(path: Path) -> list[str]:
    st = torch.load(path, weights_only=False, map_location="cpu")
    return [pg["name"] for pg in st["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]]


def test_mixed_group_orders_are_read_from_each_rank(tmp_path):
    tensors, info = _oracle(MIXED)
    tag = MIXED / info["tag"]
    orders = [_group_names(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(4)]
    assert orders == info["group_orders"] and orders[0] != orders[1]  # the files really differ
    ckpt = zckpt.open_checkpoint(str(MIXED))
    by = ckpt.by_name()
    n = 0
    for key, want in tensors.items():
        kind, name = key.split("/", 1)
        if kind not in ("fp32", "exp_avg", "exp_avg_sq"):
            continue
        rec = by[name]
        pieces = rec.value if kind == "fp32" else getattr(rec, kind)
        got = load_pieces(pieces, rec.dtype if kind == "fp32" else rec.state_dtype, rec.shape)
        assert torch.equal(got, want.reshape(got.shape)), key
        n += 1
    assert n == 3 * len(info["trainable"])
    zckpt.merge(str(MIXED), str(tmp_path / "out"), dtype="fp32")
    got = _merged(tmp_path / "out")
    for name in info["trainable"]:
        assert torch.equal(got[name], tensors[f"fp32/{name}"]), name
    report = zckpt.verify(str(MIXED))
    assert report.ok and any(c.name == "MoE experts" and "2 layers x 8 experts, ep 2/4" in c.detail
                             for c in report.checks)
    assert any("ranks 1, 2, 3 list their param groups in another order" in n for n in ckpt.notes)
    res = zckpt.reshard(str(MIXED), str(tmp_path / "ws8"), world_size=8)  # every rank in rank 0's order, said
    assert any("every output file has rank 0's order (dense, ep_size_2, ep_size_4)" in n for n in res.plan.notes)
    for r in range(8):
        names = _group_names(tmp_path / "ws8" / info["tag"] / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        assert names == orders[0]


def test_unmatched_group_order_refused_naming_the_cause(tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(MIXED, copy, ignore=shutil.ignore_patterns("expected"))
    victim = copy / "global_step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    st = torch.load(victim, weights_only=False, map_location="cpu")
    for pg in st["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
        pg["name"] = "ep_size_8" if pg["name"] == "ep_size_4" else pg["name"]
    torch.save(st, victim)
    with pytest.raises(ZckptError, match="param groups are in another order than rank 0's and cannot be matched") \
            as err:
        zckpt.open_checkpoint(str(copy))
    assert err.value.path == str(victim) and "\n" not in str(err.value)


@pytest.mark.parametrize("fx", MOE, ids=[d.name for d in MOE])
def test_info_and_verify_report_layers_experts_and_the_check(fx):
    spec = json.loads((fx / "expected" / "spec.json").read_text())
    ck = str(checkpoint_path(fx))
    d = info_of(ck)
    moe = d["moe"]
    am = spec.get("autoep_model") or {}  # (DeepSeek's: its first "dense" layers are no MoE layers)
    layers = 2 if (spec.get("moe2_ep_size") or am.get("layers", 1) - am.get("dense", 0) == 2) else 1
    experts = spec.get("num_experts") or (spec.get("autoep_model") or {}).get("experts") or 4
    assert (moe["layers"], moe["experts"], moe["checked"]) == (layers, experts, True)
    assert moe["each_expert_has"] == ["value", "exp_avg", "exp_avg_sq"] and moe["routers"] == layers
    if spec["stage"] != 0:  # without ZeRO a layer's ep_size is not saved
        eps = sorted({spec["ep_size"], spec.get("moe2_ep_size") or spec["ep_size"]})
        assert moe["ep"] == (eps[0] if len(eps) == 1 else eps) == d["ep_world_size"]
    report = zckpt.verify(ck)
    line = next(c for c in report.checks if c.name == "MoE experts")
    assert report.ok and line.ok and f"{layers} layer{'s' if layers > 1 else ''} x {experts} experts" in line.detail


def _rename_expert(src: int, dst: int):
    def change(path: Path) -> None:
        sd = torch.load(path, weights_only=False, map_location="cpu")
        torch.save({k.replace(f".deepspeed_experts.{src}.", f".deepspeed_experts.{dst}."): v for k, v in sd.items()},
                   path)
    return change


def _overlap_layer1(path: Path) -> None:  # ep rank 1's block of layer 1 put over ep rank 0's, in every map
    ms = torch.load(path, weights_only=False, map_location="cpu")
    for layers in (ms["ds_autoep_layers"], ms["universal_checkpoint_info"]["ds_autoep_layers"]):
        for amap in layers[1]["affine_maps"]["params"].values():
            amap["ranks"][1]["pieces"][0]["source"][0] = 0
    torch.save(ms, path)


def _damage(fx: Path, tmp_path: Path, case: str) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(fx, copy, ignore=shutil.ignore_patterns("expected"))
    tag = copy / (copy / "latest").read_text().strip()
    if case == "rank-expert-files":  # expert-parallel rank 1 of the ep 2 layer: experts 4-7 of layer 0
        for e in range(4, 8):
            (tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt").unlink()
    elif case == "held-twice":  # expert 3's file holds expert 2's tensors
        _rename_expert(3, 2)(tag / "layer_1_expert_3_mp_rank_00_model_states.pt")
    elif case == "beyond":  # a ninth expert's file in a layer of 8
        stray = tag / "layer_1_expert_8_mp_rank_00_model_states.pt"
        shutil.copy(tag / "layer_1_expert_7_mp_rank_00_model_states.pt", stray)
        _rename_expert(7, 8)(stray)
    elif case == "rank-files":  # ZeRO-3: rank 1's two files
        for f in tag.glob("*zero_pp_rank_1_mp_rank_00_*"):
            f.unlink()
    elif case == "z3-held-twice":
        for f in tag.glob("zero_pp_rank_*_model_states.pt"):
            _overlap_layer1(f)
    elif case == "z2-copied-expert":  # expert 5's file replaced by a copy of expert 4's
        shutil.copy(tag / "layer_1_expert_4_mp_rank_00_model_states.pt",
                    tag / "layer_1_expert_5_mp_rank_00_model_states.pt")
    elif case == "z2-rank-expert-files":  # ep 4: rank 2 saved experts 4 and 5 of each layer
        for f in list(tag.glob("layer_*_expert_4_*")) + list(tag.glob("layer_*_expert_5_*")):
            f.unlink()
    return copy


DAMAGED = [
    (MIXED, "rank-expert-files", r"MoE layer 0: expert 4 has no file; expert files missing: layer_0_expert_4_"),
    (MIXED, "held-twice", r"MoE layer 1: expert 2 is held twice \(its own file and '.*deepspeed_experts\.2\."),
    (MIXED, "beyond", r"MoE layer 1: expert 8 is beyond its 8 experts"),
    (Z3L2, "rank-files", r"missing: .*rank 1 held its partition of experts 4\.\.7 of MoE layers 0 "
                         r"\(model\.layers\.0\.mlp\), 1 \(model\.layers\.1\.mlp\)"),
    (Z3L2, "z3-held-twice", r"MoE layer 1 \(model\.layers\.1\.mlp\): expert 0 is held twice \(expert-parallel ranks "
                            r"0 and 1\)"),
    (Z2L2, "z2-rank-expert-files", r"MoE layer 0: expert 4 has no file"),
    (Z2L2, "z2-copied-expert", r"MoE layer 1: expert 4 is held twice \(its own file and 'model\.layers\.1\.mlp\."
                               r"experts\.w1\.4' in the file of expert 5\)"),
]


@pytest.mark.parametrize("fx,case,message", DAMAGED, ids=[c for _, c, _ in DAMAGED])
def test_damaged_coverage_refused_by_every_command(tmp_path, fx, case, message):
    import re

    ck = str(_damage(fx, tmp_path, case))
    calls = {
        "info": lambda: info_of(ck),
        "verify": lambda: zckpt.verify(ck),
        "merge": lambda: zckpt.merge(ck, str(tmp_path / "out"), dtype="fp32"),
        "convert": lambda: zckpt.convert(ck, out=str(tmp_path / "out")),
        "reshard": lambda: zckpt.reshard(ck, str(tmp_path / "out"), world_size=8),
    }
    for name, call in calls.items():
        with pytest.raises(ZckptError) as err:
            call()
        assert re.search(message, str(err.value)) and "\n" not in str(err.value), (name, str(err.value))
        assert not (tmp_path / "out").exists(), name
    if case in ("rank-expert-files", "rank-files"):  # the CLI: exit 1, one line, no traceback
        for argv in (["info", ck], ["merge", ck, "-o", str(tmp_path / "out")]):
            proc = subprocess.run([sys.executable, "-m", "zckpt", *argv], capture_output=True, text=True,
                                  cwd=FIXTURES.parent, env={**os.environ, "PYTHONPATH": str(FIXTURES.parent)})
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 1 and len(lines) == 1 and re.search(message, lines[0]), proc.stderr
            assert not (tmp_path / "out").exists()


def test_flipped_byte_in_an_expert_moment_refused(tmp_path):
    """One byte of expert 5's exp_avg (layer moe2, ep 4) flipped in a copy: reshard and convert, which carry the
    moments, refuse it naming the file (its zip CRC-32), nothing written; verify --deep reports it."""
    copy = tmp_path / "ck"
    shutil.copytree(MIXED, copy, ignore=shutil.ignore_patterns("expected"))
    rec = zckpt.open_checkpoint(str(copy)).by_name()["moe2.deepspeed_moe.experts.deepspeed_experts.5.up.weight"]
    piece = rec.exp_avg[0]
    data = bytearray(Path(piece.path).read_bytes())
    data[piece.offset + 1] ^= 0x40
    Path(piece.path).write_bytes(bytes(data))
    for call in (lambda: zckpt.reshard(str(copy), str(tmp_path / "out"), world_size=8),
                 lambda: zckpt.convert(str(copy), out=str(tmp_path / "out"))):
        with pytest.raises(ZckptError) as err:
            call()
        assert Path(piece.path).name in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / "out").exists()
    report = zckpt.verify(str(copy), deep=True)
    assert not report.ok and any(Path(piece.path).name in c.detail for c in report.checks if not c.ok)
