"""zckpt's pickles of planned objects (zckpt.engine.torchzip.dumps): the C pickler with placeholder globals gives
the bytes of the pure-Python pickler, falls back to it when the data holds a placeholder's text, leaves nothing
behind, and is safe from threads; what it writes is what torch.load and zckpt's own safeload read."""

from __future__ import annotations

import io
import pickle
import struct
import sys
import threading

import pytest

from zckpt.engine import torchzip
from zckpt.engine.torchzip import GlobalRef, Reduce, TensorOut, dumps, enum_member, plain_object


def _slow(obj):
    tensors: list = []
    buf = io.BytesIO()
    torchzip._Pickler(buf, tensors).dump(obj)
    return buf.getvalue(), tensors


def _obj(name: str = "layer.0.weight"):
    t = TensorOut("float32", (2, 3), [struct.pack("<6f", *range(6))])
    shared = TensorOut("bfloat16", (4,), [b"\x00" * 8])
    return {
        "module": {name: t, "tied": t, "b": shared},
        "optimizer": {"state": {0: {"exp_avg": shared, "step": 3}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "scaler": plain_object("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", {"cur_scale": 2.0 ** 16}),
        "stage": enum_member("deepspeed.runtime.zero.config", "ZeroStageEnum", 2),
        "size": Reduce(GlobalRef("torch", "Size"), ((2, 3),)),
        "nested": [(1, "a", None, True, 2.5, b"raw"), {"k": [GlobalRef("torch", "float32")] * 3}],
    }


def _read_torch(data: bytes, tensors):
    torch = pytest.importorskip("torch")
    flats = [torch.frombuffer(bytearray(b"".join(s for s in t.segments)), dtype=getattr(torch, t.dtype))
             for t in tensors]

    class U(pickle.Unpickler):
        def persistent_load(self, pid):
            flat = flats[int(pid[2])]
            return torch.storage.TypedStorage(wrap_storage=flat.untyped_storage(), dtype=flat.dtype, _internal=True)

        def find_class(self, module, name):
            if module.startswith("deepspeed"):
                return type(name, (), {"__setstate__": lambda self, st: self.__dict__.update(st)}) \
                    if name != "ZeroStageEnum" else int
            return super().find_class(module, name)

    return U(io.BytesIO(data)).load()


def test_fast_pickle_is_the_slow_pickle(monkeypatch):
    obj = _obj()
    slow, st = _slow(obj)

    def no_fallback(self, obj):
        raise AssertionError("the pure-Python pickler ran")

    monkeypatch.setattr(torchzip._Pickler, "dump", no_fallback)
    fast, ft = dumps(obj)
    assert fast == slow
    assert [id(t) for t in ft] == [id(t) for t in st] and len(ft) == 2  # each tensor once, in key order
    assert b"zckpt.engine._pickle_globals" not in fast
    got = _read_torch(fast, ft)
    assert got["module"]["tied"] is got["module"]["layer.0.weight"]
    assert got["module"]["layer.0.weight"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["optimizer"]["state"][0]["exp_avg"].data_ptr() == got["module"]["b"].data_ptr()
    assert got["stage"] == 2 and got["scaler"].cur_scale == 65536.0 and tuple(got["size"]) == (2, 3)


def test_a_plain_pickle_is_the_slow_pickle_and_refuses_tensors():
    """``dumps(obj, plain=True)`` (a DCP ``.metadata``: no persistent ids asked): the same bytes as the Python
    pickler's for an object without tensors, and a tensor in it is refused, not written as a zckpt class."""
    obj = _obj()
    for key in ("module", "optimizer"):
        obj.pop(key)
    slow, _ = _slow(obj)
    fast, ft = dumps(obj, plain=True)
    assert fast == slow and ft == []
    import pickle  # no persistent_id of zckpt's for the C pickler to call on each object
    assert not [c for c in torchzip._FastPlain.__mro__ if c is not pickle.Pickler and "persistent_id" in vars(c)]
    assert "persistent_id" in vars(torchzip._FastPickler)
    with pytest.raises(ValueError, match="tensor"):
        dumps(_obj(), plain=True)


def test_nothing_left_behind_and_module_name_restored():
    dumps(_obj())
    placeholders = sys.modules["zckpt.engine._pickle_globals"]
    assert not [k for k in vars(placeholders) if k.startswith("g")]
    assert GlobalRef.__module__ == "zckpt.engine.torchzip"


def test_data_holding_a_placeholder_falls_back_to_the_slow_pickler(monkeypatch):
    """A key that spells a placeholder GLOBAL is data: the substitution is skipped, the Python pickler writes all."""
    name = "czckpt.engine._pickle_globals\ng0\n"
    calls = []
    real = torchzip._Pickler.dump
    monkeypatch.setattr(torchzip._Pickler, "dump", lambda self, obj: calls.append(1) or real(self, obj))
    obj = _obj(name)
    fast, ft = dumps(obj)
    assert calls  # the fallback ran
    monkeypatch.undo()
    slow, _ = _slow(obj)
    assert fast == slow
    got = _read_torch(fast, ft)
    assert name in got["module"] and got["module"][name].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_dumps_from_threads():
    objs = [_obj(f"layer.{i}.weight") for i in range(16)]
    want = [_slow(o)[0] for o in objs]
    got = [None] * len(objs)

    def run(i):
        for _ in range(20):
            got[i] = dumps(objs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(objs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_saved_file_loads_in_torch_and_safeload(tmp_path):
    torch = pytest.importorskip("torch")
    from zckpt.encoding import safeload
    obj = {"w": TensorOut("float32", (3,), [struct.pack("<3f", 1.0, 2.0, 3.0)]),
           "size": Reduce(GlobalRef("torch", "Size"), ((3,),))}
    path = tmp_path / "x.pt"
    torchzip.save(obj, str(path))
    assert torch.load(path, weights_only=True)["w"].tolist() == [1.0, 2.0, 3.0]
    assert tuple(safeload.load(str(path))["size"]) == (3,)


def test_lone_tensor_archives_share_a_layout_and_load_in_torch(tmp_path):
    """Archives of lone tensors reuse the first one's layout (DCP chunks): every entry as the full planning gives it,
    but for the tensor's bytes and a serialization id of their own; what is written loads in torch with its bytes."""
    torch = pytest.importorskip("torch")
    tensors = [TensorOut("float32", (2, 3), [struct.pack("<6f", *range(k, k + 6))]) for k in range(3)]
    full = [torchzip._plan_archive(t, "archive") for t in tensors]
    quick = [torchzip.plan_archive(t, "archive") for t in tensors]
    for a, b in zip(full, quick):
        assert (a.size, a.file_size) == (b.size, b.file_size)
        for x, y in zip(a.entries, b.entries):
            assert (x.name, x.size, x.header_offset, x.data_offset) == (y.name, y.size, y.header_offset, y.data_offset)
            if x.name.endswith("serialization_id"):
                continue
            assert (x.crc, x.local_header) == (y.crc, y.local_header)
            if isinstance(x.data, TensorOut):
                assert y.data is tensors[quick.index(b)]
            else:
                assert y.data == x.data
    ids = {torchzip.serialization_id(a) for a in quick}
    assert len(ids) == 3
    for k, a in enumerate(quick):
        path = tmp_path / f"t{k}.pt"
        torchzip.write_planned(a, str(path))
        got = torch.load(path, weights_only=True)
        assert torch.equal(got, torch.arange(k, k + 6, dtype=torch.float32).reshape(2, 3))
    with pytest.raises(ValueError, match="segments hold 5 elements"):
        torchzip.plan_archive(TensorOut("float32", (2, 3), [struct.pack("<5f", *range(5))]), "archive")
