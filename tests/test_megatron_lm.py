"""Checkpoints saved by Megatron-LM's own ``pretrain_gpt.py`` (fixtures/megatron/lm16_*, lm19_*: megatron-core 0.16.1
and 0.19.2 on CPU ranks, made by fixtures/megatron/generate_lm.py, with what Megatron-LM's own ``load_checkpoint``
gives beside each): their ``common.pt`` holds the whole args Namespace, enums included. info shows the args' facts;
verify, merge (loaded by transformers) and convert (loaded by FSDP2 and DeepSpeed) work on them bit for bit; a
``common.pt`` naming a class outside the allow-list is refused in one line. Megatron is never imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

import zckpt  # noqa: E402
from zckpt.encoding.tensors import load_pieces  # noqa: E402
from zckpt.errors import UnsafePickle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEG = FIXTURES / "megatron"
LM = sorted(p.name for p in MEG.iterdir() if p.is_dir() and p.name.startswith("lm")
            and (MEG / f"{p.name}.oracle.json").exists())
STATE = ("master.", "exp_avg.", "exp_avg_sq.")


def oracle(name: str) -> tuple[dict, dict]:
    return json.loads((MEG / f"{name}.oracle.json").read_text()), load_file(str(MEG / f"{name}.oracle.safetensors"))


def zckpt_run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def one_line(res, *words):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_both_megatron_core_series_are_here():
    series = {oracle(n)[0]["megatron_core"].rsplit(".", 1)[0] for n in LM}
    assert {"0.16"} <= series and len(LM) >= 2, LM
    for n in LM:  # what Megatron-LM's own loader saw: its flags, never a hand-made args object
        meta, _ = oracle(n)
        assert "--mock-data" in meta["megatron_lm_flags"] and meta["oracle_method"].startswith("pretrain_gpt.py")


@pytest.mark.parametrize("name", LM)
def test_info_shows_the_facts_of_the_real_args(name):
    meta, _ = oracle(name)
    res = zckpt_run("info", MEG / name, "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert (d["tp_world_size"], d["pp_world_size"], d["dp_world_size"], d["world_size"]) == \
        (meta["tp"], meta["pp"], meta["dp"], meta["world_size"])
    assert d["iteration"] == meta["iteration"] and d["optimizer_layout"] == meta["distrib_optim_sharding_type"]
    m = d["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"],
            m["ffn_hidden_size"], m["vocab_size"], m["swiglu"], m["tied"], m["norm_epsilon"], m["rotary_base"]) == \
        (meta["num_layers"], meta["hidden_size"], meta["num_attention_heads"], meta["num_query_groups"],
         meta["kv_channels"], meta["ffn_hidden_size"], meta["vocab_size"], meta["gated_linear_unit"],
         meta["tied_embeddings"], meta["norm_epsilon"], meta["rotary_base"])
    run = d["run"]
    assert run["attention_backend"] == meta["attention_backend"] == "auto"  # AttnBackend.auto, by its name
    assert run["consumed_train_samples"] == meta["consumed_train_samples"] == meta["iteration"] * \
        run["global_batch_size"]
    assert run["exit_signal"] == "SIGTERM" and run.get("model_type", "encoder_or_decoder") == "encoder_or_decoder"
    text = zckpt_run("info", MEG / name)
    assert text.returncode == 0, text.stderr
    assert f"iter_{meta['iteration']:07d} (iteration {meta['iteration']})" in text.stdout
    assert f"consumed_train_samples {meta['consumed_train_samples']}" in text.stdout
    assert "attention_backend auto" in text.stdout


@pytest.mark.parametrize("name", LM)
def test_verify_deep_and_the_weights_equal_megatron_lms_load(name):
    res = zckpt_run("verify", "--deep", MEG / name)
    assert res.returncode == 0 and "complete and consistent" in res.stdout, res.stdout + res.stderr
    meta, want = oracle(name)
    weights = {k: v for k, v in want.items() if not k.startswith(STATE)}
    sd = zckpt.load_state_dict(str(MEG / name), dtype="bf16")
    tied = {"output_layer.weight"} if meta["tied_embeddings"] else set()
    assert set(sd) == set(weights) | tied
    for k, v in weights.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


@pytest.mark.parametrize("name", LM)
def test_masters_and_moments_equal_megatron_lms_load(name):
    """fully_reshardable: in the records; dp_reshardable: placed in the flat buckets (zckpt.megatron.buckets)."""
    meta, want = oracle(name)
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    by_name = ckpt.by_name()
    names = {k[len("master."):] for k in want if k.startswith("master.")}
    if meta["distrib_optim_sharding_type"] == "fully_reshardable":
        got = {r.name: (r.value, r.exp_avg, r.exp_avg_sq) for r in ckpt.of_kind("trainable")}
    else:
        assert ckpt.extra["bucket_error"] is None
        got = {n: t for n, t in ckpt.extra["buckets"].items() if by_name[n].kind == "trainable"}
    assert set(got) == names
    for n, triple in got.items():
        for kind, pieces in zip(("master", "exp_avg", "exp_avg_sq"), triple):
            assert torch.equal(load_pieces(pieces, "float32", by_name[n].shape), want[f"{kind}.{n}"]), (kind, n)
    assert ckpt.extra["step"] == meta["iteration"]


def test_an_earlier_save_by_its_tag():
    name = "lm16_tp2_pp1_dp2"  # --save-interval 2 --train-iters 4: iterations 2 and 4
    assert zckpt.open_checkpoint(str(MEG / name)).tag == "iter_0000004"
    ckpt = zckpt.open_checkpoint(str(MEG / name), tag="2")
    assert ckpt.tag == "iter_0000002" and ckpt.extra["step"] == 2
    assert ckpt.extra["megatron"]["run"]["consumed_train_samples"] == 16
    res = zckpt_run("verify", "--deep", MEG / name, "--tag", "iter_0000002")
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------ merge, loaded by transformers

def llama_oracle(name: str) -> dict:
    """The oracle's weights under Llama's names, cut here from fixtures/megatron/README.md's layout."""
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


@pytest.mark.parametrize("name", LM)
def test_merge_writes_a_llama_transformers_loads_with_the_runs_config(tmp_path, name):
    """The real args hold --norm-epsilon (as layernorm_epsilon) and --rotary-base: config.json carries them."""
    transformers = pytest.importorskip("transformers")
    meta, _ = oracle(name)
    out = tmp_path / "hf"
    res = zckpt_run("merge", MEG / name, "--dtype", "bf16", "-o", out)
    assert res.returncode == 0, res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == \
        (meta["norm_epsilon"], meta["rotary_base"], meta["kv_channels"], meta["num_query_groups"],
         meta["vocab_size"], meta["tied_embeddings"])
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.bfloat16)
    sd, want = model.state_dict(), llama_oracle(name)
    assert set(sd) == set(want) | ({"lm_head.weight"} if meta["tied_embeddings"] else set())
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


# ------------------------------------------------------------------------------ convert, loaded by the frameworks

def _convert_check(tmp_path, name, to, nproc, *extra):
    from tests import test_megatron_convert as mc
    meta, _ = oracle(name)
    out = tmp_path / to
    args = ["--to", to] + (["--world-size", nproc, "--stage", extra[0], "--dtype", "bf16"] if to == "deepspeed" else [])
    res = zckpt_run("convert", MEG / name, "--groups", "megatron-default", *args, "-o", out, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["source_format"] == "megatron"
    got = mc.torchrun(tmp_path, nproc, "fsdp2" if to == "dcp" else "deepspeed", out, MEG / f"{name}.oracle.json",
                      *extra)
    mc.check_loaded(name, got)
    return meta, got


@pytest.mark.slow
def test_convert_to_dcp_loads_in_fsdp2_bit_for_bit(tmp_path):
    name = "lm16_tp2_pp1_dp2"  # dp_reshardable buckets, placed
    meta, got = _convert_check(tmp_path, name, "dcp", 3)
    assert all(float(v) == meta["iteration"] for n, v in got["tensors"].items() if n.startswith("step/"))
    assert got["counters"]["global_steps"] == meta["iteration"]
    assert got["counters"]["global_samples"] == meta["consumed_train_samples"]


@pytest.mark.slow
def test_convert_to_deepspeed_loads_in_deepspeed_bit_for_bit(tmp_path):
    name = "lm16_tp1_pp2_dp2_fullyresh"
    meta, got = _convert_check(tmp_path, name, "deepspeed", 3, 2)
    assert got["steps"] == [float(meta["iteration"])]
    assert (got["global_steps"], got["global_samples"]) == (meta["iteration"], meta["consumed_train_samples"])


@pytest.mark.parametrize("name", [n for n in LM if n.startswith("lm19_")])
def test_convert_of_a_019_save_reads_back_in_torch_dcp(tmp_path, name):
    """megatron-core 0.19's layout (common state in the DCP) converted to DCP: torch.distributed.checkpoint's own
    load (one process) gives every master, moment and step Megatron-LM's load gave (cheap beside the FSDP2 and
    DeepSpeed loads above, which run on the 0.16 saves)."""
    import torch.distributed.checkpoint as dcp
    from tests import test_megatron_convert as mc
    out = tmp_path / "dcp"
    res = zckpt_run("convert", MEG / name, "--groups", "megatron-default", "--to", "dcp", "-o", out)
    assert res.returncode == 0, res.stderr
    meta, want = mc.expected(name)
    sd = {}
    for n, t in want["master"].items():
        sd[f"model.{n}"] = torch.empty_like(t)
        sd[f"optim.state.{n}.exp_avg"] = torch.empty_like(t)
        sd[f"optim.state.{n}.exp_avg_sq"] = torch.empty_like(t)
        sd[f"optim.state.{n}.step"] = torch.empty((), dtype=torch.float32)
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for n in want["master"]:
        assert mc._exact(sd[f"model.{n}"], want["master"][n]), n
        assert mc._exact(sd[f"optim.state.{n}.exp_avg"], want["exp_avg"][n]), n
        assert mc._exact(sd[f"optim.state.{n}.exp_avg_sq"], want["exp_avg_sq"][n]), n
        assert float(sd[f"optim.state.{n}.step"]) == meta["iteration"], n


# ------------------------------------------------------------------------------ refusals

def _with_common(tmp_path, obj_factory) -> Path:
    src = tmp_path / "src"
    shutil.copytree(MEG / "lm16_tp2_pp1_dp2", src)
    common = src / "iter_0000004" / "common.pt"
    torch.save(obj_factory(), common)
    return src


def test_a_megatron_class_outside_the_allow_list_is_refused_in_one_line(tmp_path):
    """A class the allow-list does not know (here an Enum named as megatron-core's Fp8Recipe) is named, in the
    words of a Megatron common.pt; nothing is written."""
    import argparse
    import enum

    class Fp8Recipe(enum.Enum):
        delayed = "delayed"
    Fp8Recipe.__module__, Fp8Recipe.__qualname__ = "megatron.core.enums", "Fp8Recipe"
    mod = type(sys)("megatron.core.enums")
    mod.Fp8Recipe = Fp8Recipe
    saved = {k: sys.modules.get(k) for k in ("megatron", "megatron.core", "megatron.core.enums")}
    sys.modules.update({"megatron": type(sys)("megatron"), "megatron.core": type(sys)("megatron.core"),
                        "megatron.core.enums": mod})
    try:
        src = _with_common(tmp_path, lambda: {"args": argparse.Namespace(fp8_recipe=Fp8Recipe.delayed),
                                              "iteration": 4})
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    for cmd in (["info"], ["merge", "-o", tmp_path / "out"], ["verify"]):
        res = zckpt_run(cmd[0], src, *cmd[1:])
        one_line(res, "common.pt", "Megatron common.pt", "'megatron.core.enums.Fp8Recipe'", "allow-list")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafePickle, match="Megatron common.pt.*Fp8Recipe"):
        zckpt.open_checkpoint(str(src))


def test_code_in_common_pt_is_refused_never_run(tmp_path):
    flag = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))
    src = _with_common(tmp_path, lambda: {"args": Payload(), "iteration": 4})
    res = zckpt_run("merge", src, "-o", tmp_path / "out")
    one_line(res, "Megatron common.pt", "system'", "never runs code")
    assert "DeepSpeed" not in res.stderr and not flag.exists() and not (tmp_path / "out").exists()


def test_code_in_019s_common_state_object_is_refused_never_run(tmp_path):
    """0.19 keeps the common state as the DCP item common_state/shard_0_1: replaced here by a torch.save of a payload
    of the same length (padded by a zip comment), it is refused in one line naming it; nothing runs."""
    import io
    import struct
    flag = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))
    src = tmp_path / "src"
    shutil.copytree(MEG / "lm19_tp2_pp1_dp2", src)
    v = zckpt.open_checkpoint(str(src)).extra["metadata"].values["common_state/shard_0_1"]
    buf = io.BytesIO()
    torch.save([{"args": Payload(), "iteration": 4}], buf)
    data = buf.getvalue()
    pad = v.length - len(data)
    assert 0 <= pad < 1 << 16 and data[-22:-18] == b"PK\x05\x06"
    with open(src / "iter_0000004" / v.file, "r+b") as f:
        f.seek(v.offset)
        f.write(data[:-2] + struct.pack("<H", pad) + b"\0" * pad)
    res = zckpt_run("merge", src, "-o", tmp_path / "out")
    one_line(res, "Megatron common state", "common_state/shard_0_1", "system'", "never runs code")
    assert not flag.exists() and not (tmp_path / "out").exists()


def test_an_enum_value_megatron_does_not_define_is_shown_not_guessed():
    from zckpt.encoding import safeload

    def member(value: bytes):  # AttnBackend(value) as pickle rebuilds an Enum member: GLOBAL, args, REDUCE
        return safeload.load_plain(b"\x80\x02cmegatron.core.transformer.enums\nAttnBackend\n" + value + b"\x85R.",
                                   "common.pt")
    assert repr(member(b"K\x05")) == "AttnBackend.auto" == str(member(b"K\x05")) and member(b"K\x05").name == "auto"
    assert int(member(b"K\x05")) == 5
    assert repr(member(b"K\x2a")) == "AttnBackend(42)" and member(b"K\x2a").name is None
    with pytest.raises(UnsafePickle, match="AttnBackend"):
        member(b"X\x04\x00\x00\x00auto")


def test_the_classes_megatron_core_lists_as_safe_are_inert(tmp_path):
    """megatron-core's own SAFE_GLOBALS (megatron/core/safe_globals.py) beyond the enums: a PosixPath in the args is
    its text, a SimpleNamespace a stand-in keeping its fields."""
    import argparse
    import pathlib
    import types

    from zckpt.megatron import reader
    src = _with_common(tmp_path, lambda: {"args": argparse.Namespace(data_cache_path=pathlib.PosixPath("/data/c")),
                                          "extra": types.SimpleNamespace(n=3), "iteration": 4})
    got = reader.load_common(str(src / "iter_0000004" / "common.pt"))
    assert got["args"].data_cache_path == "/data/c" and got["extra"].n == 3 and got["iteration"] == 4
