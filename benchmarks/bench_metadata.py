#!/usr/bin/env python
"""Metadata at scale: zckpt's safe open of large checkpoint metadata against a plain ``pickle.load`` of it.

Cases (files generated in a temporary folder; ``--keep DIR`` keeps them there):

``dcp-N``     a DCP ``.metadata`` of N chunks, genuine shape: torch's own dataclasses (``Metadata``,
              ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``), each of
              N / R tensors cut on dim 0 into R chunks (one per rank, R = ``--dcp-ranks``), every chunk and storage
              entry distinct (its own offsets, file and byte offset), ``planner_data`` and two param-group values;
              pickled as ``FileSystemWriter.finish`` does (``pickle.dump``). zckpt: ``dcpmeta.read_metadata`` with
              every data file's size (the open's metadata step: unpickle, check every chunk, run and storage entry).
              plain: ``pickle.load`` of the file (torch imported, its classes built).
``dcp-info-N`` a DCP folder of N chunks over ``--info-files`` ``.distcp`` files, every item a real ``torch.save`` zip
              (FSDP2's layout: each parameter's value and both moments cut on dim 0, one chunk per rank and file;
              a step per parameter and one param group in rank 0's file; metadata as in ``dcp-N``). zckpt:
              ``zckpt.ops.info.info`` of the folder (what ``zckpt info`` does). plain: ``pickle.load`` of its
              ``.metadata``.
``ds-z3-W``   a DeepSpeed ZeRO-3 tag folder of W ranks (2 files each: model states, optimizer states; ``torch.save``
              of the dicts DeepSpeed 0.19 writes, with its real ``LossScaler`` / ``ZeroStageEnum`` objects, for a
              model of ``--ds-params`` parameters in ``--ds-subgroups`` sub-groups; tensor payloads of a few
              elements). zckpt: ``open_checkpoint`` of the folder (discover, every file's zip directory and pickle,
              the ZeRO-3 checks). plain: the sum over files of ``pickle.load`` of its ``data.pkl`` (torch's classes,
              storages answered by empty storages of the stated size, as ``torch.load`` would build them).
``megatron-info-N`` a Megatron-Core ``torch_dist`` save of about N chunks and objects (``gen_megatron``: a dense GPT,
              stacked layers, tensor x pipeline parallel ranks, fully_reshardable optimizer state, every item a real
              torch zip; common.pt and metadata.json a real Megatron-LM save's with its sizes set). zckpt:
              ``zckpt.ops.info.info`` of the iteration folder. plain: ``pickle.load`` of its ``.metadata``.
``hostile-*`` crafted ``.metadata``: 10**7 references to one chunk; a list of 10**7 distinct chunk objects sharing
              one state; planner data holding a 1000**3-path shared container; ``list(big)`` called 10**5 times
              on one memo'd 10**4-element list. zckpt only (a plain ``pickle.load`` of some of them does not end).

Every measurement runs in a fresh interpreter: wall seconds of the step, and its peak RSS growth (``ru_maxrss``
after minus before). Prints a table; ``--json-out`` keeps the numbers.

    python benchmarks/bench_metadata.py --chunks 10000,100000,1000000 --ds-world-sizes 512 --hostile
    python benchmarks/bench_metadata.py --chunks 10000 --ds-world-sizes 8                     # a smoke test
    python benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --info-chunks 100000  # info, real items
    python benchmarks/bench_metadata.py --chunks 100000 --zckpt-root /tmp/old   # another tree's zckpt (before)
    python benchmarks/bench_metadata.py --chunks '' --ds-world-sizes 64,512 --ds-info  # ZeRO-3 open and info
    python benchmarks/bench_metadata.py --chunks '' --ds-world-sizes '' --megatron-chunks 100000,1000000  # Megatron
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ generating

def gen_dcp(out: Path, chunks: int, ranks: int) -> Path:
    import pickle
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    out.mkdir(parents=True, exist_ok=True)
    rows, cols = 4, 64
    sdm, sd, planner, at = {}, {}, {}, [0] * ranks
    nkeys = max(1, chunks // ranks)
    item = rows * cols * 4 + 1100  # a torch.save zip of one chunk: payload and its zip headers
    for k in range(nkeys):
        layer, kind = divmod(k, 3)
        key = (f"model.layers.{layer}.{('attn.qkv', 'mlp.up', 'mlp.down')[kind]}.weight" if k % 2 == 0 else
               f"optim.state.layers.{layer}.{('attn.qkv', 'mlp.up', 'mlp.down')[kind]}.weight.exp_avg")
        cl = []
        for r in range(ranks):
            offs = torch.Size([r * rows, 0])
            cl.append(ChunkStorageMetadata(offsets=offs, sizes=torch.Size([rows, cols])))
            sd[MetadataIndex(key, torch.Size([r * rows, 0]))] = _StorageInfo(f"__{r}_0.distcp", at[r], item)
            at[r] += item
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([ranks * rows, cols]), cl)
        planner[key] = tuple(key.split("."))
    for i in range(2):
        key = f"optim.param_groups.{i}.lr"
        sdm[key] = BytesStorageMetadata()
        sd[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", at[0], 900)
        at[0] += 900
        planner[key] = ("optim", "param_groups", str(i), "lr")
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=sd)
    with open(out / ".metadata", "wb") as f:
        pickle.dump(md, f)  # FileSystemWriter.finish
    sizes = {f"__{r}_0.distcp": at[r] for r in range(ranks)}
    (out / "sizes.json").write_text(json.dumps(sizes))
    return out / ".metadata"


def gen_dcp_files(out: Path, chunks: int, ranks: int) -> Path:
    """A DCP folder as FSDP2 + AdamW's ``dcp.save`` lays it out, every item a real ``torch.save`` zip in its
    ``.distcp`` file: P parameters (model, exp_avg, exp_avg_sq, each cut on dim 0 into one chunk per rank, a rank's
    chunks in its own file) with one step each (rank 0's file) and one param group; P = chunks / (3 ranks)."""
    import io
    import pickle
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    if (out / ".metadata").exists():  # made by an earlier run (--keep): the same folder
        return out / ".metadata"
    out.mkdir(parents=True, exist_ok=True)
    rows, cols = 4, 64
    nparams = max(1, chunks // (3 * ranks))
    files = [open(out / f"__{r}_0.distcp", "wb") for r in range(ranks)]
    sdm, sd, planner = {}, {}, {}

    def item(r: int, obj) -> tuple[int, int]:
        buf = io.BytesIO()
        torch.save(obj, buf)
        at = files[r].tell()
        files[r].write(buf.getvalue())
        return at, len(buf.getvalue())

    fqns = [f"layers.{i // 9}.p{i % 9}.weight" for i in range(nparams)]
    for n, fqn in enumerate(fqns):
        for key in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            cl = []
            for r in range(ranks):
                offs = torch.Size([r * rows, 0])
                cl.append(ChunkStorageMetadata(offsets=offs, sizes=torch.Size([rows, cols])))
                sd[MetadataIndex(key, offs)] = _StorageInfo(f"__{r}_0.distcp",
                                                            *item(r, torch.full((rows, cols), float(n + r))))
            sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([ranks * rows, cols]),
                                             cl)
            planner[key] = ("model", fqn) if key.startswith("model.") else ("optim", "state", fqn,
                                                                              key.rsplit(".", 1)[1])
        key = f"optim.state.{fqn}.step"
        sd[MetadataIndex(key, torch.Size([]))] = _StorageInfo("__0_0.distcp", *item(0, torch.tensor(1.0)))
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]),
                                         [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))])
        planner[key] = ("optim", "state", fqn, "step")
    for k, v in {"lr": 1e-3, "params": fqns}.items():
        key = f"optim.param_groups.0.{k}"
        sdm[key] = BytesStorageMetadata()
        sd[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", *item(0, v))  # a torch.save of the value, as DCP
        planner[key] = ("optim", "param_groups", "0", k)
    for f in files:
        f.close()
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=sd)
    with open(out / ".metadata", "wb") as f:
        pickle.dump(md, f)  # FileSystemWriter.finish
    return out / ".metadata"


def gen_hostile(out: Path) -> dict[str, Path]:
    import pickle
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    out.mkdir(parents=True, exist_ok=True)
    files = {}

    def md(chunks, planner=None):
        key = "model.w"
        sd = {MetadataIndex(key, torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 10)}
        t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)
        return Metadata(state_dict_metadata={key: t}, planner_data=planner or {key: ("model", "w")}, storage_data=sd)

    one = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))
    files["identical-chunks-1e7"] = md([one] * 10 ** 7)
    shared = {"offsets": torch.Size([0, 0]), "sizes": torch.Size([4, 3])}

    def twin():  # a real chunk whose __dict__ is one shared dict: pickled as NEWOBJ, BUILD <memo GET>
        c = ChunkStorageMetadata.__new__(ChunkStorageMetadata)
        object.__setattr__(c, "__dict__", shared)
        return c
    files["shared-state-chunks-1e7"] = md([twin() for _ in range(10 ** 7)])
    a = ["x"] * 1000
    b = [a] * 1000
    c = [b] * 1000
    files["shared-container-1e9-paths"] = md([one], {"model.w": ("model", "w"), "extra": c})
    big = list(range(10 ** 4))

    class Copy:
        def __reduce__(self):
            return (list, (big,))
    files["list-copies-1e9-elements"] = md([one], {"model.w": ("model", "w"), "extra": [Copy() for _ in range(10 ** 5)]})
    paths = {}
    for name, obj in files.items():
        paths[name] = out / f"{name}.metadata"
        with open(paths[name], "wb") as f:
            pickle.dump(obj, f)
    return paths


def gen_ds_z3(out: Path, world: int, nparams: int, nsub: int) -> Path:
    """A ZeRO-3 tag folder of ``world`` ranks, built from DeepSpeed's own objects (as in fixtures/z3_*)."""
    import math
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    tag = out / "global_step1"
    tag.mkdir(parents=True, exist_ok=True)
    (out / "latest").write_text("global_step1")
    shapes = [(64, 64) if i % 3 else (64,) for i in range(nparams)]
    names = [f"layers.{i // 9}.p{i % 9}.weight" for i in range(nparams)]
    per = math.ceil(nparams / nsub)
    groups = [list(range(s * per, min(nparams, (s + 1) * per))) for s in range(nsub)]
    param_shapes = [{names[i]: torch.Size(shapes[i]) for i in g} for g in groups]
    flat = [sum(math.ceil(math.prod(shapes[i]) / world) for i in g) for g in groups]
    hp = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
          "foreach": None, "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    for r in range(world):
        module = {n: torch.empty(0, dtype=torch.bfloat16) for n in names}
        ms = {"module": module, "buffer_names": [], "optimizer": None, "param_shapes": param_shapes,
              "frozen_param_shapes": {}, "shared_params": {}, "frozen_param_fragments": {},
              "lr_scheduler": {"last_batch_iteration": 0}, "data_sampler": None, "random_ltd": None,
              "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 1, "global_samples": 1,
              "dp_world_size": world, "mp_world_size": 1, "ds_config": config, "ds_version": "0.19.8"}
        torch.save(ms, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        state = {s: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(flat[s]), "exp_avg_sq": torch.zeros(flat[s])}
                 for s in range(nsub)}
        osd = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False,
               "overflow": False, "partition_count": world,
               "optimizer_state_dict": {"state": state, "param_groups": [dict(hp, params=list(range(nsub)))]},
               "fp32_flat_groups": [torch.zeros(flat[s]) for s in range(nsub)]}
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return tag


# ------------------------------------------------------------------------------------------ measuring

MEGATRON_TEMPLATE = ROOT / "fixtures" / "megatron" / "lm16_tp1_pp2_dp2_fullyresh"  # a real Megatron-LM 0.16 save


def gen_megatron(out: Path, chunks: int, tp: int, pp: int, hidden: int = 16) -> Path:
    """A Megatron-Core ``torch_dist`` iteration folder as Megatron-LM saves a dense GPT with the
    ``fully_reshardable`` distributed optimizer at tensor-parallel ``tp`` and pipeline-parallel ``pp`` (one
    ``__<rank>_0.distcp`` per rank), every item a real ``torch.save`` zip in its file: the stacked layer keys
    (``decoder.layers.<...>`` with a leading layer axis) cut per layer and over the tensor-parallel ranks, as
    megatron-core chunks them; their fp32 masters and both moments (``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``)
    chunked alike; one ``_extra_state`` object per layer and linear module (the local spec's ``[None]``), one
    ``rng_state`` object per rank (the template's bytes). ``common.pt`` and ``metadata.json`` are the template's
    (:data:`MEGATRON_TEMPLATE`, a real Megatron-LM save) with the args' sizes set to this model's; the layers are
    as many as ``chunks`` asks (16 tp + 8 chunks and 4 objects per layer: at tp 8, 140); ``hidden`` sets the sizes
    (8 heads, ffn 2 hidden, vocab 256). A row-parallel weight's chunk (``linear_proj``, ``linear_fc2``: cut on its
    last dim) is one contiguous run per row of the tensor: zckpt keeps a piece per run, so ``hidden`` sets how many
    pieces a layer has. Items of one dtype and size repeat one ``torch.save`` zip (the open reads one per layout)."""
    import glob
    import io
    import pickle
    import shutil
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    it = out / "iter_0000001"
    if (it / ".metadata").exists():  # made by an earlier run (--keep): the same folder
        return it / ".metadata"
    it.mkdir(parents=True, exist_ok=True)
    tmpl = Path(glob.glob(str(MEGATRON_TEMPLATE / "iter_*"))[0])
    heads, ffn, vocab = 8, 2 * hidden, 256
    kv = hidden // heads
    per_layer = 16 * tp + 8 + 4
    layers = max(pp, (chunks // per_layer) // pp * pp)
    files = [open(it / f"__{r}_0.distcp", "wb") for r in range(tp * pp)]
    sdm, sd, zips = {}, {}, {}

    def item(rank: int, data: bytes) -> _StorageInfo:
        at = files[rank].tell()
        files[rank].write(data)
        return _StorageInfo(f"__{rank}_0.distcp", at, len(data))

    def zip_of(dtype, sizes) -> bytes:
        z = zips.get((dtype, sizes))
        if z is None:
            buf = io.BytesIO()
            torch.save(torch.ones(sizes, dtype=dtype), buf)
            z = zips[(dtype, sizes)] = buf.getvalue()
        return z

    def tensor(key, dtype, shape, cut):  # cut: [(offsets, sizes, rank)]
        cl = []
        for offs, sizes, rank in cut:
            offs, sizes = torch.Size(offs), torch.Size(sizes)
            cl.append(ChunkStorageMetadata(offsets=offs, sizes=sizes))
            sd[MetadataIndex(key, offs)] = item(rank, zip_of(dtype, tuple(sizes)))
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), cl)

    stage = lambda l: l * pp // layers  # noqa: E731  (the pipeline stage of layer l)
    # (key, shape of one layer, the dim cut over tensor-parallel ranks or None)
    layer_keys = [("self_attention.linear_qkv.layer_norm_weight", (hidden,), None),
                  ("self_attention.linear_qkv.weight", ((heads + 2 * heads) * kv, hidden), 0),
                  ("self_attention.linear_proj.weight", (hidden, heads * kv), 1),
                  ("mlp.linear_fc1.layer_norm_weight", (hidden,), None),
                  ("mlp.linear_fc1.weight", (2 * ffn, hidden), 0),
                  ("mlp.linear_fc2.weight", (hidden, ffn), 1)]
    for prefix, dtype in (("", torch.bfloat16), ("optimizer.state.param.", torch.float32),
                          ("optimizer.state.exp_avg.", torch.float32), ("optimizer.state.exp_avg_sq.", torch.float32)):
        for rest, shape, dim in layer_keys:
            cut = []
            for l in range(layers):
                for r in range(tp if dim is not None else 1):
                    offs, sizes = [l] + [0] * len(shape), [1] + list(shape)
                    if dim is not None:
                        sizes[dim + 1] = shape[dim] // tp
                        offs[dim + 1] = r * sizes[dim + 1]
                    cut.append((offs, sizes, stage(l) * tp + r))
            tensor(f"{prefix}decoder.layers.{rest}", dtype, (layers,) + shape, cut)
        for key, shape, cut_dim, st in (("embedding.word_embeddings.weight", (vocab, hidden), 0, 0),
                                        ("decoder.final_layernorm.weight", (hidden,), None, pp - 1),
                                        ("output_layer.weight", (vocab, hidden), 0, pp - 1)):
            n = tp if cut_dim is not None else 1
            cut = [([r * shape[0] // n] + [0] * (len(shape) - 1), [shape[0] // n] + list(shape[1:]), st * tp + r)
                   for r in range(n)]
            tensor(prefix + key, dtype, shape, cut)
    buf = io.BytesIO()
    torch.save([None], buf)  # the local spec's extra state, as megatron-core wraps it in a ShardedObject
    extra = buf.getvalue()
    for l in range(layers):
        for mod in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            key = f"decoder.layers.{mod}._extra_state/shard_{l}_{layers}"
            sdm[key] = BytesStorageMetadata()
            sd[MetadataIndex(key)] = item(stage(l) * tp, extra)
    tmd = pickle.load(open(tmpl / ".metadata", "rb"))
    rng_key = next(k for k in tmd.storage_data if k.fqn.startswith("rng_state/"))
    si = tmd.storage_data[rng_key]
    with open(tmpl / si.relative_path, "rb") as f:
        f.seek(si.offset)
        rng = f.read(si.length)
    for p in range(pp):
        for r in range(tp):
            key = f"rng_state/shard_{p}.{r}_{pp}.{tp}"
            sdm[key] = BytesStorageMetadata()
            sd[MetadataIndex(key)] = item(p * tp + r, rng)
    for f in files:
        f.close()
    common = torch.load(tmpl / "common.pt", weights_only=False)  # the template's own objects (megatron-core's enums)
    a = common["args"]
    for k, v in dict(num_layers=layers, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     world_size=tp * pp, data_parallel_size=1, hidden_size=hidden, ffn_hidden_size=ffn,
                     num_attention_heads=heads, num_query_groups=heads, group_query_attention=False, kv_channels=kv,
                     padded_vocab_size=vocab, swiglu=True, untie_embeddings_and_output_weights=True).items():
        setattr(a, k, v)
    common["iteration"] = 1
    torch.save(common, it / "common.pt")
    shutil.copy(tmpl / "metadata.json", it / "metadata.json")
    (out / "latest_checkpointed_iteration.txt").write_text("1")
    with open(it / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=sd), f)  # FileSystemWriter.finish
    return it / ".metadata"


CHILD = r'''
import json, os, resource, sys, time
kind, path = sys.argv[1], sys.argv[2]
if kind.startswith("plain"):
    import torch, torch.distributed.checkpoint  # the classes, not timed
if kind == "plain-ds":
    import deepspeed.runtime.fp16.loss_scaler
if kind.startswith("zckpt"):
    import zckpt.encoding.dcpmeta, zckpt.state.open  # imported untimed, like torch for plain
def rss():
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f)
    return int(st["VmHWM"].split()[0]) * 1024, int(st["VmRSS"].split()[0]) * 1024
def syscr():
    with open("/proc/self/io") as f:
        return int(dict(line.split(":", 1) for line in f)["syscr"])
base, t0, c0, outcome, secs, cpu = rss()[1], time.perf_counter(), time.process_time(), "read", None, None
r0 = syscr()
try:
    if kind == "plain-dcp":
        import pickle
        with open(path, "rb") as f:
            pickle.load(f)
    elif kind == "zckpt-dcp":
        from zckpt.encoding import dcpmeta
        sizes = json.load(open(os.path.join(os.path.dirname(path), "sizes.json"))) \
            if os.path.exists(os.path.join(os.path.dirname(path), "sizes.json")) else None
        with open(path, "rb") as f:
            data = f.read()
        md = dcpmeta.read_metadata(data, path, sizes)
        outcome = f"read: {sum(len(t.chunks) for t in md.tensors.values())} chunks"
    elif kind == "zckpt-info":
        from zckpt.ops.info import info
        d = info(os.path.dirname(path))
        outcome = f"info: {d['format']}, world size {d['world_size']}"
    elif kind == "plain-ds":
        import io, pickle, zipfile, torch
        class U(pickle.Unpickler):
            def persistent_load(self, pid):
                _, cls, key, loc, numel = pid
                dtype = cls.dtype if hasattr(cls, "dtype") else cls(0).dtype
                return torch.storage.TypedStorage(numel, dtype=dtype, _internal=True)
        n, secs, cpu = 0, 0.0, 0.0
        for name in sorted(os.listdir(path)):
            with zipfile.ZipFile(os.path.join(path, name)) as z:  # the pickle's bytes, read untimed
                pkl = z.read(next(i for i in z.namelist() if i.endswith("/data.pkl")))
            t, c = time.perf_counter(), time.process_time()
            U(io.BytesIO(pkl)).load()
            secs += time.perf_counter() - t  # the sum of the loads alone
            cpu += time.process_time() - c
            n += 1
        outcome = f"{n} files"
    elif kind == "zckpt-ds":
        from zckpt.state.open import open_checkpoint
        ck = open_checkpoint(path)
        outcome = f"read: {ck.world_size} ranks, {len(ck.records)} params"
    elif kind == "zckpt-ds-info":
        from zckpt.ops.info import info
        d = info(os.path.dirname(path))
        outcome = f"info: stage {d.get('zero_stage')}, world size {d.get('dp_world_size')}"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
secs = time.perf_counter() - t0 if secs is None else secs
cpu = time.process_time() - c0 if cpu is None else cpu
print(json.dumps({"seconds": secs, "cpu": cpu, "rss_growth": rss()[0] - base, "peak_rss": rss()[0],
                  "read_calls": syscr() - r0, "outcome": outcome}))
'''


def measure(kind: str, path: Path, zckpt_root: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(zckpt_root), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    t = time.perf_counter()
    try:
        # cwd: python -c puts the working folder first on sys.path; run from this tree, it would shadow zckpt_root
        run = subprocess.run([sys.executable, "-c", CHILD, kind, str(path)], env=env, capture_output=True, text=True,
                             timeout=timeout, cwd=zckpt_root)
    except subprocess.TimeoutExpired:
        return {"seconds": time.perf_counter() - t, "rss_growth": None, "outcome": f"did not end in {timeout:.0f} s"}
    if run.returncode != 0:
        return {"seconds": None, "rss_growth": None, "outcome": f"exit {run.returncode}: {run.stderr[-300:]}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def mib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="10000,100000,1000000")
    ap.add_argument("--dcp-ranks", type=int, default=256)
    ap.add_argument("--info-chunks", default="", help="dcp-info-N cases: a DCP folder of N chunks, every item a real "
                    "torch zip in its .distcp file; zckpt info of the folder against pickle.load of its .metadata")
    ap.add_argument("--info-files", type=int, default=64, help="the dcp-info cases' .distcp files (one per rank)")
    ap.add_argument("--megatron-chunks", default="", help="megatron-info-N cases: a Megatron-Core torch_dist save of "
                    "about N chunks (gen_megatron); zckpt info of it against pickle.load of its .metadata")
    ap.add_argument("--megatron-tp", type=int, default=8)
    ap.add_argument("--megatron-pp", type=int, default=4)
    ap.add_argument("--megatron-hidden", type=int, default=16, help="hidden size (a row-parallel chunk's rows)")
    ap.add_argument("--ds-world-sizes", default="512")
    ap.add_argument("--ds-params", type=int, default=720, help="parameters of the ZeRO-3 model (80 layers x 9)")
    ap.add_argument("--ds-subgroups", type=int, default=8)
    ap.add_argument("--hostile", action="store_true")
    ap.add_argument("--ds-info", action="store_true", help="also zckpt info of each ds-z3 folder (its read syscalls)")
    ap.add_argument("--zckpt-root", type=Path, default=ROOT)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_metadata_"))
    rows = []
    for n in [int(x) for x in args.chunks.split(",") if x]:
        f = gen_dcp(work / f"dcp_{n}", n, args.dcp_ranks)
        plain = measure("plain-dcp", f, args.zckpt_root, args.timeout)
        z = measure("zckpt-dcp", f, args.zckpt_root, args.timeout)
        rows.append({"case": f"dcp-{n}", "bytes": f.stat().st_size, "plain": plain, "zckpt": z})
        _print(rows[-1])
    for n in [int(x) for x in args.info_chunks.split(",") if x]:
        f = gen_dcp_files(work / f"dcp_info_{n}", n, args.info_files)
        plain = measure("plain-dcp", f, args.zckpt_root, args.timeout)
        z = measure("zckpt-info", f, args.zckpt_root, args.timeout)
        rows.append({"case": f"dcp-info-{n}", "bytes": f.stat().st_size, "plain": plain, "zckpt": z})
        _print(rows[-1])
    for n in [int(x) for x in args.megatron_chunks.split(",") if x]:
        f = gen_megatron(work / f"megatron_{n}_tp{args.megatron_tp}_pp{args.megatron_pp}_h{args.megatron_hidden}", n,
                         args.megatron_tp, args.megatron_pp, args.megatron_hidden)
        plain = measure("plain-dcp", f, args.zckpt_root, args.timeout)
        z = measure("zckpt-info", f, args.zckpt_root, args.timeout)
        rows.append({"case": f"megatron-info-{n}", "bytes": f.stat().st_size, "plain": plain, "zckpt": z,
                     "chunks": _chunks(f), "files": len(list(f.parent.glob("*.distcp")))})
        _print(rows[-1])
    for w in [int(x) for x in args.ds_world_sizes.split(",") if x]:
        tag = gen_ds_z3(work / f"ds_z3_{w}", w, args.ds_params, args.ds_subgroups)
        size = sum(p.stat().st_size for p in tag.iterdir())
        plain = measure("plain-ds", tag, args.zckpt_root, args.timeout)
        z = measure("zckpt-ds", tag, args.zckpt_root, args.timeout)
        rows.append({"case": f"ds-z3-{w}", "bytes": size, "plain": plain, "zckpt": z})
        _print(rows[-1])
        if args.ds_info:  # zckpt info of the folder (read syscalls: what would be requests on an object store)
            z = measure("zckpt-ds-info", tag, args.zckpt_root, args.timeout)
            rows.append({"case": f"ds-z3-info-{w}", "bytes": size, "plain": plain, "zckpt": z,
                         "files": len(list(tag.iterdir()))})
            _print(rows[-1])
    if args.hostile:
        for name, f in gen_hostile(work / "hostile").items():
            z = measure("zckpt-dcp", f, args.zckpt_root, min(args.timeout, 120))
            rows.append({"case": f"hostile-{name}", "bytes": f.stat().st_size, "plain": None, "zckpt": z})
            _print(rows[-1])
    if args.json_out:
        args.json_out.write_text(json.dumps({"host": os.uname().nodename, "cpus": os.cpu_count(),
                                             "python": sys.version.split()[0], "zckpt_root": str(args.zckpt_root),
                                             "rows": rows}, indent=1))
    return 0


_HEADER = False


def _chunks(metadata: Path) -> int:
    """Tensor chunks and objects a .metadata lists (torch's classes; this process only)."""
    import pickle
    with open(metadata, "rb") as f:
        return len(pickle.load(f).storage_data)


def _print(row: dict) -> None:
    global _HEADER
    if not _HEADER:
        print(f"{'case':34} {'MB':>6} {'plain s':>8} {'zckpt s':>8} {'ratio':>6} {'plain cpu':>9} {'zckpt cpu':>9} "
              f"{'ratio':>6} {'plain dRSS':>10} {'zckpt dRSS':>10}  outcome  (s: wall; cpu: process seconds; "
              f"dRSS: MiB)")
        _HEADER = True
    p, z = row["plain"] or {}, row["zckpt"]

    def num(d, k):
        return f"{d[k]:.2f}" if d.get(k) is not None else "-"

    def ratio(k):
        return f"{z[k] / p[k]:.2f}" if p.get(k) and z.get(k) is not None else "-"
    print(f"{row['case']:34} {row['bytes'] / 1e6:6.1f} {num(p, 'seconds'):>8} {num(z, 'seconds'):>8} "
          f"{ratio('seconds'):>6} {num(p, 'cpu'):>9} {num(z, 'cpu'):>9} {ratio('cpu'):>6} "
          f"{mib(p.get('rss_growth')):>10} {mib(z.get('rss_growth')):>10}  {str(z.get('outcome'))[:100]}"
          + (f" ({z['read_calls']} read calls)" if z.get("read_calls") is not None else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
