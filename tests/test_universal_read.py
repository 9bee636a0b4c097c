"""Reading universal checkpoints: DeepSpeed's own ``ds_to_universal`` output and ``zckpt reshard --format universal``.

For committed fixtures, both universal forms are made (the first by real DeepSpeed 0.19.8), then:
- ``merge`` equals DeepSpeed's consolidation of the original (``expected/fp32.safetensors``) and the native merge,
  bit for bit;
- ``reshard`` universal -> native at another world size writes the same files as native -> native from the
  original (every pickle and every tensor byte);
- ``info`` and ``verify`` (also ``--deep``) work on them through the CLI;
- dtypes are read from the files (a bf16 ``fp32.pt`` is read as bf16, never reinterpreted as float32);
- a missing or damaged ``zero/<param>/*.pt`` is refused naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.encoding import safeload
from zckpt.errors import CorruptFile, IncompleteCheckpoint
from tests.conftest import FIXTURES, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_reshard import _lazy_tree_equal, assert_same_records  # noqa: E402

reshard = __import__("importlib").import_module("zckpt.ops.reshard").reshard

NAMES = ["z2_bf16_ws2", "z3_bf16_ws2", "bf16opt_z1_ws2"]  # ZeRO-2, ZeRO-3, the BF16 optimizer


def _ds_to_universal(src: Path, out: Path) -> Path:
    """Real DeepSpeed's converter: ``<out>/<tag>_universal`` and ``<out>/latest_universal``."""
    tag = (src / "latest").read_text().strip()
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=os.path.join(tempfile.gettempdir(), "zckpt-universal-read-ext"))
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(src / tag), "--output_folder", str(out / f"{tag}_universal"),
                           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                          capture_output=True, text=True, env=env, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "latest_universal").read_text().strip() == f"{tag}_universal"
    return out


@pytest.fixture(scope="module", params=NAMES)
def universal(request, tmp_path_factory):
    """(fixture folder, DeepSpeed's universal save folder, zckpt's universal save folder)."""
    fx = FIXTURES / request.param
    if not (fx / "expected" / "spec.json").exists():
        pytest.skip(f"fixture {request.param} missing")
    base = tmp_path_factory.mktemp(f"u_{request.param}")
    src = checkpoint_path(fx)
    ds = _ds_to_universal(src, base / "ds")
    ws = json.loads((fx / "expected" / "spec.json").read_text())["world_size"]
    ours = base / "zckpt"
    reshard(str(src), str(ours), world_size=ws, fmt="universal")
    return fx, ds, ours


def _merged(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


def test_opened_as_universal(universal):
    fx, ds, ours = universal
    native = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    for path in (ds, ours):
        ckpt = zckpt.open_checkpoint(str(path))
        assert ckpt.location.universal
        assert (ckpt.stage, ckpt.flavour, ckpt.precision) == (native.stage, native.flavour, native.precision)
        assert [r.name for r in ckpt.records] == [r.name for r in native.records]
        assert [(g.hyperparams, g.step, g.names) for g in ckpt.groups] == \
            [(g.hyperparams, g.step, g.names) for g in native.groups]
        for rec, nrec in zip(ckpt.records, native.records):
            assert (rec.kind, rec.shape, rec.dtype, rec.lp_dtype, rec.tied_to) == \
                (nrec.kind, nrec.shape, nrec.dtype, nrec.lp_dtype, nrec.tied_to), rec.name
            if rec.kind == "trainable":
                assert all(p.path.endswith(f"/zero/{rec.name}/fp32.pt") for p in rec.value), rec.name


@pytest.mark.parametrize("which", ["deepspeed", "zckpt"])
def test_merge_equals_deepspeed_and_native(universal, tmp_path, which):
    fx, ds, ours = universal
    src = ds if which == "deepspeed" else ours
    zckpt.merge(str(checkpoint_path(fx)), str(tmp_path / "native"))
    res = zckpt.merge(str(src), str(tmp_path / "u"))
    got, native = _merged(tmp_path / "u"), _merged(tmp_path / "native")
    assert sorted(got) == sorted(native)
    for name, want in native.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    expected = fx / "expected" / "fp32.safetensors"
    if expected.exists():  # DeepSpeed's own consolidation of the original checkpoint
        tied = res.plan.skipped_tied
        for name, want in load_file(str(expected)).items():
            have = got[tied.get(name, name)]
            assert have.dtype == want.dtype and torch.equal(have, want), name


@pytest.mark.parametrize("which", ["deepspeed", "zckpt"])
def test_reshard_universal_to_native_equals_native_to_native(universal, tmp_path, which):
    fx, ds, ours = universal
    src = ds if which == "deepspeed" else ours
    reshard(str(checkpoint_path(fx)), str(tmp_path / "n2n"), world_size=3)
    reshard(str(src), str(tmp_path / "u2n"), world_size=3)
    assert_same_records(tmp_path / "n2n", tmp_path / "u2n")
    a = tmp_path / "n2n" / (tmp_path / "n2n" / "latest").read_text().strip()
    b = tmp_path / "u2n" / (tmp_path / "u2n" / "latest").read_text().strip()
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    zero3 = any(n.startswith("zero_pp_rank_") and n.endswith("model_states.pt") for n in names)
    for n in names:  # every pickle, every tensor byte (ZeRO-3 partition padding aside)
        _lazy_tree_equal(safeload.load(str(a / n)), safeload.load(str(b / n)), n, zero3)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, ZCKPT_DEBUG=""))


def test_info_and_verify_cli(universal):
    fx, ds, ours = universal
    native = zckpt.open_checkpoint(str(checkpoint_path(fx)))
    for path in (ds, ours):
        proc = _cli("info", str(path), "--json")
        assert proc.returncode == 0, proc.stderr
        d = json.loads(proc.stdout)
        assert d["universal"] is True and d["zero_stage"] == native.stage
        assert d["parameters"] == sum(r.numel for r in native.records if r.kind in ("trainable", "frozen"))
        assert any(f["name"] == "zero/optimizer_state.pt" for f in d["files"])
        for extra in ([], ["--deep"]):
            proc = _cli("verify", str(path), *extra)
            assert proc.returncode == 0, proc.stdout + proc.stderr


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_dtypes_come_from_the_files(universal, tmp_path):
    """A master weight and moments saved as bf16 are read as bf16 (merge widens them exactly), not as float32."""
    fx, ds, _ = universal
    u = _copy(ds, tmp_path / "u")
    tag = (u / "latest_universal").read_text().strip()
    name = next(r.name for r in zckpt.open_checkpoint(str(u)).records if r.kind == "trainable")
    folder = u / tag / "zero" / name
    originals = {}
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        obj = torch.load(folder / f"{state}.pt", weights_only=False)
        t = obj["param"] if isinstance(obj, dict) else obj
        originals[state] = t
        new = t.to(torch.bfloat16)
        torch.save({**obj, "param": new} if isinstance(obj, dict) else new, folder / f"{state}.pt")
    rec = zckpt.open_checkpoint(str(u)).by_name()[name]
    assert rec.dtype == "bfloat16" and rec.state_dtype == "bfloat16"
    sd = zckpt.load_state_dict(str(u))
    assert sd[name].dtype == torch.float32
    assert torch.equal(sd[name], originals["fp32"].to(torch.bfloat16).float().reshape(sd[name].shape))


def test_missing_and_damaged_param_files(universal, tmp_path):
    fx, ds, _ = universal
    u = _copy(ds, tmp_path / "u")
    tag = (u / "latest_universal").read_text().strip()
    name = next(r.name for r in zckpt.open_checkpoint(str(u)).records if r.kind == "trainable")
    target = u / tag / "zero" / name / "exp_avg_sq.pt"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CorruptFile) as err:
        zckpt.open_checkpoint(str(u))
    assert err.value.path == str(target)
    proc = _cli("verify", str(u))
    assert proc.returncode == 1 and str(target) in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    (u / tag / "zero" / name / "fp32.pt").unlink()
    target.unlink()
    with pytest.raises(IncompleteCheckpoint) as err:
        zckpt.open_checkpoint(str(u))
    assert f"zero/{name}/fp32.pt" in str(err.value)
