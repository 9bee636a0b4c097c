"""Hostile DCP ``.metadata`` pickles against the reader (issue 49): the C unpickler whose ``find_class`` hands back
only the allow-list's inert stand-ins and whose ``persistent_load`` refuses. Each crafted pickle is refused in one
line naming the file, nothing it names is ever called (a marker file a payload would create stays absent), and
no allocation it asks for is made. Hand-assembled opcodes: no pickler would write these."""

from __future__ import annotations

import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from zckpt.encoding import dcpmeta, safeload
from zckpt.errors import CorruptFile, UnsafePickle, ZckptError

ROOT = Path(__file__).resolve().parents[1]
PATH = "/ckpt/.metadata"


def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _proto4(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def _hostile(marker: Path) -> dict[str, tuple[bytes, type, str]]:
    """name -> (pickle, the error class, words its message holds)."""
    cmd = f"touch {marker}"
    cases = {
        # GLOBAL (protocol 0's text opcode) os.system, then REDUCE: the classic payload
        "os.system by GLOBAL": (b"cos\nsystem\n(" + b"V" + cmd.encode() + b"\ntR.", UnsafePickle, "'os.system'"),
        # STACK_GLOBAL (protocol 4): module and name from the stack, memoized first
        "posix.system by STACK_GLOBAL": (_proto4(_str("posix") + b"\x94" + _str("system") + b"\x94\x93\x94" +
                                                 _str(cmd) + b"\x85R"), UnsafePickle, "'posix.system'"),
        # INST (protocol 0 calls the class with the marked items)
        "subprocess.call by INST": (b"(V" + cmd.encode() + b"\nisubprocess\ncall\n.", UnsafePickle,
                                    "'subprocess.call'"),
        # an allowed class's reduce pointed at a builtin that is not allowed: builtins.eval through torch.Size's name
        # would need the name itself; any other name is refused, eval included
        "builtins.eval": (_proto4(_str("builtins") + _str("eval") + b"\x93" + _str(f"__import__('os').system('{cmd}')")
                                  + b"\x85R"), UnsafePickle, "'builtins.eval'"),
        # getattr on an allowed class to reach something else (torch.Size -> its module's globals)
        "builtins.getattr": (_proto4(_str("builtins") + _str("getattr") + b"\x93" + _str("torch") + _str("Size") +
                                     b"\x93" + _str("__class__") + b"\x86R"), UnsafePickle, "'builtins.getattr'"),
        # a persistent id (a tensor storage) in a plain pickle
        "persistent id": (_proto4(_str("storage") + b"Q"), CorruptFile, "persistent id"),
        # a memo slot far past the pickle's length: CPython would grow its memo table to 2**32 entries (32 GB)
        "LONG_BINPUT 2**32-1": (_proto4(b"N" + b"r" + struct.pack("<I", 2**32 - 1)), CorruptFile, "memo slot"),
        # PUT's text index: any size
        "PUT 10**12": (b"Np1000000000000\n.", CorruptFile, "memo slot"),
        # a memo GET of a slot never PUT (the trick's other half)
        "GET of an empty slot": (_proto4(b"h\x05"), CorruptFile, "damaged"),
        # a string claiming 2**60 bytes: its length past the end, refused before any allocation
        "BINUNICODE8 2**60": (_proto4(b"\x8d" + struct.pack("<Q", 2**60) + b"x"), CorruptFile, "damaged pickle"),
        # an allowed callable asked for a huge allocation: bytearray(10**12)
        "bytearray(10**12)": (_proto4(_str("builtins") + _str("bytearray") + b"\x93" + b"\x8a\x06" +
                                      (10**12).to_bytes(6, "little") + b"\x85R"), CorruptFile, "bytearray of"),
        # an allowed copying callable run again and again on one memo'd list: the copy budget
        "list(big) repeated": (_proto4(_str("builtins") + _str("list") + b"\x93\x94" + b"](" + b"K\x01" * 5000 +
                                       b"e\x94" + b"(" + b"h\x00h\x01\x85R" * 20000 + b"l"),
                               CorruptFile, "copies more than"),
    }
    return cases


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "ran"


@pytest.mark.parametrize("name", list(_hostile(Path("/x"))))
def test_hostile_metadata_refused_and_nothing_runs(name, marker):
    data, cls, words = _hostile(marker)[name]
    with pytest.raises(cls) as exc:
        dcpmeta.read_metadata(data, PATH)
    msg = str(exc.value)
    assert words in msg and PATH in msg and "\n" not in msg, msg
    assert not marker.exists()


def test_allowed_stand_in_reduced_with_arguments_stays_inert():
    """REDUCE of an allow-listed DCP class with arguments (DCP's own pickles use NEWOBJ + BUILD): the stand-in keeps
    them as data; a chunk that is not a chunk is then refused by the checks, in one line."""
    m = "torch.distributed.checkpoint.metadata"
    body = (_str(m) + _str("Metadata") + b"\x93" + b"}" + _str("state_dict_metadata") + b"}" + _str("k") +
            _str(m) + _str("TensorStorageMetadata") + b"\x93)\x81}(" + _str("size") + b")" + _str("chunks") + b"]" +
            _str(m) + _str("ChunkStorageMetadata") + b"\x93" + _str("os") + _str("system") + b"\x86R" + b"a" +
            b"ub" + b"s" + _str("storage_data") + b"}" + b"s" + b"\x85R")
    with pytest.raises(CorruptFile) as exc:
        dcpmeta.read_metadata(_proto4(body), PATH)
    assert PATH in str(exc.value) and "\n" not in str(exc.value)


def test_real_metadata_still_read(tmp_path):
    """The same reader on a genuine ``.metadata`` (torch's own classes, pickled as FileSystemWriter does)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    chunks = [ChunkStorageMetadata(offsets=torch.Size([2 * r, 0]), sizes=torch.Size([2, 3])) for r in range(2)]
    md = Metadata(state_dict_metadata={"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                                        torch.Size([4, 3]), chunks)},
                  storage_data={MetadataIndex("model.w", c.offsets): _StorageInfo(f"__{r}_0.distcp", 0, 900)
                                for r, c in enumerate(chunks)})
    got = dcpmeta.read_metadata(pickle.dumps(md), PATH, {"__0_0.distcp": 900, "__1_0.distcp": 900})
    te = got.tensors["model.w"]
    assert (te.dtype, te.shape, [(c.offsets, c.sizes, c.file) for c in te.chunks]) == \
        ("bfloat16", (4, 3), [((0, 0), (2, 3), "__0_0.distcp"), ((2, 0), (2, 3), "__1_0.distcp")])
    assert hash(te.chunks[0]) == hash(dcpmeta.Chunk((0, 0), (2, 3), "__0_0.distcp", 0, 900)) and \
        te.chunks[0] == dcpmeta.Chunk((0, 0), (2, 3), "__0_0.distcp", 0, 900)


def test_cli_refuses_a_payload_in_one_line(tmp_path, marker):
    """``zckpt info`` of a folder whose ``.metadata`` is the os.system payload: exit 1, one line naming the file and
    the global, no traceback, nothing run."""
    (tmp_path / ".metadata").write_bytes(_hostile(marker)["posix.system by STACK_GLOBAL"][0])
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "zckpt", "info", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    (line,) = run.stderr.splitlines()
    assert run.returncode == 1 and "posix.system" in line and str(tmp_path / ".metadata") in line, run.stderr
    assert "Traceback" not in run.stderr and not marker.exists()
    assert safeload.MAX_PICKLE_BYTES == 1 << 30


# ------------------------------------------------- values spliced into a genuine .metadata, where the reader reads

DEEP = b"]" * 10**6 + b"a" * (10**6 - 1)  # 10**6 nested lists (EMPTY_LIST ... APPEND): 2 MB
# a tuple of two references to the one below it, 80 levels: 2**80 paths (its repr or a walk of it never ends)
SHARED = b"]q\x00" + b"".join(b"h%ch%c\x86q%c" % (i, i, i + 1) for i in range(80))


def _genuine(planner: dict | None = None) -> bytes:
    """A real Metadata (torch's own classes) pickled at protocol 2 (no frames: a value can be swapped in)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    chunks = [ChunkStorageMetadata(offsets=torch.Size([2 * r, 0]), sizes=torch.Size([2, 3])) for r in range(2)]
    md = Metadata(state_dict_metadata={"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                                        torch.Size([4, 3]), chunks)},
                  storage_data={MetadataIndex("model.w", c.offsets): _StorageInfo(f"__{r}_0.distcp", 0, 900)
                                for r, c in enumerate(chunks)}, planner_data=planner)
    return pickle.dumps(md, protocol=2)


def _swap(data: bytes, old: bytes, new: bytes) -> bytes:
    """The first pickled text ``old`` (BINUNICODE) replaced by the opcodes ``new``."""
    op = b"X" + struct.pack("<I", len(old)) + old
    assert op in data
    return data.replace(op, new, 1)


SIZES = {"__0_0.distcp": 900, "__1_0.distcp": 900}


@pytest.mark.parametrize("where", ["fqn", "file", "dtype"])
@pytest.mark.parametrize("what", ["deep", "shared"])
def test_values_nested_or_shared_without_end_are_refused_in_one_line(where, what):
    """Read without walking the whole object (check_nesting: 5 s of a 10**6-chunk save), every value kept is checked
    where it is read, and no message prints an unchecked value: 10**6 nested lists, or a tuple with 2**80 paths, in
    place of a key's name, a file name or a dtype, are refused in one line at once."""
    import time
    new = DEEP if what == "deep" else SHARED
    data = _genuine()
    data = {"fqn": lambda: _swap(data, b"model.w", new),  # the first is the state_dict_metadata key
            "file": lambda: _swap(data, b"__0_0.distcp", new),
            "dtype": lambda: data.replace(b"ctorch\nbfloat16\n", new, 1)}[where]()  # (GLOBAL torch.bfloat16)
    t0 = time.perf_counter()
    with pytest.raises(ZckptError) as exc:  # (a list for a dtype: one zckpt does not read)
        dcpmeta.read_metadata(data, PATH, SIZES)
    msg = str(exc.value)
    assert PATH in msg and "\n" not in msg and len(msg) < 600 and "RecursionError" not in msg, msg
    assert time.perf_counter() - t0 < 10


def test_a_path_shared_by_every_key_is_not_walked_per_key():
    """planner_data: 2*10**4 keys naming one tuple of 10**5 names (a memo reference each): 2*10**9 names if each
    key's path were checked in full; read at once, the paths not taken."""
    import time
    data = _genuine({"ZKEYSENTINEL": "ZPATHSENTINEL"})
    names = b"(" + b"X\x01\x00\x00\x00a" * 10**5 + b"t" + b"r" + struct.pack("<I", 900000)  # MARK..TUPLE, memo'd
    keys = b"".join(b"X\x06\x00\x00\x00k%05dj" % i + struct.pack("<I", 900000) for i in range(2 * 10**4))
    key = b"X\x0c\x00\x00\x00ZKEYSENTINEL"
    value = b"X\x0d\x00\x00\x00ZPATHSENTINEL"
    at = data.index(value) + len(value)
    assert data[at] == ord("q") and data[at + 2] == ord("s")  # BINPUT, SETITEM
    # {"model.w": NAMES, "k00000": NAMES, ..., "ZKEYSENTINEL": "ZPATHSENTINEL"}: SETITEMS after one MARK
    data = data[:at + 2] + b"u" + data[at + 3:]
    data = data.replace(key, b"(X\x07\x00\x00\x00model.w" + names + keys + key, 1)
    t0 = time.perf_counter()
    got = dcpmeta.read_metadata(data, PATH, SIZES)
    assert time.perf_counter() - t0 < 10
    assert got.tensors["model.w"].shape == (4, 3) and got.path_of("model.w") == ("model.w",)


def test_a_state_key_that_is_not_a_name_is_refused():
    """A stand-in's state dict keyed by anything but a name (here the int 5) is refused, never turned into text
    (a crafted key's text may never end)."""
    import time
    data = _swap(_genuine(), b"relative_path", b"K\x05")
    t0 = time.perf_counter()
    with pytest.raises(CorruptFile) as exc:
        dcpmeta.read_metadata(data, PATH, SIZES)
    assert "not a name" in str(exc.value) and PATH in str(exc.value), str(exc.value)
    assert time.perf_counter() - t0 < 10


def test_chunks_checked_at_once_equal_the_chunk_by_chunk_read(monkeypatch):
    """Every committed ``.metadata`` (FSDP2, torchtitan, Megatron-Core saves): the chunks checked a tensor at a time
    (``_fast_chunks``) equal the chunk-by-chunk loop's; a chunk that fails any check sends the tensor to the loop,
    which names it (here: one past its tensor's size, one missing its storage entry, two at one offset)."""
    import dataclasses
    import os

    metas = sorted((ROOT / "fixtures").rglob(".metadata"))
    assert len(metas) >= 20
    for meta in metas:
        folder = meta.parent
        sizes = {n: os.path.getsize(folder / n) for n in os.listdir(folder) if n.endswith(".distcp")}
        fast = dcpmeta.read_metadata(meta.read_bytes(), str(meta), sizes)
        with monkeypatch.context() as m:
            m.setattr(dcpmeta, "_fast_chunks", lambda *a: None)
            slow = dcpmeta.read_metadata(meta.read_bytes(), str(meta), sizes)
        assert fast.tensors.keys() == slow.tensors.keys() and fast.values == slow.values, meta
        for k, te in fast.tensors.items():
            assert (te.dtype, te.shape, te.chunks) == (slow.tensors[k].dtype, slow.tensors[k].shape,
                                                       slow.tensors[k].chunks), (meta, k)
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    def md(offsets, stored):
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size([2, 3])) for o in offsets]
        return pickle.dumps(Metadata(
            state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                                                            chunks)},
            storage_data={MetadataIndex("w", torch.Size(o)): _StorageInfo("__0_0.distcp", 100 * i, 100)
                          for i, o in enumerate(stored)}))

    good = dcpmeta.read_metadata(md([[0, 0], [2, 0]], [[0, 0], [2, 0]]), PATH, {"__0_0.distcp": 200})
    assert [dataclasses.astuple(c) for c in good.tensors["w"].chunks] == \
        [((0, 0), (2, 3), "__0_0.distcp", 0, 100), ((2, 0), (2, 3), "__0_0.distcp", 100, 100)]
    for offsets, stored, words in (([[0, 0], [3, 0]], [[0, 0], [3, 0]], "lies outside its size"),
                                   ([[0, 0], [2, 0]], [[0, 0]], "no storage entry for the chunk of 'w' at [2, 0]"),
                                   ([[0, 0], [0, 0]], [[0, 0]], "overlap")):
        with pytest.raises(CorruptFile, match=re.escape(words)):
            dcpmeta.read_metadata(md(offsets, stored), PATH, {"__0_0.distcp": 200})
    with pytest.raises(CorruptFile, match="past its end"):
        dcpmeta.read_metadata(md([[0, 0], [2, 0]], [[0, 0], [2, 0]]), PATH, {"__0_0.distcp": 150})
