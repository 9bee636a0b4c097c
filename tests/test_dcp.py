"""DCP (FSDP2) as a source: the safe ``.metadata`` reader, info / verify / merge / iter_tensors / load_state_dict
against torch's own ``dcp_to_torch_save``, and DCP -> DeepSpeed loaded by real DeepSpeed.

The oracle is real: ``tests/fsdp2_job.py`` trains the fixtures' test model (tied embedding/head, a frozen Linear,
buffers, two param groups) with FSDP2 + ``torch.optim.AdamW`` on 3 CPU ranks (gloo) and saves ``dcp.save`` of
``get_state_dict``, plus the full state from ``get_state_dict(full_state_dict=True)``. One torchrun for the module.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zckpt.errors import CorruptFile, UnsafePickle, UnsupportedLayout, ZckptError

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MODEL = {"hidden": 8, "ffn": 12, "vocab": 13, "layers": 2}
BUFFERS = "scale,idx"


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def _fsdp2(out: Path, world_size: int, dtype: str):
    import torch
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), "--master-port", str(_port()),
           str(ROOT / "tests" / "fsdp2_job.py"), str(out), "2", "2", dtype]
    from tests import ranks  # (the ranks without torchrun's agent)
    proc = ranks.run(cmd, env=_env(), timeout=600, cwd=ROOT)
    log = proc.stdout.decode(errors="replace")
    abort = "terminate called without an active exception"  # torch's own job (no zckpt) died in C++ teardown
    if proc.returncode != 0 and abort in log and "Traceback" not in log.split(abort)[0]:
        print(f"_fsdp2: a rank aborted in C++ ({abort}) with no Python error; running the job once more")
        cmd[cmd.index("--master-port") + 1] = str(_port())
        proc = ranks.run(cmd, env=_env(), timeout=600, cwd=ROOT)
        log = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, log[-6000:]
    return out / "dcp", torch.load(out / "full.pt", weights_only=False)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """FSDP2 (fp32) saved at 3 ranks after 2 AdamW steps: (dcp folder, full state dict)."""
    return _fsdp2(tmp_path_factory.mktemp("fsdp2"), 3, "fp32")


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- reading FSDP2

def test_records_are_fsdp2_full_state(fsdp2):
    import torch
    from zckpt.state.open import open_checkpoint
    from zckpt.encoding.tensors import load_pieces
    path, full = fsdp2
    ckpt = open_checkpoint(str(path))
    assert ckpt.format == "dcp" and ckpt.world_size == 3
    assert sorted(r.name for r in ckpt.records if r.kind == "trainable") == sorted(full["optim"]["state"])
    for rec in ckpt.records:
        assert torch.equal(load_pieces(rec.value, rec.dtype, rec.shape), full["model"][rec.name]), rec.name
        st = full["optim"]["state"].get(rec.name)
        if st is None:
            assert not rec.exp_avg
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(load_pieces(getattr(rec, key), rec.state_dtype, rec.shape), st[key]), (rec.name, key)
    for g, pg in zip(ckpt.groups, full["optim"]["param_groups"]):
        assert g.names == pg["params"] and g.step == 2
        assert {k: v for k, v in g.hyperparams.items() if k != "params"} == {k: v for k, v in pg.items()
                                                                             if k != "params"}
    assert sorted(ckpt.extra["stateless"]) == ["frozen.weight", "head.weight", "idx", "scale"]


def test_merge_is_dcp_to_torch_save(fsdp2, tmp_path):
    """zckpt merge (streaming) gives bit for bit what torch's dcp_to_torch_save (whole model in RAM) gives."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from zckpt.ops.merge import iter_tensors, load_state_dict, merge
    path, _ = fsdp2
    dcp_to_torch_save(str(path), str(tmp_path / "torch.pt"))
    ref = torch.load(tmp_path / "torch.pt", weights_only=False)["model"]
    merge(str(path), str(tmp_path / "out"))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for name, t in iter_tensors(str(path)):
        assert torch.equal(t, ref[name]), name
    sd = load_state_dict(str(path))
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_info_and_verify(fsdp2, tmp_path):
    path, _ = fsdp2
    run = subprocess.run([PY, "-m", "zckpt", "info", str(path), "--json"], env=_env(), capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    d = json.loads(run.stdout)
    assert d["format"] == "dcp" and d["world_size"] == 3 and d["counts"]["trainable"] == 13
    assert [g["step"] for g in d["param_groups"]] == [2, 2]
    from zckpt.ops.verify import verify
    report = verify(str(path), deep=True)
    assert report.ok and report.bytes_read == sum(os.path.getsize(p) for p in path.glob("*.distcp"))
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    from zckpt.dcp.reader import open_dcp
    piece = open_dcp(str(bad)).by_name()["blocks.1.up.weight"].exp_avg[0]
    with open(piece.path, "r+b") as f:  # one flipped bit in a moment's bytes
        f.seek(piece.offset + 3)
        b = f.read(1)
        f.seek(piece.offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    assert verify(str(bad)).ok  # metadata alone cannot see it
    report = verify(str(bad), deep=True)
    assert not report.ok and "optim.state.blocks.1.up.weight.exp_avg" in report.checks[-1].detail


# ------------------------------------------------------------------------------------------- hostile metadata

@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory):
    """A real single-process dcp.save of a tiny state dict (no process group): the base for hostile edits."""
    import torch
    import torch.distributed.checkpoint as dcp
    out = tmp_path_factory.mktemp("small") / "dcp"
    sd = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3)},
          "optim": {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3),
                                    "exp_avg_sq": torch.zeros(4, 3)}},
                    "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    return out


def _edit(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    with open(dst / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file, written by torch a moment ago
    fn(md)
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return dst


def _chunk(md, key):
    return md.state_dict_metadata[key].chunks


def _storage(md, key):
    return next(k for k in md.storage_data if k.fqn == key)


HOSTILE = {
    "huge size": (lambda md: setattr(md.state_dict_metadata["model.w"], "size", __import__("torch").Size([1 << 40, 1 << 20])),
                  CorruptFile, "claims"),
    "chunk outside": (lambda md: setattr(_chunk(md, "model.w")[0], "sizes", __import__("torch").Size([5, 3])),
                      CorruptFile, "outside"),
    "overlapping chunks": (lambda md: _chunk(md, "model.w").append(_chunk(md, "model.w")[0]), CorruptFile, "overlap"),
    "not covering": (lambda md: setattr(_chunk(md, "model.w")[0], "sizes", __import__("torch").Size([3, 3])),
                     CorruptFile, "cover 9 of its 12"),
    "offset past the end": (lambda md: setattr(md.storage_data[_storage(md, "model.b")], "offset", 10 ** 9),
                            CorruptFile, "past its end"),
    "file outside the folder": (lambda md: setattr(md.storage_data[_storage(md, "model.b")], "relative_path",
                                                   "../../etc/passwd"), CorruptFile, "not a file of the checkpoint"),
    "transformed item": (lambda md: setattr(md.storage_data[_storage(md, "model.b")], "transform_descriptors",
                                            ["zstd"]), UnsupportedLayout, "transforms"),
    "no storage entry": (lambda md: md.storage_data.pop(_storage(md, "model.b")), CorruptFile, "no storage entry"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_refused(small_dcp, tmp_path, case):
    from zckpt.state.open import open_checkpoint
    fn, exc, words = HOSTILE[case]
    bad = _edit(small_dcp, tmp_path / "bad", fn)
    with pytest.raises(exc) as info:
        open_checkpoint(str(bad))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_metadata_with_other_globals_runs_nothing(small_dcp, tmp_path):
    """A .metadata naming any global off the allow-list (here os.system) is refused before it is called."""
    from zckpt.state.open import open_checkpoint
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = _edit(small_dcp, tmp_path / "bad", lambda md: setattr(md, "planner_data", Evil()))
    with pytest.raises(UnsafePickle, match="posix.system|os.system"):
        open_checkpoint(str(bad))
    assert not marker.exists()
    run = subprocess.run([PY, "-m", "zckpt", "info", str(bad)], env=_env(), capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1 and "allow-list" in run.stderr
    assert not marker.exists()


def test_small_dcp_reads_and_chunks_on_inner_dims(small_dcp, tmp_path):
    """Chunks cut on dim 1 (any rectangle DCP metadata can express) are read row by row, exactly."""
    import torch
    from zckpt.ops.merge import load_state_dict
    assert torch.equal(load_state_dict(str(small_dcp))["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
    from zckpt.encoding import dcpmeta
    te = dcpmeta.TensorEntry("x", "float32", (4, 6), [dcpmeta.Chunk((0, 0), (4, 2), "f", 0, 1),
                                                      dcpmeta.Chunk((0, 2), (4, 4), "f", 1, 1)])
    runs = dcpmeta.chunk_runs(te)
    assert [(s, c.offsets, local, n) for s, c, local, n in runs][:3] == [(0, (0, 0), 0, 2), (2, (0, 2), 0, 4),
                                                                          (6, (0, 0), 2, 2)]
    assert sum(n for *_, n in runs) == 24


def _grid_chunks(shape, cuts):
    """The chunks of a grid over ``shape`` cut at ``cuts`` (per dim, the inner cut points)."""
    import itertools
    from zckpt.encoding import dcpmeta
    edges = [[0] + sorted(c) + [n] for c, n in zip(cuts, shape)]
    out = []
    for cell in itertools.product(*[range(len(e) - 1) for e in edges]):
        offs = tuple(edges[d][i] for d, i in enumerate(cell))
        sizes = tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(cell))
        out.append(dcpmeta.Chunk(offs, sizes, f"__{len(out) % 3}_0.distcp", len(out), 1))
    return out


def test_grid_runs_equal_the_row_runs():
    """Chunks forming a grid cut on an inner dim (tensor parallelism, stacked layers) are cut into runs per range
    asked for (dcpmeta.Grid), not all kept: for random grids and ranges those runs are exactly chunk_runs' ones."""
    import random
    from zckpt.encoding import dcpmeta
    rng = random.Random(49)
    for _ in range(300):
        ndim = rng.randint(2, 4)
        shape = tuple(rng.randint(1, 7) for _ in range(ndim))
        cuts = [rng.sample(range(1, n), rng.randint(0, min(3, n - 1))) if n > 1 else [] for n in shape]
        chunks = _grid_chunks(shape, cuts)
        rng.shuffle(chunks)
        te = dcpmeta.TensorEntry("x", "float32", shape, chunks)
        want = dcpmeta.chunk_runs(te)
        dcpmeta.cut(te)
        inner = any(cuts[d] for d in range(1, ndim))
        assert (te.grid is not None) == inner and (te.runs is None) == inner, (shape, cuts)
        numel = te.numel
        assert dcpmeta.runs_in(te, 0, numel) == want
        for _ in range(5):
            a = rng.randint(0, numel - 1)
            b = rng.randint(a + 1, numel)
            assert dcpmeta.runs_in(te, a, b) == [r for r in want if r[0] < b and r[0] + r[3] > a], (shape, cuts, a, b)


def test_grid_pieces_placed_a_block_of_rows_at_a_time_equal_the_runs():
    """dcp_pieces places a grid's whole rows a block at a time (Grid.blocks), each chunk's pieces in one pass: for
    random grids, ranges and chunk layouts (one chunk saved with strides of its own) the pieces are exactly the
    ones made a run at a time."""
    import random
    from types import SimpleNamespace
    from zckpt.encoding import dcpmeta
    from zckpt.engine.segments import Piece
    from zckpt.state import model

    class Items:  # each chunk's zip: its bytes at a layout of its own; one chunk strided (a transposed view)
        def __init__(self, odd):
            self.odd = odd

        def layout(self, te, c):
            return SimpleNamespace(contiguous=c is not self.odd, data_offset=64 + 8 * c.offset, storage_offset=3)

        def path(self, file):
            return "/ck/" + file

        def tensor(self, te, c):
            return SimpleNamespace(numel=c.numel)

    def strided(t, local, n):  # stands in for pieces_of on the strided chunk: one piece per element
        return [Piece("strided", local + i, 1, "float32") for i in range(n)]

    rng = random.Random(4949)
    orig = model.pieces_of
    model.pieces_of = strided
    try:
        for case in range(300):
            ndim = rng.randint(2, 4)
            shape = tuple(rng.randint(1, 6) for _ in range(ndim))
            cuts = [rng.sample(range(1, n), rng.randint(0, min(3, n - 1))) if n > 1 else [] for n in shape]
            if not any(cuts[1:]):
                cuts[-1] = [1] if shape[-1] > 1 else cuts[-1]
            chunks = _grid_chunks(shape, cuts)
            rng.shuffle(chunks)
            te = dcpmeta.TensorEntry("x", "float32", shape, chunks)
            dcpmeta.cut(te)
            items = Items(rng.choice(chunks) if case % 4 == 0 else None)
            n = te.numel
            ranges = [(0, n)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(6)]
            for a, b in ranges:
                want = model._run_pieces(items, te, "md", a, b, {})
                assert model.dcp_pieces(items, te, "md", a, b - a, {}) == want, (shape, cuts, a, b)
                assert sum(p.numel for p in want) == b - a
    finally:
        model.pieces_of = orig


@pytest.mark.parametrize("change, words", [
    (lambda cs: cs[:-1], "cover"),  # a cell missing
    (lambda cs: cs + [cs[-1].__class__(cs[-1].offsets, cs[-1].sizes, "__9_0.distcp", 0, 1)], "overlap"),
    (lambda cs: [c if c.offsets != (0, 0) else c.__class__((0, 0), (c.sizes[0], c.sizes[1] + 1), c.file, 0, 1)
                 for c in cs], "overlap"),  # a chunk one column into its neighbour's cell
])
def test_not_a_grid_is_still_refused(change, words):
    """Chunks that are not an exact grid fall back to chunk_runs, which names the overlap or the uncovered part."""
    from zckpt.encoding import dcpmeta
    from zckpt.errors import CorruptFile
    te = dcpmeta.TensorEntry("x", "float32", (4, 6), change(_grid_chunks((4, 6), [[2], [3]])))
    with pytest.raises(CorruptFile, match=words):
        dcpmeta.cut(te)


def test_missing_metadata_is_an_incomplete_checkpoint(small_dcp, tmp_path):
    from zckpt.dcp.reader import open_dcp
    shutil.copytree(small_dcp, tmp_path / "x")
    os.remove(tmp_path / "x" / ".metadata")
    with pytest.raises(ZckptError, match="missing: DCP's .metadata"):
        open_dcp(str(tmp_path / "x"))


# ------------------------------------------------------------------------------------------- DCP -> DeepSpeed

def _oracle_spec(world_size, stage):
    from tests import ds_oracle
    G = ds_oracle.generate_module()
    return G, G.make_spec(stage=stage, dtype="fp32", world_size=world_size, param_groups=2, scheduler=False,
                          model=MODEL)


def test_to_deepspeed_refuses_what_dcp_cannot_say(fsdp2, tmp_path):
    from zckpt.ops.to_deepspeed import to_deepspeed
    path, _ = fsdp2
    G, spec = _oracle_spec(2, 2)
    # the tied head FSDP2 saved under both names: the same bytes as emb.weight, no state; never assumed
    with pytest.raises(UnsupportedLayout, match="'head.weight' has no optimizer state and the same bytes as the "
                                                "trainable 'emb.weight'") as exc:
        to_deepspeed(str(path), str(tmp_path / "a"), 2, 2, G.build_ds_config(spec), buffers=BUFFERS)
    assert "--tied head.weight=emb.weight" in exc.value.hint
    with pytest.raises(UnsupportedLayout, match="buffer or a frozen weight"):
        to_deepspeed(str(path), str(tmp_path / "a"), 2, 2, G.build_ds_config(spec), tied="head.weight=emb.weight")
    with pytest.raises(UnsupportedLayout, match="loss scaler"):
        to_deepspeed(str(path), str(tmp_path / "b"), 2, 2, dict(G.build_ds_config(spec), fp16={"enabled": True}),
                     buffers=BUFFERS, tied="head.weight=emb.weight")
    with pytest.raises(ZckptError, match="precision"):
        to_deepspeed(str(path), str(tmp_path / "c"), 2, 2, None, buffers=BUFFERS)
    with pytest.raises(ZckptError, match="disagrees"):
        to_deepspeed(str(path), str(tmp_path / "c"), 2, 2, G.build_ds_config(spec), buffers=BUFFERS, dtype="bf16")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_to_deepspeed_of_a_folder_without_a_checkpoint_says_so(tmp_path):
    """A DCP folder that lost its ``.metadata`` is no checkpoint at all, not "a DeepSpeed one" (DeepSpeed's reader
    claims what no other does); a real DeepSpeed checkpoint is pointed at reshard."""
    from zckpt.errors import CheckpointNotFound, InvalidArgument
    from zckpt.ops.to_deepspeed import to_deepspeed
    broken = tmp_path / "broken"
    shutil.copytree(ROOT / "fixtures" / "fsdp2_llama_ws2", broken)
    (broken / ".metadata").unlink()
    with pytest.raises(CheckpointNotFound, match="no checkpoint here"):
        to_deepspeed(str(broken), str(tmp_path / "a"), 2, 2, dtype="bf16")
    with pytest.raises(InvalidArgument, match="use zckpt reshard"):
        to_deepspeed(str(ROOT / "fixtures" / "z2_bf16_ws2"), str(tmp_path / "b"), 2, 2, dtype="bf16")
    assert not any((tmp_path / n).exists() for n in "ab")


@pytest.mark.slow
@pytest.mark.parametrize("world_size,stage,tied", [(4, 3, "head.weight=emb.weight"), (1, 1, "")])
def test_to_deepspeed_loaded_by_deepspeed(fsdp2, tmp_path, world_size, stage, tied):
    """FSDP2 at 3 ranks -> DeepSpeed ZeRO-``stage`` at ``world_size``: a plain engine.load_checkpoint restores
    every fp32 master, both Adam moments, buffers, frozen weights, the step and the groups' lrs bit for bit.
    The ZeRO-1 case is converted without the job's config (``dtype="fp32"``: DeepSpeed's defaults)."""
    import torch
    from safetensors.torch import load_file
    from tests import ds_oracle
    from zckpt.ops.to_deepspeed import to_deepspeed
    path, full = fsdp2
    G, spec = _oracle_spec(world_size, stage)
    out = tmp_path / "ds"
    config = G.build_ds_config(spec) if stage != 1 else None
    to_deepspeed(str(path), str(out), world_size, stage, config, buffers=BUFFERS, tied=tied,
                 dtype=None if config else "fp32")
    if tied:  # declared: written as DeepSpeed's shared_params, the alias holds no bytes of its own
        from zckpt.state.open import open_checkpoint
        assert open_checkpoint(str(out)).by_name()["head.weight"].tied_to == "emb.weight"
    info = ds_oracle.load_with_deepspeed(spec, str(out), str(tmp_path / "oracle"))
    got = load_file(tmp_path / "oracle" / "oracle.safetensors")
    for name, ref in full["model"].items():
        key = next(k for k in (f"fp32/{name}", f"buffer/{name}", f"module/{name}") if k in got)
        assert torch.equal(got[key], ref), key
    for name, st in full["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{k}/{name}"], st[k]), (k, name)
    assert info["step"] == 2.0 and info["global_steps"] == 2 and info["lrs"] == [0.01, 0.005]


@pytest.mark.slow
def test_bf16_fsdp2_to_deepspeed_zero2_odd_size(tmp_path):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16) at 2 ranks -> a bf16 DeepSpeed ZeRO-2 engine at 3:
    the fp32 masters and moments bit for bit, module weights, frozen weights and buffers = FSDP2's cast to bf16."""
    import torch
    from safetensors.torch import load_file
    from tests import ds_oracle
    from zckpt.ops.to_deepspeed import to_deepspeed
    path, full = _fsdp2(tmp_path / "src", 2, "bf16")
    G, spec = _oracle_spec(3, 2)
    spec = dict(spec, dtype="bf16")
    to_deepspeed(str(path), str(tmp_path / "ds"), 3, 2, G.build_ds_config(spec), buffers=BUFFERS, tied="")
    info = ds_oracle.load_with_deepspeed(spec, str(tmp_path / "ds"), str(tmp_path / "oracle"))
    got = load_file(tmp_path / "oracle" / "oracle.safetensors")
    for name, ref in full["model"].items():
        if f"fp32/{name}" in got:
            assert torch.equal(got[f"fp32/{name}"], ref), name
        key = f"buffer/{name}" if f"buffer/{name}" in got else f"module/{name}"
        assert torch.equal(got[key], ref.to(got[key].dtype)), key
    for name, st in full["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{k}/{name}"], st[k]), (k, name)
    assert info["step"] == 2.0 and info["lrs"] == [0.01, 0.005]


def test_cli_convert_to_deepspeed(fsdp2, tmp_path):
    """``zckpt convert --to deepspeed``: one command, DeepSpeed files zckpt reads back as the same state; what DCP
    cannot say is asked for in one line."""
    import torch
    from zckpt.state.open import open_checkpoint
    from zckpt.encoding.tensors import load_pieces
    path, full = fsdp2
    G, spec = _oracle_spec(2, 3)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(G.build_ds_config(spec)))
    base = [PY, "-m", "zckpt", "convert", str(path), "--to", "deepspeed", "--world-size", "2", "--stage", "3",
            "--ds-config", str(cfg), "-o", str(tmp_path / "out")]
    run = subprocess.run(base, env=_env(), capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1
    assert "--tied head.weight=emb.weight" in run.stderr  # the tied head: same bytes as emb.weight, no state
    run = subprocess.run(base + ["--tied", "head.weight=emb.weight"], env=_env(), capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1 and "--buffers" in run.stderr
    assert not (tmp_path / "out").exists()
    run = subprocess.run(base + ["--buffers", BUFFERS, "--tied", "head.weight=emb.weight", "--json"], env=_env(),
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["to"] == {"stage": 3, "optimizer": "zero3", "world_size": 2}
    ds = open_checkpoint(str(tmp_path / "out"))
    assert ds.stage == 3 and ds.world_size == 2 and ds.tag == "global_step2" and [g.step for g in ds.groups] == [2, 2]
    assert {r.name for r in ds.of_kind("buffer")} == {"scale", "idx"} and ds.by_name()["head.weight"].kind == "tied"
    for name, st in full["optim"]["state"].items():
        rec = ds.by_name()[name]
        assert torch.equal(load_pieces(rec.value, rec.dtype, rec.shape), full["model"][name]), name
        assert torch.equal(load_pieces(rec.exp_avg_sq, rec.state_dtype, rec.shape), st["exp_avg_sq"]), name


# ------------------------------------------------------------------------------------------- round trip

def _state(ckpt) -> dict:
    """Every tensor's bytes (value, moments) and kind, each group's names, step and Adam hyperparameters."""
    from zckpt.encoding.tensors import load_pieces
    out = {}
    for r in ckpt.records:
        if r.kind == "tied":
            out[r.name] = ("tied", r.tied_to)
            continue
        t = [load_pieces(r.value, r.dtype, r.shape)]
        if r.exp_avg:
            t += [load_pieces(getattr(r, k), r.state_dtype, r.shape) for k in ("exp_avg", "exp_avg_sq")]
        out[r.name] = (r.kind, r.dtype, [x.view(-1).view(__import__("torch").uint8).tolist() for x in t])
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = [(g.names, g.step, {k: tuple(v) if isinstance(v, list) else v for k, v in g.hyperparams.items()
                                 if k in keys}) for g in ckpt.groups]
    return {"records": out, "groups": groups}


@pytest.mark.parametrize("fixture", ["z2_bf16_ws2", "z3_fp32_ws3"])
def test_round_trip_deepspeed_dcp_deepspeed(tmp_path, fixture):
    """DeepSpeed -> DCP (zckpt convert --to dcp) -> DeepSpeed (--to deepspeed, same size and stage): every master,
    moment, frozen weight, buffer, tied alias, step and group hyperparameter identical, dtypes kept."""
    from tests.conftest import FIXTURES, checkpoint_path
    from zckpt.state.open import open_checkpoint
    from zckpt.ops.convert import convert
    src = open_checkpoint(str(checkpoint_path(FIXTURES / fixture)))
    convert(str(checkpoint_path(FIXTURES / fixture)), to="dcp", out=str(tmp_path / "dcp"))
    tied = [f"{r.name}={r.tied_to}" for r in src.of_kind("tied")]
    buffers = ",".join(r.name for r in src.of_kind("buffer"))
    convert(str(tmp_path / "dcp"), to="deepspeed", out=str(tmp_path / "ds"), world_size=src.world_size,
            stage=src.stage, ds_config=src.ds_config, buffers=buffers, tied=tied)
    back = open_checkpoint(str(tmp_path / "ds"))
    assert (back.stage, back.world_size, back.precision, back.tag) == (src.stage, src.world_size, src.precision,
                                                                       src.tag)
    a, b = _state(src), _state(back)
    assert a["groups"] == b["groups"]
    assert a["records"].keys() == b["records"].keys()
    for name in a["records"]:
        assert a["records"][name] == b["records"][name], name


def test_chunks_cut_on_an_inner_dim_match_torch(tmp_path):
    """A tensor saved as two column blocks (chunks cut on dim 1, as a Shard(1) DTensor is): zckpt reads it row by
    row and gives what torch's own DCP reader assembles."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from zckpt.ops.merge import load_state_dict
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 0.5
    src = tmp_path / "src"
    dcp.save({"model": {"a": full[:, :2].clone(), "b": full[:, 2:].clone()}}, checkpoint_id=str(src), no_dist=True)

    def join(md):  # one tensor "model.w" of size (4, 6) made of the two saved items
        a, b = md.state_dict_metadata.pop("model.a"), md.state_dict_metadata.pop("model.b")
        a.size = torch.Size([4, 6])
        a.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2])),
                    ChunkStorageMetadata(torch.Size([0, 2]), torch.Size([4, 4]))]
        md.state_dict_metadata["model.w"] = a
        sa = md.storage_data.pop(next(k for k in md.storage_data if k.fqn == "model.a"))
        sb = md.storage_data.pop(next(k for k in md.storage_data if k.fqn == "model.b"))
        md.storage_data[MetadataIndex("model.w", [0, 0])] = sa
        md.storage_data[MetadataIndex("model.w", [0, 2])] = sb
        md.planner_data = {"model.w": ("model", "w")}

    w = _edit(src, tmp_path / "w", join)
    dcp_to_torch_save(str(w), str(tmp_path / "torch.pt"))
    ref = torch.load(tmp_path / "torch.pt", weights_only=False)["model"]["w"]
    assert torch.equal(ref, full)
    assert torch.equal(load_state_dict(str(w))["w"], full)


def test_dcp_behind_an_s3_url(fsdp2, s3_server, tmp_path):
    """A DCP folder on a real S3 server (SeaweedFS on loopback): info, verify --deep and merge read it through the
    storage layer with the options given, and merge gives the bytes of the local merge."""
    import uuid
    from zckpt.ops.info import info
    from zckpt.ops.merge import merge
    from zckpt.ops.verify import verify
    path, _ = fsdp2
    prefix = f"dcp-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    for f in path.iterdir():
        client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    url, opts = s3_server.url(prefix), s3_server.storage_options()
    assert info(url, storage_options=opts)["format"] == "dcp"
    assert verify(url, deep=True, storage_options=opts).ok
    merge(url, str(tmp_path / "remote"), storage_options=opts)
    merge(str(path), str(tmp_path / "local"))
    remote, local = (tmp_path / d / "model.safetensors" for d in ("remote", "local"))
    assert remote.read_bytes() == local.read_bytes()


def test_torchtitan_style_keys(tmp_path):
    """Model keys at the top level, ``optimizer`` saved with flatten_optimizer_state_dict=True, scheduler and train
    state beside them (torchtitan's layout): the moments are found per parameter; merge gives the model; converting
    to DeepSpeed is refused in one line (the flattened form records no param groups)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from zckpt.dcp.reader import open_dcp
    from zckpt.ops.merge import load_state_dict
    from zckpt.ops.to_deepspeed import to_deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": 1}, "train_state": {"step": 1}},
             checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    ckpt = open_dcp(str(tmp_path / "tt"))
    assert [r.name for r in ckpt.records if r.exp_avg] == list(msd)
    assert {"lr_scheduler.last_epoch", "train_state.step"} <= set(ckpt.extra["other"])
    sd = load_state_dict(str(tmp_path / "tt"))
    assert sorted(sd) == sorted(msd) and all(torch.equal(sd[k], msd[k]) for k in msd)
    with pytest.raises(UnsupportedLayout, match="no optimizer param groups"):
        to_deepspeed(str(tmp_path / "tt"), str(tmp_path / "ds"), 1, 1, {"zero_optimization": {"stage": 1}}, buffers="")


def test_trainer_fsdp_checkpoint_as_source(tmp_path):
    """A Trainer / Accelerate FSDP checkpoint (pytorch_model_fsdp_0/ + optimizer_0/, SHARDED_STATE_DICT; here
    made by ``convert --to dcp --layout trainer`` from the Trainer fixture) is one checkpoint: merge gives the
    DeepSpeed checkpoint's weights and a from_pretrained folder; --to deepspeed gives its state back identical."""
    from tests.conftest import FIXTURES
    from zckpt.state.open import open_checkpoint
    from zckpt.ops.convert import convert
    from zckpt.ops.merge import merge
    from zckpt.ops.verify import verify
    src_path = FIXTURES / "trainer" / "checkpoint-4"
    src = open_checkpoint(str(src_path))
    convert(str(src_path), to="dcp", out=str(tmp_path / "fsdp"), layout="trainer")
    ckpt = open_checkpoint(str(tmp_path / "fsdp"))
    assert ckpt.format == "dcp" and {f.name for f in ckpt.files if f.kind == "metadata"} == {
        "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"}
    assert verify(str(tmp_path / "fsdp"), deep=True).ok
    merge(str(tmp_path / "fsdp"), str(tmp_path / "m-dcp"))
    merge(str(src_path), str(tmp_path / "m-ds"))
    assert (tmp_path / "m-dcp" / "config.json").exists()
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "m-dcp" / "model.safetensors"), load_file(tmp_path / "m-ds" / "model.safetensors")
    assert set(b) <= set(a) and all(a[k].equal(b[k]) for k in b)
    tied = [f"{r.name}={r.tied_to}" for r in src.of_kind("tied")]
    convert(str(tmp_path / "fsdp"), to="deepspeed", out=str(tmp_path / "ds"), world_size=src.world_size,
            stage=src.stage, ds_config=src.ds_config, buffers=",".join(r.name for r in src.of_kind("buffer")),
            tied=tied)
    from zckpt.dcp.reader import is_dcp
    assert not is_dcp(str(tmp_path / "ds")) and (tmp_path / "ds" / "trainer_state.json").exists()
    assert _state(open_checkpoint(str(tmp_path / "ds"))) == _state(src)
