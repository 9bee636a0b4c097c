"""``zckpt convert`` of a Megatron-Core ``fully_reshardable`` checkpoint (fixtures/megatron, written by megatron-core
0.16.1) with its optimizer state, to DCP and to DeepSpeed, each loaded by the real framework into transformers'
``LlamaForCausalLM`` at a world size the source did not have (FSDP2 at 3 CPU ranks, DeepSpeed ZeRO-2 at 3 and
ZeRO-3 at 2): every master, ``exp_avg``, ``exp_avg_sq`` and step must equal what Megatron's own load gives (the
fixtures' oracles), split to Llama's q/k/v and gate/up here with torch's own indexing, and the groups Megatron's.
What the files do not say (which parameter is in which group) must be stated, or the conversion is refused."""

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
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEG = FIXTURES / "megatron"
SOURCES = ["gpt_tp1_pp1_dp2_fullyresh", "gpt_tp2_pp2_dp1_fullyresh"]
# Megatron-LM's default optimizer layout: flat buckets, placed by zckpt.megatron.buckets (tp 1 and 2, bf16 and fp32)
DP_SOURCES = ["gpt_tp1_pp1_dp2", "gpt_tp2_pp1_dp2", "gpt_tp1_pp1_dp2_fp32"]


def oracle(name: str) -> tuple[dict, dict]:
    return json.loads((MEG / f"{name}.oracle.json").read_text()), load_file(str(MEG / f"{name}.oracle.safetensors"))


def expected(name: str) -> tuple[dict, dict]:
    """{kind: {Llama name: tensor}} for master / exp_avg / exp_avg_sq, from Megatron's own load, split here."""
    meta, want = oracle(name)
    heads, groups, kv = meta["num_attention_heads"], meta["num_query_groups"], meta["kv_channels"]
    per = heads // groups
    out = {}
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        t = {k[len(kind) + 1:]: v for k, v in want.items() if k.startswith(kind + ".")}
        d = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"],
             "model.norm.weight": t["decoder.final_layernorm.weight"]}
        if not meta["tied_embeddings"]:
            d["lm_head.weight"] = t["output_layer.weight"]
        for i in range(meta["num_layers"]):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            qkv = t[m + "self_attention.linear_qkv.weight"]
            qkv = qkv.view(groups, per + 2, kv, qkv.shape[-1])
            d[h + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(-1, qkv.shape[-1])
            d[h + "self_attn.k_proj.weight"] = qkv[:, per].reshape(-1, qkv.shape[-1])
            d[h + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(-1, qkv.shape[-1])
            d[h + "self_attn.o_proj.weight"] = t[m + "self_attention.linear_proj.weight"]
            gate, up = t[m + "mlp.linear_fc1.weight"].chunk(2)
            d[h + "mlp.gate_proj.weight"], d[h + "mlp.up_proj.weight"] = gate, up
            d[h + "mlp.down_proj.weight"] = t[m + "mlp.linear_fc2.weight"]
            d[h + "input_layernorm.weight"] = t[m + "self_attention.linear_qkv.layer_norm_weight"]
            d[h + "post_attention_layernorm.weight"] = t[m + "mlp.linear_fc1.layer_norm_weight"]
        out[kind] = d
    return meta, out


def common(name: str) -> dict:
    """common.pt, read here with torch's own loader."""
    import argparse
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(MEG / name / "iter_0000003" / "common.pt", weights_only=True)


def consumed_samples(name: str) -> int:
    """Megatron-LM's consumed_train_samples, from the args in common.pt."""
    return common(name)["args"].consumed_train_samples


def zckpt_run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def torchrun(tmp: Path, nproc: int, *args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    dump = tmp / f"dump_{args[0]}_{nproc}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
           str(ROOT / "tests" / "megatron_convert_worker.py"), args[0], str(args[1]), str(args[2]), str(dump),
           *map(str, args[3:])]
    proc = ds_oracle.ranks.run(cmd, env=G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}),
                               cwd=str(tmp), timeout=900)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]
    return {"tensors": load_file(str(dump) + ".safetensors"), **json.loads(Path(str(dump) + ".json").read_text())}


def _exact(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


def check_loaded(name: str, got: dict) -> None:
    meta, want = expected(name)
    t = got["tensors"]
    names = set(want["master"])
    assert {k[len("param/"):] for k in t if k.startswith("param/")} == names
    for n in names:
        assert _exact(t[f"param/{n}"], want["master"][n]), n
        assert _exact(t[f"exp_avg/{n}"], want["exp_avg"][n]), n
        assert _exact(t[f"exp_avg_sq/{n}"], want["exp_avg_sq"][n]), n
    files_groups = meta["param_groups_per_rank"][0]
    assert len(got["groups"]) == 2
    for g, fg in zip(got["groups"], files_groups):
        assert (g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) == \
            (fg["lr"], fg["weight_decay"], tuple(fg["betas"]), fg["eps"])
    no_wd = {n for n in names if want["master"][n].ndim == 1}
    assert set(got["groups"][1]["names"]) == no_wd and set(got["groups"][0]["names"]) == names - no_wd


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES + DP_SOURCES)
def test_to_dcp_loads_in_fsdp2_at_another_world_size_bit_for_bit(tmp_path, name):
    out = tmp_path / "fsdp2"
    res = zckpt_run("convert", MEG / name, "--groups", "megatron-default", "--to", "dcp", "-o", out, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["source_format"] == "megatron" and doc["adam_mode"] == "adamw"
    assert "rng_state" in doc["not_carried"] and "train_state.{global_steps,global_samples}" in doc["carried"]
    meta, _ = oracle(name)
    got = torchrun(tmp_path, 3, "fsdp2", out, MEG / f"{name}.oracle.json")
    assert got["world_size"] == 3 != meta["world_size"]
    check_loaded(name, got)
    for n, v in got["tensors"].items():
        if n.startswith("step/"):
            assert float(v) == 3.0, n
    assert got["counters"]["global_steps"] == 3 and got["counters"]["global_samples"] == consumed_samples(name)


@pytest.mark.slow
@pytest.mark.parametrize("name, stage, ws", [("gpt_tp1_pp1_dp2_fullyresh", 2, 3), ("gpt_tp2_pp2_dp1_fullyresh", 3, 2),
                                            ("gpt_tp2_pp1_dp2", 2, 3), ("gpt_tp1_pp1_dp1", 3, 2)])
def test_to_deepspeed_loads_in_deepspeed_bit_for_bit(tmp_path, name, stage, ws):
    out = tmp_path / "ds"
    res = zckpt_run("convert", MEG / name, "--groups", "megatron-default", "--to", "deepspeed", "--world-size", ws,
                    "--stage", stage, "--dtype", "bf16", "-o", out, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["source_format"] == "megatron" and "rng_state" in doc["not_carried"]
    got = torchrun(tmp_path, ws, "deepspeed", out, MEG / f"{name}.oracle.json", stage)
    check_loaded(name, got)
    assert got["steps"] == [3.0]
    assert (got["global_steps"], got["global_samples"]) == (3, consumed_samples(name))
    assert got["client"]["opt_param_scheduler"] == common(name)["opt_param_scheduler"]


def _one_line(res, *words):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("to", [["--to", "dcp"], ["--to", "deepspeed", "--world-size", "2", "--stage", "2",
                                                  "--dtype", "bf16"]])
def test_unstated_groups_are_refused_not_guessed(tmp_path, to):
    out = tmp_path / "o"
    res = zckpt_run("convert", MEG / SOURCES[0], *to, "-o", out)
    _one_line(res, "do not list their parameters", "--groups megatron-default")
    assert not out.exists()


def test_dp_reshardable_with_uneven_pipeline_stages_is_refused(tmp_path):
    """The args say the layers are not split evenly over the stages: refused, never placed by the even rule."""
    import argparse
    src = tmp_path / "src"
    shutil.copytree(MEG / "gpt_tp1_pp2_dp1_tied", src)
    common = src / "iter_0000003" / "common.pt"
    torch.serialization.add_safe_globals([argparse.Namespace])
    d = torch.load(common, weights_only=True)
    d["args"].num_layers_in_first_pipeline_stage = 1
    torch.save(d, common)
    res = zckpt_run("convert", src, "--groups", "megatron-default", "-o", tmp_path / "o")
    _one_line(res, "dp_reshardable", "num_layers_in_first_pipeline_stage=1", "--dist-ckpt-optim-fully-reshardable")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", [n for n in sorted(p.name for p in MEG.iterdir() if p.is_dir())
                                  if "fullyresh" not in n])
def test_dp_reshardable_buckets_placed_as_megatron_laid_them_out(name):
    """Every parameter's place in every bucket of every rank equals the layout megatron-core's live buffers had
    (recorded by the generator from DistributedOptimizer's own range maps), and its state equals Megatron's own
    load (a tied output layer's copy on the last pipeline stage: the embedding's)."""
    import zckpt
    from zckpt.encoding.tensors import load_pieces
    from zckpt.megatron import buckets
    meta, want = oracle(name)
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    placed, by_name = ckpt.extra["buckets"], ckpt.by_name()
    assert ckpt.extra["bucket_error"] is None
    copies = {n for n in placed if by_name[n].kind == "tied"}
    assert set(placed) - copies == {k[len("master."):] for k in want if k.startswith("master.")}
    for n, triple in placed.items():
        src = by_name[n].tied_to or n
        for kind, pieces in zip(("master", "exp_avg", "exp_avg_sq"), triple):
            assert _exact(load_pieces(pieces, "float32", by_name[src].shape), want[f"{kind}.{src}"]), (kind, n)
    buffers = meta["dp_buffers_per_rank"]  # per global rank: its grad buffers; ranks 0..tp*pp-1 are dp rank 0
    f = ckpt.extra["megatron"]
    tp = f["tp"]
    stages = buckets._stages(ckpt.records, f["pp"], bool(f["swiglu"]), ckpt.extra["args"], "")
    for s, params in enumerate(stages):
        for t in range(tp):
            g = s * tp + t
            got = buckets._walk(params, buckets._buckets(ckpt.extra["metadata"], tp * f["pp"], "")[g], g, tp, "")
            (buf,) = buffers[g]
            starts = [b["start"] for b in buf["buckets"]]
            mine = set()
            for n, (states, start, numel) in got.items():
                b = int(next(iter(states.values())).key.split(".bucket_idx_")[1].split(".")[0])
                mine.add((by_name[n].tied_to or n, b, starts[b] + start, starts[b] + start + numel))
            theirs = {(p["name"], p["bucket"], p["start"], p["end"]) for p in buf["params"]}
            assert mine == theirs, (g, sorted(mine ^ theirs))


def test_a_parameter_put_in_anothers_place_is_found_by_its_values():
    import zckpt
    from zckpt.errors import UnsupportedLayout
    from zckpt.megatron import buckets
    ckpt = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp2"))
    placed = dict(ckpt.extra["buckets"])
    a, b = "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight"
    buckets.check_values(ckpt.records, placed)
    placed[a], placed[b] = placed[b], placed[a]
    with pytest.raises(UnsupportedLayout, match="does not cast to its saved bfloat16 weight"):
        buckets.check_values(ckpt.records, placed)


def test_glob_groups_must_cover_every_parameter_and_group(tmp_path):
    res = zckpt_run("convert", MEG / SOURCES[0], "--groups", "*layer_norm*=1", "-o", tmp_path / "o")
    _one_line(res, "matches no GLOB=K")
    res = zckpt_run("convert", MEG / SOURCES[0], "--groups", "*=0", "-o", tmp_path / "o")
    _one_line(res, "param group 1 of the checkpoint gets no parameter")
    res = zckpt_run("convert", MEG / SOURCES[0], "--groups", "*=2", "-o", tmp_path / "o")
    _one_line(res, "has 2 param group(s)")
    assert not (tmp_path / "o").exists()


def test_glob_groups_give_the_same_groups_as_the_rule():
    import zckpt
    from zckpt.megatron.state import training_state
    ckpt = zckpt.open_checkpoint(str(MEG / SOURCES[1]))
    a, b = (training_state(ckpt, g) for g in ("megatron-default", ["*norm*=1", "*=0"]))
    assert [(g.names, g.hyperparams, g.step) for g in a.groups] == [(g.names, g.hyperparams, g.step) for g in b.groups]
    assert a.groups[1].names[-1] == "model.norm.weight" and a.groups[0].names[0] == "model.embed_tokens.weight"


def test_default_rule_is_checked_against_the_files_groups(tmp_path):
    """A run whose groups are not Megatron's standard two (here: the no-decay group saved with wd_mult 1) is
    refused under megatron-default: the files' wd_mult values must be the ones the rule gives."""
    import argparse
    src = tmp_path / "src"
    shutil.copytree(MEG / SOURCES[0], src)
    common = src / "iter_0000003" / "common.pt"
    torch.serialization.add_safe_globals([argparse.Namespace])
    d = torch.load(common, weights_only=True)
    d["optimizer"]["optimizer"]["param_groups"][1]["wd_mult"] = 1.0
    torch.save(d, common)
    res = zckpt_run("convert", src, "--groups", "megatron-default", "-o", tmp_path / "o")
    _one_line(res, "are not the groups megatron-default gives")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("to", [["--to", "dcp"], ["--to", "deepspeed", "--world-size", "2", "--stage", "2",
                                                  "--dtype", "bf16"]])
def test_a_flipped_byte_in_a_moment_is_refused(tmp_path, to):
    import zckpt
    bad = tmp_path / "bad"
    shutil.copytree(MEG / SOURCES[0], bad)
    rec = [r for r in zckpt.open_checkpoint(str(bad)).records if r.kind == "trainable"][3]
    piece = rec.exp_avg[0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset + 2)
        b = f.read(1)
        f.seek(piece.offset + 2)
        f.write(bytes([b[0] ^ 0x10]))
    res = zckpt_run("convert", bad, "--groups", "megatron-default", *to, "-o", tmp_path / "o")
    _one_line(res, "do not match the CRC-32 the file records", "exp_avg of")
    assert not (tmp_path / "o").exists()


def test_a_flipped_byte_in_a_bucket_master_is_named_as_damage(tmp_path):
    """dp_reshardable: the master read to check the placement is also checked against its entry's CRC-32, so one
    flipped byte is reported as a damaged file, not as a layout zckpt does not know; nothing is written."""
    import zckpt
    bad = tmp_path / "bad"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp2", bad)
    placed = zckpt.open_checkpoint(str(bad)).extra["buckets"]
    piece = placed["decoder.layers.1.mlp.linear_fc1.weight"][0][0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset + 5)
        b = f.read(1)
        f.seek(piece.offset + 5)
        f.write(bytes([b[0] ^ 0x40]))
    res = zckpt_run("convert", bad, "--groups", "megatron-default", "--to", "dcp", "-o", tmp_path / "o")
    _one_line(res, "do not match the CRC-32 the file records")
    assert not (tmp_path / "o").exists()
