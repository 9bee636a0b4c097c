"""Reshard of the data-parallel dimension of mixture-of-experts checkpoints, checked by real DeepSpeed.

The fixtures ``fixtures/moe_*`` (native ``deepspeed.moe.layer.MoE`` through ``fixtures/gen_parallel.py``, AutoEP
through ``fixtures/gen_autoep.py``; DeepSpeed 0.19.8, ZeRO-2 bf16) are resharded to another data-parallel size,
the expert-parallel size kept, then loaded at that size: torchrun at the new size on CPU ranks (gloo) rebuilds the
same model from another seed (buffers scrambled, another learning rate), loads the output with a plain
``engine.load_checkpoint(out)`` (or the source itself with ``zckpt.deepspeed.load_checkpoint``) and captures the
live state as the fixture generator did (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, module
weights, buffers, step, lr, global steps, client state; experts under their global ids). It must equal the source
fixture's ``expected/oracle.*`` bit for bit. The engine then saves again at the new size, and every file of that
tag must equal ours (tensors byte for byte; ``ds_config`` / ``ds_version`` aside). Two shapes no committed fixture
has are made by real DeepSpeed inside their test (``fixtures/generate.py``): the BF16 optimizer with MoE, and two
MoE layers of ep 2 and ep 1. Without DeepSpeed: N -> M -> N gives back every source file, the refusals are one
line, and the CLI reports the plan with ``--json``.

Run as a script, this file is the torchrun worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"


def _launch(job: dict, nproc: int, timeout: float = 600) -> None:
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zckpt-moe-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(Path(__file__).resolve()),
               str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed MoE load at {nproc} ranks failed (rc={proc.returncode}):\n"
                               + proc.stdout.decode(errors="replace")[-6000:])


def _load(engine, job: dict):
    """Load the job's checkpoint the job's way; returns (client_state, what zckpt's resume reported)."""
    if job["mode"] == "zckpt":
        import zckpt.deepspeed
        _, client = zckpt.deepspeed.load_checkpoint(engine, job["ckpt"])
        info = engine.zckpt_resume_info
        return client, {"mode": info.mode, "source_world_size": info.source_world_size,
                        "world_size": info.world_size}
    load_path, client = engine.load_checkpoint(job["ckpt"], load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
    assert load_path is not None, "load_checkpoint returned None"
    return client, None


def _native_worker(job: dict) -> None:
    import re

    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups
    import gen_parallel as P
    from tests import ds_oracle

    G = ds_oracle.generate_module()
    spec = dict(job["spec"], expected=False)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec["seed"] + 99)
    model = P.build_moe(dict(spec, seed=spec["seed"] + 99))  # another init: all must come from the files
    with torch.no_grad():
        for _, buf in model.named_buffers():
            buf.add_(3.0)
    pg = {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense", "lr": spec["lr"] / 3,
          "weight_decay": 0.01}
    split = {"max_group_size": spec["max_group_size"]} if spec.get("max_group_size") else {}  # the run's cut
    opt = torch.optim.AdamW(split_params_into_different_moe_groups_for_optimizer([pg], **split), lr=spec["lr"] / 3,
                            betas=(0.9, 0.95), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=P._config(G, spec))
    client_state, resumed = _load(engine, job)
    moes = {n: m for n, m in model.named_modules() if type(m).__name__ == "MoE"}
    ep_of = {n: (groups._get_expert_parallel_rank(m.expert_group_name), m.num_local_experts)
             for n, m in moes.items()}
    ep_rank = ep_of["moe"][0]
    pat = re.compile(r"^(.*?)(\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)\.")

    def rename(name):  # local expert ids -> global ones, per MoE layer (as gen_parallel.moe_worker)
        def sub(m):
            er, nl = ep_of[m.group(1)]
            return f"{m.group(1)}{m.group(2)}{er * nl + int(m.group(3))}."
        return pat.sub(sub, name)

    tensors, info = P._capture(G, engine, model, spec, rename)
    client = {k: v for k, v in (client_state or {}).items() if isinstance(v, (int, float, str))}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, ep_rank)
    P._gather_and_write(G, dist, spec, Path(job["out"]), tensors, info,
                        {"client_state": client, "ep_ranks": ranks, "resumed": resumed,
                         "loaded_dp": engine.dp_world_size})
    if job.get("resave"):
        tag = (Path(job["ckpt"]) / "latest").read_text().strip()
        engine.save_checkpoint(job["resave"], tag=tag, client_state=client)
    G._finish(dist)


def _autoep_worker(job: dict) -> None:
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from transformers import MixtralConfig, MixtralForCausalLM
    import gen_autoep as A
    from tests import ds_oracle

    G = ds_oracle.generate_module()
    spec = job["spec"]
    deepspeed.init_distributed(dist_backend="gloo")
    A._registry_shim()
    torch.manual_seed(spec["seed"] + 99)
    m = A.MODEL
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], num_local_experts=m["experts"],
        num_experts_per_tok=m["top_k"], max_position_embeddings=64))
    cfg = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": spec["stage"]}, "bf16": {"enabled": spec["dtype"] == "bf16"},
           "expert_parallel": {"enabled": True, "autoep_size": int(spec["ep_size"]), "preset_model": "mixtral",
                               "use_grouped_mm": False},
           "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"] / 3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    _, resumed = _load(engine, job)
    G._relink_hp_optimizer_state(engine)
    mine = A._capture(G, engine, model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out = Path(job["out"])
        A._expected(G, spec, out, engine, model, gathered, dist.get_world_size())
        info = json.loads((out / "expected" / "oracle.json").read_text())
        info["resumed"] = resumed
        info["lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
        (out / "expected" / "oracle.json").chmod(0o644)
        (out / "expected" / "oracle.json").write_text(json.dumps(info))
    if job.get("resave"):
        engine.save_checkpoint(job["resave"], tag=(Path(job["ckpt"]) / "latest").read_text().strip())
    G._finish(dist)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(FIX))
    _job = json.loads(Path(sys.argv[1]).read_text())
    (_autoep_worker if _job["kind"] == "autoep" else _native_worker)(_job)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)


# ------------------------------------------------------------------------------------------------ tests

import pytest  # noqa: E402

import zckpt  # noqa: E402
from zckpt.errors import UnsupportedLayout  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from tests.test_reshard import assert_same_files, assert_same_state, assert_same_tree, _torch_load  # noqa: E402


def _spec(name: str) -> dict:
    return json.loads((FIX / name / "expected" / "spec.json").read_text())


def _check_loaded(src: Path, oracle: Path, ws: int) -> dict:
    info = json.loads((oracle / "expected" / "oracle.json").read_text())
    assert info["world_size"] == ws
    assert_same_state(src / "expected", oracle / "expected")
    return info


def _run(tmp_path, name: str, ws: int, mode: str, resave: bool = True):
    """Reshard fixture ``name`` to ``ws`` ranks (mode "native": then load the output with engine.load_checkpoint;
    "zckpt": load the source with zckpt.deepspeed.load_checkpoint) and check the live state."""
    src = FIX / name
    spec = _spec(name)
    out, oracle, again = tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    kind = "autoep" if spec["kind"] == "autoep" else "moe"
    ckpt = str(src)
    if mode == "native":
        res = reshard(str(src), str(out), world_size=ws)
        assert res.plan.world_size == ws and res.plan.source_world_size == spec["world_size"]
        ckpt = str(out)
    _launch({"kind": kind, "mode": mode, "spec": dict(spec, world_size=ws), "ckpt": ckpt, "out": str(oracle),
             "resave": str(again) if resave else None}, ws)
    info = _check_loaded(src, oracle, ws)
    if mode == "native" and resave:
        assert_same_files(out, again, (src / "latest").read_text().strip())
    return info


NATIVE = [
    # fixture, new data-parallel size (six DeepSpeed launches in all in this file: CI time; the other shapes, ep 1
    # and plain ws4 -> 2 among them, are covered file for file by the round trips below)
    ("moe_z2_bf16_ws2_ep2", 4),  # up: each expert-parallel rank over 2 expert-data-parallel ranks
    ("moe_z2_bf16_ws4_ep2_dbe", 2),  # use_data_before_expert_parallelism, down: expert groups no longer split
    ("moe_z2_bf16_ws4_ep2_dbe", 6),  # dbe, up: blocks of 3 ranks (R % ep would be wrong here)
]


@pytest.mark.slow
@pytest.mark.parametrize("name,ws", NATIVE, ids=lambda v: str(v))
def test_moe_dp_reshard_loads_natively(tmp_path, name, ws):
    info = _run(tmp_path, name, ws, "native", resave=ws <= 4)
    ep = _spec(name)["ep_size"]
    dbe = (_spec(name).get("ds_config") or {}).get("use_data_before_expert_parallelism")
    assert info["ep_ranks"] == [r // (ws // ep) if dbe else r % ep for r in range(ws)]
    assert info["loaded_dp"] == ws



@pytest.mark.slow
def test_moe_bf16_optimizer_dp_reshard_loads_natively(tmp_path):
    """The BF16 optimizer (ZeRO-1 + fp32 grad accumulation) with MoE, made here by real DeepSpeed (ws 2, ep 2; no
    committed fixture): its fp32 partitions keep their padding. Resharded to 4 ranks, loaded natively, identical
    to the engine that saved it, and re-saved file for file."""
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    src = tmp_path / "src"
    G.generate(dict(kind="moe", name="moe_bf16opt_z1_ws2_ep2", stage=1, dtype="bf16", world_size=2, ep_size=2,
                    grad_accum_dtype="fp32", scheduler=False), str(src), expected=False)
    ckpt = zckpt.open_checkpoint(str(src))
    assert (ckpt.flavour, ckpt.extra["moe"].ep) == ("bf16_optimizer", {1: 2})
    spec = json.loads((src / "expected" / "spec.json").read_text())
    out, oracle, again = tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    reshard(str(src), str(out), world_size=4)
    _launch({"kind": "moe", "mode": "native", "spec": dict(spec, world_size=4), "ckpt": str(out),
             "out": str(oracle), "resave": str(again)}, 4)
    _check_loaded(src, oracle, 4)
    assert_same_files(out, again, (src / "latest").read_text().strip())

@pytest.mark.slow
def test_moe_layers_of_two_expert_parallel_sizes(tmp_path):
    """Two MoE layers, ep 2 and ep 1 (expert groups ep_size_2 and ep_size_1, each partitioned over its own
    expert-data-parallel ranks), ZeRO-2, made here by real DeepSpeed at 2 ranks: resharded to 4 and loaded natively
    (and re-saved file for file), and resumed from the source at 4 by zckpt.deepspeed.load_checkpoint (each rank
    plans its own optimizer file and the expert files of its own expert-parallel ranks, in memory)."""
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    src = tmp_path / "src"
    G.generate(dict(kind="moe", name="moe_z2_bf16_ws2_ep2_ep1", stage=2, dtype="bf16", world_size=2, ep_size=2,
                    moe2_ep_size=1, scheduler=False), str(src), expected=False)
    assert zckpt.open_checkpoint(str(src)).extra["moe"].ep == {1: 1, 2: 2}
    spec = json.loads((src / "expected" / "spec.json").read_text())
    out, tag = tmp_path / "out", (src / "latest").read_text().strip()
    reshard(str(src), str(out), world_size=4)
    for mode, ckpt in (("native", out), ("zckpt", src)):
        oracle, again = tmp_path / f"oracle-{mode}", tmp_path / f"resaved-{mode}"
        _launch({"kind": "moe", "mode": mode, "spec": dict(spec, world_size=4), "ckpt": str(ckpt),
                 "out": str(oracle), "resave": str(again) if mode == "native" else None}, 4)
        info = _check_loaded(src, oracle, 4)
        if mode == "native":
            assert_same_files(out, again, tag)
        else:
            assert info["resumed"] == {"mode": "reshard", "source_world_size": 2, "world_size": 4}


AUTOEP = [("moe_autoep_z2_bf16_ws2_ep2", 4, "native"), ("moe_autoep_z2_bf16_ws2_ep2", 4, "zckpt")]


@pytest.mark.slow
@pytest.mark.parametrize("name,ws,mode", AUTOEP, ids=lambda v: str(v))
def test_autoep_dp_reshard_loads(tmp_path, name, ws, mode):
    """AutoEP (fused experts, ZeRO-2) at 2 -> 4 ranks, ep 2 kept: loaded natively from the output (and re-saved
    identically), and resumed from the source by zckpt.deepspeed.load_checkpoint."""
    info = _run(tmp_path, name, ws, mode, resave=mode == "native")
    spec = _spec(name)
    assert info["lrs"] == [spec["lr"]] * 2  # the saved hyperparameters, not the new engine's lr / 3
    assert info["ep_ranks"] == [{k: r % 2 for k in info["ep_ranks"][0]} for r in range(ws)]
    if mode == "zckpt":
        assert info["resumed"] == {"mode": "reshard", "source_world_size": spec["world_size"], "world_size": ws}

# ------------------------------------------------------------------------------------------------ without DeepSpeed

ROUND_TRIPS = [
    ("moe_z2_bf16_ws4_ep2", 2), ("moe_z2_bf16_ws4_ep2_dbe", 6), ("moe_z2_bf16_ws2_ep2", 4),
    ("moe_z2_bf16_ws2_ep1", 3), ("moe_autoep_z2_bf16_ws2_ep2", 4),
]


@pytest.mark.parametrize("name,mid", ROUND_TRIPS, ids=lambda v: str(v))
def test_moe_round_trip_reproduces_every_file(tmp_path, name, mid):
    """N -> M -> N gives back every file DeepSpeed wrote (optimizer files of every rank, the model states, the expert
    files), tensors byte for byte: the partitions of dense and expert groups, paddings, partition_count,
    param_slice_mappings (local expert ids), dp_world_size and AutoEP's expert_data_parallel_world_size."""
    src = FIX / name
    ws = _spec(name)["world_size"]
    a, b = tmp_path / "a", tmp_path / "b"
    reshard(str(src), str(a), world_size=mid)
    reshard(str(a), str(b), world_size=ws)
    tag = (src / "latest").read_text().strip()
    assert sorted(os.listdir(src / tag)) == sorted(os.listdir(b / tag))
    for n in sorted(os.listdir(src / tag)):
        assert_same_tree(_torch_load(src / tag / n), _torch_load(b / tag / n), n)
    mid_ms = _torch_load(a / tag / "mp_rank_00_model_states.pt")
    assert mid_ms["dp_world_size"] == mid
    for layer in mid_ms.get("ds_autoep_layers") or []:
        assert layer["expert_data_parallel_world_size"] == mid // layer["ep_size"]
    ep = _spec(name)["ep_size"]
    osd = _torch_load(a / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert osd["partition_count"] == [mid, mid // ep]
    src_experts = {p.name: p.read_bytes() for p in (src / tag).glob("layer_*_expert_*")}
    assert src_experts and {p.name: p.read_bytes() for p in (a / tag).glob("layer_*_expert_*")} == src_experts


def test_moe_merge_of_the_reshard_equals_the_source(tmp_path):
    """What the resharded files hold is the source's state: the same records, every byte (a second reader path)."""
    from zckpt.encoding.tensors import Reader
    src = FIX / "moe_z2_bf16_ws4_ep2_dbe"
    reshard(str(src), str(tmp_path / "o"), world_size=6)
    a, b = zckpt.open_checkpoint(str(src)), zckpt.open_checkpoint(str(tmp_path / "o"))
    assert b.world_size == 6 and [r.name for r in a.records] == [r.name for r in b.records]
    with Reader() as rd:
        for x, y in zip(a.records, b.records):
            for p, q in ((x.value, y.value), (x.exp_avg, y.exp_avg), (x.exp_avg_sq, y.exp_avg_sq)):
                n = sum(s.nbytes for s in p)
                assert n == sum(s.nbytes for s in q), x.name
                u, v = bytearray(n), bytearray(n)
                rd.read_pieces(p, memoryview(u))
                rd.read_pieces(q, memoryview(v))
                assert u == v, x.name


@pytest.mark.parametrize("kw,words", [
    ({"world_size": 3}, "not a multiple of the expert-parallel size 2"),
    ({"world_size": 4, "stage": 3}, "ZeRO stage"),
    ({"world_size": 4, "stage": 1}, "ZeRO stage"),
    ({"world_size": 4, "fmt": "universal"}, "DeepSpeed layout only"),
    ({"world_size": 4, "bf16_optimizer": True}, "optimizer"),
])
def test_moe_refusals_are_one_line(tmp_path, kw, words):
    with pytest.raises(UnsupportedLayout, match=words) as err:
        reshard(str(FIX / "moe_z2_bf16_ws2_ep2"), str(tmp_path / "o"), **kw)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()


def test_moe_without_zero_is_refused_saying_deepspeed_loads_it(tmp_path):
    with pytest.raises(UnsupportedLayout, match="loads at any data-parallel size") as err:
        reshard(str(FIX / "moe_z0_bf16_ws2_ep2"), str(tmp_path / "o"), world_size=4)
    assert "expp_rank" in str(err.value) and "\n" not in str(err.value) and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_moe_without_zero_loads_as_it_is_at_another_dp_size(tmp_path):
    """What the refusal says: DeepSpeed loads the ZeRO-0 MoE files (ws 2, ep 2) unchanged at 4 ranks, ep 2, with
    identical state (each rank reads expp_rank_{its expert-parallel rank}; dp_world_size is not checked there)."""
    name = "moe_z0_bf16_ws2_ep2"
    _launch({"kind": "moe", "mode": "native", "spec": dict(_spec(name), world_size=4), "ckpt": str(FIX / name),
             "out": str(tmp_path / "oracle"), "resave": None}, 4)
    info = _check_loaded(FIX / name, tmp_path / "oracle", 4)
    assert info["ep_ranks"] == [0, 1, 0, 1] and info["loaded_dp"] == 4


def test_cli_reshard_moe_json(tmp_path):
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(FIX / "moe_z2_bf16_ws2_ep2"),
                           "--world-size", "4", "-o", str(out), "--json"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["from"]["world_size"] == 2 and res["to"]["world_size"] == 4
    assert any("expert-parallel size 2 kept" in n for n in res["notes"])
    experts = [p for p in res["partitions"] if "expert_parallel_rank" in p]
    assert sorted(p["expert_parallel_rank"] for p in experts) == [0, 1]
    assert all(len(p["paddings"]) == 2 for p in experts)
    names = {f["name"].rsplit("/", 1)[-1] for f in res["files"]}
    assert {f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)} <= names
    assert {f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)} <= names
    assert zckpt.open_checkpoint(str(out)).world_size == 4
    bad = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(FIX / "moe_z2_bf16_ws2_ep2"),
                          "--world-size", "3", "-o", str(tmp_path / "bad")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert bad.returncode != 0 and "expert-parallel size 2" in bad.stderr
    assert len([ln for ln in bad.stderr.strip().splitlines() if ln.strip()]) == 1, bad.stderr


def test_resume_refuses_other_moe_layers_in_one_line():
    """An engine whose MoE layers are not the checkpoint's (or none) is refused before anything is read or loaded
    (other expert-parallel sizes of the same layers are laid out again: tests/test_resume_moe_ep.py)."""
    from types import SimpleNamespace
    from fixtures import gen_parallel
    from zckpt.errors import InvalidArgument
    from zckpt.ops.resume import Target, check_compatible
    ckpt = zckpt.open_checkpoint(str(FIX / "moe_z2_bf16_ws2_ep2"))
    target = Target(4, 0, 2, False, "bf16")
    engine = SimpleNamespace(has_moe_layers=True, module=gen_parallel.build_moe({"ep_size": 1}))
    # layers of ep 2 and 4 into an engine of one MoE layer:
    mixed = zckpt.open_checkpoint(str(FIX / "moe_z2_bf16_ws4_ep2_ep4_mixed"))
    with pytest.raises(InvalidArgument, match="MoE layers") as err:
        check_compatible(mixed, engine, Target(4, 0, 2, False, "bf16"))
    assert "(moe, native)" in str(err.value) and "(moe, moe2)" in str(err.value) and "\n" not in str(err.value)
    dense = SimpleNamespace(has_moe_layers=False, module=gen_parallel.build_moe({"ep_size": 1}))
    with pytest.raises(InvalidArgument, match="without MoE layers"):
        check_compatible(ckpt, dense, target)
    with pytest.raises(UnsupportedLayout, match="expp_rank"):  # MoE without ZeRO: DeepSpeed loads it as it is
        check_compatible(zckpt.open_checkpoint(str(FIX / "moe_z0_bf16_ws2_ep2")), engine, target)
