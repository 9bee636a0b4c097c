"""zckpt's reader against DeepSpeed itself, on every committed fixture (real DeepSpeed checkpoints).

* parameters rebuilt through the reader equal DeepSpeed's own consolidation, bit for bit (frozen and tied too);
* fp32 masters and Adam moments equal what DeepSpeed's ``safe_get_full_*`` APIs returned inside the training
  processes right after the save (``expected/oracle.safetensors``), so the moment slices are right as well;
* steps, world size, stage and precision match the run's record (``expected/oracle.json``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from zckpt.state.open import open_checkpoint
from zckpt.encoding.tensors import load_pieces


def _load(rec, which="value"):
    if which in rec.other_state:  # another optimizer's per-element state (momentum_buffer, Lion's exp_avg)
        return load_pieces(rec.other_state[which], rec.other_state[which][0].dtype, rec.shape)
    pieces = getattr(rec, which)
    dtype = rec.dtype if which == "value" else rec.state_dtype  # as stored: never assumed float32
    return load_pieces(pieces, dtype, rec.shape)


def test_params_equal_deepspeed_consolidation(fixture_dir, ckpt_path):
    expected = fixture_dir / "expected" / "fp32.safetensors"
    if not expected.exists():
        pytest.skip("DeepSpeed's converter cannot read this layout (see expected/NOTES.txt); oracle test covers it")
    ref = load_file(str(expected))
    ckpt = open_checkpoint(str(ckpt_path))
    byname = ckpt.by_name()
    for name, want in ref.items():
        assert name in byname, f"{name} missing from zckpt's reader"
        rec = byname[name]
        if rec.kind == "tied":
            rec = byname[rec.tied_to]
        got = _load(rec)
        if got.dtype != want.dtype:  # DeepSpeed's converter upcasts frozen params: exact for bf16/fp16 -> fp32
            got = got.to(want.dtype)
        assert torch.equal(got, want), name
    # and nothing DeepSpeed knows is missing, nothing extra besides what DeepSpeed drops (ZeRO-1 frozen weights,
    # parameters in no optimizer group, and their tied aliases)
    extra = {r.name for r in ckpt.records} - set(ref)
    assert all(byname[n].kind == "frozen" or byname[n].kind == "tied" and byname[byname[n].tied_to].kind == "frozen"
               for n in extra), extra


def test_masters_and_moments_equal_deepspeed_oracle(fixture_dir, ckpt_path):
    oracle = load_file(str(fixture_dir / "expected" / "oracle.safetensors"))
    info = json.loads((fixture_dir / "expected" / "oracle.json").read_text())
    ckpt = open_checkpoint(str(ckpt_path))
    byname = ckpt.by_name()
    checked = 0
    for key, want in oracle.items():
        kind, name = key.split("/", 1)
        rec = byname.get(name)
        if kind not in ("module", "buffer"):  # fp32, and every optimizer's per-element state (exp_avg, momentum...)
            assert rec is not None, name
            if rec.kind == "tied":
                rec = byname[rec.tied_to]
            assert rec.kind == "trainable", name
            got = _load(rec, "value" if kind == "fp32" else kind)
            if got.dtype != want.dtype:
                # DeepSpeed's safe_get_full_* may hand back bf16-stored state upcast to fp32 (exact): then the
                # stored dtype must be the narrower one, never fp32 bytes relabelled
                assert want.dtype == torch.float32 and got.dtype in (torch.bfloat16, torch.float16), key
                got = got.to(want.dtype)
            assert torch.equal(got, want.reshape(got.shape)), key
            checked += 1
        elif kind == "buffer":
            assert rec is not None and rec.kind == "buffer", name
            got = _load(rec)
            assert torch.equal(got.to(want.dtype), want), key
        elif kind == "module" and rec is not None and rec.kind == "frozen":
            got = _load(rec)
            assert got.dtype == want.dtype and torch.equal(got, want), key  # the module's value, in its dtype
    assert checked > 0
    assert ckpt.world_size == info["world_size"]
    assert ckpt.stage == (info["stage"] if info.get("stage") else ckpt.stage)
    if "global_steps" in info:
        assert ckpt.model_state["global_steps"] == info["global_steps"]


def test_counts_and_kinds(fixture_dir, ckpt_path):
    info = json.loads((fixture_dir / "expected" / "oracle.json").read_text())
    ckpt = open_checkpoint(str(ckpt_path))
    kinds = {r.name: r.kind for r in ckpt.records}
    for name in info.get("frozen", info.get("frozen_names", [])):
        assert kinds.get(name) == "frozen", name
    for name in info.get("buffers", info.get("buffer_names", [])):
        assert kinds.get(name) == "buffer", name
    for pair in info.get("tied", info.get("tied_pairs", [])):
        a, b = pair if isinstance(pair, (list, tuple)) else (pair, None)
        assert kinds.get(a) == "tied" or (b and kinds.get(b) == "tied"), pair


def test_round_robin_gradients_read_in_param_shapes_order(tmp_path):
    """``round_robin_gradients`` (``fixtures/z2_bf16_ws2_rr``): the flat groups are in param_shapes' round-robin
    order, while DeepSpeed 0.19.8's own param_slice_mappings name the params in model order (same-sized
    ``blocks.0.up.weight`` / ``down.weight`` swapped). zckpt reads by param_shapes: every master rounds to the live
    engine's bf16 weight. Earlier zckpt refused it, blaming the files ("come from different saves"); reshard still
    refuses it in one line (the round-robin order depends on the world size)."""
    import zckpt
    from tests.conftest import FIXTURES
    from zckpt.errors import UnsupportedLayout
    fx = FIXTURES / "z2_bf16_ws2_rr"
    osd = open_checkpoint(str(fx)).optim_states[0]["optimizer_state_dict"]
    ckpt = open_checkpoint(str(fx))
    # rank 0 holds emb.weight and the start of param_shapes' second param; DeepSpeed's mapping names another one
    assert ckpt.groups[0].names[:2] == ["emb.weight", "blocks.0.down.weight"]
    assert list(osd["param_slice_mappings"][0]) == ["emb.weight", "blocks.0.up.weight"]
    assert any("round_robin_gradients" in n for n in ckpt.notes)
    oracle = load_file(str(fx / "expected" / "oracle.safetensors"))
    for rec in ckpt.of_kind("trainable"):
        assert torch.equal(_load(rec).to(torch.bfloat16), oracle[f"module/{rec.name}"]), rec.name
    with pytest.raises(UnsupportedLayout, match="round_robin_gradients") as err:
        zckpt.reshard(str(fx), str(tmp_path / "o"), world_size=3)
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
