"""Megatron-Core mixture-of-experts checkpoints saved by Megatron-LM's own ``pretrain_gpt.py`` (fixtures/megatron/
moe16_*: megatron-core 0.16.1 on CPU ranks, SequentialMLP experts, 8 per layer, top-2; generate_lm.py), each with
what Megatron-LM's own ``load_checkpoint`` gives beside it (the oracle):

- ``moe16_ep2_dp4``: 2 MoE layers, expert-parallel 2 x expert-data-parallel 2, ``dp_reshardable`` (the experts'
  state in the second optimizer's buckets), allgather dispatcher;
- ``moe16_etp2_ep2_fullyresh``: 3 layers of which 1 and 2 are MoE (per-layer keys), expert tensor parallelism 2 x
  expert-parallel 2, ``fully_reshardable``;
- ``moe19_ep2_dp4``: ``moe16_ep2_dp4``'s twin saved by megatron-core 0.19.2 (its common state inside the DCP);
- ``moe16_ep1_dp2``: expert-parallel size 1 (the experts are ordinary parameters of the one optimizer and buffer,
  after their layer's router), alltoall dispatcher, ``dp_reshardable``;
- ``moe16_etp2_ep2_dp4``: expert tensor parallelism 2 x ep 2, ``dp_reshardable`` (each expert's state from the
  buckets of its two expert tp ranks);
- ``moe16_ep2_dp2_expertbias``: sigmoid routing with the router's ``expert_bias`` (a persistent buffer).

read (every expert's weight, master and moments equal to the oracle bit for bit; the buckets placed where DDP's own
buffers had them), ``info`` / ``info --json`` (layers x experts, ep, the coverage check), ``verify --deep``; a
deleted data file, an expert missing from or doubled in ``.metadata`` and a flipped byte refused in one line naming
the layer and the expert; ``merge`` under transformers' Mixtral names loaded by ``MixtralForCausalLM``; ``convert``
to DCP loaded by FSDP2 and to DeepSpeed loaded by DeepSpeed, into Mixtral, bit for bit. Megatron is never imported."""

from __future__ import annotations

import json
import os
import pickle
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

ROOT = Path(__file__).resolve().parent.parent
MEG = FIXTURES / "megatron"
DP, FULLY, DP19, EP1 = "moe16_ep2_dp4", "moe16_etp2_ep2_fullyresh", "moe19_ep2_dp4", "moe16_ep1_dp2"
ETP, BIAS = "moe16_etp2_ep2_dp4", "moe16_ep2_dp2_expertbias"
MOE = [DP, FULLY, DP19, EP1, ETP, BIAS]
EXPERT = "decoder.layers.{i}.mlp.experts.experts.{e}.{p}"


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
    return lines[0]


def moe_layers(meta: dict) -> list[int]:
    freq = meta["moe_layer_freq"]
    return [i for i in range(meta["num_layers"]) if (freq[i] if isinstance(freq, list) else i % freq == 0)]


def test_the_fixtures_are_megatron_lms_own_moe_saves():
    for name in MOE:
        meta, _ = oracle(name)
        assert "--mock-data" in meta["megatron_lm_flags"] and meta["oracle_method"].startswith("pretrain_gpt.py")
        assert (meta["num_experts"], meta["moe_router_topk"], meta["moe_grouped_gemm"]) == (8, 2, False)
        assert len(moe_layers(meta)) == 2
    assert {oracle(n)[0]["expert_model_parallel_size"] for n in MOE} == {1, 2}
    assert {oracle(n)[0]["moe_token_dispatcher_type"] for n in MOE} == {"allgather", "alltoall"}
    assert {oracle(n)[0]["expert_tensor_parallel_size"] for n in MOE} == {1, 2}
    assert {oracle(n)[0]["distrib_optim_sharding_type"] for n in MOE} == {"dp_reshardable", "fully_reshardable"}
    assert {oracle(n)[0]["megatron_core"].rsplit(".", 1)[0] for n in MOE} == {"0.16", "0.19"}


@pytest.mark.parametrize("name", MOE)
def test_info_shows_layers_x_experts_ep_and_the_check(name):
    meta, _ = oracle(name)
    res = zckpt_run("info", MEG / name, "--json")
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout)["moe"]
    assert (m["layers"], m["experts"], m["ep"], m["topk"], m["etp"], m["checked"], m["routers"]) == \
        (2, 8, meta["expert_model_parallel_size"], 2, meta["expert_tensor_parallel_size"], True, 2)
    assert m["each_expert_has"] == ["value", "master", "exp_avg", "exp_avg_sq"]
    assert [x["layer"] for x in m["by_layer"]] == [f"decoder.layers.{i}.mlp" for i in moe_layers(meta)]
    text = zckpt_run("info", MEG / name)
    assert f"experts      2 layers x 8 experts, ep {meta['expert_model_parallel_size']}: every expert once" \
        in text.stdout and "(top-2)" in text.stdout, text.stdout


@pytest.mark.parametrize("name", MOE)
def test_verify_deep(name):
    res = zckpt_run("verify", "--deep", MEG / name)
    assert res.returncode == 0 and "complete and consistent" in res.stdout, res.stdout + res.stderr
    assert "ok   MoE experts: 2 layers x 8 experts" in res.stdout


@pytest.mark.parametrize("name", MOE)
def test_every_expert_router_master_and_moment_equals_megatron_lms_load(name):
    meta, want = oracle(name)
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    by_name = ckpt.by_name()
    weights = {k for k in want if not k.startswith(("master.", "exp_avg.", "exp_avg_sq."))}
    buffers = {k for k in weights if k.endswith(".mlp.router.expert_bias")}  # TopKRouter's persistent buffer
    assert bool(buffers) == ("--moe-router-enable-expert-bias" in meta["megatron_lm_flags"])
    for n in buffers:
        r = by_name[n]
        assert r.kind == "buffer" and torch.equal(load_pieces(r.value, r.dtype, r.shape), want[n]), n
    weights -= buffers
    assert {n for n, r in by_name.items() if r.kind == "trainable"} == weights
    experts = [EXPERT.format(i=i, e=e, p=p) for i in moe_layers(meta) for e in range(8)
               for p in ("linear_fc1.weight", "linear_fc2.weight")]
    assert set(experts) <= weights and {f"decoder.layers.{i}.mlp.router.weight" for i in moe_layers(meta)} <= weights
    placed = ckpt.extra.get("buckets")
    assert (placed is not None) == (meta["distrib_optim_sharding_type"] == "dp_reshardable")
    for n in weights:
        r = by_name[n]
        triple = placed[n] if placed else (r.value, r.exp_avg, r.exp_avg_sq)
        if placed:  # the records hold the training-dtype weights; the masters are in the buckets
            assert torch.equal(load_pieces(r.value, r.dtype, r.shape), want[n]), n
        for kind, pieces in zip(("master", "exp_avg", "exp_avg_sq"), triple):
            assert torch.equal(load_pieces(pieces, "float32", r.shape), want[f"{kind}.{n}"]), (kind, n)
    assert ckpt.extra["step"] == meta["iteration"] == 3


@pytest.mark.parametrize("name", [DP, DP19, ETP])
def test_expert_buckets_placed_where_ddps_expert_buffers_had_them(name):
    """Every expert's master and moments come from the DCP chunks of the buckets that start where megatron-core's
    live expert_parallel_buffers had the expert (DDP's param_index_map, recorded by the generator) on each rank of
    the expert tp x ep group (rank g = etp_rank + etp x ep_rank: experts 4 ep_rank .. 4 ep_rank + 3 of both
    layers; with expert tp 2, each of its two ranks holds a shard of each, and the pieces cover both)."""
    meta, _ = oracle(name)
    etp = meta["expert_tensor_parallel_size"]
    ckpt = zckpt.open_checkpoint(str(MEG / name))
    placed, md = ckpt.extra["buckets"], ckpt.extra["metadata"]
    tag_dir = Path(ckpt.location.tag_dir)
    ranks = etp * meta["expert_model_parallel_size"]  # global ranks 0..ranks-1: expert-data-parallel rank 0
    for g in range(ranks):
        (buf,) = meta["dp_expert_buffers_per_rank"][g]
        ep_rank = g // etp
        assert {p["name"] for p in buf["params"]} == {EXPERT.format(i=i, e=e, p=q) for i in (0, 1)
                                                      for e in range(4 * ep_rank, 4 * ep_rank + 4)
                                                      for q in ("linear_fc1.weight", "linear_fc2.weight")}
        for p in buf["params"]:
            lo = buf["buckets"][p["bucket"]]["start"]
            for k, kind in enumerate(("param", "exp_avg", "exp_avg_sq")):
                (te,) = [t for key, t in md.tensors.items() if key.startswith(
                    f"chained_1.optimizer.distributed.dp_group_idx_{g}.") and key.endswith(
                    f"bucket_idx_{p['bucket']}.{kind}")]
                (chunk,) = [c for c in te.chunks if c.offsets[0] == p["start"] - lo]
                assert chunk.sizes[0] == p["end"] - p["start"]
                pieces = placed[p["name"]][k]
                assert sum(x.nbytes for x in pieces) == 4 * etp * (p["end"] - p["start"])
                inside = [x for x in pieces if Path(x.path) == tag_dir / chunk.file and chunk.offset <= x.offset
                          and x.offset + x.nbytes <= chunk.offset + chunk.length]
                assert sum(x.nbytes for x in inside) == 4 * (p["end"] - p["start"]), (p["name"], kind, g)


# ------------------------------------------------------------------------------------------------- damage

def _copy(tmp_path, name) -> Path:
    dst = tmp_path / name
    shutil.copytree(MEG / name, dst)
    return dst / "iter_0000003"


def _metadata(folder: Path):
    """.metadata unpickled by torch's own classes (the test may use pickle; zckpt never does)."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)
    with open(folder / ".metadata", "rb") as fh:
        return pickle.load(fh)


def _expert_chunk(md, param="linear_fc1.weight", layer=1, expert=5):
    key = f"decoder.layers.mlp.experts.experts.{param}"
    for c in md.state_dict_metadata[key].chunks:
        if tuple(c.offsets[:2]) == (layer, expert):
            return key, c
    raise AssertionError("no such chunk")


def test_a_deleted_data_file_is_refused_naming_the_layer_and_expert(tmp_path):
    folder = _copy(tmp_path, DP)
    md = _metadata(folder)
    key, chunk = _expert_chunk(md)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    victim = md.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
    (folder / victim).unlink()
    for cmd in (["info"], ["verify"], ["merge", "-o", tmp_path / "m"]):
        line = one_line(zckpt_run(*cmd, folder.parent), "MoE layer", "expert", victim, "not in the folder")
        assert "decoder.layers." in line
    assert not (tmp_path / "m").exists()


def test_an_expert_missing_from_the_metadata_is_refused_naming_it(tmp_path):
    """A save whose .metadata lacks one expert's chunk (a rank's plan lost): refused by every command, naming layer
    1 and expert 5, exit 1, nothing written."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    folder = _copy(tmp_path, DP)
    md = _metadata(folder)
    key, chunk = _expert_chunk(md, "linear_fc2.weight")
    md.state_dict_metadata[key].chunks.remove(chunk)
    del md.storage_data[MetadataIndex(key, chunk.offsets)]
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    for cmd in (["info"], ["verify"], ["convert", "--groups", "megatron-default", "--to", "dcp", "-o", tmp_path / "d"]):
        one_line(zckpt_run(*cmd, folder.parent), "MoE layer 1 (decoder.layers.1.mlp): expert 5 is missing",
                 "linear_fc2.weight")
    assert not (tmp_path / "d").exists()


def test_a_router_missing_from_the_metadata_is_refused_naming_its_layer(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    folder = _copy(tmp_path, DP19)
    md = _metadata(folder)
    key = "decoder.layers.mlp.router.weight"
    (chunk,) = [c for c in md.state_dict_metadata[key].chunks if c.offsets[0] == 1]
    md.state_dict_metadata[key].chunks.remove(chunk)
    del md.storage_data[MetadataIndex(key, chunk.offsets)]
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    one_line(zckpt_run("verify", folder.parent), "MoE layer 1 (decoder.layers.1.mlp): its router is missing")


def test_an_expert_held_twice_is_refused_naming_it(tmp_path):
    """Expert 5's chunk relabelled as expert 4's (two saves put together): expert 4 held twice."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    folder = _copy(tmp_path, DP)
    md = _metadata(folder)
    key, chunk = _expert_chunk(md, "linear_fc2.weight", 0, 5)
    where = md.storage_data.pop(MetadataIndex(key, chunk.offsets))
    chunk.offsets = torch.Size([0, 4, *chunk.offsets[2:]])
    md.storage_data[MetadataIndex(key, chunk.offsets, 1)] = where
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    one_line(zckpt_run("info", folder.parent), "MoE layer 0 (decoder.layers.0.mlp): expert 4 is held twice")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_an_expert_moment_is_refused_naming_the_expert(tmp_path):
    """fully_reshardable: the exp_avg of layer 2's expert 6 (per-layer keys); verify --deep and convert name it."""
    folder = _copy(tmp_path, FULLY)
    ckpt = zckpt.open_checkpoint(str(folder.parent))
    rec = ckpt.by_name()[EXPERT.format(i=2, e=6, p="linear_fc2.weight")]
    p = rec.exp_avg[0]
    _flip(Path(p.path), p.offset + 3)
    # verify --deep names the file, the item and what it holds: the layer and the expert
    one_line(zckpt_run("verify", "--deep", folder.parent), "NOT consistent", Path(p.path).name,
             "optimizer.state.exp_avg.decoder.layers.2.mlp.experts.experts.linear_fc2.weight: exp_avg of "
             "'decoder.layers.2.mlp.experts.experts.6.linear_fc2.weight'")
    one_line(zckpt_run("convert", folder.parent, "--groups", "megatron-default", "--to", "dcp", "-o", tmp_path / "d"),
             "decoder.layers.2.mlp.experts.experts.6.linear_fc2.weight", "CRC-32")
    assert not (tmp_path / "d").exists()


def test_a_flipped_byte_in_an_expert_bucket_moment_is_refused_naming_the_expert(tmp_path):
    """dp_reshardable: a byte of the expert buckets' exp_avg under layer 1's expert 2: verify --deep names the
    expert; convert names the tensor it is in: Mixtral's fused layer-1 experts, or (--native-names) the expert."""
    folder = _copy(tmp_path, DP)
    ckpt = zckpt.open_checkpoint(str(folder.parent))
    p = ckpt.extra["buckets"][EXPERT.format(i=1, e=2, p="linear_fc1.weight")][1][0]
    _flip(Path(p.path), p.offset + 5)
    one_line(zckpt_run("verify", "--deep", folder.parent), "NOT consistent", Path(p.path).name,
             "chained_1.optimizer.distributed.dp_group_idx_0.", "exp_avg of "
             "'decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight'")
    to = ["--to", "deepspeed", "-w", 2, "--stage", 2, "--dtype", "bf16", "-o", tmp_path / "d"]
    one_line(zckpt_run("convert", folder.parent, "--groups", "megatron-default", *to),
             "exp_avg of 'model.layers.1.mlp.experts.gate_up_proj'", "CRC-32")
    one_line(zckpt_run("convert", folder.parent, "--groups", "megatron-default", "--native-names", *to),
             "exp_avg of 'decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight'", "CRC-32")
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------------------------------------- merge

def mixtral_expected(name: str, kind: str | None = None) -> dict:
    """The oracle under transformers' Mixtral names, split and stacked here with torch's own indexing; ``kind``:
    master / exp_avg / exp_avg_sq (None: the weights)."""
    meta, want = oracle(name)
    t = {k[len(kind) + 1:]: v for k, v in want.items() if k.startswith(kind + ".")} if kind else \
        {k: v for k, v in want.items() if not k.startswith(("master.", "exp_avg.", "exp_avg_sq."))}
    heads, groups, kv = meta["num_attention_heads"], meta["num_query_groups"], meta["kv_channels"]
    per = heads // groups
    d = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"],
         "model.norm.weight": t["decoder.final_layernorm.weight"], "lm_head.weight": t["output_layer.weight"]}
    for i in range(meta["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = t[m + "self_attention.linear_qkv.weight"]
        qkv = qkv.view(groups, per + 2, kv, qkv.shape[-1])
        d[h + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(-1, qkv.shape[-1])
        d[h + "self_attn.k_proj.weight"] = qkv[:, per].reshape(-1, qkv.shape[-1])
        d[h + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(-1, qkv.shape[-1])
        d[h + "self_attn.o_proj.weight"] = t[m + "self_attention.linear_proj.weight"]
        d[h + "input_layernorm.weight"] = t[m + "self_attention.linear_qkv.layer_norm_weight"]
        d[h + "post_attention_layernorm.weight"] = t[m + "mlp.linear_fc1.layer_norm_weight"]
        d[h + "mlp.gate.weight"] = t[m + "mlp.router.weight"]
        d[h + "mlp.experts.gate_up_proj"] = torch.stack([t[EXPERT.format(i=i, e=e, p="linear_fc1.weight")]
                                                         for e in range(meta["num_experts"])])
        d[h + "mlp.experts.down_proj"] = torch.stack([t[EXPERT.format(i=i, e=e, p="linear_fc2.weight")]
                                                      for e in range(meta["num_experts"])])
    return d


def test_merge_writes_a_mixtral_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    meta, _ = oracle(DP)
    out = tmp_path / "hf"
    res = zckpt_run("merge", MEG / DP, "--dtype", "bf16", "-o", out)
    assert res.returncode == 0, res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
            cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]) == \
        ("mixtral", 8, 2, meta["moe_ffn_hidden_size"], meta["norm_epsilon"], meta["rotary_base"], meta["kv_channels"])
    model, info = transformers.MixtralForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16,
                                                                  output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    sd, want = model.state_dict(), mixtral_expected(DP)
    assert set(sd) == set(want)
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def test_merge_with_an_expert_bias_keeps_megatrons_names_with_a_note(tmp_path):
    """Sigmoid routing with a per-expert bias is not Mixtral's router: Megatron's names (the bias included), no
    config.json, a note saying why."""
    _, want = oracle(BIAS)
    out = tmp_path / "hf"
    res = zckpt_run("merge", MEG / BIAS, "-o", out)
    assert res.returncode == 0, res.stderr
    assert "expert_bias' has no Mixtral name" in res.stdout + res.stderr and not (out / "config.json").exists()
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == {k for k in want if not k.startswith(("master.", "exp_avg.", "exp_avg_sq."))}
    assert torch.equal(got["decoder.layers.1.mlp.router.expert_bias"], want["decoder.layers.1.mlp.router.expert_bias"])


def test_merge_of_dense_and_moe_layers_keeps_megatrons_names_with_a_note(tmp_path):
    """Layer 0 is dense (--moe-layer-freq [0,1,1]): not a Mixtral; the weights under Megatron's names, the note
    says why; the fp32 masters equal the oracle's."""
    meta, want = oracle(FULLY)
    out = tmp_path / "hf"
    res = zckpt_run("merge", MEG / FULLY, "-o", out)
    assert res.returncode == 0, res.stderr
    assert "layers [0] are dense" in res.stdout + res.stderr and not (out / "config.json").exists()
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == {k for k in want if not k.startswith(("master.", "exp_avg.", "exp_avg_sq."))}
    for k, v in got.items():
        assert torch.equal(v, want[f"master.{k}"]), k


# ------------------------------------------------------------------------------------------------- convert

def torchrun(tmp: Path, nproc: int, *args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    dump = tmp / f"dump_{args[0]}_{nproc}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
           str(ROOT / "tests" / "megatron_moe_worker.py"), args[0], str(args[1]), str(args[2]), str(dump),
           *map(str, args[3:])]
    proc = ds_oracle.ranks.run(cmd, env=G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}),
                               cwd=str(tmp), timeout=900)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]
    got = {}
    for case in ("fsdp2", "deepspeed"):
        base = f"{dump}_{case}"
        got[case] = {"tensors": load_file(base + ".safetensors"), **json.loads(Path(base + ".json").read_text())}
    return got


def _exact(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


def check_loaded(got: dict) -> None:
    t = got["tensors"]
    want = {k: mixtral_expected(DP, k) for k in ("master", "exp_avg", "exp_avg_sq")}
    assert {k[len("param/"):] for k in t if k.startswith("param/")} == set(want["master"])
    for n in want["master"]:
        for kind, prefix in (("master", "param/"), ("exp_avg", "exp_avg/"), ("exp_avg_sq", "exp_avg_sq/")):
            assert _exact(t[prefix + n], want[kind][n]), (kind, n)
    meta, _ = oracle(DP)
    names = [set(g["names"]) for g in got["groups"]]
    experts = {n for n in want["master"] if ".experts." in n}
    no_wd = {n for n in want["master"] if want["master"][n].ndim == 1}
    assert names == [set(want["master"]) - experts - no_wd, no_wd, experts]
    files = [g for r in meta["param_groups_per_rank"][:1] for g in r]  # rank 0: dense 2 groups, then experts'
    for g, fg in zip(got["groups"], files):
        assert (g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) == \
            (fg["lr"], fg["weight_decay"], tuple(fg["betas"]), fg["eps"])


@pytest.mark.slow
def test_to_dcp_and_deepspeed_load_in_fsdp2_and_deepspeed_mixtral_bit_for_bit(tmp_path):
    """convert --to dcp, loaded by FSDP2 into MixtralForCausalLM at 2 ranks (the source had 4), and convert --to
    deepspeed (ZeRO-2, 2 ranks), loaded by DeepSpeed's engine.load_checkpoint: every master, exp_avg, exp_avg_sq,
    the three groups and the step equal Megatron-LM's own load (one launch runs both loads)."""
    dcp_out, ds_out = tmp_path / "fsdp2", tmp_path / "ds"
    res = zckpt_run("convert", MEG / DP, "--groups", "megatron-default", "--to", "dcp", "-o", dcp_out, "--json")
    assert res.returncode == 0, res.stderr
    res = zckpt_run("convert", MEG / DP, "--groups", "megatron-default", "--to", "deepspeed", "--world-size", 2,
                    "--stage", 2, "--dtype", "bf16", "-o", ds_out, "--json")
    assert res.returncode == 0, res.stderr
    got = torchrun(tmp_path, 2, "both", dcp_out, MEG / f"{DP}.oracle.json", ds_out, 2)
    fsdp2, ds = got["fsdp2"], got["deepspeed"]
    assert fsdp2["world_size"] == 2
    check_loaded(fsdp2)
    for n, v in fsdp2["tensors"].items():
        if n.startswith("step/"):
            assert float(v) == 3.0, n
    assert fsdp2["counters"]["global_steps"] == 3
    check_loaded(ds)
    assert ds["steps"] == [3.0] and ds["global_steps"] == 3


def test_ep1_to_dcp_under_mixtral_names_read_back_by_torch(tmp_path):
    """Expert-parallel size 1: the experts in the dense buffer and groups (2 groups, no expert group); the DCP under
    Mixtral's names, read by torch.distributed.checkpoint's own load, holds the oracle's masters and moments."""
    import torch.distributed.checkpoint as dcp
    out = tmp_path / "dcp"
    res = zckpt_run("convert", MEG / EP1, "--groups", "megatron-default", "--to", "dcp", "-o", out)
    assert res.returncode == 0, res.stderr
    want = {k: mixtral_expected(EP1, k) for k in ("master", "exp_avg", "exp_avg_sq")}
    sd = {f"model.{n}": torch.empty_like(v) for n, v in want["master"].items()}
    sd.update({f"optim.state.{n}.{k}": torch.empty_like(want[k][n]) for n in want["master"]
               for k in ("exp_avg", "exp_avg_sq")})
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for n in want["master"]:
        assert torch.equal(sd[f"model.{n}"], want["master"][n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[f"optim.state.{n}.{k}"], want[k][n]), (k, n)
    # zckpt diff names the Megatron side the same way (Mixtral): every master and moment equal
    res = zckpt_run("diff", MEG / EP1, out)
    assert res.returncode == 0 and "SAME:" in res.stdout and " 0 differ, 0 only in A, 0 only in B" in res.stdout, \
        res.stdout + res.stderr


def test_dense_and_moe_layers_to_dcp_read_back_by_torch(tmp_path):
    """Not a Mixtral (a dense layer): Megatron's names; torch.distributed.checkpoint's own load of the output gives
    the oracle's masters and moments."""
    import torch.distributed.checkpoint as dcp
    meta, want = oracle(FULLY)
    out = tmp_path / "dcp"
    res = zckpt_run("convert", MEG / FULLY, "--groups", "megatron-default", "--to", "dcp", "-o", out)
    assert res.returncode == 0, res.stderr
    names = [k for k in want if not k.startswith(("master.", "exp_avg.", "exp_avg_sq."))]
    sd = {f"model.{n}": torch.empty_like(want[f"master.{n}"]) for n in names}
    sd.update({f"optim.state.{n}.{k}": torch.empty_like(want[f"{k}.{n}"]) for n in names
               for k in ("exp_avg", "exp_avg_sq")})
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for n in names:
        assert torch.equal(sd[f"model.{n}"], want[f"master.{n}"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[f"optim.state.{n}.{k}"], want[f"{k}.{n}"]), (k, n)
