"""``zckpt reshard --ep N``: a native DeepSpeed MoE checkpoint (ZeRO-2) laid out at another expert-parallel size
(issue 47, item 1), checked by real DeepSpeed 0.19.8.

Two DeepSpeed launches (CI time), each at 4 CPU ranks building the model with ``ep_size`` 4 from another seed and
capturing its state (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, experts under their global
ids), which must equal the source's live state bit for bit, then saving again at ep 4, which must equal
``zckpt reshard --ep 4``'s output file for file:

* native MoE ``fixtures/moe_z2_bf16_ws2_ep2`` (ep 2 x dp 2) resumed with ``zckpt.deepspeed.load_checkpoint`` at
  ep 4 x dp 4 (each rank's files laid out in memory as the offline reshard writes them; a plain
  ``engine.load_checkpoint`` of the offline output was run the same way by hand, same state and files);
* AutoEP ``fixtures/moe_autoep_z2_bf16_ws2_ep2`` resharded offline to ep 4 x dp 4 and loaded by a plain
  ``engine.load_checkpoint``.

Without DeepSpeed: ep 2 -> 1 -> 2, 2 -> 4 -> 2 (also with ``use_data_before_expert_parallelism``, and AutoEP) give
back every source file; refusals are one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zckpt.errors import UnsupportedLayout, ZckptError
from zckpt.ops.reshard import reshard
from tests.test_reshard import assert_same_files, assert_same_tree, _torch_load
from tests.test_reshard_moe import FIX, _check_loaded, _launch, _spec


@pytest.mark.slow
def test_autoep_ep_reshard_loads_natively_at_the_new_ep(tmp_path):
    """AutoEP (ZeRO-2): ep 2 x dp 2 -> ep 4 x dp 4, loaded by a plain engine.load_checkpoint (ds_autoep_layers,
    affine maps and placement as DeepSpeed writes them at ep 4)."""
    name, ws, ep = "moe_autoep_z2_bf16_ws2_ep2", 4, 4
    src, out, oracle, again = FIX / name, tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    res = reshard(str(src), str(out), world_size=ws, ep=ep)
    assert any("expert-parallel size 2 -> 4" in n for n in res.plan.notes)
    _launch({"kind": "autoep", "mode": "native", "spec": dict(_spec(name), world_size=ws, ep_size=ep),
             "ckpt": str(out), "out": str(oracle), "resave": str(again)}, ws)
    info = _check_loaded(src, oracle, ws)  # every master, moment, weight, step = the source's engine
    assert info["ep_ranks"] == [{k: r for k in info["ep_ranks"][0]} for r in range(ws)]
    assert_same_files(out, again, (src / "latest").read_text().strip())  # = what DeepSpeed saves at ep 4


@pytest.mark.slow
def test_resume_at_another_ep_equals_the_source(tmp_path):
    """``zckpt.deepspeed.load_checkpoint`` of the ep 2 x dp 2 source into an engine of ep 4 x dp 4 (each rank's
    files laid out in memory at ep 4): the engine's state is the source's, and what it saves equals the offline
    ``reshard --ep 4`` output file for file."""
    name, ws, ep = "moe_z2_bf16_ws2_ep2", 4, 4
    src, out, oracle, again = FIX / name, tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    reshard(str(src), str(out), world_size=ws, ep=ep)
    _launch({"kind": "moe", "mode": "zckpt", "spec": dict(_spec(name), world_size=ws, ep_size=ep), "ckpt": str(src),
             "out": str(oracle), "resave": str(again)}, ws)
    info = _check_loaded(src, oracle, ws)
    assert info["resumed"] == {"mode": "reshard", "source_world_size": 2, "world_size": ws}
    assert_same_files(out, again, (src / "latest").read_text().strip())


@pytest.mark.parametrize("name,mid_ws,mid_ep", [
    ("moe_z2_bf16_ws2_ep2", 2, 1), ("moe_z2_bf16_ws2_ep2", 4, 4), ("moe_z2_bf16_ws4_ep2_dbe", 4, 4),
    ("moe_autoep_z2_bf16_ws2_ep2", 4, 4), ("moe_autoep_z2_bf16_ws4_ep4_l2", 4, 2)],
    ids=["ep1", "ep4", "dbe-ep4", "autoep-ep4", "autoep-2layers-ep2"])
def test_ep_round_trip_reproduces_every_file(tmp_path, name, mid_ws, mid_ep):
    """ep 2 -> mid_ep -> 2 (use_data_before_expert_parallelism too: expert-data-parallel blocks)."""
    src, a, b = FIX / name, tmp_path / "a", tmp_path / "b"
    reshard(str(src), str(a), world_size=mid_ws, ep=mid_ep)
    reshard(str(a), str(b), world_size=_spec(name)["world_size"], ep=_spec(name)["ep_size"])
    tag = (src / "latest").read_text().strip()
    assert sorted(os.listdir(src / tag)) == sorted(os.listdir(b / tag))
    for n in sorted(os.listdir(src / tag)):
        assert_same_tree(_torch_load(src / tag / n), _torch_load(b / tag / n), n)
    osd = _torch_load(a / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert osd["partition_count"] == [mid_ws, mid_ws // mid_ep]
    assert osd["base_optimizer_state"]["param_groups"][1]["name"] == f"ep_size_{mid_ep}"
    ms = _torch_load(a / tag / "mp_rank_00_model_states.pt")
    experts = (_spec(name).get("autoep_model") or {}).get("experts", 4)
    if ms.get("ds_autoep_layers"):  # rank 0's fused shards of experts/ep experts
        assert {tuple(s)[0] for s in ms["param_shapes"][1].values()} == {experts // mid_ep}
        assert all(x["ep_size"] == mid_ep and x["expert_data_parallel_world_size"] == mid_ws // mid_ep
                   for x in ms["ds_autoep_layers"])
    else:  # rank 0's local expert ids
        local = ms["param_shapes"][1]
        assert {int(n.split(".deepspeed_experts.")[1].split(".")[0]) for n in local} == set(range(4 // mid_ep))


@pytest.mark.parametrize("name,kw,words", [
    ("moe_autoep_z3_bf16_ws2_ep2", dict(world_size=6, ep=4), "not a multiple of the expert-parallel size 4"),
    ("moe_z2_bf16_ws2_ep2", dict(world_size=4, ep=3), "4 experts do not split over expert-parallel size 3"),
    ("moe_z2_bf16_ws2_ep2", dict(world_size=2, ep=4), "data-parallel size 2 is not a multiple of the "
                                                       "expert-parallel size 4"),
    ("z2_bf16_ws2", dict(world_size=4, ep=2), "no experts"),
], ids=["autoep-zero3", "not-dividing", "dp-not-multiple", "dense"])
def test_ep_refusals_are_one_line(tmp_path, name, kw, words):
    with pytest.raises(ZckptError) as err:
        reshard(str(FIX / name), str(tmp_path / "o"), **kw)
    assert words in str(err.value) and "\n" not in str(err.value) and not (tmp_path / "o").exists()


def test_cli_ep(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(FIX / "moe_z2_bf16_ws2_ep2"), "-w", "4",
                           "--ep", "4", "-o", str(tmp_path / "o"), "--json"], capture_output=True, text=True,
                          cwd=FIX.parent)
    assert proc.returncode == 0 and "expert-parallel size 2 -> 4" in proc.stdout, proc.stderr
