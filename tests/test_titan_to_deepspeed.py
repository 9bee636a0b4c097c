"""A torchtitan run back to transformers names (issue 47 item 2, both directions): torchtitan 0.3.0's own
``CheckpointManager`` saves of its Qwen3 models (``fixtures/titan_qwen3_ws2``: MoE with fused q/k/v, its default;
MoE with split q/k/v; MoE with ``expert_bias_E``; dense, untied and tied; 2 CPU ranks, two AdamW steps in two groups) with the
transformers config the user states (``--hf-config``).

The oracle of every mapping is the two frameworks' own code, not zckpt's table: what torchtitan's model and
optimizer held at the save (``expected/<case>.safetensors``), its fused ``wqkv`` state split by torchtitan's own
``_split_qkv_on_save``, renamed by torchtitan's own ``Qwen3StateDictAdapter.to_hf`` (one tensor per expert), then
loaded by transformers 5's own ``from_pretrained`` (which fuses the experts into ``gate_up_proj`` /
``down_proj``): its ``state_dict()`` is the expected state under the class's names, for the weights and, each
loaded the same way, for ``exp_avg`` and ``exp_avg_sq``.

- ``merge --hf-config``: ``from_pretrained`` loads the output with no missing, unexpected or mismatched key, every
  tensor equal to the oracle (MoE fused and split q/k/v, dense untied and tied: lm_head is the embeddings).
- ``convert --to deepspeed --hf-config``: DeepSpeed 0.19.8 (the plain transformers class, no AutoEP; ZeRO-2 for
  the fused-qkv MoE and the dense saves, ZeRO-1 for the split and the tied ones; 2 gloo ranks, one launch,
  tests/moe_dcp_worker.py's ``deepspeed`` case, its groups built as torchtitan's were) loads it: every fp32 master,
  ``exp_avg`` and ``exp_avg_sq`` equal to the oracle, the bf16 weights their cast, step 2, torchtitan's group
  values; one step runs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import zckpt
from tests.conftest import FIXTURES
from zckpt.errors import InvalidArgument, UnsupportedLayout, ZckptError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TITAN = FIXTURES / "titan_qwen3_ws2"
KINDS = ("param", "exp_avg", "exp_avg_sq")
DS = {"moe": 2, "moe_split": 1, "dense": 2, "dense_tied": 1}  # the case -> the ZeRO stage DeepSpeed loads it at
# the dense runs' first group: their norms (the MoE runs': all but the experts)
FIRST_GROUP = {"dense": r"norm\.weight$", "dense_tied": r"norm\.weight$"}


def step(case: str) -> str:
    return str(TITAN / case / "checkpoint" / "step-2")


def config(case: str) -> str:
    return str(TITAN / "hf" / case / "config.json")


_ORACLE: dict = {}


def oracle(case: str, tmp: Path) -> dict:
    """{kind: {the class's name: tensor}}: what torchtitan held, through torchtitan's own split and to_hf, then
    transformers' own from_pretrained (which fuses the experts)."""
    if case in _ORACLE:
        return _ORACLE[case]
    from types import SimpleNamespace as NS
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(ROOT / "tests"))
    from moe_dcp_worker import _titan_kernels_stub
    _titan_kernels_stub()
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    info = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    d = info["dims"]
    held = load_file(str(TITAN / "expected" / f"{case}.safetensors"))
    cfg = NS(layers=[NS(moe=NS(num_experts=d["experts"]) if info["moe"] else None)] * d["layers"],
             enable_weight_tying=info.get("tied", False))
    hpk = d["heads"] // d["kv_heads"]
    out = {}
    for kind in KINDS:
        sd = {k.split("/", 1)[1]: v for k, v in held.items() if k.startswith(kind + "/")}
        for i in range(d["layers"]):
            FusedQKVLinear._split_qkv_on_save(NS(head_dim=d["head_dim"], heads_per_kv=hpk, r_dim=hpk + 2), sd,
                                              f"layers.{i}.attention.qkv_linear.", None)
        folder = tmp / f"oracle-{case}-{kind}"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in Qwen3StateDictAdapter(cfg, None).to_hf(sd).items()},
                  str(folder / "model.safetensors"))
        shutil.copy(config(case), folder / "config.json")
        model, li = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
        assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
        out[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _ORACLE[case] = out
    return out


def deepspeed_jobs(base: Path):
    """The saves (:data:`DS`: the case, its ZeRO stage) converted at 2 ranks, bf16, for DeepSpeed to load (in the
    session's one launch: tests/conftest.py's ``titan_deepspeed_loads``)."""
    results, cases = {}, []
    for case, stage in DS.items():
        results[case] = zckpt.convert(step(case), to="deepspeed", out=str(base / f"{case}.ds"), world_size=2,
                                      stage=stage, dtype="bf16", hf_config=config(case))
        cases.append({"mode": "deepspeed", "stage": stage, "config": str(TITAN / "hf" / case),
                      "ckpt": str(base / f"{case}.ds"), "out": str(base / "ds" / case),
                      "first_group": FIRST_GROUP.get(case)})
    return cases, (base / "ds", results)


@pytest.fixture(scope="module")
def deepspeed_loads(titan_deepspeed_loads):
    return titan_deepspeed_loads[__name__]


@pytest.mark.parametrize("case", list(DS))
def test_deepspeed_loads_a_torchtitan_run(deepspeed_loads, tmp_path, case):
    from safetensors.torch import load_file
    out, results = deepspeed_loads
    want = oracle(case, tmp_path)
    got = load_file(str(out / case / "deepspeed.safetensors"))
    info = json.loads((out / case / "deepspeed.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("fp32/")]
    assert sorted(names) == sorted(want["param"])  # (tied: lm_head.weight read through the embeddings' parameter)
    assert sum(n.endswith("gate_up_proj") for n in names) == (0 if case.startswith("dense") else 2)
    for name in names:
        for kind, key in zip(KINDS, ("fp32", "exp_avg", "exp_avg_sq")):
            assert torch.equal(got[f"{key}/{name}"], want[kind][name]), (kind, name)
        assert torch.equal(got[f"module/{name}"], want["param"][name].to(torch.bfloat16)), name
    titan = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    assert info["step"] == 2.0 and info["global_steps"] == 2 == titan["train_state"]["step"]
    assert [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in info["groups"]] == \
        [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in titan["groups"]]
    plan = results[case].plan
    assert set(plan.not_carried) == {"train_state.ntokens_seen", "lr_scheduler", "train_state.global_samples",
                                     "dataloader"}  # (torchtitan saved dataloader: None)
    assert any("param groups: torchtitan saves each parameter's group values" in n for n in plan.notes)
    assert json.loads((out / case / "after.json").read_text())["loss"] > 0  # one step ran


@pytest.mark.parametrize("case", ["moe", "moe_split", "dense", "dense_tied"])
def test_merge_loads_with_from_pretrained(tmp_path, case):
    from transformers import AutoModelForCausalLM
    res = zckpt.merge(step(case), str(tmp_path / "out"), hf_config=config(case))
    assert "config.json" in res.copied
    model, li = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert type(model).__name__ == ("Qwen3ForCausalLM" if case.startswith("dense") else "Qwen3MoeForCausalLM")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (case == "dense_tied")
    assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
    want = oracle(case, tmp_path)["param"]
    sd = model.state_dict()
    assert list(sd) == list(want)
    for name, t in sd.items():
        assert torch.equal(t, want[name]), name


def test_what_the_class_cannot_hold_is_said(tmp_path):
    """torchtitan's expert_bias_E (load_balance_coeff set) has no place in transformers' Qwen3-MoE: listed as not
    carried by convert, in a note by merge; the rest is written."""
    res = zckpt.convert(step("moe_bias"), to="deepspeed", out=str(tmp_path / "ds"), world_size=2, stage=2,
                        dtype="bf16", hf_config=config("moe_bias"), dry_run=True)
    bias = [k for k in res.plan.not_carried if k.endswith("expert_bias_E")]
    assert bias == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]
    assert "Qwen3MoeTopKRouter has none" in res.plan.not_carried[bias[0]]
    m = zckpt.merge(step("moe_bias"), str(tmp_path / "m"), hf_config=config("moe_bias"), dry_run=True)
    assert sum("not carried: layers." in n for n in m.notes) == 2
    assert not any("expert_bias" in t.name for s in m.plan.shards for t in s.tensors)


def test_refusals_in_one_line(tmp_path):
    """Without a config, carrying torchtitan's fused-qkv save's state is refused (pointing to --hf-config); a config of
    another shape or family, --hf-config where it does not apply: one line each, nothing written."""
    def refused(exc, match, call):
        with pytest.raises(exc, match=match) as e:
            call()
        assert "\n" not in str(e.value)
        return e.value
    e = refused(ZckptError, "is torchtitan.s fused-qkv attention.s", lambda: zckpt.convert(
        step("moe"), to="dcp", out=str(tmp_path / "g")))
    assert "--hf-config" in e.hint
    refused(ZckptError, "fused-qkv", lambda: zckpt.convert(step("moe"), to="deepspeed", out=str(tmp_path / "a"),
                                                           world_size=2, stage=2, dtype="bf16"))
    refused(UnsupportedLayout, "makes layer 0 a dense layer", lambda: zckpt.merge(step("moe"), str(tmp_path / "b"),
                                                                        hf_config=config("dense")))
    refused(UnsupportedLayout, "is tok_embeddings.weight .enable_weight_tying", lambda: zckpt.merge(
        step("dense_tied"), str(tmp_path / "b"), hf_config=config("dense")))
    refused(UnsupportedLayout, "is a weight of its own", lambda: zckpt.merge(
        step("dense"), str(tmp_path / "b"), hf_config=config("dense_tied")))
    cfg = json.loads(Path(config("moe")).read_text())
    for change, match in (({"num_key_value_heads": 1}, "q/k/v rows"), ({"model_type": "mixtral"}, "mixtral"),
                          ({"num_local_experts": 4}, "experts x moe_intermediate_size"),
                          ({"transformers_version": "4.57.1"}, "transformers 4.57.1")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.json"
        bad.write_text(json.dumps({**cfg, **change}))
        refused(UnsupportedLayout, match, lambda: zckpt.convert(step("moe"), to="deepspeed", out=str(tmp_path / "c"),
                                                                world_size=2, stage=2, dtype="bf16",
                                                                hf_config=str(bad)))
    refused(InvalidArgument, "--hf-config names the transformers class", lambda: zckpt.convert(
        step("moe"), out=str(tmp_path / "d"), hf_config=config("moe")))
    refused(InvalidArgument, "not a DCP folder", lambda: zckpt.merge(
        str(FIXTURES / "z2_bf16_ws2"), str(tmp_path / "e"), hf_config=config("moe")))
    refused(InvalidArgument, "no such file", lambda: zckpt.merge(step("moe"), str(tmp_path / "f"),
                                                                 hf_config=str(tmp_path / "none.json")))
    assert not any((tmp_path / x).exists() for x in "abcdefg")


def test_cli_exit_status(tmp_path):
    from click.testing import CliRunner
    from zckpt.cli import main
    r = CliRunner().invoke(main, ["convert", step("moe"), "--to", "dcp", "--hf-config", config("moe"), "-o",
                                  str(tmp_path / "o")])
    assert r.exit_code == 2 and "--hf-config" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["merge", step("dense"), "--hf-config", config("dense"), "-o", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3"


def test_a_model_only_save(tmp_path):
    """torchtitan's last step is saved model only by default (checkpoint.last_save_model_only): its top-level model
    keys, no optimizer. merge --hf-config writes it; convert --to deepspeed refuses it in one line."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    dcp_to_torch_save(step("moe"), str(tmp_path / "sd.pt"))
    sd = torch.load(tmp_path / "sd.pt", weights_only=False)
    torch.save({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}, tmp_path / "model.pt")
    torch_save_to_dcp(str(tmp_path / "model.pt"), str(tmp_path / "step-9"))
    with pytest.raises(UnsupportedLayout, match="holds the model only") as e:
        zckpt.convert(str(tmp_path / "step-9"), to="deepspeed", out=str(tmp_path / "ds"), world_size=2, stage=2,
                      dtype="bf16", hf_config=config("moe"))
    assert "\n" not in str(e.value) and not (tmp_path / "ds").exists()
    zckpt.merge(str(tmp_path / "step-9"), str(tmp_path / "m"), hf_config=config("moe"))
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = oracle("moe", tmp_path)["param"]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kv,hpk", [(1, 2), (2, 3), (4, 1)])
def test_fused_qkv_state_split_at_other_head_counts(tmp_path, kv, hpk):
    """The fused wqkv optimizer state split as torchtitan's _merge_qkv_on_load fused it (per key-value group: q's
    rows, k's, v's), at other head counts than the fixture's, from pieces cut mid-row: = wq / wk / wv."""
    from zckpt.dcp.titan_hf import _qkv_state
    from zckpt.encoding.tensors import Reader, load_pieces
    from zckpt.engine.segments import Piece
    hd, cols = 4, 6
    g = torch.Generator().manual_seed(kv * 10 + hpk)
    wq, wk, wv = (torch.randn(n * hd, cols, generator=g) for n in (kv * hpk, kv, kv))
    fused = torch.cat([wq.reshape(kv, hpk, hd, cols), wk.reshape(kv, 1, hd, cols), wv.reshape(kv, 1, hd, cols)],
                      dim=1).reshape(-1, cols)  # torchtitan's _merge_qkv_on_load
    path = tmp_path / "fused.bin"
    path.write_bytes(b"\0" * 12 + fused.numpy().tobytes())
    n = fused.numel()
    cuts = [0, 5, n // 2 + 1, n]  # pieces that end mid-row
    pieces = [Piece(str(path), 12 + 4 * a, b - a, "float32") for a, b in zip(cuts, cuts[1:])]
    parts = _qkv_state(pieces, [int(wq.shape[0]), int(wk.shape[0]), int(wv.shape[0])], kv, cols)
    with Reader(None) as reader:
        for want, got in zip((wq, wk, wv), parts):
            assert torch.equal(load_pieces(got, "float32", tuple(want.shape), reader), want)


def test_fused_qkv_save_read_as_saved_without_a_config(tmp_path):
    """torchtitan's default (fused-qkv) save, without --hf-config: info and verify read it (the fused state checked
    as saved: a flipped byte in it is found by verify --deep), merge writes its weights under torchtitan's names;
    only what would carry its optimizer state is refused, in one line, nothing written."""
    from click.testing import CliRunner
    from zckpt.cli import main
    notes = zckpt.info(step("moe")).to_dict()["notes"]
    assert any("fused-qkv attention in 2 layer(s)" in n for n in notes)
    assert not any("read as frozen" in n for n in notes)  # wq/wk/wv's state is the fused one, not none
    report = zckpt.verify(step("moe"), deep=True)
    assert report.ok and any(c.name == "steps agree" and "['2']" in c.detail for c in report.checks)
    m = zckpt.merge(step("moe"), str(tmp_path / "m"))
    assert "layers.0.attention.qkv_linear.wq.weight" in {t.name for s in m.plan.shards for t in s.tensors}
    for to, kw in (("dcp", {}), ("megatron", {}), ("deepspeed", dict(world_size=2, stage=2, dtype="bf16"))):
        with pytest.raises(ZckptError, match="fused-qkv") as e:
            zckpt.convert(step("moe"), to=to, out=str(tmp_path / to), **kw)
        assert "\n" not in str(e.value) and not (tmp_path / to).exists()
    res = CliRunner().invoke(main, ["diff", step("moe"), step("moe_split")])
    assert res.exit_code == 1 and "fused-qkv" in res.output  # the fused state: said not compared, not equal
    bad = Path(shutil.copytree(step("moe"), tmp_path / "bad"))
    ck = zckpt.open_checkpoint(str(bad))
    piece = ck.extra["fused_qkv"]["layers.1.attention.qkv_linear.wqkv.weight"]["exp_avg_sq"][0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset)
        byte = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not zckpt.verify(str(bad), deep=True).ok
