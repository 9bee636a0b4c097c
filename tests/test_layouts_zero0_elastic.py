"""ZeRO-0 and elastic (``elastic_checkpoint: true``) checkpoints, against the live DeepSpeed engine.

The fixtures (``fixtures/z0_*``, ``fixtures/*_elastic``) were written by real DeepSpeed 0.19.8; DeepSpeed's own
converter cannot read ZeRO-0 (expected/NOTES.txt), so the reference is the engine's state captured right after
the save (``expected/oracle.safetensors``: the optimizer wrapper's fp32 masters and Adam moments, module weights,
buffers). We check that

* merge (fp32 and bf16 output) writes exactly those values: masters for trainable parameters, the module
  weights for frozen ones, the buffers; tied aliases point at their source;
* info and verify report the layout (stage, optimizer, precision, dtypes, counts, steps) as the run recorded it;
* a ZeRO-0 reshard is refused with a clear message, an elastic checkpoint reshards into the elastic form and real
  DeepSpeed loads it at the new world size with identical state (and saves the same files again);
* the ZeRO-0 name matching accepts only a single fitting mapping.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.deepspeed.zero0 import match_groups
from zckpt.errors import UnsupportedLayout
from zckpt.ops.info import info as info_of
from tests.conftest import FIXTURE_DIRS, checkpoint_path
from tests.test_merge import _merged

ROOT = Path(__file__).resolve().parents[1]


def _spec(d: Path) -> dict:
    return json.loads((d / "expected" / "spec.json").read_text())


def _is_elastic(d: Path) -> bool:
    return bool((_spec(d).get("zero") or {}).get("elastic_checkpoint"))


ZERO0 = [d for d in FIXTURE_DIRS if _spec(d).get("stage") == 0 and _spec(d).get("kind", "engine") == "engine"]
ELASTIC = [d for d in FIXTURE_DIRS if _is_elastic(d)]
BOTH = ZERO0 + ELASTIC
IDS = [d.name for d in BOTH]


def _oracle(d: Path) -> tuple[dict, dict]:
    return load_file(str(d / "expected" / "oracle.safetensors")), json.loads((d / "expected" / "oracle.json").read_text())


def _want(oracle: dict, name: str) -> torch.Tensor:
    """What the live engine holds for ``name``: the master of a trainable parameter, else the module's value."""
    for prefix in ("fp32/", "buffer/", "module/"):
        if prefix + name in oracle:
            return oracle[prefix + name]
    raise KeyError(name)


def test_fixtures_present():
    assert ZERO0 and ELASTIC, "the ZeRO-0 / elastic fixtures are missing (fixtures/generate.py --only ...)"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fx", BOTH, ids=IDS)
def test_merge_equals_live_engine(fx, tmp_path, dtype):
    oracle, info = _oracle(fx)
    res = zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype=dtype)
    got = _merged(tmp_path / "out")
    target = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    names = list(dict.fromkeys(info["param_names"] + info["buffers"]))
    for name in names:
        src = res.plan.skipped_tied.get(name, name)
        assert src in got, f"{name} missing"
        want = _want(oracle, name)
        want = want.to(target) if want.is_floating_point() else want
        assert got[src].dtype == want.dtype, name
        assert torch.equal(got[src].view(torch.uint8), want.reshape(got[src].shape).view(torch.uint8)), name
    assert set(got) <= set(names), set(got) - set(names)
    if fx in ZERO0:  # the masters differ from the bf16/fp16 module copies: merge took the masters
        ms = zckpt.open_checkpoint(str(checkpoint_path(fx))).model_state["module"]
        trainable = [n for n in info["trainable"] if f"fp32/{n}" in oracle]
        assert trainable
        if _spec(fx)["dtype"] != "fp32" and dtype == "fp32":
            assert any(ms[n].dtype != "float32" for n in trainable)


@pytest.mark.parametrize("fx", BOTH, ids=IDS)
def test_load_state_dict_equals_live_engine(fx):
    oracle, info = _oracle(fx)
    sd = zckpt.load_state_dict(str(checkpoint_path(fx)))
    for name in info["param_names"] + info["buffers"]:
        want = _want(oracle, name)
        assert torch.equal(sd[name], want.to(sd[name].dtype)), name
        if want.is_floating_point() and f"fp32/{name}" in oracle:
            assert sd[name].dtype == torch.float32, name


@pytest.mark.parametrize("fx", BOTH, ids=IDS)
def test_info_reports_the_layout(fx):
    _, info = _oracle(fx)
    spec = _spec(fx)
    d = info_of(str(checkpoint_path(fx)))
    assert d["zero_stage"] == spec["stage"]
    assert d["optimizer"] == ("zero0" if spec["stage"] == 0 else "zero")
    assert d["precision"] == spec["dtype"]
    assert d["dp_world_size"] == spec["world_size"] == info["world_size"]
    assert (d["pp_world_size"], d["tp_world_size"], d["ep_world_size"]) == (1, 1, 1)
    assert d["master_dtype"] == "float32" and d["optimizer_state_dtype"] == "float32"
    assert d["counts"]["trainable"] == len(info["trainable"])
    assert d["counts"]["frozen"] == len(info["frozen"])
    assert d["counts"]["tied"] == len(info["tied"])
    assert d["counts"]["buffer"] == len(info["buffers"])
    assert len(d["param_groups"]) == len(info["param_groups"])
    assert {g["step"] for g in d["param_groups"]} == {info["step"]}
    assert [g["params"] for g in d["param_groups"]] == [len(g["names"]) for g in info["param_groups"]]
    assert d["global_steps"] == info["global_steps"]
    json.dumps(d)


def test_info_cli_json_zero0():
    fx = ZERO0[0]
    out = subprocess.run([sys.executable, "-m", "zckpt", "info", str(checkpoint_path(fx)), "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["zero_stage"] == 0 and d["optimizer"] == "zero0"
    assert d["files"] == [{"name": "mp_rank_00_model_states.pt", "bytes": d["total_bytes"]}]


@pytest.mark.parametrize("fx", BOTH, ids=IDS)
def test_verify_deep(fx):
    report = zckpt.verify(str(checkpoint_path(fx)), deep=True)
    assert report.ok, report.to_json()
    names = {c["name"] for c in report.to_json()["checks"]}
    assert {"shapes agree", "optimizer state", "steps agree", "CRC of every entry"} <= names


@pytest.mark.parametrize("fx", ZERO0, ids=[d.name for d in ZERO0])
def test_zero0_reshard_refused(fx, tmp_path):
    with pytest.raises(UnsupportedLayout, match="ZeRO-0"):
        zckpt.reshard(str(checkpoint_path(fx)), str(tmp_path / "o"), world_size=3)
    assert not (tmp_path / "o").exists()


def test_elastic_refuses_targets_without_hyperparameters(tmp_path):
    src = str(checkpoint_path(ELASTIC[0]))
    with pytest.raises(UnsupportedLayout, match="hyperparameters"):
        zckpt.reshard(src, str(tmp_path / "a"), world_size=3, stage=3)
    with pytest.raises(UnsupportedLayout, match="hyperparameters"):
        zckpt.reshard(src, str(tmp_path / "b"), world_size=3, fmt="universal")


# ------------------------------------------------------------------------------------------------ elastic reshard

def _elastic_cases():
    cases = []
    for d in ELASTIC:
        ws = _spec(d)["world_size"]
        cases.append(pytest.param(d, 2 if ws == 3 else 3, True, id=f"{d.name}-elastic-engine"))
    if ELASTIC:  # an elastic file also loads into a rigid engine of the size it was written for
        cases.append(pytest.param(ELASTIC[0], 3 if _spec(ELASTIC[0])["world_size"] != 3 else 2, False,
                                  id=f"{ELASTIC[0].name}-rigid-engine"))
    return cases


@pytest.mark.parametrize("fx,ws,elastic_engine", _elastic_cases())
def test_elastic_reshard_loads_in_deepspeed(fx, ws, elastic_engine, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    from tests.test_reshard import assert_same_files, assert_same_state

    src = checkpoint_path(fx)
    out = tmp_path / "out"
    res = zckpt.reshard(str(src), str(out), world_size=ws)
    tag = res.plan.tag
    files = sorted((out / tag).glob("*optim_states.pt"))
    assert len(files) == ws
    osd = torch.load(files[-1], weights_only=False)["optimizer_state_dict"]
    assert isinstance(osd["base_optimizer_state"], list)  # written back elastic
    spec = ds_oracle.target_spec(_spec(fx), ws)
    if not elastic_engine:
        spec["zero"] = {k: v for k, v in (spec.get("zero") or {}).items() if k != "elastic_checkpoint"}
    again = tmp_path / "resaved"
    ds_oracle.load_with_deepspeed(spec, str(out), str(tmp_path / "oracle"), resave=str(again) if elastic_engine
                                  else None)
    assert_same_state(fx / "expected", tmp_path / "oracle", skip=("lrs",))
    if elastic_engine:  # DeepSpeed saving what it loaded writes our files again
        assert_same_files(out, again, tag)


# ------------------------------------------------------------------------------------------------ name matching

def _fp(values: dict):
    """A fingerprint over synthetic values: masters ("m", g, j) and module entries by name."""
    return lambda key, full: values[key[:3]] if key[0] == "m" else values[key]


def test_match_groups_needs_no_order():
    cands = [("a", (3, 2)), ("b", (2,)), ("f", (4, 4)), ("c", (3, 2)), ("d", (2,))]
    vals = {("c", "a"): 1, ("c", "b"): 2, ("c", "f"): 3, ("c", "c"): 4, ("c", "d"): 5}
    # groups in another order than the model: the values place every master
    got = match_groups([[(3, 2), (3, 2)], [(2,), (2,)]], cands, "p",
                       fingerprint=_fp({**vals, ("m", 0, 0): 4, ("m", 0, 1): 1, ("m", 1, 0): 5, ("m", 1, 1): 2}))
    assert got == [["c", "a"], ["d", "b"]]
    # shapes alone settle unique shapes, whatever the order
    assert match_groups([[(2,), (3, 2)]], [("a", (3, 2)), ("b", (2,))], "p") == [["b", "a"]]


def test_match_groups_refuses_what_the_files_cannot_tell():
    cands = [("a", (3, 2)), ("frozen", (3, 2)), ("b", (2,))]
    with pytest.raises(UnsupportedLayout, match="cannot tell"):
        match_groups([[(3, 2), (2,)]], cands, "p")  # 'a' or 'frozen'
    with pytest.raises(UnsupportedLayout, match="cannot tell"):  # in model order, but the same shapes: no guess
        match_groups([[(2,), (2,)]], [("x", (2,)), ("y", (2,))], "p")
    with pytest.raises(UnsupportedLayout, match="cannot tell"):  # the same values: still no guess
        match_groups([[(2,), (2,)]], [("x", (2,)), ("y", (2,))], "p",
                     fingerprint=_fp({("c", "x"): 1, ("c", "y"): 1, ("m", 0, 0): 1, ("m", 0, 1): 1}))
    with pytest.raises(UnsupportedLayout, match="fits no module parameter"):
        match_groups([[(2,)], [(2,)]], [("a", (2,))], "p")
    with pytest.raises(UnsupportedLayout, match="fits no module parameter"):  # values match nothing
        match_groups([[(2,)]], [("a", (2,))], "p", fingerprint=_fp({("c", "a"): 1, ("m", 0, 0): 2}))


def test_match_groups_uses_saved_names():
    pair = [("x", (2,)), ("y", (2,))]
    assert match_groups([[(2,), (2,)]], pair, "p", names=[["y", "x"]]) == [["y", "x"]]
    with pytest.raises(UnsupportedLayout, match="does not have"):
        match_groups([[(2,), (2,)]], pair, "p", names=[["y", "z"]])
    from zckpt.errors import CorruptFile
    with pytest.raises(CorruptFile, match="does not round"):  # names that the values contradict
        match_groups([[(2,), (2,)]], pair, "p", names=[["y", "x"]],
                     fingerprint=_fp({("c", "x"): 1, ("c", "y"): 2, ("m", 0, 0): 1, ("m", 0, 1): 2}))


# ------------------------------------------------------------------------------------------------ tensor parallel

TP = [d for d in FIXTURE_DIRS if _spec(d).get("kind") == "autotp"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fx", TP, ids=[d.name for d in TP])
def test_autotp_merge_equals_deepspeed_universal(fx, tmp_path, dtype):
    """AutoTP shards merged by the checkpoint's affine map equal DeepSpeed's own TP consolidation
    (ds_to_universal's zero/<name>/fp32.pt), and the moments equal its exp_avg / exp_avg_sq."""
    want = load_file(str(fx / "expected" / f"{dtype}.safetensors"))
    zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "out"), dtype=dtype)
    got = _merged(tmp_path / "out")
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    oracle = load_file(str(fx / "expected" / "oracle.safetensors"))
    ckpt = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    from zckpt.encoding.tensors import load_pieces
    for key, w in oracle.items():
        kind, name = key.split("/", 1)
        rec = ckpt.by_name()[name]
        pieces = rec.value if kind == "fp32" else getattr(rec, kind)
        got_t = load_pieces(pieces, rec.dtype if kind == "fp32" else rec.state_dtype, rec.shape)
        assert torch.equal(got_t, w.to(got_t.dtype)), key


@pytest.mark.parametrize("fx", TP, ids=[d.name for d in TP])
def test_autotp_info_verify_and_reshard_refused(fx, tmp_path):
    spec = _spec(fx)
    d = info_of(str(checkpoint_path(fx)))
    assert d["mp_world_size"] == spec["tp"] and d["dp_world_size"] == spec["world_size"] // spec["tp"]
    assert d["tp_world_size"] == spec["tp"] and d["pp_world_size"] == 1 and d["ep_world_size"] == 1
    assert d["zero_stage"] == spec["stage"] and d["precision"] == spec["dtype"]
    assert zckpt.verify(str(checkpoint_path(fx)), deep=True).ok
    with pytest.raises(UnsupportedLayout, match="tensor-parallel"):
        zckpt.reshard(str(checkpoint_path(fx)), str(tmp_path / "o"), world_size=2)


def test_tensor_parallel_without_metadata_refused(tmp_path):
    """A model-parallel checkpoint whose files carry no affine map stays refused (one line, names the problem)."""
    if not TP:
        pytest.skip("no AutoTP fixture")
    import shutil
    from zckpt.encoding import safeload
    src = checkpoint_path(TP[0])
    ck = tmp_path / "ck"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("expected"))
    tag = (ck / "latest").read_text().strip()
    for f in (ck / tag).glob("mp_rank_*_model_states.pt"):
        sd = torch.load(f, weights_only=False)
        sd.pop("universal_checkpoint_info")
        torch.save(sd, f)
    assert safeload.load(str(next((ck / tag).glob("mp_rank_*_model_states.pt")))).get("mp_world_size") == 2
    with pytest.raises(UnsupportedLayout, match="without AutoTP partition metadata"):
        zckpt.open_checkpoint(str(ck))
