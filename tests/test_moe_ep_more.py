"""``zckpt reshard --ep`` beyond one expert-parallel size at ZeRO-1/2 (issue 47 item 1): native MoE without ZeRO
(``expp_rank_*`` files), and MoE layers of several expert-parallel sizes (``--ep 4,2``: one size per MoE layer in
order), checked by real DeepSpeed 0.19.8.

Each slow test is one DeepSpeed launch at 4 CPU ranks (``tests/test_reshard_moe.py``'s worker): the engine is built
at the new sizes from another seed, loads zckpt's output with a plain ``engine.load_checkpoint`` and captures its
state (masters, both moments, step, the router and the dense weights, experts under global ids), which must equal
the source fixture's ``expected/oracle.*`` bit for bit; then it saves again, and every file must equal zckpt's
(``ds_config`` / ``ds_version`` aside). Without DeepSpeed: there and back gives every source file back, and what
DeepSpeed cannot run is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _autoep_worker(job: dict) -> None:
    """A torchrun rank: the job's AutoEP model (gen_autoep's arch and dims) built at the job's ep / stage from
    another seed, ``engine.load_checkpoint`` of the job's folder, its live state written as the fixture generator
    writes it, then saved again."""
    import torch
    import deepspeed
    import deepspeed.comm as dist
    import gen_autoep as A
    from tests import ds_oracle

    G = ds_oracle.generate_module()
    spec = job["spec"]
    deepspeed.init_distributed(dist_backend="gloo")
    A._registry_shim()
    torch.manual_seed(spec["seed"] + 99)
    model, _ = A.build_hf_model(spec)
    cfg = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": spec["stage"]}, "bf16": {"enabled": spec["dtype"] == "bf16"},
           "expert_parallel": {"enabled": True, "autoep_size": int(spec["ep_size"]),
                               "preset_model": spec.get("arch", "mixtral"), "use_grouped_mm": False},
           "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"] / 3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "torch_adam": True}}}
    if spec.get("max_group_size"):  # the run's limit, as gen_autoep.worker lowers it
        import deepspeed.moe.utils as U
        U.split_params_into_different_moe_groups_for_optimizer.__defaults__ = (spec["max_group_size"],)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    path, _ = engine.load_checkpoint(job["ckpt"], load_optimizer_states=True, load_lr_scheduler_states=True)
    assert path is not None, "load_checkpoint returned None"
    G._relink_hp_optimizer_state(engine)
    mine = A._capture(G, engine, model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out = Path(job["out"])
        A._expected(G, spec, out, engine, model, gathered, dist.get_world_size())
        info = json.loads((out / "expected" / "oracle.json").read_text())
        info["lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
        (out / "expected" / "oracle.json").chmod(0o644)
        (out / "expected" / "oracle.json").write_text(json.dumps(info))
    engine.save_checkpoint(job["resave"], tag=(Path(job["ckpt"]) / "latest").read_text().strip())
    G._finish(dist)


def _native_jobs(jobs: list[dict]) -> None:
    """Several native MoE loads in one launch (CI time): ``tests/test_reshard_moe.py``'s worker for each job in
    turn, the process group kept until the last."""
    from tests import ds_oracle
    from tests import test_reshard_moe as M

    G = ds_oracle.generate_module()
    finish = G._finish
    G._finish = lambda dist: dist.barrier()
    from deepspeed.utils import groups
    for job in jobs:
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):  # each job's engine makes its own expert groups (the
            setattr(groups, name, {})  # largest ep_size names the expp_rank files a rank loads without ZeRO)
        M._native_worker(job)
    import deepspeed.comm as dist
    finish(dist)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "fixtures"))
    _job = json.loads(Path(sys.argv[1]).read_text())
    _native_jobs(_job["jobs"]) if "jobs" in _job else _autoep_worker(_job)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)


# ------------------------------------------------------------------------------------------------ tests

import pytest  # noqa: E402

from zckpt.errors import ZckptError  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from tests.test_reshard import assert_same_files, assert_same_state, assert_same_tree, _torch_load  # noqa: E402
from tests.test_reshard_moe import FIX, _check_loaded, _spec  # noqa: E402


def _launch_here(job: dict, nproc: int, timeout: float = 600) -> None:
    """torchrun of this file's worker: an AutoEP job, or ``{"jobs": [...]}`` of native MoE jobs."""
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    for j in job.get("jobs") or [job]:
        Path(j["out"]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zckpt-ep-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(Path(__file__).resolve()),
               str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed MoE load at {nproc} ranks failed (rc={proc.returncode}):\n"
                               + proc.stdout.decode(errors="replace")[-6000:])


def _same_files(src, b):
    tag = (src / "latest").read_text().strip()
    assert sorted(os.listdir(src / tag)) == sorted(os.listdir(b / tag))
    for n in sorted(os.listdir(src / tag)):
        assert_same_tree(_torch_load(src / tag / n), _torch_load(b / tag / n), n)


def _groups(path):
    o = _torch_load(path)["optimizer"]
    return [(pg["name"], len(pg["params"])) for pg in o["optimizer_state_dict"]["param_groups"]]


# ------------------------------------------------------------------------------------------------ without ZeRO

NATIVE = [  # (fixture, new ep per MoE layer): every output loaded at 4 ranks in one DeepSpeed launch
    ("moe_z0_bf16_ws2_ep2", (4,)),  # without ZeRO: ep 2 -> 4
    ("moe_z0_bf16_ws2_ep2_ep1", (4, 2)),  # without ZeRO, layers of ep 2 and ep 1 -> 4 and 2
    ("moe_z0_bf16_ws2_ep2_ep1", (1, 2)),  # without ZeRO, the sizes swap (rank 0's order of the names kept)
    ("moe_z2_bf16_ws4_ep2_ep4_mixed", (4, 2)),  # ZeRO-2, layers of ep 2 and 4 swap sizes (the groups swap layers;
    # rank 0's order of the names kept, which the engine's PYTHONHASHSEED 0 gives)
    ("moe_z2_bf16_ws4_ep2_ep4_mixed", (4, 4)),  # ZeRO-2, both layers at ep 4: one expert group
]


@pytest.fixture(scope="module")
def native_loaded(tmp_path_factory):
    """Each NATIVE case resharded at 4 ranks and loaded by a plain engine.load_checkpoint at its new sizes (one
    launch), the engine's state captured and its re-save written."""
    root = tmp_path_factory.mktemp("native")
    jobs, cases = [], []
    for i, (name, ep) in enumerate(NATIVE):
        d = root / str(i)
        res = reshard(str(FIX / name), str(d / "out"), world_size=4, ep=ep[0] if len(ep) == 1 else ep)
        spec = dict(_spec(name), world_size=4, ep_size=ep[0], **({"moe2_ep_size": ep[1]} if len(ep) > 1 else {}))
        jobs.append({"kind": "moe", "mode": "native", "spec": spec, "ckpt": str(d / "out"), "out": str(d / "oracle"),
                     "resave": str(d / "resaved")})
        cases.append((name, ep, d, res.plan.notes))
    _launch_here({"jobs": jobs}, 4)
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(NATIVE)), ids=[f"{n}-{'+'.join(map(str, e))}" for n, e in NATIVE])
def test_native_ep_reshard_loads_natively(native_loaded, case):
    """DeepSpeed holds every master, both moments, step, router and dense weight of the source after loading
    zckpt's output at the new expert-parallel sizes, and its re-save equals zckpt's files."""
    name, ep, d, notes = native_loaded[case]
    src = FIX / name
    assert "-> " + str(ep[0]) in notes[0]
    assert_same_state(src / "expected", d / "oracle" / "expected", skip=("lrs",))  # every tensor, step, counters
    want, got = (json.loads((x / "expected" / "oracle.json").read_text()) for x in (src, d / "oracle"))
    assert got["lrs"] == want["lrs"][:len(set(ep)) + 1]  # dense + one group per size, the saved lr (engine: lr/3)
    assert got["ep_ranks"] == [r % ep[0] for r in range(4)] and got["loaded_dp"] == 4
    assert_same_files(d / "out", d / "resaved", (src / "latest").read_text().strip())


@pytest.mark.parametrize("name,mid_ws,mid_ep", [
    ("moe_z0_bf16_ws2_ep2", 4, 4), ("moe_z0_bf16_ws2_ep2", 2, 1), ("moe_z0_bf16_ws2_ep2_ep1", 4, (4, 2)),
    ("moe_z0_bf16_ws2_ep2_ep1", 4, (1, 4))], ids=["ep4", "ep1", "4+2", "1+4"])
def test_zero0_ep_round_trip_reproduces_every_file(tmp_path, name, mid_ws, mid_ep):
    src, a, b = FIX / name, tmp_path / "a", tmp_path / "b"
    res = reshard(str(src), str(a), world_size=mid_ws, ep=mid_ep)
    assert "mixture of experts without ZeRO" in res.plan.notes[0]
    eps = (mid_ep,) if isinstance(mid_ep, int) else mid_ep
    tag = (src / "latest").read_text().strip()
    files = sorted(os.listdir(a / tag))
    assert [f for f in files if f.startswith("expp_rank_")] == [f"expp_rank_{e}_mp_rank_00_optim_states.pt"
                                                               for e in range(max(eps))]
    groups = _groups(a / tag / "expp_rank_0_mp_rank_00_optim_states.pt")
    assert sorted(n for n, _ in groups[1:]) == sorted({f"ep_size_{n}" for n in eps})
    assert _torch_load(a / tag / "mp_rank_00_model_states.pt")["dp_world_size"] == mid_ws
    back = (2,) if len(eps) == 1 else (2, 1)
    reshard(str(a), str(b), world_size=_spec(name)["world_size"], ep=back if len(back) > 1 else back[0])
    _same_files(src, b)


# ------------------------------------------------------------------------------------------------ layers of several sizes

MIXED = "moe_z2_bf16_ws4_ep2_ep4_mixed"  # ZeRO-2, layer 0 at ep 2, layer 1 at ep 4, 8 experts each, ws 4


@pytest.fixture(scope="module")
def mixed_in_rank0_order(tmp_path_factory):
    """The mixed fixture resharded at its own sizes: every rank's file in rank 0's group order (the source's ranks
    1-3 saved another order), what a round trip comes back to."""
    out = tmp_path_factory.mktemp("mixed") / "norm"
    reshard(str(FIX / MIXED), str(out), world_size=4)
    return out


@pytest.mark.parametrize("ws,ep", [(4, (4, 2)), (8, (8, 8)), (4, (1, 4)), (2, (2, 2)), (8, (4, 4))],
                         ids=["swap", "merge-8", "ep1", "merge-2", "merge-4-ws8"])
def test_several_sizes_round_trip_reproduces_every_file(tmp_path, mixed_in_rank0_order, ws, ep):
    src, a, b = mixed_in_rank0_order, tmp_path / "a", tmp_path / "b"
    reshard(str(src), str(a), world_size=ws, ep=ep)
    tag = (src / "latest").read_text().strip()
    osd = _torch_load(a / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    names = [pg["name"] for pg in osd["base_optimizer_state"]["param_groups"][1:]]
    assert sorted(names) == sorted({f"ep_size_{n}" for n in ep})
    assert osd["partition_count"][1:] == [ws // int(n.rsplit("_", 1)[1]) for n in names]
    ms = _torch_load(a / tag / "mp_rank_00_model_states.pt")
    assert len(ms["param_shapes"]) == 1 + len(names)
    reshard(str(a), str(b), world_size=4, ep=(2, 4))
    _same_files(src, b)


@pytest.mark.parametrize("name,kw,words", [
    (MIXED, dict(world_size=4, ep=(2, 4, 4)), "3 expert-parallel sizes for 2 MoE layers"),
    (MIXED, dict(world_size=4, ep=(3, 4)), "8 experts do not split over expert-parallel size 3"),
    (MIXED, dict(world_size=6, ep=(2, 4)), "data-parallel size 6 is not a multiple of the expert-parallel size 4"),
    ("moe_autoep_z2_bf16_ws4_ep4_l2", dict(world_size=4, ep=(2, 4)), "AutoEP requires one size"),
    ("moe_z0_bf16_ws2_ep2_ep1", dict(world_size=2, ep=(4, 1)), "data-parallel size 2 is not a multiple"),
    ("moe_z0_bf16_ws2_ep2_ep1", dict(world_size=4, ep=(2, 1), stage=1), "ZeRO stage"),
], ids=["count", "not-dividing", "dp", "autoep-two-sizes", "zero0-dp", "zero0-stage"])
def test_several_sizes_refusals_are_one_line(tmp_path, name, kw, words):
    with pytest.raises(ZckptError) as err:
        reshard(str(FIX / name), str(tmp_path / "o"), **kw)
    assert words in str(err.value) and "\n" not in str(err.value) and not (tmp_path / "o").exists()


def test_cli_ep_per_layer(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(FIX / MIXED), "-w", "4", "--ep", "4,2",
                           "-o", str(tmp_path / "o"), "--json"], capture_output=True, text=True, cwd=FIX.parent)
    assert proc.returncode == 0 and "layer 0 2 -> 4, layer 1 4 -> 2" in proc.stdout, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(FIX / MIXED), "-w", "4", "--ep", "4,x",
                          "-o", str(tmp_path / "bad")], capture_output=True, text=True, cwd=FIX.parent)
    assert bad.returncode == 2 and "--ep" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ AutoEP at ZeRO-3

Z3 = "moe_autoep_z3_bf16_ws4_ep2_l2"  # Qwen3-MoE, 2 layers x 8 experts in one ZeRO-3 sub-group, ws 4, ep 2


@pytest.mark.slow
def test_autoep_zero3_ep_reshard_loads_natively(tmp_path):
    """AutoEP at ZeRO-3 (zero3_partitioned), ep 2 x dp 4 -> ep 4 x dp 4: DeepSpeed's topology check passes on the
    written ds_zero_partition_groups, the engine holds the source's state, and its re-save equals zckpt's files."""
    src, out, oracle, again = FIX / Z3, tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    res = reshard(str(src), str(out), world_size=4, ep=4)
    assert "expert-parallel size 2 -> 4" in res.plan.notes[0]
    _launch_here({"spec": dict(_spec(Z3), ep_size=4), "ckpt": str(out), "out": str(oracle),
                    "resave": str(again)}, 4)
    info = _check_loaded(src, oracle, 4)
    assert info["ep_ranks"] == [{k: r for k in info["ep_ranks"][0]} for r in range(4)]
    assert_same_files(out, again, (src / "latest").read_text().strip())


@pytest.mark.parametrize("name,ws,ep", [
    (Z3, 4, 4), (Z3, 8, 4), (Z3, 2, 1), (Z3, 4, 2), ("moe_autoep_z3_bf16_ws2_ep2", 4, 4),
    ("moe_autoep_z3_bf16_ws4_ep2", 6, 2)], ids=["ep4", "ws8-ep4", "ws2-ep1", "same", "ws2-to-ep4", "ws6"])
def test_autoep_zero3_round_trip_reproduces_every_file(tmp_path, name, ws, ep):
    """There and back gives every source file (fixtures whose ZeRO-3 partitions have no padding: DeepSpeed leaves
    its padding uninitialised, zckpt writes zeros)."""
    src, a, b = FIX / name, tmp_path / "a", tmp_path / "b"
    reshard(str(src), str(a), world_size=ws, ep=ep)
    tag = (src / "latest").read_text().strip()
    osd = _torch_load(a / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert [(m["partition_count"], m["group_names"]) for m in osd["ds_zero_partition_groups"]] == \
        [(ws, ["replicated"]), (ws // ep, [f"ep_size_{ep}"])]
    layers = _torch_load(a / tag / f"zero_pp_rank_{ws - 1}_mp_rank_00_model_states.pt")["ds_autoep_layers"]
    assert {(x["ep_size"], x["ep_rank"], x["expert_data_parallel_world_size"]) for x in layers} == \
        {(ep, (ws - 1) % ep, ws // ep)}
    reshard(str(a), str(b), world_size=_spec(name)["world_size"], ep=_spec(name)["ep_size"])
    _same_files(src, b)


@pytest.mark.parametrize("name,kw", [("moe_z0_bf16_ws2_ep2", dict(world_size=4, ep=4)),
                                     ("moe_z2_bf16_ws4_ep2_ep4_mixed", dict(world_size=4, ep=(4, 2))),
                                     (Z3, dict(world_size=4, ep=4))], ids=["zero0", "several-sizes", "autoep-zero3"])
def test_flipped_expert_moment_refused_nothing_published(tmp_path, name, kw):
    """A flipped byte in an expert's exp_avg fails its zip CRC while the new layout is written: refused naming the
    file, no output."""
    import shutil
    import zckpt
    ck = shutil.copytree(FIX / name, tmp_path / "ck")
    rec = next(r for r in zckpt.open_checkpoint(str(ck)).records if "expert" in r.name and r.exp_avg)
    piece = rec.exp_avg[-1]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset)
        b = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ZckptError) as err:
        reshard(str(ck), str(tmp_path / "o"), **kw)
    assert os.path.basename(piece.path) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,kw", [("moe_z0_bf16_ws2_ep2_ep1", dict(world_size=4, ep=(1, 1))),
                                     (MIXED, dict(world_size=4, ep=(1, 1))), (Z3, dict(world_size=4, ep=1)),
                                     ("moe_autoep_z2_bf16_ws4_ep4_l2", dict(world_size=4, ep=1))],
                         ids=["zero0", "zero2", "autoep-zero3", "autoep-zero2"])
def test_group_deepspeed_would_cut_is_refused(tmp_path, monkeypatch, name, kw):
    """An expert group over DeepSpeed's max_group_size (178956971 elements; lowered here) would be cut into several
    param groups by DeepSpeed: refused in one line, not written as one."""
    from zckpt.deepspeed import expert_groups
    monkeypatch.setattr(expert_groups, "MAX_GROUP_SIZE", 100)
    with pytest.raises(ZckptError, match="max_group_size 100") as err:
        reshard(str(FIX / name), str(tmp_path / "o"), **kw)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()


def test_group_as_large_as_the_sources_is_not_refused(tmp_path, monkeypatch):
    """A source whose ranks hold an expert group over DeepSpeed's default max_group_size whole came from a run that
    passed a larger one: an output group no larger is written (ep 2 -> 4 halves each rank's experts)."""
    from zckpt.deepspeed import expert_groups
    monkeypatch.setattr(expert_groups, "MAX_GROUP_SIZE", 100)
    res = reshard(str(FIX / "moe_z2_bf16_ws2_ep2"), str(tmp_path / "o"), world_size=4, ep=4)
    assert "expert-parallel size 2 -> 4" in res.plan.notes[0]
