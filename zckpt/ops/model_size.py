"""Model size for the memory estimate (:mod:`zckpt.ops.estimate`): ``(parameters, largest_layer)`` exactly, from a
Hugging Face ``config.json`` (:func:`count_from_config`: Llama, Qwen2, Qwen3, Mistral, GPT-2) or from a
checkpoint's recorded shapes (:func:`counts_from_checkpoint`, no tensor bytes read).

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from zckpt.errors import InvalidArgument


# --------------------------------------------------------------------------------------------------------------
# Counts from a Hugging Face config.json

_LLAMA_LIKE_DEFAULTS = {
    # family: defaults of the transformers config class for the keys that shape parameters
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, tie_word_embeddings=False,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=None, tie_word_embeddings=False),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, tie_word_embeddings=False,
                  attention_bias=False),
}
_GPT2_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                      tie_word_embeddings=True, add_cross_attention=False)
# transformers' attribute_map for GPT2Config: config.json may use either name
_GPT2_ALIASES = {"n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
                 "n_layer": "num_hidden_layers"}

SUPPORTED_MODEL_TYPES = tuple(sorted([*_LLAMA_LIKE_DEFAULTS, "gpt2"]))

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "GPT2LMHeadModel": "gpt2",
}


class _Cfg:
    """Reads integer and boolean fields of a config dict with family defaults and clean errors."""

    def __init__(self, config: Mapping, defaults: dict, model_type: str, aliases: dict | None = None):
        self.config, self.defaults, self.model_type, self.aliases = config, defaults, model_type, aliases or {}

    def raw(self, key):
        if key in self.config:
            return self.config[key]
        alias = self.aliases.get(key)
        if alias is not None and alias in self.config:
            return self.config[alias]
        return self.defaults.get(key)

    def int(self, key, minimum=1, optional=False):
        value = self.raw(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidArgument(f"config.json of a {self.model_type} model: {key} must be an integer of at least "
                                  f"{minimum}, got {value!r}")
        return value

    def bool(self, key):
        value = self.raw(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise InvalidArgument(f"config.json of a {self.model_type} model: {key} must be true or false, "
                                  f"got {value!r}")
        return value


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _model_type(config: Mapping) -> str:
    model_type = config.get("model_type")
    if not model_type:
        for arch in config.get("architectures") or ():
            if arch in _ARCHITECTURES:
                return _ARCHITECTURES[arch]
        raise InvalidArgument("config.json has no model_type", hint="is this a Hugging Face config.json?")
    return str(model_type)


def count_from_config(config: Mapping) -> tuple[int, int]:
    """``(parameters, largest_layer)`` of ``AutoModelForCausalLM.from_config(config)``, exactly, without torch.

    ``parameters`` counts tied weights once (as ``model.parameters()`` does); ``largest_layer`` is the most
    parameters one module owns directly, measured like DeepSpeed's ``estimate_zero3_..._all_live`` (the LM head
    counts as its own module even when it is tied to the embedding). Supported ``model_type`` values: llama,
    mistral, qwen2, qwen3, gpt2; missing keys take the defaults of the transformers config class.
    """
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"a config must be a JSON object, got {type(config).__name__}")
    model_type = _model_type(config)
    if model_type in _LLAMA_LIKE_DEFAULTS:
        modules = _llama_like_modules(_Cfg(config, _LLAMA_LIKE_DEFAULTS[model_type], model_type), model_type)
    elif model_type == "gpt2":
        modules = _gpt2_modules(_Cfg(config, _GPT2_DEFAULTS, model_type, _GPT2_ALIASES))
    else:
        raise InvalidArgument(f"model_type {model_type!r} is not supported for counting from config.json "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
                              hint="pass --params and --largest-layer instead, or estimate from a checkpoint")
    # modules: (own parameters, counted in the total?) for every module that owns parameters
    total = sum(n * count for n, count, counted in modules if counted)
    largest = max(n for n, count, _ in modules if count)
    return total, largest


def _llama_like_modules(c: _Cfg, family: str):
    hidden = c.int("hidden_size")
    vocab = c.int("vocab_size")
    inter = c.int("intermediate_size")
    layers = c.int("num_hidden_layers", minimum=0)
    heads = c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", optional=True) or heads
    head_dim = c.int("head_dim", optional=True) or hidden // heads
    tied = c.bool("tie_word_embeddings")
    if family == "llama":
        q_bias = kv_bias = o_bias = c.bool("attention_bias")
        mlp_bias = c.bool("mlp_bias")
    elif family == "qwen3":
        q_bias = kv_bias = o_bias = c.bool("attention_bias")
        mlp_bias = False
    elif family == "qwen2":  # bias on q, k, v (hard-wired in the model), none on o
        q_bias = kv_bias = True
        o_bias = mlp_bias = False
    else:  # mistral: no biases at all
        q_bias = kv_bias = o_bias = mlp_bias = False

    per_layer = [
        _linear(hidden, heads * head_dim, q_bias),  # q_proj
        _linear(hidden, kv_heads * head_dim, kv_bias),  # k_proj
        _linear(hidden, kv_heads * head_dim, kv_bias),  # v_proj
        _linear(heads * head_dim, hidden, o_bias),  # o_proj
        _linear(hidden, inter, mlp_bias),  # gate_proj
        _linear(hidden, inter, mlp_bias),  # up_proj
        _linear(inter, hidden, mlp_bias),  # down_proj
        hidden, hidden,  # input_layernorm, post_attention_layernorm (RMSNorm: weight only)
    ]
    if family == "qwen3":
        per_layer += [head_dim, head_dim]  # q_norm, k_norm
    modules = [(n, layers, True) for n in per_layer]
    modules += [
        (vocab * hidden, 1, True),  # embed_tokens
        (hidden, 1, True),  # final norm
        (vocab * hidden, 1, not tied),  # lm_head (the embedding's weight when tied)
    ]
    return modules


def _gpt2_modules(c: _Cfg):
    embd = c.int("n_embd")
    vocab = c.int("vocab_size")
    positions = c.int("n_positions")
    layers = c.int("n_layer", minimum=0)
    inner = c.int("n_inner", optional=True) or 4 * embd
    tied = c.bool("tie_word_embeddings") if c.raw("tie_word_embeddings") is not None else True
    per_layer = [
        2 * embd,  # ln_1 (LayerNorm: weight and bias)
        _linear(embd, 3 * embd, True),  # attn.c_attn (Conv1D)
        _linear(embd, embd, True),  # attn.c_proj
        2 * embd,  # ln_2
        _linear(embd, inner, True),  # mlp.c_fc
        _linear(inner, embd, True),  # mlp.c_proj
    ]
    if c.bool("add_cross_attention"):
        per_layer += [
            2 * embd,  # ln_cross_attn
            _linear(embd, 2 * embd, True),  # crossattention.c_attn
            _linear(embd, embd, True),  # crossattention.q_attn
            _linear(embd, embd, True),  # crossattention.c_proj
        ]
    modules = [(n, layers, True) for n in per_layer]
    modules += [
        (vocab * embd, 1, True),  # wte
        (positions * embd, 1, True),  # wpe
        (2 * embd, 1, True),  # ln_f
        (vocab * embd, 1, not tied),  # lm_head
    ]
    return modules


# --------------------------------------------------------------------------------------------------------------
# Counts from a DeepSpeed checkpoint


def counts_from_checkpoint(path, tag=None, storage_options: dict | None = None) -> tuple[int, int]:
    """``(parameters, largest_layer)`` from a checkpoint's recorded shapes (no tensor bytes are read).

    Parameters are the trainable and frozen ones (a tied alias is not counted again, buffers are not
    parameters). The largest layer is the most parameters one module (the name up to its last dot) owns
    directly, tied aliases included, as DeepSpeed's ``..._all_live`` estimator measures it. Uses
    ``zckpt.state.open.open_checkpoint`` and the ``name``, ``shape`` and ``kind`` of each record.
    ``storage_options``: fsspec options for a URL ``path``, for this call only.
    """
    from zckpt.state.open import open_checkpoint

    path = os.fspath(path)
    ckpt = open_checkpoint(path, tag=tag, storage_options=storage_options)
    try:
        records = getattr(ckpt, "records", None)
        if records is None:
            records = getattr(ckpt, "params")
        records = list(records)
    finally:
        close = getattr(ckpt, "close", None)
        if callable(close):
            close()

    total = 0
    per_module: dict[str, int] = {}
    for rec in records:
        kind = getattr(rec, "kind", "trainable")
        if kind == "buffer":
            continue
        numel = math.prod(int(d) for d in rec.shape)
        if kind in ("trainable", "frozen"):
            total += numel
        module = rec.name.rsplit(".", 1)[0] if "." in rec.name else ""
        per_module[module] = per_module.get(module, 0) + numel
    if not per_module or total == 0:
        raise InvalidArgument("the checkpoint records no parameters to estimate from", path=path)
    return total, max(per_module.values())
