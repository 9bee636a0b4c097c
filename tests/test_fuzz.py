"""Property tests over damaged real checkpoints: every case ends in success or zckpt's own error.

The same targets drive the coverage-guided fuzzer in tests/fuzz/fuzz_atheris.py (figures in docs/reliability.md).
"""

from __future__ import annotations

import os
import shutil
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.fuzz.targets import (
    MARKER, SEED_FIXTURES, check, copy_fixture, fixture_files, mutate_file, mutate_pickle_in_zip,
)
from zckpt.errors import CorruptFile, UnsafePickle, ZckptError

FAST = settings(max_examples=int(os.environ.get("ZCKPT_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=list(HealthCheck))


@FAST
@given(fixture=st.sampled_from(SEED_FIXTURES), which=st.integers(0, 20), ops=st.binary(min_size=5, max_size=40))
def test_mutated_rank_file(tmp_path_factory, fixture, which, ops):
    ck = copy_fixture(fixture, tmp_path_factory.mktemp("f") / "ck")
    _, tag, files = fixture_files(fixture)
    target = ck / tag / files[which % len(files)].name
    target.write_bytes(mutate_file(target.read_bytes(), ops))
    check(str(ck))


@FAST
@given(fixture=st.sampled_from(SEED_FIXTURES), which=st.integers(0, 20), ops=st.binary(min_size=5, max_size=30))
def test_mutated_pickle_inside_valid_zip(tmp_path_factory, fixture, which, ops):
    """Damage only data.pkl and rewrite a valid zip around it: exercises the unpickler and the layout readers."""
    ck = copy_fixture(fixture, tmp_path_factory.mktemp("p") / "ck")
    _, tag, files = fixture_files(fixture)
    target = ck / tag / files[which % len(files)].name
    target.write_bytes(mutate_pickle_in_zip(target.read_bytes(), ops))
    check(str(ck))


LEGACY_SEEDS = [n for n in ("z2_bf16_ws2_legacy", "z3_bf16_ws2_legacy")
                if os.path.isdir(os.path.join(os.path.dirname(__file__), "..", "fixtures", n))]


@pytest.mark.skipif(not LEGACY_SEEDS, reason="no committed legacy fixtures")
@FAST
@given(fixture=st.sampled_from(LEGACY_SEEDS or ["-"]), which=st.integers(0, 20),
       ops=st.binary(min_size=5, max_size=40), in_pickles=st.booleans())
def test_mutated_legacy_rank_file(tmp_path_factory, fixture, which, ops, in_pickles):
    """A legacy (non-zip) rank file damaged anywhere, or only in its pickles (the first bytes, where a flip reaches
    the unpickler and the layout checks rather than tensor data, which no CRC guards)."""
    ck = copy_fixture(fixture, tmp_path_factory.mktemp("l") / "ck")
    _, tag, files = fixture_files(fixture)
    target = ck / tag / files[which % len(files)].name
    data = target.read_bytes()
    if in_pickles:
        from zckpt.encoding import legacy
        with open(target, "rb") as f:
            start = legacy.read_header(f, len(data)).data_start
        data = mutate_file(data[:start], ops) + data[start:]
    else:
        data = mutate_file(data, ops)
    target.write_bytes(data)
    check(str(ck))


@pytest.mark.parametrize("glob", ["os system", "posix system", "builtins eval", "builtins exec",
                                  "subprocess Popen", "torch load", "torch.serialization load",
                                  "builtins getattr", "importlib import_module", "pickle loads",
                                  "numpy.core.multiarray _reconstruct"])
def test_forged_globals_are_refused(tmp_path, glob):
    """A pickle naming a code-running global in place of a real one is refused by name; nothing runs."""
    ck = copy_fixture("z2_bf16_ws2", tmp_path / "ck")
    tag = (ck / "latest").read_text().strip()
    target = sorted((ck / tag).glob("*optim_states.pt"))[0]
    with zipfile.ZipFile(target) as zf:
        blobs = {i.filename: zf.read(i) for i in zf.infolist()}
    name = next(n for n in blobs if n.endswith("data.pkl"))
    mod, attr = glob.split()
    forged = f"c{mod}\n{attr}\n".encode()
    old = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n"
    assert old in blobs[name]
    blobs[name] = blobs[name].replace(old, forged)
    with zipfile.ZipFile(target, "w") as zf:
        for n, b in blobs.items():
            zf.writestr(n, b)
    if os.path.exists(MARKER):
        os.remove(MARKER)
    with pytest.raises(ZckptError) as err:
        import zckpt
        zckpt.merge(str(ck), str(tmp_path / "out"))
    if glob != "numpy.core.multiarray _reconstruct":
        assert isinstance(err.value, UnsafePickle) and f"{mod}.{attr}" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing_rank", "duplicate_rank", "extra_rank", "mixed_prefix", "swapped_ranks",
                                  "stale_rank_from_other_save", "empty_file", "model_missing"])
def test_rank_set_damage(tmp_path, case):
    import zckpt
    ck = copy_fixture("z2_fp32_ws3", tmp_path / "ck")
    tag = (ck / "latest").read_text().strip()
    optim = sorted((ck / tag).glob("*optim_states.pt"))
    if case == "missing_rank":
        optim[1].unlink()
    elif case == "duplicate_rank":
        shutil.copy(optim[0], ck / tag / ("bf16_" + optim[0].name))
    elif case == "extra_rank":
        shutil.copy(optim[0], ck / tag / optim[0].name.replace("rank_0", "rank_3"))
    elif case == "mixed_prefix":
        optim[2].rename(ck / tag / ("bf16_" + optim[2].name))
    elif case == "swapped_ranks":
        a, b = optim[0].read_bytes(), optim[1].read_bytes()
        optim[0].write_bytes(b)
        optim[1].write_bytes(a)
    elif case == "stale_rank_from_other_save":
        other = copy_fixture("z2_bf16_ws4", tmp_path / "other")
        src = sorted((other / (other / "latest").read_text().strip()).glob("*optim_states.pt"))[1]
        shutil.copy(src, optim[1])
    elif case == "empty_file":
        optim[0].write_bytes(b"")
    elif case == "model_missing":
        next((ck / tag).glob("*model_states.pt")).unlink()
    with pytest.raises(ZckptError):
        zckpt.merge(str(ck), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_wrong_shapes_and_dtypes_in_metadata(tmp_path):
    """param_shapes that disagree with the partitions are caught before any byte is written."""
    import zckpt
    ck = copy_fixture("z2_bf16_ws2", tmp_path / "ck")
    tag = (ck / "latest").read_text().strip()
    model = ck / tag / "mp_rank_00_model_states.pt"
    sd = torch.load(model, weights_only=False)
    name = next(iter(sd["param_shapes"][0]))
    sd["param_shapes"][0][name] = torch.Size([1000, 1000])
    torch.save(sd, model)
    with pytest.raises(CorruptFile):
        zckpt.merge(str(ck), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# inputs the atheris fuzzer once crashed or exhausted memory with (tests/fuzz/fuzz_atheris.py encoding)
ATHERIS_REGRESSIONS = [
    "ZFwADQAAOwAAAADJfg==",  # LONG_BINPUT 678654301: the C unpickler grew its memo to gigabytes
    "AIAeIUWdFg==",  # ds_version became an OrderedDict: TypeError in verify
]


@pytest.mark.parametrize("b64", ATHERIS_REGRESSIONS)
def test_atheris_regressions(tmp_path, b64):
    import base64
    data = base64.b64decode(b64)
    fixture = SEED_FIXTURES[data[0] % len(SEED_FIXTURES)]
    _, tag, files = fixture_files(fixture)
    ck = copy_fixture(fixture, tmp_path / "ck")
    target = ck / tag / files[(data[1] & 0x7F) % len(files)].name
    mutate = mutate_pickle_in_zip if data[1] & 0x80 else mutate_file
    target.write_bytes(mutate(target.read_bytes(), data[2:]))
    check(str(ck))


@pytest.mark.parametrize("extra,words", [
    ("layer_00-model_states.pt", "pipeline"),
    ("layer_0_expert_1_mp_rank_00_model_states.pt", "mixture-of-experts"),
    ("mp_rank_01_model_states.pt", "model-parallel"),
    # expp_rank_* files are MoE-without-ZeRO optimizer files now: a model-states copy under that name is refused as
    # the file it is, named
    ("expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_0_mp_rank_00_optim_states.pt: not a DeepSpeed optimizer"),
])
def test_pipeline_tensor_parallel_and_moe_are_refused_clearly(tmp_path, extra, words):
    import zckpt
    from zckpt.errors import CorruptFile, UnsupportedLayout
    ck = copy_fixture("z2_bf16_ws2", tmp_path / "ck")
    tag = (ck / "latest").read_text().strip()
    shutil.copy(next((ck / tag).glob("mp_rank_00_model_states.pt")), ck / tag / extra)
    with pytest.raises(CorruptFile if extra.startswith("expp_rank") else UnsupportedLayout, match=words):
        zckpt.merge(str(ck), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
