"""zckpt info says what the files hold, the same in text and --json: a Megatron dp_reshardable save's optimizer
state (what convert carries), a model-only DCP's parameter dtypes, a Hugging Face folder (merge's own output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zckpt
from tests.conftest import FIXTURES, ROOT

MEGATRON = FIXTURES / "megatron"


def _info(*args):
    res = subprocess.run([sys.executable, "-m", "zckpt", "info", *map(str, args)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _line(text: str, key: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(key))


@pytest.mark.parametrize("name", ["gpt_tp1_pp1_dp2", "gpt_tp2_pp1_dp2"])
def test_megatron_dp_reshardable_shows_its_optimizer_state(name):
    """dp_reshardable keeps masters and moments in DDP buckets; info shows them as convert carries them (the same
    dtypes and keys as the fully_reshardable save of the same run), not "optimizer states none"."""
    doc = json.loads(_info(MEGATRON / name, "--json"))
    assert doc["optimizer_layout"] == "dp_reshardable"
    ckpt = zckpt.open_checkpoint(str(MEGATRON / name))
    placed = ckpt.extra["buckets"]
    assert placed and {r.name for r in ckpt.records if r.kind == "trainable"} == set(placed)
    assert doc["master_dtype"] == "fp32" and doc["optimizer_state_dtype"] == "fp32"  # (--json: as --dtype spells them)
    assert doc["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert doc["parameter_dtype"] == "bf16"  # the weights as saved, beside the fp32 masters
    full = json.loads(_info(MEGATRON / "gpt_tp1_pp1_dp2_fullyresh", "--json"))
    assert (full["master_dtype"], full["optimizer_state_dtype"], full["optimizer_state_keys"]) == \
        (doc["master_dtype"], doc["optimizer_state_dtype"], doc["optimizer_state_keys"])
    line = _line(_info(MEGATRON / name), "dtypes")
    assert "optimizer states float32 (exp_avg, exp_avg_sq in dp_reshardable buckets)" in line, line
    assert "masters float32" in line and "none" not in line, line


def test_model_only_dcp_shows_parameter_dtypes(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"embed.weight": torch.randn(8, 4, dtype=torch.bfloat16),
                    "norm.weight": torch.ones(4, dtype=torch.bfloat16), "head.bias": torch.randn(8)}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "m"))
    doc = json.loads(_info(tmp_path / "m", "--json"))
    assert doc["parameter_dtype"] == ["bf16", "fp32"] and doc["master_dtype"] is None
    line = _line(_info(tmp_path / "m"), "dtypes")
    assert line.split()[1:4] == ["parameters", "bfloat16+float32,", "optimizer"], line


def test_hf_folder_described(tmp_path):
    """merge's own output (safetensors or .bin, one file or sharded with its index, config.json): what is in it, read
    by the real libraries as the oracle, not "no checkpoint here"."""
    from safetensors import safe_open

    src = FIXTURES / "trainer" / "checkpoint-4"
    for name, kw in (("st", {"dtype": "bf16"}), ("bin", {"fmt": "pt", "max_shard_size": "3KB"})):
        out = tmp_path / name
        zckpt.merge(str(src), str(out), **kw)
        doc = json.loads(_info(out, "--json"))
        if name == "st":
            with safe_open(str(out / "model.safetensors"), "pt") as f:
                want = {k: f.get_slice(k) for k in f.keys()}
                dtypes = {str(v.get_dtype()) for v in want.values()}
            assert dtypes == {"BF16"} and doc["dtypes"] == [{
                "dtype": "bf16", "tensors": len(want),
                "numel": sum(torch.Size(v.get_shape()).numel() for v in want.values())}]
            assert doc["checksums"] is None and doc["index"] is None
        else:
            want = {}
            for f in sorted(out.glob("pytorch_model-*.bin")):
                want.update(torch.load(f, weights_only=True))
            assert len(doc["files"]) == len(list(out.glob("pytorch_model-*.bin"))) > 1
            assert doc["index"] == "pytorch_model.bin.index.json" and doc["checksums"] == "crc32"
            assert {t.dtype for t in want.values()} == {torch.float32}
            assert doc["dtypes"] == [{"dtype": "fp32", "tensors": len(want),
                                      "numel": sum(t.numel() for t in want.values())}]
        cfg = json.loads((out / "config.json").read_text())
        assert doc["format"] == "hf" and doc["tensors"] == len(want)
        assert doc["config"]["model_type"] == cfg["model_type"] and doc["config"]["hidden_size"] == cfg["hidden_size"]
        assert doc["total_bytes"] == sum(f["bytes"] for f in doc["files"])
        text = _info(out)
        assert _line(text, "format").startswith("format       Hugging Face model folder"), text
        assert f"tensors      {len(want)}," in text and f"hidden_size {cfg['hidden_size']}" in text, text
        assert ("none (safetensors holds no checksum" in text) == (name == "st"), text
