"""torchtitan's Llama 3 back to transformers' ``LlamaForCausalLM`` (issue 47 item 2): torchtitan 0.3.0's own
``CheckpointManager`` saves of its ``Llama3Model`` (``fixtures/titan_llama3_ws2``: fused q/k/v and untied, its
defaults; tied, its 1B/3B sizes; split q/k/v; 2 layers, 4 query heads in 2 key-value groups, 2 CPU ranks, two AdamW
steps in two groups) with the transformers config the user states (``--hf-config``).

torchtitan's Llama rotates interleaved pairs, transformers' halves: its ``Llama3StateDictAdapter.to_hf`` permutes
the rows of wq and wk per head. The oracle of every tensor is the two frameworks' own code: what torchtitan's model
and optimizer held at the save (``expected/<case>.safetensors``), its fused ``wqkv`` split by torchtitan's own
``_split_qkv_on_save``, through torchtitan's own ``Llama3StateDictAdapter.to_hf`` (the permutation), then loaded by
transformers' own ``from_pretrained``: its ``state_dict()`` is the expected state under the class's names, for the
weights and, each loaded the same way, for ``exp_avg`` and ``exp_avg_sq``.

- ``merge --hf-config``: ``from_pretrained`` loads the output with no missing, unexpected or mismatched key, every
  tensor equal to the oracle (q/k permuted: not equal to torchtitan's rows as they are).
- ``convert --to deepspeed --hf-config``: DeepSpeed 0.19.8 (plain ``LlamaForCausalLM``; ZeRO-2 for the fused save,
  ZeRO-1 for the tied and split ones; 2 gloo ranks, in the session's one torchtitan launch: tests/conftest.py's
  ``titan_deepspeed_loads``) loads it: every fp32 master, ``exp_avg`` and ``exp_avg_sq`` equal to the oracle, the
  bf16 weights their cast, step 2, torchtitan's group values; one step runs.
- ``permute_rows`` on pieces cut anywhere = torchtitan's ``_permute`` (1-4 heads, head sizes 2-8).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import zckpt
from tests.conftest import FIXTURES
from zckpt.errors import UnsupportedLayout

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TITAN = FIXTURES / "titan_llama3_ws2"
KINDS = ("param", "exp_avg", "exp_avg_sq")
DS = {"llama": 2, "llama_tied": 1, "llama_split": 1}  # the case -> the ZeRO stage DeepSpeed loads it at
CASES = ("llama", "llama_tied", "llama_split")


def step(case: str) -> str:
    return str(TITAN / case / "checkpoint" / "step-2")


def config(case: str) -> str:
    return str(TITAN / "hf" / case / "config.json")


def _adapter(info: dict):
    from types import SimpleNamespace as NS
    sys.path.insert(0, str(ROOT / "tests"))
    from moe_dcp_worker import _titan_kernels_stub
    _titan_kernels_stub()
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    d = info["dims"]
    cfg = NS(layers=[NS(attention=NS(n_heads=d["heads"], n_kv_heads=d["kv_heads"], head_dim=None))] * d["layers"],
             dim=d["dim"], enable_weight_tying=info["tied"])
    return Llama3StateDictAdapter(cfg, None)


def held(case: str) -> dict:
    """{kind: {torchtitan name: tensor}}: what torchtitan held at the save, the fused wqkv split by torchtitan."""
    from types import SimpleNamespace as NS
    from safetensors.torch import load_file
    _adapter(json.loads((TITAN / "expected" / f"{case}.json").read_text()))  # (torchtitan importable)
    from torchtitan.models.common.attention import FusedQKVLinear
    info = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    d = info["dims"]
    saved = load_file(str(TITAN / "expected" / f"{case}.safetensors"))
    hpk = d["heads"] // d["kv_heads"]
    out = {}
    for kind in KINDS:
        sd = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(kind + "/")}
        for i in range(d["layers"]):
            FusedQKVLinear._split_qkv_on_save(NS(head_dim=d["dim"] // d["heads"], heads_per_kv=hpk, r_dim=hpk + 2),
                                              sd, f"layers.{i}.attention.qkv_linear.", None)
        out[kind] = sd
    return out


_ORACLE: dict = {}


def oracle(case: str, tmp: Path) -> dict:
    """{kind: {the class's name: tensor}}: :func:`held` through torchtitan's own to_hf (q/k permuted), then
    transformers' own from_pretrained."""
    if case in _ORACLE:
        return _ORACLE[case]
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    info = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    out = {}
    for kind, sd in held(case).items():
        folder = tmp / f"oracle-{case}-{kind}"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in _adapter(info).to_hf(sd).items()}, str(folder / "model.safetensors"))
        shutil.copy(config(case), folder / "config.json")
        model, li = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
        assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
        out[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _ORACLE[case] = out
    return out


def deepspeed_jobs(base: Path):
    """The saves (:data:`DS`) converted at 2 ranks, bf16, for DeepSpeed to load in the session's one launch."""
    results, cases = {}, []
    for case, stage in DS.items():
        results[case] = zckpt.convert(step(case), to="deepspeed", out=str(base / f"{case}.ds"), world_size=2,
                                      stage=stage, dtype="bf16", hf_config=config(case))
        cases.append({"mode": "deepspeed", "stage": stage, "config": str(TITAN / "hf" / case),
                      "ckpt": str(base / f"{case}.ds"), "out": str(base / "ds" / case),
                      "first_group": r"norm\.weight$"})  # torchtitan's first group: its norms (the same set)
    return cases, (base / "ds", results)


@pytest.mark.parametrize("case", CASES)
def test_merge_loads_with_from_pretrained(tmp_path, case):
    from transformers import AutoModelForCausalLM
    res = zckpt.merge(step(case), str(tmp_path / "out"), hf_config=config(case))
    assert "config.json" in res.copied
    assert any("Llama 3 (q/k rows permuted as its to_hf does)" in n for n in res.notes), res.notes
    model, li = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (case == "llama_tied")
    assert not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"], li
    want = oracle(case, tmp_path)["param"]
    sd = model.state_dict()
    assert list(sd) == list(want)
    for name, t in sd.items():
        assert torch.equal(t, want[name]), name
    rows = held(case)["param"]
    for i in range(2):  # the permutation is not the identity here: torchtitan's rows as they are would be wrong
        for w, p in (("wq", "q_proj"), ("wk", "k_proj")):
            assert not torch.equal(rows[f"layers.{i}.attention.qkv_linear.{w}.weight"],
                                   sd[f"model.layers.{i}.self_attn.{p}.weight"])
        assert torch.equal(rows[f"layers.{i}.attention.qkv_linear.wv.weight"],
                           sd[f"model.layers.{i}.self_attn.v_proj.weight"])


@pytest.fixture(scope="module")
def deepspeed_loads(titan_deepspeed_loads):
    return titan_deepspeed_loads[__name__]


@pytest.mark.parametrize("case", list(DS))
def test_deepspeed_loads_a_torchtitan_llama(deepspeed_loads, tmp_path, case):
    from safetensors.torch import load_file
    out, results = deepspeed_loads
    want = oracle(case, tmp_path)
    got = load_file(str(out / case / "deepspeed.safetensors"))
    info = json.loads((out / case / "deepspeed.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("fp32/")]
    assert sorted(names) == sorted(want["param"])  # (tied: lm_head.weight read through the embeddings' parameter)
    for name in names:
        for kind, key in zip(KINDS, ("fp32", "exp_avg", "exp_avg_sq")):
            assert torch.equal(got[f"{key}/{name}"], want[kind][name]), (kind, name)
        assert torch.equal(got[f"module/{name}"], want["param"][name].to(torch.bfloat16)), name
    titan = json.loads((TITAN / "expected" / f"{case}.json").read_text())
    assert info["step"] == 2.0 and info["global_steps"] == 2 == titan["train_state"]["step"]
    assert [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in info["groups"]] == \
        [(g["lr"], g["weight_decay"], g["betas"], g["initial_lr"]) for g in titan["groups"]]
    assert len(titan["groups"][0]["names"]) == 5  # the norms: torchtitan's first group, DeepSpeed's first
    plan = results[case].plan
    assert set(plan.not_carried) == {"train_state.ntokens_seen", "lr_scheduler", "train_state.global_samples",
                                     "dataloader"}
    assert json.loads((out / case / "after.json").read_text())["loss"] > 0  # one step ran


def test_permute_rows_is_torchtitans_permute(tmp_path):
    """Pieces cut at arbitrary elements (mid-row, across files) permuted = torchtitan's own ``_permute``."""
    import numpy as np
    from zckpt.dcp.titan_llama import permute_rows
    from zckpt.engine.segments import Piece
    _adapter({"dims": {"heads": 1, "kv_heads": 1, "dim": 2, "layers": 1}, "tied": False})
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    rng = np.random.default_rng(5)
    for heads, head, cols in ((1, 2, 3), (2, 4, 5), (4, 8, 3), (2, 6, 1)):
        rows = heads * head
        n = rows * cols
        cuts = sorted(set(rng.integers(1, n, size=4).tolist()))
        bounds = [0, *cuts, n]
        pieces = []
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            f = tmp_path / f"p{heads}-{k}.bin"
            f.write_bytes(b"\0" * 12 + np.arange(a, b, dtype=np.float32).tobytes())  # (at an offset)
            pieces.append(Piece(str(f), 12, b - a, "float32"))
        got = np.concatenate([np.fromfile(p.path, np.float32, p.numel, offset=p.offset)
                              for p in permute_rows(pieces, heads, rows, cols)])
        want = Llama3StateDictAdapter._permute(None, torch.arange(n, dtype=torch.float32).reshape(rows, cols), heads)
        assert np.array_equal(got, want.reshape(-1).numpy()), (heads, head, cols)


def test_refusals_in_one_line(tmp_path):
    """A config of the other family (Qwen3's q_norm; none in Llama) or of another shape: one line, nothing written."""
    def refused(match, call):
        with pytest.raises(UnsupportedLayout, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    qwen3 = FIXTURES / "titan_qwen3_ws2"
    cfg = json.loads(Path(config("llama")).read_text())
    as_qwen3 = tmp_path / "qwen3.json"  # Qwen3's class at the Llama save's shapes
    as_qwen3.write_text(json.dumps({**cfg, "model_type": "qwen3"}))
    refused("has no attention.q_norm .torchtitan's Llama 3", lambda: zckpt.merge(step("llama"), str(tmp_path / "a"),
                                                                               hf_config=str(as_qwen3)))
    q = json.loads((qwen3 / "hf" / "dense" / "config.json").read_text())
    as_llama = tmp_path / "llama.json"  # Llama's class at the Qwen3 save's shapes
    as_llama.write_text(json.dumps({**cfg, **{k: q[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                 "head_dim")}}))
    refused("has attention.q_norm .torchtitan's Qwen3", lambda: zckpt.convert(
        str(qwen3 / "dense" / "checkpoint" / "step-2"), to="deepspeed", out=str(tmp_path / "b"), world_size=2,
        stage=2, dtype="bf16", hf_config=str(as_llama)))
    refused("vocab_size x hidden_size", lambda: zckpt.merge(str(qwen3 / "dense" / "checkpoint" / "step-2"),
                                                            str(tmp_path / "b"), hf_config=config("llama")))
    for change, match in (({"num_key_value_heads": 4}, "q/k/v rows"), ({"intermediate_size": 64}, "intermediate"),
                          ({"tie_word_embeddings": True}, "is a weight of its own")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.json"
        bad.write_text(json.dumps({**cfg, **change}))
        refused(match, lambda: zckpt.merge(step("llama"), str(tmp_path / "c"), hf_config=str(bad)))
    assert not any((tmp_path / x).exists() for x in "abc")
