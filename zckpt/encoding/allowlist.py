"""The allow-listed unpickler: replays a torch pickle against a fixed list of globals, each mapped to an inert
stand-in or a checked callable (no DeepSpeed, no torch needed; anything else is :class:`~zckpt.errors.UnsafePickle`
naming it), within a copy budget proportional to the pickle's size. Storages become :class:`StorageRef` s once
the archive (:mod:`zckpt.encoding.safeload`) places them; tensors :class:`LazyTensor` s (:func:`unwrap`)."""

from __future__ import annotations

import _compat_pickle
import contextlib
import dataclasses
import gc
import pickle
import threading
from itertools import chain
from typing import Any, Callable

from zckpt.errors import CorruptFile, UnsafePickle, UnsupportedLayout
from zckpt.encoding.enums import MEGATRON_ENUMS, named_enum, signal_members
from zckpt.encoding.lazytensor import DTYPE_SIZES, LazyTensor, StorageRef

# elements the allow-listed callables (torch.Size, list, dict, ...) and stand-ins may copy while one pickle loads:
# COPY_FACTOR per byte of pickle plus COPY_BASE. A real pickle copies under one element per byte (each element
# costs at least a byte of opcodes); a crafted one copies one memo'd container again and again (``list(big)`` is 6
# bytes each time) and is refused at the bound, so memory and time stay proportional to the file's size.
COPY_FACTOR = 4
COPY_BASE = 1 << 20

_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
    "UntypedStorage": "uint8",
}
_TORCH_DTYPES = {
    "float64": "float64", "double": "float64", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64",
    "int32": "int32", "int": "int32", "int16": "int16", "short": "int16", "int8": "int8", "uint8": "uint8",
    "bool": "bool", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "complex64": "complex64", "complex128": "complex128",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
}


class _Budget:
    __slots__ = ("left", "size", "adopted")

    def __init__(self, size: int):
        self.left, self.size = COPY_FACTOR * size + COPY_BASE, size
        self.adopted: list[dict] = []  # the state dicts stand-ins took as their own, checked by settle()

    def settle(self) -> None:
        """At the end of a load: each state dict a stand-in took as its own (:meth:`Inert.__setstate__`) taken by
        one object only (a memo reference BUILDs many from one), keyed by names only, and charged. Checked here at
        once, each check one C loop over all of them (3 x 10**5 objects in a 10**5-chunk DCP ``.metadata``), not per
        object: taking a dict copies nothing, so nothing grows meanwhile, and nothing the load built is returned
        before these checks pass."""
        states = self.adopted
        if len(set(map(id, states))) != len(states):
            raise CorruptFile("crafted pickle: two objects built from one state (a memo reference)")
        try:
            "".join(chain.from_iterable(states))  # every key a str (a key's text is never made: a crafted one's is huge)
        except TypeError:
            raise CorruptFile("crafted pickle: the state of an object has a key that is not a name") from None
        self.left -= sum(map(len, states))
        if self.left < 0:
            _charge(0)


_ACTIVE = threading.local()  # the budget of the pickle this thread is loading (None outside a load)


def _charge(n: int) -> None:
    """Count ``n`` elements copied by a callable or stand-in against the current pickle's budget."""
    budget = getattr(_ACTIVE, "budget", None)
    if budget is not None:
        budget.left -= n
        if budget.left < 0:
            raise CorruptFile(f"crafted pickle: it copies more than {COPY_FACTOR} elements per byte of its "
                              f"{budget.size} bytes (memo references repeating a container)")


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector paused (where it was running) for the block: unpickling and checking a large
    pickle builds millions of live objects and no garbage, so each of the collector's passes over them is wasted
    (they are 80% of a plain ``pickle.load`` of a DCP ``.metadata`` of 10**5 chunks).

    What the block built (10**7 pieces of a 10**6-chunk Megatron save) is then moved to the oldest generation
    (``gc.freeze`` + ``gc.unfreeze``: two list splices, nothing frozen): left in the youngest, the collector's first
    pass after the block would walk all of it (1.2 s of that save's ``info``) and its next ones again."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            if gc.get_count()[0] >= PROMOTE_FROM:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


PROMOTE_FROM = 100_000  # objects built under a pause from which they are moved to the oldest generation


@contextlib.contextmanager
def _loading(size: int):
    """Around one C unpickler run: the copy budget for a ``size``-byte pickle, the garbage collector paused."""
    prev = getattr(_ACTIVE, "budget", None)
    _ACTIVE.budget = budget = _Budget(size)
    try:
        with gc_paused():
            yield
            budget.settle()
    finally:
        _ACTIVE.budget = prev


def _copied(func: Callable) -> Callable:
    """``func(x, ...)`` charged len(x) (builtins that copy their argument: list, dict, set, tuple ...)."""
    def call(*args):
        if args and hasattr(args[0], "__len__"):
            _charge(len(args[0]))
        return func(*args)
    call.__name__ = getattr(func, "__name__", "call")
    _ORIGINALS[call] = func
    return call


_ORIGINALS: dict[Callable, Callable] = {}  # charged wrapper -> the builtin (a defaultdict's factory is the builtin)


class Inert:
    """Stand-in for an allow-listed class (e.g. DeepSpeed's ``LossScaler``): keeps the pickled state, runs nothing."""

    _qualname = "?"

    def __init__(self, *args, **kwargs):
        self.__dict__["_args"] = args
        if kwargs:
            _charge(len(kwargs))
            self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if type(state) is dict and not self.__dict__:  # BUILD after NEWOBJ (every dataclass): the state dict
            budget = getattr(_ACTIVE, "budget", None)  # itself becomes the object's (never copied)
            if budget is not None:  # (a pickler writes a fresh state per object, names as keys: the load's end
                budget.adopted.append(state)  # checks all of them at once, _Budget.settle)
                self.__dict__ = state
                return
            try:
                "".join(state)  # every key a str
            except TypeError:
                pass
            else:
                self.__dict__ = state
                return
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if isinstance(state, dict):
            _charge(len(state))
            if not all(isinstance(k, str) for k in state):  # (never str() of a key: a crafted one's text is huge)
                raise CorruptFile(f"crafted pickle: the state of a {self._qualname} has a key that is not a name")
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def get(self, key, default=None):
        return self.__dict__.get(key, default)

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return f"{self._qualname}({fields})"


class EnumValue(int):
    """Stand-in for an IntEnum member such as ``ZeroStageEnum.gradients`` (an int that remembers its class)."""

    _qualname = "?"

    def __repr__(self) -> str:
        return f"{self._qualname}({int(self)})"


class TorchDtype(str):
    """Stand-in for a pickled ``torch.<dtype>`` object: its canonical name."""


class TorchDevice(str):
    """Stand-in for a pickled ``torch.device``."""


def _inert_class(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (Inert,), {"_qualname": qualname})


def _enum_class(qualname: str) -> Callable:
    cls = type(qualname.rsplit(".", 1)[-1], (EnumValue,), {"_qualname": qualname})
    return lambda value: cls(value)


def _size(*args):
    if not args:
        return ()
    if type(args[0]) is tuple:  # (torch pickles a Size as its tuple: kept as it is, nothing copied or charged)
        return args[0]
    budget = getattr(_ACTIVE, "budget", None)  # _charge, inline: three of these per DCP chunk
    if budget is not None:
        budget.left -= len(args[0])
        if budget.left < 0:
            _charge(0)
    return tuple(args[0])


def _device(*args):
    if not all(a is None or type(a) in (str, int) for a in args):
        raise CorruptFile(f"pickle builds torch.device from {str(args)[:60]}")
    return TorchDevice(":".join(str(a) for a in args if a is not None))


def _str(*args):
    # str() of a container is its repr: a crafted pickle would ask for the text of a huge shared structure
    if args and not isinstance(args[0], (str, bytes, int, float, complex, bool)):
        raise CorruptFile(f"pickle calls str on a {type(args[0]).__name__}")
    if args:
        _charge(len(args[0]) if isinstance(args[0], (str, bytes)) else 1)
    return str(*args)


def _ordered_dict(*args):
    import collections
    if args and hasattr(args[0], "__len__"):
        _charge(len(args[0]))
    return collections.OrderedDict(*args)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    # protocol-2 pickles store bytes as _codecs.encode(str, 'latin1'); nothing else is needed
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickle(f"pickle calls _codecs.encode with {type(obj).__name__}/{encoding!r}")
    _charge(len(obj))
    return obj.encode(encoding, errors)


def _bytearray(*args):
    # bytearray(n) would allocate n bytes: a two-byte pickle could ask for gigabytes
    if args and isinstance(args[0], int) and args[0] > 1 << 20:
        raise CorruptFile(f"pickle asks for a bytearray of {args[0]} bytes")
    if args:
        _charge(args[0] if isinstance(args[0], int) else len(args[0]) if hasattr(args[0], "__len__") else 0)
    return bytearray(*args)


def _defaultdict(factory=None, *args):
    import collections
    if args and hasattr(args[0], "__len__"):
        _charge(len(args[0]))
    factory = _ORIGINALS.get(factory, str if factory is _str else factory)
    return collections.defaultdict(factory if factory in (list, dict, int, float, set, str) else None, *args)


def _numpy_allowed(name: str):
    import numpy as np
    if name in ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar"):
        def scalar(dtype, data=None):
            if not isinstance(dtype, np.dtype) or dtype.hasobject:
                raise UnsafePickle("numpy scalar of object dtype")
            return np.frombuffer(data, dtype=dtype, count=1)[0] if data is not None else dtype.type()
        return scalar
    if name in ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"):
        def reconstruct(cls, shape, dtype):
            if cls is not np.ndarray:
                raise UnsafePickle("numpy array subclass")
            return _SafeNdarray(shape, dtype)
        return reconstruct
    if name == "numpy.ndarray":
        return np.ndarray
    if name == "numpy.dtype":
        def dtype(spec, align=False, copy=False):
            if not isinstance(spec, str) or spec.startswith("O"):
                raise UnsafePickle(f"numpy dtype {spec!r}")
            return _SafeDtype(np.dtype(spec))
        return dtype
    return None


class _SafeDtype:
    """numpy dtype under construction: BUILD gives its state; object dtypes are refused."""

    def __init__(self, dt):
        self.dt = dt

    def __setstate__(self, state):
        # (version, byteorder, subarray, names, fields, elsize, alignment, flags)
        if isinstance(state, tuple) and len(state) >= 2 and state[1] in ("<", ">", "=", "|"):
            if state[3] is not None or state[2] is not None:
                raise UnsafePickle("structured numpy dtype")
            self.dt = self.dt.newbyteorder(state[1]) if state[1] in "<>" else self.dt
        if self.dt.hasobject:
            raise UnsafePickle("numpy object dtype")


class _SafeNdarray:
    """numpy array under construction; BUILD supplies (version, shape, dtype, fortran, raw bytes)."""

    def __init__(self, shape, dtype):
        self.value = None

    def __setstate__(self, state):
        import numpy as np
        _, shape, dtype, fortran, raw = state
        dt = dtype.dt if isinstance(dtype, _SafeDtype) else dtype
        if not isinstance(dt, np.dtype) or dt.hasobject or not isinstance(raw, (bytes, bytearray)):
            raise UnsafePickle("numpy array with object data")
        _charge(len(raw))
        arr = np.frombuffer(bytes(raw), dtype=dt).reshape(shape, order="F" if fortran else "C")
        self.value = arr


_TENSOR_REBUILDS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    *rest):
    if not isinstance(storage, _PendingStorage):
        raise CorruptFile("tensor rebuilt from something that is not a storage")
    _charge(len(size) + len(stride))
    dtype = storage.dtype
    if rest and isinstance(rest[0], TorchDtype):  # _rebuild_tensor_v3(..., dtype, metadata)
        dtype = str(rest[0])
    size = size if type(size) is tuple and set(map(type, size)) <= _INT else tuple(int(s) for s in size)
    stride = stride if type(stride) is tuple and set(map(type, stride)) <= _INT else tuple(int(s) for s in stride)
    return storage.tensor(int(storage_offset), size, stride, dtype)


_INT = {int}


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if isinstance(data, LazyTensor) and isinstance(state, dict):
        _charge(len(state))
        data.attrs.update({str(k): v for k, v in state.items() if isinstance(v, (int, float, str, bool))})
    return data


def _rebuild_from_type_v2(func, new_type, args, state=None):
    result = func(*args)
    return _rebuild_parameter(result, False, None, state if isinstance(state, dict) else None)


def _reconstructor(cls, base, state=None):
    """``copyreg._reconstructor`` limited to stand-in classes (protocol 0/1 style plain objects)."""
    if not (isinstance(cls, type) and issubclass(cls, Inert)) or base is not object:
        raise UnsafePickle("copyreg._reconstructor of a class outside the allow-list")
    obj = cls()
    if isinstance(state, dict):
        obj.__setstate__(state)
    return obj


def _tensor_class(*args):
    raise UnsafePickle("pickle constructs a torch.Tensor directly")


_ALLOWED: dict[str, Any] = {
    "collections.OrderedDict": _ordered_dict,
    "collections.defaultdict": _defaultdict,
    "builtins.set": _copied(set),
    "builtins.frozenset": _copied(frozenset),
    "builtins.bytearray": _bytearray,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "builtins.list": _copied(list),
    "builtins.dict": _copied(dict),
    "builtins.int": int,
    "builtins.float": float,
    "builtins.str": _str,
    "builtins.tuple": _copied(tuple),
    "_codecs.encode": _codecs_encode,
    "copyreg._reconstructor": _reconstructor,
    "builtins.object": object,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _tensor_class,
    "torch.nn.parameter.Parameter": _tensor_class,
    "torch.Size": _size,
    "torch.device": _device,
    # DeepSpeed classes seen in real checkpoints (0.6 .. 0.19.8)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _inert_class("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler":
        _inert_class("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase":
        _inert_class("deepspeed.runtime.fp16.loss_scaler.LossScalerBase"),
    "deepspeed.utils.tensor_fragment.fragment_address": _inert_class("deepspeed.utils.tensor_fragment.fragment_address"),
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_class("deepspeed.runtime.zero.config.ZeroStageEnum"),
    "deepspeed.runtime.zero.stage_1_and_2.ZeroStageEnum": _enum_class("deepspeed.runtime.zero.config.ZeroStageEnum"),
    "argparse.Namespace": _inert_class("argparse.Namespace"),  # Megatron-DeepSpeed client state, Megatron-LM args
}
# Megatron-LM's common.pt: its args Namespace names megatron-core's enums (zckpt.encoding.enums), as names
for _name, _members in MEGATRON_ENUMS.items():
    _ALLOWED[_name] = named_enum(_name, _members)
_ALLOWED["signal.Signals"] = named_enum("signal.Signals", signal_members)  # Megatron-LM's exit_signal (SIGTERM)
for _name in ("megatron.core.optimizer.optimizer_config.OptimizerConfig", "types.SimpleNamespace"):
    _ALLOWED[_name] = _inert_class(_name)  # dataclass / namespace: their fields kept, nothing run


def _posix_path(*parts):
    """``pathlib.PosixPath`` (in megatron-core's SAFE_GLOBALS: a path in the args) as its text; no filesystem."""
    if not all(type(p) is str for p in parts):
        raise UnsafePickle("pickle builds a pathlib.PosixPath from something other than strings")
    _charge(sum(map(len, parts)))
    import posixpath
    return posixpath.join(*parts) if parts else "."


_ALLOWED["pathlib.PosixPath"] = _posix_path
for _name in _STORAGE_DTYPES:
    _ALLOWED[f"torch.{_name}"] = ("storage", _STORAGE_DTYPES[_name])
_ALLOWED["torch.storage.UntypedStorage"] = ("storage", "uint8")
for _name, _dt in _TORCH_DTYPES.items():
    _ALLOWED[f"torch.{_name}"] = TorchDtype(_dt)

ALLOWED_GLOBALS = frozenset(_ALLOWED) | {
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
}


class _PendingStorage:
    """A storage seen in the pickle; becomes a :class:`StorageRef` once its zip entry is located (``reader``: the
    file's archive, :mod:`zckpt.encoding.safeload`'s zip or legacy one: its ``storage_ref(key, dtype, numel)``)."""

    def __init__(self, reader: Any, key: str, dtype: str, numel):
        self.reader, self.key, self.dtype = reader, key, dtype
        self.ref = reader.storage_ref(key, dtype, numel)
        self.tensors: list[LazyTensor] = []

    def place(self, offset: int) -> None:
        """Give the storage (and its tensors) their byte offset, once a legacy file's layout is known."""
        self.ref = dataclasses.replace(self.ref, offset=offset)
        for t in self.tensors:
            t.storage = dataclasses.replace(t.storage, offset=offset)

    def tensor(self, storage_offset, shape, stride, dtype):
        if dtype != self.dtype and self.dtype != "uint8":
            raise CorruptFile(f"tensor dtype {dtype} disagrees with its storage dtype {self.dtype}")
        ref = self.ref if dtype == self.ref.dtype else StorageRef(self.ref.path, self.ref.key, dtype,
                                                                    self.ref.offset, self.ref.nbytes, self.ref.crc)
        if (shape and min(shape) < 0) or (stride and min(stride) < 0) or storage_offset < 0:
            raise CorruptFile("tensor with negative shape, stride or offset")
        span = 1 + sum((d - 1) * s for d, s in zip(shape, stride)) if all(shape) else 0
        if span and (storage_offset + span) * DTYPE_SIZES[dtype] > ref.nbytes:
            raise CorruptFile(f"tensor of shape {list(shape)} overruns its storage {self.key} "
                              f"({ref.nbytes} bytes)")
        t = LazyTensor(ref, storage_offset, shape, stride, dtype)
        self.tensors.append(t)
        return t


class _Feed:
    """``data`` as the file of a C unpickler: its ``peek`` hands over all of the bytes at once (the unpickler then
    reads from memory, as ``pickle.loads`` does, instead of calling ``read`` for each opcode)."""

    def __init__(self, data):
        self.data, self.pos = memoryview(data), 0

    def peek(self, n: int = 0):
        return self.data[self.pos:]

    def read(self, n: int = -1):
        end = len(self.data) if n is None or n < 0 else self.pos + n
        out = self.data[self.pos:end]
        self.pos += len(out)
        return bytes(out)

    def readinto(self, b) -> int:
        out = self.data[self.pos:self.pos + len(b)]
        b[:len(out)] = out
        self.pos += len(out)
        return len(out)

    def readline(self):
        nl = bytes(self.data[self.pos:]).find(b"\n")  # protocol 0 text opcodes only
        return self.read(nl + 1 if nl >= 0 else -1)


class SafeUnpickler(pickle.Unpickler):
    """The allow-list's unpickler over ``data``; ``archive`` (``.path``, ``storage_ref(key, dtype, numel)``)
    places the storages the pickle names. A result with ``placeholders`` set needs :func:`unwrap`."""

    def __init__(self, data: bytes, archive: Any):
        super().__init__(_Feed(data), encoding="utf-8")
        self.archive, self.size = archive, len(data)
        self.storages: dict[str, _PendingStorage] = {}
        self.placeholders = False  # a numpy placeholder or a pending storage was made: the result needs unwrap

    def load(self):
        with _loading(self.size):
            return super().load()

    def find_class(self, module, name):
        # protocol-2 pickles (torch's default) use Python 2 names: __builtin__.set, copy_reg ...
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        qual = f"{module}.{name}"
        if qual in _ALLOWED:
            value = _ALLOWED[qual]
            return value
        if qual in ALLOWED_GLOBALS:
            value = _numpy_allowed(qual)
            if value is not None:
                self.placeholders = True
                return value
        raise UnsafePickle(f"pickle names the global '{qual}', which is not on zckpt's allow-list",
                           path=self.archive.path)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise CorruptFile(f"unexpected persistent id {str(pid)[:80]!r}")
        stype, key = pid[1], str(pid[2])
        if not (isinstance(stype, tuple) and stype[0] == "storage"):
            raise CorruptFile(f"storage of unknown type {str(stype)[:80]!r}")
        if len(pid) > 5 and pid[5] is not None:  # legacy files: torch writes None (views are whole storages)
            raise UnsupportedLayout("legacy torch file with a storage view", path=self.archive.path)
        if key not in self.storages:
            self.storages[key] = _PendingStorage(self.archive, key, stype[1], pid[4])
            self.placeholders = True
        return self.storages[key]


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, TorchDtype, TorchDevice,
                     LazyTensor, StorageRef})  # a LazyTensor's storage is a StorageRef already, its attrs plain


def unwrap(obj, depth=0, seen=None):
    """Replace construction helpers (numpy placeholders, pending storages) by their final values.

    Each container is walked once (``seen``: id -> its result): a crafted pickle that references one container
    from many places (memo GETs: a list of 2**60 paths in a few hundred bytes) costs one walk per object, not one
    per path."""
    if depth > 200:
        raise CorruptFile("pickle nests deeper than 200 levels")
    if type(obj) in _LEAVES:
        return obj
    if seen is None:
        seen = {}
    done = seen.get(id(obj))
    if done is not None:
        return done[1]
    if isinstance(obj, _SafeNdarray):
        out = obj.value
    elif isinstance(obj, _SafeDtype):
        out = obj.dt
    elif isinstance(obj, _PendingStorage):
        out = obj.ref
    elif isinstance(obj, dict):
        seen[id(obj)] = (obj, obj)
        for k, v in list(obj.items()):
            if type(v) not in _LEAVES:  # most values: no call
                obj[k] = unwrap(v, depth + 1, seen)
        return obj
    elif isinstance(obj, list):
        seen[id(obj)] = (obj, obj)
        for i, v in enumerate(obj):
            if type(v) not in _LEAVES:
                obj[i] = unwrap(v, depth + 1, seen)
        return obj
    elif isinstance(obj, tuple):
        out = type(obj)(unwrap(v, depth + 1, seen) for v in obj) if not hasattr(obj, "_fields") else obj
    elif isinstance(obj, Inert):
        seen[id(obj)] = (obj, obj)
        for k, v in list(obj.__dict__.items()):
            obj.__dict__[k] = unwrap(v, depth + 1, seen)
        return obj
    else:
        out = obj
    seen[id(obj)] = (obj, out)  # obj is kept alive with its id
    return out
