"""``zckpt convert --to megatron --megatron-args ...`` of runs Megatron did not train (issue 46, sources (b) and (c)):
a real DeepSpeed ZeRO-2 run of a Hugging Face Llama (``fixtures/trainer/checkpoint-4``: the Trainer, 2 ranks, tied,
2 heads / 1 key-value head), a real ZeRO-3 one (``fixtures/trainer_z3``: untied, 4 heads / 2 key-value heads) and
a real FSDP2 run of one (``fixtures/fsdp2_llama_ws2``: ``dcp.save`` of ``get_state_dict``, 2 ranks, untied, 4 heads
/ 2 key-value heads; ``fixtures/gen_fsdp2_llama.py``).

The oracle is megatron-core 0.16.1's own load (tests/megatron_from_runs_worker.py, in the one torchrun of 2 CPU
ranks this file shares with tests/test_megatron_write.py: tests/megatron_core_loads.py) at two shapes per source
(ZeRO-3: tp 2, which the ZeRO-2 run's one key-value head cannot split, and Megatron-LM's default
``dp_reshardable`` layout at dp 2): every weight, fp32 master, ``exp_avg`` and ``exp_avg_sq`` bit-equal to the
source's as its own framework gives them (DeepSpeed's ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` at save time, ``expected/oracle.safetensors``; torch's DCP reader for the FSDP2
run), fused here with torch (q/k/v per query group, gate/up); megatron-core's two groups with the source's betas,
eps and Adam step;
the ``OptimizerParamScheduler`` Megatron-LM builds from the same flags accepts the checkpoint's (its
``_check_and_set`` asserts each value) and sets the lr megatron-core's own scheduler gives at that step; one more
iteration runs. The flags' arithmetic (megatron/run_args) is checked against megatron-core's scheduler for every
decay style. Refusals are one line with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
FSDP2 = FIXTURES / "fsdp2_llama_ws2"
#: name -> (source, the flags, the model as generate.py's spec, iteration, (tp, pp, dp) shapes megatron-core loads at)
SOURCES = {
    "deepspeed": (TRAINER, "--lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 2 --train-iters 20 "
                           "--global-batch-size 4 --weight-decay 0.01",
                  {"layers": 2, "hidden": 16, "heads": 2, "groups": 1, "ffn": 32, "vocab": 128, "tied": True}, 4,
                  [(1, 2, 1), (1, 1, 2)]),
    "fsdp2": (FSDP2, "--lr=1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-fraction 0.1 --train-iters 10 "
                     "--global-batch-size 4 --weight-decay 0.1 --adam-beta2 0.95",
              {"layers": 2, "hidden": 16, "heads": 4, "groups": 2, "ffn": 32, "vocab": 64, "tied": False}, 3,
              [(2, 1, 1), (1, 2, 1), (1, 1, 2)]),
    # DeepSpeed ZeRO-3, a real Trainer run of an untied GQA Llama (so tp 2), the weight decay Megatron-LM's default
    "deepspeed_z3": (FIXTURES / "trainer_z3" / "checkpoint-4",
                     "--lr 5e-3 --min-lr 5e-4 --lr-decay-style WSD --lr-wsd-decay-style cosine --lr-wsd-decay-iters 4 "
                     "--lr-warmup-fraction 0.05 --train-iters 6 --global-batch-size 4",
                     {"layers": 2, "hidden": 16, "heads": 4, "groups": 2, "ffn": 32, "vocab": 64, "tied": False}, 4,
                     [(2, 1, 1), (1, 2, 1)]),
}
JOBS = [(name, shape) for name, src in SOURCES.items() for shape in src[4]]
# and one in Megatron-LM's default layout: the distributed optimizer's buckets for dp 2 (--layout dp_reshardable,
# the DDP settings generate.py's _build runs with)
DP_JOB = len(JOBS)
JOBS.append(("deepspeed_z3", (1, 1, 2)))
DDP = "overlap_grad_reduce=false,grad_reduce_in_fp32=true,pad_buckets_for_high_nccl_busbw=false"


def _convert(src, out, **kw):
    from zckpt.ops.convert import convert
    return convert(str(src), to="megatron", out=str(out), **kw)


def _flags(text: str) -> dict:
    """The flags as argparse would read them (``--x=v`` or ``--x v``), for the oracle's own arithmetic."""
    words, out = text.replace("=", " ").split(), {}
    for k, v in zip(words[::2], words[1::2]):
        out[k[2:].replace("-", "_")] = v
    return out


def _scheduler_args(text: str) -> dict:
    """What Megatron-LM 0.16.1's ``get_optimizer_param_scheduler`` passes ``OptimizerParamScheduler`` for these
    (iteration-based) flags after ``validate_args`` (megatron/training/training.py, arguments.py)."""
    f = _flags(text)
    gbs, iters = int(f["global_batch_size"]), int(f["train_iters"])
    decay = int(f.get("lr_decay_iters", iters)) * gbs
    warmup = float(f["lr_warmup_fraction"]) * decay if "lr_warmup_fraction" in f else \
        int(f.get("lr_warmup_iters", 0)) * gbs
    wd = float(f.get("weight_decay", 0.01))
    wsd = int(f["lr_wsd_decay_iters"]) * gbs if "lr_wsd_decay_iters" in f else None
    return {"init_lr": float(f.get("lr_warmup_init", 0.0)), "max_lr": float(f["lr"]),
            "min_lr": float(f.get("min_lr", 0.0)), "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": f.get("lr_decay_style", "linear"), "start_wd": wd, "end_wd": wd,
            "wd_incr_steps": iters * gbs, "wd_incr_style": "constant", "wsd_decay_steps": wsd,
            "lr_wsd_decay_style": f.get("lr_wsd_decay_style", "exponential")}


def _megatron_lr(text: str, iteration: int) -> tuple[float, float, dict]:
    """megatron-core's own scheduler stepped as training steps it (one global batch per iteration): the lr and the
    weight decay it gives a group, and its state_dict."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Opt:
        param_groups = [{"wd_mult": 1.0}]
    s = OptimizerParamScheduler(Opt(), **_scheduler_args(text))
    for _ in range(iteration):
        s.step(increment=int(_flags(text)["global_batch_size"]))
    return Opt.param_groups[0]["lr"], Opt.param_groups[0]["weight_decay"], s.state_dict()


def _fused(get, cfg: dict, tied: bool) -> dict:
    """Megatron's names (model.state_dict's, global layer numbers) -> tensors, from ``get(hf_name)``: q/k/v per query
    group, gate/up, as megatron-core lays its fused weights out."""
    heads, groups, kv = cfg["heads"], cfg["groups"], cfg["hidden"] // cfg["heads"]
    per = heads // groups
    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": get("model.norm.weight")}
    if not tied:
        out["output_layer.weight"] = get("lm_head.weight")
    for i in range(cfg["layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = torch.cat(
            [t for g in range(groups) for t in (q[g * per * kv:(g + 1) * per * kv], k[g * kv:(g + 1) * kv],
                                               v[g * kv:(g + 1) * kv])])
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = get(p + "input_layernorm.weight")
        out[m + "self_attention.linear_proj.weight"] = get(p + "self_attn.o_proj.weight")
        out[m + "mlp.linear_fc1.layer_norm_weight"] = get(p + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        out[m + "mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
    return out


def _expected(name: str, tmp: Path) -> Path:
    """The source's state as its framework gives it, under Megatron's names: weights (bf16), master.*, exp_avg.*,
    exp_avg_sq.* (fp32)."""
    from safetensors.torch import load_file, save_file
    src, _, cfg, _, _ = SOURCES[name]
    if name.startswith("deepspeed"):  # DeepSpeed's own per-parameter API inside the run, at the save
        o = load_file(str(Path(src).parent / "expected" / "oracle.safetensors"))
        kinds = {"": lambda n: o[f"module/{n}"], "master.": lambda n: o[f"fp32/{n}"],
                 "exp_avg.": lambda n: o[f"exp_avg/{n}"], "exp_avg_sq.": lambda n: o[f"exp_avg_sq/{n}"]}
    else:  # torch's own DCP reader
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(str(src), str(tmp / "fsdp2.pt"))
        sd = torch.load(str(tmp / "fsdp2.pt"), weights_only=False)
        model, st = sd["model"], sd["optim"]["state"]
        kinds = {"": lambda n: model[n].to(torch.bfloat16), "master.": lambda n: model[n],
                 "exp_avg.": lambda n: st[n]["exp_avg"], "exp_avg_sq.": lambda n: st[n]["exp_avg_sq"]}
    out = {}
    for prefix, get in kinds.items():
        out.update({prefix + k: v.contiguous() for k, v in _fused(get, cfg, cfg["tied"]).items()})
    path = tmp / f"{name}.expected.safetensors"
    save_file(out, str(path))
    return path


def megatron_jobs(tmp: Path) -> tuple[list, dict]:
    """Every job megatron-core loads for this file (written into ``tmp``) and their plans: the conftest fixture
    ``megatron_core_loads`` runs them in the one launch it shares with tests/test_megatron_write.py."""
    jobs, plans = [], {}
    for i, (name, (tp, pp, dp)) in enumerate(JOBS):
        src, flags, cfg, _, _ = SOURCES[name]
        out = tmp / f"{i}-{name}-tp{tp}pp{pp}"
        more = {"layout": "dp_reshardable", "dp": dp, "ddp_config": DDP} if i == DP_JOB else {}
        plans[i] = _convert(src, out, tp=tp, pp=pp, megatron_args=flags, **more).plan
        expected = tmp / f"{name}.expected.safetensors"
        if not expected.exists():
            _expected(name, tmp)
        jobs.append({"name": name, "ckpt": str(out), "shape": [tp, pp, dp], "expected": str(expected),
                     "spec": {**cfg, "swiglu": True, "dtype": "bf16"}, "scheduler_args": _scheduler_args(flags)})
    return jobs, plans


@pytest.fixture(scope="module")
def loaded(megatron_core_loads):
    """megatron-core's findings for every job (the session's one launch of 2 CPU ranks) and the plans."""
    return megatron_core_loads[__name__]


def _members(cfg: dict) -> tuple[list[str], list[str]]:
    """megatron-core's standard groups: (wd_mult 1: two or more dimensions; wd_mult 0: 1-D), Megatron's names."""
    names = _fused(lambda n: torch.zeros(0), cfg, cfg["tied"])
    one = sorted(n for n in names if "layer_norm" in n or "final_layernorm" in n)
    return sorted(set(names) - set(one)), one


@pytest.mark.parametrize("i", range(len(JOBS)), ids=[f"{n}-to-tp{s[0]}pp{s[1]}dp{s[2]}" +
                                                     ("-dp_reshardable" if i == DP_JOB else "")
                                                     for i, (n, s) in enumerate(JOBS)])
def test_megatron_core_resumes_a_genuine_run(loaded, i):
    results, plans = loaded
    got, (name, shape) = results[i], JOBS[i]
    src, flags, cfg, iteration, _ = SOURCES[name]
    assert got["name"] == name and tuple(got["shape"]) == shape
    assert got["sharding"] == ("dp_reshardable" if i == DP_JOB else "fully_reshardable")
    args = vars(torch.load(str(next(Path(got["ckpt"]).glob("iter_*")) / "common.pt"),
                           weights_only=False)["args"])
    sizes = {k: args.get(k) for k in ("world_size", "data_parallel_size", "overlap_grad_reduce", "ddp_bucket_size",
                                      "accumulate_allreduce_grads_in_fp32", "ddp_pad_buckets_for_high_nccl_busbw")}
    assert sizes == ({"world_size": 2, "data_parallel_size": 2, "overlap_grad_reduce": False, "ddp_bucket_size": None,
                      "accumulate_allreduce_grads_in_fp32": True, "ddp_pad_buckets_for_high_nccl_busbw": False}
                     if i == DP_JOB else dict.fromkeys(sizes)), sizes  # as Megatron-LM's save at that shape; else none
    assert got["keys_equal"], (got["missing"], got["extra"])  # every weight, master, exp_avg, exp_avg_sq
    assert got["tensors"] > 0 and not got["differ"], got["differ"]  # bit for bit
    import zckpt
    source_groups = zckpt.open_checkpoint(str(src)).groups
    lr, wd, sched = _megatron_lr(flags, iteration)
    assert got["scheduler"] == sched  # and sched.load_state_dict asserted each value against the flags' own
    decayed, plain = _members(cfg)
    assert set(got["groups"]) == {"0.0", "0.1"}, got["groups"]
    for key, members, mult in (("0.0", decayed, 1.0), ("0.1", plain, 0.0)):
        g = got["groups"][key]
        assert g["agree"] and g["params"] == members, (key, g["params"], members)
        s = g["settings"]
        assert (s["wd_mult"], s["lr_mult"], s["is_decoupled_lr"]) == (mult, 1.0, False)
        assert s["adam_step"] == [iteration]
        assert (tuple(s["betas"]), s["eps"]) == (tuple(source_groups[0].hyperparams["betas"]),
                                                 source_groups[0].hyperparams["eps"])
        assert s["lr"] == lr and s["weight_decay"] == wd * mult  # megatron-core's scheduler at the source's step
    src_wd = {h.hyperparams["weight_decay"] for h in source_groups}
    assert src_wd == {wd, 0.0}  # the source's decay is what the flags state
    assert got["iteration"] == iteration
    assert got["consumed_train_samples"] == iteration * int(_flags(flags)["global_batch_size"])
    assert got["losses_finite"], got["losses"]  # one more iteration at the new shape
    doc = plans[i].summary()["megatron_args"]  # --json's account
    assert doc["iteration"] == iteration and doc["lr"] == lr and doc["opt_param_scheduler"] == sched


# ------------------------------------------------------------------------------------------------ the flags

@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD/exponential",
                                   "WSD/linear", "WSD/cosine", "WSD/minus_sqrt"])
def test_the_flags_make_megatron_cores_scheduler(style):
    """run_args' scheduler (state, lr, weight decay) equals megatron-core's OptimizerParamScheduler built as
    get_optimizer_param_scheduler builds it, at every step of a run (warm-up, decay, past the end)."""
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from zckpt.megatron import run_args
    decay, _, wsd = style.partition("/")
    text = (f"--lr 3e-4 --min-lr 3e-5 --lr-decay-style {decay} --lr-warmup-iters 3 --lr-warmup-init 1e-5 "
            "--train-iters 30 --lr-decay-iters 25 --global-batch-size 8 --weight-decay-incr-style cosine "
            "--start-weight-decay 0.01 --end-weight-decay 0.1")
    if wsd:
        text += f" --lr-wsd-decay-style {wsd} --lr-wsd-decay-iters 10"
    a = run_args.parse(text)
    s = run_args.schedule(a)

    class Opt:
        param_groups = [{"wd_mult": 1.0}]
    ref = OptimizerParamScheduler(Opt(), **{k: v for k, v in s.items()})
    for it in range(35):
        n = it * 8
        assert run_args.state_dict(s, n) == ref.state_dict()
        assert (run_args.lr_at(s, n), run_args.wd_at(s, n)) == (Opt.param_groups[0]["lr"],
                                                                Opt.param_groups[0]["weight_decay"]), (style, it)
        ref.step(increment=8)


def test_sample_based_flags(tmp_path):
    from zckpt.megatron import run_args
    s = run_args.schedule(run_args.parse("--lr 1e-3 --train-samples 800 --lr-warmup-samples 40 --global-batch-size 8"))
    assert (s["lr_decay_steps"], s["lr_warmup_steps"], s["wd_incr_steps"]) == (800, 40, 800)
    s = run_args.schedule(run_args.parse(["--lr", "1e-3", "--train-iters", "100", "--lr-warmup-fraction", "0.1",
                                          "--global-batch-size", "8"]))
    assert (s["lr_decay_steps"], s["lr_warmup_steps"], s["start_wd"]) == (800, 80.0, 0.01)  # Megatron's default


# ------------------------------------------------------------------------------------------------ refusals

def _refused(tmp_path, src, words, exc=None, **kw):
    from zckpt.errors import OptionError, ZckptError
    out = tmp_path / "out"
    with pytest.raises(exc or ZckptError) as e:
        _convert(src, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
    return isinstance(e.value, OptionError)


OK = SOURCES["deepspeed"][1]


def test_a_genuine_run_without_the_flags_is_refused_naming_them(tmp_path):
    assert _refused(tmp_path, TRAINER, ["--megatron-args", "--lr", "--global-batch-size", "--train-iters"])
    assert _refused(tmp_path, FSDP2, ["--megatron-args", "--lr"])
    assert _refused(tmp_path, TRAINER, ["--global-batch-size", "--train-iters", "not given"], megatron_args="--lr 1e-3")


@pytest.mark.parametrize("flags, words", [
    ("--micro-batch-size 2", ["'--micro-batch-size' is not a flag zckpt reads"]),
    ("--lr", ["--lr needs a value"]),
    ("--lr 1e-3 --lr 2e-3", ["--lr is given twice"]),
    ("--lr fast", ["--lr 'fast' is not a number"]),
    ("--lr-decay-style exp", ["'exp' is not one of"]),
    ("lr=3", ["'lr=3' is not a flag"]),
])
def test_a_flag_not_understood_is_refused(tmp_path, flags, words):
    assert _refused(tmp_path, TRAINER, words, megatron_args=flags)


@pytest.mark.parametrize("extra, words", [
    ("--weight-decay 0.1", ["weight decay 0.01", "is 0.1"]),  # the source's decayed group: 0.01
    ("--weight-decay 0.01 --adam-beta2 0.95", ["--adam-beta2 0.95", "0.999"]),
    ("--weight-decay 0.01 --global-batch-size 8", ["16 samples", "= 32"]),  # the run's 4 iterations of 4
    ("--weight-decay 0.01 --lr-warmup-iters 40", ["warm-up is not shorter than the decay"]),
    ("--weight-decay 0.01 --train-samples 80", ["--train-samples with --train-iters"]),
])
def test_a_contradiction_with_the_source_or_megatron_is_refused(tmp_path, extra, words):
    base = "--lr 5e-3 --train-iters 20 --global-batch-size 4"
    flags = base if "--global-batch-size" not in extra else base.replace(" --global-batch-size 4", "")
    assert _refused(tmp_path, TRAINER, words, megatron_args=f"{flags} {extra}")


@pytest.mark.parametrize("length, words", [
    ("--train-iters 3", ["--train-iters 3 is not past the source's iteration 4", "stop at once"]),
    ("--train-iters 4", ["--train-iters 4 is not past"]),  # Megatron-LM trains while iteration < train_iters
    ("--train-samples 19", ["--train-samples 19 (4 iterations", "16 samples (iteration 4)"]),
])
def test_a_run_that_ends_at_the_source_is_refused(tmp_path, length, words):
    """--train-iters (--train-samples) not past the source's iteration (samples): Megatron-LM would stop at once,
    so nothing is written (exit 2); one more iteration (--train-samples 20) is written."""
    assert _refused(tmp_path, TRAINER, words, megatron_args=f"--lr 5e-3 {length} --global-batch-size 4 "
                                                             "--weight-decay 0.01")
    if "samples" in length:
        _convert(TRAINER, tmp_path / "ok", megatron_args="--lr 5e-3 --train-samples 20 --global-batch-size 4 "
                                                        "--weight-decay 0.01", dry_run=True)


def test_a_group_layout_other_than_megatrons_is_refused(tmp_path):
    """A 1-D parameter trained with weight decay (not megatron-core's split), groups at different lrs, amsgrad."""
    import dataclasses
    import zckpt
    from zckpt.errors import OptionError, UnsupportedLayout
    from zckpt.megatron import run_args
    ckpt = zckpt.open_checkpoint(str(FSDP2))
    a = run_args.parse(SOURCES["fsdp2"][1])
    one = [dataclasses.replace(ckpt.groups[0], names=ckpt.groups[0].names + ckpt.groups[1].names)]
    with pytest.raises(OptionError, match="trained 'model.layers.0.input_layernorm.weight' with weight decay 0.1"):
        run_args.megatron_groups(dataclasses.replace(ckpt, groups=one), dict(a), 3)
    lrs = [dataclasses.replace(g, hyperparams={**g.hyperparams, "lr": 1e-3 * (i + 1)})
           for i, g in enumerate(ckpt.groups)]
    with pytest.raises(UnsupportedLayout, match="different learning rates"):
        run_args.megatron_groups(dataclasses.replace(ckpt, groups=lrs), dict(a), 3)
    silent = [dataclasses.replace(g, hyperparams={k: v for k, v in g.hyperparams.items()
                                                  if k != "decoupled_weight_decay"}) for g in ckpt.groups]
    for mode in (None, False):  # DeepSpeed's FusedAdam / CPUAdam groups do not say; its config may (adam_w_mode)
        with pytest.raises(UnsupportedLayout, match=f"did not decouple its weight decay.*: {mode}"):
            run_args.megatron_groups(dataclasses.replace(ckpt, groups=silent), dict(a), 3, mode)
    assert run_args.megatron_groups(dataclasses.replace(ckpt, groups=silent), dict(a), 3, True)[0]
    ams = [dataclasses.replace(g, hyperparams={**g.hyperparams, "amsgrad": True}) for g in ckpt.groups]
    with pytest.raises(UnsupportedLayout, match="amsgrad"):
        run_args.megatron_groups(dataclasses.replace(ckpt, groups=ams), dict(a), 3)


def test_a_source_that_is_not_llama_is_refused(tmp_path):
    bad = tmp_path / "src"
    import shutil
    shutil.copytree(FSDP2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    _refused(tmp_path, bad, ["model_type 'mistral'"], megatron_args=SOURCES["fsdp2"][1])
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "llama3",
                                                                              "rope_theta": 5e5}}))
    _refused(tmp_path, bad, ["rope_type 'llama3'"], megatron_args=SOURCES["fsdp2"][1])
    _refused(tmp_path, FIXTURES / "z2_bf16_ws2", ["no config.json"], megatron_args=OK)


def test_the_flags_for_a_megatron_source_are_refused_not_ignored(tmp_path):
    assert _refused(tmp_path, FIXTURES / "megatron" / "gpt_tp1_pp1_dp2_fullyresh",
                    ["--megatron-args does not apply", "carried as saved"], megatron_args=OK)
    from zckpt.errors import OptionError
    from zckpt.ops.convert import convert
    with pytest.raises(OptionError, match="--megatron-args"):
        convert(str(TRAINER), to="dcp", out=str(tmp_path / "o"), megatron_args=OK)
    assert not (tmp_path / "o").exists()


def test_the_flags_for_megatrons_state_under_llama_names_are_refused(tmp_path):
    """zckpt's Megatron -> DCP holds Megatron's own scheduler and group settings: --megatron-args would replace
    them, so it is refused (never silently preferred to the source's, nor ignored)."""
    from tests.test_megatron_write import _dcp_of
    dcp = _dcp_of("gpt_tp1_pp1_dp2_fullyresh", tmp_path / "dcp")
    assert _refused(tmp_path, dcp, ["--megatron-args does not apply", "Megatron's own scheduler"], megatron_args=OK)
    _convert(dcp, tmp_path / "ok")  # without it: carried as saved


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_json_and_exit_status(tmp_path):
    res = _cli("convert", TRAINER, "--to", "megatron", "--pp", "2", "-o", tmp_path / "ok", "--megatron-args", OK,
               "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    lr, _, sched = _megatron_lr(OK, 4) if _has_mcore() else (None, None, None)
    m = doc["megatron_args"]
    assert m["flags"]["--lr"] == 5e-3 and m["iteration"] == 4 and m["consumed_train_samples"] == 16
    assert lr is None or (m["lr"] == lr and m["opt_param_scheduler"] == sched)
    assert {"scheduler.pt", "trainer_state.json", "rng_state_0.pth"} <= set(doc["not_carried"])  # never silent
    c = torch.load(str(tmp_path / "ok" / "iter_0000004" / "common.pt"), weights_only=False)
    assert c["opt_param_scheduler"] == m["opt_param_scheduler"]
    args = vars(c["args"])
    assert (args["lr"], args["global_batch_size"], args["train_iters"], args["consumed_train_samples"],
            args["adam_beta2"]) == (5e-3, 4, 20, 16, 0.999)
    for bad, code in ((["--to", "megatron", "--megatron-args", "--seq-length 16"], 2),
                      (["--to", "megatron"], 2),
                      (["--to", "dcp", "--megatron-args", OK], 2),
                      (["--to", "megatron", "--megatron-args", OK + " --adam-eps 1e-6"], 2),
                      (["--to", "megatron", "--megatron-args", OK.replace("--train-iters 20", "--train-iters 3")],
                       2)):
        res = _cli("convert", TRAINER, *bad, "-o", tmp_path / "no")
        assert res.returncode == code and len(res.stderr.strip().splitlines()) == 1, (bad, res.stderr)
        assert "Traceback" not in res.stderr and not (tmp_path / "no").exists()


def _has_mcore() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True
