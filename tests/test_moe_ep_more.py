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

import os
import subprocess
import sys

import pytest

from zckpt.errors import ZckptError
from zckpt.ops.reshard import reshard
from tests.test_reshard import assert_same_files, assert_same_tree, _torch_load
from tests.test_reshard_moe import FIX, _check_loaded, _launch, _spec


def _same_files(src, b):
    tag = (src / "latest").read_text().strip()
    assert sorted(os.listdir(src / tag)) == sorted(os.listdir(b / tag))
    for n in sorted(os.listdir(src / tag)):
        assert_same_tree(_torch_load(src / tag / n), _torch_load(b / tag / n), n)


def _groups(path):
    o = _torch_load(path)["optimizer"]
    return [(pg["name"], len(pg["params"])) for pg in o["optimizer_state_dict"]["param_groups"]]


# ------------------------------------------------------------------------------------------------ without ZeRO

@pytest.mark.slow
@pytest.mark.parametrize("name,ws,ep", [("moe_z0_bf16_ws2_ep2", 4, 4), ("moe_z0_bf16_ws2_ep2_ep1", 4, (4, 2))],
                         ids=["ep2-to-4", "ep2+ep1-to-4+2"])
def test_zero0_ep_reshard_loads_natively(tmp_path, name, ws, ep):
    """MoE without ZeRO at another expert-parallel size: DeepSpeed loads each rank's expp_rank file of its new
    expert-parallel rank with the source's state, and re-saves zckpt's files."""
    src, out, oracle, again = FIX / name, tmp_path / "out", tmp_path / "oracle", tmp_path / "resaved"
    reshard(str(src), str(out), world_size=ws, ep=ep)
    eps = (ep,) if isinstance(ep, int) else ep
    spec = dict(_spec(name), world_size=ws, ep_size=eps[0], **({"moe2_ep_size": eps[1]} if len(eps) > 1 else {}))
    _launch({"kind": "moe", "mode": "native", "spec": spec, "ckpt": str(out), "out": str(oracle),
             "resave": str(again)}, ws)
    info = _check_loaded(src, oracle, ws)
    assert info["ep_ranks"] == [r % eps[0] for r in range(ws)] and info["loaded_dp"] == ws
    assert_same_files(out, again, (src / "latest").read_text().strip())


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
