"""``zckpt convert --to dcp --layout torchtitan``: a DeepSpeed ZeRO-2 checkpoint saved at 2 ranks, loaded by
torchtitan 0.3.0's own ``CheckpointManager.load(step=3)`` at 3 CPU ranks (tests/titan_worker.py: FSDP2, torchtitan's
``OptimizersContainer`` / ``LRSchedulersContainer``, a train state). Every weight, buffer, moment and step must
equal DeepSpeed's save-time view (``expected/oracle.*``: ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``, the module's buffers and frozen weight) bit for bit, each group's lr and weight
decay DeepSpeed's, the scheduler's ``last_epoch`` the steps DeepSpeed's WarmupLR took, ``train_state`` the
source's ``global_steps`` and the stated ``ntokens_seen``. What the source does not hold is refused until stated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.components.checkpoint")

ROOT = Path(__file__).resolve().parents[1]
NAME = "z2_bf16_ws2"  # two groups, WarmupLR, a frozen bf16 weight, tied head, buffers (fixtures/generate.py)


def _exact(ours, want) -> bool:
    """Bit for bit; a narrower stored value (the bf16 frozen weight) loaded into an fp32 parameter must be exactly
    its upcast."""
    if ours.shape != want.shape:
        return False
    if ours.dtype == want.dtype:
        return torch.equal(ours.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    wide = ours.dtype if ours.element_size() > want.element_size() else want.dtype
    return torch.equal(ours.to(wide), want.to(wide))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    base = tmp_path_factory.mktemp("titan")
    step_dir = base / "ckpt" / "step-3"
    # the documented command (docs/migrate-fsdp2.md)
    proc = _cli("convert", checkpoint_path(FIXTURES / NAME), "--to", "dcp", "--layout", "torchtitan",
                "--ntokens-seen", "90", "--initial-lr", "0.01,0.005", "-o", step_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    spec = FIXTURES / NAME / "expected" / "spec.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(ROOT / "tests" / "titan_worker.py"),
           str(spec), str(base), "3", str(base / "loaded")]
    run = ds_oracle.run_torchrun(cmd, G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(base)}), 900)
    assert run.returncode == 0, run.stdout.decode(errors="replace")[-6000:]
    from safetensors.torch import load_file
    return doc, load_file(str(base / "loaded.safetensors")), json.loads((base / "loaded.json").read_text())


@pytest.mark.slow
def test_torchtitans_checkpoint_manager_loads_deepspeeds_state_bit_for_bit(loaded):
    from safetensors.torch import load_file
    doc, got, info = loaded
    exp = FIXTURES / NAME / "expected"
    want, oracle = load_file(str(exp / "oracle.safetensors")), json.loads((exp / "oracle.json").read_text())
    assert info["world_size"] == 3 != json.loads((exp / "spec.json").read_text())["world_size"]
    assert info["tied"] and oracle["tied"]
    tied = dict(map(tuple, oracle["tied"]))  # alias -> source: named_parameters gives the source name only
    checked = set()
    for key, value in want.items():
        kind, name = key.split("/", 1)
        if kind == "fp32":
            mine = f"param/{tied.get(name, name)}"
        elif kind in ("exp_avg", "exp_avg_sq"):
            mine = f"{kind}/{tied.get(name, name)}"
        elif kind == "buffer":
            mine = key
        elif kind == "module" and name in oracle["frozen"]:
            mine = f"param/{name}"
        else:
            continue
        assert _exact(got[mine], value), key
        checked.add(mine)
    trainable = set(oracle["trainable"])
    assert {f"param/{n}" for n in trainable} <= checked and {f"exp_avg_sq/{n}" for n in trainable} <= checked
    assert any(k.startswith("buffer/") for k in checked) and info["frozen"] == oracle["frozen"]
    steps = {float(got[f"step/{n}"]) for n in trainable}
    assert steps == {float(oracle["step"])}
    # each group's lr and weight decay are DeepSpeed's, whatever torchtitan was configured with
    ds_groups = {n: (lr, g["weight_decay"]) for g, lr in zip(oracle["param_groups"], oracle["lrs"]) for n in g["names"]}
    for g in info["groups"]:
        assert {ds_groups[n] for n in g["names"]} == {(g["lr"], g["weight_decay"])}, g
        assert g["betas"] == [0.9, 0.95] and g["eps"] == 1e-8 and g["decoupled_weight_decay"]
    assert sorted(g["initial_lr"] for g in info["groups"]) == [0.005, 0.01]
    # WarmupLR stepped last_batch_iteration + 1 times; torchtitan's LambdaLR counts them as last_epoch
    assert info["last_epoch"] == oracle["lr_scheduler"]["last_batch_iteration"] + 1 == 3
    assert info["train_state"] == {"step": oracle["global_steps"], "ntokens_seen": 90}
    assert doc["layout"] == "torchtitan" and "dataloader" in doc["not_carried"]
    assert "client_state" in doc["not_carried"] and any("last_epoch = 3" in c for c in doc["carried"])


def test_values_the_source_does_not_hold_are_refused_until_stated(tmp_path):
    src = checkpoint_path(FIXTURES / NAME)
    out = tmp_path / "ckpt" / "step-3"
    cases = [((), "--ntokens-seen"), (("--ntokens-seen", "0"), "--initial-lr"),
             (("--ntokens-seen", "0", "--initial-lr", "0.1,0.2,0.3"), "--initial-lr")]
    for extra, option in cases:
        proc = _cli("convert", src, "--to", "dcp", "--layout", "torchtitan", *extra, "-o", out)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert option in proc.stderr and not out.exists()
    proc = _cli("convert", FIXTURES / "z0_fp32_ws2", "--to", "dcp", "--layout", "torchtitan", "--ntokens-seen", "0",
                "--initial-lr", "0.01", "-o", out, "--json")  # no scheduler in that run
    assert proc.returncode == 1 and "--lr-last-epoch" in proc.stdout + proc.stderr and not out.exists()
    proc = _cli("convert", src, "--to", "dcp", "--layout", "dcp", "--ntokens-seen", "0", "-o", out)
    assert proc.returncode == 2 and "--layout torchtitan" in proc.stderr  # an option that does not apply: usage
    proc = _cli("convert", src, "--to", "dcp", "--layout", "torchtitan", "--ntokens-seen", "0", "--initial-lr", "x",
                "-o", out)
    assert proc.returncode == 1 and "--initial-lr" in proc.stderr


def test_trainer_checkpoint_schedule_from_scheduler_pt(tmp_path):
    """A Trainer checkpoint-N: last_epoch is its scheduler.pt's (LambdaLR), initial_lr its groups' own; its Llama under
    torchtitan's Llama 3 names (its config.json says llama: tests/test_titan_llama.py loads them in torchtitan)."""
    from zckpt.ops.convert import convert
    res = convert(str(FIXTURES / "trainer" / "checkpoint-4"), out=str(tmp_path / "step-4"), layout="torchtitan",
                  torchtitan={"ntokens_seen": 0}, dry_run=True)
    saved = torch.load(FIXTURES / "trainer" / "checkpoint-4" / "scheduler.pt", weights_only=True)
    assert f"lr_scheduler.last_epoch = {saved['last_epoch']}" in res.plan.carried
    keys = set(res.plan.parts[0][1].keys())
    assert "optimizer.param_groups.norm.weight.initial_lr" in keys and "lr_scheduler.last_epoch" in keys
    assert "tok_embeddings.weight" in keys and "train_state.ntokens_seen" in keys
