"""The Hugging Face folder reader (zckpt.hf.reader): merge's own outputs (safetensors or .bin, one file or sharded
with an index, config.json) read back as records whose bytes equal what safetensors / torch.load read; folders that
are also training checkpoints left to their readers; damaged folders refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.errors import CorruptFile, IncompleteCheckpoint
from zckpt.hf import reader
from tests.conftest import FIXTURES

TRAINER = FIXTURES / "trainer" / "checkpoint-4"
Z2 = FIXTURES / "z2_bf16_ws2"


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """merge's outputs of two checkpoints: (name -> (folder, the real library's state dict))."""
    base = tmp_path_factory.mktemp("hf")
    out = {}
    for name, src, kw in (("st", TRAINER, {}), ("st_sharded", TRAINER, {"max_shard_size": "2KB"}),
                          ("bin_sharded", TRAINER, {"fmt": "pt", "max_shard_size": "3KB"}),
                          ("bin_bf16", Z2, {"fmt": "pt", "dtype": "bf16"}), ("st_bf16", Z2, {"dtype": "bf16"})):
        folder = base / name
        zckpt.merge(str(src), str(folder), **kw)
        if kw.get("fmt") == "pt":
            ref = {}
            for f in sorted(folder.glob("pytorch_model*.bin")):
                ref.update(torch.load(f, weights_only=True))
        else:
            ref = {}
            for f in sorted(folder.glob("model*.safetensors")):
                ref.update(load_file(f))
        out[name] = (folder, ref)
    return out


def test_merge_outputs_read_bit_for_bit(hf_folders):
    for name, (folder, ref) in hf_folders.items():
        ckpt = reader.read(str(folder))
        assert ckpt.format == "hf" and ckpt.world_size == 1, name
        assert [r.name for r in ckpt.records] == list(ref), name  # every tensor, in the files' order
        assert {r.name: (tuple(r.shape), r.dtype) for r in ckpt.records} == \
            {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in ref.items()}, name
        sd = zckpt.load_state_dict(ckpt)
        floating = {k for k, v in ref.items() if v.is_floating_point()}
        for k, v in ref.items():  # load_state_dict gives fp32; the bytes read are the files' own
            assert torch.equal(sd[k], v.float() if k in floating else v), (name, k)
    sharded = reader.read(str(hf_folders["bin_sharded"][0]))
    assert len(sharded.files) > 1 and sharded.extra["hf"]["index"] == "pytorch_model.bin.index.json"
    assert sharded.extra["hf"]["checksums"] == "crc32"
    assert reader.read(str(hf_folders["st_sharded"][0])).extra["hf"]["checksums"] is None
    assert reader.read(str(hf_folders["st"][0])).extra["hf"]["config"]["model_type"] == "llama"


def test_training_checkpoints_are_not_claimed():
    # a Trainer checkpoint-N holds model.safetensors beside global_stepN/latest: its training state is read
    assert (TRAINER / "model.safetensors").exists() and not reader.claims(str(TRAINER))
    assert reader.weight_files(str(TRAINER)) == ["model.safetensors"]  # (read when asked: zckpt diff)
    for folder in (Z2, FIXTURES / "megatron" / "gpt_tp1_pp1_dp2"):
        assert not reader.claims(str(folder))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_damaged_folders_refused(hf_folders, tmp_path):
    st = _copy(hf_folders["st"][0], tmp_path / "trunc")
    f = st / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    with pytest.raises(CorruptFile, match="header says"):
        reader.read(str(st))
    f.write_bytes(f.read_bytes()[:-12])
    with pytest.raises(CorruptFile, match="do not hold"):
        reader.read(str(st))
    sh = _copy(hf_folders["st_sharded"][0], tmp_path / "missing")
    victim = sorted(sh.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(IncompleteCheckpoint, match=victim.name):
        reader.read(str(sh))
    idx = _copy(hf_folders["st_sharded"][0], tmp_path / "badindex")
    doc = json.loads((idx / "model.safetensors.index.json").read_text())
    first, second = list(doc["weight_map"])[:2]
    doc["weight_map"][first] = doc["weight_map"][second] if doc["weight_map"][first] != doc["weight_map"][second] \
        else sorted(set(doc["weight_map"].values()))[-1]
    (idx / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptFile, match=first):
        reader.read(str(idx))


def test_bin_bytes_checked_by_their_crc(hf_folders, tmp_path):
    folder = _copy(hf_folders["bin_bf16"][0], tmp_path / "flip")
    ckpt = reader.read(str(folder))
    assert reader.claims(str(folder))
    rec = max(ckpt.records, key=lambda r: r.numel)
    piece = rec.value[0]
    with open(piece.path, "r+b") as fh:
        fh.seek(piece.offset + 1)
        b = fh.read(1)
        fh.seek(piece.offset + 1)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptFile, match="CRC"):
        zckpt.load_state_dict(ckpt)
