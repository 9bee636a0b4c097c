"""zckpt's numpy casts are bit-identical to torch's Tensor.to on every class of value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from zckpt.encoding.casting import cast

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65520.0, 65536.0,
                     3.4028235e38, 1e-45, -1e-45, 1.1754944e-38, 6e-8, 5.9604645e-8, 2.98e-8, 1.00390625,
                     1.005859375, 1.0078125, 0.1, 1 / 3], dtype=np.float32)


def _torch(raw, src, dst):
    t = torch.from_numpy(raw.copy()).view(getattr(torch, src)).to(getattr(torch, dst))
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_downcasts_match_torch(dst):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype(np.uint32)  # every kind of bit pattern
    vals = np.concatenate([SPECIALS, bits.view(np.float32), rng.standard_normal(4097).astype(np.float32)])
    raw = vals.view(np.uint8)
    assert np.array_equal(cast(raw, "float32", dst), _torch(raw, "float32", dst))
    assert np.array_equal(cast(raw, "float32", dst, use_torch=True), _torch(raw, "float32", dst))


@pytest.mark.parametrize("src", ["bfloat16", "float16"])
def test_upcasts_exact(src):
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.uint8)  # all 65536 bit patterns
    assert np.array_equal(cast(every, src, "float32"), _torch(every, src, "float32"))
    other = "float16" if src == "bfloat16" else "bfloat16"
    assert np.array_equal(cast(every, src, other), _torch(every, src, other))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=300))
def test_random_floats(values):
    raw = np.array(values, dtype=np.float32).view(np.uint8)
    for dst in ("bfloat16", "float16"):
        assert np.array_equal(cast(raw, "float32", dst), _torch(raw, "float32", dst))


def test_pure_bf16_upcast_is_torch_on_every_pattern():
    """The numpy-free bf16 -> fp32 path (small merges) equals torch's conversion on all 65536 patterns, NaNs too."""
    from zckpt.encoding.casting import upcast_bf16_pure
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    out = np.frombuffer(upcast_bf16_pure(memoryview(every.tobytes())), dtype=np.uint8)
    assert np.array_equal(out, _torch(every, "bfloat16", "float32"))


@pytest.mark.parametrize("src", ["int64", "int32", "int16", "int8", "uint8", "bool"])
@pytest.mark.parametrize("dst", ["float32", "float64"])
def test_integers_to_floats_match_torch_without_torch(src, dst, monkeypatch):
    """Integers (a step count, an index buffer: reshard --format universal writes them as fp32) are cast by numpy
    exactly as torch does, round to nearest even past 2**24 / 2**53 included; torch is not needed for it."""
    import sys
    rng = np.random.default_rng(0)
    if src == "bool":
        a = rng.integers(0, 2, 4096).astype(bool)
    elif src == "int64":
        a = np.concatenate([rng.integers(-2**63, 2**63 - 1, 4096, dtype=np.int64),
                            np.array([2**24 + 1, 2**24 + 3, 2**53 + 1, -(2**63), 2**63 - 1], dtype=np.int64)])
    else:
        info = np.iinfo(src)
        a = rng.integers(info.min, info.max, 4096, dtype=src, endpoint=True)
    want = torch.from_numpy(a.copy()).to(getattr(torch, dst)).numpy().view(np.uint8).tobytes()
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch would fail here
    assert cast(a.view(np.uint8), src, dst).tobytes() == want


def _edges() -> np.ndarray:
    """Every fp32 sign, exponent and high mantissa bits (all 65536 high halves) with the low halves that decide a
    rounding to bf16 (bit 16) or to fp16 (bit 13): below, at and above half an ulp, with the kept lsb clear or set;
    NaNs left out (torch's kernels decide their bits: those chunks go to torch)."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2FFF, 0x3000, 0x3001, 0x7FFF, 0x8000, 0x8001,
                     0xFFFF, 0x5A5A], dtype=np.uint32)
    u = (hi[:, None] | lows[None, :]).ravel()
    return u[~np.isnan(u.view(np.float32))]


@pytest.mark.parametrize("kernel", ["ml_dtypes", "numpy"])
@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_numpy_downcasts_match_torch_at_every_rounding_edge(dst, kernel, monkeypatch):
    """The kernels without torch (torch not importable while they run; bf16: ml_dtypes' cast, and numpy's integer
    passes where ml_dtypes is missing): every exponent, subnormals, the overflow to infinity and the
    round-half-to-even cases, bit for bit as torch; a shorter chunk after a longer one (the per-thread buffers
    reused); the same bits written into a caller's buffer."""
    import sys
    from zckpt.encoding import casting
    raw = _edges().view(np.uint8)
    want = _torch(raw, "float32", dst)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(casting, "_USE_ML", None)
    if kernel == "numpy":
        monkeypatch.setattr(casting, "_ML_BF16", None)  # as where ml_dtypes is not installed
    else:
        monkeypatch.setattr(casting, "ML_SLOW_FROM", 0)  # its import paying whatever its version
    assert casting.fast_bf16() == (kernel == "ml_dtypes")
    assert np.array_equal(cast(raw, "float32", dst), want)
    assert np.array_equal(cast(raw[:4 * 10007], "float32", dst), want[:2 * 10007])
    out = bytearray(2 * 10007)
    got = cast(raw[:4 * 10007], "float32", dst, out=memoryview(out))
    assert bytes(out) == want[:2 * 10007].tobytes() and np.shares_memory(got, np.frombuffer(out, np.uint8))


@pytest.mark.parametrize("src,dst", [("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float16"),
                                     ("float16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float16"),
                                     ("int64", "float32"), ("float32", "float32")])
@pytest.mark.parametrize("use_torch", [False, True])
def test_cast_into_a_callers_buffer(src, dst, use_torch):
    """``out=``: every path writes its result into the caller's buffer (a job's output buffer, no copy after the
    cast), NaN chunks (torch's path) included, bit for bit what it returns without ``out``; a buffer of another
    size is refused."""
    from zckpt.encoding.lazytensor import DTYPE_SIZES
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, 4096 * 8, dtype=np.uint8)
    if src == "float32":
        raw = np.concatenate([SPECIALS, rng.standard_normal(4096).astype(np.float32)]).view(np.uint8)
    elif src == "int64":
        raw = rng.integers(-2**40, 2**40, 4096, dtype=np.int64).view(np.uint8)
    n = raw.size // DTYPE_SIZES[src]
    want = cast(raw, src, dst, use_torch).copy()
    out = bytearray(n * DTYPE_SIZES[dst])
    cast(raw, src, dst, use_torch, out=memoryview(out))
    assert bytes(out) == want.tobytes()
    if src != dst:
        assert bytes(out) == _torch(raw, src, dst).tobytes()
    with pytest.raises(ValueError):
        cast(raw, src, dst, use_torch, out=memoryview(bytearray(len(out) + 2)))


def test_torch_path_reuses_its_buffer_and_stays_exact():
    """Casts through torch (a process that imported it) write into one per-thread buffer: a larger chunk after a
    smaller one and a smaller after a larger both give torch's bits."""
    rng = np.random.default_rng(1)
    for n in (1000, 300000, 77):
        raw = rng.standard_normal(n).astype(np.float32).view(np.uint8)
        for dst in ("bfloat16", "float16"):
            assert np.array_equal(cast(raw, "float32", dst, use_torch=True), _torch(raw, "float32", dst))


_MERGE = r'''
import sys, hashlib
from pathlib import Path
from zckpt.encoding import casting
casting.TORCH_CAST_FROM = int(sys.argv[3])
if sys.argv[5] == "no-ml":
    casting._ML_BF16 = None  # as where ml_dtypes is not installed
elif sys.argv[5] == "ml":
    casting.ML_SLOW_FROM = 0  # its import pays for any casts, whatever its version
else:  # "slow-ml": an ml_dtypes whose import is slow (0.7 under numpy 2.4), the default threshold
    casting._slow_import = lambda version: True
from zckpt.ops.merge import merge
merge(sys.argv[1], sys.argv[2], dtype=sys.argv[4])
print("torch" in sys.modules, "ml_dtypes" in sys.modules,
      hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(sys.argv[2]).glob("*.safetensors")))).hexdigest())
'''


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_large_downcasts_import_torch_and_write_the_same_bytes(tmp_path, dtype):
    """A merge whose slow down-casts read at least ``TORCH_CAST_FROM`` bytes imports torch and casts with its
    kernel; a smaller one never imports it (a fresh process each); fp32 -> bf16 is slow only without ml_dtypes
    (numpy's passes), so with it even a threshold of 1 byte imports no torch for bf16. An ml_dtypes whose import is
    slow (0.7) is not imported for casts below ``ML_SLOW_FROM``: numpy's passes, and with a threshold of 1 byte
    torch. All write the same bytes (the fp32 masters of a real DeepSpeed save, cast to bf16 / fp16)."""
    import subprocess
    import sys
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "fixtures" / "z2_bf16_ws2"
    got = {}
    runs = [("numpy", 1 << 62, "no-ml"), ("torch", 1, "no-ml")]
    if dtype == "bf16":
        runs += [("ml_dtypes", 1, "ml"), ("slow-ml", 1 << 62, "slow-ml"), ("slow-ml-torch", 1, "slow-ml")]
    for name, threshold, ml in runs:
        run = subprocess.run([sys.executable, "-c", _MERGE, str(src), str(tmp_path / name), str(threshold), dtype,
                              ml], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        got[name] = run.stdout.split()
    assert got["numpy"][:2] == ["False", "False"] and got["torch"][0] == "True", got
    assert got["numpy"][2] == got["torch"][2]
    if dtype == "bf16":  # (fp16's kernels do not depend on ml_dtypes)
        assert got["ml_dtypes"] == ["False", "True", got["numpy"][2]], got
        assert got["slow-ml"] == ["False", "False", got["numpy"][2]], got
        assert got["slow-ml-torch"] == ["True", "False", got["numpy"][2]], got


def test_slow_downcast_bytes(monkeypatch):
    """What torch_pays weighs: fp32 -> fp16 always, fp32 -> bf16 only where ml_dtypes does not cast it (missing,
    or slow to import for this many bytes), nothing else."""
    import sys
    from types import SimpleNamespace as T
    from zckpt.encoding import casting
    casts = [T(numel=10, src_dtype="float32", dtype="bfloat16"), T(numel=100, src_dtype="float32", dtype="float16"),
             T(numel=1000, src_dtype="bfloat16", dtype="float32"), T(numel=7, src_dtype="bfloat16", dtype="float16")]
    monkeypatch.setattr(casting, "_USE_ML", None)
    monkeypatch.delitem(sys.modules, "ml_dtypes", raising=False)
    monkeypatch.setattr(casting, "_ml_version", lambda: (0, 6))  # quick to import
    assert casting.slow_downcast_bytes(casts) == 400 and casting.fast_bf16()
    monkeypatch.delitem(sys.modules, "ml_dtypes", raising=False)
    monkeypatch.setattr(casting, "_slow_import", lambda version: True)  # (0.7 under numpy 2.4, say)
    assert casting.slow_downcast_bytes(casts) == 440 and "ml_dtypes" not in sys.modules
    monkeypatch.setattr(casting, "ML_SLOW_FROM", 40)
    assert casting.slow_downcast_bytes(casts) == 400 and casting._USE_ML
    monkeypatch.setattr(casting, "_ML_BF16", None)
    assert casting.slow_downcast_bytes(casts) == 440


def test_ml_dtypes_imported_only_where_it_pays(monkeypatch, tmp_path):
    """ml_dtypes imported already: used, at no cost; not installed: never; installed: used where it imports
    quickly (before ``ML_SLOW_IMPORT``, or under numpy ``NUMPY_QUICK`` or later), else only for casts of
    ``ML_SLOW_FROM`` bytes or more. Its version is read from its ``__init__.py`` without importing it (the
    installed one's is ml_dtypes' own); a version that cannot be read is weighed as slow."""
    import importlib.util
    import sys
    from types import SimpleNamespace
    import ml_dtypes
    from zckpt.encoding import casting
    assert casting._ml_version() == tuple(int(x) for x in ml_dtypes.__version__.split(".")[:2])
    assert casting.ml_pays(0)  # (imported in this process)
    monkeypatch.delitem(sys.modules, "ml_dtypes")
    for numpy_version, slow in (("2.4.6", True), ("2.3.5", True), ("1.26.4", True), ("2.5.2", False),
                                ("2.6.0rc1", False), ("3.0.0", False)):
        monkeypatch.setattr(np, "__version__", numpy_version)
        for version, small, large in (((0, 5), True, True), ((0, 6), True, True), ((0, 7), not slow, True),
                                      ((1, 2), not slow, True), (None, False, False)):
            monkeypatch.setattr(casting, "_ml_version", lambda v=version: v)
            assert casting.ml_pays(casting.ML_SLOW_FROM - 1) == small, (numpy_version, version)
            assert casting.ml_pays(casting.ML_SLOW_FROM) == large, (numpy_version, version)
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, "ml_dtypes")
    init = tmp_path / "__init__.py"
    for text, want in (("x = 1\n__version__ = '0.6.1'\n", (0, 6)), ("__version__ = \"0.10.0rc1\"", (0, 10)),
                       ("from ._v import __version__\n", casting.ML_SLOW_IMPORT)):
        init.write_text(text)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, o=str(init): SimpleNamespace(origin=o))
        assert casting._ml_version() == want, text
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert casting._ml_version() is None and not casting.ml_pays(1 << 62)


def test_prepare_weighs_the_jobs_bf16_bytes(monkeypatch):
    """``Worker.prepare`` hands the fp32 bytes of the jobs' fp32 -> bf16 casts to the decision, not the other
    casts' (every job of a reshard or convert, not only a merge's, decides by its own volume)."""
    from zckpt.encoding import casting
    from zckpt.engine.executor import Worker
    from zckpt.engine.segments import Cast, Piece
    seen = []
    monkeypatch.setattr(casting, "choose_bf16", lambda n: seen.append(n) or False)
    jobs = [([Cast([Piece("a", 0, 10, "float32"), Piece("a", 40, 5, "float32")], "float32"), b"x"], "bfloat16"),
            ([Cast([Piece("a", 0, 7, "float32")], "float32")], "float16"),
            ([Cast([Piece("b", 0, 3, "bfloat16")], "bfloat16"), Piece("b", 6, 2, "float32")], "float32"),
            ([Cast([Piece("a", 100, 8, "float32")], "float32")], "bfloat16")]
    worker = Worker()
    worker.use_torch = False
    worker.prepare(jobs)
    assert seen == [(10 + 5 + 8) * 4]
    worker.prepare(jobs[1:3])
    assert seen == [(10 + 5 + 8) * 4]  # no bf16 down-cast among them: nothing to decide


def test_torch_pays_only_from_its_threshold(monkeypatch):
    """torch imported already: always its kernel; else only from TORCH_CAST_FROM bytes, and not when missing."""
    import builtins
    import sys
    from zckpt.encoding import casting
    assert casting.torch_pays(0)  # (this process imported torch)
    monkeypatch.delitem(sys.modules, "torch")
    assert not casting.torch_pays(casting.TORCH_CAST_FROM - 1)
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "torch" else real(name, *a, **k))
    assert not casting.torch_pays(casting.TORCH_CAST_FROM)


def test_fp16_kernel_blocks_edges_and_input_kept(monkeypatch):
    """zckpt's fp32 -> fp16 kernel (numpy passes over blocks of F16_BLOCK elements, no torch) at block bounds
    (blocks made small here: lengths one under, at and over a block and several blocks with a tail), on fp16's
    own edges (each subnormal step's halfway points, the lowest binade's bound 2**-13, the largest finite and the
    overflow at 65520, values past 65536, both signs and zeros) as torch; the input left as it was."""
    import sys
    from zckpt.encoding import casting
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    h = h[(h & 0x7C00) != 0x7C00]  # every finite fp16 ...
    mids = torch.from_numpy(h.view(np.float16)).float().numpy()
    step = np.abs(mids) * 2.0 ** -11 + 2.0 ** -25  # ... at its value, half an fp16 step above and just around that
    vals = np.concatenate([mids, mids + np.sign(mids) * step, np.nextafter(mids + np.sign(mids) * step, np.inf),
                           np.nextafter(mids + np.sign(mids) * step, -np.inf), 2.0 ** -13 * np.array([1, -1]),
                           np.array([65504, 65519.996, 65520, 65536, 1e30, 3.4028235e38, -65520, -1e30, 0, -0.0]),
                           ]).astype(np.float32)
    raw = vals.view(np.uint8)
    want = _torch(raw, "float32", "float16")
    keep = raw.copy()
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(casting, "F16_BLOCK", 4096)
    for n in (1, 4095, 4096, 4097, 3 * 4096 + 17, vals.size):
        assert np.array_equal(cast(raw[:4 * n], "float32", "float16"), want[:2 * n]), n
    assert np.array_equal(raw, keep)


def test_numpy_passes_hand_over_to_ml_dtypes_once_they_cast_its_import(monkeypatch):
    """Casts no caller decided on (a loader's tensors one at a time) and jobs decided for numpy's passes count the
    bytes those passes cast; once they reach ``ML_SLOW_FROM`` the next casts import ml_dtypes and use it. The bits
    are the same before and after."""
    from zckpt.encoding import casting
    monkeypatch.setattr(casting, "_USE_ML", None)
    monkeypatch.setattr(casting, "_numpy_bf16", 0)
    monkeypatch.setattr(casting, "_switched", False)
    monkeypatch.setattr(casting, "_slow_import", lambda version: True)
    monkeypatch.setattr(casting, "ML_SLOW_FROM", 3 * 4 * 4096)
    monkeypatch.setattr(casting, "ml_pays", lambda n, real=casting.ml_pays: False if n < casting.ML_SLOW_FROM
                        else real(n))
    raw = _edges()[:4096].view(np.uint8)
    want = _torch(raw, "float32", "bfloat16")
    used = []
    for _ in range(5):
        assert np.array_equal(cast(raw, "float32", "bfloat16"), want)
        used.append(casting._USE_ML)
    assert used == [False, False, True, True, True], used
    assert casting._numpy_bf16 == 3 * 4 * 4096


def test_ml_dtypes_cast_finds_every_nan_in_its_result(monkeypatch):
    """The ml_dtypes path casts first and looks for NaN in the bf16 result (half the bytes of the fp32 input): every
    one of the 2**24 - 2 fp32 NaN patterns becomes a bf16 NaN there and no other value does, so a chunk holding any
    NaN, of either sign, anywhere, goes to torch and gets torch's bits; numpy's warning of a NaN cast stays quiet."""
    import warnings
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from zckpt.encoding import casting
    monkeypatch.setattr(casting, "_USE_ML", True)
    monkeypatch.setattr(casting, "_ML_BF16", ml_dtypes.bfloat16)
    mant = np.arange(1, 1 << 23, dtype=np.uint32)
    for sign in (0, 1 << 31):
        nans = (mant | np.uint32(0x7F800000 | sign)).view(np.float32)
        got = np.empty(nans.size, np.uint16)
        with np.errstate(invalid="ignore"):
            np.copyto(got.view(ml_dtypes.bfloat16), nans, casting="unsafe")
        assert casting._bf16_nan(got) and ((got & 0x7FFF) > 0x7F80).all()
    rng = np.random.default_rng(5)
    finite = rng.integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    finite = finite[~np.isnan(finite.view(np.float32))]
    finite = np.concatenate([finite, np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF], np.uint32)])
    got = np.empty(finite.size, np.uint16)
    np.copyto(got.view(ml_dtypes.bfloat16), finite.view(np.float32), casting="unsafe")
    assert not casting._bf16_nan(got)  # no finite or infinite value rounds to a NaN (the largest round to inf)
    assert not casting._bf16_nan(np.empty(0, np.uint16))
    calls = []
    monkeypatch.setattr(casting, "_has_nan", lambda *a: calls.append(a) or False)  # the input is not scanned
    base = rng.standard_normal(4099).astype(np.float32).view(np.uint32)
    for where, pattern in [(0, 0x7FC00000), (2049, 0xFF800001), (4098, 0x7F800001), (17, 0xFFFFFFFF), (None, 0)]:
        bits = base.copy()
        if where is not None:
            bits[where] = pattern
        raw = bits.view(np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert np.array_equal(cast(raw, "float32", "bfloat16"), _torch(raw, "float32", "bfloat16")), where
            out = bytearray(bits.size * 2)
            cast(raw, "float32", "bfloat16", out=memoryview(out))
        assert bytes(out) == _torch(raw, "float32", "bfloat16").tobytes(), where
    assert not calls
