"""Metadata at scale (issue 27 item 4): the fast pickle walk and load keep every refusal, read the fixtures into the
same objects as torch does, and refuse crafted amplification (memo references repeating one object or container)
in one line. The sizes themselves are measured by ``benchmarks/bench_metadata.py``, not timed here."""

from __future__ import annotations

import glob
import pickle
import pickletools
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from zckpt.errors import CorruptFile, UnsafePickle
from zckpt.encoding import allowlist, dcpmeta, pickles, safeload

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- the walk, against references

def _reference_scan(data, start=0, limit=None):
    """The walk as it was before the regular expression (one opcode at a time, pickletools' table): the end offset,
    or the error class and the memo slot / reason it names."""
    end, pos = len(data), start
    bound = limit if limit is not None else end - start
    top = 0
    ops = {ord(op.code): op for op in pickletools.opcodes}
    memo = {"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"}
    widths = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
              pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
    while pos < end:
        op = ops.get(data[pos])
        if op is None:
            return ("CorruptFile", "unknown")
        pos += 1
        if op.name == "STOP":
            own = limit if limit is not None else pos - start
            return ("CorruptFile", "memo") if top > own else pos
        n = op.arg.n if op.arg is not None else 0
        if n > 0:
            if pos + n > end:
                return ("Truncated", "argument")
            if op.name in memo:
                top = max(top, int.from_bytes(data[pos:pos + n], "little"))
            pos += n
        elif n == pickletools.UP_TO_NEWLINE:
            begin = pos
            for _ in range(2 if op.arg.name == "stringnl_noescape_pair" else 1):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    return ("Truncated", "text")
                pos = nl + 1
            if op.name in memo:
                text = bytes(data[begin:pos - 1])
                if not text.isdigit():
                    return ("CorruptFile", "number")
                top = max(top, int(text))
        elif n < 0:
            width, signed = widths[n]
            if pos + width > end:
                return ("Truncated", "length")
            size = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            if size < 0:
                return ("CorruptFile", "negative")
            if pos + width + size > end:
                return ("Truncated", "past")
            pos += width + size
        if top > bound:
            return ("CorruptFile", "memo")
    return ("Truncated", "stop")


def _outcome(data, start=0, limit=None):
    try:
        return pickles.scan(data, start, "f", limit=limit)
    except pickles.Truncated:
        return "Truncated"
    except CorruptFile:
        return "CorruptFile"


def _ref(data, start=0, limit=None):
    got = _reference_scan(data, start, limit)
    return got if isinstance(got, int) else got[0]


def _samples() -> list[bytes]:
    """Pickles of every protocol with short and long strings and bytes, many memo entries, text opcodes."""
    objs = [
        {"a": [1, 2.5, None, True, "x" * 300, b"y" * 300, ("t", -7, 1 << 70)], "b": {"k": "v" * 255}},
        [str(i) for i in range(3000)] + [[i] for i in range(400)],  # memo indices past 255 and 4095
        {"s": {1, 2}, "f": frozenset({3}), "ba": bytearray(b"zz"), "c": 1j, "big": "é" * 70000},
        [(i, i * 0.5, f"k{i}") for i in range(20000)],
    ]
    out = []
    for obj in objs:
        for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
            out.append(pickle.dumps(obj, protocol=proto))
    for path in sorted(glob.glob(str(ROOT / "fixtures" / "z*_ws*" / "*" / "*.pt")))[:12]:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                out.append(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))
    return out


SAMPLES = _samples()


@pytest.fixture(params=["expression", "one-by-one"])
def walk(request, monkeypatch):
    """Both walks: the regular expression (forced for small data too) and the one-opcode loop of small data."""
    monkeypatch.setattr(pickles, "REGEX_FROM", 0 if request.param == "expression" else 1 << 40)
    monkeypatch.setattr(pickles, "COMPILE_AFTER", 0)
    return request.param


def test_walk_ends_where_pickletools_ends(walk):
    for data in SAMPLES:
        last = None
        for op, _, pos in pickletools.genops(data):
            last = pos
        assert pickles.scan(data, 0, "f", limit=len(data)) == last + 1
        assert pickles.scan(data + b"trailing bytes", 0, "f") == last + 1
        two = data + data  # legacy files: pickles one after another, their lengths written nowhere
        assert pickles.scan(two, len(data), "f") == len(two)


def test_walk_refuses_what_the_old_walk_refused(walk):
    """Mutated pickles (bytes flipped, cut, inserted: forged memo indices and lengths among them) give the same end
    offset or the same error class as the one-opcode-at-a-time walk."""
    rng = random.Random(27)
    checked = 0
    for data in [d for d in SAMPLES if len(d) < 40_000]:
        for _ in range(30):
            b = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(b))
                kind = rng.random()
                if kind < 0.5:
                    b[i] = rng.randrange(256)
                elif kind < 0.8:
                    b[i:i] = bytes([rng.choice(b"qrjhpg\x94\x8cXUCBT"), *rng.randbytes(rng.randint(1, 5))])
                else:
                    del b[i:]
                    break
            b = bytes(b)
            for limit in (None, len(b)):
                assert _outcome(b, 0, limit) == _ref(b, 0, limit), (limit, b[:40])
                checked += 1
    assert checked > 500


@pytest.mark.parametrize("forged, why", [
    (b"\x80\x02r\xff\xff\xff\x7fN.", "LONG_BINPUT 2**31-1 in a 9-byte pickle"),
    (b"\x80\x02q\xc8N.", "BINPUT 200 in a 6-byte pickle"),
    (b"\x80\x02j\x00\x00\x01\x00N.", "LONG_BINGET 65536"),
    (b"p99999\nN.", "text PUT"),
])
def test_forged_memo_indices_refused(walk, forged, why):
    with pytest.raises(CorruptFile, match="memo slot"):
        pickles.scan(forged, 0, "f", limit=len(forged))
    with pytest.raises(CorruptFile, match="memo slot"):
        pickles.scan(forged, 0, "f")
    assert _ref(forged) == "CorruptFile" and _ref(forged, 0, len(forged)) == "CorruptFile", why


def test_memo_index_at_the_bound_is_read(walk):
    data = b"\x80\x02N" + b"r" + struct.pack("<I", 9) + b"."  # slot 9 in a 9-byte pickle: allowed, as before
    assert len(data) == 9 and pickles.scan(data, 0, "f", limit=len(data)) == 9 and _ref(data, 0, 9) == 9


# ------------------------------------------------------------------------ the same objects as torch builds

def _same(ours, real, where="") -> None:
    """``ours`` (safeload's) describes ``real`` (torch.load's / pickle.load's) exactly."""
    if isinstance(real, torch.Tensor):
        assert isinstance(ours, safeload.LazyTensor), where
        assert (tuple(ours.shape), tuple(ours.stride), ours.storage_offset) == \
            (tuple(real.shape), tuple(real.stride()), real.storage_offset()), where
        assert ours.dtype == str(real.dtype).removeprefix("torch."), where
    elif isinstance(real, torch.dtype):
        assert ours == str(real).removeprefix("torch."), where
    elif isinstance(real, torch.Size):
        assert type(ours) is tuple and ours == tuple(real), where
    elif isinstance(real, dict):
        assert type(ours) is type(real) and list(ours) == list(real), where
        for k in real:
            _same(ours[k], real[k], f"{where}.{k}")
    elif isinstance(real, (list, tuple)):
        assert type(ours) is type(real) and len(ours) == len(real), where
        for i, (a, b) in enumerate(zip(ours, real)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(real, int) and type(real).__module__.startswith("deepspeed"):  # ZeroStageEnum
        assert isinstance(ours, safeload.EnumValue) and int(ours) == int(real), where
    elif type(real).__module__.startswith(("deepspeed", "torch", "argparse")) and hasattr(real, "__dict__"):
        assert isinstance(ours, safeload.Inert), where
        assert type(ours).__name__ == type(real).__name__, where
        state = real.__getstate__() if type(real).__getstate__ is not object.__getstate__ else vars(real)
        if isinstance(state, dict):
            assert {k: v for k, v in vars(ours).items() if not k.startswith("_")}.keys() == state.keys(), where
            for k in state:
                _same(vars(ours)[k], state[k], f"{where}.{k}")
        else:
            _same(vars(ours)["_state"], state, f"{where}._state")
    else:
        assert type(ours) is type(real) and ours == real, where


FIXTURE_FILES = sorted(glob.glob(str(ROOT / "fixtures" / "z3_bf16_ws4" / "*" / "*.pt"))
                       + glob.glob(str(ROOT / "fixtures" / "z2_bf16_ws2" / "*" / "*.pt"))
                       + glob.glob(str(ROOT / "fixtures" / "z1_fp32_ws3_legacy" / "*" / "*.pt"))
                       + glob.glob(str(ROOT / "fixtures" / "moe_z2_bf16_ws2_ep2" / "*" / "*.pt"))[:4])


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: "/".join(Path(p).parts[-3:]))
def test_fixture_objects_are_torch_load(path):
    pytest.importorskip("deepspeed")
    real = torch.load(path, map_location="cpu", weights_only=False)
    _same(safeload.load(path), real)


def test_dcp_metadata_objects_are_torch_pickle(tmp_path):
    """A real dcp.save .metadata: the stand-ins hold what torch's own dataclasses hold; chunks read exactly."""
    import torch.distributed.checkpoint as dcp
    sd = {"model": {"w": torch.zeros(8, 6), "b": torch.ones(3)}, "optim": {"lr": 0.5}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    data = (tmp_path / "d" / ".metadata").read_bytes()
    real = pickle.loads(data)
    ours = safeload.load_plain(data, "m", dcpmeta.EXTRA_GLOBALS)
    _same(ours.state_dict_metadata["model.w"].chunks[0], real.state_dict_metadata["model.w"].chunks[0])
    def entries(storage_data):
        return [(k.fqn, getattr(k, "offset", None), v.relative_path, v.offset, v.length)
                for k, v in storage_data.items()]
    assert entries(ours.storage_data) == entries(real.storage_data)
    md = dcpmeta.read_metadata(data, "m")
    assert md.tensors["model.w"].shape == (8, 6) and md.tensors["model.w"].chunks[0].offsets == (0, 0)
    assert md.paths == real.planner_data


# ---------------------------------------------------------------------------------- crafted amplification

def _metadata(chunks, planner=None) -> bytes:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)
    sd = {MetadataIndex("model.w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 10)}
    return pickle.dumps(Metadata(state_dict_metadata={"model.w": t}, planner_data=planner or {"model.w": ("model", "w")},
                                 storage_data=sd))


def _chunk():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    return ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))


def test_one_chunk_listed_many_times_is_refused_at_the_second(monkeypatch):
    """10**6 memo references to one chunk (a few MB): refused in one line when the second is met, before the
    chunks are cut into runs (the old reader walked all of them, then found the overlap)."""
    data = _metadata([_chunk()] * 10 ** 6)
    assert len(data) < 6 * 10 ** 6
    runs = []
    monkeypatch.setattr(dcpmeta, "chunk_runs", lambda *a, **k: runs.append(1))
    with pytest.raises(CorruptFile) as info:
        dcpmeta.read_metadata(data, "/ckpt/.metadata")
    msg = str(info.value)
    assert "overlap (one chunk object listed twice)" in msg and "/ckpt/.metadata" in msg and "\n" not in msg
    assert not runs


def test_repeated_copies_refused():
    """``list(big)`` called again and again on one memo'd list (6 bytes each): refused by the copy budget."""
    big = list(range(10 ** 4))

    class Copy:
        def __reduce__(self):
            return (list, (big,))
    data = _metadata([_chunk()], {"model.w": ("model", "w"), "x": [Copy() for _ in range(10 ** 4)]})
    assert len(data) < 200_000  # 10**8 elements asked for
    with pytest.raises(CorruptFile, match="crafted pickle: it copies more than") as info:
        dcpmeta.read_metadata(data, "/ckpt/.metadata")
    assert "\n" not in str(info.value) and "/ckpt/.metadata" in str(info.value)


def test_one_state_dict_for_many_objects_refused():
    """Distinct chunk objects BUILT from one memo'd state dict (7 bytes each: 10**7 of them in 70 MB): refused by
    the load that builds them (its end checks every adopted state at once: taking a dict copies nothing), before
    anything reads them (the old reader copied the dict into each, then found the overlap)."""
    shared = {"offsets": torch.Size([0, 0]), "sizes": torch.Size([4, 3])}
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def twin():  # a real chunk whose __dict__ is the shared dict: pickled as NEWOBJ, BUILD <memo GET>
        c = ChunkStorageMetadata.__new__(ChunkStorageMetadata)
        object.__setattr__(c, "__dict__", shared)
        return c
    data = _metadata([twin() for _ in range(1000)])
    assert data.count(b"\x81") >= 1000
    with pytest.raises(CorruptFile, match="two objects built from one state") as info:
        dcpmeta.read_metadata(data, "/ckpt/.metadata")
    assert "\n" not in str(info.value) and "/ckpt/.metadata" in str(info.value)


def test_two_chunks_at_one_offset_refused_before_cutting_runs(monkeypatch):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    data = _metadata([ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))
                      for _ in range(1000)])
    monkeypatch.setattr(dcpmeta, "chunk_runs", lambda *a, **k: pytest.fail("cut into runs"))
    with pytest.raises(CorruptFile, match=r"overlap \(two start at \[0, 0\]\)"):
        dcpmeta.read_metadata(data, "m")


@pytest.mark.parametrize("call, words", [
    ((str, ([1] * 100,)), "str on a list"),
    ((torch.device, ([1, 2],)), "torch.device from"),
])
def test_text_of_containers_refused(call, words):
    class R:
        def __reduce__(self):
            return call
    data = pickle.dumps({"x": R()}, protocol=2)
    with pytest.raises(CorruptFile, match=words):
        safeload.load_plain(data, "m")


def test_shared_containers_walked_once(monkeypatch, tmp_path):
    """A torch file whose object is a chain of lists, each holding the next one twice (2**20 paths, 21 lists): the
    placeholder pass visits each object once (the old one visited every path)."""
    x: list = [torch.zeros(2)]
    for _ in range(20):
        x = [x, x]
    torch.save({"chain": x}, tmp_path / "f.pt")
    calls = []
    real = allowlist.unwrap

    def counted(obj, *a):
        calls.append(1)
        return real(obj, *a)
    monkeypatch.setattr(allowlist, "unwrap", counted)
    obj = safeload.load(str(tmp_path / "f.pt"))
    assert len(calls) < 100
    leaf = obj["chain"]
    for _ in range(20):
        assert leaf[0] is leaf[1]
        leaf = leaf[0]
    assert isinstance(leaf[0], safeload.LazyTensor) and isinstance(leaf[0].storage, safeload.StorageRef)


def test_unwrap_still_places_bare_storages(tmp_path):
    """A storage outside a tensor (beside one that uses it) still becomes a StorageRef."""
    t = torch.arange(6, dtype=torch.uint8)
    torch.save({"t": t, "s": t.untyped_storage()}, tmp_path / "f.pt")
    obj = safeload.load(str(tmp_path / "f.pt"))
    assert isinstance(obj["s"], safeload.StorageRef) and obj["s"].nbytes == 6
    assert obj["t"].storage.offset == obj["s"].offset


def test_unsafe_globals_still_refused_with_the_fast_loader():
    class Evil:
        def __reduce__(self):
            return (eval, ("1",))
    with pytest.raises(UnsafePickle, match="builtins.eval"):
        safeload.load_plain(pickle.dumps([1, Evil()]), "m", dcpmeta.EXTRA_GLOBALS)


def test_gc_left_as_found():
    import gc
    data = _metadata([_chunk()])
    assert gc.isenabled()
    dcpmeta.read_metadata(data, "m")
    assert gc.isenabled()
    gc.disable()
    try:
        dcpmeta.read_metadata(data, "m")
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(CorruptFile):
        dcpmeta.read_metadata(_metadata([_chunk()] * 3), "m")
    assert gc.isenabled()


def test_defaultdict_factories_are_the_builtins():
    """The charged wrappers of list / set / dict / str stay the builtins a defaultdict is made with."""
    import collections
    for factory in (list, set, dict, str, int):
        data = pickle.dumps({"d": collections.defaultdict(factory, {"a": factory()})}, protocol=2)
        got = safeload.load_plain(data, "m")["d"]
        assert isinstance(got, collections.defaultdict) and got.default_factory is factory and got["a"] == factory()


# ------------------------------------------------------------------------------- DCP opened in O(files) (issue 49)

def _dcp_save(out: Path, frozen: int, threads: int = 2) -> Path:
    """A real one-process ``dcp.save`` into ``threads`` .distcp files: ``frozen`` module tensors of one shape and
    two trainable ones of another with AdamW state (moments, a step each) and one param group. (Frozen tensors of a
    trainable one's shape are compared with it byte for byte at open: ``zckpt.dcp.reader.tie_candidates``.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    g = torch.Generator().manual_seed(frozen)
    model = {f"frozen.{i}.weight": torch.randn(300, 256, generator=g) for i in range(frozen)}  # 300 KB: past a block
    state = {}
    for name in ("a.weight", "b.weight"):
        model[name] = torch.randn(8, 6, generator=g)
        state[name] = {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 6, generator=g),
                       "exp_avg_sq": torch.rand(8, 6, generator=g)}
    sd = {"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["a.weight", "b.weight"]}]}}
    dcp.save(sd, storage_writer=FileSystemWriter(str(out), thread_count=threads), no_dist=True)
    return out


def test_dcp_opens_in_requests_per_file_not_per_item(s3_server, tmp_path):
    """Opening a DCP checkpoint on S3 (the local SeaweedFS server, every request counted by a proxy in front of
    it) takes the same requests for 4 or 24 module tensors in its 2 data files: a chunk's zip is read once per
    layout (dtype, chunk size, item length), not once per item; what it opens is what torch saved."""
    import uuid
    import torch.distributed.checkpoint as dcp
    from tests.faultproxy import FaultProxy
    from zckpt import load_state_dict
    from zckpt.state.open import open_checkpoint
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    try:
        opts = dict(s3_server.storage_options(), endpoint_url=proxy.endpoint)
        client, counts = s3_server.client(), {}
        for frozen in (4, 24):
            src = _dcp_save(tmp_path / f"f{frozen}", frozen)
            files = sorted(p.name for p in src.iterdir())
            assert [f for f in files if f.endswith(".distcp")] == ["__0_0.distcp", "__0_1.distcp"]
            prefix = f"o1-{uuid.uuid4().hex[:8]}"
            for name in files:
                client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}", Body=(src / name).read_bytes())
            before = len(proxy.requests)
            ckpt = open_checkpoint(s3_server.url(prefix), storage_options=opts)
            counts[frozen] = len(proxy.requests) - before
            assert ckpt.format == "dcp" and len(ckpt.records) == frozen + 2 and ckpt.groups[0].step == 3
            got = load_state_dict(ckpt)
            assert sorted(got) == sorted([f"frozen.{i}.weight" for i in range(frozen)]
                                                          + ["a.weight", "b.weight"])
            real = {k: torch.empty_like(v) for k, v in got.items()}  # torch's own load is the oracle
            dcp.load({"model": real}, checkpoint_id=str(src), no_dist=True)
            assert all(torch.equal(got[k], real[k]) for k in real)
    finally:
        proxy.stop()
    # about the same requests whatever the number of items: listing, sizes, .metadata, one item per layout, the
    # steps and param-group values fetched together where they lie within 1 MiB (distcp.GAP), never one per chunk
    assert counts[24] - counts[4] <= 2, counts  # (33 and 35 here: 24 frozen tensors of 300 KB lie between them)
    assert counts[4] <= 36, counts  # (each step and value read alone: 36; each item read at open: 58 and 238)


def _dcp_save_trainable(out: Path, params: int) -> Path:
    """A real one-process ``dcp.save`` (one .distcp file) of ``params`` trainable tensors, each with AdamW's moments
    and its own step, in two param groups of their own hyperparameters."""
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(params)
    names = [f"layers.{i}.weight" for i in range(params)]
    model = {n: torch.randn(4, 3, generator=g) for n in names}
    state = {n: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3, generator=g),
                 "exp_avg_sq": torch.rand(4, 3, generator=g)} for n in names}
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "params": names[::2]},
              {"lr": 0.2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": names[1::2]}]
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=str(out),
             no_dist=True)
    return out


def test_steps_and_group_values_read_in_requests_per_file(s3_server, tmp_path):
    """Every parameter's step and every param-group value is read at open (one step per group is checked): on S3
    (requests counted at a proxy in front of the local server) 3 and 40 trainable parameters take the same
    requests, the steps and values fetched together (:meth:`zckpt.encoding.distcp.Items.prefetch`); the steps,
    groups and records are those of the local open, and a step item whose bytes were changed is refused."""
    import uuid
    from tests.faultproxy import FaultProxy
    from zckpt.state.open import open_checkpoint
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    try:
        opts = dict(s3_server.storage_options(), endpoint_url=proxy.endpoint)
        client, counts = s3_server.client(), {}
        for params in (3, 40):
            src = _dcp_save_trainable(tmp_path / f"p{params}", params)
            prefix = f"st-{uuid.uuid4().hex[:8]}"
            for p in src.iterdir():
                client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
            before = len(proxy.requests)
            ckpt = open_checkpoint(s3_server.url(prefix), storage_options=opts)
            counts[params] = len(proxy.requests) - before
            local = open_checkpoint(str(src))
            assert [g.step for g in ckpt.groups] == [7, 7] and len(ckpt.extra["step_tensors"]) == params
            assert [(g.hyperparams["lr"], g.names) for g in ckpt.groups] == \
                [(g.hyperparams["lr"], g.names) for g in local.groups] == [(0.1, [f"layers.{i}.weight" for i in
                                                                               range(0, params, 2)]),
                                                                        (0.2, [f"layers.{i}.weight" for i in
                                                                               range(1, params, 2)])]
            assert [(r.name, r.kind, r.group) for r in ckpt.records] == [(r.name, r.kind, r.group)
                                                                         for r in local.records]
    finally:
        proxy.stop()
    assert counts[40] == counts[3], counts  # (each step and value read alone: 3 + 5 more, and 40 + 5 more)
    # one step's stored value changed (its zip and CRC-32 left as they were): refused, naming the item
    from zckpt.encoding import dcpmeta
    from zckpt.state.open import open_checkpoint as open_local
    src = tmp_path / "p40"
    md = dcpmeta.read_metadata((src / ".metadata").read_bytes(), "m")
    (c,) = md.tensors["optim.state.layers.30.weight.step"].chunks
    data = bytearray((src / c.file).read_bytes())
    at = c.offset + bytes(data[c.offset:c.offset + c.length]).index(struct.pack("<f", 7.0))
    data[at:at + 4] = struct.pack("<f", 8.0)
    (src / c.file).write_bytes(bytes(data))
    with pytest.raises(CorruptFile) as exc:
        open_local(str(src))
    msg = str(exc.value)
    assert "layers.30.weight.step" in msg and "CRC-32" in msg and c.file in msg and "\n" not in msg, msg


def test_a_chunk_laid_out_unlike_its_layout_is_refused_when_read(tmp_path):
    """Two chunks of one dtype, size and item length: the second rewritten as a zip of a transposed view (the same
    bytes count, another stride in its pickle). The open places it by the first one's layout; reading it refuses in
    one line naming the file and the item (its bytes would be taken in the wrong order), and merge writes nothing."""
    import io
    import torch.distributed.checkpoint as dcp
    from zckpt import load_state_dict
    from zckpt.encoding import dcpmeta
    from zckpt.ops.merge import merge
    src = tmp_path / "dcp"
    a, b = torch.arange(12.0).reshape(4, 3), torch.arange(12.0, 24.0).reshape(4, 3)
    dcp.save({"model": {"a": a, "b": b}}, checkpoint_id=str(src), no_dist=True)
    md = dcpmeta.read_metadata((src / ".metadata").read_bytes(), "m")
    (cb,) = md.tensors["model.b"].chunks
    buf = io.BytesIO()
    torch.save(torch.arange(12.0, 24.0).reshape(3, 4).t(), buf)  # shape (4, 3), stride (1, 4)
    odd = buf.getvalue()
    assert len(odd) == cb.length  # the same item length: only its pickle tells it apart
    data = bytearray((src / cb.file).read_bytes())
    data[cb.offset:cb.offset + cb.length] = odd
    (src / cb.file).write_bytes(bytes(data))
    with pytest.raises(CorruptFile) as exc:
        load_state_dict(str(src))
    msg = str(exc.value)
    assert cb.file in msg and "DCP item of 'model.b'" in msg and "data.pkl differs" in msg and "\n" not in msg, msg
    with pytest.raises(CorruptFile):
        merge(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    from zckpt.ops.verify import verify
    assert verify(str(src)).ok  # the metadata alone cannot see it
    report = verify(str(src), deep=True)
    assert not report.ok and "model.b" in report.checks[-1].detail and "data.pkl differs" in report.checks[-1].detail


def _twin_setup(tmp_path, writer: str = "torch"):
    """A DCP data file with many items of one layout and what the input check asks of it: (path, spans, layouts)
    for ``distcp.item_entries``, and the first two items of its most common layout. ``writer``: torch's dcp.save
    (24 module tensors of one shape; data descriptors after each entry) or zckpt's (convert --to dcp of a DeepSpeed
    fixture; CRC-32s in the local headers)."""
    from collections import Counter
    from zckpt.encoding import distcp
    from zckpt.state.open import open_checkpoint
    if writer == "torch":
        src = _dcp_save(tmp_path / "twins", 24, threads=1)
    else:
        from tests.conftest import FIXTURES
        from zckpt.ops.convert import convert
        src = tmp_path / "twins"
        convert(str(FIXTURES / "z2_bf16_ws2"), "dcp", str(src))
    ckpt = open_checkpoint(str(src))
    md, folder = ckpt.extra["metadata"], ckpt.location.tag_dir
    path = sorted(distcp.items_by_file(md, folder))[0]
    spans = [(o, n) for o, n, _ in distcp.items_by_file(md, folder)[path]]
    laid = distcp.layouts_by_file(md, folder)[path]
    (common, _), = Counter(id(lay) for lay, _ in laid.values()).most_common(1)
    pair = [span for span in spans if span[0] in laid and id(laid[span[0]][0]) == common][:2]
    # two items read whole at open (steps: no layout places them), of one length
    (size, _), = Counter(n for o, n in spans if o not in laid and n < 4096).most_common(1)
    whole = [span for span in spans if span[0] not in laid and span[1] == size][:2]
    return path, spans, laid, pair, whole


def _entries_or_refusal(path, spans, laid, twins: bool):
    from zckpt.encoding import distcp
    of = distcp._Twin.of
    if not twins:
        distcp._Twin.of = classmethod(lambda cls, *a: None)
    try:
        return distcp.item_entries(path, spans, None, laid)
    except CorruptFile as e:
        return ("refused", str(e))
    finally:
        distcp._Twin.of = of


@pytest.mark.parametrize("writer", ["torch", "zckpt"])
def test_items_of_one_layout_are_read_as_twins_of_the_first(tmp_path, monkeypatch, writer):
    """The input check's zip directories of a DCP file: the first item of a layout read as any zip, the others as
    its twins (two reads each, their bytes but the CRC-32 fields and the per-item id compared with it). The
    entries are those of reading every item as any zip, and most items were read as twins."""
    from zckpt.encoding import distcp
    path, spans, laid, _, _ = _twin_setup(tmp_path, writer)
    hits = []
    real = distcp._Twin.entries
    monkeypatch.setattr(distcp._Twin, "entries", lambda self, f, off: hits.append(off) or real(self, f, off))
    fast = _entries_or_refusal(path, spans, laid, twins=True)
    assert sum(off in laid for off in hits) >= (20 if writer == "torch" else 8)
    assert any(off not in laid for off in hits)  # (items read whole at open: steps, values)
    assert fast == _entries_or_refusal(path, spans, laid, twins=False)
    every = len(hits)
    hits.clear()  # zip records past SMALL_ITEM around a tensor (a crafted entry of megabytes): read as any zip
    monkeypatch.setattr(distcp, "SMALL_ITEM", 256)
    assert _entries_or_refusal(path, spans, laid, twins=True) == fast and not hits
    monkeypatch.setattr(distcp, "SMALL_ITEM", 64 << 10)
    monkeypatch.setattr(distcp, "TWIN_BYTES", 2000)  # the twins' memory spent (as by many distinct item lengths):
    assert _entries_or_refusal(path, spans, laid, twins=True) == fast  # the later kinds read as any zip
    assert len(hits) < every


@pytest.mark.parametrize("kind", ["laid", "whole"])
@pytest.mark.parametrize("writer", ["torch", "zckpt"])
def test_a_twin_damaged_anywhere_outside_its_tensor_reads_as_any_zip_would(tmp_path, writer, kind):
    """Every byte of a twin item outside its tensor's bytes flipped in turn: the entries, or the one-line refusal,
    are the same as when every item is read as any zip (a flipped CRC-32 field, header or record, is refused)."""
    from zckpt.encoding.zipentries import read_entries, Window
    path, _, laid, pair, whole = _twin_setup(tmp_path, writer)
    first, twin = pair if kind == "laid" else whole
    with open(path, "rb") as f:
        entries = read_entries(Window(f, twin[0], twin[1]), twin[1], path)
    data = next(e for e in entries.values() if e.name.endswith("/data/0") or kind == "whole")
    refused = 0
    positions = [p for p in range(twin[1]) if kind == "whole" or not data.data_offset <= p < data.data_offset + data.size]
    with open(path, "r+b") as f:
        for pos in positions:
            f.seek(twin[0] + pos)
            byte = f.read(1)[0]
            f.seek(twin[0] + pos)
            f.write(bytes([byte ^ 0x10]))
            f.flush()
            got = _entries_or_refusal(path, [first, twin], laid, twins=True)
            assert got == _entries_or_refusal(path, [first, twin], laid, twins=False), pos
            refused += isinstance(got, tuple)
            f.seek(twin[0] + pos)
            f.write(bytes([byte]))
            f.flush()
    assert len(positions) > 700 and refused > len(positions) // 4  # (names, offsets, CRC-32 fields: refused)
    # (a flipped byte of a step's value: the same entries, the CRC-32 the input check then compares with the bytes)


def test_deepspeed_opens_in_requests_per_rank_file(s3_server, tmp_path):
    """The same for DeepSpeed: opening a ZeRO-3 checkpoint on S3 (requests counted at a proxy in front of the local
    server) costs a few requests per rank file, whatever the world size: the committed real saves at 2 and 4 ranks
    (4 and 8 rank files) differ by at most 3 requests per extra file; what opens is the checkpoint read locally."""
    import uuid
    from tests.faultproxy import FaultProxy
    from zckpt.state.open import open_checkpoint
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    try:
        opts = dict(s3_server.storage_options(), endpoint_url=proxy.endpoint)
        client, counts = s3_server.client(), {}
        for ws in (2, 4):
            src = ROOT / "fixtures" / f"z3_bf16_ws{ws}"
            prefix = f"ds-{uuid.uuid4().hex[:8]}"
            files = [p for p in src.rglob("*") if p.is_file() and "expected" not in p.parts]
            for p in files:
                client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{p.relative_to(src).as_posix()}",
                                  Body=p.read_bytes())
            before = len(proxy.requests)
            ckpt = open_checkpoint(s3_server.url(prefix), storage_options=opts)
            counts[ws] = len(proxy.requests) - before
            local = open_checkpoint(str(src))
            assert ckpt.world_size == ws and [(r.name, r.shape) for r in ckpt.records] == \
                [(r.name, r.shape) for r in local.records]
    finally:
        proxy.stop()
    assert counts[4] - counts[2] <= 3 * 4, counts  # 4 more rank files (20 and 28 requests here: 2 a file)
    assert counts[2] <= 24, counts  # 4 rank files, the listing, latest


def test_tie_candidates_read_each_tensor_once_not_each_pair(tmp_path, monkeypatch):
    """Frozen tensors of a trainable tensor's shape are compared with it for a likely tie: the first bytes of each
    tensor are read once (12 frozen against 2 trainable: 14 first reads, not 48), and the one real copy is still
    found (a frozen tensor equal to a trainable one), the others not."""
    import torch.distributed.checkpoint as dcp
    from zckpt.io import storage
    from zckpt.state.open import open_checkpoint
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    model = {f"frozen.{i}": torch.randn(8, 6, generator=g) for i in range(11)}
    model.update({"copy_of_a": a.clone(), "a": a, "b": b})
    state = {n: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(8, 6), "exp_avg_sq": torch.zeros(8, 6)}
             for n in ("a", "b")}
    dcp.save({"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}},
             checkpoint_id=str(tmp_path / "d"), no_dist=True)
    reads = []
    real = storage.read_range
    monkeypatch.setattr(storage, "read_range", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    ckpt = open_checkpoint(str(tmp_path / "d"))
    assert ckpt.extra["tie_candidates"] == [("copy_of_a", "a")]
    assert len(reads) <= 14 + 2, len(reads)  # 14 first reads, the equal pair's full comparison (2)


def _placed(buckets: dict) -> dict:
    """Where each parameter's optimizer state was placed, by file name (not path) and offset."""
    return {name: [[(p.path.rsplit("/", 1)[-1], p.offset, p.numel, p.dtype) for p in ps] for ps in states]
            for name, states in buckets.items()}


def test_megatron_opens_in_requests_per_file_not_per_item(s3_server, tmp_path):
    """Opening a Megatron-Core torch_dist save on S3 (requests counted at a proxy in front of the local server)
    costs the same requests for 2 or 16 layers in its 4 data files: each module's extra-state object and the
    optimizer's objects are fetched per data file, a chunk's zip is read once per layout, never once per item.
    The 16-layer save is made here by megatron-core itself (fixtures/megatron/generate.py, the committed
    gpt_tp1_pp1_dp2's spec but for its layers); what opens on S3 is what opens locally."""
    pytest.importorskip("megatron.core")
    import subprocess
    import sys
    import uuid
    from tests.faultproxy import FaultProxy
    from zckpt import load_state_dict
    from zckpt.state.open import open_checkpoint
    r = subprocess.run([sys.executable, str(ROOT / "fixtures" / "megatron" / "generate.py"), "--spec", "layers=16,dp=2",
                        "--iters", "1", "--no-oracle", "--name", "l16", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sources = {2: ROOT / "fixtures" / "megatron" / "gpt_tp1_pp1_dp2", 16: tmp_path / "l16"}
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    try:
        opts = dict(s3_server.storage_options(), endpoint_url=proxy.endpoint)
        client, counts, items = s3_server.client(), {}, {}
        for layers, src in sources.items():
            prefix = f"mc-{uuid.uuid4().hex[:8]}"
            for p in src.rglob("*"):
                if p.is_file():
                    client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{p.relative_to(src).as_posix()}",
                                      Body=p.read_bytes())
            before = len(proxy.requests)
            ckpt = open_checkpoint(s3_server.url(prefix), storage_options=opts)
            counts[layers] = len(proxy.requests) - before
            md = ckpt.extra["metadata"]
            assert len(md.files) == 4 and ckpt.extra["megatron"]["num_layers"] == layers
            items[layers] = sum(len(t.chunks) for t in md.tensors.values()) + len(md.values)
            local = open_checkpoint(str(src))
            assert [(r.name, r.shape, r.dtype) for r in ckpt.records] == \
                [(r.name, r.shape, r.dtype) for r in local.records]
            assert ckpt.extra["step"] == local.extra["step"] and ckpt.extra["bucket_error"] is None
            assert _placed(ckpt.extra["buckets"]) == _placed(local.extra["buckets"])
            if layers == 2:  # the bytes too (the data path reads per range, not per item: not counted here)
                got, want = load_state_dict(ckpt), load_state_dict(local)
                assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        proxy.stop()
    assert items[16] > 4 * items[2], items  # 8x the layers: 4x the items (extra-state objects, chunks)
    # finding the iteration, one listing with the sizes, metadata.json, common.pt, .metadata, a read per data file
    # for its objects, one chunk per layout (25 and 25 here): before, a request per extra-state object (8 and 64 of
    # them) and two HEADs per file (46 and 102)
    assert counts[16] - counts[2] <= 2, counts
    assert counts[2] <= 30, counts


def test_row_parallel_weights_of_a_70b_model_at_tp8_open():
    """A 70B model's row-parallel weights saved by Megatron-Core at tensor-parallel 8 (stacked [80, 8192, 8192], each
    layer's chunk cut on its last dim) are 80 x 8192 x 8 runs of their flat form: past MAX_RUNS, so they were refused
    at open. Their chunks are a grid: the open keeps the grid, and a layer's runs (8192 rows x 8) are made when
    that layer is taken, equal to cutting the whole tensor into runs and keeping that layer's."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )
    layers, h, tp = 80, 8192, 8
    chunks, sd = [], {}
    for layer in range(layers):
        for r in range(tp):
            offs = torch.Size([layer, 0, r * h // tp])
            chunks.append(ChunkStorageMetadata(offsets=offs, sizes=torch.Size([1, h, h // tp])))
            sd[MetadataIndex("decoder.layers.self_attention.linear_proj.weight", offs)] = \
                _StorageInfo(f"__{r}_0.distcp", layer * 2 ** 25, 2 ** 25)
    key = "decoder.layers.self_attention.linear_proj.weight"
    md = Metadata(state_dict_metadata={key: TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                                  torch.Size([layers, h, h]), chunks)},
                  storage_data=sd)
    te = dcpmeta.read_metadata(pickle.dumps(md), "/x/.metadata").tensors[key]
    assert te.runs is None and te.grid is not None and layers * h * tp > dcpmeta.MAX_RUNS
    runs = dcpmeta.runs_in(te, 5 * h * h, 6 * h * h)  # layer 5
    assert len(runs) == h * tp and sum(n for *_, n in runs) == h * h
    assert [(f, c.offsets, local, n) for f, c, local, n in runs[:tp + 1]] == \
        [(5 * h * h + r * h // tp, (5, 0, r * h // tp), 0, h // tp) for r in range(tp)] + \
        [(5 * h * h + h, (5, 0, 0), h // tp, h // tp)]
    assert all(a[0] + a[3] == b[0] for a, b in zip(runs, runs[1:]))  # in order, back to back


def test_the_expression_compiled_once_walking_without_it_would_cost_more(monkeypatch):
    """A pickle of 16-64 KiB is walked one opcode at a time until the bytes so walked (per expression) reach
    ``COMPILE_AFTER``, then the expression is compiled and kept; a pickle of that size compiles it at once. Every
    walk ends where pickletools ends, either way."""
    import pickle
    compiled = []
    real = pickles._run_pattern

    def spy(bits):
        compiled.append(bits)
        return real(bits)
    monkeypatch.setattr(pickles, "_run_pattern", spy)
    monkeypatch.setattr(pickles, "_walked", {})
    monkeypatch.setattr(pickles, "_compiled", set())
    small = pickle.dumps([("k%d" % i, i, 2.5 * i) for i in range(600)], protocol=2)
    assert pickles.REGEX_FROM <= len(small) < pickles.COMPILE_AFTER // 2 and pickles._bits_below(len(small)) == 14
    walks = -(-pickles.COMPILE_AFTER // len(small)) - 1  # the last walk before the bytes reach COMPILE_AFTER
    assert [pickles.scan(small) for _ in range(walks)] == [len(small)] * walks and compiled == []
    assert [pickles.scan(small) for _ in range(2)] == [len(small)] * 2 and compiled == [14, 14]
    before = len(compiled)
    big = pickle.dumps([("k%d" % i, i) for i in range(12000)], protocol=2)
    bits = pickles._bits_below(len(big))
    assert len(big) >= pickles.COMPILE_AFTER and bits != 14
    assert pickles.scan(big) == len(big) and compiled[before:] == [bits]
    last = None
    for _, _, pos in pickletools.genops(big):
        last = pos
    assert last + 1 == len(big)
