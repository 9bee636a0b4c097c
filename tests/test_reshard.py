"""zckpt reshard, with DeepSpeed as the oracle.

Real checkpoints (``fixtures/generate.py``, committed under fixtures/<name>/ or generated on demand) are
resharded; DeepSpeed then loads the result at the new world size with a plain ``engine.load_checkpoint`` (no
universal flag), captures every parameter's fp32 master and Adam moments with its own ``safe_get_full_*`` API,
and saves again. We check that

* the captured state equals the source fixture's (captured the same way at save time) bit for bit, together
  with module weights, buffers, frozen weights, step, global steps, scheduler, loss scaler and client state;
* the files DeepSpeed writes when it saves that state again are the files we wrote (same keys, same tensors).

The round trip N -> M -> N reproducing the source files exactly is a hypothesis property (no DeepSpeed).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ds_oracle  # noqa: E402

from zckpt.encoding import safeload  # noqa: E402
from zckpt.errors import InvalidArgument, OutputExists  # noqa: E402

reshard_mod = __import__("importlib").import_module("zckpt.ops.reshard")
reshard = reshard_mod.reshard


# ------------------------------------------------------------------------------------------------ fixtures

def _fixture_roots():
    roots = []
    if os.environ.get("ZCKPT_FIXTURES_DIR"):
        roots.append(Path(os.environ["ZCKPT_FIXTURES_DIR"]))
    roots.append(ROOT / "fixtures")
    return roots


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """fixture_dir(name) -> folder of a generated fixture (committed, $ZCKPT_FIXTURES_DIR, or made now)."""
    made = {}

    def get(name: str) -> Path:
        for root in _fixture_roots():
            d = root / name
            if (d / "expected" / "oracle.safetensors").exists():
                return d
        if name not in made:
            G = ds_oracle.generate_module()
            d = tmp_path_factory.mktemp("fx") / name
            G.generate(name, d, expected=False)
            made[name] = d
        return made[name]

    return get


def _spec(d: Path) -> dict:
    return json.loads((d / "expected" / "spec.json").read_text())


def _ckpt(d: Path) -> Path:
    return ds_oracle.generate_module().checkpoint_dir(d)


# ------------------------------------------------------------------------------------------------ comparisons

def _load_st(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def assert_same_state(src_dir: Path, new_dir: Path, prefixes: tuple | None = None, skip: tuple = ()) -> None:
    """The oracle captured after loading our output equals the source fixture's oracle, bit for bit."""
    import torch
    want, got = _load_st(src_dir / "oracle.safetensors"), _load_st(new_dir / "oracle.safetensors")
    if prefixes:
        want = {k: v for k, v in want.items() if k.startswith(prefixes)}
    missing = sorted(set(want) - set(got))
    assert not missing, f"not restored: {missing}"
    for key, w in want.items():
        g = got[key]
        assert tuple(g.shape) == tuple(w.shape), key
        if g.dtype != w.dtype:  # e.g. a buffer saved in bf16 under zero.Init, loaded into an fp32 model
            g = g.to(w.dtype)
        assert torch.equal(g.view(-1).view(torch.uint8) if g.numel() else g,
                           w.view(-1).view(torch.uint8) if w.numel() else w), f"{key} differs"
    wi = json.loads((src_dir / "oracle.json").read_text())
    gi = json.loads((new_dir / "oracle.json").read_text())
    for k in ("step", "global_steps", "global_samples", "skipped_steps", "lr_scheduler", "loss_scaler") + \
            (("lrs",) if not prefixes else ()):
        if k in wi and k not in skip:
            assert gi.get(k) == wi[k], f"{k}: {gi.get(k)} != {wi[k]}"
    for k, v in (wi.get("client_state") or {}).items():
        assert gi["client_state"].get(k) == v, f"client_state[{k}]"


def _torch_load(path):
    import torch
    return torch.load(str(path), map_location="cpu", weights_only=False)


SKIP_KEYS = {"ds_config", "ds_version"}


def assert_same_tree(a, b, where=""):
    """Equal structures: tensors equal in dtype, shape and bytes; objects by their state."""
    import torch
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if a.dtype != b.dtype and "/module/" in where + "/" and a.is_floating_point() and b.is_floating_point():
            # a buffer keeps the dtype of the model that loads it (zero.Init makes fp32 buffers bf16): after a
            # stage change DeepSpeed re-saves it in its own model's dtype; the value must survive both ways
            assert torch.equal(a.to(b.dtype), b) and torch.equal(b.to(a.dtype), a), where
            return
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{where}: {a.dtype}{list(a.shape)} vs " \
                                                                        f"{b.dtype}{list(b.shape)}"
        if a.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        ka = [k for k in a if k not in SKIP_KEYS]
        kb = [k for k in b if k not in SKIP_KEYS]
        assert sorted(map(str, ka)) == sorted(map(str, kb)), f"{where}: keys {ka} vs {kb}"
        for k in ka:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a).__name__ == type(b).__name__, where
        assert_same_tree(vars(a), vars(b), where + "." + type(a).__name__)
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def assert_same_files(ours: Path, theirs: Path, tag: str) -> None:
    """Every file DeepSpeed writes when saving the loaded state again equals the file we wrote."""
    names = sorted(n for n in os.listdir(theirs / tag) if n.endswith(".pt"))
    assert names == sorted(os.listdir(ours / tag)), (names, sorted(os.listdir(ours / tag)))
    for n in names:
        assert_same_tree(_torch_load(ours / tag / n), _torch_load(theirs / tag / n), n)
    assert (ours / "latest").read_text() == (theirs / "latest").read_text()


def run_case(fixture_dir, tmp_path, name, world_size, stage=None, bf16_optimizer=None, resave=True):
    src = fixture_dir(name)
    spec = _spec(src)
    out = tmp_path / "out"
    res = reshard(str(_ckpt(src)), str(out), world_size=world_size, stage=stage, bf16_optimizer=bf16_optimizer)
    assert res.plan.world_size == world_size
    tspec = ds_oracle.target_spec(spec, world_size, stage, bf16_optimizer)
    again = tmp_path / "resaved" if resave else None
    ds_oracle.load_with_deepspeed(tspec, str(out), str(tmp_path / "oracle"), resave=str(again) if again else None)
    # the BF16 optimizer has no loss scaler; DeepSpeed's ZeRO optimizers hold a static one in bf16
    assert_same_state(src / "expected", tmp_path / "oracle", skip=("loss_scaler",) if bf16_optimizer else ())
    if again:
        assert_same_files(out, again, res.plan.tag)
    return res


# ------------------------------------------------------------------------------------------------ oracle matrix

CORE = [
    # fixture, M, stage, bf16_optimizer
    ("z2_bf16_ws2", 3, None, None),  # up, odd
    ("z2_bf16_ws2", 1, None, None),  # down to one rank, two param groups
    ("z3_bf16_ws2", 3, None, None),  # zero.Init, sub_group_size=40
    ("z1_bf16_ws2", 3, None, None),
    ("bf16opt_z1_ws2", 3, None, None),  # BF16 optimizer, padded fp32 partitions
    ("z2_fp32_ws3", 2, None, None),  # fp32, 3 -> 2
    ("z2_bf16_ws2", 3, 3, None),  # ZeRO-2 -> ZeRO-3
    ("z3_bf16_ws2", 3, 1, None),  # ZeRO-3 -> ZeRO-1
    ("bf16opt_z1_ws2", 1, 2, None),  # BF16 optimizer -> ZeRO-2
    ("z1_bf16_ws2", 4, 1, True),  # ZeRO-1 -> BF16 optimizer
]

WIDE = [
    ("z2_bf16_ws2_align", 3, None, None),  # parameter_alignment
    ("z2_fp16_ws2", 3, None, None),  # fp16: dynamic loss scaler
    ("z3_bf16_ws4", 2, None, None),  # two param groups, 4 -> 2
    ("z3_fp32_ws3", 2, 2, None),  # fp32 ZeRO-3 -> ZeRO-2
    ("z2_bf16_ws4", 3, 3, None),  # 4 -> 3 and to ZeRO-3
]

# master weights and moments stored in bf16, fp32 adapters on a frozen bf16 base: dtypes kept as the source has them
DTYPES = [
    ("z2_bf16master_ws2", 3, None, None),  # bf16 masters + bf16 moments, two param groups
    ("z3_bf16master_ws2", 3, None, None),
    ("z2_bf16master_ws2", 1, 3, None),  # ... across ZeRO-2 -> ZeRO-3
    ("z3_lora_ws2", 3, None, None),  # fp32 LoRA adapters, frozen bf16 base
    ("z3_lora_ws2", 1, 2, None),  # ... to ZeRO-2
]


@pytest.mark.parametrize("name,ws,stage,bf16opt", CORE, ids=lambda v: str(v))
def test_deepspeed_loads_resharded(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    run_case(fixture_dir, tmp_path, name, ws, stage, bf16opt)


@pytest.mark.slow
@pytest.mark.parametrize("name,ws,stage,bf16opt", DTYPES, ids=lambda v: str(v))
def test_deepspeed_loads_resharded_dtypes(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    run_case(fixture_dir, tmp_path, name, ws, stage, bf16opt)


def test_bf16_masters_with_fp32_cpu_adam_moments(fixture_dir, tmp_path):
    """bf16 masters + fp32 CPU-Adam moments (ZeRO-Offload). DeepSpeed 0.19.8 itself rounds the fp32 moments to
    bf16 when it loads such a checkpoint, even its own at the same world size, so the reference is DeepSpeed's
    load of the source, not the save-time state; that zckpt's files keep the exact fp32 moments is checked by
    the round trip (ROUND_TRIP) and the reader tests."""
    name = "z2_bf16master_offload_ws2"
    src = fixture_dir(name)
    spec = _spec(src)
    ds_oracle.load_with_deepspeed(ds_oracle.target_spec(spec, spec["world_size"]), str(_ckpt(src)),
                                  str(tmp_path / "native"))
    out = tmp_path / "out"
    reshard(str(_ckpt(src)), str(out), world_size=3)
    ds_oracle.load_with_deepspeed(ds_oracle.target_spec(spec, 3), str(out), str(tmp_path / "oracle"))
    assert_same_state(tmp_path / "native", tmp_path / "oracle")


@pytest.mark.parametrize("name,ws,stage,bf16opt", WIDE, ids=lambda v: str(v))
def test_deepspeed_loads_resharded_wide(fixture_dir, tmp_path, name, ws, stage, bf16opt):
    run_case(fixture_dir, tmp_path, name, ws, stage, bf16opt)


# ------------------------------------------------------------------------------------------------ Trainer

@pytest.mark.slow
def test_trainer_checkpoint_resumes_at_new_world_size(fixture_dir, tmp_path):
    """A resharded checkpoint-N stays a Trainer checkpoint: resume_from_checkpoint at 3 ranks restores it."""
    src = fixture_dir("trainer")
    ckpt = _ckpt(src)
    out = tmp_path / "checkpoint-4"
    reshard(str(ckpt), str(out), world_size=3)
    for name in os.listdir(ckpt):  # the Trainer's own files are kept (RNG: ranks < min(N, M))
        if name.startswith("rng_state") or (ckpt / name).is_dir():
            continue
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert sorted(p for p in os.listdir(out) if p.startswith("rng_state")) == ["rng_state_0.pth", "rng_state_1.pth"]
    spec = ds_oracle.target_spec(_spec(src), 3)
    info = ds_oracle.resume_trainer(spec, str(out), str(tmp_path / "oracle"))
    assert info["hf_global_step"] == 4
    assert_same_state(src / "expected", tmp_path / "oracle", prefixes=("fp32/", "exp_avg/", "exp_avg_sq/", "module/"))


def test_trainer_rng_files(fixture_dir, tmp_path):
    ckpt = _ckpt(fixture_dir("trainer"))
    reshard(str(ckpt), str(tmp_path / "one"), world_size=1)
    assert (tmp_path / "one" / "rng_state.pth").read_bytes() == (ckpt / "rng_state_0.pth").read_bytes()
    assert not any(p.startswith("rng_state_") for p in os.listdir(tmp_path / "one"))
    for name in ("trainer_state.json", "training_args.bin", "config.json", "scheduler.pt"):
        assert (tmp_path / "one" / name).exists(), name


# ------------------------------------------------------------------------------------------------ universal

UNIVERSAL = [
    ("z2_bf16_ws2", 3, None),
    ("z3_bf16_ws2", 3, None),
    ("z2_bf16_ws2", 3, 3),  # across ZeRO-2 -> ZeRO-3, which ds_to_universal cannot do
]


@pytest.mark.parametrize("name,ws,stage", UNIVERSAL, ids=lambda v: str(v))
def test_universal_output_loads(fixture_dir, tmp_path, name, ws, stage):
    """load_universal restores fp32 masters, moments and step (DeepSpeed itself skips module weights/buffers)."""
    src = fixture_dir(name)
    out = tmp_path / "u"
    res = reshard(str(_ckpt(src)), str(out), world_size=ws, stage=stage, fmt="universal")
    assert (out / "latest_universal").read_text() == f"{res.plan.tag}_universal"
    tspec = ds_oracle.target_spec(_spec(src), ws, stage)
    ds_oracle.load_with_deepspeed(tspec, str(out), str(tmp_path / "oracle"), universal=True)
    assert_same_state(src / "expected", tmp_path / "oracle", prefixes=("fp32/", "exp_avg/", "exp_avg_sq/"))


# ------------------------------------------------------------------------------------------------ round trip

PADDED_Z3 = ("fp32_flat_groups", "/exp_avg", "frozen_param_fragments")


def _lazy_tree_equal(a, b, where="", zero3=False):
    """Compare two safeload trees; tensors by bytes (read from disk).

    ZeRO-3 partitions end with ceil(n/ws)*ws - n padding elements whose content DeepSpeed leaves unspecified
    (they are not zero in real checkpoints); there only dtype and shape are compared here, and the real
    elements by :func:`assert_same_records`.
    """
    from zckpt.io import storage
    if isinstance(a, safeload.LazyTensor):
        assert isinstance(b, safeload.LazyTensor), where
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), where
        if zero3 and any(p in where for p in PADDED_Z3):
            return
        ra = storage.read_range(a.storage.path, a.byte_offset, a.nbytes) if a.numel else b""
        rb = storage.read_range(b.storage.path, b.byte_offset, b.nbytes) if b.numel else b""
        assert ra == rb, f"{where}: bytes differ"
    elif isinstance(a, dict):
        ka = [k for k in a if k not in SKIP_KEYS]
        kb = [k for k in b if k not in SKIP_KEYS]
        assert ka == kb, f"{where}: {ka} vs {kb}"
        for k in ka:
            _lazy_tree_equal(a[k], b[k], f"{where}/{k}", zero3)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _lazy_tree_equal(x, y, f"{where}[{i}]", zero3)
    elif isinstance(a, safeload.Inert):
        assert a._qualname == b._qualname, where
        state = lambda o: {k: v for k, v in vars(o).items() if not k.startswith("_")}  # noqa: E731
        _lazy_tree_equal(state(a), state(b), where)
    else:
        assert type(a) is type(b) or (isinstance(a, int) and isinstance(b, int)), f"{where}: {a!r} {b!r}"
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_records(a: Path, b: Path):
    """Every tensor of the training state (fp32 masters, moments, frozen, buffers) has the same bytes."""
    from zckpt import open_checkpoint
    from zckpt.encoding.tensors import Reader, load_pieces
    ca, cb = open_checkpoint(str(a)), open_checkpoint(str(b))
    assert [r.name for r in ca.records] == [r.name for r in cb.records]
    groups = lambda c: [(g.hyperparams, g.step, g.names) for g in c.groups]  # noqa: E731
    assert groups(ca) == groups(cb)
    with Reader() as reader:
        for ra, rb in zip(ca.records, cb.records):
            assert (ra.kind, ra.shape, ra.dtype, ra.tied_to) == (rb.kind, rb.shape, rb.dtype, rb.tied_to), ra.name
            for attr in ("value", "exp_avg", "exp_avg_sq"):
                pa, pb = getattr(ra, attr), getattr(rb, attr)
                assert bool(pa) == bool(pb), (ra.name, attr)
                if pa:
                    ta = load_pieces(pa, pa[0].dtype, ra.shape, reader)
                    tb = load_pieces(pb, pb[0].dtype, rb.shape, reader)
                    assert ta.view(-1).view(__import__("torch").uint8).equal(
                        tb.view(-1).view(__import__("torch").uint8)), (ra.name, attr)


def assert_same_checkpoint_files(a: Path, b: Path, tag: str):
    names = sorted(os.listdir(a / tag))
    assert names == sorted(os.listdir(b / tag))
    zero3 = any(n.startswith("zero_pp_rank_") and n.endswith("model_states.pt") for n in names)
    for n in names:
        _lazy_tree_equal(safeload.load(str(a / tag / n)), safeload.load(str(b / tag / n)), n, zero3)
    assert_same_records(a, b)


ROUND_TRIP = ["z2_bf16_ws2", "z3_bf16_ws2", "bf16opt_z1_ws2", "z1_bf16_ws2", "z2_fp32_ws3", "z2_bf16master_ws2",
              "z3_bf16master_ws2", "z2_bf16master_offload_ws2"]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_round_trip_reproduces_partitions(fixture_dir, tmp_path_factory, name):
    from hypothesis import given, settings, HealthCheck
    from hypothesis import strategies as st
    src = _ckpt(fixture_dir(name))
    n = _spec(fixture_dir(name))["world_size"]
    tag = (src / "latest").read_text().strip()

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(m=st.integers(min_value=1, max_value=9))
    def prop(m):
        tmp = tmp_path_factory.mktemp("rt")
        reshard(str(src), str(tmp / "m"), world_size=m)
        reshard(str(tmp / "m"), str(tmp / "back"), world_size=n)
        assert_same_checkpoint_files(src, tmp / "back", tag)
        shutil.rmtree(tmp)

    prop()


def test_round_trip_through_other_stage(fixture_dir, tmp_path):
    """ZeRO-2 at N -> ZeRO-3 at 5 -> ZeRO-2 at N gives back the same optimizer partitions."""
    src = _ckpt(fixture_dir("z2_bf16_ws2"))
    reshard(str(src), str(tmp_path / "z3"), world_size=5, stage=3)
    reshard(str(tmp_path / "z3"), str(tmp_path / "back"), world_size=2, stage=2)
    tag = (src / "latest").read_text().strip()
    assert_same_checkpoint_files(src, tmp_path / "back", tag)


# ------------------------------------------------------------------------------------------------ plan / API

def test_partition_math_matches_source(fixture_dir):
    """Planning the source's own world size reproduces its group paddings and partition sizes."""
    from zckpt import open_checkpoint
    for name in ("z2_bf16_ws2", "z2_fp32_ws3", "bf16opt_z1_ws2"):
        ck = open_checkpoint(str(_ckpt(fixture_dir(name))))
        plan = reshard_mod.plan_reshard(ck, ck.world_size)
        for r, osd in enumerate(ck.optim_states):
            pads = osd["optimizer_state_dict"]["group_paddings"]
            assert [p["paddings"][r] for p in plan.partitions] == list(pads), name


def test_dry_run_writes_nothing(fixture_dir, tmp_path):
    src = _ckpt(fixture_dir("z2_bf16_ws2"))
    res = reshard(str(src), str(tmp_path / "o"), world_size=4, stage=3, dry_run=True)
    assert not (tmp_path / "o").exists()
    js = res.to_json()
    assert js["dry_run"] and js["to"] == {"stage": 3, "optimizer": "zero3", "world_size": 4}
    assert sum(1 for f in js["files"] if "optim_states" in f["name"]) == 4
    json.dumps(js)


@pytest.mark.parametrize("name,kw", [("z2_bf16_ws2", {}), ("z3_bf16_ws2", {"stage": 2}),
                                     ("z2_bf16_ws2", {"stage": 3, "fmt": "universal"}),
                                     ("z3_bf16_ws4", {"fmt": "universal"})])
def test_each_output_file_is_pickled_once(fixture_dir, tmp_path, monkeypatch, name, kw):
    """Planning lays every torch file out once (its archive: pickle, entries, offsets, size); execute writes that
    archive and pickles nothing again, and the sizes the plan (and --dry-run) report are the files'. A file holding
    a lone tensor (universal checkpoints) copies the layout of the first of its dtype and shape: not pickled."""
    from zckpt import open_checkpoint
    from zckpt.engine import torchzip
    pickled = []
    real = torchzip.dumps
    monkeypatch.setattr(torchzip, "dumps", lambda obj: pickled.append(obj) or real(obj))
    monkeypatch.setattr(torchzip, "_LONE_TENSOR_LAYOUTS", {})
    plan = reshard_mod.plan_reshard(open_checkpoint(str(_ckpt(fixture_dir(name)))), 3, **kw)
    torch_files = [f for f in plan.files if f.kind == "torch"]
    kinds = {(f.archive.entries[0].name, f.obj.dtype, tuple(f.obj.shape)) for f in torch_files
             if type(f.obj) is torchzip.TensorOut}
    others = [id(f.obj) for f in torch_files if type(f.obj) is not torchzip.TensorOut]
    assert torch_files and [id(o) for o in pickled if type(o) is not torchzip.TensorOut] == others
    assert sum(1 for o in pickled if type(o) is torchzip.TensorOut) == len(kinds)  # one pickle per layout
    planned = len(pickled)
    reshard_mod.execute(plan, str(tmp_path / "o"))
    assert len(pickled) == planned  # nothing pickled at write time
    for f in plan.files:
        assert (tmp_path / "o" / f.relpath).stat().st_size == f.nbytes, f.relpath
        if f.kind == "torch":
            assert f.nbytes == f.archive.file_size and f.payload_bytes == f.archive.payload_bytes
    assert plan.total_bytes == sum(f.nbytes for f in plan.files)


def test_refuses_bad_targets(fixture_dir, tmp_path):
    src = _ckpt(fixture_dir("z2_bf16_ws2"))
    with pytest.raises(InvalidArgument):
        reshard(str(src), str(tmp_path / "o"), world_size=0)
    with pytest.raises(InvalidArgument):
        reshard(str(src), str(src / "inside"), world_size=3)
    with pytest.raises(InvalidArgument):
        reshard(str(src), str(tmp_path / "o"), world_size=3, stage=2, bf16_optimizer=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputExists):
        reshard(str(src), str(tmp_path / "full"), world_size=3)
    with pytest.raises(OutputExists):  # --overwrite replaces only a previous zckpt reshard output
        reshard(str(src), str(tmp_path / "full"), world_size=3, overwrite=True)
    (tmp_path / "full" / "x").unlink()
    reshard(str(src), str(tmp_path / "full"), world_size=2)
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputExists, match="holds x"):  # a file the previous output did not write is kept
        reshard(str(src), str(tmp_path / "full"), world_size=3, overwrite=True)
    assert (tmp_path / "full" / "x").read_text() == "x"
    (tmp_path / "full" / "x").unlink()
    reshard(str(src), str(tmp_path / "full"), world_size=3, overwrite=True)
    assert (tmp_path / "full" / "latest").read_text() == (src / "latest").read_text()
    assert sorted(p.name for p in (tmp_path / "full").iterdir() if p.name.startswith("global_step"))


def test_progress_callback(fixture_dir, tmp_path):
    seen = []
    res = reshard(str(_ckpt(fixture_dir("z3_bf16_ws2"))), str(tmp_path / "o"), world_size=3,
                  progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] == res.plan.total_bytes
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_optimizer_state_other_than_adam_is_never_dropped(tmp_path):
    """``fixtures/z2_bf16_ws2_sgd`` (momentum SGD: ``momentum_buffer``, no ``exp_avg``): the momentum is per element,
    so reshard (CLI and API) and a resume's per-rank plan re-partition it like Adam's moments (every rank file holds
    it, sliced like the masters; earlier zckpt wrote the checkpoint without it, exit 0, then refused it). What
    cannot carry it refuses in one line: a DCP for torch's AdamW, the universal layout. DeepSpeed loading the
    output is tests/test_outside_optimizer.py."""
    import subprocess
    import torch
    import zckpt
    from zckpt.state.open import open_checkpoint
    from zckpt.errors import UnsupportedLayout
    from zckpt.encoding.tensors import load_pieces
    from zckpt.ops.reshard import plan_ranks
    src = ROOT / "fixtures" / "z2_bf16_ws2_sgd"
    oracle = _load_st(src / "expected" / "oracle.safetensors")
    for ws in (1, 3):
        zckpt.reshard(str(src), str(tmp_path / f"o{ws}"), world_size=ws)
        ckpt = open_checkpoint(str(tmp_path / f"o{ws}"))
        assert ckpt.world_size == ws and ckpt.other_state_keys == ["momentum_buffer"]
        for rec in ckpt.of_kind("trainable"):
            got = load_pieces(rec.other_state["momentum_buffer"], "float32", rec.shape)
            assert torch.equal(got, oracle[f"momentum_buffer/{rec.name}"].reshape(rec.shape)), rec.name
    plan = plan_ranks(open_checkpoint(str(src)), 3, [0])
    optim = next(f.obj for f in plan.files if f.relpath.endswith("optim_states.pt"))
    assert all(list(st) == ["momentum_buffer"] for st in
               optim["optimizer_state_dict"]["base_optimizer_state"]["state"].values())
    proc = subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(src), "-w", "3", "-o", str(tmp_path / "c")],
                          capture_output=True, text=True, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    for call in (lambda: zckpt.reshard(str(src), str(tmp_path / "u"), world_size=3, fmt="universal"),
                 lambda: zckpt.convert(str(src), to="dcp", out=str(tmp_path / "d"))):
        with pytest.raises(UnsupportedLayout, match="momentum_buffer") as err:
            call()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "u").exists() and not (tmp_path / "d").exists()
    zckpt.merge(str(src), str(tmp_path / "m"))
    assert (tmp_path / "m").exists()
