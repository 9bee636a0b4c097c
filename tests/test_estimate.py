"""``zckpt estimate`` against DeepSpeed's own estimators, row by row, and against transformers' parameter counts.

DeepSpeed and transformers are test dependencies only; zckpt.ops.estimate imports neither (checked below).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zckpt.cli import main
from zckpt.errors import InvalidArgument
from zckpt.ops.estimate import (
    Row,
    count_from_config,
    counts_from_checkpoint,
    estimate,
    parse_count,
    parse_fraction,
    parse_size,
    recommend,
)

os.environ.setdefault("DS_ACCELERATOR", "cpu")

GIB = 2**30
ROW_KEYS = {"stage", "offload_optimizer", "offload_param", "zero_init", "per_gpu_bytes", "per_cpu_bytes"}
# estimate --json: one object, like every command's --json (field names as info's: parameters, world_size, *_bytes)
OBJECT_KEYS = {"ok", "command", "source", "path", "tag", "model_type", "parameters", "largest_layer",
               "gpus_per_node", "nodes", "world_size", "buffer_factor", "rows", "recommendation"}


def json_rows(result) -> list[dict]:
    """The rows of ``estimate --json``'s one object (after checking it is one object on one line)."""
    assert result.stdout.count("\n") == 1, result.stdout
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict) and set(doc) == OBJECT_KEYS, doc
    assert doc["ok"] is True and doc["command"] == "estimate"
    return doc["rows"]

# (name, parameters, largest layer). Real models (counts as transformers builds them) and degenerate tiny ones.
QWEN3_8B = (8_190_735_360, 622_329_856)  # the issue's figures
REAL_SHAPES = [
    ("Qwen3-8B", *QWEN3_8B),
    ("Qwen3-0.6B (tied)", 596_049_920, 155_582_464),
    ("Qwen2.5-0.5B (tied)", 494_032_768, 136_134_656),
    ("Llama-2-7B", 6_738_415_616, 131_072_000),
    ("Llama-3-8B", 8_030_261_248, 525_336_576),
    ("Llama-3-70B", 70_553_706_496, 1_050_673_152),
    ("Llama-3.1-405B", 405_853_388_800, 2_101_346_304),
    ("Mistral-7B", 7_241_732_096, 131_072_000),
    ("GPT-2 (tied)", 124_439_808, 38_597_376),
    ("GPT-2 XL (tied)", 1_557_611_200, 80_411_200),
    ("one parameter", 1, 1),
    ("tiny", 10, 3),
    ("odd", 999_999_937, 12_345_677),
    ("zero", 0, 0),
]
CLUSTERS = [(g, n) for g in (1, 2, 3, 4, 6, 8, 16) for n in (1, 2, 3, 4, 8, 16, 64)]
BUFFER_FACTORS = [1.5, 1.0, 1.25, 2.0, 3]


# --------------------------------------------------------------------------------------------------------------
# DeepSpeed's side


@pytest.fixture(scope="module")
def ds():
    z2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    z3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    return z2, z3


def ds_rows(ds, P, L, G, N, bf):
    """The rows DeepSpeed's two _all_cold functions print, in their loop order, from its inner functions."""
    z2, z3 = ds
    out = []
    for cpu_offload in [True, False]:
        cpu, gpu = z2.estimate_zero2_model_states_mem_needs(total_params=P, num_gpus_per_node=G, num_nodes=N,
                                                             cpu_offload=cpu_offload, additional_buffer_factor=bf)
        out.append(dict(stage=2, offload_optimizer="cpu" if cpu_offload else "none", offload_param=None,
                        zero_init=None, per_gpu_bytes=gpu, per_cpu_bytes=cpu))
    for cpu_offload in [True, False]:
        for cpu_offload_params in [True, False]:
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in [True, False]:
                cpu, gpu, _ = z3.estimate_zero3_model_states_mem_needs(
                    total_params=P, largest_layer_params=L, num_gpus_per_node=G, num_nodes=N,
                    cpu_offload=cpu_offload, cpu_offload_params=cpu_offload_params, zero_init=zero_init,
                    additional_buffer_factor=bf)
                out.append(dict(stage=3, offload_optimizer="cpu" if cpu_offload else "none",
                                offload_param="cpu" if cpu_offload_params else "none", zero_init=zero_init,
                                per_gpu_bytes=gpu, per_cpu_bytes=cpu))
    return out


def ds_printed(ds, P, L, G, N, bf=1.5):
    """(per CPU, per GPU, options) as the _all_cold functions print them."""
    z2, z3 = ds
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        z2.estimate_zero2_model_states_mem_needs_all_cold(P, num_gpus_per_node=G, num_nodes=N,
                                                          additional_buffer_factor=bf)
        z3.estimate_zero3_model_states_mem_needs_all_cold(P, L, num_gpus_per_node=G, num_nodes=N,
                                                          additional_buffer_factor=bf)
    rows = []
    for line in buf.getvalue().splitlines():
        m = re.fullmatch(r"\s*([0-9.]+)GB \|\s*([0-9.]+)GB \| (.*)", line)
        if m:
            options = re.sub(r"\s+,", ",", m.group(3).replace("OffloadDeviceEnum.", "")).strip()
            rows.append((m.group(1), m.group(2), options))
    return rows


def assert_same(ours: list[Row], theirs: list[dict]):
    assert [r.to_dict() for r in ours] == theirs
    for r in ours:  # integers, as DeepSpeed returns them (not floats that compare equal)
        assert type(r.per_gpu_bytes) is int and type(r.per_cpu_bytes) is int


# --------------------------------------------------------------------------------------------------------------
# Estimates equal DeepSpeed's


def test_issue_figures(ds):
    rows = estimate(*QWEN3_8B, gpus_per_node=8)
    zero2 = next(r for r in rows if r.stage == 2 and r.offload_optimizer == "none")
    zero3 = [r for r in rows if r.stage == 3 and r.offload_optimizer == "none"]
    assert zero2.per_gpu_bytes == 34_810_625_280 and f"{zero2.per_gpu_bytes / GIB:.2f}" == "32.42"
    assert {r.per_gpu_bytes for r in zero3} == {20_918_473_984}
    assert f"{zero3[0].per_gpu_bytes / GIB:.2f}" == "19.48"
    assert_same(rows, ds_rows(ds, *QWEN3_8B, 8, 1, 1.5))


@pytest.mark.parametrize("name,P,L", REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
def test_real_shapes_every_cluster(ds, name, P, L):
    for G, N in CLUSTERS:
        for bf in BUFFER_FACTORS:
            assert_same(estimate(P, L, G, N, bf), ds_rows(ds, P, L, G, N, bf))


def test_defaults_are_deepspeeds(ds):
    # num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5 when left out, in both
    assert_same(estimate(*QWEN3_8B), ds_rows(ds, *QWEN3_8B, 1, 1, 1.5))
    assert_same(estimate(*QWEN3_8B, 8), ds_rows(ds, *QWEN3_8B, 8, 1, 1.5))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    P=st.integers(0, 10**13),
    L_frac=st.fractions(0, 1),
    G=st.integers(1, 64),
    N=st.integers(1, 1024),
    bf=st.one_of(st.floats(0.01, 8, allow_nan=False, allow_infinity=False), st.integers(1, 4)),
)
def test_random_shapes(ds, P, L_frac, G, N, bf):
    L = int(P * L_frac)
    assert_same(estimate(P, L, G, N, bf), ds_rows(ds, P, L, G, N, bf))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(P=st.integers(0, 2**70), L=st.integers(0, 2**70), G=st.integers(1, 10**4), N=st.integers(1, 10**5))
def test_extreme_shapes_float_rounding(ds, P, L, G, N):
    # beyond 2**53 DeepSpeed's float divisions round; the mirror rounds the same way (and L > P is accepted
    # by the library function as it is by DeepSpeed)
    assert_same(estimate(P, L, G, N), ds_rows(ds, P, L, G, N, 1.5))


@pytest.mark.parametrize("P,L,G,N,bf", [
    (*QWEN3_8B, 8, 1, 1.5), (*QWEN3_8B, 8, 2, 1.5), (70_553_706_496, 1_050_673_152, 8, 4, 1.5),
    (124_439_808, 38_597_376, 1, 1, 1.5), (10, 3, 3, 1, 2.0), (6_738_415_616, 131_072_000, 4, 16, 1.0),
])
def test_printed_tables_match(ds, P, L, G, N, bf):
    """The _all_cold wrappers print exactly these rows, in this order, with these numbers (GiB, shown as GB)."""
    printed = ds_printed(ds, P, L, G, N, bf)
    rows = estimate(P, L, G, N, bf)
    assert len(printed) == len(rows) == 8
    assert printed == [(f"{r.per_cpu_bytes / 2**30:.2f}", f"{r.per_gpu_bytes / 2**30:.2f}", r.options) for r in rows]


def test_row_order_and_labels():
    rows = estimate(1000, 100, 2)
    assert [(r.stage, r.offload_param, r.offload_optimizer, r.zero_init) for r in rows] == [
        (2, None, "cpu", None), (2, None, "none", None),
        (3, "cpu", "cpu", True), (3, "cpu", "cpu", False),
        (3, "none", "cpu", True), (3, "none", "cpu", False),
        (3, "none", "none", True), (3, "none", "none", False),
    ]


@pytest.mark.parametrize("args", [
    dict(params=-1, largest_layer=0), dict(params=1.5, largest_layer=1), dict(params=10, largest_layer=True),
    dict(params=10, largest_layer=1, gpus_per_node=0), dict(params=10, largest_layer=1, nodes=0),
    dict(params=10, largest_layer=1, buffer_factor=0), dict(params=10, largest_layer=1, buffer_factor=float("nan")),
])
def test_estimate_refuses_bad_arguments(args):
    with pytest.raises(InvalidArgument):
        estimate(**args)


def test_package_level_name():
    import zckpt

    res = zckpt.estimate(params=10, largest_layer=3)  # the command's options as parameters (zckpt estimate --params)
    assert res.rows[0].per_gpu_bytes == 20 and res.to_dict()["parameters"] == 10
    assert zckpt.estimate(params="8B", largest_layer="600M", gpu_memory="80GiB").recommendation.fits
    import zckpt.ops.estimate as module  # the rows alone, as before
    assert module.estimate(10, 3)[0].per_gpu_bytes == 20


# --------------------------------------------------------------------------------------------------------------
# Recommendation


def _rec(gpu_memory, headroom=0.25, shape=QWEN3_8B, gpus=8, nodes=1):
    return recommend(estimate(*shape, gpus, nodes), gpu_memory, headroom)


@pytest.mark.parametrize("gpu_memory,expected", [
    (80 * GIB, (2, "none", None)),  # 32.42 GiB <= 60 GiB
    (40 * GIB, (3, "none", "none")),  # 32.42 > 30, 19.48 <= 30
    (28 * GIB, (3, "none", "none")),  # 19.48 <= 21
    (24 * GIB, (2, "cpu", None)),  # 19.48 > 18, ZeRO-2 optimizer offload 15.26 <= 18
    (16 * GIB, (3, "cpu", "none")),  # 15.26 > 12, 4.23 <= 12
    (4 * GIB, (3, "cpu", "cpu")),  # 4.23 > 3, 2.32 <= 3
    (2 * GIB, None),  # 2.32 > 1.5
])
def test_recommendation_ladder(gpu_memory, expected):
    rec = _rec(gpu_memory)
    if expected is None:
        assert rec.row is None and not rec.fits and "nothing fits" in rec.reason
        return
    assert (rec.row.stage, rec.row.offload_optimizer, rec.row.offload_param) == expected
    assert (rec.stage, rec.offload_optimizer, rec.offload_param, rec.zero_init) == (
        rec.row.stage, rec.row.offload_optimizer, rec.row.offload_param, rec.row.zero_init)
    assert rec.row.per_gpu_bytes <= rec.budget_bytes
    assert rec.row.zero_init in (None, True)  # stage 3: the zero_init row (less host RAM, same GPU figure)
    assert rec.reason and "GiB" in rec.reason


def test_recommendation_boundary_is_inclusive():
    rows = estimate(*QWEN3_8B, 8)
    need = next(r for r in rows if r.stage == 2 and r.offload_optimizer == "none").per_gpu_bytes
    # headroom 0: exactly the bytes needed fits, one byte less does not
    assert recommend(rows, need, 0).row.stage == 2
    assert recommend(rows, need - 1, 0).row.stage == 3
    # 50% headroom: 2 * need fits
    assert recommend(rows, 2 * need, Fraction(1, 2)).row.offload_optimizer == "none"
    assert recommend(rows, 2 * need - 1, 0.5).row.stage == 3


def test_recommendation_reason_explains():
    rec = _rec(24 * GIB)
    assert "ZeRO-2, no offload needs 32.42 GiB" in rec.reason
    assert "ZeRO-3, no offload needs 19.48 GiB" in rec.reason
    assert "18.00 GiB budget" in rec.reason and "25% headroom" in rec.reason
    assert "nothing fits without it" in rec.reason
    rec = _rec(80 * GIB)
    assert "fits" in rec.reason and "47.58 GiB free" in rec.reason
    rec = _rec(2 * GIB)
    assert "largest layer" in rec.reason


def test_more_gpus_move_the_choice_down():
    # ZeRO-3 without offload shrinks with the GPU count; with 64 GPUs the 70B fits on 80 GiB GPUs without offload
    shape = (70_553_706_496, 1_050_673_152)
    assert _rec(80 * GIB, shape=shape, gpus=8).row.offloads > 0
    assert _rec(80 * GIB, shape=shape, gpus=8, nodes=8).row.describe() == "ZeRO-3, no offload"


@pytest.mark.parametrize("headroom", [-0.1, 1, 1.0, Fraction(3, 2), float("inf"), "25%"])
def test_recommend_refuses_bad_headroom(headroom):
    with pytest.raises(InvalidArgument):
        recommend(estimate(10, 3), 100, headroom)


# --------------------------------------------------------------------------------------------------------------
# Parsers


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80G", 80 * 10**9), ("80 gib", 80 * 2**30),
    ("81559MiB", 81559 * 2**20), ("1.5TiB", 3 * 2**39), ("24576MB", 24576 * 10**6), ("1024", 1024),
    ("512KiB", 2**19), ("1TB", 10**12), ("79.6GiB", round(Fraction("79.6") * 2**30)), ("2B", 2),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1GiB", "0GiB", "80 Gigs", "1e3GB", "nan"])
def test_parse_size_refuses(text):
    with pytest.raises(InvalidArgument):
        parse_size(text)


@pytest.mark.parametrize("text,expected", [
    ("25%", Fraction(1, 4)), ("0.25", Fraction(1, 4)), ("12.5%", Fraction(1, 8)), ("0%", 0), ("0", 0),
    ("1", 1), ("100%", 1),
])
def test_parse_fraction(text, expected):
    assert parse_fraction(text) == expected


@pytest.mark.parametrize("text", ["25", "abc", "-5%", "%", "1.5"])
def test_parse_fraction_refuses(text):
    with pytest.raises(InvalidArgument):
        parse_fraction(text)


@pytest.mark.parametrize("text,expected", [
    ("8190735360", 8190735360), ("8_190_735_360", 8190735360), ("8,190,735,360", 8190735360),
    ("8.19B", 8_190_000_000), ("622M", 622_000_000), ("7e9", 7 * 10**9), ("1.5k", 1500), ("70b", 70 * 10**9),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1.5", "-3", "8.1234567891B", "1e-3", "12 GiB"])
def test_parse_count_refuses(text):
    with pytest.raises(InvalidArgument):
        parse_count(text)


# --------------------------------------------------------------------------------------------------------------
# Counts from config.json, checked against transformers


@pytest.fixture(scope="module")
def tf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def hf_counts(model):
    """What DeepSpeed's estimate_zero3_model_states_mem_needs_all_live measures (tied weights once)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied Parameter once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TINY_GPT2 = dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=40)

CONFIG_CASES = [
    ("llama", TINY),
    ("llama", {**TINY, "tie_word_embeddings": True}),
    ("llama", {**TINY, "attention_bias": True, "mlp_bias": True}),
    ("llama", {**TINY, "head_dim": 20, "num_key_value_heads": 1}),
    ("llama", {k: v for k, v in TINY.items() if k != "num_key_value_heads"}),  # kv heads default to heads
    ("llama", {**TINY, "vocab_size": 5, "intermediate_size": 400}),  # an MLP projection is the largest layer
    ("mistral", TINY),
    ("mistral", {k: v for k, v in TINY.items() if k != "num_key_value_heads"}),  # default 8 kv heads
    ("mistral", {**TINY, "head_dim": 16, "tie_word_embeddings": True}),
    ("qwen2", TINY),
    ("qwen2", {**TINY, "tie_word_embeddings": True}),
    ("qwen2", {**TINY, "num_key_value_heads": 4}),
    ("qwen2", {**TINY, "head_dim": 24}),  # not a Qwen2Config field, but the attention reads it
    ("qwen3", TINY),  # head_dim defaults to 128 in Qwen3, not hidden // heads
    ("qwen3", {**TINY, "head_dim": 12, "tie_word_embeddings": True}),
    ("qwen3", {**TINY, "head_dim": 16, "attention_bias": True}),
    ("gpt2", TINY_GPT2),
    ("gpt2", {**TINY_GPT2, "n_inner": 50}),
    ("gpt2", {**TINY_GPT2, "tie_word_embeddings": False}),
    ("gpt2", {**TINY_GPT2, "add_cross_attention": True}),
    ("gpt2", {**TINY_GPT2, "vocab_size": 3, "n_positions": 500}),  # wpe is the largest layer
    ("gpt2", {"vocab_size": 11, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "max_position_embeddings": 8}),  # the generic names of GPT2Config's attribute_map
]


@pytest.mark.parametrize("model_type,kwargs", CONFIG_CASES)
def test_config_counts_equal_transformers(tf, ds, model_type, kwargs):
    torch, transformers = tf
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = hf_counts(model)
    assert count_from_config(config.to_dict()) == expected  # the full dict transformers would save
    assert count_from_config({"model_type": model_type, **kwargs}) == expected  # a sparse one: class defaults
    assert tuple(ds[1].model_to_params(model)) == expected  # DeepSpeed's own _all_live measurement


@pytest.mark.parametrize("model_type,config", [
    ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),  # Qwen3-8B
    ("llama", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                   num_key_value_heads=8, tie_word_embeddings=False)),  # Llama-3-70B
    ("gpt2", dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_head=25)),  # GPT-2 XL
])
def test_full_size_dims_on_meta(tf, model_type, config):
    """Real widths (a single layer, on the meta device: no memory); the layer count is checked separately."""
    torch, transformers = tf
    key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    cfg = transformers.AutoConfig.for_model(model_type, **config, **{key: 1})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert count_from_config(cfg.to_dict()) == hf_counts(model)


def test_real_configs():
    qwen3_8b = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "attention_bias": False,
                "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "rope_theta": 1000000}
    assert count_from_config(qwen3_8b) == QWEN3_8B
    llama3_70b = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                  "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    assert count_from_config(llama3_70b) == (70_553_706_496, 1_050_673_152)
    assert count_from_config({"model_type": "gpt2"}) == (124_439_808, 38_597_376)
    mistral_7b = {"model_type": "mistral", "num_hidden_layers": 32}
    assert count_from_config(mistral_7b) == (7_241_732_096, 131_072_000)
    # no model_type: taken from architectures
    assert count_from_config({"architectures": ["GPT2LMHeadModel"]}) == (124_439_808, 38_597_376)


def test_config_defaults_follow_transformers(tf):
    _, transformers = tf
    from zckpt.ops.model_size import _GPT2_DEFAULTS, _LLAMA_LIKE_DEFAULTS

    for model_type, defaults in {**_LLAMA_LIKE_DEFAULTS, "gpt2": _GPT2_DEFAULTS}.items():
        cfg = transformers.AutoConfig.for_model(model_type)
        for key, value in defaults.items():
            if value is not None:
                assert getattr(cfg, key) == value, (model_type, key)


@pytest.mark.parametrize("config", [
    {"model_type": "bert"}, {}, {"model_type": "llama", "hidden_size": "4096"},
    {"model_type": "llama", "num_attention_heads": 0}, {"model_type": "qwen2", "tie_word_embeddings": "yes"},
    ["not", "a", "dict"],
])
def test_config_refused(config):
    with pytest.raises(InvalidArgument):
        count_from_config(config)


# --------------------------------------------------------------------------------------------------------------
# Counts from a checkpoint


class _Rec:
    def __init__(self, name, shape, kind):
        self.name, self.shape, self.kind = name, shape, kind


@pytest.fixture
def fake_layout(monkeypatch):
    """A stand-in for zckpt.state.open.open_checkpoint (the real reader is tested in its own suite)."""

    records = [
        _Rec("model.embed_tokens.weight", (100, 8), "trainable"),
        _Rec("model.layers.0.self_attn.q_proj.weight", (8, 8), "trainable"),
        _Rec("model.layers.0.self_attn.q_proj.bias", (8,), "trainable"),
        _Rec("model.layers.0.mlp.up_proj.weight", (30, 8), "frozen"),
        _Rec("model.layers.0.rotary.inv_freq", (4,), "buffer"),
        _Rec("model.norm.weight", (8,), "trainable"),
        _Rec("lm_head.weight", (100, 8), "tied"),
        _Rec("head_bias", (3,), "trainable"),  # a parameter of the root module
    ]
    calls = []

    class Ckpt:  # the reader's Checkpoint keeps its TensorRecords in .records
        pass

    Ckpt.records = records

    def open_checkpoint(path, tag=None, storage_options=None):
        calls.append((path, tag))
        return Ckpt()

    monkeypatch.setattr("zckpt.state.open.open_checkpoint", open_checkpoint)
    return calls


def test_counts_from_checkpoint_records(fake_layout):
    total, largest = counts_from_checkpoint("ckpt", tag="global_step4")
    assert total == 800 + 64 + 8 + 240 + 8 + 3  # tied alias and buffer not counted
    assert largest == 800  # embed_tokens; lm_head (tied alias) also 800
    assert fake_layout == [("ckpt", "global_step4")]


def test_cli_from_checkpoint(fake_layout, tmp_path):
    result = CliRunner().invoke(main, ["estimate", str(tmp_path), "--gpus", "2", "--json", "--tag", "t1"])
    assert result.exit_code == 0, result.output
    assert json_rows(result) == [r.to_dict() for r in estimate(1123, 800, 2)]
    doc = json.loads(result.stdout)
    assert (doc["source"], doc["path"], doc["tag"]) == ("checkpoint", str(tmp_path), "t1")
    assert (doc["parameters"], doc["largest_layer"], doc["model_type"]) == (1123, 800, None)
    assert fake_layout == [(str(tmp_path), "t1")]


def _layout_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("zckpt.state.open") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_layout_available(), reason="zckpt.state.open exists: the checkpoint path is live")
def test_cli_checkpoint_reader_missing(tmp_path):
    result = CliRunner().invoke(main, ["estimate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.startswith("zckpt: error:") and "not available" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.skipif(not _layout_available(), reason="zckpt.state.open missing")
def test_committed_fixture_counts_equal_deepspeed(ds, fixture_dir, ckpt_path):
    """Each committed fixture (tests/conftest.py): counts from its shapes equal DeepSpeed's model_to_params."""
    import fixtures.generate as G

    spec = json.loads((fixture_dir / "expected" / "spec.json").read_text())
    if spec.get("kind") in ("pipeline", "moe", "autoep"):
        pytest.skip("model needs torch.distributed (fixtures/gen_parallel.py); tests/test_layouts_pp_moe.py "
                    "checks its counts against the live model's parameters")
    model = G.build_hf_model(spec["model"]) if spec["model"].get("arch") else G.build_model(spec["model"])
    G.attach_late_module(model, spec)  # the model as saved: with a module attached after deepspeed.initialize
    expected = tuple(ds[1].model_to_params(model))
    assert counts_from_checkpoint(ckpt_path) == expected
    config_file = ckpt_path / "config.json"
    if config_file.exists():  # the Trainer's checkpoint-N carries the model's config.json
        assert count_from_config(json.loads(config_file.read_text())) == expected
    result = run(str(ckpt_path), "--gpus", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json_rows(result) == ds_rows(ds, *expected, 2, 1, 1.5)


@pytest.mark.slow
@pytest.mark.skipif(not _layout_available(), reason="zckpt.state.open missing")
@pytest.mark.parametrize("stage", [2, 3])
def test_generated_checkpoint_counts_equal_deepspeed(ds, tmp_path, stage):
    """A real ZeRO checkpoint (2 CPU ranks): counts equal DeepSpeed's model_to_params on the same model."""
    import fixtures.generate as G  # the repository root is on sys.path (tests/conftest.py)

    dims = {"layers": 2, "ffn": 20}  # the up projection (7 x 20 + 20) is the largest layer, not the embedding
    G.generate(G.make_spec(stage=stage, dtype="bf16", world_size=2, model=dims), tmp_path / "ck", expected=False,
               oracle=False)
    expected = tuple(ds[1].model_to_params(G.build_model(dims)))
    assert expected[1] == 7 * 20 + 20
    assert counts_from_checkpoint(tmp_path / "ck") == expected  # a Path is fine
    result = run(str(tmp_path / "ck"), "--gpus", "2", "--json")
    assert json_rows(result) == ds_rows(ds, *expected, 2, 1, 1.5)


# --------------------------------------------------------------------------------------------------------------
# The command line


def run(*args):
    return CliRunner().invoke(main, ["estimate", *args])


def test_cli_table_issue_figures():
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "32.42 GiB" in out and "19.48 GiB" in out
    assert not re.search(r"[0-9] ?GB\b", out)  # the unit is named GiB
    assert len([line for line in out.splitlines() if line.startswith("ZeRO-")]) == 8
    assert "8,190,735,360" in out and "622,329,856" in out


@pytest.mark.parametrize("P,L,G,N,bf", [
    (*QWEN3_8B, 8, 1, "1.5"), (*QWEN3_8B, 8, 2, "1.5"), (70_553_706_496, 1_050_673_152, 8, 16, "1.5"),
    (124_439_808, 38_597_376, 1, 1, "2"), (6_738_415_616, 131_072_000, 3, 5, "1.0"), (1, 1, 1, 1, "1.5"),
])
def test_cli_json_equals_deepspeed(ds, P, L, G, N, bf):
    result = run("--params", str(P), "--largest-layer", str(L), "--gpus", str(G), "--nodes", str(N),
                 "--buffer-factor", bf, "--json")
    assert result.exit_code == 0, result.output
    rows = json_rows(result)
    assert rows == ds_rows(ds, P, L, G, N, float(bf))
    doc = json.loads(result.stdout)
    assert doc["source"] == "params" and doc["path"] is None and doc["recommendation"] is None
    assert (doc["parameters"], doc["largest_layer"], doc["gpus_per_node"], doc["nodes"], doc["world_size"]) \
        == (P, L, G, N, G * N)
    assert doc["buffer_factor"] == float(bf)
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["stage"] in (2, 3) and row["offload_optimizer"] in ("none", "cpu")
        assert isinstance(row["per_gpu_bytes"], int) and isinstance(row["per_cpu_bytes"], int)
        if row["stage"] == 3:
            assert row["offload_param"] in ("none", "cpu") and isinstance(row["zero_init"], bool)
        else:
            assert row["offload_param"] is None and row["zero_init"] is None


def test_cli_defaults_one_gpu_one_node(ds):
    result = run("--params", "1000000", "--largest-layer", "1000", "--json")
    assert json_rows(result) == ds_rows(ds, 1_000_000, 1000, 1, 1, 1.5)


def test_cli_config_file_and_folder(tmp_path, ds):
    config = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
              "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for where in (tmp_path / "config.json", tmp_path):
        result = run("--config", str(where), "--gpus", "8", "--json")
        assert result.exit_code == 0, result.output
        assert json_rows(result) == ds_rows(ds, *QWEN3_8B, 8, 1, 1.5)
        doc = json.loads(result.stdout)
        assert (doc["source"], doc["path"], doc["model_type"]) == ("config", str(where), "qwen3")
    result = run("--config", str(tmp_path), "--gpus", "8")
    assert "32.42 GiB" in result.stdout and "qwen3" in result.stdout


def test_cli_recommendation_table():
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8", "--gpu-memory", "24GiB")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())  # the reason is wrapped
    assert "Recommendation: ZeRO-2, offload_optimizer=cpu." in out
    assert "Why:" in out and "nothing fits without it" in out
    assert "<- recommended" in out
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8", "--gpu-memory", "80GiB",
                 "--headroom", "30%")
    out = " ".join(result.stdout.split())
    assert "Recommendation: ZeRO-2, no offload." in out and "30% headroom" in out
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8", "--gpu-memory", "28GiB")
    assert "Recommendation: ZeRO-3, no offload, zero_init on." in result.stdout


def test_cli_recommendation_headroom_forms():
    base = ["--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8", "--gpu-memory", "40GiB"]
    # ZeRO-2 needs 32.42 GiB: fits with 7 GiB headroom, not with 25% (10 GiB)
    assert "ZeRO-2, no offload." in run(*base, "--headroom", "7GiB").stdout
    assert "ZeRO-3, no offload" in run(*base).stdout
    assert "ZeRO-2, no offload." in run(*base, "--headroom", "0.15").stdout
    assert "ZeRO-2, no offload." in run(*base, "--headroom", "0%").stdout


def test_cli_recommendation_json():
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpus", "8", "--gpu-memory", "16GiB",
                 "--json")
    rows = json_rows(result)
    assert len(rows) == 8 and all(set(r) == ROW_KEYS | {"fits", "recommended"} for r in rows)
    chosen = [r for r in rows if r["recommended"]]
    assert len(chosen) == 1 and chosen[0]["stage"] == 3 and chosen[0]["offload_optimizer"] == "cpu"
    assert chosen[0]["offload_param"] == "none" and chosen[0]["zero_init"] is True
    assert [r["fits"] for r in rows] == [r["per_gpu_bytes"] <= 12 * GIB for r in rows]
    rec = json.loads(result.stdout)["recommendation"]
    assert set(rec) == {"gpu_memory_bytes", "headroom_bytes", "budget_bytes", "row", "reason"}
    assert (rec["gpu_memory_bytes"], rec["headroom_bytes"], rec["budget_bytes"]) == (16 * GIB, 4 * GIB, 12 * GIB)
    assert rec["row"] == {k: v for k, v in chosen[0].items() if k in ROW_KEYS}
    assert "nothing fits without it" in rec["reason"]


def test_cli_json_nothing_fits():
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpu-memory", "2GiB", "--json")
    assert result.exit_code == 0, result.output
    rows = json_rows(result)
    rec = json.loads(result.stdout)["recommendation"]
    assert rec["row"] is None and rec["budget_bytes"] == 2 * GIB - GIB // 2 and rec["reason"]
    assert not any(r["fits"] or r["recommended"] for r in rows)


def test_cli_json_error_is_one_object():
    result = run("--params", "10", "--largest-layer", "11", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["command"] == "estimate" and "larger than --params" in doc["error"]["message"]


def test_cli_nothing_fits_is_an_answer():
    result = run("--params", "8190735360", "--largest-layer", "622329856", "--gpu-memory", "2GiB")
    assert result.exit_code == 0
    assert "Recommendation: none of these settings fits." in result.stdout


@pytest.mark.parametrize("args,words", [
    ([], "give the model size"),
    (["--params", "abc", "--largest-layer", "1"], "cannot read 'abc'"),
    (["--params", "100"], "--largest-layer: missing option, required with --params"),
    (["--largest-layer", "100"], "--largest-layer: does not apply here (no --params): only with --params"),
    (["--params", "10", "--largest-layer", "11"], "larger than --params"),
    (["--params", "0", "--largest-layer", "0"], "at least 1"),
    (["--params", "10", "--largest-layer", "1", "--gpus", "0"], "--gpus: 0 is not in the range x>=1"),
    (["--params", "10", "--largest-layer", "1", "--gpus", "two"], "--gpus: 'two' is not a valid integer"),
    (["--params", "10", "--largest-layer", "1", "--nodes", "-1"], "--nodes: -1 is not in the range x>=1"),
    (["--params", "10", "--largest-layer", "1", "--buffer-factor", "-1"], "--buffer-factor"),
    (["--params", "10", "--largest-layer", "1", "--buffer-factor", "inf"], "--buffer-factor"),
    (["--params", "10", "--largest-layer", "1", "--gpu-memory", "lots"], "memory size"),
    (["--params", "10", "--largest-layer", "1", "--gpu-memory", "80GiB", "--headroom", "25"], "ambiguous"),
    (["--params", "10", "--largest-layer", "1", "--gpu-memory", "80GiB", "--headroom", "100%"], "nothing"),
    (["--params", "10", "--largest-layer", "1", "--gpu-memory", "8GiB", "--headroom", "9GiB"], "nothing"),
    (["--params", "10", "--largest-layer", "1", "--headroom", "25%"], "--headroom: does not apply here (no "
                                                                        "--gpu-memory): only with --gpu-memory"),
    (["--params", "10", "--largest-layer", "1", "--config", "x.json"], "--params: does not apply here (--config "
                                                                         "x.json): only without PATH and without"),
    (["--config", "/nonexistent/config.json"], "no such file"),
    (["/nonexistent/checkpoint"], "no such file or folder"),
    (["--params", "10", "--largest-layer", "1", "--tag", "t"], "--tag: does not apply here (no PATH): only with PATH"),
])
def test_cli_bad_inputs_are_one_line_errors(args, words):
    """A value zckpt reads and refuses: exit 1; a usage mistake (an option outside its range, one that does not
    apply, a missing one: the message starts with the flag and a colon) exit 2, as in every command."""
    result = run(*args)
    usage = re.match(r"--[a-z-]+: (missing option|does not apply|-?\w+ is not in the range|'\w+' is not a valid)", words)
    assert result.exit_code == (2 if usage else 1), result.output
    assert result.stdout == ""
    assert result.stderr.startswith("zckpt: error:") and result.stderr.count("\n") == 1
    assert words in result.stderr


def test_cli_bad_config_files(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, words in [("bad.json", "not a JSON file"), ("bert.json", "not supported"), ("list.json", "object")]:
        result = run("--config", str(tmp_path / name))
        assert result.exit_code == 1 and words in result.stderr and result.stderr.count("\n") == 1
    result = run("--config", str(tmp_path))  # a folder without config.json
    assert result.exit_code == 1 and "no config.json" in result.stderr
    result = run(str(tmp_path / "bert.json"))  # a JSON file given as checkpoint PATH
    assert result.exit_code == 1 and "--config" in result.stderr


def test_cli_help_has_examples():
    result = CliRunner().invoke(main, ["estimate", "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "zckpt estimate --params 8190735360" in result.output
    assert "GiB" in result.output


def test_no_torch_or_deepspeed_import():
    code = ("import sys; from click.testing import CliRunner; from zckpt.cli import main; "
            "r = CliRunner().invoke(main, ['estimate', '--params', '8.19B', '--largest-layer', '622M', '--gpus', '8',"
            " '--gpu-memory', '80GiB']); assert r.exit_code == 0, r.output; "
            "import zckpt.ops.estimate; "
            "bad = [m for m in ('torch', 'deepspeed', 'transformers', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
