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

``fixtures/moe_autoep_z3_bf16_ws2_ep2`` is the same model at ZeRO-3 (``checkpoint_format: zero3_partitioned``: no
expert files, each rank's local expert shards partitioned over its expert-data-parallel group in the ZeRO-3
optimizer file). The same merge / state / moments / tie comparisons run on it; info, verify --deep and convert to
DCP equal the engine; reshard to a size not a multiple of ep is refused in one line (the reshard itself, at
another ep too: tests/test_moe_ep_more.py); damaged files (a wrong partition record, a short expert flat
group, affine maps that overlap, flipped bytes) are refused or reported naming the file.

``fixtures/moe_autoep_z3_bf16_ws4_ep2`` is that model on 4 ranks, ep 2: expert-data-parallel size 2 (groups [0, 2]
and [1, 3]), each local expert parameter split in ceil(n/2) slices over its two ranks. The merge / state / moments /
tie / info / verify / convert tests run on it too; two ranks of one group claiming the same slice are refused.
``fixtures/moe_autoep_z3_bf16_ws6_ep2`` (6 ranks, ep 2: edp 3) has local expert params of 256 elements, not a
multiple of 3: 86 per rank, the last slice 84 and 2 of padding; the same tests run on it.

Two MoE layers of 8 experts, top-2 (issue 47): ``fixtures/moe_autoep_z3_bf16_ws4_ep2_l2`` (a random tiny Qwen3-MoE
at ZeRO-3, ws 4, ep 2: both layers' experts in one ZeRO-3 sub-group, which earlier zckpt refused) and
``moe_autoep_z2_bf16_ws4_ep4_l2`` (Mixtral at ZeRO-2, ep 4): merge (AutoEP's names, ``native_names``), state and
moments = the engine; the ZeRO-3 one also info / verify --deep / convert. Under the model class's own names:
tests/test_moe_hf_names.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.errors import UnsupportedLayout
from zckpt.encoding.tensors import load_pieces
from zckpt.ops.info import info as info_of
from tests.conftest import FIXTURES, checkpoint_path
from tests.test_merge import _merged

FX = FIXTURES / "moe_autoep_z2_bf16_ws2_ep2"
FX3 = FIXTURES / "moe_autoep_z3_bf16_ws2_ep2"
FX3W4 = FIXTURES / "moe_autoep_z3_bf16_ws4_ep2"  # expert-data-parallel size 2: expert shards split over 2 ranks
FX3W6 = FIXTURES / "moe_autoep_z3_bf16_ws6_ep2"  # edp 3: 256 elements per local expert param, ceil(256/3) = 86
# two MoE layers of 8 experts, top-2 (issue 47): Qwen3-MoE at ZeRO-3 (both layers' experts in one sub-group), ws 4
# ep 2; Mixtral at ZeRO-2, ws 4 ep 4 (two experts per rank)
FX3L2 = FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2"
FX2L2 = FIXTURES / "moe_autoep_z2_bf16_ws4_ep4_l2"


def _oracle(fx: Path):
    if not (fx / "expected" / "spec.json").exists():
        pytest.fail(f"fixtures/{fx.name} missing (python fixtures/generate.py --only {fx.name})")
    return (load_file(str(fx / "expected" / "oracle.safetensors")),
            json.loads((fx / "expected" / "oracle.json").read_text()))


@pytest.fixture(scope="module")
def oracle():
    return _oracle(FX)


@pytest.fixture(scope="module", params=[FX, FX3, FX3W4, FX3W6, FX3L2, FX2L2],
                ids=["zero2", "zero3", "zero3-edp2", "zero3-edp3", "zero3-2layers", "zero2-2layers-ep4"])
def both(request):
    return request.param, _oracle(request.param)


def _live(tensors: dict, prefix: str) -> dict:
    return {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + "/")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_merge_equals_live_engine(both, tmp_path, dtype):
    fx, (tensors, info) = both
    masters = _live(tensors, "fp32")
    # AutoEP's own names (the model class's: tests/test_moe_hf_names.py)
    zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype=dtype, native_names=True)
    got = _merged(tmp_path / "out")
    target = torch.float32 if dtype == "fp32" else torch.bfloat16
    aliases = {a: b for a, b in info["tied"]}
    assert set(got) | set(aliases) == set(info["param_names"])
    for name in info["param_names"]:
        src = aliases.get(name, name)
        assert torch.equal(got[src], masters[name].to(target)), name
    for name in info["expert_params"]:  # fused experts at their logical shape: every expert-parallel rank's
        assert got[name].shape[0] == info["model_dims"]["experts"], name


def test_state_dict_moments_and_tie_equal_live_engine(both):
    fx, (tensors, info) = both
    ck = str(checkpoint_path(fx))
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


@pytest.mark.parametrize("fx", [FX3, FX3W4, FX3W6, FX3L2], ids=["edp1", "edp2", "edp3", "2layers-one-subgroup"])
def test_zero3_info_verify_convert(tmp_path, fx):
    tensors, info = _oracle(fx)
    ck = checkpoint_path(fx)
    d = info_of(str(ck))
    ws = info["world_size"]
    assert (d["dp_world_size"], d["ep_world_size"], d["pp_world_size"], d["tp_world_size"]) == (ws, 2, 1, 1)
    assert d["zero_stage"] == 3 and d["precision"] == "bf16" and d["global_steps"] == info["global_steps"]
    assert d["counts"]["tied"] == len(info["tied"])
    ckpt = zckpt.open_checkpoint(str(ck))
    steps = {g.hyperparams.get("name"): g.step for g in ckpt.groups}
    assert steps == {"dense-params": info["step"], "ep_size_2": info["step"]}
    assert zckpt.verify(str(ck), deep=True).ok
    with pytest.raises(UnsupportedLayout, match="not a multiple of the expert-parallel size 2") as err:
        zckpt.reshard(str(ck), str(tmp_path / "o"), world_size=1)  # (reshard: tests/test_moe_ep_more.py)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
    # to DCP: every master and moment under its name, = the engine (the router alias is tied: no state of its own)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    zckpt.convert(str(ck), out=str(tmp_path / "dcp"), native_names=True)  # (the model's names: test_moe_dcp)
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "dcp.pt"))
    sd = torch.load(tmp_path / "dcp.pt", weights_only=False)
    aliases = {a for a, _ in info["tied"]}
    for name, want in _live(tensors, "fp32").items():
        assert torch.equal(sd["model"][name], want), name
    for kind in ("exp_avg", "exp_avg_sq"):
        for name, want in _live(tensors, kind).items():
            if name not in aliases:
                got = sd["optim"]["state"][name][kind]
                assert torch.equal(got, want.reshape(got.shape)), (kind, name)


def _rewrite(path: Path, change) -> None:
    """Load one DeepSpeed file with torch, change it, save it back (the damaged copy of a real file)."""
    obj = torch.load(path, weights_only=False, map_location="cpu")
    change(obj)
    torch.save(obj, path)


def _z3_copy(tmp_path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(checkpoint_path(FX3), copy)
    return copy / (copy / "latest").read_text().strip()


def _edp_rank(ms):  # rank 1 says it is the second rank of its expert-data-parallel group (of 1)
    ms["ds_autoep_layers"][0]["expert_data_parallel_rank"] = 1


def _partition_ranks(st):  # rank 1 says its expert sub-group is partitioned over rank 0
    st["optimizer_state_dict"]["ds_zero_partition_groups"][1]["partition_ranks"] = [0]


def _short_flat(st):
    osd = st["optimizer_state_dict"]
    osd["fp32_flat_groups"][1] = osd["fp32_flat_groups"][1][:-8].clone()


def _overlap(ms):  # ep rank 1's block put over ep rank 0's: one block twice, one never
    for layer in (ms["ds_autoep_layers"], ms["universal_checkpoint_info"]["ds_autoep_layers"]):
        layer[0]["affine_maps"]["params"]["model.layers.0.mlp.experts.w2"]["ranks"][1]["pieces"][0]["source"][0] = 0


@pytest.mark.parametrize("victim,change,message", [
    ("zero_pp_rank_1_mp_rank_00_model_states.pt", _edp_rank, "not partitioned as its expert-data-parallel group"),
    ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", _partition_ranks, "says ranks \\[0\\], rank 0 of 1"),
    ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", _short_flat, "expert sub-group 1: fp32 partition has 760"),
    ("*model_states.pt", _overlap, "MoE layer 0 \\(model.layers.0.mlp\\): expert 0 is held twice \\(expert-parallel "
                                   "ranks 0 and 1\\)"),
], ids=["edp-rank", "partition-ranks", "short-expert-group", "overlapping-maps"])
def test_zero3_damaged_file_refused_in_one_line(tmp_path, victim, change, message):
    tag = _z3_copy(tmp_path)
    files = sorted(tag.glob(victim))
    for f in files:
        _rewrite(f, change)
    with pytest.raises(Exception, match=message) as err:
        zckpt.open_checkpoint(str(tag.parent))
    named = {getattr(err.value, "path", "") or ""} | {str(err.value)}
    assert any(f.name in n for f in files for n in named) and "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, "-m", "zckpt", "info", str(tag.parent)], capture_output=True, text=True,
                          cwd=FIXTURES.parent, env={**os.environ, "PYTHONPATH": str(FIXTURES.parent)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and re.search(message, lines[0]) and not proc.stdout, proc.stderr
    assert any(f.name in lines[0] for f in files)


def test_zero3_edp2_duplicate_slice_refused(tmp_path):
    """Rank 2 (second of expert-data-parallel group [0, 2]) says it holds slice 0, as rank 0 does."""
    copy = tmp_path / "ck"
    shutil.copytree(checkpoint_path(FX3W4), copy)
    victim = copy / (copy / "latest").read_text().strip() / "zero_pp_rank_2_mp_rank_00_model_states.pt"
    ms = torch.load(victim, weights_only=False, map_location="cpu")
    assert ms["ds_autoep_layers"][0]["expert_data_parallel_rank"] == 1  # the real file: rank 2 holds slice 1
    _rewrite(victim, lambda m: m["ds_autoep_layers"][0].__setitem__("expert_data_parallel_rank", 0))
    with pytest.raises(Exception, match="not partitioned as its expert-data-parallel group") as err:
        zckpt.open_checkpoint(str(copy))
    assert victim.name in str(err.value) + str(getattr(err.value, "path", "")) and "\n" not in str(err.value)


def test_zero3_flipped_bytes_and_missing_rank_named(tmp_path):
    tag = _z3_copy(tmp_path)
    victim = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    try:
        bad = zckpt.verify(str(tag.parent), deep=True)
    except Exception as exc:  # damage in the zip structure itself: refused, naming the file
        assert victim.name in str(exc) or victim.name in str(getattr(exc, "path", ""))
    else:
        assert not bad.ok and any(victim.name in c.detail for c in bad.checks if not c.ok)
    victim.unlink()
    with pytest.raises(Exception, match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        zckpt.open_checkpoint(str(tag.parent))
