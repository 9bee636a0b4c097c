"""MoE state across frameworks (issue 47 item 2): DeepSpeed AutoEP <-> DCP under the names and fusion of the
transformers class the run trains, loaded by the real frameworks bit for bit.

DeepSpeed AutoEP -> DCP: ``fixtures/moe_autoep_z2_bf16_ws4_ep4_l2`` (Mixtral, ZeRO-2, ep 4),
``moe_autoep_z3_bf16_ws4_ep2_l2`` (Qwen3-MoE, ZeRO-3, ep 2), ``moe_autoep_z2_bf16_ws4_ep2_dsv3`` /
``moe_autoep_z3_bf16_ws2_ep2_dsv3`` (DeepSeek-V3, ZeRO-2 / ZeRO-3, ep 2: a dense first layer, a shared expert, the
router's ``e_score_correction_bias`` buffer, which FSDP2 must load equal to the engine's) and
``moe_autoep_z2_bf16_ws2_ep2_dsv2`` (DeepSeek-V2), ``moe_autoep_z2_bf16_ws2_ep2_qwen35`` (Qwen3.5-MoE's text
backbone, ``shared_expert`` and ``shared_expert_gate``), each 2 MoE layers x 8 experts, top-2, saved by DeepSpeed
0.19.8 with the model's ``config.json``. ``zckpt convert --to dcp`` writes ``experts.gate_up_proj`` (w1 then w3 per
expert), ``experts.down_proj`` and ``mlp.gate.weight`` with their fp32 masters, both moments and steps. The oracle is
FSDP2 itself (tests/moe_dcp_worker.py, one torchrun of 2 gloo ranks): the transformers class built from the
fixture's config.json, ``fully_shard`` per decoder layer, AdamW in two groups, ``dcp.load`` + ``set_state_dict``;
every parameter, ``exp_avg``, ``exp_avg_sq`` and ``step`` must equal the live DeepSpeed engine's
(``expected/oracle.safetensors``: ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), and one
optimizer step runs.

FSDP2 -> DeepSpeed: ``fixtures/fsdp2_moe_mixtral_ws2`` / ``fsdp2_moe_qwen3_ws2`` (a real FSDP2 run's ``dcp.save``,
fixtures/gen_fsdp2_moe.py) -> ``convert --to deepspeed`` -> DeepSpeed 0.19.8 (the same transformers class, no
AutoEP) at ZeRO-2 and ZeRO-1 loads it: masters and moments equal FSDP2's full state bit for bit. ``merge`` of the
DCP loads with ``from_pretrained``; the coverage check runs on such DCPs (a fused tensor's experts are its shape).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import zckpt
from tests.conftest import FIXTURES, checkpoint_path
from tests.test_moe_hf_names import autoep_name
from zckpt.errors import CorruptFile, IncompleteCheckpoint, InvalidArgument

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
AUTOEP = {"mixtral": FIXTURES / "moe_autoep_z2_bf16_ws4_ep4_l2",
          "qwen3_moe": FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2",
          # a dense first layer, shared experts, MLA; V3's router e_score_correction_bias (a buffer)
          "deepseek_v3-zero2": FIXTURES / "moe_autoep_z2_bf16_ws4_ep2_dsv3",
          "deepseek_v3-zero3": FIXTURES / "moe_autoep_z3_bf16_ws2_ep2_dsv3",
          "deepseek_v2": FIXTURES / "moe_autoep_z2_bf16_ws2_ep2_dsv2",
          # Qwen3.5-MoE's text backbone: gated delta net, a shared expert AutoEP keeps as its shared_experts
          "qwen3_5_moe": FIXTURES / "moe_autoep_z2_bf16_ws2_ep2_qwen35"}
FSDP2 = {"mixtral": FIXTURES / "fsdp2_moe_mixtral_ws2", "qwen3_moe": FIXTURES / "fsdp2_moe_qwen3_ws2"}
DS_STAGE = {"mixtral": 2, "qwen3_moe": 1}


def _torchrun(job: dict, nproc: int = 2, timeout: int = 600) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    with tempfile.TemporaryDirectory(prefix="zckpt-moe-dcp-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(ROOT / "tests" / "moe_dcp_worker.py"), str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]


def _load(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


TITAN_DIMS = {"vocab": 32, "dim": 16, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 8, "moe_hidden": 8,
              "experts": 8, "top_k": 2}  # the Qwen3-MoE fixture's config.json, as torchtitan's Qwen3 config


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of 2 gloo ranks (``deepspeed.init_distributed``, the default group FSDP2 and torchtitan use too):
    both AutoEP fixtures converted to DCP, loaded by FSDP2; the Qwen3-MoE one converted with ``--layout
    torchtitan``, loaded by torchtitan's Qwen3 MoE model (fused qkv and not) and CheckpointManager; both FSDP2 MoE
    fixtures converted to DeepSpeed (ZeRO-2 / ZeRO-1 at 2 ranks), loaded by DeepSpeed."""
    base = tmp_path_factory.mktemp("moe-dcp")
    cases, results = [], {}
    for arch, fx in AUTOEP.items():
        res = zckpt.convert(str(checkpoint_path(fx)), out=str(base / f"{arch}.dcp"))
        results[arch] = res
        cases.append({"mode": "load", "config": str(fx), "dcp": str(base / f"{arch}.dcp"), "out": str(base / arch)})
    results["titan"] = zckpt.convert(str(checkpoint_path(AUTOEP["qwen3_moe"])), out=str(base / "ckpt" / "step-2"),
                                     layout="torchtitan", torchtitan={"ntokens_seen": 64, "initial_lr": 0.01,
                                                                      "lr_last_epoch": 2})
    for fuse in (True, False):
        cases.append({"mode": "titan", "base": str(base), "step": 2, "dims": TITAN_DIMS, "fuse_qkv": fuse,
                      "out": str(base / f"titan-fused{int(fuse)}"), "save_step": 4 - int(fuse)})
    for arch, fx in FSDP2.items():
        zckpt.convert(str(fx / "dcp"), to="deepspeed", out=str(base / f"{arch}.ds"), world_size=2,
                      stage=DS_STAGE[arch], dtype="bf16")
        cases.append({"mode": "deepspeed", "stage": DS_STAGE[arch], "config": str(fx / "dcp"),
                      "ckpt": str(base / f"{arch}.ds"), "out": str(base / "ds" / arch)})
    # AutoEP -> DCP (the class's names) -> DeepSpeed without AutoEP: a run leaving AutoEP for plain DeepSpeed
    zckpt.convert(str(base / "mixtral.dcp"), to="deepspeed", out=str(base / "autoep-plain.ds"), world_size=2,
                  stage=2, dtype="bf16")
    cases.append({"mode": "deepspeed", "stage": 2, "config": str(AUTOEP["mixtral"]),
                  "ckpt": str(base / "autoep-plain.ds"), "out": str(base / "ds" / "autoep-plain")})
    # ... and DeepSeek-V3 (its router bias a buffer, which the DCP does not mark as one: named with --buffers)
    zckpt.convert(str(base / "deepseek_v3-zero2.dcp"), to="deepspeed", out=str(base / "dsv3-plain.ds"), world_size=2,
                  stage=2, dtype="bf16", buffers="*.e_score_correction_bias")
    cases.append({"mode": "deepspeed", "stage": 2, "config": str(AUTOEP["deepseek_v3-zero2"]),
                  "ckpt": str(base / "dsv3-plain.ds"), "out": str(base / "ds" / "dsv3-plain")})
    _torchrun({"deepspeed": True, "cases": cases})
    return base, results


@pytest.fixture(scope="module")
def fsdp2_loads(launched):
    return launched


@pytest.fixture(scope="module")
def deepspeed_loads(launched):
    return launched[0] / "ds"


@pytest.mark.parametrize("arch", list(AUTOEP))
def test_fsdp2_loads_autoep_under_the_model_names(fsdp2_loads, arch):
    base, results = fsdp2_loads
    fx = AUTOEP[arch]
    assert any("names and fused experts, with the optimizer state" in n for n in results[arch].plan.notes)
    want = _load(fx / "expected" / "oracle.safetensors")
    oracle = json.loads((fx / "expected" / "oracle.json").read_text())
    got = _load(base / arch / "loaded.safetensors")
    info = json.loads((base / arch / "loaded.json").read_text())

    def engine(kind: str, name: str):
        if name.endswith(".experts.gate_up_proj"):
            mp = name[:-len(".gate_up_proj")]
            return torch.cat([want[f"{kind}/{mp}.w1"], want[f"{kind}/{mp}.w3"]], dim=1)
        if name.endswith(".experts.down_proj"):
            return want[f"{kind}/{name[:-len('down_proj')]}w2"]
        if name.endswith(".mlp.gate.weight"):
            return want[f"{kind}/{name[:-len('gate.weight')]}router.gate.weight"]
        return want[f"{kind}/{autoep_name(name)}"]  # (Qwen3.5's shared_expert(_gate): AutoEP's shared_experts(_gate))

    names = [k.split("/", 1)[1] for k in got if k.startswith("param/")]
    assert sum(n.endswith(".experts.gate_up_proj") for n in names) == 2 and len(names) == len(oracle["trainable"]) - 2  # (w1 + w3: one)
    buffers = [k.split("/", 1)[1] for k in got if k.startswith("buffer/")]  # DeepSeek-V3's router bias
    assert len(buffers) == len(oracle["buffers"]) == (2 if arch.startswith("deepseek_v3") else 0)
    for name in buffers:
        t = want[f"buffer/{name[:-len('gate.e_score_correction_bias')]}router.e_score_correction_bias"]
        assert torch.count_nonzero(t) and torch.equal(got[f"buffer/{name}"], t), name  # (the class inits zeros)
    for name in names:
        assert torch.equal(got[f"param/{name}"], engine("fp32", name)), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{kind}/{name}"], engine(kind, name)), (kind, name)
        assert got[f"step/{name}"].tolist() == [float(oracle["step"])], name
    dense, experts = info["groups"]
    assert all(".experts." in n for n in experts["names"]) and len(experts["names"]) == 4
    assert "model.layers.1.mlp.gate.weight" in dense["names"]
    for g in (dense, experts):  # DeepSpeed's hyperparameters, not the wrong ones the job built the optimizer with
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.01, [0.9, 0.95], 1e-8, 0.01), g
    first = 1 if arch.startswith("deepseek") else 0  # DeepSeek's first layer is dense (first_k_dense_replace)
    assert f"optim.state.model.layers.{first}.mlp.experts.gate_up_proj.exp_avg" in info["target_keys"]
    after = json.loads((base / arch / "after.json").read_text())
    assert after["loss"] == after["loss"] and all(after["moved"].values()), after  # one step ran: finite, moved


# torchtitan 0.3.0's Qwen3 names -> the source's (written out from its Qwen3StateDictAdapter.from_hf_map; AutoEP's
# fused experts and router for the MoE): the oracle's names, independent of zckpt's table
TITAN_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
TITAN_LAYER = {"attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
               "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
               "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
               "attention.wo.weight": "self_attn.o_proj.weight", "attention.q_norm.weight": "self_attn.q_norm.weight",
               "attention.k_norm.weight": "self_attn.k_norm.weight", "attention_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight",
               "moe.routed_experts.inner_experts.w1_EFD": "mlp.experts.w1",
               "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.w2",
               "moe.routed_experts.inner_experts.w3_EFD": "mlp.experts.w3",
               "moe.router.gate.weight": "mlp.router.gate.weight"}


def _titan_source(name: str) -> list[str]:
    """The source names a torchtitan Qwen3 parameter is made of (a fused wqkv: wq, wk, wv)."""
    if name.endswith(".qkv_linear.wqkv.weight"):
        return [n for w in ("wq", "wk", "wv") for n in _titan_source(name.replace("wqkv", w))]
    if name in TITAN_TOP:
        return [TITAN_TOP[name]]
    _, layer, rest = name.split(".", 2)
    return [f"model.layers.{layer}.{TITAN_LAYER[rest]}"]


@pytest.mark.parametrize("fused", [True, False], ids=["fuse_qkv", "split_qkv"])
def test_torchtitan_loads_autoep_qwen3_under_its_names(fsdp2_loads, fused):
    """torchtitan 0.3.0's own Qwen3 MoE model and CheckpointManager load the AutoEP Qwen3-MoE checkpoint: every
    parameter, exp_avg, exp_avg_sq and step equal to the DeepSpeed engine's (GroupedExperts w1_EFD/w2_EDF/w3_EFD =
    AutoEP's w1/w2/w3, router.gate = AutoEP's router; a fused wqkv's = wq/wk/wv per key-value group, as torchtitan's
    _merge_qkv_on_load fuses them), the lr of each group DeepSpeed's, last_epoch and train_state as stated."""
    base, results = fsdp2_loads
    fx = AUTOEP["qwen3_moe"]
    plan = results["titan"].plan
    assert "expert_bias_E" in plan.not_carried and any("torchtitan qwen3_moe names" in n for n in plan.notes)
    want = _load(fx / "expected" / "oracle.safetensors")
    got = _load(base / f"titan-fused{int(fused)}" / "titan.safetensors")
    info = json.loads((base / f"titan-fused{int(fused)}" / "titan.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("param/")]
    assert sum(".inner_experts.w" in n for n in names) == 6 and sum(".router.gate." in n for n in names) == 2
    assert sum(n.endswith("wqkv.weight") for n in names) == (2 if fused else 0)
    for name in names:
        src = _titan_source(name)
        for kind, key in (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            parts = [want[f"{kind}/{s}"] for s in src]
            if len(parts) == 3:  # per key-value group g: q rows, k rows, v rows (kv_heads 1 here: one group)
                kv, hd = TITAN_DIMS["kv_heads"], TITAN_DIMS["head_dim"]
                parts = [torch.cat([p.reshape(kv, -1, hd, p.shape[1]) for p in parts], 1).reshape(-1, parts[0].shape[1])]
            assert torch.equal(got[f"{key}/{name}"], parts[0]), (kind, name)
        assert got[f"step/{name}"].tolist() == [2.0], name
    assert all((g["lr"], g["weight_decay"], g["initial_lr"]) == (0.01, 0.01, 0.01) for g in info["groups"])
    assert info["last_epoch"] == 2 and info["train_state"] == {"step": 2, "ntokens_seen": 64}
    # zckpt reads its own output back (the fused wqkv's state is the split keys' twin): experts checked, verified
    assert zckpt.verify(str(base / "ckpt" / "step-2")).ok
    assert zckpt.info(str(base / "ckpt" / "step-2")).to_dict()["moe"]["layers"] == 2


def test_torchtitan_layout_of_a_model_torchtitan_does_not_have(tmp_path):
    from zckpt.errors import UnsupportedLayout
    with pytest.raises(UnsupportedLayout, match="torchtitan 0.3.0 has no mixtral model") as e:
        zckpt.convert(str(checkpoint_path(AUTOEP["mixtral"])), out=str(tmp_path / "o"), layout="torchtitan",
                      torchtitan={"ntokens_seen": 0, "initial_lr": 0.01, "lr_last_epoch": 2})
    assert "--layout dcp" in str(e.value.hint) and not (tmp_path / "o").exists()


def test_torchtitan_layout_of_a_model_zckpt_has_no_torchtitan_table_of(tmp_path):
    """Qwen3.5-MoE: torchtitan 0.3.0 has the model (models/qwen3_5), zckpt no table of its names: refused in one
    line saying so (not that torchtitan lacks it), nothing written. (DeepSeek-V3's: tests/test_titan_dsv3.py.)"""
    from zckpt.errors import UnsupportedLayout
    with pytest.raises(UnsupportedLayout, match="no table of torchtitan 0.3.0's qwen3_5_moe_text names") as e:
        zckpt.convert(str(checkpoint_path(AUTOEP["qwen3_5_moe"])), out=str(tmp_path / "o"), layout="torchtitan",
                      torchtitan={"ntokens_seen": 0, "initial_lr": 0.01, "lr_last_epoch": 2})
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


def test_autoep_names_where_the_class_is_not_said(tmp_path):
    """Without config.json: DeepSpeed's names and a note (as merge); native_names keeps them without one; a
    checkpoint with no AutoEP layer refuses native_names (it would do nothing)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    fx = AUTOEP["mixtral"]
    copy = tmp_path / "ck"
    shutil.copytree(fx, copy, ignore=shutil.ignore_patterns("expected"))
    (copy / "config.json").unlink()
    res = zckpt.convert(str(copy), out=str(tmp_path / "noconfig"))
    assert any("AutoEP names kept" in n and "no config.json" in n for n in res.plan.notes), res.plan.notes
    res2 = zckpt.convert(str(checkpoint_path(fx)), out=str(tmp_path / "native"), native_names=True)
    assert not any("AutoEP names kept" in n or "fused experts" in n for n in res2.plan.notes)
    for out in ("noconfig", "native"):
        dcp_to_torch_save(str(tmp_path / out), str(tmp_path / f"{out}.pt"))
        sd = torch.load(tmp_path / f"{out}.pt", weights_only=False)
        assert "model.layers.1.mlp.experts.w3" in sd["model"] and "model.layers.1.mlp.experts.w3" in sd["optim"][
            "state"] and not any("gate_up_proj" in k for k in sd["model"])
    with pytest.raises(InvalidArgument, match="--native-names applies to a Megatron-Core source or an AutoEP"):
        zckpt.convert(str(checkpoint_path(FIXTURES / "z2_bf16_ws2")), out=str(tmp_path / "o"), native_names=True)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch", list(FSDP2))
def test_deepspeed_loads_an_fsdp2_moe_run(deepspeed_loads, arch):
    fx = FSDP2[arch]
    want = _load(fx / "expected" / "oracle.safetensors")
    oracle = json.loads((fx / "expected" / "oracle.json").read_text())
    got = _load(deepspeed_loads / arch / "deepspeed.safetensors")
    info = json.loads((deepspeed_loads / arch / "deepspeed.json").read_text())
    assert sum(k.endswith(".experts.gate_up_proj") for k in want) == 6  # 2 layers x (fp32, exp_avg, exp_avg_sq)
    for key, t in want.items():
        assert torch.equal(got[key], t), key
    for name in (k.split("/", 1)[1] for k in want if k.startswith("fp32/")):
        assert torch.equal(got[f"module/{name}"], want[f"fp32/{name}"].to(torch.bfloat16)), name
    assert info["step"] == oracle["step"][0] == 2.0 and info["global_steps"] == 2
    assert [(g["lr"], g["weight_decay"]) for g in info["groups"]] == [(0.01, 0.01), (0.01, 0.0)]
    assert json.loads((deepspeed_loads / arch / "after.json").read_text())["loss"] > 0  # one step ran


@pytest.mark.parametrize("arch,case,n", [("mixtral", "autoep-plain", 21), ("deepseek_v3-zero2", "dsv3-plain", 45)])
def test_deepspeed_without_autoep_loads_the_autoep_run_through_dcp(deepspeed_loads, arch, case, n):
    """AutoEP Mixtral (ZeRO-2, ep 4, 4 ranks) and DeepSeek-V3 (ZeRO-2, ep 2, 4 ranks) -> DCP under the class's names
    -> convert --to deepspeed (ZeRO-2, 2 ranks) -> DeepSpeed with the plain transformers class loads every master
    and moment equal to the AutoEP engine's (gate_up_proj = w1 then w3 per expert), step 2; DeepSeek-V3's router
    e_score_correction_bias is the engine's buffer."""
    want = _load(AUTOEP[arch] / "expected" / "oracle.safetensors")
    got = _load(deepspeed_loads / case / "deepspeed.safetensors")
    info = json.loads((deepspeed_loads / case / "deepspeed.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("fp32/")]
    assert len(names) == n and sum(n.endswith("gate_up_proj") for n in names) == 2
    buffers = [k.split("/", 1)[1] for k in got if k.startswith("buffer/") and "e_score" in k]
    assert len(buffers) == (2 if arch.startswith("deepseek_v3") else 0)
    for name in buffers:
        t = want[f"buffer/{name[:-len('gate.e_score_correction_bias')]}router.e_score_correction_bias"]
        assert torch.count_nonzero(t) and torch.equal(got[f"buffer/{name}"], t), name
    for name in names:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            if name.endswith(".experts.gate_up_proj"):
                mp = name[:-len(".gate_up_proj")]
                t = torch.cat([want[f"{kind}/{mp}.w1"], want[f"{kind}/{mp}.w3"]], dim=1)
            elif name.endswith(".experts.down_proj"):
                t = want[f"{kind}/{name[:-len('down_proj')]}w2"]
            elif name.endswith(".mlp.gate.weight"):
                t = want[f"{kind}/{name[:-len('gate.weight')]}router.gate.weight"]
            else:
                t = want[f"{kind}/{name}"]
            assert torch.equal(got[f"{kind}/{name}"], t), (kind, name)
    assert info["step"] == 2.0 and info["global_steps"] == 2


@pytest.mark.parametrize("arch", list(FSDP2))
def test_merge_of_an_fsdp2_moe_run_loads_with_from_pretrained(tmp_path, arch):
    from transformers import AutoModelForCausalLM
    fx = FSDP2[arch]
    res = zckpt.merge(str(fx / "dcp"), str(tmp_path / "out"))
    assert any("config.json copied from the DCP folder" in n for n in res.notes)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert type(model).__name__ == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want = _load(fx / "expected" / "oracle.safetensors")
    sd = model.state_dict()
    assert sum(n.endswith(".experts.down_proj") for n in sd) == 2
    for name, t in sd.items():
        assert torch.equal(t, want[f"fp32/{name}"]), name


def _damaged(tmp_path: Path, change) -> Path:
    """The Mixtral FSDP2 DCP read by torch, changed, written back by torch (``torch_save_to_dcp``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    dcp_to_torch_save(str(FSDP2["mixtral"] / "dcp"), str(tmp_path / "sd.pt"))
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    change(sd)
    torch.save(sd, tmp_path / "bad.pt")
    torch_save_to_dcp(str(tmp_path / "bad.pt"), str(tmp_path / "bad"))
    return tmp_path / "bad"


def test_coverage_of_an_fsdp2_moe_dcp(tmp_path):
    """info / verify report layers x experts (whole fused tensors: counted by their shape); an expert cut off, a
    fused tensor or a router deleted is refused by every command naming the layer."""
    d = zckpt.info(str(FSDP2["qwen3_moe"] / "dcp")).to_dict()
    assert d["moe"]["layers"] == 2 and d["moe"]["experts"] == 8 and d["moe"]["whole"] and d["moe"]["checked"]
    assert d["moe"]["each_expert_has"] == ["value", "exp_avg", "exp_avg_sq"]
    assert zckpt.verify(str(FSDP2["qwen3_moe"] / "dcp")).ok
    mp = "model.layers.1.mlp"

    def cut(sd):  # expert 7 dropped from gate_up_proj (its value and both moments)
        sd["model"][f"{mp}.experts.gate_up_proj"] = sd["model"][f"{mp}.experts.gate_up_proj"][:7].clone()
        st = sd["optim"]["state"][f"{mp}.experts.gate_up_proj"]
        st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"][:7].clone(), st["exp_avg_sq"][:7].clone()

    def drop(key):
        def change(sd):
            del sd["model"][key]
            sd["optim"]["state"].pop(key, None)
            for g in sd["optim"]["param_groups"]:
                g["params"] = [p for p in g["params"] if p != key]
        return change

    for i, (change, err, text) in enumerate([
            (cut, CorruptFile, f"MoE layer 1 ({mp}): '{mp}.experts.gate_up_proj' holds 7 experts, the layer 8"),
            (drop(f"{mp}.experts.down_proj"), IncompleteCheckpoint,
             f"MoE layer 1 ({mp}): the experts' '{mp}.experts.down_proj' is missing"),
            (drop(f"{mp}.gate.weight"), IncompleteCheckpoint, f"MoE layer 1 ({mp}): no router")]):
        (tmp_path / str(i)).mkdir()
        bad = str(_damaged(tmp_path / str(i), change))
        for command in (lambda: zckpt.info(bad), lambda: zckpt.verify(bad),
                        lambda: zckpt.merge(bad, str(tmp_path / "m")),
                        lambda: zckpt.convert(bad, to="deepspeed", out=str(tmp_path / "c"), world_size=2, stage=2,
                                              dtype="bf16")):
            with pytest.raises(err) as e:
                command()
            assert text in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("kv,hpk", [(2, 2), (4, 1), (1, 3)])
def test_fused_qkv_optimizer_state_at_other_head_counts(tmp_path, kv, hpk):
    """The fused ``wqkv`` state at key-value group counts the fixture does not have (it has one): the pieces
    zckpt lays out equal torchtitan 0.3.0's ``_merge_qkv_on_load`` (attention.py) applied to wq / wk / wv:
    ``cat([wq.reshape(n_kv, hpk, hd, H), wk.reshape(n_kv, 1, hd, H), wv.reshape(n_kv, 1, hd, H)], 1)``, each
    rank's flat partition boundaries anywhere (the source pieces are cut at odd places)."""
    import numpy as np
    from zckpt.dcp.titan import _fused_qkv
    from zckpt.engine.segments import Piece
    from zckpt.engine.torchzip import TensorOut
    hd, H = 4, 6
    g = torch.Generator().manual_seed(kv * 10 + hpk)
    ts = {"wq": torch.randn(kv * hpk * hd, H, generator=g), "wk": torch.randn(kv * hd, H, generator=g),
          "wv": torch.randn(kv * hd, H, generator=g)}
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"".join(t.numpy().tobytes() for t in ts.values()))
    flat, offset, prefix = {}, 0, "layers.0.attention.qkv_linear."
    for w, t in ts.items():
        n, cut = t.numel(), t.numel() // 3 + 1  # two pieces per tensor, cut mid-row
        segs = [Piece(str(raw), offset, cut, "float32"), Piece(str(raw), offset + 4 * cut, n - cut, "float32")]
        offset += 4 * n
        for key in ("exp_avg", "exp_avg_sq"):
            flat[f"state.{prefix}{w}.weight.{key}"] = TensorOut("float32", tuple(t.shape), segs)
        flat[f"state.{prefix}{w}.weight.step"] = 7.0
        flat[f"param_groups.{prefix}{w}.weight.lr"] = 0.5
    _fused_qkv(flat, prefix, kv)
    out = flat[f"state.{prefix}wqkv.weight.exp_avg"]
    data = np.fromfile(raw, dtype=np.float32)
    got = np.concatenate([data[p.offset // 4:p.offset // 4 + p.numel] for p in out.segments]).reshape(out.shape)
    q, k, v = ts["wq"].reshape(kv, hpk, hd, H), ts["wk"].reshape(kv, 1, hd, H), ts["wv"].reshape(kv, 1, hd, H)
    want = torch.cat([q, k, v], dim=1).reshape(-1, H)
    assert out.shape == tuple(want.shape) and torch.equal(torch.from_numpy(got), want)
    assert flat[f"state.{prefix}wqkv.weight.step"] == 7.0 and flat[f"param_groups.{prefix}wqkv.weight.lr"] == 0.5


def test_torchtitan_own_moe_saves_read(fsdp2_loads):
    """torchtitan's own saves of its Qwen3 MoE model (CheckpointManager.save after the load above): with split qkv
    (step-4) zckpt reads every expert, master and moment equal to what torchtitan loaded, the coverage checked; with
    torchtitan's fused qkv (step-3) info and verify read it as saved, and carrying its optimizer state (under wqkv
    alone) is refused in one line (how its rows split into q, k and v needs the head size, which the files do not
    hold)."""
    from zckpt.errors import ZckptError
    base, _ = fsdp2_loads
    split = str(base / "ckpt" / "step-4")
    d = zckpt.info(split).to_dict()
    assert d["moe"]["layers"] == 2 and d["moe"]["experts"] == 8 and d["moe"]["whole"]
    loaded = _load(base / "titan-fused0" / "titan.safetensors")
    got = dict(zckpt.iter_tensors(split))
    assert set(got) == {k.split("/", 1)[1] for k in loaded if k.startswith("param/")}
    for name, t in got.items():
        assert torch.equal(t, loaded[f"param/{name}"]), name
    assert zckpt.verify(split, deep=True).ok
    fused = str(base / "ckpt" / "step-3")  # read and checked as saved; its state not carried without a config
    assert any("fused-qkv attention in 2 layer(s)" in n for n in zckpt.info(fused).to_dict()["notes"])
    assert zckpt.verify(fused, deep=True).ok
    with pytest.raises(ZckptError, match="is torchtitan.s fused-qkv attention.s") as e:
        zckpt.convert(fused, to="dcp", out=str(base / "fused-out"))
    assert "\n" not in str(e.value) and not (base / "fused-out").exists()


def test_coverage_of_other_families_routers(tmp_path):
    """gpt-oss names its router ``mlp.router`` (and keeps biases beside the fused experts): its DCP (a one-process
    ``dcp.save`` of ``get_state_dict`` after an AdamW step) is read with both layers' experts and routers checked,
    not refused for want of ``mlp.gate``; with layer 1's router deleted it is refused, its other layer having one."""
    import warnings

    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import get_state_dict
    cfg = transformers.GptOssConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=8,
                                    num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32, (2, 5))
    model(ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
        for key in ("model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.bias"):  # the whole router
            del msd[key]
            osd["state"].pop(key)
            for g in osd["param_groups"]:
                g["params"] = [p for p in g["params"] if p != key]
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    moe = zckpt.info(str(tmp_path / "ok")).to_dict()["moe"]
    assert (moe["layers"], moe["experts"], moe["routers"], moe["whole"]) == (2, 8, 2, True)
    with pytest.raises(IncompleteCheckpoint, match=r"MoE layer 1 \(model.layers.1.mlp\): no router "
                                                   r"\('model.layers.1.mlp.router.\*'\)"):
        zckpt.info(str(tmp_path / "bad"))
