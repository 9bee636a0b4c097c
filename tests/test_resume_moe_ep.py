"""``zckpt.deepspeed.load_checkpoint`` into an engine of other expert-parallel sizes (issue 47 item 1, the resume
half): AutoEP at ZeRO-2 and at ZeRO-3 (``zero3_partitioned``), and native MoE layers of several sizes, each rank
laying its files out in memory through the writers ``zckpt reshard --ep`` uses.

One DeepSpeed 0.19.8 launch at 4 CPU ranks (CI time) runs every case in turn: the engine is built at the new sizes
from another seed (another learning rate, buffers scrambled), ``engine.load_checkpoint`` of the *source* goes through
zckpt (``zckpt.deepspeed.patch_deepspeed``: what ``resume_anywhere`` does), and the live state is captured as the
fixture generators capture it (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, module weights,
router, buffers, step, counters; experts under global ids): it must equal the source fixture's
``expected/oracle.*`` bit for bit. The engine then saves again, and every file must equal what ``zckpt reshard
--ep`` writes offline (what DeepSpeed's own ``load_checkpoint`` of that output holds: tests/test_moe_ep_more.py,
tests/test_moe_reshard_ep.py); then one training step runs. Without DeepSpeed: each rank's in-memory objects equal
the offline output's files, and the refusals are one line.

Run as a script, this file is the torchrun worker.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _jobs(jobs: list[dict]) -> None:
    """A torchrun rank: each job's engine built and loaded by the worker of the test that loads the offline output
    (AutoEP: tests/test_moe_ep_more.py; native: tests/test_reshard_moe.py), with DeepSpeed's load_checkpoint routed
    through zckpt; what zckpt did written to ``OUT/resumed_rank{r}.json``, then one training step."""
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    from tests import ds_oracle
    from tests import test_moe_ep_more as E
    from tests import test_reshard_moe as M
    import zckpt.deepspeed as zd

    G = ds_oracle.generate_module()
    finish = G._finish
    G._finish = lambda dist: dist.barrier()
    made = []
    initialize = deepspeed.initialize

    def recording(*a, **kw):
        out = initialize(*a, **kw)
        made.append(out[0])
        return out

    deepspeed.initialize = recording
    for job in jobs:
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):  # each job's engine makes its own expert groups
            setattr(groups, name, {})
        zd.patch_deepspeed()
        try:
            E._autoep_worker(job) if job["kind"] == "autoep" else M._native_worker(job)
        finally:
            zd.unpatch_deepspeed()
        engine = made[-1]
        rank, info = dist.get_rank(), engine.zckpt_resume_info
        spec = job["spec"]
        import gen_autoep as A
        import gen_parallel as P
        vocab = {**A.MODEL, **(spec.get("autoep_model") or {})}["vocab"] if job["kind"] == "autoep" else \
            P.MOE_MODEL["vocab"]
        ids = torch.randint(0, vocab, (spec["micro_batch"], spec["seq_len"]),
                            generator=torch.Generator().manual_seed(77 + rank))
        loss = engine(input_ids=ids, labels=ids).loss if job["kind"] == "autoep" else engine(ids)
        engine.backward(loss)
        engine.step()
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        (Path(job["out"]) / f"resumed_rank{rank}.json").write_text(json.dumps(
            {"mode": info.mode, "source_world_size": info.source_world_size, "world_size": info.world_size,
             "crc_checked": info.crc_checked_entries, "loss": float(loss.detach().float()),
             "global_steps": engine.global_steps, "groups": [pg.get("name") for pg in inner.param_groups],
             "ep": [info.source_ep, info.ep]}))
        del engine, made[:]
    finish(dist)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "fixtures"))
    _all = json.loads(Path(sys.argv[1]).read_text())
    import gen_parallel
    gen_parallel._hash_seed(_all)  # rank R runs with PYTHONHASHSEED hash_seeds[R] (re-executed before anything)
    _jobs(_all["jobs"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)


# ------------------------------------------------------------------------------------------------ tests

import pytest  # noqa: E402

from zckpt.errors import ZckptError  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from tests.test_reshard import assert_same_files, assert_same_state, assert_same_tree, _torch_load  # noqa: E402
from tests.test_reshard_moe import FIX, _spec  # noqa: E402

CASES = [  # (fixture, data-parallel size, the engine's expert-parallel size per MoE layer)
    ("moe_autoep_z2_bf16_ws4_ep4_l2", 4, (2, 2)),  # AutoEP ZeRO-2, Mixtral, 2 layers x 8 experts: ep 4 -> 2
    ("moe_autoep_z3_bf16_ws4_ep2_l2", 4, (4, 4)),  # AutoEP ZeRO-3, Qwen3-MoE, 2 layers x 8 experts: ep 2 -> 4
    ("moe_z2_bf16_ws4_ep2_ep4_mixed", 4, (4, 2)),  # native ZeRO-2, layers of ep 2 and 4 -> 4 and 2
    ("moe_autoep_z3_bf16_ws2_ep2", 4, (4,)),  # AutoEP ZeRO-3, 1 layer x 4 experts: dp 2 -> 4 and ep 2 -> 4
    # AutoEP ZeRO-3 whose expert group max_group_size 1100 cut into 3 param groups: ep 2 -> 4 (1024 + 512 elements)
    ("moe_autoep_z3_bf16_ws4_ep2_l2_cut", 4, (4, 4)),
]
SOURCE_EP = [[4, 4], [2, 2], [2, 4], [2], [2, 2]]  # each case's saved expert-parallel size per MoE layer
IDS = ["autoep-z2-ep4to2", "autoep-z3-ep2to4", "native-2+4to4+2", "autoep-z3-dp2to4-ep2to4", "autoep-z3-cut-ep2to4"]
# the run's max_group_size where the source's cut alone does not say how ep 4 is cut (it allows 1024..1535): the
# offline output is given it, the resumed engine's own groups say it
MGS = {"moe_autoep_z3_bf16_ws4_ep2_l2_cut": 1100}
# each engine rank's PYTHONHASHSEED: DeepSpeed orders a rank's expert groups by a set of names, so ranks 1 and 3
# hold the native case's [dense, ep_size_4, ep_size_2] where the plan (rank 0 of the source) has [dense, ep_size_2,
# ep_size_4]: each rank's planned file is put in its engine's order
HASH_SEEDS = [0, 1, 0, 1]


def _ep_arg(ep: tuple):
    return ep[0] if len(set(ep)) == 1 else ep


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every case resumed from its source by zckpt in one launch; beside it, the offline ``reshard --ep`` output."""
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    root = tmp_path_factory.mktemp("resume-ep")
    jobs, cases = [], []
    for i, (name, ws, ep) in enumerate(CASES):
        d = root / str(i)
        reshard(str(FIX / name), str(d / "offline"), world_size=ws, ep=_ep_arg(ep), max_group_size=MGS.get(name))
        spec = dict(_spec(name), world_size=ws, ep_size=ep[0])
        kind = "autoep" if spec["kind"] == "autoep" else "moe"
        if kind == "moe":
            spec["moe2_ep_size"] = ep[1]
        (d / "oracle").mkdir(parents=True)
        jobs.append({"kind": kind, "mode": "native", "spec": spec, "ckpt": str(FIX / name), "out": str(d / "oracle"),
                     "resave": str(d / "resaved")})
        cases.append(d)
    with tempfile.TemporaryDirectory(prefix="zckpt-resume-ep-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps({"jobs": jobs, "hash_seeds": HASH_SEEDS}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(Path(__file__).resolve()),
               str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), 900)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed MoE resume at 4 ranks failed (rc={proc.returncode}):\n"
                               + proc.stdout.decode(errors="replace")[-6000:])
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_resume_at_other_ep_sizes_equals_the_source(resumed, case):
    """The engine at the new sizes holds every expert's master and both moments, the router, the dense weights,
    step and counters of the source, bit for bit; its re-save equals the offline ``reshard --ep`` output file for
    file; one step trains."""
    name, ws, ep = CASES[case]
    src, d = FIX / name, resumed[case]
    assert_same_state(src / "expected", d / "oracle" / "expected", skip=("lrs",))
    got = json.loads((d / "oracle" / "expected" / "oracle.json").read_text())
    want = json.loads((src / "expected" / "oracle.json").read_text())
    assert set(got["lrs"]) == {_spec(name)["lr"]}  # the saved lr in every group, not the new engine's lr / 3
    if _spec(name)["kind"] == "autoep":
        assert got["ep_ranks"] == [{k: r % ep[0] for k in got["ep_ranks"][0]} for r in range(ws)]
    else:
        assert got["ep_ranks"] == [r % ep[0] for r in range(ws)] and got["loaded_dp"] == ws
    tag = (src / "latest").read_text().strip()
    orders = []
    for rank in range(ws):
        info = json.loads((d / "oracle" / f"resumed_rank{rank}.json").read_text())
        assert (info["mode"], info["source_world_size"], info["world_size"]) == ("reshard", _spec(name)["world_size"],
                                                                                  ws)
        assert math.isfinite(info["loss"]) and info["global_steps"] == want["global_steps"] + 1
        assert info["ep"] == [SOURCE_EP[case], list(ep)], info["ep"]  # per MoE layer: the checkpoint's, the engine's
        orders.append(info["groups"])
    if len({tuple(o) for o in orders}) == 1:
        assert_same_files(d / "offline", d / "resaved", tag)
    else:  # ranks 1 and 3 saved their own order: compared in rank 0's (zckpt's reader matches them by name)
        assert orders[1] == orders[3] != orders[0] == orders[2] and sorted(orders[1]) == sorted(orders[0])
        reshard(str(d / "resaved"), str(d / "resaved-rank0-order"), world_size=ws)
        assert_same_files(d / "offline", d / "resaved-rank0-order", tag)
        for rank in (0, 2):  # the ranks whose engine has the plan's order: DeepSpeed's own files equal
            n = f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            assert_same_tree(_torch_load(d / "offline" / tag / n), _torch_load(d / "resaved" / tag / n), n)


# ------------------------------------------------------------------------------------------------ without DeepSpeed

@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_in_memory_objects_equal_the_offline_files(tmp_path, case):
    """What each rank hands DeepSpeed at the new sizes (its optimizer file, model states, the expert files of its
    own expert-parallel ranks) equals ``torch.load`` of the file ``zckpt reshard --ep`` writes."""
    import zckpt
    from zckpt.deepspeed.writer import plan_ranks
    from zckpt.ops.resume import Materializer
    name, ws, ep = CASES[case]
    reshard(str(FIX / name), str(tmp_path / "o"), world_size=ws, ep=_ep_arg(ep), max_group_size=MGS.get(name))
    ckpt = zckpt.open_checkpoint(str(FIX / name))
    experts = set()
    for rank in range(ws):
        plan = plan_ranks(ckpt, ws, [rank], ep=_ep_arg(ep), max_group_size=MGS.get(name))
        mat = Materializer()
        try:
            for f in plan.files:
                assert_same_tree(_torch_load(tmp_path / "o" / f.relpath), mat.load(f.obj), f.relpath)
        finally:
            mat.close()
        experts |= {os.path.basename(f.relpath) for f in plan.files if "_expert_" in f.relpath}
    tag = (FIX / name / "latest").read_text().strip()
    assert experts == {n for n in os.listdir(FIX / name / tag) if "_expert_" in n}  # every expert file, once planned


def _engine(model):
    from types import SimpleNamespace
    return SimpleNamespace(has_moe_layers=True, module=model)


def test_engine_sizes_read_per_layer_and_refusals_are_one_line(monkeypatch):
    """The engine's sizes are read from its modules, per MoE layer in the checkpoint's order; an engine whose MoE
    layers are not the checkpoint's, or whose sizes DeepSpeed cannot run at its data-parallel size, is refused in
    one line before anything is read."""
    import zckpt
    from fixtures import gen_parallel
    from zckpt.ops import resume_checks as R
    monkeypatch.setattr(R, "moe_experts", lambda engine: {})  # live expert ids need DeepSpeed's expert groups
    mixed = zckpt.open_checkpoint(str(FIX / "moe_z2_bf16_ws4_ep2_ep4_mixed"))
    two = gen_parallel.build_moe({"ep_size": 4, "moe2_ep_size": 2, "num_experts": 8, "moe2_num_experts": 8})
    t = R.Target(4, 0, 2, False, "bf16")
    moe = R._check_moe_engine(mixed, _engine(two), t)
    assert t.ep == (4, 2) and sorted(set(moe.layout.ep.values())) == [2, 4]
    same = R.Target(4, 0, 2, False, "bf16")
    R._check_moe_engine(mixed, _engine(gen_parallel.build_moe(
        {"ep_size": 2, "moe2_ep_size": 4, "num_experts": 8, "moe2_num_experts": 8})), same)
    assert same.ep is None  # the checkpoint's own sizes: nothing laid out again
    one = gen_parallel.build_moe({"ep_size": 4})  # one MoE layer: not the checkpoint's two
    with pytest.raises(ZckptError, match="MoE layers") as err:
        R.check_compatible(mixed, _engine(one), R.Target(4, 0, 2, False, "bf16"))
    assert "\n" not in str(err.value)
    with pytest.raises(ZckptError, match="not a multiple of the expert-parallel size 4") as err:
        R.check_compatible(mixed, _engine(two), R.Target(2, 0, 2, False, "bf16"))
    assert "\n" not in str(err.value)
