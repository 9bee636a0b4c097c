"""AutoEP (DeepSpeed 0.19.2+ automatic expert parallelism) checkpoints, against the live engine.

``fixtures/moe_autoep_z2_bf16_ws2_ep2`` was written by real DeepSpeed 0.19.8 on 2 CPU ranks (``fixtures/gen_autoep.py``:
a random tiny Mixtral, 4 experts, ``autoep_size`` 2, ZeRO-2 bf16). The reference is the engine's state captured
right after the save (``expected/oracle.safetensors``): ``safe_get_full_*`` masters and moments, each fused expert
parameter put together from both expert-parallel ranks' local experts. We check that

* merge (fp32, bf16) and ``load_state_dict`` give exactly those tensors under the live model's names, each fused
  expert parameter at its logical ``[num_experts, ...]`` shape; the router alias DeepSpeed does not record as a
  tie is tied to its parameter (DeepSpeed's own ``ds_to_universal`` gives its bf16 copy instead);
* the Adam moments of every parameter equal the engine's;
* info reports the layout (dp 2, ep 2), verify --deep passes and catches a damaged expert file;
* reshard to a data-parallel size that is not a multiple of ep is refused in one line (the data-parallel
  reshard itself: tests/test_reshard_moe.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.errors import UnsupportedLayout
from zckpt.formats.tensors import load_pieces
from zckpt.ops.info import info as info_of
from tests.conftest import FIXTURES, checkpoint_path
from tests.test_merge import _merged

FX = FIXTURES / "moe_autoep_z2_bf16_ws2_ep2"


@pytest.fixture(scope="module")
def oracle():
    if not (FX / "expected" / "spec.json").exists():
        pytest.fail("fixtures/moe_autoep_z2_bf16_ws2_ep2 missing (python fixtures/generate.py --only ...)")
    return (load_file(str(FX / "expected" / "oracle.safetensors")),
            json.loads((FX / "expected" / "oracle.json").read_text()))


def _live(tensors: dict, prefix: str) -> dict:
    return {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + "/")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_merge_equals_live_engine(oracle, tmp_path, dtype):
    tensors, info = oracle
    masters = _live(tensors, "fp32")
    zckpt.merge(str(checkpoint_path(FX)), str(tmp_path / "out"), dtype=dtype)
    got = _merged(tmp_path / "out")
    target = torch.float32 if dtype == "fp32" else torch.bfloat16
    aliases = {a: b for a, b in info["tied"]}
    assert set(got) | set(aliases) == set(info["param_names"])
    for name in info["param_names"]:
        src = aliases.get(name, name)
        assert torch.equal(got[src], masters[name].to(target)), name
    for name in info["expert_params"]:  # fused experts at their logical shape: every expert-parallel rank's
        assert got[name].shape[0] == info["model_dims"]["experts"], name


def test_state_dict_moments_and_tie_equal_live_engine(oracle):
    tensors, info = oracle
    ck = str(checkpoint_path(FX))
    sd = zckpt.load_state_dict(ck)
    masters = _live(tensors, "fp32")
    for name in info["param_names"]:
        assert torch.equal(sd[name], masters[name]), name
    ckpt = zckpt.open_checkpoint(ck)
    byname = ckpt.by_name()
    for alias, src in info["tied"]:  # DeepSpeed's shared_params misses it; the bytes tell
        assert byname[alias].kind == "tied" and byname[alias].tied_to == src
    for kind in ("exp_avg", "exp_avg_sq"):
        for name, want in _live(tensors, kind).items():
            rec = byname[name]
            rec = byname[rec.tied_to] if rec.kind == "tied" else rec
            got = load_pieces(getattr(rec, kind), rec.state_dtype, rec.shape)
            assert torch.equal(got, want.reshape(got.shape)), (kind, name)
    assert [r.name for r in ckpt.records] == info["param_names"]  # the live model's order


def test_info_verify_and_reshard_refused(oracle, tmp_path):
    _, info = oracle
    ck = checkpoint_path(FX)
    d = info_of(str(ck))
    assert (d["dp_world_size"], d["ep_world_size"], d["pp_world_size"], d["tp_world_size"]) == (2, 2, 1, 1)
    assert d["zero_stage"] == 2 and d["precision"] == "bf16" and d["global_steps"] == info["global_steps"]
    assert d["counts"]["tied"] == len(info["tied"])
    assert zckpt.verify(str(ck), deep=True).ok
    with pytest.raises(UnsupportedLayout, match="mixture-of-experts") as err:  # ep 2 is kept (test_reshard_moe)
        zckpt.reshard(str(ck), str(tmp_path / "o"), world_size=1)
    assert "not a multiple of the expert-parallel size 2" in str(err.value) and not (tmp_path / "o").exists()
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    tag = (copy / "latest").read_text().strip()
    victim = sorted((copy / tag).glob("layer_0_expert_3_*"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    try:
        bad = zckpt.verify(str(copy), deep=True)
    except Exception as exc:  # damage in the zip structure itself: refused, naming the file
        assert victim.name in str(exc)
    else:
        assert not bad.ok and any(victim.name in c.detail for c in bad.checks if not c.ok)


def test_missing_expert_file_named(tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(checkpoint_path(FX), copy)
    tag = (copy / "latest").read_text().strip()
    next((copy / tag).glob("layer_0_expert_2_*")).unlink()
    with pytest.raises(Exception, match="layer_0_expert_2_mp_rank_00_model_states.pt"):
        zckpt.open_checkpoint(str(copy))


def test_autoep_zero3_refused_in_one_line():
    fx = FIXTURES / "ambiguous" / "moe_autoep_z3_bf16_ws2_ep2"
    if not (fx / "expected" / "spec.json").exists():
        pytest.fail(f"{fx} missing (python fixtures/generate.py --only ambiguous/moe_autoep_z3_bf16_ws2_ep2)")
    with pytest.raises(UnsupportedLayout, match="AutoEP checkpoint of ZeRO-3"):
        zckpt.open_checkpoint(str(checkpoint_path(fx)))
