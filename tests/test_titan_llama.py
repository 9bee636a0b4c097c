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
- ``permute_rows`` on pieces cut anywhere = torchtitan's ``_permute`` and ``_reverse_permute`` (1-4 heads, head
  sizes 2-8).
- The other way, ``convert --to dcp --layout torchtitan`` of a DeepSpeed checkpoint of transformers'
  ``LlamaForCausalLM`` (the HF Trainer fixtures ``trainer``: ZeRO-2, tied, 2 heads in 1 key-value group, head size
  8; ``trainer_z3``: ZeRO-3, untied, 4 heads in 2 groups; their ``config.json`` says ``llama``): torchtitan's own
  ``Llama3Model`` (fused and split q/k/v) loads it with its ``CheckpointManager`` at 2 ranks
  (tests/titan_llama_load_worker.py, one launch), every weight, ``exp_avg``, ``exp_avg_sq`` equal to torchtitan's
  own ``from_hf`` (and ``_merge_qkv_on_load``) of DeepSpeed's own view at the save (``expected/oracle``), step 4,
  the source's group values, ``last_epoch`` = its ``scheduler.pt``'s, ``train_state`` as stated.
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
    from zckpt.state.titan_llama import permute_rows
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
        back = np.concatenate([np.fromfile(p.path, np.float32, p.numel, offset=p.offset)
                               for p in permute_rows(pieces, heads, rows, cols, reverse=True)])
        want = Llama3StateDictAdapter._reverse_permute(None, torch.arange(n, dtype=torch.float32).reshape(rows, cols),
                                                       heads)
        assert np.array_equal(back, want.reshape(-1).numpy()), (heads, head, cols)


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


# the other way: DeepSpeed checkpoints of transformers' LlamaForCausalLM (HF Trainer runs, config.json beside) ->
# --layout torchtitan -> torchtitan's own Llama3Model + CheckpointManager.load. (source, fuse_qkv of the model loading)
TO_TITAN = {"trainer_fused": ("trainer", True), "z3_fused": ("trainer_z3", True), "z3_split": ("trainer_z3", False)}


@pytest.fixture(scope="module")
def titan_loads(tmp_path_factory):
    """Each source converted with ``--layout torchtitan`` (ntokens_seen stated), loaded by torchtitan at 2 ranks in
    one launch (tests/titan_llama_load_worker.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    base = tmp_path_factory.mktemp("to-titan")
    results, cases = {}, []
    for case, (src, fuse) in TO_TITAN.items():
        if src not in results:  # (both models of one source load the same files)
            results[src] = zckpt.convert(str(FIXTURES / src / "checkpoint-4"), to="dcp", layout="torchtitan",
                                         out=str(base / src / "checkpoint" / "step-4"), torchtitan={"ntokens_seen": 96})
        cases.append({"config": str(FIXTURES / src / "checkpoint-4" / "config.json"), "base": str(base / src),
                      "step": 4, "out": str(base / f"{case}-loaded"), "fuse_qkv": fuse})
    job = base / "job.json"
    job.write_text(json.dumps({"cases": cases}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
           str(ROOT / "tests" / "titan_llama_load_worker.py"), str(job)]
    proc = ds_oracle.run_torchrun(cmd, G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(base)}), 600)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]
    return base, results


def titan_oracle(src: str, fuse: bool) -> dict:
    """{kind: {torchtitan name: tensor}}: DeepSpeed's own view of the source at its save (``expected/oracle``:
    safe_get_full_fp32_param / _optimizer_state) through torchtitan's own ``Llama3StateDictAdapter.from_hf`` (the
    reverse permutation), fused by its own ``_merge_qkv_on_load`` where the model fuses q/k/v."""
    from types import SimpleNamespace as NS
    from safetensors.torch import load_file
    hf = json.loads((FIXTURES / src / "checkpoint-4" / "config.json").read_text())
    kv = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    hd = hf["hidden_size"] // hf["num_attention_heads"]
    _adapter({"dims": {"heads": 1, "kv_heads": 1, "dim": 2, "layers": 1}, "tied": False})  # (torchtitan importable)
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    attn = NS(n_heads=hf["num_attention_heads"], n_kv_heads=kv, head_dim=None,
              rope=ComplexRoPE.Config(dim=hd, max_seq_len=64))
    cfg = NS(layers=[NS(attention=attn)] * hf["num_hidden_layers"], dim=hf["hidden_size"],
             enable_weight_tying=bool(hf.get("tie_word_embeddings")))
    saved = load_file(str(FIXTURES / src / "expected" / "oracle.safetensors"))
    out = {}
    for kind, key in zip(KINDS, ("fp32", "exp_avg", "exp_avg_sq")):
        sd = Llama3StateDictAdapter(cfg, None).from_hf({k.split("/", 1)[1]: v for k, v in saved.items()
                                                        if k.startswith(key + "/")})
        if fuse:
            for i in range(hf["num_hidden_layers"]):
                FusedQKVLinear._merge_qkv_on_load(NS(head_dim=hd, heads_per_kv=hf["num_attention_heads"] // kv), sd,
                                                  f"layers.{i}.attention.qkv_linear.")
        out[kind] = sd
    return out


@pytest.mark.parametrize("case", list(TO_TITAN))
def test_torchtitan_loads_a_deepspeed_llama(titan_loads, case):
    from safetensors.torch import load_file
    base, results = titan_loads
    src, fuse = TO_TITAN[case]
    want = titan_oracle(src, fuse)
    got = load_file(str(base / f"{case}-loaded.safetensors"))
    info = json.loads((base / f"{case}-loaded.json").read_text())
    hf = json.loads((FIXTURES / src / "checkpoint-4" / "config.json").read_text())
    names = [k.split("/", 1)[1] for k in got if k.startswith("param/")]
    assert sum(n.endswith(".wqkv.weight") for n in names) == (hf["num_hidden_layers"] if fuse else 0)
    for name in names:
        for kind in KINDS:
            assert torch.equal(got[f"{kind}/{name}"], want[kind][name]), (kind, name)
        assert got[f"step/{name}"].tolist() == [4.0], name
    if not fuse:  # the permutation is not the identity: the class's rows as they are would be wrong
        from safetensors.torch import load_file as lf
        fp32 = lf(str(FIXTURES / src / "expected" / "oracle.safetensors"))
        assert not torch.equal(got["param/layers.0.attention.qkv_linear.wq.weight"],
                               fp32["fp32/model.layers.0.self_attn.q_proj.weight"])
    assert info["tied"] == bool(hf.get("tie_word_embeddings"))
    source = json.loads((FIXTURES / src / "expected" / "oracle.json").read_text())["param_groups"] \
        if (FIXTURES / src / "expected" / "oracle.json").exists() else None
    norms = [g for g in info["groups"] if all("norm" in n for n in g["names"])]
    rest = [g for g in info["groups"] if g not in norms]
    assert len(norms) == len(rest) == 1 and norms[0]["betas"] != [0.5, 0.6] != rest[0]["betas"]
    if source is not None:  # the source's group values, not the worker's wrong ones
        assert (norms[0]["weight_decay"], rest[0]["weight_decay"]) == (source[1]["weight_decay"],
                                                                      source[0]["weight_decay"])
    assert norms[0]["weight_decay"] != 0.5 and rest[0]["weight_decay"] != 0.7 and norms[0]["lr"] != 99.0
    sched = torch.load(FIXTURES / src / "checkpoint-4" / "scheduler.pt", weights_only=True)
    assert info["last_epoch"] == sched["last_epoch"]
    assert info["train_state"] == {"step": 4, "ntokens_seen": 96}
    plan = results[src].plan
    assert plan.carried[0] == "model (top-level keys, torchtitan Llama 3's names)"


def test_to_titan_refusals_in_one_line(tmp_path):
    """A Llama whose config's heads do not make q/k's rows, or whose head size is not hidden / heads (torchtitan's
    Llama 3 has no other): one line, nothing written."""
    from zckpt.errors import UnsupportedLayout
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "trainer_z3" / "checkpoint-4", src)
    cfg = json.loads((src / "config.json").read_text())
    for change, match in (({"num_key_value_heads": 1}, "rows do not make 1 heads"),
                          ({"num_attention_heads": 8, "head_dim": 2}, "k_proj.weight: 8 rows do not make 2 heads of 2"),
                          ({"head_dim": 8}, "torchtitan's Llama 3 has heads of hidden_size / heads")):
        (src / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(UnsupportedLayout, match=match) as e:
            zckpt.convert(str(src), to="dcp", layout="torchtitan", out=str(tmp_path / "out"),
                          torchtitan={"ntokens_seen": 0})
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
