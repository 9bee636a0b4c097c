"""torchtitan 0.3.0's DeepSeek-V3 both ways (issue 47 item 2): zckpt.state.titan_dsv3's table (torchtitan's
DeepSeekV3StateDictAdapter.from_hf_map) used by ``--hf-config`` (a torchtitan save under DeepseekV3ForCausalLM's
names) and by ``convert --to dcp --layout torchtitan`` (an AutoEP DeepSeek-V3 run under torchtitan's names).

The oracles are the frameworks' own code, never zckpt's table:

- torchtitan -> transformers / DeepSpeed: ``fixtures/titan_dsv3_ws2`` (torchtitan's own DeepSeekV3Model, its
  OptimizersContainer and CheckpointManager at 2 CPU ranks; ``dsv3``: q_lora_rank 16, ``dsv3_q``: 0). What
  torchtitan held at the save, renamed by torchtitan's own ``DeepSeekV3StateDictAdapter.to_hf`` (one tensor per
  expert; ``expert_bias_E`` -> ``e_score_correction_bias``), then loaded by transformers' own ``from_pretrained``
  (which fuses the experts): the expected state, for the weights and, each loaded the same way, the moments.
  ``merge --hf-config`` loads with no missing / unexpected / mismatched key, every tensor equal; ``convert --to
  deepspeed --hf-config`` (ZeRO-2, 2 ranks, bf16) is loaded by DeepSpeed 0.19.8 over the plain class: every master,
  ``exp_avg``, ``exp_avg_sq`` and the router bias equal, step 2, torchtitan's group values; one step runs.
- AutoEP -> torchtitan: ``moe_autoep_z2_bf16_ws4_ep2_dsv3`` / ``moe_autoep_z3_bf16_ws2_ep2_dsv3`` converted with
  ``--layout torchtitan`` and loaded by torchtitan's own DeepSeekV3Model (load_balance_coeff set, so it has
  ``expert_bias_E``), OptimizersContainer and ``CheckpointManager.load`` at 2 ranks: every parameter, moment, step
  and ``expert_bias_E`` equal to the DeepSpeed engine's (``expected/oracle.safetensors``) renamed by torchtitan's own
  ``DeepSeekV3StateDictAdapter.from_hf`` (AutoEP's experts split per expert as transformers names them).

One torchrun of 2 gloo ranks does every framework load (tests/moe_dcp_worker.py).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import zckpt
from tests.conftest import FIXTURES, checkpoint_path
from zckpt.errors import UnsupportedLayout

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TITAN = FIXTURES / "titan_dsv3_ws2"
CASES = ("dsv3", "dsv3_q")
AUTOEP = {"zero2": FIXTURES / "moe_autoep_z2_bf16_ws4_ep2_dsv3", "zero3": FIXTURES / "moe_autoep_z3_bf16_ws2_ep2_dsv3"}
KINDS = ("param", "exp_avg", "exp_avg_sq")


def step(case: str) -> str:
    return str(TITAN / case / "checkpoint" / "step-2")


def config(case: str) -> str:
    return str(TITAN / "hf" / case / "config.json")


def _adapter(dims: dict):
    sys.path.insert(0, str(ROOT / "tests"))
    from moe_dcp_worker import _titan_kernels_stub
    _titan_kernels_stub()
    from titan_dsv3_build import dsv3_config
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    return DeepSeekV3StateDictAdapter(dsv3_config(dims), None)


_ORACLE: dict = {}


def oracle(case: str, tmp: Path) -> dict:
    """{kind: {the class's name: tensor}}: what torchtitan held, through torchtitan's own to_hf, then transformers'
    own from_pretrained (which fuses the experts). The moments' files carry the buffers' values (no state)."""
    if case in _ORACLE:
        return _ORACLE[case]
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    info = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    held = load_file(str(TITAN / "expected" / f"{case}.safetensors"))
    adapter = _adapter(info["dims"])
    buffers = {k.split("/", 1)[1]: v for k, v in held.items() if k.endswith("expert_bias_E")}  # (the persistent)
    out = {}
    for kind in KINDS:
        sd = {**buffers, **{k.split("/", 1)[1]: v for k, v in held.items() if k.startswith(kind + "/")}}
        folder = tmp / f"oracle-{case}-{kind}"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in adapter.to_hf(sd).items()}, str(folder / "model.safetensors"))
        shutil.copy(config(case), folder / "config.json")
        model, li = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
        assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
        out[kind] = {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    _ORACLE[case] = out
    return out


def autoep_oracle(fx: Path) -> dict:
    """{kind: {torchtitan's name: tensor}}: the DeepSpeed engine's state (AutoEP's names: experts.w1 = gate,
    w3 = up, w2 = down [E, ...]; the router under router.) under transformers' per-expert names, renamed by
    torchtitan's own DeepSeekV3StateDictAdapter.from_hf (which stacks the experts back)."""
    from safetensors.torch import load_file
    sys.path.insert(0, str(ROOT / "tests"))
    from titan_dsv3_build import DIMS
    want = load_file(str(fx / "expected" / "oracle.safetensors"))
    adapter = _adapter(DIMS)
    out = {}
    for kind, key in zip(KINDS, ("fp32", "exp_avg", "exp_avg_sq")):
        hf = {}
        src = {k.split("/", 1)[1]: v for k, v in want.items() if k.startswith(key + "/")}
        if kind == "param":
            src.update({k.split("/", 1)[1]: v for k, v in want.items() if k.startswith("buffer/")})
        for name, t in src.items():
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.experts\.(w[123])", name)
            if m:
                proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[m.group(2)]
                hf.update({f"{m.group(1)}.experts.{e}.{proj}.weight": t[e] for e in range(t.shape[0])})
            else:
                hf[name.replace(".mlp.router.gate.weight", ".mlp.gate.weight").replace(
                    ".mlp.router.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")] = t
        out[kind] = adapter.from_hf(hf)
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of 2 gloo ranks: DeepSpeed (ZeRO-2, the plain class) loads both torchtitan saves converted with
    --hf-config; torchtitan's DeepSeekV3Model + CheckpointManager loads both AutoEP fixtures converted with --layout
    torchtitan."""
    from tests.test_moe_dcp import _torchrun
    sys.path.insert(0, str(ROOT / "tests"))
    from titan_dsv3_build import DIMS
    base = tmp_path_factory.mktemp("titan-dsv3")
    results, cases = {}, []
    for case in CASES:
        results[case] = zckpt.convert(step(case), to="deepspeed", out=str(base / f"{case}.ds"), world_size=2,
                                      stage=2, dtype="bf16", hf_config=config(case))
        cases.append({"mode": "deepspeed", "stage": 2, "config": str(TITAN / "hf" / case),
                      "ckpt": str(base / f"{case}.ds"), "out": str(base / "ds" / case)})
    for name, fx in AUTOEP.items():
        results[name] = zckpt.convert(str(checkpoint_path(fx)), out=str(base / name / "ckpt" / "step-2"),
                                      layout="torchtitan", torchtitan={"ntokens_seen": 64, "initial_lr": 0.01,
                                                                      "lr_last_epoch": 2})
        cases.append({"mode": "titan", "family": "deepseek_v3", "base": str(base / name), "step": 2, "dims": DIMS,
                      "out": str(base / "titan" / name)})
    _torchrun({"deepspeed": True, "cases": cases})
    return base, results


@pytest.mark.parametrize("case", CASES)
def test_info_and_verify_read_torchtitans_save(case):
    """Every expert once with its state and its router (torchtitan's GroupedExperts names), the expert_bias_E
    buffers read, every byte's CRC checked."""
    moe = zckpt.info(step(case)).to_dict()["moe"]
    assert moe["layers"] == 2
    report = zckpt.verify(step(case), deep=True)
    assert report.ok
    checks = {c.name: c.detail for c in report.checks}
    assert "2 layers x 8 experts" in checks["MoE experts"] and "2 routers" in checks["MoE experts"]


@pytest.mark.parametrize("case", CASES)
def test_merge_under_torchtitans_names(tmp_path, case):
    from safetensors.torch import load_file
    zckpt.merge(step(case), str(tmp_path / "m"))
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    held = load_file(str(TITAN / "expected" / f"{case}.safetensors"))
    want = {k.split("/", 1)[1]: v for k, v in held.items() if k.startswith("param/") or k.endswith("expert_bias_E")}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case", CASES)
def test_merge_with_hf_config_loads_with_from_pretrained(tmp_path, case):
    from transformers import AutoModelForCausalLM
    res = zckpt.merge(step(case), str(tmp_path / "out"), hf_config=config(case))
    assert "config.json" in res.copied and any("DeepSeek-V3 table" in n for n in res.notes)
    model, li = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
    want = oracle(case, tmp_path)["param"]
    sd = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    assert list(sd) == list(want)
    assert sum(k.endswith("e_score_correction_bias") for k in sd) == 2
    for name, t in sd.items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("case", CASES)
def test_deepspeed_loads_torchtitans_deepseek_v3(launched, tmp_path, case):
    from safetensors.torch import load_file
    base, results = launched
    out = base / "ds" / case
    want = oracle(case, tmp_path)
    got = load_file(str(out / "deepspeed.safetensors"))
    info = json.loads((out / "deepspeed.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("fp32/")]
    bufs = [k.split("/", 1)[1] for k in got if k.startswith("buffer/") and "rotary_emb" not in k]
    assert sorted(names + bufs) == sorted(want["param"])
    assert sum(n.endswith("gate_up_proj") for n in names) == 2 and len(bufs) == 2
    for name in names:
        for kind, key in zip(KINDS, ("fp32", "exp_avg", "exp_avg_sq")):
            assert torch.equal(got[f"{key}/{name}"], want[kind][name]), (kind, name)
        assert torch.equal(got[f"module/{name}"], want["param"][name].to(torch.bfloat16)), name
    for name in bufs:  # the router's e_score_correction_bias = torchtitan's expert_bias_E (not the class's zeros)
        assert torch.count_nonzero(want["param"][name]) and torch.equal(got[f"buffer/{name}"], want["param"][name])
    titan = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    assert info["step"] == 2.0 and info["global_steps"] == 2 == titan["train_state"]["step"]
    assert [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in info["groups"]] == \
        [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in titan["groups"]]
    assert "lr_scheduler" in results[case].plan.not_carried
    assert not any("expert_bias" in k for k in results[case].plan.not_carried)
    assert json.loads((out / "after.json").read_text())["loss"] > 0  # one step ran


@pytest.mark.parametrize("name", list(AUTOEP))
def test_torchtitan_loads_autoep_deepseek_v3(launched, name):
    from safetensors.torch import load_file
    base, results = launched
    plan = results[name].plan
    assert set(plan.not_carried) >= {"tokens_per_expert_E"} and "expert_bias_E" not in plan.not_carried
    assert any("torchtitan deepseek_v3 names" in n for n in plan.notes)
    want = autoep_oracle(AUTOEP[name])
    got = load_file(str(base / "titan" / name / "titan.safetensors"))
    info = json.loads((base / "titan" / name / "titan.json").read_text())
    params = [k.split("/", 1)[1] for k in got if k.startswith("param/")]
    assert sorted(params + [k.split("/", 1)[1] for k in got if k.startswith("buffer/")]) == sorted(want["param"])
    assert sum(".inner_experts.w" in n for n in params) == 6 and sum(".shared_experts." in n for n in params) == 6
    for n in params:
        for kind in KINDS:
            assert torch.equal(got[f"{kind}/{n}"], want[kind][n]), (kind, n)
        assert got[f"step/{n}"].tolist() == [2.0], n
    for i in (1, 2):  # the router bias, DeepSpeed's buffer (not torchtitan's zeros)
        n = f"layers.{i}.moe.expert_bias_E"
        assert torch.count_nonzero(want["param"][n]) and torch.equal(got[f"buffer/{n}"], want["param"][n])
    assert all((g["lr"], g["weight_decay"], g["initial_lr"]) == (0.01, 0.01, 0.01) for g in info["groups"])
    assert info["last_epoch"] == 2 and info["train_state"] == {"step": 2, "ntokens_seen": 64}
    assert zckpt.verify(str(base / name / "ckpt" / "step-2")).ok


def test_a_config_of_another_shape_is_refused(tmp_path):
    """A DeepSeek-V3 config that would not hold the save (another q_lora_rank, dense layers, experts): one line,
    nothing written; the CLI exits 1 without a traceback."""
    from click.testing import CliRunner
    from zckpt.cli import main
    cfg = json.loads(Path(config("dsv3")).read_text())
    for change, match in (({"q_lora_rank": None}, "attention.wq.weight"), ({"first_k_dense_replace": 0},
                                                                           "moe.routed_experts"),
                          ({"n_routed_experts": 4}, "w1_EFD"), ({"transformers_version": "4.57.1"}, "4.57.1")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.json"
        bad.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(UnsupportedLayout, match=match) as e:
            zckpt.merge(step("dsv3"), str(tmp_path / "o"), hf_config=str(bad))
        assert "\n" not in str(e.value) and not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["convert", step("dsv3"), "--to", "deepspeed", "--world-size", "2", "--stage", "2",
                                  "--dtype", "bf16", "--hf-config", config("dsv3_q"), "-o", str(tmp_path / "c")])
    assert r.exit_code == 1 and "wq.weight" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "c").exists()


def test_merge_bf16_keeps_what_the_class_keeps_in_fp32(tmp_path):
    """merge --dtype bf16: the router's gate.weight and e_score_correction_bias, which DeepseekV3ForCausalLM keeps in
    fp32 at any dtype (_keep_in_fp32_modules_strict), are written in fp32 (torchtitan's values exactly), the rest
    rounded to bf16; from_pretrained in bf16 holds what the files hold."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    res = zckpt.merge(step("dsv3"), str(tmp_path / "m"), dtype="bf16", hf_config=config("dsv3"))
    assert any("4 tensor(s) kept in fp32" in n for n in res.notes)
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = oracle("dsv3", tmp_path)["param"]
    kept = sorted(k for k, v in got.items() if v.dtype == torch.float32)
    assert kept == sorted(f"model.layers.{i}.mlp.gate.{w}" for i in (1, 2) for w in ("weight", "e_score_correction_bias"))
    for k, v in got.items():
        assert torch.equal(v, want[k] if k in kept else want[k].to(torch.bfloat16)), k
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], got[k]) for k in got)


def test_a_save_without_expert_bias_is_refused(tmp_path):
    """torchtitan built with load_balance_coeff None saves no expert_bias_E; the class's router has its
    e_score_correction_bias buffer: refused in one line (not written with that buffer missing), nothing written."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    dcp_to_torch_save(step("dsv3_q"), str(tmp_path / "sd.pt"))
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    sd = {k: v for k, v in sd.items() if not k.endswith("expert_bias_E")}
    torch.save(sd, tmp_path / "nobias.pt")
    torch_save_to_dcp(str(tmp_path / "nobias.pt"), str(tmp_path / "step-2"))
    for call in (lambda: zckpt.merge(str(tmp_path / "step-2"), str(tmp_path / "m"), hf_config=config("dsv3_q")),
                 lambda: zckpt.convert(str(tmp_path / "step-2"), to="deepspeed", out=str(tmp_path / "d"),
                                       world_size=2, stage=2, dtype="bf16", hf_config=config("dsv3_q"))):
        with pytest.raises(UnsupportedLayout, match="holds no moe.expert_bias_E") as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()
    # torchtitan's multi-token-prediction layers: the class builds none (refused, not dropped)
    torch.save({**sd, "mtp_layers.0.enorm.weight": torch.ones(16)}, tmp_path / "mtp.pt")
    torch_save_to_dcp(str(tmp_path / "mtp.pt"), str(tmp_path / "step-3"))
    with pytest.raises(UnsupportedLayout, match="mtp_layers.0.enorm.weight' is torchtitan's multi-token-prediction"):
        zckpt.merge(str(tmp_path / "step-3"), str(tmp_path / "m"), hf_config=config("dsv3_q"))


def test_cli_layout_torchtitan_of_autoep_deepseek_v3(tmp_path):
    """The CLI writes it (exit 0; was refused, exit 1), and zckpt reads its own output back under torchtitan's
    names: every expert once, the router bias among the model's tensors."""
    from click.testing import CliRunner
    from zckpt.cli import main
    out = tmp_path / "step-2"
    r = CliRunner().invoke(main, ["convert", str(checkpoint_path(AUTOEP["zero2"])), "--to", "dcp", "--layout",
                                  "torchtitan", "--ntokens-seen", "0", "--lr-last-epoch", "2", "--initial-lr", "0.01",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    names = {rec.name for rec in zckpt.open_checkpoint(str(out)).records}
    assert {"layers.1.moe.expert_bias_E", "layers.2.moe.shared_experts.w2.weight", "layers.0.attention.wq_a.weight",
            "layers.0.feed_forward.w1.weight"} <= names
    assert zckpt.info(str(out)).to_dict()["moe"]["layers"] == 2
