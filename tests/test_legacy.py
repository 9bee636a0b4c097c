"""Legacy (non-zip) torch files: read like zip ones everywhere, and refused in one line when hostile or broken.

The committed ``*_legacy`` fixtures were written by real DeepSpeed 0.19.8 with ``"checkpoint":
{"checkpoint_serialization": false}`` (``torch.save(..., _use_new_zipfile_serialization=False)``). DeepSpeed's own
converter cannot read them (it opens files with ``mmap=True``; expected/NOTES.txt), so the references here are
``torch.load`` of the same files, DeepSpeed's converter on a zip copy of the same checkpoint (every file re-saved by
``torch.save`` in the zip format: the same tensors and objects), and the engine state captured at save time (the
generic fixture tests). Hostile files are crafted byte by byte with torch's own layout (``_legacy_save``).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURE_DIRS, checkpoint_path
from zckpt.errors import CorruptFile, UnsafePickle, UnsupportedLayout, ZckptError
from zckpt.encoding import legacy, safeload

ROOT = Path(__file__).resolve().parent.parent
LEGACY = [d for d in FIXTURE_DIRS if d.name.endswith("_legacy")]
MARKER = "/tmp/zckpt-legacy-pwned"


def _fixture(name: str) -> Path:
    d = next((d for d in LEGACY if d.name == name), None)
    if d is None:
        pytest.skip(f"no committed fixture {name}")
    return checkpoint_path(d)


def _files(save: Path) -> list[Path]:
    tag = (save / "latest").read_text().strip()
    return sorted((save / tag).glob("*.pt"))


def _materialize(obj):
    """The object safeload gives, with every LazyTensor read from its byte range (as torch would build it)."""
    if isinstance(obj, safeload.LazyTensor):
        from zckpt.encoding.tensors import torch_dtype
        with open(obj.storage.path, "rb") as f:
            f.seek(obj.storage.offset)
            raw = bytearray(f.read(obj.storage.nbytes))
        flat = torch.frombuffer(raw, dtype=torch_dtype(obj.dtype)) if raw else torch.empty(0, dtype=torch_dtype(
            obj.dtype))
        return torch.as_strided(flat, obj.shape, obj.stride, obj.storage_offset) if obj.numel else \
            torch.empty(obj.shape, dtype=flat.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _materialize(v)) for k, v in obj.items()) if not isinstance(
            obj, collections.defaultdict) else {k: _materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(v) for v in obj)
    if isinstance(obj, safeload.Inert):
        return {k: _materialize(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return obj


def _same(a, b, where=""):
    """``a`` from safeload (materialized), ``b`` from torch.load: the same values, tensors bit for bit."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride(), where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), \
            where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(map(str, a)) == list(map(str, b)), where
        for k in b:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(b, "__dict__") and not isinstance(b, type) and not isinstance(b, (int, float, str)):
        state = {k: v for k, v in vars(b).items() if not k.startswith("_")}
        if not isinstance(a, dict):  # two torch.load objects
            assert type(a).__name__ == type(b).__name__, where
            a = {k: v for k, v in vars(a).items() if not k.startswith("_")}
        _same(a, state, f"{where}.{type(b).__name__}")
    elif isinstance(b, torch.dtype):
        assert a == str(b).split(".")[1], where
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------------------------- reading

@pytest.mark.parametrize("name", [d.name for d in LEGACY])
def test_every_rank_file_reads_as_torch_loads_it(name):
    """Every object and tensor of every rank file of the real DeepSpeed legacy fixtures, as ``torch.load`` gives
    it (our own committed fixtures: trusted), tensors bit for bit at the offsets zckpt computed."""
    files = _files(_fixture(name))
    assert files
    for path in files:
        assert legacy.is_legacy(path.read_bytes()[:4]), path
        _same(_materialize(safeload.load(str(path))), torch.load(path, weights_only=False, map_location="cpu"),
              path.name)


def test_synthetic_legacy_file_with_views_dtypes_and_a_large_pickle(tmp_path):
    """Dtypes, shared storages, views, non-contiguous and empty tensors, parameters, and an object pickle past the
    first read (several growth steps) with size fields outside the bytes read first."""
    base = torch.randn(40000)
    sd = collections.OrderedDict(
        a=base, view=base[5:17], t=torch.randn(3, 5).t(), bf=torch.randn(7).bfloat16(), h=torch.randn(4).half(),
        i=torch.arange(9, dtype=torch.int64), b=torch.tensor([True, False]), e=torch.empty(0), s=torch.tensor(2.5),
        p=torch.nn.Parameter(torch.randn(3)), u8=torch.arange(5, dtype=torch.uint8))
    for k in range(3000):  # many small storages: the object and keys pickles outgrow the first read
        sd[f"m{k}"] = torch.full((2,), float(k))
    obj = {"sd": sd, "names": [f"name-{k}" * 8 for k in range(2000)], "n": 3, "f": 0.5, "none": None}
    path = tmp_path / "big.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    with open(path, "rb") as f:
        header = legacy.read_header(f, path.stat().st_size, str(path))
    assert header.bytes_read > legacy.FIRST_READ and header.data_start > legacy.FIRST_READ
    _same(_materialize(safeload.load(str(path))), torch.load(path, weights_only=False))


@pytest.fixture(scope="module")
def zip_twins(tmp_path_factory):
    """Each legacy fixture with every rank file re-saved by torch.save in the zip format (same objects)."""
    out = {}
    for d in LEGACY:
        dst = tmp_path_factory.mktemp("zip") / d.name
        shutil.copytree(checkpoint_path(d), dst, ignore=shutil.ignore_patterns("expected"))
        for p in _files(dst):
            torch.save(torch.load(p, weights_only=False, map_location="cpu"), p)
            assert p.read_bytes()[:4] == b"PK\x03\x04"
        out[d.name] = dst
    return out


@pytest.mark.parametrize("name", [d.name for d in LEGACY])
def test_merge_equals_deepspeed_on_the_same_checkpoint(name, zip_twins, tmp_path):
    """``zckpt merge`` of the legacy checkpoint: DeepSpeed's converter's tensors for the same checkpoint (run on its
    zip twin), bit for bit, and the same files as zckpt's merge of the twin."""
    import zckpt
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    src = _fixture(name)
    ds = get_fp32_state_dict_from_zero_checkpoint(str(zip_twins[name]))
    zckpt.merge(str(src), str(tmp_path / "m"))
    zckpt.merge(str(zip_twins[name]), str(tmp_path / "z"))
    got = {}
    for p in sorted((tmp_path / "m").glob("*.safetensors")):
        got.update(load_file(p))
    first = {}
    for k, v in ds.items():  # tied aliases (head.weight is emb.weight) are written once
        first.setdefault(v.data_ptr(), k)
    ds = {k: v for k, v in ds.items() if first[v.data_ptr()] == k}
    assert set(ds) <= set(got), sorted(set(ds) - set(got))
    for k, v in ds.items():  # frozen weights: DeepSpeed keeps their bf16, merge --dtype fp32 widens them (exactly)
        assert (got[k].dtype == v.dtype or (v.dtype == torch.bfloat16 and got[k].dtype == torch.float32)) \
            and torch.equal(got[k], v.to(got[k].dtype)), k
    for p in sorted((tmp_path / "z").glob("*.safetensors")):
        assert p.read_bytes() == (tmp_path / "m" / p.name).read_bytes(), p.name


@pytest.mark.parametrize("name,ws,stage", [("z2_bf16_ws2_legacy", 3, None), ("z3_bf16_ws2_legacy", 1, 2),
                                           ("z1_fp32_ws3_legacy", 2, 3)], ids=lambda v: str(v))
def test_reshard_from_a_legacy_source_equals_the_zip_twin(name, ws, stage, zip_twins, tmp_path):
    """A legacy source reshards to the same rank files (zip, as DeepSpeed's default writes) as its zip twin."""
    from zckpt.ops.reshard import reshard
    reshard(str(_fixture(name)), str(tmp_path / "a"), world_size=ws, stage=stage)
    reshard(str(zip_twins[name]), str(tmp_path / "b"), world_size=ws, stage=stage)
    a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.pt"))
    assert a and a == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.pt"))
    for rel in a:
        _same(torch.load(tmp_path / "a" / rel, weights_only=False), torch.load(tmp_path / "b" / rel,
                                                                               weights_only=False), str(rel))


# ---------------------------------------------------------------------------------------------- verify, push

def _copy(tmp_path: Path, name: str) -> tuple[Path, list[Path]]:
    ck = tmp_path / "ck"
    shutil.copytree(_fixture(name), ck, ignore=shutil.ignore_patterns("expected"))
    return ck, _files(ck)


def _places(path: Path):
    with open(path, "rb") as f:
        return safeload.legacy_layout(str(path), f, path.stat().st_size)[1]


def test_verify_deep_reads_every_byte_and_checks_size_fields(tmp_path):
    import zckpt
    ck, files = _copy(tmp_path, "z2_bf16_ws2_legacy")
    rep = zckpt.verify(str(ck), deep=True)
    from zckpt.backup.files import checkpoint_files  # --deep reads every file of the checkpoint, the rank files among them
    assert rep.ok and rep.bytes_read == sum(f.size for f in checkpoint_files(str(ck)))
    assert set(map(str, files)) <= {f.path for f in checkpoint_files(str(ck))}
    assert "legacy files" in next(c.detail for c in rep.checks if c.name == "CRC of every entry")
    # a size field that lies (the pickle still agrees with the file size): named, by the metadata read already
    target = files[1]
    place = max(_places(target).values(), key=lambda p: p.nbytes)
    data = bytearray(target.read_bytes())
    struct.pack_into("<q", data, place.offset - 8, place.numel + 1)
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="size field") as err:
        zckpt.verify(str(ck), deep=True)
    assert err.value.path == str(target)


def test_verify_deep_without_crcs_relies_on_the_manifest(tmp_path):
    """A flipped bit inside a legacy storage has no CRC to catch it; the push manifest's sha256 does."""
    import zckpt
    from zckpt.backup.manifest import MANIFEST_NAME
    ck, files = _copy(tmp_path, "z2_bf16_ws2_legacy")
    tag = files[0].parent.name
    manifest = {"files": {f"{tag}/{p.name}": {"size": p.stat().st_size,
                                              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files}}
    (ck / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert zckpt.verify(str(ck), deep=True).ok
    target = files[0]
    place = max(_places(target).values(), key=lambda p: p.nbytes)
    data = bytearray(target.read_bytes())
    data[place.offset + 3] ^= 0x10
    target.write_bytes(bytes(data))
    rep = zckpt.verify(str(ck), deep=True)
    assert not rep.ok
    bad = [c for c in rep.checks if not c.ok]
    assert [c.name for c in bad] == ["manifest"] and target.name in bad[0].detail and "sha256" in bad[0].detail


def test_push_completeness(tmp_path):
    from zckpt.backup.scan import check_complete
    ck, files = _copy(tmp_path, "z3_bf16_ws2_legacy")
    assert check_complete(str(ck)) == (True, "complete")
    target = files[-1]
    data = target.read_bytes()
    target.write_bytes(data[:-5])
    ok, reason = check_complete(str(ck))
    assert not ok and target.name in reason and "legacy" in reason, reason
    target.write_bytes(data + b"\x00" * 8)
    ok, reason = check_complete(str(ck))
    assert not ok and target.name in reason, reason


# ---------------------------------------------------------------------------------------------- hostile files

class _Storage:
    def __init__(self, key, numel, stype="FloatStorage", view=None):
        self.key, self.numel, self.stype, self.view = key, numel, stype, view


class _Tensor:
    def __init__(self, storage: _Storage, shape):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self):
        stride = tuple(int(torch.tensor(self.shape[i + 1:]).prod()) for i in range(len(self.shape)))
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def craft(obj, blobs, keys=None, magic=legacy.MAGIC_NUMBER, proto=legacy.PROTOCOL_VERSION, sys_info=None,
          tail=b"") -> bytes:
    """A legacy file laid out as ``torch.serialization._legacy_save`` writes it; ``blobs``: (key, size field, bytes)
    in file order; every other part can be forged."""
    buf = io.BytesIO()
    for head in (magic, proto, sys_info if sys_info is not None else
                 {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(head, buf, protocol=2)

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", getattr(torch, o.stype), o.key, "cpu", o.numel, o.view)
            return None

    Pickler(buf, protocol=2).dump(obj)
    pickle.dump(keys if keys is not None else [k for k, _, _ in blobs], buf, protocol=2)
    for _key, field, data in blobs:
        buf.write(struct.pack("<q", field) + data)
    return buf.getvalue() + tail


def _good(n=6):
    st = _Storage("7", n)
    data = struct.pack(f"<{n}f", *range(n))
    return {"w": _Tensor(st, (2, n // 2)), "step": 3}, [("7", n, data)]


def test_crafted_files_are_what_torch_writes(tmp_path):
    """The crafting is faithful: torch reads a crafted file, and zckpt reads it the same."""
    obj, blobs = _good()
    path = tmp_path / "c.pt"
    path.write_bytes(craft(obj, blobs))
    ref = torch.load(path, weights_only=False)
    assert torch.equal(ref["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    _same(_materialize(safeload.load(str(path))), ref)


def _two():
    a, b = _Storage("1", 4), _Storage("2", 4)
    return {"a": _Tensor(a, (4,)), "b": _Tensor(b, (4,))}, [("1", 4, b"\x00" * 16), ("2", 4, b"\x00" * 16)]


def _hostile():
    obj, blobs = _good()
    two, two_blobs = _two()
    cases = {
        "code": (craft({"x": _Evil(), **obj}, blobs), UnsafePickle, "posix.system"),
        "code_in_sys_info": (craft(obj, blobs, sys_info={"x": _Evil()}), UnsafePickle, "only plain data"),
        "magic": (craft(obj, blobs, magic=12345), CorruptFile, "magic number"),
        "protocol": (craft(obj, blobs, proto=1000), UnsupportedLayout, "protocol 1000"),
        "big_endian": (craft(obj, blobs, sys_info={"little_endian": False}), UnsupportedLayout, "big-endian"),
        "numel_in_pickle": (craft({"w": _Tensor(_Storage("7", 8), (2, 3))}, blobs), CorruptFile,
                            "storages need"),
        "huge_numel": (craft({"w": _Tensor(_Storage("7", 1 << 60), (2, 3))}, blobs), CorruptFile, "claims"),
        "negative_numel": (craft({"w": _Tensor(_Storage("7", -6), (2, 3))}, blobs), CorruptFile, "claims"),
        "size_field": (craft(obj, [("7", 7, blobs[0][2])]), CorruptFile, "size field says 7"),
        # sizes that compensate each other (the file size is right) are caught by the size fields
        "swapped_sizes": (craft({"a": _Tensor(_Storage("1", 3), (3,)), "b": _Tensor(_Storage("2", 5), (5,))},
                                two_blobs), CorruptFile, "size field says 4"),
        "key_missing": (craft(two, two_blobs[:1], keys=["1"]), CorruptFile, "not in the keys list"),
        "key_extra": (craft(two, two_blobs + [("3", 0, b"")]), CorruptFile, "does not use"),
        "key_twice": (craft(two, two_blobs, keys=["1", "2", "2"]), CorruptFile, "twice"),
        "huge_count": (craft(two, two_blobs, keys=[str(k) for k in range(200000)]), CorruptFile, "room for"),
        "keys_not_a_list": (craft(two, two_blobs, keys={"1": 1}), CorruptFile, "not a list"),
        "view": (craft({"w": _Tensor(_Storage("7", 6, view=("8", 0, 2)), (2,))}, blobs), UnsupportedLayout, "view"),
        "trailing_bytes": (craft(obj, blobs, tail=b"\x00" * 8), CorruptFile, "storages need"),
        "overrun": (craft({"w": _Tensor(_Storage("7", 6), (4, 3))}, blobs), CorruptFile, "overruns"),
        "memo_bomb": (None, CorruptFile, "memo slot"),
        "no_stop": (None, CorruptFile, "truncated"),
    }
    good = craft(obj, blobs)
    spans = legacy._pickle_spans(good, None)  # noqa: SLF001 - the test forges one pickle in place
    o0, o1 = spans[3]
    bomb = b"\x80\x02}q\x00(X\x01\x00\x00\x00ar\xff\xff\xff\x7fK\x01u."  # LONG_BINPUT 2**31-1
    cases["memo_bomb"] = (good[:o0] + bomb + good[o1:], CorruptFile, "memo slot")
    cases["no_stop"] = (good[:o0] + good[o0:o1 - 1], CorruptFile, "truncated")
    return cases


HOSTILE = _hostile()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_legacy_file_refused_in_one_line(tmp_path, case):
    data, cls, words = HOSTILE[case]
    if os.path.exists(MARKER):
        os.remove(MARKER)
    path = tmp_path / "h.pt"
    path.write_bytes(data)
    with pytest.raises(cls) as err:
        safeload.load(str(path))
    msg = str(err.value)
    assert words in msg and "\n" not in msg and str(path) in msg, msg
    assert not os.path.exists(MARKER)


def test_every_cut_of_a_legacy_file_is_refused(tmp_path):
    obj, blobs = _good()
    data = craft(obj, blobs)
    path = tmp_path / "t.pt"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptFile):
            safeload.load(str(path))


def _cli(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, ZCKPT_DEBUG="", PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("case", ["truncated", "size_field"])
def test_commands_name_the_damaged_legacy_rank_file(tmp_path, case):
    """Damage that torch.load refuses too: every command refuses it in one line naming the file, no traceback."""
    ck, files = _copy(tmp_path, "z2_bf16_ws2_legacy")
    target = next(p for p in files if "rank_1_" in p.name)
    data = bytearray(target.read_bytes())
    place = max(_places(target).values(), key=lambda p: p.nbytes)
    if case == "truncated":
        data = data[:len(data) * 2 // 3]
    else:
        struct.pack_into("<q", data, place.offset - 8, place.numel - 1)
    target.write_bytes(bytes(data))
    with pytest.raises(Exception):  # noqa: B017 - torch refuses it (RuntimeError, EOFError ...)
        torch.load(target, weights_only=False)
    rel = os.path.join("ck", os.path.relpath(target, ck))
    for cmd in (["verify", "ck"], ["info", "ck"], ["merge", "ck", "-o", "out"]):
        proc = _cli(tmp_path, *cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and rel in lines[0], (cmd, proc.stderr)
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    from zckpt.backup.scan import check_complete
    ok, reason = check_complete(str(ck))
    assert not ok and target.name in reason, reason


def test_errors_are_zckpt_errors():
    for data, cls, _ in HOSTILE.values():
        assert issubclass(cls, ZckptError)


def test_writer_engine_checkpoint_ties_come_from_storage_sharing():
    """With the 0.17.1+ writer engine another rank than 0 writes ``mp_rank_00_model_states.pt``, and DeepSpeed
    fills ``shared_params`` on global rank 0 only: the file's ``shared_params`` is empty, and the tie shows only in
    ``module`` (head.weight is emb.weight's memory). It is read as the tie it is, not as a frozen copy."""
    from zckpt import open_checkpoint
    save = _fixture("z2_bf16_ws2_pywriter_legacy")
    ms = safeload.load(str(save / "global_step3" / "mp_rank_00_model_states.pt"))
    assert ms["shared_params"] == {}
    recs = open_checkpoint(str(save)).by_name()
    assert recs["head.weight"].kind == "tied" and recs["head.weight"].tied_to == "emb.weight"
    assert recs["frozen.weight"].kind == "frozen"
