"""Pipeline-parallel and mixture-of-experts checkpoints, against the live DeepSpeed engine.

The fixtures ``fixtures/pp2*`` (``PipelineModule`` over 2 stages, ZeRO-1, 1 or 2 data-parallel ranks) and
``fixtures/moe_*`` (native ``deepspeed.moe.layer.MoE``, 4 experts, ZeRO-2, ep_size 1 or 2 over 2 or 4 ranks) were
written by real DeepSpeed 0.19.8 (``fixtures/gen_parallel.py``). DeepSpeed's own converter cannot read either
layout (expected/NOTES.txt), so the reference is the engine state every rank captured right after the save and
rank 0 gathered (``expected/oracle.safetensors``: ``safe_get_full_fp32_param`` masters, ``safe_get_full_
optimizer_state`` moments, the live lp weights, the buffers), under the names of the whole model's state_dict.
We check that

* merge writes exactly those tensors under exactly those names (fp32: the masters; bf16: the live bf16 weights);
  frozen weights and buffers from the layer / main files; a tied pipeline module once;
* info and verify describe the layout (data-parallel and pipeline sizes, counts, steps, every file), and verify
  --deep catches a damaged layer or expert file;
* the expert-parallel rank of each optimizer file is the one the live engine had (``R % ep_size``);
* reshard of MoE without ZeRO and of ZeRO-0 pipelines is refused with a clear message (ZeRO-1 pipelines:
  test_reshard_parallel; ZeRO-1/2 MoE: test_reshard_moe); a missing layer, expert or stage file is named.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.ops.estimate import counts_from_checkpoint
from zckpt.ops.info import info as info_of
from zckpt.ops.verify import verify
from tests.conftest import FIXTURE_DIRS, checkpoint_path
from tests.test_merge import _merged

PP = [d for d in FIXTURE_DIRS if json.loads((d / "expected" / "spec.json").read_text()).get("kind") == "pipeline"]
MOE = [d for d in FIXTURE_DIRS if json.loads((d / "expected" / "spec.json").read_text()).get("kind") == "moe"]
ALL = PP + MOE


def _oracle(d: Path) -> tuple[dict, dict]:
    exp = d / "expected"
    return load_file(str(exp / "oracle.safetensors")), json.loads((exp / "oracle.json").read_text())


def _live(oracle: dict, prefix: str) -> dict:
    return {k.split("/", 1)[1]: v for k, v in oracle.items() if k.startswith(prefix + "/")}


def _ep_sizes(spec: dict):
    """info's ep_world_size: one size, or the sorted sizes of several MoE layers' expert groups"""
    sizes = sorted({spec.get("ep_size", 1)} | ({spec["moe2_ep_size"]} if spec.get("moe2_ep_size") else set()))
    return sizes[0] if len(sizes) == 1 else sizes


def test_fixtures_present():
    assert len(PP) >= 2 and len(MOE) >= 2, "the pipeline / MoE fixtures are committed under fixtures/"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fx", ALL, ids=[d.name for d in ALL])
def test_merge_equals_live_engine(fx, tmp_path, dtype):
    oracle, info = _oracle(fx)
    module, buffers, masters = _live(oracle, "module"), _live(oracle, "buffer"), _live(oracle, "fp32")
    zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype=dtype)
    got = _merged(tmp_path / "out")
    assert set(got) == set(module) | set(buffers), "names are the live model's state_dict keys"
    target = torch.float32 if dtype == "fp32" else torch.bfloat16
    for name, t in got.items():
        if name in buffers:
            want = buffers[name].to(target) if buffers[name].is_floating_point() else buffers[name]
        elif name in masters:  # trainable: the fp32 master, cast like DeepSpeed's converter does
            want = masters[name].to(target)
            if dtype == "bf16":  # and that is the engine's own bf16 weight after the step
                assert torch.equal(module[name].to(target), want), name
        else:
            assert name in info["frozen"], name
            want = module[name].to(target)
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert set(info["frozen"]) <= set(got) and set(info["trainable"]) <= set(got)


@pytest.mark.parametrize("fx", ALL, ids=[d.name for d in ALL])
def test_moments_and_steps_equal_live_engine(fx):
    oracle, info = _oracle(fx)
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    byname = ckpt.by_name()
    from zckpt.encoding.tensors import load_pieces
    for kind in ("exp_avg", "exp_avg_sq"):
        live = _live(oracle, kind)
        assert set(live) == set(info["trainable"])
        for name, want in live.items():
            pieces = getattr(byname[name], kind)
            got = load_pieces(pieces, pieces[0].dtype, byname[name].shape)
            assert torch.equal(got, want.reshape(got.shape)), (kind, name)
    assert {g.step for g in ckpt.groups} == {info["step"]}
    assert ckpt.model_state["global_steps"] == info["global_steps"]


@pytest.mark.parametrize("fx", ALL, ids=[d.name for d in ALL])
def test_info_and_counts(fx):
    oracle, info = _oracle(fx)
    spec = json.loads((fx / "expected" / "spec.json").read_text())
    d = info_of(str(checkpoint_path(fx)))
    pp = spec.get("pp", 1)
    assert d["dp_world_size"] == spec["world_size"] // pp and d["mp_world_size"] == pp
    assert d["pp_world_size"] == pp and d["tp_world_size"] == 1 and d["ep_world_size"] == _ep_sizes(spec)
    assert d["zero_stage"] == spec["stage"] and d["precision"] == spec["dtype"]
    assert d["counts"]["trainable"] == len(info["trainable"]) and d["counts"]["frozen"] == len(info["frozen"])
    assert d["counts"]["buffer"] == len(info["buffers"]) and d["counts"]["tied"] == 0
    tag_dir = checkpoint_path(fx) / info["tag"]
    assert sorted(f["name"] for f in d["files"]) == sorted(p.name for p in tag_dir.iterdir())
    # the estimator's counts equal DeepSpeed's model_to_params rule applied to the live model's parameters
    module = _live(oracle, "module")
    per_module: dict[str, int] = {}
    for name, t in module.items():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        per_module[owner] = per_module.get(owner, 0) + t.numel()
    assert counts_from_checkpoint(checkpoint_path(fx)) == (sum(t.numel() for t in module.values()),
                                                           max(per_module.values()))


@pytest.mark.parametrize("fx", ALL, ids=[d.name for d in ALL])
def test_verify_deep_catches_damaged_layer_or_expert_file(fx, tmp_path):
    src = checkpoint_path(fx)
    report = verify(str(src), deep=True)
    assert report.ok, report.to_json()
    copy = tmp_path / "ck"
    shutil.copytree(src, copy)
    tag = (copy / "latest").read_text().strip()
    victim = sorted(p for p in (copy / tag).iterdir() if p.name.startswith("layer_"))[-1]
    data = bytearray(victim.read_bytes())
    with zipfile.ZipFile(victim) as zf:  # flip a byte inside the first tensor's payload
        zi = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size)
    head = zi.header_offset
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
        int.from_bytes(data[head + 28:head + 30], "little")
    data[start] ^= 0xFF
    victim.write_bytes(bytes(data))
    if fx in MOE and json.loads((fx / "expected" / "spec.json").read_text())["stage"] == 0:
        # ZeRO-0 masters are told apart by the values they round to: the damage is found (and named) on reading
        with pytest.raises(CorruptFile, match=f"{victim.name}.*fails its CRC"):
            verify(str(copy), deep=True)
        return
    bad = verify(str(copy), deep=True)
    assert not bad.ok and any(victim.name in c.detail for c in bad.checks if not c.ok), bad.to_json()


@pytest.mark.parametrize("fx", PP, ids=[d.name for d in PP])
def test_pipeline_names_and_tied_module_once(fx):
    _, info = _oracle(fx)
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    names = [r.name for r in ckpt.records]
    assert names.count("tied_modules.embed.weight") == 1 and "0.weight" not in names
    assert ckpt.parallel == "pipeline" and info["parts"] == [0, 3, 6]
    assert {r.name for r in ckpt.of_kind("frozen")} == {"3.proj.weight"}  # only in layer_03 (ZeRO-1)
    assert ckpt.by_name()["3.proj.bias"].kind == "trainable"  # what tells layer 3 from a frozen tied module


@pytest.mark.parametrize("fx", MOE, ids=[d.name for d in MOE])
def test_moe_expert_parallel_ranks_match_engine(fx):
    """The expert-parallel rank of every optimizer file is the live engine's: ``R % ep`` by default, ``R // (ws/ep)``
    with ``use_data_before_expert_parallelism`` (read from the saved ds_config)."""
    from zckpt.deepspeed.expert_groups import expert_data_ranks
    _, info = _oracle(fx)
    ep = info["ep_size"]
    ws = len(info["ep_ranks"])
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    reader = {r: e for e in range(ep) for r in expert_data_ranks(ckpt.model_state, ws, ep, e, "")}
    assert info["ep_ranks"] == [reader[r] for r in range(ws)]
    dbe = (json.loads((fx / "expected" / "spec.json").read_text()).get("ds_config") or {}).get(
        "use_data_before_expert_parallelism")
    assert info["ep_ranks"] == [r // (ws // ep) if dbe else r % ep for r in range(ws)]
    experts = [r.name for r in ckpt.records if ".deepspeed_experts." in r.name]
    ids = sorted({int(n.split(".deepspeed_experts.")[1].split(".")[0]) for n in experts})
    assert ids == list(range(info["num_experts"]))
    if json.loads((fx / "expected" / "spec.json").read_text())["stage"] == 0:  # MoE without ZeRO: expp_rank files
        assert sorted(f.name for f in ckpt.files if f.kind == "expp") == \
            [f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(ep)]
        return
    counts = ckpt.optim_states[0]["optimizer_state_dict"]["partition_count"]
    names = [str(g.hyperparams.get("name")) for g in sorted(ckpt.groups, key=lambda g: g.index)]
    assert counts == [info["world_size"] // int(n[len("ep_size_"):]) if n.startswith("ep_size_") else info["world_size"]
                      for n in names]  # expert groups over ws / ep ranks, in rank 0's group order


# ZeRO-1 pipelines and ZeRO-1/2 MoE reshard their data-parallel size (tests/test_reshard_parallel.py,
# tests/test_reshard_moe.py); ZeRO-0 pipelines and MoE without ZeRO do not
REFUSED = [d for d in PP + MOE if json.loads((d / "expected" / "spec.json").read_text())["stage"] == 0]


@pytest.mark.parametrize("fx", REFUSED, ids=[d.name for d in REFUSED])
def test_reshard_refused(fx, tmp_path):
    with pytest.raises(UnsupportedLayout, match="pipeline-parallel|mixture-of-experts") as err:
        zckpt.reshard(str(checkpoint_path(fx)), str(tmp_path / "o"), world_size=1)
    assert "does not reshard" in str(err.value) or "not supported" in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


def _copy_without(fx: Path, tmp_path: Path, pick) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(checkpoint_path(fx), copy)
    tag = (copy / "latest").read_text().strip()
    victim = next(p for p in sorted((copy / tag).iterdir()) if pick(p.name))
    victim.unlink()
    return copy


@pytest.mark.parametrize("which,pick", [
    ("layer", lambda n: n.startswith("layer_01")),
    ("stage optimizer", lambda n: n.endswith("mp_rank_01_optim_states.pt")),
    ("stage model", lambda n: n == "mp_rank_01_model_states.pt"),
])
def test_pipeline_missing_file_named(tmp_path, which, pick):
    if not PP:
        pytest.skip("no pipeline fixture")
    copy = _copy_without(PP[0], tmp_path, pick)
    with pytest.raises(IncompleteCheckpoint):
        zckpt.open_checkpoint(str(copy))


def test_moe_missing_expert_file_named(tmp_path):
    if not MOE:
        pytest.skip("no MoE fixture")
    copy = _copy_without(MOE[0], tmp_path, lambda n: n.startswith("layer_0_expert_2_"))
    with pytest.raises(IncompleteCheckpoint, match="layer_0_expert_2_mp_rank_00_model_states.pt"):
        zckpt.open_checkpoint(str(copy))


@pytest.mark.parametrize("fx", MOE, ids=[d.name for d in MOE])
def test_moe_loads_strictly_into_the_ep1_model(fx):
    """The merged names are the state_dict of the same model built with ep_size=1 (all experts local), in order."""
    from fixtures import gen_parallel
    oracle, _ = _oracle(fx)
    spec = json.loads((fx / "expected" / "spec.json").read_text())
    model = gen_parallel.build_moe({**spec, "ep_size": 1, "moe2_ep_size": 1 if spec.get("moe2_ep_size") else None})
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    assert [r.name for r in ckpt.records] == list(model.state_dict())
    zckpt.load_into_module(model, ckpt)  # strict: no missing or unexpected keys
    for name, t in model.state_dict().items():
        want = oracle.get(f"fp32/{name}", oracle.get(f"buffer/{name}"))
        assert torch.equal(t, want.to(t.dtype)), name


_PIPE_NAMES = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from fixtures import gen_parallel
m = gen_parallel.build_pipeline({"pp": 1, "seed": 1234})
print(json.dumps([[k, list(v.shape)] for k, v in m.state_dict().items()]))
"""


def test_pipeline_names_are_the_whole_pipeline_module_state_dict(tmp_path):
    """The same PipelineModule built as ONE stage (one process) has exactly our names, shapes and order."""
    import os
    import subprocess
    import sys

    from fixtures.generate import _free_port
    if not PP:
        pytest.skip("no pipeline fixture")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _PIPE_NAMES], cwd=str(Path(__file__).resolve().parents[1]),
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    want = [(k, tuple(s)) for k, s in json.loads(out.stdout.strip().splitlines()[-1])]
    for fx in PP:
        ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
        assert [(r.name, tuple(r.shape)) for r in ckpt.records] == want, fx.name
