"""Megatron-Core ``torch_dist`` checkpoints (fixtures/megatron: written by megatron-core 0.16.1, with the tensors
Megatron's own load gives beside each): info, verify, the weights, masters and moments bit for bit, merge, and
damaged or incomplete copies refused in one line. Megatron is never imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

import zckpt  # noqa: E402
from zckpt.cli import main  # noqa: E402
from zckpt.encoding.tensors import load_pieces  # noqa: E402
from zckpt.errors import UnsupportedLayout  # noqa: E402
from zckpt.megatron import reader  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEG = FIXTURES / "megatron"
NAMES = sorted(p.name for p in MEG.iterdir() if p.is_dir() and p.name.startswith("gpt_")  # made by generate.py
               and (MEG / f"{p.name}.oracle.json").exists())  # (Megatron-LM's own saves: test_megatron_lm.py)
STATE = ("master.", "exp_avg.", "exp_avg_sq.")


def oracle(name: str) -> tuple[dict, dict]:
    return json.loads((MEG / f"{name}.oracle.json").read_text()), load_file(str(MEG / f"{name}.oracle.safetensors"))


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_every_fixture_is_here():
    assert len(NAMES) == 9, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_info_names_the_layout(name):
    meta, _ = oracle(name)
    res = cli("info", MEG / name, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["format"] == "megatron" and d["backend"] == "torch_dist"
    assert (d["tp_world_size"], d["pp_world_size"], d["dp_world_size"]) == (meta["tp"], meta["pp"], meta["dp"])
    assert d["world_size"] == meta["world_size"] and d["iteration"] == meta["iteration"] == 3
    assert d["optimizer_layout"] == meta["distrib_optim_sharding_type"]
    m = d["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["ffn_hidden_size"],
            m["vocab_size"], m["swiglu"], m["tied"]) == \
        (meta["num_layers"], meta["hidden_size"], meta["num_attention_heads"], meta["num_query_groups"],
         meta["ffn_hidden_size"], meta["vocab_size"], meta["gated_linear_unit"], meta["tied_embeddings"])
    text = cli("info", MEG / name)
    assert text.exit_code == 0, text.output
    assert "Megatron-Core torch_dist, iter_0000003 (iteration 3)" in text.output
    assert f"{meta['tp']} tensor-parallel x {meta['pp']} pipeline x {meta['dp']} data-parallel" in text.output
    assert meta["distrib_optim_sharding_type"] in text.output


@pytest.mark.parametrize("name", NAMES)
def test_verify_deep_passes(name):
    res = cli("verify", "--deep", MEG / name)
    assert res.exit_code == 0, res.output
    assert "complete and consistent" in res.output


@pytest.mark.parametrize("name", NAMES)
def test_weights_equal_megatrons_load_bit_for_bit(name):
    meta, want = oracle(name)
    weights = {k: v for k, v in want.items() if not k.startswith(STATE)}
    dtype = "fp32" if meta["params_dtype"] == "fp32" else "bf16"
    sd = zckpt.load_state_dict(str(MEG / name), dtype=dtype)
    tied = {"output_layer.weight"} if meta["tied_embeddings"] else set()
    assert set(sd) == set(weights) | tied
    for k, v in weights.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    if tied:
        assert torch.equal(sd["output_layer.weight"], weights["embedding.word_embeddings.weight"])
    streamed = dict(zckpt.iter_tensors(str(MEG / name), dtype=dtype, keep_tied=False))
    assert set(streamed) == set(weights) and all(torch.equal(streamed[k], v) for k, v in weights.items())


@pytest.mark.parametrize("name", [n for n in NAMES if "fullyresh" in n])
def test_masters_and_moments_equal_megatrons_load(name):
    _, want = oracle(name)
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    trainable = ckpt.of_kind("trainable")
    assert trainable and {r.name for r in trainable} == {k[len("master."):] for k in want if k.startswith("master.")}
    for r in trainable:
        for field, prefix in (("value", "master."), ("exp_avg", "exp_avg."), ("exp_avg_sq", "exp_avg_sq.")):
            got = load_pieces(getattr(r, field), "float32", r.shape)
            assert torch.equal(got, want[prefix + r.name]), (field, r.name)
    assert ckpt.groups == [] and ckpt.state_refusal == reader.GROUPS_REFUSAL  # groups do not list their params
    assert ckpt.extra["step"] == 3 and len(ckpt.extra["param_groups"]) == 2


@pytest.mark.parametrize("name", [n for n in NAMES if "fullyresh" not in n])
def test_dp_reshardable_reads_weights_as_saved_and_places_the_buckets_apart(name):
    """The records keep the saved weights (merge writes what Megatron's model held); the buckets' state is placed
    beside them for convert (tests/test_megatron_convert.py)."""
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    assert all(not r.exp_avg for r in ckpt.records)
    assert ckpt.extra["bucket_error"] is None and ckpt.state_refusal == reader.GROUPS_REFUSAL
    tied = {r.name for r in ckpt.of_kind("tied")} if "pp2" in name else set()  # the last stage's copy, checked
    assert set(ckpt.extra["buckets"]) == {r.name for r in ckpt.of_kind("trainable")} | tied


def test_open_and_info_build_no_pieces_and_a_read_builds_each_record_once():
    """Opening (info, verify's metadata) learns every chunk layout but places no record's pieces: a save of 10**6
    chunks has 10**7 of them, which only a command reading values needs (docs/benchmarks.md, item 1). The first read
    of a record builds its lists once, checked, and gives what Megatron's load holds (the masters test above)."""
    from zckpt.ops.info import describe
    from zckpt.state.model import DeferredRecord
    _, want = oracle("gpt_tp2_pp2_dp1_fullyresh")
    ckpt = zckpt.open_checkpoint(str(MEG / "gpt_tp2_pp2_dp1_fullyresh"))
    records = [r for r in ckpt.records if r.kind != "tied"]
    assert records and all(isinstance(r, DeferredRecord) and r.pending for r in records)
    d = describe(ckpt)
    assert d["master_dtype"] == "float32" and d["optimizer_state_dtype"] == "float32"
    assert d["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert all(r.pending for r in records), "describing the checkpoint built pieces"
    rec = next(r for r in records if "linear_proj" in r.name)  # row-parallel: a piece per row and chunk
    value = rec.value
    assert not rec.pending and rec.value is value and len(value) > 1
    assert torch.equal(load_pieces(rec.exp_avg_sq, "float32", rec.shape), want["exp_avg_sq." + rec.name])
    assert rec.state_dtype == "float32" and sum(r.pending for r in records) == len(records) - 1
    import dataclasses
    other = next(r for r in records if r.pending)
    copy = dataclasses.replace(other, name="x")  # what renames and views do: the built lists, no build of its own
    assert not other.pending and not copy.pending and copy.value == other.value and copy.exp_avg == other.exp_avg


def test_a_deferred_build_is_checked_as_an_eager_one():
    from zckpt.engine.segments import Piece
    from zckpt.errors import CorruptFile
    from zckpt.state.model import DeferredRecord
    short = DeferredRecord("w", (2, 3), "trainable", "float32", state_dtype="float32", path="/x/.metadata",
                           build=lambda: ([Piece("/x/a", 0, 5, "float32")], [Piece("/x/a", 0, 6, "float32")],
                                          [Piece("/x/a", 0, 6, "float32")]))
    assert "not built" in repr(short)
    for _ in range(2):  # (and again: a damaged record is never taken as built)
        with pytest.raises(CorruptFile, match="'w': value covers 5 elements, its shape \\[2, 3\\] has 6"):
            short.value
    assert short.pending
    relabelled = DeferredRecord("w", (6,), "trainable", "float32", state_dtype="float32", path="/x/.metadata",
                                build=lambda: ([Piece("/x/a", 0, 6, "float32")], [Piece("/x/a", 0, 6, "bfloat16")],
                                               [Piece("/x/a", 0, 6, "bfloat16")]))
    assert relabelled.state_dtype == "float32"
    with pytest.raises(CorruptFile, match="exp_avg is stored as bfloat16, its metadata says float32"):
        relabelled.exp_avg


def test_a_chunk_layout_is_learned_and_checked_at_open(tmp_path):
    """A damaged item of a weight's chunks is refused by ``info`` in one line: every kind of chunk is read once at
    open, though no record's pieces are built."""
    from zckpt.encoding import dcpmeta
    bad = tmp_path / "ck"
    shutil.copytree(MEG / "gpt_tp2_pp1_dp1", bad)
    folder = bad / "iter_0000003"
    md = dcpmeta.read_metadata((folder / ".metadata").read_bytes(), str(folder / ".metadata"), None)
    key = next(k for k in md.tensors if k.endswith("linear_proj.weight"))
    for c in md.tensors[key].chunks:  # every item of the weight (whichever one the open reads): its zip's header
        with open(folder / c.file, "r+b") as f:
            f.seek(c.offset)
            f.write(b"\0" * 30)
    res = zckpt_run("info", bad, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert ".distcp" in lines[0], lines


def test_tied_only_where_the_files_say_so():
    tied = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp2_dp1_tied"))
    assert [(r.name, r.tied_to) for r in tied.of_kind("tied")] == [reader.TIED]
    untied = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp1"))
    assert not untied.of_kind("tied") and "output_layer.weight" in untied.by_name()


def test_stacked_and_per_layer_keys_give_the_same_records():
    stacked = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp1"))
    perlayer = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp1_perlayer"))
    assert [(r.name, r.shape) for r in stacked.records] == [(r.name, r.shape) for r in perlayer.records]
    assert stacked.records[0].name == "embedding.word_embeddings.weight"
    assert stacked.records[1].name.startswith("decoder.layers.0.")


def test_an_iteration_folder_and_a_tag(tmp_path):
    iter_dir = MEG / "gpt_tp2_pp1_dp1" / "iter_0000003"
    assert zckpt.open_checkpoint(str(iter_dir)).tag == "iter_0000003"
    for tag in ("iter_0000003", "3"):
        assert zckpt.open_checkpoint(str(MEG / "gpt_tp2_pp1_dp1"), tag=tag).tag == "iter_0000003"
    res = cli("info", MEG / "gpt_tp2_pp1_dp1", "--tag", "iter_0000009")
    assert res.exit_code != 0 and "iter_0000009" in res.output


def test_opened_as_megatron_not_dcp():
    from zckpt.dcp import reader as dcp_reader
    iter_dir = str(MEG / "gpt_tp1_pp1_dp1" / "iter_0000003")
    assert dcp_reader.claims(iter_dir) and reader.claims(iter_dir)
    assert zckpt.open_checkpoint(iter_dir).format == "megatron"


def test_merge_writes_megatron_names_and_the_tied_embedding_once(tmp_path):
    out = tmp_path / "out"
    res = cli("merge", MEG / "gpt_tp1_pp2_dp1_tied", "--to", "safetensors", "--dtype", "bf16", "-o", out)
    assert res.exit_code == 0, res.output
    assert "tensor names are Megatron's" in res.output
    _, want = oracle("gpt_tp1_pp2_dp1_tied")
    got = load_file(str(out / "model.safetensors"))
    weights = {k: v for k, v in want.items() if not k.startswith(STATE)}
    assert set(got) == set(weights) and "output_layer.weight" not in got
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def zckpt_run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("name", ["gpt_tp2_pp1_dp2", "gpt_tp2_pp2_dp1_fullyresh"])
def test_a_flipped_byte_in_a_distcp_item_is_refused(tmp_path, name):
    bad = tmp_path / name
    shutil.copytree(MEG / name, bad)
    ckpt = zckpt.open_checkpoint(str(bad))
    rec = next(r for r in ckpt.records if r.kind == "trainable" and r.name.startswith("decoder.layers.1."))
    piece = rec.value[0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset + piece.nbytes // 2)
        b = f.read(1)
        f.seek(piece.offset + piece.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    out = tmp_path / "merged"
    res = zckpt_run("merge", bad, "-o", out, cwd=tmp_path)
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and os.path.basename(piece.path) in lines[0] and "CRC-32" in lines[0], res.stderr
    assert not out.exists()
    deep = zckpt_run("verify", "--deep", bad, cwd=tmp_path)
    assert deep.returncode != 0 and os.path.basename(piece.path) in deep.stdout + deep.stderr


@pytest.mark.parametrize("damage", ["metadata-missing", "metadata-truncated", "common-missing", "common-truncated"])
def test_an_incomplete_iteration_is_one_line(tmp_path, damage):
    bad = tmp_path / "ck"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp1", bad)
    target = bad / "iter_0000003" / (".metadata" if damage.startswith("metadata") else "common.pt")
    if damage.endswith("missing"):
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    res = zckpt_run("info", bad, cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr and target.name in lines[0], res.stderr


def test_other_megatron_layouts_are_refused_in_one_line(tmp_path):
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(UnsupportedLayout, match="legacy 'torch' checkpoint format.*model_optim_rng.pt|"
                                                "model_optim_rng.pt.*legacy"):
        zckpt.open_checkpoint(str(legacy))
    other = tmp_path / "fsdp"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp1", other)
    (other / "iter_0000003" / "metadata.json").write_text(json.dumps({"sharded_backend": "fsdp_dtensor"}))
    with pytest.raises(UnsupportedLayout, match="fsdp_dtensor.*torch_dist"):
        zckpt.open_checkpoint(str(other))
    res = zckpt_run("info", other, cwd=tmp_path)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_extra_state_other_than_none_is_refused():
    reader.check_extra_state("k", [None])
    reader.check_extra_state("k", None)
    with pytest.raises(UnsupportedLayout, match="TransformerEngine"):
        reader.check_extra_state("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2", [b"\x80fp8"])


# ------------------------------------------------------------------------------ Hugging Face Llama names

def llama_oracle(name: str) -> dict:
    """The oracle's weights under Llama's names, cut here from the README's layout (not from zckpt's map)."""
    meta, want = oracle(name)
    heads, groups, kv = meta["num_attention_heads"], meta["num_query_groups"], meta["kv_channels"]
    per = heads // groups
    out = {"model.embed_tokens.weight": want["embedding.word_embeddings.weight"],
           "model.norm.weight": want["decoder.final_layernorm.weight"]}
    if not meta["tied_embeddings"]:
        out["lm_head.weight"] = want["output_layer.weight"]
    for i in range(meta["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = want[src + "self_attention.linear_qkv.weight"].reshape(groups, (per + 2) * kv, -1)
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :per * kv].reshape(heads * kv, -1)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, per * kv:(per + 1) * kv].reshape(groups * kv, -1)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * kv:].reshape(groups * kv, -1)
        out[dst + "self_attn.o_proj.weight"] = want[src + "self_attention.linear_proj.weight"]
        gate, up = want[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = want[src + "mlp.linear_fc2.weight"]
        out[dst + "input_layernorm.weight"] = want[src + "self_attention.linear_qkv.layer_norm_weight"]
        out[dst + "post_attention_layernorm.weight"] = want[src + "mlp.linear_fc1.layer_norm_weight"]
    return out


LLAMA = [n for n in NAMES if oracle(n)[0]["gated_linear_unit"]]


# TransformerConfig's defaults, which the generator's models ran with (fixtures/megatron/generate.py names neither)
MEGATRON_NORM_EPS, MEGATRON_ROPE_BASE = 1e-5, 10000


def _llama_config(meta: dict, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": meta["hidden_size"], "intermediate_size": meta["ffn_hidden_size"],
            "num_hidden_layers": meta["num_layers"], "num_attention_heads": meta["num_attention_heads"],
            "num_key_value_heads": meta["num_query_groups"], "head_dim": meta["kv_channels"],
            "vocab_size": meta["vocab_size"], "tie_word_embeddings": meta["tied_embeddings"],
            "rms_norm_eps": MEGATRON_NORM_EPS, "rope_theta": MEGATRON_ROPE_BASE, "torch_dtype": dtype}


def _check_loads(transformers, out, name, meta, dtype):
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    sd = model.state_dict()
    want = llama_oracle(name)
    assert set(sd) == set(want) | ({"lm_head.weight"} if meta["tied_embeddings"] else set())
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    if meta["tied_embeddings"]:
        assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
        assert torch.equal(sd["lm_head.weight"], want["model.embed_tokens.weight"])
    return model


@pytest.mark.parametrize("name", LLAMA)
def test_merge_of_a_llama_shaped_model_loads_in_transformers(tmp_path, name):
    """The fixtures' args hold no --norm-epsilon / --rotary-base: the weights get Llama's names, and no config.json
    is guessed (LlamaConfig's rms_norm_eps default, 1e-6, is not Megatron's 1e-5); with the run's config beside
    them, from_pretrained loads Megatron's tensors bit for bit."""
    transformers = pytest.importorskip("transformers")
    meta, _ = oracle(name)
    dtype = "fp32" if meta["params_dtype"] == "fp32" else "bf16"
    out = tmp_path / "hf"
    res = cli("merge", MEG / name, "--dtype", dtype, "-o", out)
    assert res.exit_code == 0, res.output
    assert "Hugging Face Llama names" in res.output and "no config.json written" in res.output
    assert "norm_epsilon" in res.output and "rotary_base" in res.output and not (out / "config.json").exists()
    (out / "config.json").write_text(json.dumps(_llama_config(meta, "float32" if dtype == "fp32" else "bfloat16")))
    _check_loads(transformers, out, name, meta, dtype)


def test_config_json_from_the_args_when_they_hold_it(tmp_path):
    """Args as Megatron-LM saves them (norm_epsilon, rotary_base, rotary_percent): config.json carries them."""
    transformers = pytest.importorskip("transformers")
    name = "gpt_tp2_pp1_dp1"
    src = tmp_path / name
    shutil.copytree(MEG / name, src)
    common = src / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)  # our own committed fixture
    state["args"].norm_epsilon, state["args"].rotary_base, state["args"].rotary_percent = 1e-5, 10000, 1.0
    torch.save(state, common)
    meta, _ = oracle(name)
    out = tmp_path / "hf"
    res = cli("merge", src, "--dtype", "bf16", "-o", out)
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["rms_norm_eps"], cfg["rope_theta"]) == (1e-5, 10000)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]) == \
        (meta["num_query_groups"], meta["kv_channels"], meta["tied_embeddings"])
    model = _check_loads(transformers, out, name, meta, "bf16")
    assert model.config.rms_norm_eps == 1e-5
    state["args"].rotary_percent = 0.5  # partial RoPE: not Llama's; still no config guessed
    torch.save(state, common)
    res = cli("merge", src, "--dtype", "bf16", "-o", tmp_path / "hf2")
    assert res.exit_code == 0 and "partial RoPE" in res.output and not (tmp_path / "hf2" / "config.json").exists()


def test_native_names_keeps_megatrons_names(tmp_path):
    out = tmp_path / "native"
    res = cli("merge", MEG / "gpt_tp2_pp1_dp1", "--dtype", "bf16", "--native-names", "-o", out)
    assert res.exit_code == 0, res.output
    assert "tensor names are Megatron's" in res.output and not (out / "config.json").exists()
    assert "decoder.layers.0.mlp.linear_fc1.weight" in load_file(str(out / "model.safetensors"))


def test_a_gelu_model_keeps_megatrons_names_and_says_why(tmp_path):
    res = cli("merge", MEG / "gpt_tp1_pp2_dp1_tied", "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert "not mapped to Hugging Face Llama names: the files do not say swiglu" in res.output


@pytest.mark.parametrize("name, why", [("gpt_tp2_pp2_dp1_fullyresh", "param groups"),
                                       ("gpt_tp1_pp1_dp1", "param groups"),
                                       ("gpt_tp1_pp2_dp1_tied", "param groups")])
def test_carrying_the_optimizer_state_is_refused_in_one_line(tmp_path, name, why):
    out = tmp_path / "dcp"
    res = zckpt_run("convert", MEG / name, "--to", "dcp", "-o", out, cwd=tmp_path)
    assert res.returncode != 0 and not out.exists()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], res.stderr


def test_a_save_folder_without_its_latest_file_names_its_iterations(tmp_path):
    """No latest_checkpointed_iteration.txt (a save that did not finish?): one line naming the iterations, and
    --tag picks one; never read as another format."""
    src = tmp_path / "save"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp1", src)
    (src / "latest_checkpointed_iteration.txt").unlink()
    res = zckpt_run("info", src, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "iter_0000003" in lines[0] and "--tag" in lines[0], res.stderr
    res = zckpt_run("info", src, "--tag", "3", cwd=tmp_path)
    assert res.returncode == 0 and "Megatron-Core torch_dist" in res.stdout, res.stderr
