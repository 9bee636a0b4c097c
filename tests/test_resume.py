"""Resume at another world size / stage inside the training job (``zckpt.deepspeed.load_checkpoint``).

Real DeepSpeed on CPU ranks (``tests/resume_worker.py`` under torchrun). In one job, every rank builds the
fixture's engine twice: once loading ``zckpt reshard``'s output with a plain ``engine.load_checkpoint`` (the
offline route), once through the API straight from the source. We check that

* each rank's raw engine state after the load (fp32 partitions, Adam moments and step, loss scaler, module
  weights and ZeRO-3 partitions, frozen weights, buffers, scheduler, counters, client state) is the same object
  tree, bit for bit, on both routes, and so are the losses of the next training steps;
* DeepSpeed's own view of the state (``safe_get_full_*``, gathered weights) equals the source fixture's;
* failures (a file missing on one rank only, a model that does not match) raise the same one-line error on
  every rank, and no rank hangs (the job has a timeout).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ds_oracle  # noqa: E402
from test_reshard import _ckpt, _spec, assert_same_state, assert_same_tree, fixture_dir  # noqa: E402,F401

from zckpt.ops.reshard import reshard  # noqa: E402

WORKER = Path(__file__).resolve().parent / "resume_worker.py"


ABORT = "terminate called without an active exception"


def run_job(job: dict, world_size: int, timeout: float = 420) -> subprocess.CompletedProcess:
    """torchrun the worker; on timeout the whole process group is killed and the test fails (a hang).

    Once in about 1,500 CI tests a CPU-rank DeepSpeed job died in C++ (``std::terminate``: a joinable thread
    destroyed, SIGABRT) with no Python error on any rank; that abort, and only that, is retried once, visibly."""
    res = _run_job_once(job, world_size, timeout)
    if res.returncode != 0 and ABORT in res.stdout and "Traceback" not in res.stdout.split(ABORT)[0]:
        print(f"run_job: a rank aborted in C++ ({ABORT}) with no Python error; running the job once more")
        res = _run_job_once(job, world_size, timeout)
    return res


def _run_job_once(job: dict, world_size: int, timeout: float) -> subprocess.CompletedProcess:
    G = ds_oracle.generate_module()
    with tempfile.TemporaryDirectory(prefix="zckpt-resume-job-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(WORKER), str(path)]
        env = G.rank_env({"TMPDIR": tmp})  # TORCH_EXTENSIONS_DIR as the caller's (DeepSpeed JIT-builds its ops)
        try:  # (the ranks without torchrun's agent: tests/ranks.py)
            proc = ds_oracle.ranks.run(cmd, env=env, timeout=timeout, cwd=str(ROOT))
        except subprocess.TimeoutExpired as e:  # (the ranks killed)
            pytest.fail(f"the job hung (> {timeout}s):\n" + (e.output or b"").decode(errors="replace")[-4000:])
        return subprocess.CompletedProcess(cmd, proc.returncode, proc.stdout.decode(errors="replace"))


def _torch_load(path):
    import torch
    return torch.load(str(path), map_location="cpu", weights_only=False)


def resume_case(fixture_dir, tmp_path, name, ws, stage=None, bf16opt=None, train_steps=2, trace=False,
                oracle_prefixes=None):
    src_fx = fixture_dir(name)
    src = _ckpt(src_fx)
    offline = tmp_path / "offline"
    reshard(str(src), str(offline), world_size=ws, stage=stage, bf16_optimizer=bf16opt)
    spec = ds_oracle.target_spec(_spec(src_fx), ws, stage, bf16opt)
    out = tmp_path / "out"
    out.mkdir()
    job = {"spec": spec, "out": str(out), "routes": ["offline", "api"], "offline": str(offline),
           "source": str(src), "oracle": True, "train_steps": train_steps, "trace": trace}
    res = run_job(job, ws)
    assert res.returncode == 0, res.stdout[-6000:]
    for r in range(ws):
        assert_same_tree(_torch_load(out / f"offline_rank{r}.pt"), _torch_load(out / f"api_rank{r}.pt"), f"rank{r}")
        info = json.loads((out / f"info_api_rank{r}.json").read_text())
        assert info["mode"] == "reshard" and info["world_size"] == ws and info["rank"] == r
    losses = json.loads((out / "losses.json").read_text())
    assert losses["api"] == losses["offline"] and len(losses["api"]) == train_steps
    skip = ("loss_scaler",) if bf16opt else ()
    assert_same_state(src_fx / "expected", out / "oracle", skip=skip, prefixes=oracle_prefixes)
    return out


CASES = [
    # fixture, M, stage, bf16_optimizer
    ("z2_bf16_ws2", 3, None, None),  # up, odd, two param groups
    ("z3_bf16_ws2", 3, None, None),  # ZeRO-3, zero.Init, sub_group_size=40
    ("bf16opt_z1_ws2", 1, None, None),  # BF16 optimizer, down to one rank
    ("z2_fp16_ws2", 3, None, None),  # fp16: dynamic loss scaler
    ("z2_bf16_ws2", 3, 3, None),  # ZeRO-2 -> ZeRO-3
    ("z3_bf16_ws4", 2, 1, None),  # ZeRO-3 at 4 -> ZeRO-1 at 2, two param groups
    ("z3_bf16_ws2_legacy", 1, 2, None),  # legacy (non-zip) source files, ZeRO-3 at 2 -> ZeRO-2 at 1
]


@pytest.mark.parametrize("name,ws,stage,bf16opt", CASES, ids=lambda v: str(v))
def test_resume_equals_offline_reshard(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    resume_case(fixture_dir, tmp_path, name, ws, stage, bf16opt)


@pytest.mark.slow
@pytest.mark.parametrize("name,ws,stage,bf16opt", [
    ("z2_fp32_ws3", 2, None, None),  # fp32, 3 -> 2
    ("z1_bf16_ws2", 3, 1, True),  # ZeRO-1 -> BF16 optimizer
    ("z2_bf16_ws2_align", 3, None, None),  # parameter_alignment
    # a zero-element trainable parameter, which DeepSpeed saves with the frozen ones (was refused: "'nothing' is
    # frozen in the checkpoint but not in the model"); 1-element parameters at a partition boundary
    ("z2_bf16_ws2_oddparams", 3, None, None),
], ids=lambda v: str(v))
def test_resume_equals_offline_reshard_wide(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    resume_case(fixture_dir, tmp_path, name, ws, stage, bf16opt)


OFFLOAD_CASES = [
    # ZeRO-Offload (offload_optimizer: {device: cpu}, DeepSpeedCPUAdam): source and target engines both offload
    ("z2_bf16_ws2_offload", 3, None, None),  # fp32 masters and moments on the CPU, 2 -> 3 ranks
    ("z2_bf16_ws2_offload", 1, 3, None),  # ... and to ZeRO-3 at one rank
    ("z2_bf16master_offload_ws2", 3, None, None),  # bf16 masters, fp32 CPU-Adam moments
    ("z2_bf16master_bf16states_offload_ws2", 1, None, None),  # bf16 masters and bf16 moments (0.19.1+)
]


@pytest.mark.slow
@pytest.mark.parametrize("name,ws,stage,bf16opt", OFFLOAD_CASES, ids=lambda v: str(v))
def test_resume_with_optimizer_offload_equals_offline_reshard(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    """Offloaded optimizer states (CPU Adam; bf16 masters and moments): every rank's engine state after the
    in-memory load is bit-identical to a plain load of ``zckpt reshard``'s output, and so are the next losses."""
    # bf16 masters with fp32 CPU-Adam moments: DeepSpeed's own load rounds the moments to bf16 (docs/layouts.md),
    # on both routes alike, so the source's moments are not what any engine holds after a load
    rounded = name == "z2_bf16master_offload_ws2"
    resume_case(fixture_dir, tmp_path, name, ws, stage, bf16opt,
                oracle_prefixes=("fp32/", "module/", "buffer/") if rounded else None)


def _overlap(reads) -> int:
    """Bytes read more than once among (path, offset, n) reads."""
    twice, by_path = 0, {}
    for path, off, n in reads:
        by_path.setdefault(path, []).append((off, off + n))
    for spans in by_path.values():
        spans.sort()
        reach = -1
        for a, b in spans:
            if a < reach:
                twice += min(b, reach) - a
            reach = max(reach, b)
    return twice


@pytest.mark.parametrize("name,ws,stage", [("z3_bf16_ws2", 1, 2), ("z2_bf16_ws2", 3, None)], ids=lambda v: str(v))
def test_resume_reads_each_source_byte_once(fixture_dir, tmp_path, name, ws, stage):
    """A ZeRO-3 bf16 source resumed at one rank with ZeRO-2 needs its fp32 masters as masters and, cast, as the bf16
    module weights a ZeRO-3 source does not store: they are read once. ``bytes_read`` counts every byte the call
    read from the source, metadata included: it equals what a trace of the process's reads at the operating-system
    boundary saw, no byte is read twice (but the few bytes of each group's 0-d Adam ``step``), and it is at most
    the source's size."""
    out = resume_case(fixture_dir, tmp_path, name, ws, stage, trace=True, train_steps=1)
    src = _ckpt(fixture_dir(name))
    tag = (src / "latest").read_text().strip()
    size = sum(p.stat().st_size for p in (src / tag).glob("*.pt"))
    latest = (src / "latest").stat().st_size  # read once to find the tag
    for r in range(ws):
        info = json.loads((out / f"info_api_rank{r}.json").read_text())
        reads = json.loads((out / f"trace_rank{r}.json").read_text())
        assert info["bytes_read"] == sum(n for _, _, n in reads) > 0, (info, len(reads))
        # each byte once, but for the optimizer's 0-d ``step`` (read by the reader to check that the groups agree,
        # then as a tensor of the optimizer state: 4-8 bytes per group)
        big = [r for r in reads if r[2] > 8]
        assert _overlap(big) == 0, [r for i, r in enumerate(big) if any(
            j != i and q[0] == r[0] and q[1] < r[1] + r[2] and r[1] < q[1] + q[2] for j, q in enumerate(big))]
        assert _overlap(reads) <= 8 * 8, _overlap(reads)
        assert info["source_bytes"] == size and info["tensor_bytes_read"] < info["bytes_read"] <= size + latest, info


def test_same_layout_loads_natively(fixture_dir, tmp_path):
    """Same world size and stage: the API is a plain engine.load_checkpoint of the source ("native"); forcing the
    in-memory route gives the same state too."""
    src_fx = fixture_dir("z2_bf16_ws2")
    spec = ds_oracle.target_spec(_spec(src_fx), 2)
    out = tmp_path / "out"
    out.mkdir()
    job = {"spec": spec, "out": str(out), "routes": ["offline", "api_native", "api"], "offline": str(_ckpt(src_fx)),
           "source": str(_ckpt(src_fx)), "force_reshard": True, "train_steps": 1}
    res = run_job(job, 2)
    assert res.returncode == 0, res.stdout[-6000:]
    for r in range(2):
        want = _torch_load(out / f"offline_rank{r}.pt")
        for route, mode in (("api_native", "native"), ("api", "reshard")):
            assert_same_tree(want, _torch_load(out / f"{route}_rank{r}.pt"), f"{route} rank{r}")
            assert json.loads((out / f"info_{route}_rank{r}.json").read_text())["mode"] == mode
    losses = json.loads((out / "losses.json").read_text())
    assert losses["api"] == losses["offline"] == losses["api_native"]


# ------------------------------------------------------------------------------------------------ failures

def _errors(out: Path, ws: int) -> list[str]:
    return [(out / f"error_rank{r}.txt").read_text() for r in range(ws)]


def test_missing_file_on_one_rank_fails_everywhere(fixture_dir, tmp_path):
    """Rank 1 sees a copy of the checkpoint without rank 1's optimizer file; rank 0 sees a complete one. Both
    raise the same one-line error naming the missing file (agreed on before any state is touched), no hang."""
    src_fx = fixture_dir("z2_bf16_ws2")
    src = _ckpt(src_fx)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tag = (src / "latest").read_text().strip()
    (broken / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    out = tmp_path / "out"
    out.mkdir()
    job = {"spec": ds_oracle.target_spec(_spec(src_fx), 3), "out": str(out), "routes": ["api"],
           "source": str(src), "rank_source": {"1": str(broken)}, "expect_error": True}
    res = run_job(job, 3, timeout=300)
    assert res.returncode == 0, res.stdout[-6000:]
    errs = _errors(out, 3)
    assert len(set(errs)) == 1, errs
    cls, msg = errs[0].split("|", 1)
    assert cls == "IncompleteCheckpoint" and "\n" not in msg, errs[0]
    assert f"{broken / tag / 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt'}: missing" in msg, msg
    assert "rank 1 of 2" in msg, msg


@pytest.mark.parametrize("ws,verify", [(1, False), (3, True)], ids=["whole-reads", "verify"])
def test_flipped_byte_in_the_source_fails_everywhere(fixture_dir, tmp_path, ws, verify):
    """One bit flipped in a fp32 master of the source: at 1 rank every entry is read whole and checked; at 3 ranks
    each reads parts of the old partitions, which ``verify=True`` reads whole. Every rank raises the same one-line
    CorruptFile naming the file and the entry, before any state is touched."""
    import zckpt
    src_fx = fixture_dir("z2_bf16_ws2")
    broken = tmp_path / "broken"
    shutil.copytree(_ckpt(src_fx), broken)
    rec = next(r for r in zckpt.open_checkpoint(str(broken)).records if r.kind == "trainable")
    piece = rec.value[0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset + piece.nbytes // 2)
        b = f.read(1)
        f.seek(piece.offset + piece.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    out = tmp_path / "out"
    out.mkdir()
    job = {"spec": ds_oracle.target_spec(_spec(src_fx), ws), "out": str(out), "routes": ["api"],
           "source": str(broken), "expect_error": True, "verify": verify}
    res = run_job(job, ws, timeout=300)
    assert res.returncode == 0, res.stdout[-6000:]
    errs = _errors(out, ws)
    assert len(set(errs)) == 1, errs
    cls, msg = errs[0].split("|", 1)
    assert cls == "CorruptFile" and "\n" not in msg and "CRC-32" in msg, errs[0]
    assert os.path.basename(piece.path) in msg and "zip entry data/" in msg, msg


def test_shape_mismatch_refused_before_loading(fixture_dir, tmp_path):
    src_fx = fixture_dir("z3_bf16_ws2")
    out = tmp_path / "out"
    out.mkdir()
    job = {"spec": ds_oracle.target_spec(_spec(src_fx), 3), "out": str(out), "routes": ["api"],
           "source": str(_ckpt(src_fx)), "model_override": {"ffn": 12}, "expect_error": True}
    res = run_job(job, 3, timeout=300)
    assert res.returncode == 0, res.stdout[-6000:]
    errs = _errors(out, 3)
    assert len(set(errs)) == 1, errs
    cls, msg = errs[0].split("|", 1)
    assert cls == "InvalidArgument" and "shape" in msg and "blocks.0.up" in msg, errs[0]


# ------------------------------------------------------------------------------------------------ Trainer

@pytest.mark.slow
def test_trainer_resumes_at_new_world_size(fixture_dir, tmp_path):
    """The committed 2-rank ZeRO-2 Trainer checkpoint, resumed at 3 ranks under ``resume_anywhere()`` and trained
    two more steps: the logged losses and the final engine state equal those of the offline route (``zckpt
    reshard`` to 3 ranks, then a plain ``resume_from_checkpoint``)."""
    src_fx = fixture_dir("trainer")
    src = _ckpt(src_fx)
    offline = tmp_path / "checkpoint-4"
    reshard(str(src), str(offline), world_size=3)
    spec = ds_oracle.target_spec(_spec(src_fx), 3)
    got = {}
    for route, path in (("offline", offline), ("api", src)):
        out = tmp_path / route
        out.mkdir()
        job = {"trainer": True, "route": route, "spec": spec, "out": str(out), "source": str(path),
               "train_steps": 2}
        res = run_job(job, 3, timeout=600)
        assert res.returncode == 0, res.stdout[-6000:]
        got[route] = json.loads((out / "oracle" / "oracle.json").read_text())
    assert got["api"]["hf_global_step"] == got["offline"]["hf_global_step"] == 6
    # log_history: the 4 steps of the saved run (from trainer_state.json), then the 2 new ones
    assert len(got["api"]["losses"]) == 6 and got["api"]["losses"] == got["offline"]["losses"]
    assert_same_state(tmp_path / "offline" / "oracle", tmp_path / "api" / "oracle")


# ------------------------------------------------------------------------------------------------ no DeepSpeed job

@pytest.mark.parametrize("name,ws,stage", [("z2_bf16_ws2", 3, None), ("z3_fp16_ws2", 3, 2), ("z1_fp32_ws3", 2, 3),
                                           ("bf16opt_z1_ws2", 4, None)], ids=lambda v: str(v))
def test_in_memory_objects_equal_written_files(fixture_dir, tmp_path, name, ws, stage):
    """What each rank hands DeepSpeed equals ``torch.load`` of the file ``zckpt reshard`` writes for it."""
    from zckpt import open_checkpoint
    from zckpt.ops.resume import Materializer
    from zckpt.ops.reshard import plan_ranks
    src = _ckpt(fixture_dir(name))
    res = reshard(str(src), str(tmp_path / "o"), world_size=ws, stage=stage)
    ckpt = open_checkpoint(str(src))
    for rank in range(ws):
        plan = plan_ranks(ckpt, ws, [rank], stage)
        mat = Materializer()
        try:
            for f in plan.files:
                written = tmp_path / "o" / f.relpath
                assert written.exists(), f.relpath
                assert_same_tree(_torch_load(written), mat.load(f.obj), f.relpath)
        finally:
            mat.close()
        names = {os.path.basename(f.relpath) for f in plan.files}
        assert any(f"zero_pp_rank_{rank}_" in n and "optim" in n for n in names), names
    assert res.plan.world_size == ws


def test_agree_without_distributed_raises_own_error():
    from zckpt.ops.resume import agree
    from zckpt.errors import CorruptFile
    agree(None)
    with pytest.raises(CorruptFile):
        agree(CorruptFile("bad", path="x"))


@pytest.mark.s3
def test_in_memory_objects_from_a_url(fixture_dir, s3_server):
    """A source behind an S3 URL (ranged reads) gives each rank the same objects as the local source."""
    import uuid
    from zckpt import open_checkpoint
    from zckpt.ops.resume import Materializer
    from zckpt.ops.reshard import plan_ranks
    src = _ckpt(fixture_dir("z3_bf16_ws2"))
    prefix = f"resume-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    for p in src.rglob("*"):
        if p.is_file() and "expected" not in p.parts:
            client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{p.relative_to(src)}", Body=p.read_bytes())
    with s3_server.environ():
        local, remote = open_checkpoint(str(src)), open_checkpoint(s3_server.url(prefix))
        for rank in range(3):
            a, b = plan_ranks(local, 3, [rank], 2), plan_ranks(remote, 3, [rank], 2)
            ma, mb = Materializer(), Materializer()
            try:
                for fa, fb in zip(a.files, b.files):
                    assert fa.relpath == fb.relpath
                    assert_same_tree(ma.load(fa.obj), mb.load(fb.obj), fa.relpath)
            finally:
                ma.close()
                mb.close()
            assert ma.bytes_read == mb.bytes_read > 0


@pytest.mark.slow
def test_accelerate_load_state_at_new_world_size(tmp_path):
    """Accelerate + DeepSpeed ZeRO-2: ``save_state`` at 2 ranks, ``load_state`` at 3 under ``resume_anywhere()``;
    DeepSpeed's view of the loaded state (fp32 masters, moments, weights, buffers) equals the saved one."""
    G = ds_oracle.generate_module()
    spec = G.make_spec(stage=2, dtype="bf16", world_size=2, scheduler=False, param_groups=2, client_state={})
    for phase, ws in (("save", 2), ("load", 3)):
        job = {"accelerate": True, "phase": phase, "spec": dict(spec, world_size=ws), "out": str(tmp_path)}
        res = run_job(job, ws, timeout=600)
        assert res.returncode == 0, res.stdout[-6000:]
    assert_same_state(tmp_path / "expected", tmp_path / "oracle", prefixes=("fp32/", "exp_avg/", "exp_avg_sq/",
                                                                             "module/", "buffer/"))


def test_patch_passes_storage_options_and_restores_the_previous_patch(monkeypatch):
    """``resume_anywhere(storage_options=...)`` hands its options to every patched ``engine.load_checkpoint``;
    on leaving, the patch in place before it (here a plain ``patch_deepspeed()``) is back, then nothing is."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine

    import zckpt.ops.resume as R
    from zckpt.integrations import resume_anywhere

    calls = []
    monkeypatch.setattr(R, "load_checkpoint", lambda engine, path, tag=None, **kw: calls.append((path, kw)))
    original = DeepSpeedEngine.load_checkpoint
    R.patch_deepspeed()
    try:
        outer = DeepSpeedEngine.load_checkpoint
        with resume_anywhere(storage_options={"endpoint_url": "http://127.0.0.1:1"}):
            DeepSpeedEngine.load_checkpoint(object(), "s3://bucket/run")
        DeepSpeedEngine.load_checkpoint(object(), "local")
        assert DeepSpeedEngine.load_checkpoint is outer
    finally:
        R.unpatch_deepspeed()
    assert DeepSpeedEngine.load_checkpoint is original
    assert [(p, kw["storage_options"]) for p, kw in calls] == [
        ("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:1"}), ("local", None)]
