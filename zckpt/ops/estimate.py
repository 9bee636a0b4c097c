"""Memory needed for ZeRO model states, byte for byte as DeepSpeed's estimators compute it, without DeepSpeed.

DeepSpeed ships two printing helpers, ``estimate_zero2_model_states_mem_needs_all_cold`` (stage_1_and_2.py) and
``estimate_zero3_model_states_mem_needs_all_cold`` (stage3.py). :func:`estimate` returns every row they print,
with the same integer byte values, in the same order:

* ZeRO-2: ``offload_optimizer`` cpu, then none (the ZeRO-2 formulas do not use the largest layer);
* ZeRO-3: (``offload_param``, ``offload_optimizer``) = (cpu, cpu), (none, cpu), (none, none), each with
  ``zero_init`` on, then off.

What the numbers are (all mirrored from DeepSpeed 0.19, including its float arithmetic and ``int()`` truncations):

* ``per_gpu_bytes``: the model states one GPU holds (fp16/bf16 params, gradients, fp32 master weights and Adam
  moments as far as they are not partitioned away or offloaded). No buffer factor applies to it.
* ``per_cpu_bytes``: host RAM *per node* (DeepSpeed calls it "per CPU"), times the buffer factor (1.5 by default).
  ZeRO-2 with optimizer offload scales with the *total* GPU count (``max(4 * total_gpus, 16)`` bytes per param),
  ZeRO-3 divides by the node count.
* "largest layer": the most parameters any single module owns directly (``module.parameters(recurse=False)``),
  as DeepSpeed's ``..._all_live`` variant measures it; usually the embedding or the LM head.

DeepSpeed prints ``bytes / 2**30`` followed by "GB"; the figures are GiB, and zckpt labels them so.

Also here: :func:`recommend` (the lowest stage and offload setting whose model states leave the requested
headroom free on the GPU), the parsers the CLI uses for sizes (``80GiB``), percentages (``25%``) and counts
(``8.19B``), and, from :mod:`zckpt.ops.model_size`, :func:`count_from_config` (exact parameter count and largest
layer from a Hugging Face ``config.json`` for Llama, Qwen2, Qwen3, Mistral and GPT-2) and
:func:`counts_from_checkpoint`.

Pure Python: no torch, no DeepSpeed.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import types
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from zckpt.errors import InvalidArgument
from zckpt.ops.model_size import SUPPORTED_MODEL_TYPES, count_from_config, counts_from_checkpoint

GIB = 2**30

__all__ = [
    "Row",
    "Recommendation",
    "estimate",
    "estimate_memory",
    "EstimateResult",
    "recommend",
    "count_from_config",
    "counts_from_checkpoint",
    "parse_size",
    "parse_fraction",
    "parse_count",
    "format_gib",
    "format_bytes",
    "SUPPORTED_MODEL_TYPES",
]


# --------------------------------------------------------------------------------------------------------------
# The estimators


@dataclass(frozen=True)
class Row:
    """One row of DeepSpeed's printed table.

    ``offload_param`` and ``zero_init`` only exist for stage 3; they are ``None`` on stage-2 rows.
    """

    stage: int
    offload_optimizer: str  # "none" | "cpu"
    offload_param: str | None  # "none" | "cpu" (stage 3), None (stage 2)
    zero_init: bool | None  # stage 3 only
    per_gpu_bytes: int
    per_cpu_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def options(self) -> str:
        """The options column as DeepSpeed words it (without its padding of "cpu")."""
        if self.stage == 2:
            return f"offload_optimizer={self.offload_optimizer}"
        return (
            f"offload_param={self.offload_param}, offload_optimizer={self.offload_optimizer}, "
            f"zero_init={1 if self.zero_init else 0}"
        )

    @property
    def offloads(self) -> int:
        """0: nothing offloaded, 1: optimizer offloaded, 2: optimizer and parameters offloaded."""
        return (self.offload_optimizer == "cpu") + (self.offload_param == "cpu")

    def describe(self) -> str:
        """Short human name: ``ZeRO-3, offload_optimizer=cpu``."""
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_param == "cpu":
            parts.append("offload_param=cpu")
        if self.offload_optimizer == "cpu":
            parts.append("offload_optimizer=cpu")
        if self.offloads == 0:
            parts.append("no offload")
        return ", ".join(parts)


def _check_count(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be at least {minimum}, got {value}")


def _check_buffer_factor(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"buffer factor must be a positive number, got {value!r}")


def _zero2(total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor):
    # Mirror of deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs; the expressions are
    # kept as DeepSpeed writes them so that the float rounding is identical.
    total_gpus = num_nodes * num_gpus_per_node

    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem)


def _zero3(total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload, cpu_offload_params,
           zero_init, additional_buffer_factor):
    # Mirror of deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs (same expressions, same order).
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = (4 * largest_layer_params)

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory

            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor

        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)

            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem)


def estimate(params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
             buffer_factor: float = 1.5) -> list[Row]:
    """Every row DeepSpeed's two ``..._all_cold`` estimators print, in their order, as exact byte counts.

    ``params``: total parameters (tied weights once); ``largest_layer``: the most parameters one module owns
    directly; ``gpus_per_node`` and ``nodes`` default to 1 as in DeepSpeed; ``buffer_factor`` is DeepSpeed's
    ``additional_buffer_factor`` (applies to the CPU figures only).
    """
    _check_count("params", params)
    _check_count("largest_layer", largest_layer)
    _check_count("gpus_per_node", gpus_per_node, 1)
    _check_count("nodes", nodes, 1)
    _check_buffer_factor(buffer_factor)

    rows = []
    for cpu_offload in (True, False):
        cpu, gpu = _zero2(params, gpus_per_node, nodes, cpu_offload, buffer_factor)
        rows.append(Row(2, "cpu" if cpu_offload else "none", None, None, gpu, cpu))
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu, gpu = _zero3(params, largest_layer, gpus_per_node, nodes, cpu_offload, cpu_offload_params,
                                  zero_init, buffer_factor)
                rows.append(Row(3, "cpu" if cpu_offload else "none", "cpu" if cpu_offload_params else "none",
                                zero_init, gpu, cpu))
    return rows


def format_gib(nbytes: int | float, width: int = 0) -> str:
    """``nbytes`` in GiB with two decimals, the way DeepSpeed rounds its "GB" column."""
    return f"{nbytes / 2**30:{width}.2f} GiB"


def format_bytes(nbytes: int) -> str:
    """GiB with two decimals from 1 GiB up (as the table shows), smaller binary units below (for tiny models)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} bytes"


# --------------------------------------------------------------------------------------------------------------
# Recommendation

# The usual advice, in order: no offload before any offload (offload costs PCIe traffic and CPU time), then the
# lowest stage (ZeRO-2 keeps whole parameters on every GPU: no all-gather per forward and backward), then the
# least offload.
_PREFERENCE = (
    (2, "none", None),
    (3, "none", "none"),
    (2, "cpu", None),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
)


@dataclass(frozen=True)
class Recommendation:
    """The choice :func:`recommend` makes. ``row`` is None when even full offload does not fit."""

    row: Row | None
    reason: str
    gpu_memory_bytes: int
    headroom_bytes: int
    budget_bytes: int  # gpu_memory_bytes - headroom_bytes: what model states may use

    def __repr__(self) -> str:
        budget = f"{self.budget_bytes / 2**30:.2f} GiB per GPU for model states"
        if self.row is None:
            return f"<Recommendation: nothing fits in {budget}>"
        return (f"<Recommendation {self.row.describe()}: {self.row.per_gpu_bytes / 2**30:.2f} GiB of {budget}>")

    @property
    def fits(self) -> bool:
        return self.row is not None

    def fits_row(self, row: Row) -> bool:
        return row.per_gpu_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        """The budget in bytes, the chosen ``row`` (None when nothing fits) and the ``reason``, for ``--json``."""
        return {"gpu_memory_bytes": self.gpu_memory_bytes, "headroom_bytes": self.headroom_bytes,
                "budget_bytes": self.budget_bytes, "row": self.row.to_dict() if self.row else None,
                "reason": self.reason}

    # the chosen row's fields, None when nothing fits
    stage = property(lambda self: self.row.stage if self.row else None)
    offload_optimizer = property(lambda self: self.row.offload_optimizer if self.row else None)
    offload_param = property(lambda self: self.row.offload_param if self.row else None)
    zero_init = property(lambda self: self.row.zero_init if self.row else None)


def _as_fraction(value) -> Fraction:
    if isinstance(value, bool):
        raise InvalidArgument(f"headroom must be a fraction between 0 and 1, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"headroom must be a fraction between 0 and 1, got {value!r}")
        return Fraction(repr(value))  # 0.1 means one tenth, not the binary float next to it
    if isinstance(value, (int, Fraction)):
        return Fraction(value)
    raise InvalidArgument(f"headroom must be a fraction between 0 and 1, got {value!r}")


def _pick(rows: list[Row], stage: int, offload_optimizer: str, offload_param: str | None) -> Row | None:
    """The row for one setting; for stage 3 the zero_init=1 one (same GPU figure, less CPU RAM)."""
    found = [r for r in rows if (r.stage, r.offload_optimizer, r.offload_param) == (stage, offload_optimizer,
                                                                                      offload_param)]
    found.sort(key=lambda r: not r.zero_init)  # zero_init True first
    return found[0] if found else None


def _zero_init_pair(rows: list[Row], row: Row) -> Row | None:
    for r in rows:
        if (r.stage, r.offload_optimizer, r.offload_param) == (row.stage, row.offload_optimizer, row.offload_param) \
                and r.zero_init is not None and r.zero_init != row.zero_init:
            return r
    return None


def recommend(rows: list[Row], gpu_memory_bytes: int, headroom_fraction=0.25) -> Recommendation:
    """The lowest stage and offload setting whose model states leave ``headroom_fraction`` of the GPU free.

    Order of preference: ZeRO-2 without offload, ZeRO-3 without offload, ZeRO-2 with the optimizer offloaded,
    ZeRO-3 with the optimizer offloaded, ZeRO-3 with optimizer and parameters offloaded. Offload is advised only
    when no stage fits without it. A setting fits when ``per_gpu_bytes <= gpu_memory - ceil(gpu_memory *
    headroom)``; the headroom is what activations, temporary buffers and the CUDA context get.
    """
    _check_count("gpu_memory_bytes", gpu_memory_bytes, 1)
    frac = _as_fraction(headroom_fraction)
    if not 0 <= frac < 1:
        raise InvalidArgument(f"headroom must be at least 0 and below 100%, got {float(frac):.4g}")
    if not rows:
        raise InvalidArgument("no estimate rows to choose from")
    headroom = math.ceil(gpu_memory_bytes * frac)
    budget = gpu_memory_bytes - headroom

    g = format_bytes

    budget_words = (f"{g(budget)} budget ({g(gpu_memory_bytes)} per GPU minus {_pct(frac)} headroom = "
                    f"{g(headroom)} kept for activations)")
    candidates = [(pref, _pick(rows, *pref)) for pref in _PREFERENCE]
    candidates = [(pref, r) for pref, r in candidates if r is not None]

    chosen = next((r for _, r in candidates if r.per_gpu_bytes <= budget), None)
    too_big = [r for _, r in candidates if chosen is None or _PREFERENCE.index(_key(r)) < _PREFERENCE.index(
        _key(chosen))]

    if chosen is None:
        smallest = min(candidates, key=lambda c: c[1].per_gpu_bytes)[1]
        reason = (f"nothing fits: even the smallest setting, {smallest.describe()}, needs "
                  f"{g(smallest.per_gpu_bytes)} per GPU, more than the {budget_words}.")
        if smallest.offload_param == "cpu":
            reason += (" With parameters offloaded a GPU still holds the largest layer in fp32 (4 bytes per "
                       "parameter), which more GPUs do not shrink: use GPUs with more memory, less headroom, or "
                       "split that layer (tensor parallelism).")
        return Recommendation(None, reason, gpu_memory_bytes, headroom, budget)

    free = gpu_memory_bytes - chosen.per_gpu_bytes
    parts = []
    if too_big:
        parts.append("; ".join(f"{r.describe()} needs {g(r.per_gpu_bytes)} per GPU" for r in too_big)
                     + f", more than the {budget_words}")
        lead = f"{chosen.describe()} is the first that fits: {g(chosen.per_gpu_bytes)} of model states per GPU, " \
               f"leaving {g(free)} free for activations"
    else:
        lead = (f"{chosen.describe()} fits: {g(chosen.per_gpu_bytes)} of model states per GPU is within the "
                f"{budget_words}, leaving {g(free)} free")
    parts.append(lead)
    if chosen.offloads == 0 and chosen.stage == 2:
        parts.append("the lowest stage that fits communicates least (no parameter all-gather in forward and "
                     "backward), so there is no reason to go to ZeRO-3 or to offload")
    elif chosen.offloads == 0:
        parts.append("ZeRO-3 partitions the parameters too, at the cost of gathering them for every forward and "
                     "backward; no offload is needed")
    else:
        parts.append("offload moves optimizer states" + (" and parameters" if chosen.offload_param == "cpu" else "")
                     + " to host RAM and is slower (PCIe traffic, optimizer step on the CPU); it is advised only "
                     "because nothing fits without it")
    cpu = f"host RAM needed per node: {g(chosen.per_cpu_bytes)}"
    other = _zero_init_pair(rows, chosen)
    if other is not None:
        cpu += (f" with zero_init (deepspeed.zero.Init / HF Trainer's ZeRO-3 loading), "
                f"{g(other.per_cpu_bytes)} without it")
    parts.append(cpu)
    return Recommendation(chosen, "; ".join(parts) + ".", gpu_memory_bytes, headroom, budget)


def _key(row: Row):
    return (row.stage, row.offload_optimizer, row.offload_param)


def _pct(frac: Fraction) -> str:
    value = frac * 100
    return f"{int(value)}%" if value.denominator == 1 else f"{float(value):.4g}%"


# --------------------------------------------------------------------------------------------------------------
# Parsers for the command line

_NUMBER = r"([0-9][0-9_,]*(?:\.[0-9]*)?|\.[0-9]+)"


def _decimal(text: str, what: str, original: str) -> Decimal:
    try:
        return Decimal(text.replace("_", "").replace(",", ""))
    except InvalidOperation:
        raise InvalidArgument(f"cannot read {original!r} as {what}") from None


def parse_size(text: str) -> int:
    """A memory size in bytes, by zckpt's one rule (:mod:`zckpt.units`): ``80GiB`` = 80*2**30,
    ``80GB`` = ``80G`` = 80*10**9, ``81559MiB``, ``1.5TiB``, ``85899345920`` (bare numbers are bytes)."""
    from zckpt.units import parse_size as _parse

    return _parse(text, what="a memory size")


def parse_fraction(text: str) -> Fraction:
    """A share: ``25%`` or ``0.25``. A bare number above 1 is refused (write ``25%``)."""
    original = text
    s = str(text).strip()
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", s):
        raise InvalidArgument(f"cannot read {original!r} as a share (examples: 25%, 0.25)")
    value = Fraction(s) / (100 if percent else 1)
    if not percent and value > 1:
        raise InvalidArgument(f"{original!r} is ambiguous: write {original}% for a percentage or a fraction "
                              f"like 0.25")
    return value


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str, what: str = "a parameter count") -> int:
    """A whole count: ``8190735360``, ``8_190_735_360``, ``8,190,735,360``, ``8.19B``, ``622M``, ``7e9``.

    Suffixes are decimal (K = 10**3, M = 10**6, B or G = 10**9, T = 10**12); the result must be a whole number.
    """
    original = text
    s = str(text).strip().lower()
    m = re.fullmatch(_NUMBER + r"(?:e([0-9]+))?\s*([kmbgt]?)", s)
    if not m:
        raise InvalidArgument(f"cannot read {original!r} as {what} (examples: 8190735360, 8.19B, 622M)")
    value = _decimal(m.group(1), what, original)
    if m.group(2):
        value *= 10 ** int(m.group(2))
    value *= _COUNT_SUFFIX[m.group(3)]
    if value != value.to_integral_value():
        raise InvalidArgument(f"{original!r} is not a whole number of parameters")
    return int(value)


# --------------------------------------------------------------------------------------------------------------
# The command: a model size from one source, DeepSpeed's rows, and the fit question (``zckpt estimate``)

@dataclass
class EstimateResult:
    """What ``zckpt estimate`` answers; :meth:`to_dict` is its ``--json`` object."""

    source: str  # "params", "config" or "checkpoint": where the counts came from
    path: str | None
    tag: str | None
    model_type: str | None
    parameters: int
    largest_layer: int
    gpus_per_node: int
    nodes: int
    buffer_factor: float
    rows: list
    recommendation: Recommendation | None
    described: str  # the table's "(from ...)"

    def to_dict(self) -> dict:
        rows = []
        for row in self.rows:
            item = row.to_dict()
            if self.recommendation is not None:
                item["fits"] = self.recommendation.fits_row(row)
                item["recommended"] = self.recommendation.row == row
            rows.append(item)
        return {"source": self.source, "path": self.path, "tag": self.tag, "model_type": self.model_type,
                "parameters": self.parameters, "largest_layer": self.largest_layer,
                "gpus_per_node": self.gpus_per_node, "nodes": self.nodes,
                "world_size": self.gpus_per_node * self.nodes, "buffer_factor": self.buffer_factor, "rows": rows,
                "recommendation": self.recommendation.to_dict() if self.recommendation is not None else None}


def _count_arg(value, flag: str) -> int:
    n = parse_count(value, flag) if isinstance(value, str) else value
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgument(f"{flag} must be a whole number, got {value!r}")
    if n < 1:
        raise InvalidArgument(f"{flag} must be at least 1, got {n}")
    return n


def _buffer_factor_arg(value) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"--buffer-factor must be a number, got {value!r}") from None
    if not math.isfinite(out) or out <= 0:
        raise InvalidArgument(f"--buffer-factor must be a positive number, got {value!r}")
    return out


def _gpu_memory_arg(value) -> int:
    """A size by the one size rule; a bare small number (``80``) is refused rather than read as 80 bytes."""
    from zckpt.units import parse_size as size_of

    text = str(value).strip()
    nbytes = size_of(text, "--gpu-memory", what="a memory size") if isinstance(value, str) else value
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 2**20:
        raise InvalidArgument(f"--gpu-memory {text} is {nbytes} bytes, less than any GPU has",
                              hint=f"write the unit: {text}GiB (= {text}*2**30) or {text}GB")
    return nbytes


def _headroom_arg(value, gpu_memory: int) -> Fraction:
    """``25%`` or ``0.25`` (a share of the GPU), or a size such as ``16GiB``."""
    from zckpt.units import parse_size as size_of

    s = str(value).strip()
    if not isinstance(value, str) or s.endswith("%") or not any(ch.isalpha() for ch in s):
        frac = parse_fraction(s) if isinstance(value, str) else _as_fraction(value)
    else:
        frac = Fraction(size_of(s, "--headroom", what="a memory size"), gpu_memory)
    if frac >= 1:
        raise InvalidArgument(f"--headroom {value} leaves nothing of the GPU's memory for model states")
    return frac


def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise InvalidArgument("no such file" if not os.path.isdir(path) else "no config.json in this folder",
                              path=file, hint="--config takes a config.json or the folder holding it")
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"not a JSON file ({exc})", path=file,
                              hint="--config takes a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise InvalidArgument("not a JSON object", path=file, hint="--config takes a Hugging Face config.json")
    return config


def estimate_memory(path: str | None = None, tag: str | None = None, params=None, largest_layer=None,
                    config: str | None = None, gpus_per_node: int = 1, nodes: int = 1, buffer_factor=1.5,
                    gpu_memory=None, headroom=None) -> EstimateResult:
    """``zckpt estimate``: the model size from exactly one source (``params`` + ``largest_layer``, counts or text
    such as ``"8.19B"``; ``config``, a Hugging Face config.json or its folder; or a checkpoint ``path`` [+ ``tag``]),
    every row DeepSpeed's estimators print for ``gpus_per_node`` x ``nodes``, and with ``gpu_memory`` (bytes or
    ``"80GiB"``) the lowest setting that leaves ``headroom`` (``"25%"``, ``0.3`` or ``"16GiB"``) free."""
    sources = [name for name, given in (("PATH", path is not None), ("--config", config is not None),
                                        ("--params", params is not None)) if given]
    if len(sources) > 1:
        raise InvalidArgument(f"give one source of model size, not {' and '.join(sources)}")
    if not sources:
        if largest_layer is not None:
            raise InvalidArgument("--largest-layer needs --params")
        raise InvalidArgument("give the model size: --params P --largest-layer L, --config config.json, "
                              "or a checkpoint PATH", hint="see zckpt estimate --help")
    if largest_layer is not None and params is None:
        raise InvalidArgument("--largest-layer goes with --params (it is computed from PATH or --config)")
    if tag is not None and path is None:
        raise InvalidArgument("--tag goes with a checkpoint PATH")
    for flag, n in (("--gpus", gpus_per_node), ("--nodes", nodes)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"{flag} must be at least 1, got {n!r}")

    if params is not None:
        if largest_layer is None:
            raise InvalidArgument("--params needs --largest-layer (the ZeRO-3 figures depend on it)",
                                  hint="the most parameters one module owns, usually vocab_size * hidden_size")
        count, largest = _count_arg(params, "--params"), _count_arg(largest_layer, "--largest-layer")
        if largest > count:
            raise InvalidArgument(f"--largest-layer ({largest:,}) is larger than --params ({count:,})",
                                  hint="were the two swapped?")
        source, described, read, model_type = "params", "from --params", None, None
    elif config is not None:
        cfg = _read_config(str(config))
        count, largest = count_from_config(cfg)
        model_type = cfg.get("model_type") or None
        source, described, read = "config", f"from config.json: {model_type or 'model_type unknown'}", str(config)
    else:
        path = str(path)
        if not os.path.exists(path):
            from zckpt.errors import CheckpointNotFound

            raise CheckpointNotFound("no such file or folder", path=path)
        if os.path.isfile(path) and path.endswith(".json"):
            raise InvalidArgument("this is a JSON file, not a checkpoint", path=path,
                                  hint="pass a config.json with --config")
        count, largest = counts_from_checkpoint(path, tag=tag)
        source, read, model_type = "checkpoint", path, None
        described = f"from checkpoint {path}" + (f", tag {tag}" if tag else "")

    factor = _buffer_factor_arg(buffer_factor)
    rows = estimate(count, largest, gpus_per_node, nodes, factor)
    rec = None
    if gpu_memory is not None:
        nbytes = _gpu_memory_arg(gpu_memory)
        rec = recommend(rows, nbytes, _headroom_arg(headroom if headroom is not None else "25%", nbytes))
    elif headroom is not None:
        raise InvalidArgument("--headroom goes with --gpu-memory")
    return EstimateResult(source, read, tag, model_type, count, largest, gpus_per_node, nodes, factor, rows, rec,
                          described)


# ``zckpt.ops.estimate`` is both this module and (lazily, in zckpt/__init__.py) the function; once the module is
# imported the package attribute is the module, so let calling the module call the function.
class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
