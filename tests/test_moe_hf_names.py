"""Merge of an AutoEP checkpoint under the names and fusion of the transformers class it was made from (issue 47).

``fixtures/moe_autoep_z3_bf16_ws4_ep2_l2`` (a random tiny ``Qwen3MoeForCausalLM``, AutoEP at ZeRO-3) and
``moe_autoep_z2_bf16_ws4_ep4_l2`` (``MixtralForCausalLM``, ZeRO-2) were saved by DeepSpeed 0.19.8 with the model's
``config.json`` beside ``latest`` (``fixtures/gen_autoep.py``, ``save_config``). ``zckpt merge`` writes
``experts.gate_up_proj`` / ``experts.down_proj`` / ``mlp.gate.weight``; the oracle is transformers itself:
``AutoModelForCausalLM.from_pretrained`` of the output reports no missing, unexpected or mismatched key, and every
tensor equals the live engine's master (``expected/oracle.safetensors``), ``gate_up_proj`` being AutoEP's w1 (gate)
then w3 (up) per expert, as ``deepspeed/moe/ep_repack.py`` split it. Without a config.json saying the class, or
with another model type, AutoEP's names are kept and a note says why.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from tests.conftest import FIXTURES, checkpoint_path
from tests.test_merge import _merged

L2 = [FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2", FIXTURES / "moe_autoep_z2_bf16_ws4_ep4_l2"]
DEEPSEEK = [FIXTURES / "moe_autoep_z2_bf16_ws4_ep2_dsv3", FIXTURES / "moe_autoep_z3_bf16_ws2_ep2_dsv3",
            FIXTURES / "moe_autoep_z2_bf16_ws2_ep2_dsv2"]
QWEN35 = FIXTURES / "moe_autoep_z2_bf16_ws2_ep2_qwen35"
CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "deepseek_v2": "DeepseekV2ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


def autoep_name(name: str) -> str:
    """AutoEP's name of a parameter the class and AutoEP's layer name alike but for Qwen3.5's shared expert and its
    gate (the class's ``shared_expert(_gate)``, AutoEP's layer's ``shared_experts(_gate)``)."""
    return re.sub(r"\.shared_expert(_gate)?\.", lambda m: f".shared_experts{m.group(1) or ''}.", name)


def _want(fx: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    fp = load_file(str(fx / "expected" / "oracle.safetensors"))
    if name.endswith(".experts.gate_up_proj"):
        mp = name[:-len(".gate_up_proj")]
        t = torch.cat([fp[f"fp32/{mp}.w1"], fp[f"fp32/{mp}.w3"]], dim=1)
    elif name.endswith(".experts.down_proj"):
        t = fp[f"fp32/{name[:-len('down_proj')]}w2"]
    elif name.endswith(".mlp.gate.weight"):
        t = fp[f"fp32/{name[:-len('gate.weight')]}router.gate.weight"]
    elif name.endswith(".mlp.gate.e_score_correction_bias"):  # DeepSeek-V3's router buffer, on AutoEP's router
        t = fp[f"buffer/{name[:-len('gate.e_score_correction_bias')]}router.e_score_correction_bias"]
        assert torch.count_nonzero(t), name  # random in the fixture: the class's init (zeros) would not pass
    else:  # (Qwen3.5's shared_expert and its gate: AutoEP's layer holds them as shared_experts(_gate))
        t = fp[f"fp32/{autoep_name(name)}"]
    return t.to(dtype)


@pytest.mark.parametrize("fx,dtype", [(L2[0], "fp32"), (L2[1], "bf16"), (DEEPSEEK[0], "bf16"), (DEEPSEEK[1], "fp32"),
                                      (DEEPSEEK[2], "bf16"), (QWEN35, "bf16")],
                         ids=["qwen3_moe-zero3", "mixtral-zero2", "deepseek_v3-zero2", "deepseek_v3-zero3",
                              "deepseek_v2-zero2", "qwen3_5_moe-zero2"])
def test_from_pretrained_loads_the_merge_exactly(tmp_path, fx, dtype):
    from transformers import AutoModelForCausalLM

    arch = json.loads((fx / "expected" / "oracle.json").read_text())["arch"]
    res = zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype=dtype)
    assert any("names and fused experts" in n for n in res.notes)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == {"qwen3_5_moe": "qwen3_5_moe_text"}.get(arch, arch)  # (Qwen3.5: its text backbone)
    assert cfg["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    target = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True, dtype=target)
    assert type(model).__name__ == CLASS[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd = model.state_dict()
    assert set(sd) == set(_merged(tmp_path / "out"))
    assert sum(".experts.gate_up_proj" in n for n in sd) == 2  # both MoE layers
    assert sum(".shared_experts." in n for n in sd) == (6 if arch.startswith("deepseek") else 0)
    assert sum(".shared_expert" in n for n in sd) == (8 if arch == "qwen3_5_moe" else 6 if "deepseek" in arch else 0)
    assert sum(n.endswith("e_score_correction_bias") for n in sd) == (2 if arch == "deepseek_v3" else 0)
    keep = {"deepseek_v3": (".mlp.gate.weight", ".e_score_correction_bias"), "deepseek_v2": (".mlp.gate.weight",)}
    stored = _merged(tmp_path / "out")
    for name, t in sd.items():  # DeepSeek's class keeps gate.weight (and V3's bias) in fp32: written so, exact
        kept = name.endswith(keep.get(arch, ()))
        assert stored[name].dtype == (torch.float32 if kept else target), name
        assert torch.equal(t, _want(fx, name, torch.float32 if kept else target).to(t.dtype)), name
    assert sum("kept in fp32" in n for n in res.notes) == (dtype != "fp32" and arch in keep)


def test_autoep_names_kept_where_the_class_is_not_said(tmp_path):
    fx = L2[0]
    res = zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "native"), native_names=True)
    assert "model.layers.1.mlp.experts.w3" in _merged(tmp_path / "native") and not res.notes
    copy = tmp_path / "ck"
    shutil.copytree(fx, copy, ignore=shutil.ignore_patterns("expected"))
    (copy / "config.json").unlink()
    res = zckpt.merge(str(copy), str(tmp_path / "noconfig"))
    got = _merged(tmp_path / "noconfig")
    assert "model.layers.0.mlp.experts.w1" in got and "model.layers.0.mlp.experts.gate_up_proj" not in got
    assert any("AutoEP names kept" in n and "no config.json" in n for n in res.notes)
    assert not (tmp_path / "noconfig" / "config.json").exists()
    cfg = json.loads((fx / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe"}))
    res = zckpt.merge(str(copy), str(tmp_path / "other"))
    assert "model.layers.0.mlp.router.gate.weight" in _merged(tmp_path / "other")
    assert any("model_type 'qwen3_5_moe'" in n for n in res.notes)


@pytest.mark.parametrize("fx,change,text", [
    (DEEPSEEK[2], {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
     "layer model.layers.1.mlp holds no router.e_score_correction_bias, which the model class has"),
    (DEEPSEEK[0], {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]},
     "layer model.layers.1.mlp holds model.layers.1.mlp.router.e_score_correction_bias"),
    (DEEPSEEK[0], {"first_k_dense_replace": 0},
     "the checkpoint's MoE layers are [1, 2], {cfg} makes DeepseekV3ForCausalLM's [0, 1, 2]"),
    (DEEPSEEK[0], {"n_routed_experts": 16},
     "layer model.layers.1.mlp holds 8 experts of intermediate size 8, {cfg} says n_routed_experts 16"),
], ids=["v2-save-as-v3", "v3-save-as-v2", "dense-layers", "experts"])
def test_deepseek_names_where_the_save_and_config_json_disagree(tmp_path, fx, change, text):
    """What the class would need and the save does not hold (V3's router bias), what the save holds and the class
    has no place for, MoE layers or experts other than config.json's: AutoEP's names kept with a note saying which,
    nothing invented (merge and convert --to dcp alike)."""
    copy = tmp_path / "ck"
    shutil.copytree(fx, copy, ignore=shutil.ignore_patterns("expected"))
    cfg = json.loads((fx / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    text = text.format(cfg=copy / "config.json")
    res = zckpt.merge(str(copy), str(tmp_path / "m"))
    assert "model.layers.1.mlp.router.gate.weight" in _merged(tmp_path / "m")
    assert not (tmp_path / "m" / "config.json").exists()
    assert any(n.startswith("AutoEP names kept") and text in n for n in res.notes), (text, res.notes)
    conv = zckpt.convert(str(copy), out=str(tmp_path / "c"), dry_run=True)
    assert any(n.startswith("AutoEP names kept") and text in n for n in conv.plan.notes), conv.plan.notes
