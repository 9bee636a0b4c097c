"""DeepSpeed -> DCP against the real thing: DeepSpeed saved at N (the committed fixtures), ``zckpt convert --to
dcp``, then real FSDP2 at M != N (1, 2 and 3 CPU ranks, gloo) resumes with ``fully_shard`` + ``torch.optim.AdamW``
+ ``dcp.load`` + ``set_state_dict`` (tests/fsdp2_worker.py). Every master, moment and step must be bit-equal to
DeepSpeed's save-time view (``expected/oracle.*``: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``);
the groups' lr, betas, eps and weight decay DeepSpeed's; frozen weights and buffers the module's. Then a few steps
continue on both sides from the same global batches and the masters are compared with DeepSpeed's own
continuation (different processes, reductions and kernels: the measured difference is asserted small, see
docs/migrate-fsdp2.md for the figures).

One torchrun per world size covers several fixtures (frozen, tied, two groups, ZeRO-3, bf16 / fp16 / fp32
sources, bf16 masters, BF16 optimizer)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# world size M -> fixtures (their own world size N != M); * = also continued and compared with DeepSpeed
RUNS = {
    3: ["z2_bf16_ws2*", "z3_bf16_ws2", "z2_bf16master_ws2"],
    1: ["z2_fp16_ws2", "z3_fp16_ws2", "bf16opt_z1_ws2", "z1_bf16_ws2"],
    2: ["z2_fp32_ws3*", "z3_bf16_ws4", "z3_fp32_ws3"],
}
STEPS, ROWS = 3, 6  # continuation: 3 steps of 6 rows (split over 1, 2 or 3 ranks the same way)


def _torchrun(job: dict, nproc: int, timeout: int = 900) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    with tempfile.TemporaryDirectory(prefix="zckpt-fsdp2-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(ROOT / "tests" / "fsdp2_worker.py"), str(path)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]


def _spec(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected" / "spec.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Convert every fixture, resume each in FSDP2 at its M, continue the starred ones in both frameworks."""
    from zckpt.ops.convert import convert
    base = tmp_path_factory.mktemp("fsdp2")
    done = {}
    for m, names in RUNS.items():
        cases = []
        for entry in names:
            name = entry.rstrip("*")
            spec = _spec(name)
            assert spec["world_size"] != m
            dcp_dir = base / f"{name}.dcp"
            convert(str(checkpoint_path(FIXTURES / name)), out=str(dcp_dir))
            case = {"name": name, "spec": spec, "dcp": str(dcp_dir), "out": str(base / name)}
            if entry.endswith("*"):
                case.update(train_steps=STEPS, rows=ROWS, bf16_compute=spec["dtype"] == "bf16")
            cases.append(case)
            done[name] = case
        _torchrun({"mode": "fsdp2", "cases": cases}, m)
    trainer = {"name": "trainer", "spec": _spec("trainer"), "dcp": str(base / "trainer.fsdp"),
               "out": str(base / "trainer")}
    convert(str(checkpoint_path(FIXTURES / "trainer")), out=trainer["dcp"])  # layout "trainer" by default
    _torchrun({"mode": "accelerate", "cases": [trainer]}, 3)
    done["trainer"] = trainer
    for case in done.values():
        if case.get("train_steps"):
            ds = dict(case, ckpt=str(checkpoint_path(FIXTURES / case["name"])))
            _torchrun({"mode": "deepspeed", "cases": [ds]}, case["spec"]["world_size"])
    return done


def _exact(ours, want) -> bool:
    """The same value bit for bit: in one dtype, the same bits; a narrower stored value (bf16 frozen weight, bf16
    master) loaded into FSDP2's fp32 parameter must be exactly its upcast."""
    if ours.shape != want.shape:
        return False
    if ours.dtype == want.dtype:
        return torch.equal(ours.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    wide = ours.dtype if ours.element_size() > want.element_size() else want.dtype
    return torch.equal(ours.to(wide), want.to(wide)) and not torch.isnan(ours.float()).any()


def _load(case: dict, what: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    out = Path(case["out"])
    info = json.loads((out / f"{what}.json").read_text())
    return load_file(str(out / f"{what}.safetensors")), info


ALL = [e.rstrip("*") for names in RUNS.values() for e in names]


@pytest.mark.parametrize("name", ALL)
def test_fsdp2_resumes_deepspeeds_state_bit_for_bit(runs, name):
    from safetensors.torch import load_file
    case = runs[name]
    got, info = _load(case, "loaded")
    want = load_file(str(FIXTURES / name / "expected" / "oracle.safetensors"))
    oracle = json.loads((FIXTURES / name / "expected" / "oracle.json").read_text())
    assert info["world_size"] != oracle["world_size"]
    assert info["param_dtypes"] == ["torch.float32"] and info["tied"]
    checked = 0
    for n in oracle["trainable"]:
        assert _exact(got[f"param/{n}"], want[f"fp32/{n}"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert _exact(got[f"{k}/{n}"], want[f"{k}/{n}"]), (k, n)
        step = got[f"step/{n}"]
        assert step.dtype == torch.float32 and step.dim() == 0 and float(step) == float(oracle["step"]), n
        checked += 1
    for n in oracle["frozen"]:
        assert _exact(got[f"param/{n}"], want[f"module/{n}"]), n
        assert f"exp_avg/{n}" not in got
    for n in oracle["buffers"]:
        assert _exact(got[f"buffer/{n}"], want[f"buffer/{n}"]), n
    assert checked == len(oracle["trainable"]) > 0
    groups = {tuple(g["names"]): g for g in info["groups"]}
    for g, lr in zip(oracle["param_groups"], oracle["lrs"]):
        mine = groups[tuple(g["names"])]
        assert (mine["lr"], mine["weight_decay"], mine["betas"], mine["eps"]) == (lr, g["weight_decay"],
                                                                                  [0.9, 0.95], 1e-8), mine
        assert mine["decoupled_weight_decay"] is True
    # every key the FSDP2 model + AdamW state dict has was in the checkpoint (dcp.load is strict), and the
    # checkpoint's model / optim keys are exactly those (nothing zckpt-specific under model. or optim.)
    meta_keys = _metadata_keys(Path(case["dcp"]))
    mine = {k for k in meta_keys if k.startswith(("model.", "optim."))}
    assert mine == set(info["target_keys"])


def _metadata_keys(folder: Path) -> set[str]:
    import pickle
    return set(pickle.loads((folder / ".metadata").read_bytes()).state_dict_metadata)


@pytest.mark.parametrize("name", [e.rstrip("*") for names in RUNS.values() for e in names if e.endswith("*")])
def test_fsdp2_continues_like_deepspeed(runs, name):
    case = runs[name]
    fsdp, finfo = _load(case, "after")
    ds, dinfo = _load(case, "deepspeed")
    start, _ = _load(case, "loaded")
    worst, moved = 0.0, 0.0
    for key, want in ds.items():
        worst = max(worst, float((fsdp[key] - want).abs().max()))
        moved = max(moved, float((want - start[key]).abs().max()))
    losses = list(zip(finfo["losses"], dinfo["losses"]))
    print(f"{name}: after {STEPS} steps max |FSDP2 - DeepSpeed| = {worst:.3g} (largest update {moved:.3g}); "
          f"losses {losses}")
    assert moved > 1e-4  # the steps did move the weights
    assert abs(finfo["losses"][0] - dinfo["losses"][0]) < (1e-5 if case["spec"]["dtype"] == "fp32" else 2e-2)
    assert worst < (1e-6 if case["spec"]["dtype"] == "fp32" else 0.05 * moved), (worst, moved)


def test_accelerate_loads_the_trainer_layout(runs):
    """A Trainer checkpoint-N converted with the default layout is what a Trainer / Accelerate FSDP2 run
    (``fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}``) resumes from: Accelerate's own
    ``load_fsdp_model`` / ``load_fsdp_optimizer`` at 3 ranks (the source had 2) restore DeepSpeed's state bit for
    bit, and the Trainer's ``scheduler.pt`` (copied) its schedule."""
    from safetensors.torch import load_file
    case = runs["trainer"]
    folder = Path(case["dcp"])
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (folder / "optimizer_0" / ".metadata").is_file()
    assert (folder / "scheduler.pt").is_file() and (folder / "trainer_state.json").is_file()
    assert not (folder / "latest").exists() and not any(folder.glob("global_step*"))
    # model.* and zckpt's record of the tie (a key Accelerate's dcp.load of {"model": ...} never asks for)
    assert {k for k in _metadata_keys(folder / "pytorch_model_fsdp_0") if not k.startswith("model.")} == {"zckpt.tied"}
    assert all(k.startswith("optimizer.") for k in _metadata_keys(folder / "optimizer_0"))
    got, info = _load(case, "accelerate")
    want = load_file(str(FIXTURES / "trainer" / "expected" / "oracle.safetensors"))
    oracle = json.loads((FIXTURES / "trainer" / "expected" / "oracle.json").read_text())
    for n in oracle["trainable"]:
        assert _exact(got[f"param/{n}"], want[f"fp32/{n}"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert _exact(got[f"{k}/{n}"], want[f"{k}/{n}"]), (k, n)
        assert float(got[f"step/{n}"]) == float(oracle["step"]), n
    for g, want_g, lr in zip(info["groups"], oracle["param_groups"], oracle["lrs"]):
        assert (g["names"], g["lr"], g["weight_decay"]) == (want_g["names"], lr, want_g["weight_decay"])
    assert info["scheduler"] == oracle["hf_lr_scheduler"]["last_epoch"]
