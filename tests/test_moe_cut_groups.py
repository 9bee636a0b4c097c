"""DeepSpeed native-MoE saves whose expert group DeepSpeed cut into several param groups of one name (issue 47).

``fixtures/moe_z2_bf16_ws4_ep2_cut`` (DeepSpeed 0.19.8, ZeRO-2 bf16, 4 ranks, two MoE layers of 8 experts, top-2,
ep 2): the optimizer's groups come from ``split_params_into_different_moe_groups_for_optimizer(max_group_size=300)``,
as a large run's come from its default 178956971, so the 656-element ``ep_size_2`` group of each rank is cut into 3
groups named ``ep_size_2`` (286, 288 and 82 elements; a cut inside an expert, a layer's local experts over two
groups). Read: every master and moment equals the live engine's (``expected/oracle.*``), every expert once; the
reader once said "local expert ids ... are [3], expected 0..0 (the file is damaged or truncated)".

Reshard: at the same expert-parallel size the cut is kept (it does not depend on the data-parallel size: DeepSpeed
counts whole expert parameters); at another the output's groups are cut as DeepSpeed's helper cuts them, the limit
read from the source's cut where every limit it allows cuts the output alike, else ``--max-group-size`` is asked
for. Oracle: one DeepSpeed launch of 2 ranks (tests/test_moe_ep_more.py's worker, the engine built with the
fixture's max_group_size) loads ws 2 at ep 2 and ws 2 at ep 1: its state equals the source's oracle bit for bit and
its re-save equals zckpt's files.

AutoEP at ZeRO-3 (``fixtures/moe_autoep_z3_bf16_ws4_ep2_l2_cut``, DeepSpeed 0.19.8: ``configure_moe_param_groups``
at max_group_size 1100 cuts each rank's ep_size_2 group into 3 param groups, each its own ZeRO-3 sub-group): read
equal to the live engine, resharded at any dp and ep as the helper cuts. Resume (``zckpt.deepspeed.load_checkpoint``)
of every cut source at dp 2 and another ep, in one 2-rank DeepSpeed launch: the engine's state equals the source's
oracle bit for bit and its re-save equals the offline ``reshard --ep`` output; where the source's cut allows limits
that cut the engine's ep otherwise, the engine's own groups say the limit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.deepspeed import group_cuts
from zckpt.encoding.tensors import load_pieces
from zckpt.errors import ZckptError
from zckpt.ops.reshard import reshard
from tests.conftest import FIXTURES
from tests.test_merge import _merged
from tests.test_reshard import _torch_load, assert_same_files, assert_same_state, assert_same_tree

NAME = "moe_z2_bf16_ws4_ep2_cut"
CUT = FIXTURES / NAME
AUTOEP = FIXTURES / "moe_autoep_z2_bf16_ws4_ep4_l2_cut"
TAG = "global_step3"


def _groups(path):
    o = _torch_load(path)["optimizer_state_dict"]
    return [pg["name"] for pg in o["base_optimizer_state"]["param_groups"]], list(o["partition_count"])


def _shape_sizes(path):
    import math
    return [sum(math.prod(s) for s in g.values()) for g in _torch_load(path)["param_shapes"]]


def test_the_fixture_is_cut():
    names, counts = _groups(CUT / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert names == ["dense", "ep_size_2", "ep_size_2", "ep_size_2"] and counts == [4, 2, 2, 2]
    assert _shape_sizes(CUT / TAG / "mp_rank_00_model_states.pt")[1:] == [286, 288, 82]


def test_read_equals_the_live_engine(tmp_path):
    tensors = load_file(str(CUT / "expected" / "oracle.safetensors"))
    info = json.loads((CUT / "expected" / "oracle.json").read_text())
    ckpt = zckpt.open_checkpoint(str(CUT))
    by = ckpt.by_name()
    n = 0
    for key, want in tensors.items():
        kind, name = key.split("/", 1)
        if kind not in ("fp32", "exp_avg", "exp_avg_sq"):
            continue
        rec = by[name]
        pieces = rec.value if kind == "fp32" else getattr(rec, kind)
        got = load_pieces(pieces, rec.dtype if kind == "fp32" else rec.state_dtype, rec.shape)
        assert torch.equal(got, want.reshape(got.shape)), key
        n += 1
    assert n == 3 * len(info["trainable"]) and sum(".deepspeed_experts.15." in k for k in tensors) == 0
    experts = {k.split("/", 1)[1].split(".up.")[0].split(".down.")[0] for k in tensors if "deepspeed_experts" in k}
    assert len(experts) == 16  # 2 layers x 8 experts, global ids
    report = zckpt.verify(str(CUT))
    assert report.ok and any(c.name == "MoE experts" and "2 layers x 8 experts" in c.detail for c in report.checks)
    zckpt.merge(str(CUT), str(tmp_path / "m"), dtype="fp32")
    got = _merged(tmp_path / "m")
    for name in info["trainable"]:
        assert torch.equal(got[name], tensors[f"fp32/{name}"]), name
    zckpt.convert(str(CUT), str(tmp_path / "dcp"), to="dcp")
    dcp = zckpt.open_checkpoint(str(tmp_path / "dcp")).by_name()
    for name in info["trainable"]:
        rec = dcp[name]
        assert torch.equal(load_pieces(rec.value, rec.dtype, rec.shape), tensors[f"fp32/{name}"]), name
        assert torch.equal(load_pieces(rec.exp_avg_sq, rec.state_dtype, rec.shape), tensors[f"exp_avg_sq/{name}"])


def test_autoep_cut_read_and_resharded_at_the_same_ep(tmp_path):
    """AutoEP cuts too (a config optimizer's groups come from configure_moe_param_groups, the helper at its default;
    lowered to 600 in the fixture): 3 ep_size_4 groups, read equal to the live engine; the same ep at another dp keeps
    them; another ep is refused in one line."""
    names, counts = _groups(AUTOEP / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert names == ["dense-params"] + ["ep_size_4"] * 3 and counts == [4, 1, 1, 1]
    tensors = load_file(str(AUTOEP / "expected" / "oracle.safetensors"))
    by = zckpt.open_checkpoint(str(AUTOEP)).by_name()
    n = 0
    for key, want in tensors.items():
        kind, name = key.split("/", 1)
        if kind in ("fp32", "exp_avg", "exp_avg_sq") and name in by and by[name].kind == "trainable":
            rec = by[name]
            pieces = rec.value if kind == "fp32" else getattr(rec, kind)
            got = load_pieces(pieces, rec.dtype if kind == "fp32" else rec.state_dtype, rec.shape)
            assert torch.equal(got, want.reshape(got.shape)), key
            n += 1
    assert n >= 3 * 16 and any(".experts.w1" in k for k in tensors)
    reshard(str(AUTOEP), str(tmp_path / "ws8"), world_size=8)
    assert _groups(tmp_path / "ws8" / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt") == (
        names, [8, 2, 2, 2])
    reshard(str(tmp_path / "ws8"), str(tmp_path / "back"), world_size=4)
    for f in sorted(os.listdir(AUTOEP / "global_step2")):
        assert_same_tree(_torch_load(AUTOEP / "global_step2" / f), _torch_load(tmp_path / "back" / "global_step2" / f),
                         f)
    with pytest.raises(ZckptError, match="first parameter of 1024 elements is over max_group_size 512"):
        reshard(str(AUTOEP), str(tmp_path / "e1"), world_size=2, ep=1)  # DeepSpeed would make an empty group


@pytest.mark.slow
def test_deepspeed_loads_autoep_at_another_ep(tmp_path):
    """AutoEP ep 4 -> 2 of the cut fixture: 6 ep_size_2 groups (each fused parameter of 512 elements alone, at any
    limit in [512, 767] the source's cut allows); DeepSpeed 0.19.8 (its helper's limit 600, as the run's) loads it
    with the source's state (tests/test_moe_ep_more.py's AutoEP worker) and re-saves the very files."""
    from tests.test_moe_ep_more import _launch_here
    from tests.test_reshard_moe import _check_loaded, _spec

    out, oracle, again = tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    reshard(str(AUTOEP), str(out), world_size=4, ep=2)
    names, counts = _groups(out / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert names == ["dense-params"] + ["ep_size_2"] * 6 and counts == [4] + [2] * 6
    _launch_here({"spec": dict(_spec(AUTOEP.name), ep_size=2), "ckpt": str(out), "out": str(oracle),
                  "resave": str(again)}, 4)
    _check_loaded(AUTOEP, oracle, 4)
    assert_same_files(out, again, "global_step2")


def test_cli_info_and_a_missing_rank_file(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    run = [sys.executable, "-m", "zckpt"]
    p = subprocess.run(run + ["info", str(CUT)], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and "2 layers x 8 experts, ep 2: every expert once" in p.stdout, p.stderr
    assert "ep_size_2 is 3 param groups (DeepSpeed's split_params_into_different_moe_groups_for_optimizer" in p.stdout
    bad = tmp_path / "bad"
    shutil.copytree(CUT, bad)
    os.remove(bad / TAG / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt")
    p = subprocess.run(run + ["verify", str(bad)], capture_output=True, text=True, env=env)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "damaged or truncated" not in err[0], p.stderr
    assert "rank 3 held its partition of experts 4..7 of moe (ep_size_2), experts 4..7 of moe2" in err[0], err[0]


@pytest.mark.parametrize("ws,ep,mgs,groups", [
    (8, None, None, ["dense"] + ["ep_size_2"] * 3),  # the cut kept
    (4, 4, None, ["dense"] + ["ep_size_4"] * 2),  # 328 elements: 286 + 42 at any limit in [288, 320]
    (2, 1, 300, ["dense"] + ["ep_size_1"] * 5),  # 1312 elements: 286, 288, 286, 288, 164
])
def test_reshard_cuts_as_deepspeed(tmp_path, ws, ep, mgs, groups):
    res = reshard(str(CUT), str(tmp_path / "o"), world_size=ws, ep=ep, max_group_size=mgs)
    assert _groups(tmp_path / "o" / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[0] == groups
    assert zckpt.verify(str(tmp_path / "o")).ok, res.plan.notes
    if ep == 4:  # 286 + 42 says only that the limit was in [286, 320]: 656 elements cut otherwise at 286 and 320
        with pytest.raises(ZckptError, match="between 286 and 320"):
            reshard(str(tmp_path / "o"), str(tmp_path / "back"), world_size=4, ep=2)
    reshard(str(tmp_path / "o"), str(tmp_path / "back"), world_size=4, ep=2 if ep else None,
            max_group_size=300 if ep else None)
    for n in sorted(os.listdir(CUT / TAG)):  # there and back: every file of the source
        assert_same_tree(_torch_load(CUT / TAG / n), _torch_load(tmp_path / "back" / TAG / n), n)


def test_uncut_source_at_another_ep(tmp_path):
    """A source nothing was cut in says only that the run's limit was at least its largest group: a larger output
    group is written whole (DeepSpeed's default) and said so, or cut at the --max-group-size given."""
    src = FIXTURES / "moe_z2_bf16_ws4_ep2"  # one layer of 4 experts: 164 elements per rank at ep 2
    res = reshard(str(src), str(tmp_path / "a"), world_size=2, ep=1)
    assert any("328 elements per rank is written whole" in n and "--max-group-size N" in n for n in res.plan.notes)
    assert _groups(tmp_path / "a" / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[0] == ["dense", "ep_size_1"]
    res = reshard(str(src), str(tmp_path / "b"), world_size=2, ep=1, max_group_size=200)
    assert not any("written whole" in n for n in res.plan.notes)
    path = tmp_path / "b" / TAG
    assert _groups(path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[0] == ["dense"] + ["ep_size_1"] * 2
    assert _shape_sizes(path / "mp_rank_00_model_states.pt")[1:] == [199, 129]  # 35+5+35+7 per expert, cut at 200
    assert zckpt.verify(str(tmp_path / "b")).ok
    reshard(str(tmp_path / "b"), str(tmp_path / "back"), world_size=4, ep=2)
    for n in sorted(os.listdir(src / TAG)):
        assert_same_tree(_torch_load(src / TAG / n), _torch_load(tmp_path / "back" / TAG / n), n)


def test_refusals_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ZckptError, match=r"200 would not cut .* between 288 and 320"):
        reshard(str(CUT), str(tmp_path / "a"), world_size=4, ep=4, max_group_size=200)
    with pytest.raises(ZckptError, match=r"has no experts"):
        reshard(str(FIXTURES / "z2_bf16_ws2"), str(tmp_path / "b"), world_size=2, max_group_size=300)
    with pytest.raises(ZckptError, match=r"at least 328 \(nothing was cut\)"):
        reshard(str(FIXTURES / "moe_z2_bf16_ws4_ep2_ep4_mixed"), str(tmp_path / "c"), world_size=4, ep=4,
                max_group_size=100)
    # a source whose cut allows limits that cut the output differently: the limit is asked for, nothing written
    real = group_cuts.cut_bounds
    monkeypatch.setattr(group_cuts, "cut_bounds", lambda *a: (real(*a)[0], 330, True))
    with pytest.raises(ZckptError, match=r"between 288 and 330 .*pass --max-group-size N"):
        reshard(str(CUT), str(tmp_path / "d"), world_size=2, ep=1)
    assert not (tmp_path / "d").exists()
    p = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(CUT), "-o", str(tmp_path / "e"), "-w", "4",
                        "--ep", "4", "--max-group-size", "200"], capture_output=True, text=True,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tests.test_moe_ep_more import _launch_here
    from tests.test_reshard_moe import _spec

    root = tmp_path_factory.mktemp("cut")
    jobs = []
    for i, ep in enumerate((2, 1)):
        d = root / str(i)
        reshard(str(CUT), str(d / "out"), world_size=2, ep=ep)
        jobs.append({"kind": "moe", "mode": "native", "spec": dict(_spec(NAME), world_size=2, ep_size=ep,
                                                                   moe2_ep_size=ep),
                     "ckpt": str(d / "out"), "out": str(d / "oracle"), "resave": str(d / "resaved")})
    _launch_here({"jobs": jobs}, 2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case,ep", [(0, 2), (1, 1)], ids=["ws2-ep2", "ws2-ep1"])
def test_deepspeed_loads_the_output(loaded, case, ep):
    """DeepSpeed 0.19.8 (engine built with max_group_size 300) holds every master, both moments, step, router and
    dense weight of the source after loading zckpt's output, and its re-save equals zckpt's files (the cut too)."""
    d = loaded / str(case)
    assert_same_state(CUT / "expected", d / "oracle" / "expected", skip=("lrs",))
    got = json.loads((d / "oracle" / "expected" / "oracle.json").read_text())
    assert got["loaded_dp"] == 2 and got["ep_ranks"] == [r % ep for r in range(2)]
    assert_same_files(d / "out", d / "resaved", TAG)
    assert len(_groups(d / "out" / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")[0]) == (4 if ep == 2 else 6)


# ------------------------------------------------------------------------------------------------ AutoEP at ZeRO-3

Z3 = FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2_cut"  # Qwen3-MoE, 2 layers x 8 experts, ws 4, ep 2, cut at 1100
Z3TAG = "global_step2"


def _z3_groups(path):
    osd = _torch_load(path)["optimizer_state_dict"]
    return ([pg["name"] for pg in osd["optimizer_state_dict"]["param_groups"]],
            [(m["partition_count"], m["group_names"]) for m in osd["ds_zero_partition_groups"]],
            [int(t.numel()) for t in osd["fp32_flat_groups"]])


def test_autoep_zero3_cut_read_equals_the_live_engine(tmp_path):
    """DeepSpeed 0.19.8 cuts at ZeRO-3 too (configure_moe_param_groups at max_group_size 1100, each fused expert
    parameter counting its local [4, ...] elements): 3 ep_size_2 param groups of 1024 elements, each its own ZeRO-3
    sub-group over the expert-data-parallel pair. Every master and moment read equals the live engine's; info,
    verify, merge and convert to DCP too."""
    names, subs, flats = _z3_groups(Z3 / Z3TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert names == ["dense-params"] + ["ep_size_2"] * 3 and subs[1:] == [(2, ["ep_size_2"])] * 3
    assert flats[1:] == [512] * 3
    tensors = load_file(str(Z3 / "expected" / "oracle.safetensors"))
    info = json.loads((Z3 / "expected" / "oracle.json").read_text())
    ckpt = zckpt.open_checkpoint(str(Z3))
    assert any("ep_size_2 is 3 param groups (DeepSpeed's split_params_into_different_moe_groups_for_optimizer" in x
               for x in ckpt.notes), ckpt.notes
    by = ckpt.by_name()
    n = 0
    for key, want in tensors.items():
        kind, name = key.split("/", 1)
        if kind in ("fp32", "exp_avg", "exp_avg_sq") and by[name].kind == "trainable":
            rec = by[name]
            pieces = rec.value if kind == "fp32" else getattr(rec, kind)
            got = load_pieces(pieces, rec.dtype if kind == "fp32" else rec.state_dtype, rec.shape)
            assert torch.equal(got, want.reshape(got.shape)), key
            n += 1
    assert n == 3 * len(info["trainable"]) and sum(".experts." in k and k.startswith("fp32/") for k in tensors) == 6
    report = zckpt.verify(str(Z3), deep=True)
    assert report.ok and any(c.name == "MoE experts" and "2 layers x 8 experts" in c.detail for c in report.checks)
    zckpt.merge(str(Z3), str(tmp_path / "m"), dtype="fp32", native_names=True)
    got = _merged(tmp_path / "m")
    for name in info["trainable"]:
        assert torch.equal(got[name], tensors[f"fp32/{name}"]), name
    zckpt.convert(str(Z3), str(tmp_path / "dcp"), to="dcp")
    dcp = zckpt.open_checkpoint(str(tmp_path / "dcp")).by_name()
    for name in info["trainable"]:
        rec = dcp[name]
        assert torch.equal(load_pieces(rec.value, rec.dtype, rec.shape), tensors[f"fp32/{name}"]), name
        assert torch.equal(load_pieces(rec.exp_avg, rec.state_dtype, rec.shape), tensors[f"exp_avg/{name}"])


@pytest.mark.parametrize("ws,ep,mgs,groups,flats", [
    (8, None, None, 3, [256] * 3),  # the cut kept (whole parameters: it does not depend on dp)
    (2, None, None, 3, [1024] * 3),
    (4, 4, 1100, 2, [1024, 512]),  # 6 x 256 at 1100: 1024 + 512 (the source's cut allows 1024..1535: asked for)
    (2, 1, None, 6, [512] * 6),  # 6 x 1024: each alone at any limit in 1024..1535
])
def test_autoep_zero3_cut_resharded_as_deepspeed_cuts(tmp_path, ws, ep, mgs, groups, flats):
    reshard(str(Z3), str(tmp_path / "o"), world_size=ws, ep=ep, max_group_size=mgs)
    names, subs, got = _z3_groups(tmp_path / "o" / Z3TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    e = ep or 2
    assert names == ["dense-params"] + [f"ep_size_{e}"] * groups and got[1:] == flats
    assert subs == [(ws, ["replicated"])] + [(ws // e, [f"ep_size_{e}"])] * groups
    assert zckpt.verify(str(tmp_path / "o")).ok
    reshard(str(tmp_path / "o"), str(tmp_path / "back"), world_size=4, ep=2 if ep else None,
            max_group_size=1100 if ep else None)  # ep 1's cut says 1024..2047: cut otherwise at those
    for n in sorted(os.listdir(Z3 / Z3TAG)):  # there and back: every file of the source
        assert_same_tree(_torch_load(Z3 / Z3TAG / n), _torch_load(tmp_path / "back" / Z3TAG / n), n)


def test_autoep_zero3_cut_refusals(tmp_path):
    with pytest.raises(ZckptError, match=r"between 1024 and 1535 .*pass --max-group-size N"):
        reshard(str(Z3), str(tmp_path / "a"), world_size=4, ep=4)
    with pytest.raises(ZckptError, match=r"1000 would not cut .* between 1024 and 1535"):
        reshard(str(Z3), str(tmp_path / "b"), world_size=4, ep=4, max_group_size=1000)
    with pytest.raises(ZckptError, match=r"at least 3072 \(nothing was cut\)"):  # the uncut run's group: 6 x 512
        reshard(str(FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2"), str(tmp_path / "c"), world_size=4, ep=4,
                max_group_size=1100)
    p = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(Z3), "-o", str(tmp_path / "d"), "-w", "4",
                        "--ep", "4"], capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "--max-group-size N" in p.stderr
    assert not any((tmp_path / x).exists() for x in "abcd")


# ------------------------------------------------------------------------------------------------ DeepSpeed, 2 ranks

RESUME = [  # (fixture, the source: the fixture or zckpt's output of it at (ws, ep), the engine's ep at dp 2)
    (Z3, None, 1),  # AutoEP ZeRO-3 cut at 1100: dp 4 -> 2, ep 2 -> 1 (6 groups of one 1024-element parameter)
    (AUTOEP, None, 2),  # AutoEP ZeRO-2 cut at 600: dp 4 -> 2, ep 4 -> 2 (6 groups)
    (CUT, None, 1),  # native ZeRO-2 cut at 300: dp 4 -> 2, ep 2 -> 1 (5 groups)
    # sources whose cut allows limits that cut the engine's ep otherwise: the engine's own groups say the limit
    (Z3, (2, 1), 2),  # zckpt's ep 1 output (6 x 1024: 1024..2047) back at ep 2: 2 + 2 + 2 parameters at 1100
    (CUT, (4, 4), 2),  # zckpt's ep 4 output (286 + 42: 286..320) back at ep 2: 286, 288, 82 at 300
    (Z3, None, 2),  # dp 4 -> 2 only: the cut kept
    (CUT, None, 2),
]
RESUME_IDS = ["autoep-z3-ep2to1", "autoep-z2-ep4to2", "native-z2-ep2to1", "autoep-z3-ep1to2-engine-limit",
              "native-z2-ep4to2-engine-limit", "autoep-z3-dp4to2", "native-z2-dp4to2"]


@pytest.fixture(scope="module")
def cut_resumed(tmp_path_factory):
    """One DeepSpeed 0.19.8 launch of 2 CPU ranks (tests/test_resume_moe_ep.py's worker: ``engine.load_checkpoint``
    routed through zckpt, one training step after): the offline ``reshard --ep`` output of the ZeRO-3 cut fixture
    (same sizes as the engine: DeepSpeed's own load of zckpt's files), then each cut source resumed by zckpt at
    dp 2 (another ep, or the same: the cut kept), every engine built at the run's max_group_size (the spec's)."""
    from tests import ds_oracle
    from tests.test_reshard_moe import _spec

    G = ds_oracle.generate_module()
    root = tmp_path_factory.mktemp("cut-resume")
    jobs = []
    for i, (fx, via, ep) in enumerate([(Z3, None, 1)] + RESUME):
        d = root / str(i)
        reshard(str(fx), str(d / "offline"), world_size=2, ep=ep)
        src = d / "offline" if i == 0 else fx
        if via:
            reshard(str(fx), str(d / "source"), world_size=via[0], ep=via[1])
            src = d / "source"
        spec = dict(_spec(fx.name), world_size=2, ep_size=ep)
        if spec["kind"] == "moe":
            spec["moe2_ep_size"] = ep
        (d / "oracle").mkdir(parents=True)
        jobs.append({"kind": "autoep" if spec["kind"] == "autoep" else "moe", "mode": "native", "spec": spec,
                     "ckpt": str(src), "out": str(d / "oracle"), "resave": str(d / "resaved")})
    with tempfile.TemporaryDirectory(prefix="zckpt-cut-resume-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps({"jobs": jobs}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(Path(__file__).resolve().parent / "test_resume_moe_ep.py"), str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), 900)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed cut-group resume at 2 ranks failed (rc={proc.returncode}):\n"
                               + proc.stdout.decode(errors="replace")[-6000:])
    return root


def _check_resumed(d: Path, src: Path, mode: str, source_ws: int):
    assert_same_state(src / "expected", d / "oracle" / "expected", skip=("lrs",))
    assert set(json.loads((d / "oracle" / "expected" / "oracle.json").read_text())["lrs"]) == {
        json.loads((src / "expected" / "spec.json").read_text())["lr"]}  # the saved lr, not the engine's lr / 3
    want = json.loads((src / "expected" / "oracle.json").read_text())
    for rank in range(2):
        info = json.loads((d / "oracle" / f"resumed_rank{rank}.json").read_text())
        assert (info["mode"], info["source_world_size"], info["world_size"]) == (mode, source_ws, 2)
        assert info["global_steps"] == want["global_steps"] + 1 and info["loss"] == info["loss"]  # one step, finite
    tag = (src / "latest").read_text().strip()
    assert_same_files(d / "offline", d / "resaved", tag)


@pytest.mark.slow
def test_deepspeed_loads_autoep_zero3_cut_at_another_ep(cut_resumed):
    """zckpt's ZeRO-3 output at dp 2, ep 1 (6 ep_size_1 groups, each its own sub-group): DeepSpeed's own
    load_checkpoint holds the source's every master, moment, router and dense weight, its re-save is zckpt's files."""
    d = cut_resumed / "0"
    names, subs, _ = _z3_groups(d / "offline" / Z3TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert names == ["dense-params"] + ["ep_size_1"] * 6 and subs[1:] == [(2, ["ep_size_1"])] * 6
    _check_resumed(d, Z3, "native", 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(RESUME)), ids=RESUME_IDS)
def test_resume_of_a_cut_source_at_another_size(cut_resumed, case):
    """zckpt.deepspeed.load_checkpoint of the cut source into the engine at dp 2 (and another ep): the engine holds the
    source's state bit for bit, its re-save equals the offline ``reshard --ep`` output (the native source's limit
    read from the engine's own groups, where the source's cut allows 288..320 and those cut ep 1 otherwise)."""
    fx, via, ep = RESUME[case]
    if via:  # without the engine's limit the source's cut alone does not say how to cut ep 2
        with pytest.raises(ZckptError, match="pass --max-group-size N"):
            reshard(str(cut_resumed / str(case + 1) / "source"), str(cut_resumed / "refused"), world_size=2, ep=ep)
    _check_resumed(cut_resumed / str(case + 1), fx, "reshard", via[0] if via else 4)
