"""Master weights and optimizer states are read in the dtype their files hold, never assumed fp32.

The committed fixtures ``z2_bf16master_ws2`` / ``z3_bf16master_ws2`` (``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``), ``z2_bf16master_offload_ws2`` (bf16 masters, fp32 CPU-Adam moments) and
``z3_lora_ws2`` (fp32 adapters on a frozen bf16 base) go through every fixture-parametrized test (reader vs
DeepSpeed's consolidation and live-engine oracle, merge, reshard loaded by DeepSpeed). Here: what the dtypes
are reported as, and the invariant that refuses mislabelled or unknown dtypes instead of reinterpreting bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.ops.info import info as zckpt_info
from zckpt.state.model import Piece, TensorRecord, check_records
from zckpt.state.open import open_checkpoint
from zckpt.errors import CorruptFile, UnsupportedLayout
from tests.conftest import FIXTURES

BF16_MASTERS = ["z2_bf16master_ws2", "z3_bf16master_ws2"]


def _fixture(name: str) -> Path:
    d = FIXTURES / name
    if not (d / "expected" / "spec.json").exists():
        pytest.skip(f"fixture {name} not generated")
    return d


@pytest.mark.parametrize("name,master,state", [
    ("z2_bf16master_ws2", "bfloat16", "bfloat16"),
    ("z3_bf16master_ws2", "bfloat16", "bfloat16"),
    ("z2_bf16master_offload_ws2", "bfloat16", "float32"),
    ("z3_lora_ws2", "float32", "float32"),
    ("z2_bf16_ws2", "float32", "float32"),
])
def test_info_reports_the_stored_dtypes(name, master, state):
    d = zckpt_info(str(_fixture(name)))
    assert d["master_dtype"] == master and d["optimizer_state_dtype"] == state
    ckpt = open_checkpoint(str(_fixture(name)))
    for rec in ckpt.of_kind("trainable"):
        assert rec.dtype == master and {p.dtype for p in rec.value} == {master}, rec.name
        assert rec.state_dtype == state and {p.dtype for p in rec.exp_avg + rec.exp_avg_sq} == {state}, rec.name


def test_lora_base_keeps_its_dtype_and_precision_is_the_engines():
    ckpt = open_checkpoint(str(_fixture("z3_lora_ws2")))
    assert ckpt.precision == "fp32"  # the engine trained in fp32; the frozen base is bf16
    frozen = ckpt.of_kind("frozen")
    assert frozen and all(r.dtype == "bfloat16" for r in frozen)
    assert {r.name.rsplit(".", 1)[-1] for r in ckpt.of_kind("trainable")} == {"lora_A", "lora_B"}


@pytest.mark.parametrize("name", BF16_MASTERS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_state_dict_equals_the_live_engine(name, dtype):
    """load_state_dict (= merge's values) against DeepSpeed's safe_get_full_fp32_param taken in the job."""
    fx = _fixture(name)
    oracle = load_file(str(fx / "expected" / "oracle.safetensors"))
    sd = zckpt.load_state_dict(str(fx), dtype=dtype)
    want_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    checked = 0
    for key, want in oracle.items():
        if not key.startswith("fp32/"):
            continue
        name_ = key[5:]
        assert sd[name_].dtype == want_dtype
        # the masters are bf16: the oracle's values are exactly representable in bf16 and fp32
        assert torch.equal(sd[name_], want.to(want_dtype)), name_
        checked += 1
    assert checked


def test_mislabelled_records_are_refused():
    good = Piece("f", 0, 6, "bfloat16")
    check_records([TensorRecord("w", (2, 3), "trainable", "bfloat16", [good])])
    with pytest.raises(CorruptFile, match="labelled float32 but stored as bfloat16"):
        check_records([TensorRecord("w", (2, 3), "trainable", "float32", [good])])
    with pytest.raises(CorruptFile, match="covers 6 elements"):
        check_records([TensorRecord("w", (7,), "trainable", "bfloat16", [good])])
    with pytest.raises(CorruptFile, match="several dtypes"):
        check_records([TensorRecord("w", (2, 3), "trainable", "bfloat16", [good],
                                    exp_avg=[Piece("f", 0, 3, "float32"), Piece("f", 12, 3, "bfloat16")],
                                    exp_avg_sq=[good])])


def _rewrite_optim(ckpt_dir: Path, rank: int, fn) -> None:
    """Edit one rank's optimizer file with torch (trusted: our own fixture), as a foreign writer could."""
    tag = (ckpt_dir / "latest").read_text().strip()
    (path,) = (ckpt_dir / tag).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    sd = torch.load(path, map_location="cpu", weights_only=False)
    fn(sd["optimizer_state_dict"])
    torch.save(sd, path)


@pytest.mark.parametrize("dtype,error,words", [
    (torch.float64, UnsupportedLayout, "stored as float64"),
    (torch.int32, UnsupportedLayout, "stored as int32"),
])
def test_unknown_master_dtype_is_refused(tmp_path, dtype, error, words):
    ck = tmp_path / "ck"
    shutil.copytree(_fixture("z2_bf16_ws2"), ck)

    def edit(osd):
        osd["single_partition_of_fp32_groups"] = [t.to(dtype) for t in osd["single_partition_of_fp32_groups"]]

    for rank in (0, 1):
        _rewrite_optim(ck, rank, edit)
    with pytest.raises(error, match=words):
        open_checkpoint(str(ck))
    r = subprocess.run([sys.executable, "-m", "zckpt", "merge", str(ck), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_ranks_that_disagree_on_the_master_dtype_are_refused(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(_fixture("z2_bf16_ws2"), ck)

    def edit(osd):
        osd["single_partition_of_fp32_groups"] = [t.to(torch.bfloat16) for t in osd["single_partition_of_fp32_groups"]]

    _rewrite_optim(ck, 1, edit)
    with pytest.raises(CorruptFile, match="several dtypes"):
        open_checkpoint(str(ck))


def test_relabelled_bf16_masters_would_be_caught(tmp_path, monkeypatch):
    """The bug this guards against: a reader that labels bf16 masters float32. The invariant stops it."""
    import zckpt.deepspeed.zero12 as z12
    monkeypatch.setattr(z12, "uniform_dtype", lambda *a, **k: "float32")
    with pytest.raises(CorruptFile, match="labelled float32 but stored as bfloat16"):
        open_checkpoint(str(_fixture("z2_bf16master_ws2")))
