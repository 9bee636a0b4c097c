"""merge: bit-exact against DeepSpeed's consolidation, every layout, both dtypes; sharding; .bin; atomicity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import zckpt
from zckpt.deepspeed.model import declared_ties
from zckpt.errors import OutputExists, UnsupportedLayout, ZckptError
from tests.conftest import FIXTURE_DIRS, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent


def _merged(out: Path) -> dict:
    index = out / "model.safetensors.index.json"
    files = [out / "model.safetensors"] if not index.exists() else sorted(
        {out / f for f in json.loads(index.read_text())["weight_map"].values()})
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_merge_equals_deepspeed(fixture_dir, ckpt_path, tmp_path, dtype):
    expected = fixture_dir / "expected" / f"{dtype}.safetensors"
    if not expected.exists():
        pytest.skip("DeepSpeed's converter cannot read this layout")
    ref = load_file(str(expected))
    convert = json.loads((fixture_dir / "expected" / "convert.json").read_text()) \
        if (fixture_dir / "expected" / "convert.json").exists() else {}
    ambiguous = zckpt.open_checkpoint(str(ckpt_path)).ambiguous_ties
    if ambiguous:  # a parameter outside the optimizer with another's bytes: refused until the tie is declared
        with pytest.raises(UnsupportedLayout, match=f"--no-tie {ambiguous[0][0]}"):
            zckpt.merge(str(ckpt_path), str(tmp_path / "out"), dtype=dtype)
        assert not (tmp_path / "out").exists()
    with declared_ties({a: None for a, _ in ambiguous}):  # (the fixtures' are parameters of their own)
        res = zckpt.merge(str(ckpt_path), str(tmp_path / "out"), dtype=dtype)
    got = _merged(tmp_path / "out")
    tied = res.plan.skipped_tied
    for name, want in ref.items():
        src = tied.get(name, name)
        assert src in got, f"{name} missing"
        assert got[src].dtype == want.dtype, name
        assert torch.equal(got[src], want), name
    # every tensor we wrote is one DeepSpeed wrote (ZeRO-1 frozen weights DeepSpeed drops are the exception)
    with declared_ties({a: None for a, _ in ambiguous}):
        ckpt = zckpt.open_checkpoint(str(ckpt_path))
    for name in set(got) - set(ref):
        assert ckpt.by_name()[name].kind == "frozen", name
    assert convert is not None


def test_merge_keep_tied_and_exclude_frozen(tmp_path):
    fx = [d for d in FIXTURE_DIRS if d.name.startswith("z2_bf16_ws2")]
    if not fx:
        pytest.skip("fixture missing")
    ck = checkpoint_path(fx[0])
    res = zckpt.merge(str(ck), str(tmp_path / "a"), keep_tied=True, exclude_frozen=True)
    got = _merged(tmp_path / "a")
    c = zckpt.open_checkpoint(str(ck))
    assert not res.plan.skipped_tied
    for r in c.records:
        if r.kind == "frozen":
            assert r.name not in got
        elif r.kind == "tied":
            assert torch.equal(got[r.name], got[r.tied_to])


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_sharded_output_matches_single(tmp_path, fmt):
    ck = checkpoint_path(FIXTURE_DIRS[0])
    ref = zckpt.load_state_dict(str(ck))
    zckpt.merge(str(ck), str(tmp_path / "s"), fmt=fmt, max_shard_size="400B")
    out = tmp_path / "s"
    index_name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    index = json.loads((out / index_name).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert files[0].endswith(f"-00001-of-{len(files):05d}." + ("safetensors" if fmt == "safetensors" else "bin"))
    total = 0
    seen = {}
    for f in files:
        if fmt == "safetensors":
            with safe_open(str(out / f), "pt") as sf:
                part = {k: sf.get_tensor(k) for k in sf.keys()}
        else:
            part = torch.load(out / f, weights_only=True)
        for k, v in part.items():
            assert index["weight_map"][k] == f  # each shard holds only its own tensors
            total += v.numel() * v.element_size()
            if fmt == "pt":  # the storage is only this tensor (DeepSpeed's .bin shards embed whole groups)
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
        seen.update(part)
    assert total == index["metadata"]["total_size"]
    tied = {r.name for r in zckpt.open_checkpoint(str(ck)).of_kind("tied")}
    for k, v in ref.items():
        if k in tied:
            continue
        assert torch.equal(seen[k], v), k


def test_pt_single_file_loads_with_weights_only(tmp_path):
    ck = checkpoint_path(FIXTURE_DIRS[-1])
    zckpt.merge(str(ck), str(tmp_path / "p"), fmt="pt", dtype="bf16")
    sd = torch.load(tmp_path / "p" / "pytorch_model.bin", weights_only=True, mmap=True)
    ref = zckpt.load_state_dict(str(ck), dtype="bf16")
    for k, v in sd.items():
        assert torch.equal(v, ref[k])


def test_iter_and_load_state_dict(tmp_path):
    ck = checkpoint_path(FIXTURE_DIRS[0])
    sd = zckpt.load_state_dict(str(ck), dtype="bf16")
    names = [n for n, _ in zckpt.iter_tensors(str(ck), dtype="bf16")]
    assert names == list(sd)
    c = zckpt.open_checkpoint(str(ck))
    for r in c.of_kind("tied"):
        assert sd[r.name] is sd[r.tied_to]


def test_output_exists_and_overwrite(tmp_path):
    ck = checkpoint_path(FIXTURE_DIRS[0])
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(OutputExists):
        zckpt.merge(str(ck), str(out))
    with pytest.raises(OutputExists, match="no .zckpt.json"):  # --overwrite replaces only a zckpt merge output
        zckpt.merge(str(ck), str(out), overwrite=True)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "keep.txt").unlink()
    zckpt.merge(str(ck), str(out))
    (out / "stale.txt").write_text("left by hand in a previous output")
    with pytest.raises(OutputExists, match="holds stale.txt"):  # issue 21: a file zckpt did not write is never deleted
        zckpt.merge(str(ck), str(out), overwrite=True)
    assert (out / "stale.txt").read_text() == "left by hand in a previous output"
    (out / "stale.txt").unlink()
    zckpt.merge(str(ck), str(out), overwrite=True)
    assert (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name or "zckpt-old" in p.name]


def test_bad_input_leaves_no_output(tmp_path):
    src = checkpoint_path(FIXTURE_DIRS[0])
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(src, bad, ignore=shutil.ignore_patterns("expected"))
    tag = (bad / "latest").read_text().strip()
    optim = sorted((bad / tag).glob("*optim_states.pt"))[-1]
    optim.write_bytes(optim.read_bytes()[:-200])  # truncate one rank
    with pytest.raises(ZckptError):
        zckpt.merge(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "zckpt" in p.name]


def test_interrupted_merge_leaves_nothing_or_previous(tmp_path):
    """SIGKILL a merge at several moments: OUT is absent or the previous complete result, never partial."""
    ck = checkpoint_path(FIXTURE_DIRS[0])
    out = tmp_path / "out"
    zckpt.merge(str(ck), str(out))
    good = (out / "model.safetensors").read_bytes()
    env = dict(os.environ, ZCKPT_TEST_SLOW_WRITE="0.05")
    for delay in (0.05, 0.5, 1.0, 2.0):
        p = subprocess.Popen([sys.executable, "-m", "zckpt", "merge", str(ck), "-o", str(out), "--overwrite",
                              "--quiet", "--max-shard-size", "300B"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if (out / "model.safetensors").exists():
            assert (out / "model.safetensors").read_bytes() == good
            assert not (out / "model.safetensors.index.json").exists()
        else:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            for f in set(index["weight_map"].values()):
                assert (out / f).exists()
        # finish it properly so the next round starts from a complete result
        zckpt.merge(str(ck), str(out), overwrite=True)
        assert (out / "model.safetensors").read_bytes() == good


def test_dry_run_writes_nothing(tmp_path):
    ck = checkpoint_path(FIXTURE_DIRS[0])
    res = zckpt.merge(str(ck), str(tmp_path / "d"), dry_run=True, max_shard_size="300B")
    assert not (tmp_path / "d").exists()
    s = res.to_json()
    assert s["dry_run"] and len(s["files"]) > 1 and s["total_bytes"] > 0


def test_load_into_module_strict():
    ck = checkpoint_path(FIXTURE_DIRS[0])
    sd = zckpt.load_state_dict(str(ck))

    class Holder(torch.nn.Module):
        def __init__(self, keys):
            super().__init__()
            for k, v in keys.items():
                parent = self
                *path, leaf = k.split(".")
                for p in path:
                    if not hasattr(parent, p):
                        parent.add_module(p, torch.nn.Module())
                    parent = getattr(parent, p)
                if v.is_floating_point():
                    parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(v)))
                else:
                    parent.register_buffer(leaf, torch.zeros_like(v))

    m = Holder(sd)
    zckpt.load_into_module(m, str(ck))
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    m.register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(zckpt.InvalidArgument, match="missing in checkpoint: extra"):
        zckpt.load_into_module(m, str(ck))
    zckpt.load_into_module(m, str(ck), strict=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trainer_checkpoint_becomes_from_pretrained_folder(tmp_path, dtype):
    trainer = ROOT / "fixtures" / "trainer" / "checkpoint-4"
    if not trainer.exists():
        pytest.skip("trainer fixture missing")
    from transformers import AutoModelForCausalLM
    out = tmp_path / "model"
    res = zckpt.merge(str(trainer), str(out), dtype=dtype)
    assert "config.json" in res.copied
    cfg = json.loads((out / "config.json").read_text())
    want = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == want
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert str(model.dtype) == f"torch.{want}"
    sd = zckpt.load_state_dict(str(trainer), dtype=dtype)
    msd = model.state_dict()
    for k, v in sd.items():
        assert torch.equal(msd[k], v), k
    # re-tied: the head shares the embedding
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
