"""Reshard of the data-parallel dimension of pipeline-parallel checkpoints, checked by real DeepSpeed.

The fixtures ``fixtures/pp2*`` (``PipelineModule`` over 2 stages, written by DeepSpeed 0.19.8 through
``fixtures/gen_parallel.py``) are resharded to another data-parallel size, the stages kept, then loaded NATIVELY:
torchrun at pp x new-dp CPU ranks (gloo) rebuilds the same ``PipelineModule`` from another seed (buffers scrambled),
calls a plain ``engine.load_checkpoint(out)`` and captures the live state exactly as the fixture generator did
(``gen_parallel._capture``: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, module weights,
buffers, step, lr, global steps, client state). It must equal the source fixture's ``expected/oracle.*`` bit for
bit. The engine then saves again at the new size, and every file of that tag must equal ours (tensors byte for
byte; ``ds_config`` / ``ds_version`` aside).

Run as a script, this file is the torchrun worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"


def _load_pipeline(spec: dict, ckpt: str, out: str, resave: str, timeout: float = 600) -> None:
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    Path(out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zckpt-pp-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"spec": spec, "ckpt": ckpt, "out": out, "resave": resave}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(spec["world_size"]), "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(Path(__file__).resolve()), str(job)]
        proc = ds_oracle.run_torchrun(cmd, G.rank_env({"TMPDIR": tmp}), timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed pipeline load at {spec['world_size']} ranks failed "
                               f"(rc={proc.returncode}):\n" + proc.stdout.decode(errors="replace")[-6000:])


def _worker(job_path: str) -> None:
    import torch
    import deepspeed
    import deepspeed.comm as dist

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(FIX))
    from tests import ds_oracle
    import gen_parallel as P

    G = ds_oracle.generate_module()
    job = json.loads(Path(job_path).read_text())
    spec = dict(job["spec"], expected=False)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec["seed"] + 99)
    model = P.build_pipeline(dict(spec, seed=spec["seed"] + 99))  # another init: all must come from the files
    with torch.no_grad():
        for _, buf in model.named_buffers():
            buf.add_(3.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"] / 3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=P._config(G, spec))
    import zckpt.deepspeed
    from zckpt.errors import UnsupportedLayout
    try:  # zckpt's own resume refuses a pipeline engine in one line, before reading anything
        zckpt.deepspeed.load_checkpoint(engine, job["ckpt"])
        refusal = None
    except UnsupportedLayout as exc:
        refusal = str(exc)
    load_path, client_state = engine.load_checkpoint(job["ckpt"], load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    assert load_path is not None, "load_checkpoint returned None"
    tensors, info = P._capture(G, engine, model, spec)
    client = {k: v for k, v in (client_state or {}).items() if isinstance(v, (int, float, str))}
    P._gather_and_write(G, dist, spec, Path(job["out"]), tensors, info,
                        {"client_state": client, "loaded_dp": engine.grid.data_parallel_size, "zckpt_refusal": refusal})
    tag = (Path(job["ckpt"]) / "latest").read_text().strip()
    engine.save_checkpoint(job["resave"], tag=tag, client_state=client)
    G._finish(dist)


if __name__ == "__main__":
    _worker(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the exit-time abort of CPU ranks (fixtures/generate.py exit_rank)


# ------------------------------------------------------------------------------------------------ tests

import pytest  # noqa: E402

from zckpt.errors import UnsupportedLayout  # noqa: E402
from zckpt.ops.reshard import reshard  # noqa: E402
from tests.test_reshard import assert_same_files, assert_same_state  # noqa: E402

PIPE_CASES = [
    # fixture, new data-parallel size
    ("pp2dp2_z1_bf16_ws4", 1),  # ZeRO-1 bf16, dp 2 -> 1 (2 ranks)
    ("pp2_z1_bf16_ws2", 2),  # ZeRO-1 bf16, dp 1 -> 2 (4 ranks)
    ("pp2_z1_fp32_ws2", 2),  # ZeRO-1 fp32 (zero_pp_rank_* names), dp 1 -> 2
]


@pytest.mark.slow
@pytest.mark.parametrize("name,dp", PIPE_CASES, ids=lambda v: str(v))
def test_pipeline_dp_reshard_loads_natively(tmp_path, name, dp):
    src = FIX / name
    spec = json.loads((src / "expected" / "spec.json").read_text())
    pp = int(spec["pp"])
    out = tmp_path / "out"
    res = reshard(str(src), str(out), world_size=dp)
    assert res.plan.world_size == dp and res.plan.source_world_size == spec["world_size"] // pp
    tag = res.plan.tag
    names = sorted(p.name for p in (out / tag).iterdir())
    prefix = "bf16_" if spec["dtype"] == "bf16" else ""
    assert [n for n in names if "optim_states" in n] == sorted(
        f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(dp) for s in range(pp))
    oracle, again = tmp_path / "oracle", tmp_path / "resaved"
    _load_pipeline(dict(spec, world_size=pp * dp), str(out), str(oracle), str(again))
    info = json.loads((oracle / "expected" / "oracle.json").read_text())
    assert info["loaded_dp"] == dp and info["processes"] == pp * dp
    assert "zckpt reshard" in info["zckpt_refusal"] and "\n" not in info["zckpt_refusal"]
    assert_same_state(src / "expected", oracle / "expected")
    assert_same_files(out, again, tag)


def test_pipeline_refusals(tmp_path):
    """What stays refused says so in one line: the stage / optimizer / format cannot change, and resume
    (zckpt.deepspeed.load_checkpoint) of a pipeline checkpoint points at reshard + engine.load_checkpoint."""
    src = str(FIX / "pp2dp2_z1_bf16_ws4")
    for kw, word in (({"stage": 2}, "ZeRO stage"), ({"fmt": "universal"}, "DeepSpeed layout only"),
                     ({"bf16_optimizer": True}, "optimizer")):
        with pytest.raises(UnsupportedLayout) as exc:
            reshard(src, str(tmp_path / "o"), world_size=1, **kw)
        assert word in str(exc.value) and "\n" not in str(exc.value)
        assert not (tmp_path / "o").exists()
    with pytest.raises(UnsupportedLayout, match="ZeRO-0 pipeline") as exc:  # DeepSpeed loads it per rank
        reshard(str(FIX / "pp2dp2_z0_bf16_ws4"), str(tmp_path / "o"), world_size=1)
    assert "\n" not in str(exc.value) and not (tmp_path / "o").exists()
    from zckpt.state.open import open_checkpoint
    from zckpt.ops.reshard import plan_ranks
    with pytest.raises(UnsupportedLayout, match="zckpt reshard"):
        plan_ranks(open_checkpoint(src), 1, [0])


def test_pipeline_plan_partitions_every_stage():
    """Each stage's flat group is re-partitioned by the plain ZeRO-1 writer (no second partitioner): the partition
    sizes of the plan at the source's own dp equal the source files' partitions."""
    from zckpt.state.open import open_checkpoint
    from zckpt.ops.reshard import plan_reshard
    ckpt = open_checkpoint(str(FIX / "pp2dp2_z1_bf16_ws4"))
    plan = plan_reshard(ckpt, ckpt.world_size)
    stages = ckpt.extra["pipeline_stages"]
    assert sorted({p["pipeline_stage"] for p in plan.partitions}) == list(range(len(stages)))
    for p in plan.partitions:
        sub = stages[p["pipeline_stage"]]
        osd = sub.optim_states[0]["optimizer_state_dict"]
        assert p["partition"] == osd["base_optimizer_state"]["state"][p["group"]]["exp_avg"].numel
