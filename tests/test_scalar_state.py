"""Per-partition scalar optimizer state (issue 50 item 13): DeepSpeed's own ``HybridStateOptimizer`` test keeps, per
flat partition, an int ``integer_step`` and a ``[1]``-shaped ``tensor_step``. A one-element state tensor equal on
every rank is a scalar: carried as saved (and loaded by DeepSpeed at the new size, bit for bit); one whose value
differs between ranks is per-partition state, refused. Fixtures ``z2_bf16_ws2_hybrid`` / ``z1_bf16_ws2_hybrid``
were saved by DeepSpeed 0.19.8 (``fixtures/generate.py``, optimizer ``hybrid``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zckpt
from tests.conftest import FIXTURES
from tests.test_reshard import fixture_dir, run_case  # noqa: F401 - the session fixture of committed fixtures
from zckpt.errors import UnsupportedLayout
from zckpt.state.open import open_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def _states(folder: Path, tag: str = "global_step3") -> list[dict]:
    files = sorted((folder / tag).glob("*zero_pp_rank_*_optim_states.pt"))
    return [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]


@pytest.mark.parametrize("name", ["z2_bf16_ws2_hybrid", "z1_bf16_ws2_hybrid"])
def test_scalar_state_is_carried_as_saved(name, tmp_path):
    src = FIXTURES / name
    ckpt = open_checkpoint(str(src))
    assert ckpt.state_refusal is None and ckpt.other_state_keys == [], (ckpt.state_refusal, ckpt.notes)
    saved = [osd["base_optimizer_state"]["state"] for osd in _states(src)]
    assert all(list(st) == list(saved[0]) for st in saved) and len(saved[0]) >= 1
    for stage in (None, 3):
        out = tmp_path / f"ws3-{stage}"
        zckpt.reshard(str(src), str(out), world_size=3, stage=stage)
        new = _states(out)
        assert len(new) == 3
        for osd in new:
            st = osd["optimizer_state_dict"]["state"] if stage == 3 else osd["base_optimizer_state"]["state"]
            assert len(st) == len(saved[0])
            for g, s in st.items():
                ref = saved[0][g] if g in saved[0] else next(iter(saved[0].values()))
                assert list(s) == ["integer_step", "tensor_step"] and s["integer_step"] == ref["integer_step"] == 3
                t = s["tensor_step"]
                assert t.shape == ref["tensor_step"].shape == (1,) and t.dtype == ref["tensor_step"].dtype
                assert t.numpy().tobytes() == ref["tensor_step"].numpy().tobytes()


def test_deepspeed_loads_the_reshard_bit_for_bit(fixture_dir, tmp_path):  # noqa: F811
    """DeepSpeed 0.19.8's engine at 3 ranks loads zckpt's reshard of the 2-rank ZeRO-2 checkpoint with the source
    engine's state (run_case: DeepSpeed's own API on every parameter) and saves again the very files zckpt wrote,
    tensor_step and integer_step included."""
    run_case(fixture_dir, tmp_path, "z2_bf16_ws2_hybrid", 3)


def test_ranks_that_disagree_are_refused(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "z2_bf16_ws2_hybrid", ck, ignore=shutil.ignore_patterns("expected"))
    f = ck / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["tensor_step"] = torch.tensor([2.0])
    torch.save(sd, f)
    with pytest.raises(UnsupportedLayout, match="'tensor_step' of param group 1 is not elementwise \\(a one-element "
                                                "tensor \\[1\\] whose value differs between ranks\\)"):
        zckpt.reshard(str(ck), str(tmp_path / "o"), world_size=3)
    assert not (tmp_path / "o").exists()
    res = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(ck), "-w", "3", "-o", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "tensor_step" in res.stderr
    assert zckpt.verify(str(ck)).ok  # the weights still read: merge, verify, info
    zckpt.merge(str(ck), str(tmp_path / "m"))
