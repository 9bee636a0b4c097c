"""``zckpt convert --to megatron``: a Megatron-LM save folder that megatron-core 0.16.1 itself resumes at other
TP / PP / DP (fixtures/megatron, written by megatron-core 0.16.1, both optimizer layouts as sources).

The oracle is megatron-core's own load (tests/megatron_write_worker.py, one torchrun for every shape): fresh
``GPTModel`` + ``DistributedOptimizer`` + ``OptimizerParamScheduler`` at the new shape, ``dist_checkpointing.load``,
``load_state_dict``; every weight, fp32 master, ``exp_avg`` and ``exp_avg_sq`` bit-equal to the source's oracle
(megatron-core's load of the source), every param group's settings, Adam step and members, the scheduler and the
counters equal, and one more training iteration runs. A round trip (Megatron -> zckpt -> Megatron at the source's
shape) gives the source's tensors back byte for byte. Refusals are one line with nothing written."""

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

ROOT = Path(__file__).resolve().parent.parent
MEG = FIXTURES / "megatron"
# (source, (tp, pp, dp) megatron-core loads the output at): each shape other than the source's; fully_reshardable
# (tp2 pp2, 4 layers), dp_reshardable (Megatron-LM's default: dp2; tied and GELU at pp2; fp32 params, tied; tp2 x
# dp2, tied; per-layer keys)
JOBS = [("gpt_tp2_pp2_dp1_fullyresh", (2, 1, 1)), ("gpt_tp2_pp2_dp1_fullyresh", (1, 2, 1)),
        ("gpt_tp2_pp2_dp1_fullyresh", (1, 1, 2)), ("gpt_tp1_pp1_dp2", (2, 1, 1)), ("gpt_tp1_pp1_dp2", (1, 2, 1)),
        ("gpt_tp1_pp2_dp1_tied", (2, 1, 1)), ("gpt_tp1_pp1_dp2_fp32", (1, 2, 1)), ("gpt_tp2_pp1_dp2", (1, 1, 2)),
        ("gpt_tp1_pp1_dp1_perlayer", (2, 1, 1))]


CHUNKED = ("gpt_tp2_pp2_dp1_fullyresh", (1, 2, 1))
# --layout dp_reshardable (Megatron-LM's default) at another (tp, pp, dp) than the source's: fully_reshardable tp2 pp2
# -> dp2; dp_reshardable dp2 -> pp2; tied tp2 x dp2 -> pp2 (the shared embedding's own buckets); fp32 params -> tp2;
# tied GELU pp2 -> dp2. generate.py's DDP (overlap_grad_reduce off: one bucket) is not in its args: stated.
DDP = "overlap_grad_reduce=false,grad_reduce_in_fp32=true,pad_buckets_for_high_nccl_busbw=false"
DP_JOBS = [("gpt_tp2_pp2_dp1_fullyresh", (1, 1, 2), None), ("gpt_tp1_pp1_dp2", (1, 2, 1), None),
           ("gpt_tp2_pp1_dp2", (1, 2, 1), None), ("gpt_tp1_pp1_dp2_fp32", (2, 1, 1), None),
           ("gpt_tp1_pp2_dp1_tied", (1, 1, 2), None), ("gpt_tp2_pp1_dp2", (2, 1, 1), "dcp"),  # + via Llama names
           ("gpt_tp2_pp2_dp1_fullyresh", (1, 1, 2), "deepspeed")]
# several buckets (overlap_grad_reduce with a bucket size): the first stage's 3 buckets, the last stage's one (pp 2);
# 9 buckets over dp 2 (tied, pp1): megatron-core built with the same DDP settings loads them; each rank's shards
# checked parameter by parameter (megatron_write_worker._direct)
BUCKET_JOBS = [("gpt_tp2_pp2_dp1_fullyresh", (1, 2, 1), 1500), ("gpt_tp1_pp2_dp1_tied", (1, 1, 2), 700)]
# a dp_reshardable output resumed at another data-parallel size (megatron-core reshards these buckets in DP; the
# args stating world_size 1 / data_parallel_size 1 and the DDP settings do not stand in the way): written at dp 1,
# loaded at dp 2 (the buckets' padding, lcm(dp, 128), is the same at both)
RESIZE_JOBS = [("gpt_tp2_pp2_dp1_fullyresh", (1, 1, 1), (1, 1, 2))]
# source (c): a DCP under Hugging Face Llama names (zckpt's own Megatron -> DCP, the q/k/v and gate/up split) with the
# model's config.json beside it, fused back; megatron-core's load must equal the original Megatron source's oracle
DCP_JOBS = [("gpt_tp2_pp2_dp1_fullyresh", (1, 2, 1), "dcp"), ("gpt_tp2_pp1_dp2", (1, 2, 1), "dcp"),
            ("gpt_tp2_pp2_dp1_fullyresh", (2, 1, 1), "deepspeed")]  # source (b): DeepSpeed ZeRO-2 files
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 32, "vocab_size": 64, "rms_norm_eps": 1e-05,
         "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
         "mlp_bias": False, "max_position_embeddings": 16}


def _dcp_of(src: str, out: Path, to: str = "dcp", **config) -> Path:
    """A DCP (or DeepSpeed ZeRO-2 at 2 ranks) checkpoint of the Megatron fixture ``src`` under Llama's names
    (convert --to dcp / deepspeed), its config.json beside it."""
    from zckpt.ops.convert import convert
    more = {"world_size": 2, "stage": 2, "dtype": "bf16"} if to == "deepspeed" else {}
    convert(str(MEG / src), to=to, out=str(out), groups=["megatron-default"], **more)
    meta = json.loads((MEG / f"{src}.oracle.json").read_text())
    cfg = {**LLAMA, "num_hidden_layers": meta["num_layers"], "tie_word_embeddings": meta["tied_embeddings"], **config}
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


def _convert(src, out, **kw):
    from zckpt.ops.convert import convert
    return convert(str(src), to="megatron", out=str(out), **kw)


def _write_dp(src, out, tp, pp, dp, ddp=None):
    """--layout dp_reshardable at (tp, pp, dp), ``ddp``: --ddp-config; the plan."""
    return _convert(src, out, tp=tp, pp=pp, layout="dp_reshardable", dp=dp, ddp_config=ddp).plan


def megatron_jobs(tmp: Path) -> tuple[list, None]:
    """Every job megatron-core loads for this file (written into ``tmp``): the conftest fixture
    ``megatron_core_loads`` runs them in the one launch it shares with tests/test_megatron_from_runs.py."""
    jobs = []
    for i, (src, (tp, pp, dp)) in enumerate(JOBS):
        out = tmp / f"{i}-{src}-tp{tp}pp{pp}"
        _convert(MEG / src, out, tp=tp, pp=pp)
        jobs.append({"source": src, "ckpt": str(out), "shape": [tp, pp, dp]})
    # one more: every tensor stored as blocks of rows over several .distcp files (what a tensor over 256 MiB gets)
    from zckpt.megatron.writer import plan_megatron
    from zckpt.ops.convert import execute
    from zckpt.state import checksums
    from zckpt.state.open import open_checkpoint
    src, (tp, pp, dp) = CHUNKED
    ckpt = open_checkpoint(str(MEG / src))
    out = tmp / "chunked"
    plan = plan_megatron(ckpt, str(out), tp, pp, chunk_bytes=256, file_bytes=64 << 10)
    assert len(plan.parts[0][1].files) > 3 and max(len(i.chunks) for i in plan.parts[0][1].items) > 8
    execute(plan, str(out), check=checksums.input_check(ckpt))
    jobs.append({"source": src, "ckpt": str(out), "shape": [tp, pp, dp]})
    for i, (src, (tp, pp, dp), via) in enumerate(DCP_JOBS):
        out = tmp / f"{via}-{i}-{src}-tp{tp}pp{pp}"
        _convert(_dcp_of(src, tmp / f"{via}-{i}-{src}", via), out, tp=tp, pp=pp)
        jobs.append({"source": src, "ckpt": str(out), "shape": [tp, pp, dp]})
    for i, (src, (tp, pp, dp), via) in enumerate(DP_JOBS):
        out = tmp / f"dp-{i}-{src}-tp{tp}pp{pp}dp{dp}"
        _write_dp(_dcp_of(src, tmp / f"dp-{via}-{i}-{src}", via) if via else MEG / src, out, tp, pp, dp, DDP)
        jobs.append({"source": src, "ckpt": str(out), "shape": [tp, pp, dp]})
    for i, (src, (tp, pp, dp), size) in enumerate(BUCKET_JOBS):
        out = tmp / f"buckets-{i}-{src}-tp{tp}pp{pp}dp{dp}"
        _write_dp(MEG / src, out, tp, pp, dp, DDP.replace("overlap_grad_reduce=false", "overlap_grad_reduce=true") +
                  f",bucket_size={size}")
        jobs.append({"source": src, "ckpt": str(out), "shape": [tp, pp, dp], "direct": True,
                     "ddp": {"overlap_grad_reduce": True, "bucket_size": size}})
    for i, (src, (tp, pp, dp), at) in enumerate(RESIZE_JOBS):
        out = tmp / f"resize-{i}-{src}-tp{tp}pp{pp}dp{dp}"
        _write_dp(MEG / src, out, tp, pp, dp, DDP)
        jobs.append({"source": src, "ckpt": str(out), "shape": list(at)})
    return jobs, None


@pytest.fixture(scope="module")
def loaded(megatron_core_loads):
    """megatron-core's findings for every job (the session's one launch of 2 CPU ranks)."""
    return megatron_core_loads[__name__][0]


@pytest.mark.parametrize("i", range(len(JOBS)), ids=[f"{s}-to-tp{t[0]}pp{t[1]}dp{t[2]}" for s, t in JOBS])
def test_megatron_core_resumes_the_output_at_another_shape(loaded, i):
    got = loaded[i]
    assert got["source"] == JOBS[i][0] and tuple(got["shape"]) == JOBS[i][1]
    assert got["keys_equal"], (got["missing"], got["extra"])  # every weight, master, exp_avg, exp_avg_sq
    assert got["tensors"] > 0 and not got["differ"], got["differ"]  # bit for bit
    assert got["groups_equal"], (got["groups"], got["groups_expected"])  # settings, Adam step, members
    assert all(g["agree"] for g in got["groups"].values())
    assert got["scheduler_equal"], got["scheduler"]
    assert got["iteration"] == got["iteration_expected"] == 3
    src_args = json.loads((MEG / f"{JOBS[i][0]}.oracle.json").read_text())
    assert got["consumed_train_samples"] == 3 * 4 * src_args["dp"]  # the source's: 3 iterations of its batch
    assert got["losses_finite"], got["losses"]  # one more iteration at the new shape


def test_megatron_core_reads_tensors_stored_in_blocks_of_rows(loaded):
    got = loaded[len(JOBS)]
    assert got["source"] == CHUNKED[0] and tuple(got["shape"]) == CHUNKED[1]
    assert got["keys_equal"] and got["tensors"] > 0 and not got["differ"], (got["missing"], got["differ"])
    assert got["groups_equal"] and got["scheduler_equal"] and got["losses_finite"]


@pytest.mark.parametrize("i", range(len(DCP_JOBS)), ids=[f"{s}-via-{v}-to-tp{t[0]}pp{t[1]}dp{t[2]}"
                                                         for s, t, v in DCP_JOBS])
def test_llama_names_are_fused_back_exactly(loaded, i):
    """sources (b) and (c), a DeepSpeed or DCP checkpoint under Hugging Face Llama names: q/k/v fused per query
    group, gate/up fused, layers stacked, weights the masters' bf16 cast: megatron-core's load equals the original
    Megatron checkpoint's, every tensor bit for bit."""
    got = loaded[len(JOBS) + 1 + i]
    assert got["source"] == DCP_JOBS[i][0] and tuple(got["shape"]) == DCP_JOBS[i][1]
    assert got["keys_equal"] and got["tensors"] > 0 and not got["differ"], (got["missing"], got["differ"])
    assert got["groups_equal"] and got["scheduler_equal"] and got["losses_finite"]
    assert got["iteration"] == 3


@pytest.mark.parametrize("i", range(len(DP_JOBS)), ids=[f"{s}{'-via-' + v if v else ''}-to-dp_reshardable-tp{t[0]}"
                                                         f"pp{t[1]}dp{t[2]}" for s, t, v in DP_JOBS])
def test_megatron_core_resumes_dp_reshardable_buckets(loaded, i):
    """--layout dp_reshardable: megatron-core 0.16.1's own dp_reshardable load (its per_bucket_numel_unpadded
    compared with its buffers, each parameter's state taken by position in the buckets) equals the source's oracle
    bit for bit, and one more iteration runs; from Megatron either layout, and from a DCP under Llama names."""
    got = loaded[len(JOBS) + 1 + len(DCP_JOBS) + i]
    assert got["source"] == DP_JOBS[i][0] and tuple(got["shape"]) == DP_JOBS[i][1]
    assert got["keys_equal"] and got["tensors"] > 0 and not got["differ"], (got["missing"], got["differ"])
    assert got["groups_equal"], (got["groups"], got["groups_expected"])  # (its members: megatron-core's own)
    assert got["scheduler_equal"] and got["losses_finite"] and got["iteration"] == 3
    folder = Path(got["ckpt"])
    c = torch.load(str(next(folder.glob("iter_*")) / "common.pt"), weights_only=False)
    assert c["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert c["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}


@pytest.mark.parametrize("i", range(len(BUCKET_JOBS)), ids=[f"{s}-{n}-tp{t[0]}pp{t[1]}dp{t[2]}"
                                                             for s, t, n in BUCKET_JOBS])
def test_megatron_core_loads_several_buckets(loaded, i):
    """overlap_grad_reduce with a bucket size: megatron-core, built with those DDP settings, accepts the buckets
    (per_bucket_numel_unpadded) and holds the source's master and moments in every rank's shard of every
    parameter; at dp 1 its own gather equals the oracle too (at dp 2 that gather misplaces elements of later
    buckets by itself: megatron-core's issue #504, so the shards are compared directly), one more iteration runs.
    Every rank's param groups agree and equal the source's (settings, step, members): at dp 2 data-parallel rank 1
    holds no element of the 1-D (wd_mult 0) group, every norm falling in the first half of its bucket, so it has
    that group with no params and no Adam step, which the worker does not count as a disagreement."""
    got = loaded[len(JOBS) + 1 + len(DCP_JOBS) + len(DP_JOBS) + i]
    assert got["source"] == BUCKET_JOBS[i][0] and tuple(got["shape"]) == BUCKET_JOBS[i][1]
    assert got["direct"] and all(d["checked"] > 0 and not d["bad"] for d in got["direct"]), got["direct"]
    assert got["keys_equal"] and got["scheduler_equal"] and got["losses_finite"] and got["iteration"] == 3
    # every rank's groups agree (a rank holding no element of a group has no Adam step for it: the worker says why)
    assert all(g["agree"] for g in got["groups"].values()) and got["groups_equal"], got["groups"]
    if BUCKET_JOBS[i][1][2] == 1:
        assert got["tensors"] > 0 and not got["differ"], got["differ"]


@pytest.mark.parametrize("i", range(len(RESIZE_JOBS)), ids=[f"{s}-dp{t[2]}-at-dp{a[2]}" for s, t, a in RESIZE_JOBS])
def test_megatron_core_resumes_dp_reshardable_at_another_dp(loaded, i):
    """The args state the output's world and data-parallel sizes (1 here); megatron-core's load at dp 2 reshards the
    buckets in DP and equals the source's oracle bit for bit (Megatron-LM's own load reads neither size from the
    checkpoint: only the rerun state, which zckpt does not write, depends on them)."""
    got = loaded[len(JOBS) + 1 + len(DCP_JOBS) + len(DP_JOBS) + len(BUCKET_JOBS) + i]
    assert got["source"] == RESIZE_JOBS[i][0] and tuple(got["shape"]) == RESIZE_JOBS[i][2]
    c = torch.load(str(next(Path(got["ckpt"]).glob("iter_*")) / "common.pt"), weights_only=False)
    assert (vars(c["args"])["world_size"], vars(c["args"])["data_parallel_size"]) == (1, 1)
    assert got["keys_equal"] and got["tensors"] > 0 and not got["differ"], (got["missing"], got["differ"])
    assert got["groups_equal"] and got["scheduler_equal"] and got["losses_finite"] and got["iteration"] == 3


@pytest.mark.parametrize("i", [0, 2])
def test_zckpt_reads_the_buckets_back_as_the_source(loaded, i):
    """zckpt's own reader places every master and moment in the written buckets (checked against the weights) and
    zckpt diff finds them equal to the source's, across shapes (tp2 pp2 -> dp2; tied tp2 x dp2 -> pp2)."""
    import zckpt
    got = loaded[len(JOBS) + 1 + len(DCP_JOBS) + i]
    out = zckpt.open_checkpoint(got["ckpt"])
    assert out.extra["megatron"]["optimizer_layout"] == "dp_reshardable" and out.extra["bucket_error"] is None
    res = zckpt.diff(str(MEG / DP_JOBS[i][0]), got["ckpt"])
    assert res.ok and " 0 differ, 0 only in A, 0 only in B" in res.to_dict()["summary"], res.to_dict()["summary"]


def test_dp_reshardable_args_say_the_shape_and_ddp_as_megatron_lm_saves_them(tmp_path):
    """A dp_reshardable output states what a Megatron-LM save at its shape holds: world_size (tp x pp x dp),
    data_parallel_size and the DDP settings the buckets were laid out with (Megatron-LM's arg names), so info says
    its data-parallel size and converting it again needs no --ddp-config; a fully_reshardable output states none
    (info: not saved), whatever the source said; the reader never counts ranks from the .distcp files."""
    import zckpt
    from zckpt.ops.info import render_megatron
    _write_dp(MEG / "gpt_tp2_pp2_dp1_fullyresh", tmp_path / "a", 2, 1, 2, DDP + ",bucket_size=none")
    args = vars(torch.load(str(tmp_path / "a" / "iter_0000003" / "common.pt"), weights_only=False)["args"])
    assert {k: args[k] for k in ("world_size", "data_parallel_size", "tensor_model_parallel_size",
                                 "pipeline_model_parallel_size", "overlap_grad_reduce", "ddp_bucket_size",
                                 "accumulate_allreduce_grads_in_fp32", "ddp_pad_buckets_for_high_nccl_busbw")} == \
        {"world_size": 4, "data_parallel_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
         "overlap_grad_reduce": False, "ddp_bucket_size": None, "accumulate_allreduce_grads_in_fp32": True,
         "ddp_pad_buckets_for_high_nccl_busbw": False}
    d = zckpt.info(str(tmp_path / "a")).to_dict()
    assert (d["tp_world_size"], d["pp_world_size"], d["dp_world_size"], d["world_size"]) == (2, 1, 2, 4)
    assert "2 tensor-parallel x 1 pipeline x 2 data-parallel (4 ranks)" in render_megatron(d)
    assert len(list((tmp_path / "a" / "iter_0000003").glob("*.distcp"))) == 1  # one writer, four ranks stated
    again = _convert(tmp_path / "a", tmp_path / "b", layout="dp_reshardable").plan  # its own shape, no --ddp-config
    assert again.dp == 2 and set(again.ddp["from"].values()) == {"args"}, again.ddp
    assert zckpt.diff(str(tmp_path / "a"), str(tmp_path / "b")).ok
    _convert(tmp_path / "a", tmp_path / "c", tp=1)  # fully_reshardable: resumes at any DP, states none
    args = vars(torch.load(str(tmp_path / "c" / "iter_0000003" / "common.pt"), weights_only=False)["args"])
    assert "world_size" not in args and "data_parallel_size" not in args
    d = zckpt.info(str(tmp_path / "c")).to_dict()
    assert (d["dp_world_size"], d["world_size"]) == (None, None)
    assert "data-parallel size not saved" in render_megatron(d)


def test_dp_of_three_pads_buckets_to_lcm_3_128(tmp_path):
    """--dp 3: each bucket padded to a multiple of lcm(3, 128) = 384 and cut into 3 equal shards (every shard
    boundary a chunk boundary; per_bucket_numel says the padded size); zckpt's reader and diff read it back as the
    source."""
    import zckpt
    from zckpt.encoding import distcp
    plan = _write_dp(MEG / "gpt_tp1_pp1_dp2", tmp_path / "o", None, None, 3, DDP)
    assert any("dp_reshardable for dp 3" in n for n in plan.notes)
    out = zckpt.open_checkpoint(str(tmp_path / "o"))
    md = out.extra["metadata"]
    (key, te), = [(k, t) for k, t in md.tensors.items() if k.endswith(".param")]
    items = distcp.Items(out.location.tag_dir, None)
    try:
        v = md.values[key.split(".gbuf_idx_")[0] + ".per_bucket_numel/shard_0_1"]
        (padded,), = [list(d.values())[0] for d in items.load(v.file, v.offset, v.length)[0]]
    finally:
        items.close()
    assert padded % 384 == 0 and padded - 384 < te.shape[0] <= padded, (padded, te.shape)
    edges = {c.offsets[0] for c in te.chunks}
    assert {r * padded // 3 for r in range(3) if r * padded // 3 < te.shape[0]} <= edges
    assert out.extra["bucket_error"] is None
    res = zckpt.diff(str(MEG / "gpt_tp1_pp1_dp2"), str(tmp_path / "o"))
    assert res.ok and " 0 differ, 0 only in A, 0 only in B" in res.to_dict()["summary"]


def test_a_real_dp_reshardable_save_comes_back_as_megatron_saved_it(tmp_path):
    """Megatron-LM's own default save (lm16_tp2_pp1_dp2, pretrain_gpt.py) -> dp_reshardable at its own tp2 pp1 dp2
    (dp and the DDP settings from its args): the same keys, every bucket chunked as megatron-core chunked it, the
    same per_bucket_numel objects and param groups, every weight and every bucket element outside the gaps equal;
    zckpt's reader gives the masters and moments of Megatron-LM's own load (the oracle files)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    import zckpt
    from zckpt.encoding.tensors import load_pieces
    src = MEG / "lm16_tp2_pp1_dp2"
    plan = _write_dp(src, tmp_path / "o", None, None, None)
    assert any("from args" in n for n in plan.notes), plan.notes
    a, b = _dcp_tensors(src, tmp_path, "iter_0000004"), _dcp_tensors(tmp_path / "o", tmp_path)
    ma = FileSystemReader(str(src / "iter_0000004")).read_metadata().state_dict_metadata
    mb = FileSystemReader(str(tmp_path / "o" / "iter_0000004")).read_metadata().state_dict_metadata
    keys = {k for k in ma if not k.startswith("rng_state")}
    assert keys == set(mb), keys ^ set(mb)
    buckets = [k for k in keys if ".bucket_idx_" in k]
    assert len(buckets) == 6  # 2 model-parallel ranks x (param, exp_avg, exp_avg_sq)
    for k in keys:
        if k in buckets:
            chunks = [sorted((tuple(c.offsets), tuple(c.sizes)) for c in m[k].chunks) for m in (ma, mb)]
            assert chunks[0] == chunks[1] and len(chunks[0]) > 10, k
            gaps = b[k] == 0  # zckpt's gaps are zeros; megatron-core's hold whatever memory held
            same = a[k].view(torch.int32) == b[k].view(torch.int32)
            assert bool((same | gaps).all()) and int(same.sum()) > b[k].numel() // 2, k
        elif isinstance(a[k], torch.Tensor):
            assert not _equal(a, b, [k]), k
        else:
            assert a[k] == b[k], k  # param groups, per_bucket_numel(_unpadded), the local spec's extra states
    meta = json.loads((MEG / "lm16_tp2_pp1_dp2.oracle.json").read_text())
    want = load_file(str(MEG / "lm16_tp2_pp1_dp2.oracle.safetensors"))
    ckpt = zckpt.open_checkpoint(str(tmp_path / "o"))
    by_name = ckpt.by_name()
    got = {n: t for n, t in ckpt.extra["buckets"].items() if by_name[n].kind == "trainable"}
    assert ckpt.extra["bucket_error"] is None and got and ckpt.extra["step"] == meta["iteration"] == 4
    assert set(got) == {k[len("master."):] for k in want if k.startswith("master.")}
    for n, triple in got.items():
        for kind, pieces in zip(("master", "exp_avg", "exp_avg_sq"), triple):
            assert torch.equal(load_pieces(pieces, "float32", by_name[n].shape), want[f"{kind}.{n}"]), (kind, n)


def test_a_dcp_without_what_megatron_needs_is_refused(tmp_path):
    dcp = _dcp_of("gpt_tp1_pp1_dp2_fullyresh", tmp_path / "dcp")
    (dcp / "config.json").unlink()
    _refused(tmp_path, dcp, ["no config.json beside the checkpoint"])
    (dcp / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 2, "tie_word_embeddings": False,
                                                 "rope_theta": None}))
    _refused(tmp_path, dcp, ["config.json does not say rope_theta"])
    (dcp / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 2, "tie_word_embeddings": False,
                                                 "model_type": "mistral"}))
    _refused(tmp_path, dcp, ["model_type 'mistral'", "Llama"])
    (dcp / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 3, "tie_word_embeddings": False}))
    _refused(tmp_path, dcp, ["not the config.json's Llama", "missing model.layers.2"])


def test_groups_without_megatrons_settings_are_refused(tmp_path):
    """torch AdamW's groups (an FSDP2 run) have no wd_mult / lr_mult / max_lr / min_lr: refused, not defaulted."""
    import dataclasses
    import zckpt
    from zckpt.errors import UnsupportedLayout
    from zckpt.megatron.from_hf import megatron_groups
    ckpt = zckpt.open_checkpoint(str(_dcp_of("gpt_tp1_pp1_dp2_fullyresh", tmp_path / "dcp")))
    plain = [dataclasses.replace(g, hyperparams={k: v for k, v in g.hyperparams.items() if k != "wd_mult"})
             for g in ckpt.groups]
    with pytest.raises(UnsupportedLayout, match="has no wd_mult"):
        megatron_groups(dataclasses.replace(ckpt, groups=plain), 3)
    swapped = [dataclasses.replace(g, names=o.names) for g, o in zip(ckpt.groups, ckpt.groups[::-1])]
    with pytest.raises(UnsupportedLayout, match="not one of megatron-core's standard groups"):
        megatron_groups(dataclasses.replace(ckpt, groups=swapped), 3)


def _dcp_tensors(folder: Path, tmp: Path, it: str | None = None) -> dict:
    """Every item of the checkpoint's iteration folder (``it``, default the only one), as torch's own DCP reader
    gives it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    it = folder / it if it else next(folder.glob("iter_*"))
    dst = tmp / f"{folder.name}-{len(list(tmp.glob('*.pt')))}.pt"
    dcp_to_torch_save(str(it), str(dst))
    return torch.load(str(dst), weights_only=False)


def _equal(a: dict, b: dict, keys) -> list[str]:
    return [k for k in keys if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                    torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k],
                                                b[k].view(torch.uint8) if b[k].dim() else b[k]))]


def test_round_trip_gives_the_source_back_byte_for_byte(tmp_path):
    """fully_reshardable tp2 pp2 -> zckpt at tp1 pp1 -> zckpt at tp2 pp2: every tensor as the source's."""
    src = MEG / "gpt_tp2_pp2_dp1_fullyresh"
    _convert(src, tmp_path / "one", tp=1, pp=1)
    _convert(tmp_path / "one", tmp_path / "two", tp=2, pp=2)
    a, b = _dcp_tensors(src, tmp_path), _dcp_tensors(tmp_path / "two", tmp_path)
    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor) and not k.startswith("rng_state"))
    assert tensors and set(tensors) <= set(b), set(tensors) - set(b)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in tensors)
    assert not _equal(a, b, tensors)
    c1 = torch.load(str(next(src.glob("iter_*")) / "common.pt"), weights_only=False)
    c2 = torch.load(str(next((tmp_path / "two").glob("iter_*")) / "common.pt"), weights_only=False)
    assert c1["optimizer"] == c2["optimizer"] and c1["opt_param_scheduler"] == c2["opt_param_scheduler"]
    assert (c1["iteration"], c1["num_floating_point_operations_so_far"], c1["content_metadata"]) == \
        (c2["iteration"], c2["num_floating_point_operations_so_far"], c2["content_metadata"])
    assert vars(c2["args"])["tensor_model_parallel_size"] == 2 and vars(c2["args"])["no_save_rng"] is True
    assert {k: v for k, v in vars(c1["args"]).items() if k not in ("world_size", "data_parallel_size")} == \
        {k: v for k, v in vars(c2["args"]).items() if k != "no_save_rng"}


def test_dp_reshardable_source_the_weights_as_saved_and_state_stable(tmp_path):
    """Megatron-LM's default layout -> fully_reshardable: the weights are the source's bytes; converting the output
    again changes nothing."""
    src = MEG / "gpt_tp1_pp1_dp2"
    _convert(src, tmp_path / "one", tp=2)
    _convert(tmp_path / "one", tmp_path / "two", tp=1)
    a, b, c = (_dcp_tensors(p, tmp_path) for p in (src, tmp_path / "one", tmp_path / "two"))
    weights = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor) and not k.startswith(("optimizer.",
                                                                                                   "rng_state")))
    assert weights and not _equal(a, b, weights)
    tensors = sorted(k for k, v in b.items() if isinstance(v, torch.Tensor))
    assert sum(k.startswith("optimizer.state.param.") for k in tensors) == 9
    assert set(tensors) == {k for k, v in c.items() if isinstance(v, torch.Tensor)} and not _equal(b, c, tensors)


# ------------------------------------------------------------------------------------------------ refusals

def _refused(tmp_path, src, words, **kw):
    from zckpt.errors import ZckptError
    out = tmp_path / "out"
    with pytest.raises(ZckptError) as e:
        _convert(src, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
    return e.value


def test_a_vocabulary_that_does_not_divide_into_the_tp_is_refused(tmp_path):
    _refused(tmp_path, MEG / "gpt_tp1_pp1_dp1", ["padded_vocab_size", "64", "--tp 3"], tp=3)


def test_uneven_pipeline_stages_are_refused(tmp_path):
    _refused(tmp_path, MEG / "gpt_tp1_pp1_dp1", ["2 layers", "--pp 3", "uneven"], pp=3)


def test_heads_that_do_not_divide_are_refused(tmp_path):
    _refused(tmp_path, MEG / "gpt_tp1_pp2_dp1_tied", ["num_attention_heads 4", "--tp 8"], tp=8)  # vocab 96 = 8 x 12


def _refused_dp(tmp_path, src, words, tp=None, pp=None, dp=None, ddp=None, kind=None):
    from zckpt.errors import ZckptError
    out = tmp_path / "out"
    with pytest.raises(kind or ZckptError) as e:
        _write_dp(src, out, tp, pp, dp, ddp)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))


def test_dp_reshardable_needs_the_facts_its_buckets_depend_on(tmp_path):
    """generate.py's args do not say the run's DDP settings: refused naming them; another shape without --dp:
    refused (the dp size is the target's, never guessed)."""
    from zckpt.errors import InvalidArgument
    _refused_dp(tmp_path, MEG / "gpt_tp1_pp1_dp1", ["overlap_grad_reduce", "grad_reduce_in_fp32",
                                                    "pad_buckets_for_high_nccl_busbw", "--ddp-config"])
    _refused_dp(tmp_path, MEG / "lm16_tp2_pp1_dp2", ["--dp N"], tp=1, pp=2, kind=InvalidArgument)
    _refused_dp(tmp_path, MEG / "gpt_tp1_pp1_dp1", ["bucket_sizes", "KEY=VALUE"], dp=1, ddp="bucket_sizes=4",
                kind=InvalidArgument)


def test_dp_reshardable_shapes_megatron_core_cannot_save_are_refused(tmp_path):
    """A dp whose shard of a bucket holds only padding (megatron-core asserts 'empty bucket encountered' when it
    saves or loads it); a mixture-of-experts model."""
    import dataclasses
    import zckpt
    from zckpt.errors import UnsupportedLayout
    from zckpt.megatron.writer import plan_megatron
    _refused_dp(tmp_path, MEG / "gpt_tp1_pp1_dp1", ["data-parallel rank", "holds no parameter", "empty bucket"],
                dp=128, ddp=DDP)
    ckpt = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp2"))
    moe = dataclasses.replace(ckpt, extra={**ckpt.extra, "args": {**ckpt.extra["args"], "num_experts": 4}})
    with pytest.raises(UnsupportedLayout, match="mixture-of-experts"):
        plan_megatron(moe, str(tmp_path / "o"), layout="dp_reshardable", dp=2, ddp_config=DDP)


def test_dp_options_for_fully_reshardable_are_refused_not_ignored(tmp_path):
    from zckpt.errors import OptionError
    from zckpt.megatron.writer import plan_megatron
    import zckpt
    ckpt = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp2"))
    for kw in ({"dp": 2}, {"ddp_config": DDP}):
        with pytest.raises(OptionError, match="dp_reshardable"):
            plan_megatron(ckpt, str(tmp_path / "o"), **kw)


def test_tp_for_another_target_is_refused(tmp_path):
    from zckpt.errors import InvalidArgument
    from zckpt.ops.convert import convert
    with pytest.raises(InvalidArgument, match="--tp"):
        convert(str(MEG / "gpt_tp1_pp1_dp2_fullyresh"), to="dcp", out=str(tmp_path / "o"), tp=2,
                groups=["megatron-default"])
    assert not (tmp_path / "o").exists()


def test_a_deepspeed_source_of_another_model_is_refused(tmp_path):
    _refused(tmp_path, FIXTURES / "z2_bf16_ws2", ["no config.json beside the checkpoint"])


def test_an_optimizer_other_than_adam_is_refused(tmp_path):
    bad = tmp_path / "sgd"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp2_fullyresh", bad)
    common = next(bad.glob("iter_*")) / "common.pt"
    c = torch.load(str(common), weights_only=False)
    c["args"].optimizer = "sgd"
    torch.save(c, str(common))
    _refused(tmp_path, bad, ["optimizer is 'sgd'", "Adam"])


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("src", ["gpt_tp1_pp1_dp2_fullyresh", "gpt_tp1_pp1_dp2"])
def test_a_flipped_byte_in_the_source_is_refused(tmp_path, src):
    import zckpt
    bad = tmp_path / "bad"
    shutil.copytree(MEG / src, bad)
    ckpt = zckpt.open_checkpoint(str(bad))
    if ckpt.extra.get("buckets"):  # dp_reshardable: a moment in a bucket
        piece = ckpt.extra["buckets"]["decoder.layers.1.mlp.linear_fc1.weight"][1][0]
    else:
        piece = [r for r in ckpt.records if r.kind == "trainable"][3].exp_avg[0]
    _flip(piece.path, piece.offset + 2)
    _refused(tmp_path, bad, ["CRC-32"])


def test_a_truncated_source_file_is_refused(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(MEG / "gpt_tp2_pp2_dp1_fullyresh", bad)
    data = sorted(next(bad.glob("iter_*")).glob("*.distcp"))[-1]
    os.truncate(data, data.stat().st_size - 100)
    _refused(tmp_path, bad, [data.name])


def test_options_of_other_targets_are_refused_not_ignored(tmp_path):
    from zckpt.errors import InvalidArgument
    for kw in ({"world_size": 2}, {"groups": ["megatron-default"]}, {"native_names": True}, {"dtype": "bf16"}):
        with pytest.raises(InvalidArgument, match="do not apply to --to megatron"):
            _convert(MEG / "gpt_tp1_pp1_dp2_fullyresh", tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_writes_it_and_names_what_does_not_apply(tmp_path):
    src = MEG / "gpt_tp1_pp1_dp2"
    res = _cli("convert", src, "--to", "megatron", "--tp", "2", "-o", tmp_path / "ok", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["format"], doc["source_format"], doc["layout"], doc["tp"], doc["pp"], doc["dp"], doc["ddp"]) == \
        ("megatron", "megatron", "fully_reshardable", 2, 1, None, None)
    assert (tmp_path / "ok" / "latest_checkpointed_iteration.txt").read_text() == "3"
    for bad in (["--to", "dcp", "--tp", "2"], ["--to", "megatron", "--groups", "megatron-default"],
                ["--to", "megatron", "--layout", "trainer"], ["--to", "megatron", "--world-size", "2"]):
        res = _cli("convert", src, *bad, "-o", tmp_path / "no")
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (bad, res.stderr)
        assert "does not apply" in res.stderr, res.stderr
    res = _cli("convert", src, "--to", "megatron", "--tp", "3", "-o", tmp_path / "no")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr and "--tp 3" in res.stderr
    assert not (tmp_path / "no").exists()


def test_cli_writes_dp_reshardable_and_refuses_its_options_elsewhere(tmp_path):
    """--layout dp_reshardable --dp N --ddp-config ...: exit 0, the buckets written; --dp / --ddp-config with
    fully_reshardable or another target: exit 2 naming the option; a dp megatron-core cannot shard: exit 1."""
    src = MEG / "gpt_tp2_pp2_dp1_fullyresh"
    res = _cli("convert", src, "--to", "megatron", "--tp", "1", "--pp", "1", "--layout", "dp_reshardable", "--dp", "2",
               "--ddp-config", DDP, "-o", tmp_path / "ok", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["layout"], doc["tp"], doc["pp"], doc["dp"]) == ("dp_reshardable", 1, 1, 2)
    assert doc["ddp"] == {"bucket_size": None, "grad_dtype": "fp32", "pad_buckets_for_high_nccl_busbw": False,
                          "from": dict.fromkeys(("overlap_grad_reduce", "grad_reduce_in_fp32",
                                                 "pad_buckets_for_high_nccl_busbw"), "--ddp-config")}, doc["ddp"]
    assert any("dp_reshardable for dp 2: buckets per model-parallel rank [1]" in n for n in doc["notes"]), doc["notes"]
    for bad, word in ((["--to", "megatron", "--dp", "2"], "--dp"), (["--to", "megatron", "--ddp-config", DDP],
                                                                     "--ddp-config"),
                      (["--to", "dcp", "--dp", "2"], "--dp")):
        res = _cli("convert", src, *bad, "-o", tmp_path / "no")
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (bad, res.stderr)
        assert word in res.stderr, res.stderr
    res = _cli("convert", src, "--to", "megatron", "--layout", "dp_reshardable", "--dp", "4096", "--ddp-config", DDP,
               "-o", tmp_path / "no")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "empty bucket" in res.stderr
    assert not (tmp_path / "no").exists()


def test_megatron_lms_own_args_are_carried_as_saved(tmp_path):
    """A save by Megatron-LM's pretrain_gpt.py (its whole args Namespace: enums, torch dtypes): common.pt keeps
    every arg as it was, as the same classes (megatron-core's own torch.load, weights_only, reads it), but the
    parallel sizes, no_save_rng and the optimizer layout."""
    pytest.importorskip("megatron.core")
    src = MEG / "lm16_tp2_pp1_dp2"
    _convert(src, tmp_path / "o", tp=1, pp=2)
    a = vars(torch.load(str(src / "iter_0000004" / "common.pt"), weights_only=False)["args"])  # the latest
    out = torch.load(str(tmp_path / "o" / "iter_0000004" / "common.pt"))  # weights_only: megatron's safe globals
    b = vars(out["args"])
    changed = {k for k in set(a) | set(b) if a.get(k) != b.get(k) or type(a.get(k)) is not type(b.get(k))}
    assert changed == {"tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
                       "data_parallel_size", "no_save_rng", "dist_ckpt_optim_fully_reshardable"}, changed
    assert (b["tensor_model_parallel_size"], b["pipeline_model_parallel_size"], b["no_save_rng"]) == (1, 2, True)
    assert type(b["attention_backend"]).__name__ == "AttnBackend" and str(b["params_dtype"]) == "torch.bfloat16"


def test_an_fp16_run_is_refused(tmp_path):
    """fp16 training keeps a loss scaler beside the param groups, which the writer does not carry: refused."""
    bad = tmp_path / "fp16"
    shutil.copytree(MEG / "gpt_tp1_pp1_dp2_fullyresh", bad)
    common = next(bad.glob("iter_*")) / "common.pt"
    c = torch.load(str(common), weights_only=False)
    c["args"].fp16, c["args"].bf16 = True, False
    torch.save(c, str(common))
    _refused(tmp_path, bad, ["fp16", "loss scaler"])


def test_what_is_not_carried_is_said(tmp_path):
    """megatron-core 0.19's save: its per-rank rerun-machine objects and RNG states are listed as left out, with
    why; its common state (a DCP object there) is written as common.pt."""
    plan = _convert(MEG / "lm19_tp2_pp1_dp2", tmp_path / "o", tp=1, pp=2, dry_run=True).plan
    assert set(plan.not_carried) == {"rng_state", "rerun_state_machine_state"}, plan.not_carried
    assert any(n.startswith("left out rerun_state_machine_state") for n in plan.notes)
    assert not (tmp_path / "o").exists()


def test_args_naming_experts_the_files_lack_are_refused(tmp_path):
    """Mixture-of-experts models are written (tests/test_megatron_write_moe.py); args that name experts the files do
    not hold are refused, not written as a dense model."""
    import dataclasses
    import zckpt
    from zckpt.errors import UnsupportedLayout
    from zckpt.megatron.writer import plan_megatron
    ckpt = zckpt.open_checkpoint(str(MEG / "gpt_tp1_pp1_dp2_fullyresh"))
    moe = dataclasses.replace(ckpt, extra={**ckpt.extra, "args": {**ckpt.extra["args"], "num_experts": 4}})
    with pytest.raises(UnsupportedLayout, match="name 4 experts .* no SequentialMLP expert tensor"):
        plan_megatron(moe, str(tmp_path / "o"))


def test_tag_picks_an_older_iteration(tmp_path):
    """A save folder of two iterations (Megatron-LM saved at 2 and 4): --tag 2 writes iter_0000002, named by the
    latest file."""
    _convert(MEG / "lm16_tp2_pp1_dp2", tmp_path / "o", tag="2", tp=1)
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")) == \
        ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "o" / "latest_checkpointed_iteration.txt").read_text() == "2"
    c = torch.load(str(tmp_path / "o" / "iter_0000002" / "common.pt"), weights_only=False)
    assert c["iteration"] == 2 and all(g["step"] == 2.0 for g in c["optimizer"]["optimizer"]["param_groups"])


def test_a_vocabulary_megatron_lm_pads_to_another_size_is_refused(tmp_path):
    """Megatron-LM pads the tokenizer's vocabulary again at the new TP (to a multiple of make_vocab_size_divisible_by
    x TP): 91 tokens pad to 96 at tp 1 and 2, to 128 at tp 4, which the saved 96 rows cannot load into."""
    src = MEG / "lm16_tp1_pp2_dp2_fullyresh"
    _refused(tmp_path, src, ["does not pad to --tp 4", "multiple of 64", "= 128", "96 rows"], tp=4)
    _convert(src, tmp_path / "tp2", tp=2, pp=1)  # 96 at tp 2 too
