"""``zckpt diff``: real checkpoints against their own reshard, DCP conversion, round trip, Megatron conversion and
merge (equal); single elements changed through the real frameworks' own writers (torch's ``dcp.save`` of the DCP
conversion loaded with torch; safetensors' ``save_file``), each named exactly; tolerances at their edges; a
flipped byte refused; the CLI's exit statuses and --json schema; docs/check-conversion.md run in order."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import zckpt
from tests.conftest import FIXTURES
from zckpt.cli import main
from zckpt.errors import CorruptFile

Z2 = FIXTURES / "z2_bf16_ws2"  # ZeRO-2 bf16, 2 ranks: masters, moments, a frozen bf16 weight, buffers, a tie
TRAINER = FIXTURES / "trainer" / "checkpoint-4"  # Llama-shaped, 2 layers, 2 param groups
MEGATRON = FIXTURES / "megatron"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """Each conversion of the fixtures, made once by zckpt itself."""
    base = tmp_path_factory.mktemp("diff")
    zckpt.reshard(str(Z2), str(base / "ws3"), world_size=3)
    zckpt.convert(str(Z2), to="dcp", out=str(base / "dcp"))
    zckpt.convert(str(base / "dcp"), to="deepspeed", out=str(base / "back"), world_size=2, stage=2, dtype="bf16",
                  buffers="scale,idx")
    zckpt.merge(str(TRAINER), str(base / "merged"), max_shard_size="20KB")
    for name in ("gpt_tp1_pp1_dp2", "gpt_tp2_pp2_dp1_fullyresh"):
        zckpt.convert(str(MEGATRON / name), to="dcp", out=str(base / name), groups="megatron-default")
    return base


def _torch_dcp(src: Path, dst: Path, edit=None) -> Path:
    """``src`` (a DCP folder) loaded with torch, ``edit(state)`` applied, saved by ``dcp.save``: the framework's own
    writer, so every CRC of the copy is right."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(src), str(dst) + ".pt")
        state = torch.load(str(dst) + ".pt", weights_only=False)
        if edit is not None:
            edit(state)
        dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    return dst


def test_conversions_hold_the_same_state(outs):
    for a, b in ((Z2, outs / "ws3"), (Z2, outs / "dcp"), (Z2, outs / "back"), (outs / "dcp", outs / "ws3")):
        r = zckpt.diff(str(a), str(b))
        assert r.ok, (b, r.summary(), [x.line() for x in r.differences])
        c = r.counts
        assert c["differ"] == c["only_in_a"] == c["only_in_b"] == 0 and not r.not_compared, (b, r.not_compared)
        labels = {t.label for t in r.tensors}
        # masters, both moments, the frozen bf16 weight, both buffers; the tie compared once
        assert {"emb.weight", "emb.weight [exp_avg]", "emb.weight [exp_avg_sq]", "frozen.weight", "scale", "idx"} \
            <= labels and not any("head.weight" in x for x in labels), labels
        assert all(t.status == "equal" and t.stats.differing == 0 for t in r.tensors)
        values = {v.name for v in r.values}
        assert {"group 0 step", "group 1 lr", "group 0 betas", "group 1 members", "global_steps",
                "global_samples"} <= values, values
        assert r.crc_checked_entries > 0 and r.bytes_compared > 0
    parts = {t.part for t in zckpt.diff(str(Z2), str(outs / "dcp")).tensors}
    assert parts == {"masters", "weights", "optimizer"}
    # a Trainer checkpoint-N as FSDP saves it (two DCP folders) against the DeepSpeed one it came from
    zckpt.convert(str(TRAINER), to="dcp", out=str(outs / "trainer-fsdp"), layout="trainer")
    r = zckpt.diff(str(TRAINER), str(outs / "trainer-fsdp"))
    assert r.ok and r.format_b == "dcp" and len(r.tensors) == 60, (r.summary(), len(r.tensors))


def test_megatron_against_its_conversion(outs):
    for name in ("gpt_tp1_pp1_dp2", "gpt_tp2_pp2_dp1_fullyresh"):  # dp_reshardable (buckets), fully_reshardable
        r = zckpt.diff(str(MEGATRON / name), str(outs / name))
        assert r.ok, (name, r.summary(), [x.line() for x in r.differences], r.only_in_a, r.only_in_b)
        labels = {t.label for t in r.tensors}  # Llama's names: q/k/v and gate/up split, moments too
        assert {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight [exp_avg_sq]"} <= labels
        assert all(t.dtype_a == "float32" for t in r.tensors)  # the masters, not the bf16 weights
        assert any("members" in line for line in r.not_compared)  # Megatron does not list them: said
        assert {"group 0 lr", "group 1 weight_decay", "global_steps"} <= {v.name for v in r.values}
    # its merge (weights only, Llama's names): a dp_reshardable save's saved weights are what merge wrote
    zckpt.merge(str(MEGATRON / "gpt_tp1_pp1_dp2"), str(outs / "mg-merged"), dtype="bf16")
    r = zckpt.diff(str(MEGATRON / "gpt_tp1_pp1_dp2"), str(outs / "mg-merged"))
    assert r.ok and len(r.tensors) > 15 and any("saved weights are compared" in x for x in r.not_compared), \
        (r.summary(), [x.line() for x in r.differences])
    # two Megatron runs of other layouts and seeds: differences named, matched through the same names
    r = zckpt.diff(str(MEGATRON / "gpt_tp1_pp1_dp2"), str(MEGATRON / "gpt_tp2_pp2_dp1_fullyresh"),
                   only="weights", include=["model.layers.0.*"])
    assert not r.ok and {t.name for t in r.tensors} and all(t.name.startswith("model.layers.0.") for t in r.tensors)


def test_merge_output_is_the_checkpoints_weights(outs, tmp_path):
    r = zckpt.diff(str(TRAINER), str(outs / "merged"))
    assert r.ok and r.format_b == "hf", r.summary()
    assert len(r.tensors) == 20 and {t.part for t in r.tensors} == {"weights"}
    said = " ".join(r.not_compared)
    assert "optimizer state" in said and "param groups of A" in said and "counters of A" in said
    assert any("lm_head.weight" in n for n in r.notes)  # the tied alias: compared once, said so
    # a bf16 merge (pytorch_model.bin, CRC-checked): the fp32 masters cast to bf16 as torch rounds, then bit for bit
    zckpt.merge(str(TRAINER), str(tmp_path / "bf16"), fmt="pt", dtype="bf16")
    r = zckpt.diff(str(tmp_path / "bf16"), str(TRAINER))
    assert r.ok and all(t.cast == "b" and t.dtype_a == "bfloat16" for t in r.tensors), r.summary()
    assert r.crc_checked_entries > 0
    from safetensors.torch import load_file, save_file
    sd = load_file(str(sorted((outs / "merged").glob("*.safetensors"))[0]))  # one shard, one element changed
    name = next(iter(sd))
    sd[name] = sd[name].clone()
    before = sd[name].view(-1)[5].item()
    sd[name].view(-1)[5] = before * (1 + 2 ** -20)
    after = sd[name].view(-1)[5].item()
    ulps = abs(int(np.float32(before).view(np.int32)) - int(np.float32(after).view(np.int32)))  # (same sign)
    (tmp_path / "one").mkdir()
    save_file(sd, str(tmp_path / "one" / "model.safetensors"))
    r = zckpt.diff(str(TRAINER), str(tmp_path / "one"), include=[name])
    (d,) = r.differences
    assert d.name == name and d.stats.first == 5 and d.stats.differing == 1 and d.stats.max_ulp == ulps > 0, d.line()
    assert d.stats.max_abs == abs(np.float64(np.float32(after)) - np.float64(np.float32(before)))


@pytest.fixture(scope="module")
def changed(outs, tmp_path_factory):
    """The DCP conversion saved again by torch, with one change each."""
    base = tmp_path_factory.mktemp("changed")

    def master(state):
        t = state["model"]["emb.weight"]
        t[3, 4] = t[3, 4] * 1.5

    def moment(state):
        t = state["optim"]["state"]["blocks.0.up.weight"]["exp_avg_sq"]
        t[9, 6] = t[9, 6] * 2

    def frozen(state):
        t = state["model"]["frozen.weight"]
        t[1, 2] = t[1, 2] + 1

    def step(state):
        for name, s in state["optim"]["state"].items():
            s["step"] = s["step"] + 1

    def lr(state):
        state["optim"]["param_groups"][1]["lr"] *= 2

    made = {"same": _torch_dcp(outs / "dcp", base / "same")}
    for name, edit in (("master", master), ("moment", moment), ("frozen", frozen), ("step", step), ("lr", lr)):
        made[name] = _torch_dcp(outs / "dcp", base / name, edit)
    return made


def test_torch_resave_is_equal(changed):
    r = zckpt.diff(str(Z2), str(changed["same"]))
    assert r.ok, [x.line() for x in r.differences]


@pytest.mark.parametrize("what,label,index", [
    ("master", "emb.weight", [3, 4]), ("moment", "blocks.0.up.weight [exp_avg_sq]", [9, 6]),
    ("frozen", "frozen.weight", [1, 2])])
def test_one_changed_element_is_named(changed, what, label, index):
    r = zckpt.diff(str(Z2), str(changed[what]))
    assert not r.ok
    (d,) = r.differences
    assert d.label == label and d.status == "differ" and d.reason == "values", d.line()
    shape = d.shape_a
    assert d.stats.differing == d.stats.outside == 1 and d.to_json()["first_index_nd"] == index
    assert d.stats.first == index[0] * shape[1] + index[1]
    assert r.counts["differ"] == 1 and r.counts["equal"] == len(r.tensors) + len(r.values) - 1
    # the CLI: exit 1, the difference named on stderr in one line, then the summary
    res = invoke("diff", Z2, changed[what])
    assert res.exit_code == 1 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"DIFFER  {label}: first at [{index[0]}, {index[1]}]"), lines
    assert lines[-1].startswith("zckpt: error: DIFFERENT:") and "1 differ" in lines[-1], lines


def test_step_and_lr_are_named(changed):
    r = zckpt.diff(str(Z2), str(changed["step"]), only="groups")
    assert [(v.name, v.a, v.b) for v in r.differences] == [("group 0 step", 3, 4), ("group 1 step", 3, 4)]
    assert not r.tensors
    r = zckpt.diff(str(Z2), str(changed["lr"]))
    (d,) = r.differences
    assert d.name == "group 1 lr" and d.b == 2 * d.a, d.line()
    assert zckpt.diff(str(Z2), str(changed["lr"]), only="weights,optimizer,counters").ok  # --only leaves it out


def test_groups_matched_by_their_members(outs, tmp_path):
    def swap(state):
        state["optim"]["param_groups"] = state["optim"]["param_groups"][::-1]

    r = zckpt.diff(str(Z2), str(_torch_dcp(outs / "dcp", tmp_path / "swapped", swap)), only="groups")
    assert r.ok and "group 0 (B's 1) lr" in {v.name for v in r.values}, [v.line() for v in r.values]


def test_tolerances_at_their_edges(changed):
    r = zckpt.diff(str(Z2), str(changed["master"]), only="weights")
    (d,) = r.differences
    atol, ulp, rel = d.stats.max_abs, d.stats.max_ulp, d.stats.max_rel
    assert atol > 0 and ulp > 0 and rel > 0
    at = zckpt.diff(str(Z2), str(changed["master"]), only="weights", atol=atol)
    assert at.ok and at.counts["close"] == 1 and "within the tolerance" in at.summary()
    below = zckpt.diff(str(Z2), str(changed["master"]), only="weights", atol=float(np.nextafter(atol, 0)))
    assert not below.ok and below.differences[0].label == "emb.weight"
    assert zckpt.diff(str(Z2), str(changed["master"]), only="weights", ulp=ulp).ok
    assert not zckpt.diff(str(Z2), str(changed["master"]), only="weights", ulp=ulp - 1).ok
    assert zckpt.diff(str(Z2), str(changed["master"]), only="weights", rtol=rel * 1.001).ok
    assert not zckpt.diff(str(Z2), str(changed["master"]), only="weights", rtol=rel * 0.999).ok
    res = invoke("diff", Z2, changed["master"], "--only", "weights", "--atol", repr(atol))
    assert res.exit_code == 0 and "SAME" in res.stdout, res.output


def test_a_missing_tensor_on_either_side(outs, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "fewer"
    folder.mkdir()
    tensors = {}
    for f in sorted((outs / "merged").glob("*.safetensors")):
        tensors.update(load_file(f))
    gone = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(folder / "model.safetensors"))
    r = zckpt.diff(str(TRAINER), str(folder))
    assert r.only_in_a == [gone] and not r.only_in_b and not r.ok and r.counts["differ"] == 0
    r = zckpt.diff(str(folder), str(TRAINER))
    assert r.only_in_b == [gone] and not r.only_in_a and not r.ok
    res = invoke("diff", folder, TRAINER)
    assert res.exit_code == 1 and f"only in B: {gone}" in res.stderr and "1 only in B" in res.stderr
    assert zckpt.diff(str(folder), str(TRAINER), exclude=["*.up_proj.*"]).ok  # globs leave it out
    (tmp_path / "reshaped").mkdir()  # the same elements in another shape: a difference, said so
    save_file({k: (v.reshape(-1) if k == gone else v) for k, v in tensors.items()},
              str(tmp_path / "reshaped" / "model.safetensors"))
    (d,) = zckpt.diff(str(TRAINER), str(tmp_path / "reshaped")).differences
    assert d.name == gone and d.reason == "shape" and d.shape_b == [d.shape_a[0] * d.shape_a[1]], d.line()


def test_damaged_input_is_refused(tmp_path):
    from tests.test_checksums import damaged_copy
    ck, piece, _ = damaged_copy(tmp_path, "trainer", "exp_avg")
    with pytest.raises(CorruptFile, match="CRC-32"):
        zckpt.diff(str(TRAINER), str(ck))
    res = invoke("diff", TRAINER, ck)
    assert res.exit_code == 1 and res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert Path(piece.path).name in line and "CRC-32" in line and "DIFFER" not in line, line
    assert zckpt.diff(str(TRAINER), str(ck), only="weights").ok  # the moments are not read: not checked either


def test_damaged_dcp_item_is_refused(outs, tmp_path):
    dcp_copy = tmp_path / "dcp"
    shutil.copytree(outs / "dcp", dcp_copy)
    piece = {r.name: r for r in zckpt.open_checkpoint(str(dcp_copy)).records}["blocks.0.up.weight"].exp_avg[0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset + piece.nbytes // 2)
        byte = f.read(1)
        f.seek(piece.offset + piece.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x08]))
    with pytest.raises(CorruptFile, match="CRC"):
        zckpt.diff(str(Z2), str(dcp_copy))


def test_cli_usage_json_and_dtypes(outs, tmp_path):
    from tests.test_cli import _check, _schemas
    res = invoke("diff", Z2, outs / "dcp", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    _check(doc, _schemas()["diff"], "diff")
    assert doc["ok"] and doc["format_a"] == "deepspeed" and doc["format_b"] == "dcp" and doc["tag"] == "global_step3"
    assert invoke("diff", Z2).exit_code == 2  # B missing: the command line cannot be read
    for bad in (["--only", "weights,banana"], ["--atol", "-1"], ["--ulp", "-2"], ["--workers", "0"]):
        res = invoke("diff", Z2, Z2, *bad)
        assert res.exit_code == 1 and res.stderr.count("\n") == 1 and bad[0] in res.stderr, (bad, res.output)
    for nothing in (["--include", "typo*"], ["--only", "masters", "--include", "frozen.*"]):  # never a pass
        res = invoke("diff", Z2, outs / "dcp", *nothing)
        assert res.exit_code == 1 and res.stderr.count("\n") == 1, (nothing, res.output)
    res = invoke("diff", Z2, Z2, "--tag-b", "global_step9")  # the side's own flag named
    assert res.exit_code == 1 and "--tag-b global_step9" in res.stderr and invoke("diff", Z2, Z2, "--tag-a",
                                                                                   "global_step3").exit_code == 0
    res = invoke("diff", Z2, tmp_path / "nothing")
    assert res.exit_code == 1 and "nothing" in res.stderr and "Traceback" not in res.output
    res = invoke("diff", Z2, Z2, "-v")
    assert res.exit_code == 0 and "equal   emb.weight [exp_avg]" in res.stdout and "equal   group 1 lr" in res.stdout
    # a bf16 frozen weight merged to fp32: another dtype, the same values (said), a real change still differs
    r = zckpt.diff(str(Z2), str(outs / "dcp"), include=["frozen.weight"])
    (t,) = r.tensors
    assert t.status == "equal" and t.dtype_a == t.dtype_b == "bfloat16"
    zckpt.merge(str(Z2), str(tmp_path / "m"))
    r = zckpt.diff(str(Z2), str(tmp_path / "m"), include=["frozen.weight"])
    (t,) = r.tensors
    assert r.ok and t.reason == "dtype" and (t.dtype_a, t.dtype_b) == ("bfloat16", "float32")
    assert r.counts["other_dtype"] == 1 and "another dtype" in r.summary()
    zckpt.merge(str(Z2), str(tmp_path / "m16"), dtype="bf16")  # every floating tensor cast, the fp32 buffer too
    r = zckpt.diff(str(Z2), str(tmp_path / "m16"))
    assert r.ok and {t.name: t.cast for t in r.tensors}["scale"] == "a", r.summary()


# the docs' workspace (the names the examples use), for the recipe
from tests.test_docs_examples import _args, examples, workspace  # noqa: E402, F401


def test_check_conversion_recipe_runs_in_order(workspace):
    steps = [c for where, c in examples() if where.startswith("docs/check-conversion.md:")]
    assert sum(c.startswith("zckpt diff") for c in steps) >= 5, steps
    for command in steps:
        res = CliRunner().invoke(main, _args(command, workspace))
        assert res.exit_code == 0, f"{command}\n{res.output}"
        if command.startswith("zckpt diff") and "--only" not in command:
            assert "SAME:" in res.stdout and "0 differ" in res.stdout, res.output


def test_a_url_side(s3_server, outs, changed):
    """A checkpoint behind an S3 URL (the real local S3 server) against a local one: the same verdicts."""
    from tests.test_distributed import _upload
    opts = s3_server.storage_options()
    url = s3_server.url("diff", "dcp")
    _upload(outs / "dcp", url, opts)
    r = zckpt.diff(str(Z2), url, storage_options=opts)
    assert r.ok and r.b == url and r.crc_checked_entries > 0, r.summary()
    moved = s3_server.url("diff", "moment")
    _upload(changed["moment"], moved, opts)
    r = zckpt.diff(moved, str(Z2), storage_options=opts)
    assert [d.label for d in r.differences] == ["blocks.0.up.weight [exp_avg_sq]"]
    assert r.differences[0].to_json()["first_index_nd"] == [9, 6]


def test_ranks_of_a_launcher_split_the_ranges(changed, tmp_path):
    """Under torchrun each rank compares a share; rank 0 says the verdict, every rank exits with it; a flipped byte
    read by either rank is refused by all."""
    from tests.test_checksums import damaged_copy
    from tests.test_distributed import torchrun
    res = torchrun(2, "diff", str(Z2), str(changed["moment"]), "--json")
    assert res.returncode == 1, res.stderr[-2000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("{")]  # rank 0 only
    doc = json.loads(line)
    (d,) = [t for t in doc["tensor_diffs"] if t["status"] != "equal"]
    assert d["name"] == "blocks.0.up.weight" and d["state"] == "exp_avg_sq" and d["first_index_nd"] == [9, 6]
    assert doc["counts"]["differ"] == 1 and doc["crc_checked_entries"] > 0
    ck, piece, _ = damaged_copy(tmp_path, "trainer", "exp_avg")
    res = torchrun(2, "diff", str(TRAINER), str(ck))
    assert res.returncode != 0 and "CRC-32" in res.stderr and Path(piece.path).name in res.stderr
    assert "DIFFER" not in res.stderr + res.stdout


def test_torchtitan_layout_per_parameter_groups(outs, tmp_path):
    """torchtitan's flattened optimizer state records each parameter's group values, no group list: compared per
    parameter; one parameter's lr changed (through dcp.save) is named."""
    tt = tmp_path / "tt"
    zckpt.convert(str(Z2), to="dcp", out=str(tt), layout="torchtitan",
                  torchtitan={"ntokens_seen": 0, "initial_lr": [0.001, 0.001]})
    r = zckpt.diff(str(Z2), str(tt))
    assert r.ok and "lr of every parameter" in {v.name for v in r.values}, r.summary()

    def lr(state):
        state["optimizer"]["param_groups.blocks.0.up.weight.lr"] *= 2

    r = zckpt.diff(str(Z2), str(_torch_dcp(tt, tmp_path / "tt-lr", lr)))
    assert [d.name for d in r.differences] == ["blocks.0.up.weight lr"], [d.line() for d in r.differences]


def test_measures_on_known_bits(tmp_path):
    """The element measures on raw arrays whose answers are known: NaNs, signed zeros, ULPs across zero, more
    differing elements than one measuring block, and two dtypes."""
    from zckpt.encoding.tensors import Reader
    from zckpt.engine import compare
    from zckpt.engine.segments import Piece

    def pieces(arr, name):
        path = tmp_path / name
        path.write_bytes(arr.tobytes())
        half = arr.size // 2  # two pieces, cut elsewhere than the ranges are
        size = arr.itemsize
        dtype = "bfloat16" if arr.dtype == np.uint16 else str(arr.dtype)
        return [Piece(str(path), 0, half, dtype), Piece(str(path), half * size, arr.size - half, dtype)]

    a = np.array([1.0, np.nan, 0.0, 1.0, -1e-45, 2.0], dtype=np.float32)
    b = np.array([1.0, np.nan, -0.0, np.nan, 1e-45, 2.0], dtype=np.float32)
    readers = [Reader(), Reader()]
    st = compare.compare_range(readers, pieces(a, "a"), "float32", pieces(b, "b"), "float32", 0, 6,
                               compare.Tolerance(atol=0.5))
    # +0 / -0 differ in bits, not in value (within atol); the NaN against 1.0 is never within; +-1e-45: 2 ULPs
    assert st.differing == 3 and st.outside == 1 and st.first == 2 and st.first_outside == 3
    assert math.isinf(st.max_abs) and st.max_ulp == np.iinfo(np.int64).max
    st = compare.compare_range(readers, pieces(a, "a"), "float32", pieces(b, "b"), "float32", 4, 2, compare.Tolerance())
    assert st.differing == st.outside == 1 and st.max_ulp == 2 and st.first == 4
    n = compare.MEASURE_BLOCK * 2 + 5  # every element differs by one ULP: measured over three blocks
    x = np.arange(n, dtype=np.float32) + 1
    y = x.view(np.int32) + 1
    st = compare.compare_range(readers, pieces(x, "x"), "float32", pieces(y.view(np.float32), "y"), "float32", 0,
                               n, compare.Tolerance(ulp=1))
    assert st.differing == n and st.outside == 0 and st.max_ulp == 1 and st.first == 0
    # bf16 against fp32: the values compared (no bits across dtypes)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)[:8]
    st = compare.compare_range(readers, pieces(bf, "bf"), "bfloat16", pieces(x[:8], "f"), "float32", 0, 8,
                               compare.Tolerance())
    assert st.differing == 0 and st.max_ulp is None  # small integers: exact in bf16


@pytest.mark.parametrize("fixture", ["z2_bf16_ws2", "z3_bf16_ws4", "z2_bf16master_ws2", "trainer"])
def test_masters_equal_deepspeeds_own_converter(fixture, tmp_path):
    """The oracle: DeepSpeed's zero_to_fp32 output of each fixture (expected/fp32.safetensors, made by DeepSpeed
    itself), as a Hugging Face folder, against the checkpoint: every master equal, element for element."""
    folder = tmp_path / "oracle"
    folder.mkdir()
    shutil.copy(FIXTURES / fixture / "expected" / "fp32.safetensors", folder / "model.safetensors")
    ck = TRAINER if fixture == "trainer" else FIXTURES / fixture
    r = zckpt.diff(str(ck), str(folder), only="weights")
    assert r.ok and len(r.tensors) >= 10, (r.summary(), r.only_in_a, r.only_in_b, [d.line() for d in r.differences])


def test_moments_equal_deepspeeds_own_api(tmp_path):
    """The oracle of the moments: what DeepSpeed's per-parameter API returned inside the training processes
    (expected/oracle.safetensors: safe_get_full_fp32_param, safe_get_full_optimizer_state), saved by torch's
    dcp.save as FSDP2 lays a state out, against the checkpoint's files: every master and moment equal."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    oracle = load_file(str(Z2 / "expected" / "oracle.safetensors"))
    facts = json.loads((Z2 / "expected" / "oracle.json").read_text())
    by = lambda kind: {k.split("/", 1)[1]: v for k, v in oracle.items() if k.startswith(kind + "/")}  # noqa: E731
    model = {**by("buffer"), **{n: v for n, v in by("module").items() if n in facts["frozen"]}, **by("fp32")}
    model = {n: v for n, v in model.items() if n not in dict(facts["tied"])}
    state = {n: {"exp_avg": by("exp_avg")[n], "exp_avg_sq": by("exp_avg_sq")[n], "step": torch.tensor(3.0)}
             for n in facts["trainable"]}
    groups = [{"params": g["names"], "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in facts["param_groups"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}},
                 checkpoint_id=str(tmp_path / "oracle"), no_dist=True)
    r = zckpt.diff(str(Z2), str(tmp_path / "oracle"), only="weights,optimizer")
    assert r.ok and r.counts["equal"] == 7 * 3 + 3, (r.summary(), r.only_in_a, r.only_in_b)


def test_deepspeed_side_changed_by_torch_save(tmp_path):
    """A DeepSpeed optimizer file loaded with torch, one fp32 master element and one exp_avg element of rank 1's
    partition changed, saved again with torch.save (its CRCs right); DeepSpeed's own param_slice_mappings say which
    parameter and element: diff names exactly those."""
    import torch
    opt = "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(str(Z2 / opt), weights_only=False, map_location="cpu")
    osd = sd["optimizer_state_dict"]
    numel = {r.name: r.numel for r in zckpt.open_checkpoint(str(Z2)).records}
    name, frag = next((n, fa) for n, fa in osd["param_slice_mappings"][0].items() if fa.numel == numel[n] > 4)
    j = frag.numel // 2
    for what in ("master", "exp_avg"):
        copy = tmp_path / what
        shutil.copytree(Z2, copy, ignore=shutil.ignore_patterns("expected"))
        flat = osd["single_partition_of_fp32_groups"][0] if what == "master" else \
            osd["base_optimizer_state"]["state"][0]["exp_avg"]
        with torch.no_grad():  # (the masters are saved as leaves that require grad)
            saved = flat[frag.start + j].clone()
            flat[frag.start + j] = saved * 1.5 + 1e-3
            torch.save(sd, str(copy / opt))
            flat[frag.start + j] = saved
        (d,) = zckpt.diff(str(Z2), str(copy)).differences
        assert (d.name, d.state, d.stats.first, d.stats.differing) == \
            (name, "value" if what == "master" else "exp_avg", j, 1), d.line()


def test_client_state_is_compared(outs, tmp_path):
    """DeepSpeed's client state (the top-level keys of the model states that are not DeepSpeed's own: what
    load_checkpoint returns; a DCP checkpoint's client_state, as convert carries it) is part of the state: a value
    changed is named, a key one side holds alone is a difference, a value that is not plain data is said to be left
    out. A layout without the place (torchtitan's) is said, not a difference."""
    import torch
    copy = tmp_path / "ce"
    shutil.copytree(Z2, copy, ignore=shutil.ignore_patterns("expected"))
    ms = copy / "global_step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(str(ms), weights_only=False, map_location="cpu")
    epoch = sd["my_epoch"]
    sd["my_epoch"] = epoch + 1
    sd["data_position"] = {"shard": 3, "offsets": [1, 2]}
    sd["rng"] = torch.zeros(2)
    torch.save(sd, str(ms))
    for other in (Z2, outs / "dcp"):  # (the DCP conversion carries my_epoch as client_state.my_epoch)
        r = zckpt.diff(str(copy), str(other))
        assert not r.ok and [(d.name, d.a, d.b) for d in r.differences] == [("client_state.my_epoch", epoch + 1,
                                                                            epoch)]
        assert r.only_in_a == ["client_state.data_position.shard", "client_state.data_position.offsets"]
        assert any("client state of A that is not plain data: client_state.rng (a LazyTensor)" in n
                   for n in r.not_compared), r.not_compared
    code = CliRunner().invoke(main, ["diff", str(copy), str(Z2)])
    assert code.exit_code == 1 and "client_state.my_epoch" in code.output
    tt = tmp_path / "tt"
    zckpt.convert(str(Z2), to="dcp", out=str(tt), layout="torchtitan",
                  torchtitan={"ntokens_seen": 0, "initial_lr": [0.001, 0.001]})
    r = zckpt.diff(str(copy), str(tt))
    assert not [d for d in r.differences if d.name.startswith("client_state")] and not r.only_in_a
    assert any("client state of A: the other side holds none" in n for n in r.not_compared), r.not_compared
