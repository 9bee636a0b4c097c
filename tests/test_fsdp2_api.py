"""``zckpt.integrations.fsdp2``: the code docs/migrate-fsdp2.md shows, run as written under torchrun at 3 CPU ranks
(gloo) on the Trainer fixture DeepSpeed saved at 2, converted into both layouts (the Trainer's
``pytorch_model_fsdp_0/`` + ``optimizer_0/``, and one DCP folder). Every master, moment and step must equal
DeepSpeed's save-time view (``expected/oracle.*``) bit for bit, the groups and schedule the Trainer's; an optimizer
with other groups is refused before anything is loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "migrate-fsdp2.md"
TRAINER = FIXTURES / "trainer" / "checkpoint-4"

# appended to the docs' code: rank 0 writes what was loaded
DUMP = '''
from safetensors.torch import save_file as _save
_names = {id(p): n for n, p in model.named_parameters()}
_out = {}
for _n, _p in model.named_parameters():
    _out[f"param/{_n}"] = _p.detach().full_tensor().contiguous().clone()
    for _k, _v in opt.state.get(_p, {}).items():
        _out[f"{_k}/{_n}"] = (_v.full_tensor() if hasattr(_v, "full_tensor") else _v).contiguous().clone()
_groups = [{"names": [_names[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"],
            "betas": list(g["betas"]), "eps": g["eps"]} for g in opt.param_groups]
_bad = None
try:
    fsdp2.load(model, torch.optim.AdamW(model.parameters(), weight_decay=0.01), ckpt)
except Exception as _e:
    _bad = f"{type(_e).__name__}: {_e}"
if dist.get_rank() == 0:
    import json as _json, os as _os
    _save(_out, _os.environ["DUMP"] + ".safetensors")
    open(_os.environ["DUMP"] + ".json", "w").write(_json.dumps({
        "world_size": dist.get_world_size(), "groups": _groups, "scheduler": sched.state_dict()["last_epoch"],
        "last_lr": sched.get_last_lr(), "report": str(report), "counters": report.counters,
        "not_restored": report.not_restored, "refused": _bad}))
dist.barrier()
dist.destroy_process_group()
'''


def doc_snippet() -> str:
    """The python block of docs/migrate-fsdp2.md that calls fsdp2.load, exactly as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if "fsdp2.load(" in b]
    assert len(found) == 1, "docs/migrate-fsdp2.md should show one fsdp2.load example"
    return found[0]


def _torchrun(script: Path, cwd: Path, dump: Path, nproc: int = 3) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()), str(script)]
    env = G.rank_env({"DUMP": str(dump), "PYTHONPATH": str(ROOT), "TMPDIR": str(cwd)})
    proc = ds_oracle.ranks.run(cmd, env=env, cwd=str(cwd), timeout=900)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from zckpt.ops.convert import convert
    base = tmp_path_factory.mktemp("fsdp2api")
    convert(str(TRAINER), out=str(base / "fsdp2-400"))  # the docs' command: the Trainer layout
    convert(str(TRAINER), out=str(base / "ds_ckpt-dcp"), layout="dcp")
    code = doc_snippet()
    assert 'ckpt = "fsdp2-400"' in code
    out = {}
    for name in ("fsdp2-400", "ds_ckpt-dcp"):
        script = base / f"run_{name}.py"
        script.write_text(code.replace('ckpt = "fsdp2-400"', f'ckpt = "{name}"') + DUMP)
        _torchrun(script, base, base / name.replace("-", "_"))
        out[name] = base / name.replace("-", "_")
    return out


def _exact(ours, want) -> bool:
    if ours.shape != want.shape or ours.dtype != want.dtype:
        return False
    return torch.equal(ours.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2-400", "ds_ckpt-dcp"])
def test_docs_code_loads_the_trainer_fixture_bit_for_bit_at_another_world_size(loaded, layout):
    from safetensors.torch import load_file
    from zckpt.state.open import open_checkpoint
    got = load_file(str(loaded[layout]) + ".safetensors")
    info = json.loads(Path(str(loaded[layout]) + ".json").read_text())
    want = load_file(str(FIXTURES / "trainer" / "expected" / "oracle.safetensors"))
    oracle = json.loads((FIXTURES / "trainer" / "expected" / "oracle.json").read_text())
    assert info["world_size"] == 3 != oracle["world_size"]
    for n in oracle["trainable"]:
        assert _exact(got[f"param/{n}"], want[f"fp32/{n}"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert _exact(got[f"{k}/{n}"], want[f"{k}/{n}"]), (k, n)
        assert float(got[f"step/{n}"]) == float(oracle["step"]), n
    assert "param/lm_head.weight" not in got  # the tie survived: one parameter under the source name
    assert [g["names"] for g in info["groups"]] == [g["names"] for g in oracle["param_groups"]]
    source = open_checkpoint(str(TRAINER)).groups  # what DeepSpeed saved
    for g, want_g, lr, src in zip(info["groups"], oracle["param_groups"], oracle["lrs"], source):
        assert (g["lr"], g["weight_decay"]) == (lr, want_g["weight_decay"])
        assert (tuple(g["betas"]), g["eps"]) == (src.hyperparams["betas"], src.hyperparams["eps"])
    assert info["refused"].startswith("InvalidArgument: ") and "the checkpoint 2" in info["refused"]
    if layout == "fsdp2-400":
        assert info["scheduler"] == oracle["hf_lr_scheduler"]["last_epoch"]
        assert info["counters"]["global_step"] == oracle["global_steps"]
        assert "scheduler (scheduler.pt)" in info["report"]
    else:
        assert info["counters"]["global_samples"] == oracle["global_samples"] == 16
        assert info["counters"]["global_steps"] == oracle["global_steps"]


# ------------------------------------------------------------------------- one process, a plain module

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from zckpt.ops.convert import convert
    base = tmp_path_factory.mktemp("fsdp2one")
    convert(str(TRAINER), out=str(base / "tr"))
    return base / "tr"


def _hf_model():
    import transformers
    transformers.set_seed(5)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(TRAINER)),
                                                         dtype=torch.float32)


def _two_groups(model, wd=(0.01, 0.0)):
    named = dict(model.named_parameters())
    norm = [n for n in named if "norm" in n]
    return [{"params": [p for n, p in named.items() if n not in norm], "weight_decay": wd[0], "lr": 0.0,
             "betas": (0.9, 0.999), "eps": 1e-8},
            {"params": [named[n] for n in norm], "weight_decay": wd[1], "lr": 0.0, "betas": (0.9, 0.999),
             "eps": 1e-8}]


def test_param_groups_are_the_checkpoints(converted):
    from zckpt.integrations import fsdp2
    model = _hf_model()
    groups = fsdp2.param_groups(model, converted)
    oracle = json.loads((FIXTURES / "trainer" / "expected" / "oracle.json").read_text())
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in groups] == [g["names"] for g in oracle["param_groups"]]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in oracle["param_groups"]]
    assert [g["betas"] for g in groups] == [(0.9, 0.999)] * 2
    assert [g["lr"] for g in groups] == oracle["lrs"] and [g["initial_lr"] for g in groups] == [0.005] * 2


@pytest.mark.parametrize("wrong,message", [
    (lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.01), "the optimizer has 1 param group(s)"),
    (lambda m: torch.optim.AdamW(_two_groups(m, (0.0, 0.0))), "group 0 weight_decay 0.0, the checkpoint's 0.01"),
    (lambda m: torch.optim.AdamW(_two_groups(m)[::-1]), "is in optimizer group 0, the checkpoint's group 1"),
    (lambda m: torch.optim.AdamW([{**g, "betas": (0.9, 0.95)} for g in _two_groups(m)]), "betas (0.9, 0.95)"),
    (lambda m: torch.optim.AdamW([{**g, "lr": 1e-3} for g in _two_groups(m)]), "group 0 lr 0.001, the checkpoint's 0.0"),
])
def test_other_groups_are_refused_before_anything_is_loaded(converted, wrong, message):
    from zckpt.errors import InvalidArgument
    from zckpt.integrations import fsdp2
    model = _hf_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InvalidArgument) as exc:
        fsdp2.load(model, wrong(model), converted)
    assert message in exc.value.message and "\n" not in str(exc.value)
    assert "param_groups(model, path)" in exc.value.hint
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_right_groups_load_and_wrong_model_is_refused(converted):
    from zckpt.errors import InvalidArgument
    from zckpt.integrations import fsdp2
    model = _hf_model()
    opt = torch.optim.AdamW(_two_groups(model))
    report = fsdp2.load(model, opt, converted)
    assert "optimizer (2 param groups, step 4)" in report.restored
    assert report.not_restored["scheduler.pt"] == "no scheduler= passed"
    other = torch.nn.Linear(3, 3)
    with pytest.raises(InvalidArgument, match="which the model has no parameter of"):
        fsdp2.param_groups(other, converted)
    with pytest.raises(InvalidArgument, match="which the checkpoint does not"):
        fsdp2.load(other, None, converted)


def test_a_bf16_model_would_round_the_fp32_masters_and_is_refused(converted):
    import transformers
    from zckpt.errors import InvalidArgument
    from zckpt.integrations import fsdp2
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(TRAINER)))
    assert next(model.parameters()).dtype == torch.bfloat16  # the config says bf16
    with pytest.raises(InvalidArgument, match="is bfloat16, the checkpoint's float32: loading would round it"):
        fsdp2.load(model, torch.optim.AdamW(fsdp2.param_groups(model, converted)), converted)


def _save_then_load(tmp_path, save_mode: str, ckpt, load_ckpt):
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    for mode, n, where in ((save_mode, 2, ckpt), ("load", 3, load_ckpt)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(ROOT / "tests" / "fsdp2_api_worker.py"), mode, str(where), str(tmp_path / ("load" if mode == "load"
                                                                                            else "save"))]
        proc = ds_oracle.ranks.run(cmd, env=G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}),
                                   timeout=900, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]
    from safetensors.torch import load_file
    saved, got = load_file(str(tmp_path / "save.safetensors")), load_file(str(tmp_path / "load.safetensors"))
    assert sorted(saved) == sorted(got) and any(k.startswith("exp_avg_sq/") for k in saved)
    for k in saved:
        assert _exact(got[k], saved[k]), k
    s, g = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("save", "load"))
    assert (s["world_size"], g["world_size"]) == (2, 3)
    assert sorted((x["lr"], x["weight_decay"], sorted(x["names"])) for x in g["groups"]) == \
        sorted((x["lr"], x["weight_decay"], sorted(x["names"])) for x in s["groups"])
    assert g["last_epoch"] == s["last_epoch"] == 3 and g["counters"] == {"ntokens_seen": 90, "step": 3}
    assert g["refused"].startswith("InvalidArgument: ") and "weight_decay" in g["refused"]
    return g


@pytest.mark.slow
def test_torchtitans_own_checkpoint_saved_at_2_loads_at_3(tmp_path):
    """torchtitan's CheckpointManager (its OptimizersContainer, LRSchedulersContainer, a train_state) saves at 2
    CPU ranks; fsdp2.param_groups + load at 3 give every weight, moment and step back bit for bit."""
    pytest.importorskip("torchtitan.components.checkpoint")
    g = _save_then_load(tmp_path, "torchtitan", tmp_path / "base", tmp_path / "base" / "ckpt" / "step-3")
    assert "not restored: dataloader" in g["report"]


@pytest.mark.slow
def test_torchtitan_shaped_checkpoint_saved_at_2_loads_at_3(tmp_path):
    """FSDP2 at 2 ranks saves torchtitan's layout (top-level model keys, flat optimizer state, lr_scheduler
    last_epoch, train_state); the documented two calls at 3 ranks restore it bit for bit, groups and schedule
    included; one group for all parameters is refused (the norm weights and biases had no weight decay)."""
    from safetensors.torch import load_file
    sys.path.insert(0, str(ROOT / "tests"))
    import ds_oracle
    G = ds_oracle.generate_module()
    ckpt = tmp_path / "step-3"
    for mode, n in (("save", 2), ("load", 3)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(G._free_port()),
               str(ROOT / "tests" / "fsdp2_api_worker.py"), mode, str(ckpt), str(tmp_path / mode)]
        proc = ds_oracle.ranks.run(cmd, env=G.rank_env({"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}),
                                   timeout=900, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-6000:]
    saved, got = load_file(str(tmp_path / "save.safetensors")), load_file(str(tmp_path / "load.safetensors"))
    assert sorted(saved) == sorted(got) and any(k.startswith("exp_avg_sq/") for k in saved)
    for k in saved:
        assert _exact(got[k], saved[k]), k
    s, g = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("save", "load"))
    assert (s["world_size"], g["world_size"]) == (2, 3)
    assert [(x["lr"], x["weight_decay"], sorted(x["names"])) for x in g["groups"]] == \
        [(x["lr"], x["weight_decay"], sorted(x["names"])) for x in s["groups"]]
    assert g["last_epoch"] == s["last_epoch"] == 3 and g["counters"] == {"ntokens_seen": 90, "step": 3}
    assert g["refused"].startswith("InvalidArgument: ") and "weight_decay" in g["refused"]
