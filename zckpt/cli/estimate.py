"""``zckpt estimate``: DeepSpeed's ZeRO memory estimates without DeepSpeed, and which setting fits.

No torch here (nor in zckpt.ops.estimate): the command answers in milliseconds.
"""

from __future__ import annotations

import json
import math
import os
import textwrap

import click

from zckpt.cli._common import emit_json, global_options, follow_links_option
from zckpt.errors import InvalidArgument

EPILOG = """\b
Sources of model size (exactly one):
  --params P --largest-layer L   counts you know (8190735360, 8_190_735_360, 8.19B, 622M)
  --config PATH                  a Hugging Face config.json (or its folder): llama, mistral,
                                 qwen2, qwen3, gpt2; counts computed exactly
  PATH                           a DeepSpeed checkpoint (counts from its recorded shapes)

\b
Figures are DeepSpeed's (estimate_zero2/zero3_model_states_mem_needs_all_cold), byte for
byte; DeepSpeed prints them with "GB" but they are GiB (2**30 bytes), and zckpt says GiB.
"per CPU" is host RAM per node. Sizes as in every zckpt command: 80GiB = 80*2**30 (what
an "80 GB" H100 has), 80GB = 80G = 80*10**9; a --gpu-memory below 1MiB is refused (80 alone
would be 80 bytes: write the unit).

\b
Examples:
  zckpt estimate --params 8190735360 --largest-layer 622329856 --gpus 8
  zckpt estimate --config Qwen3-8B/config.json --gpus 8 --nodes 2 --json
  zckpt estimate --config Qwen3-8B/ --gpus 8 --gpu-memory 80GiB --headroom 30%
  zckpt estimate checkpoint-400 --gpus 4 --gpu-memory 24GiB"""


def _count(text: str, what: str) -> int:
    from zckpt.ops.estimate import parse_count

    return parse_count(text, what)


def _buffer_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"--buffer-factor must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"--buffer-factor must be a positive number, got {text!r}")
    return value


def _headroom(text: str, gpu_memory: int):
    """``25%`` or ``0.25`` (a share of the GPU), or a size such as ``16GiB``; returns a Fraction."""
    from fractions import Fraction

    from zckpt.ops.estimate import parse_fraction
    from zckpt.units import parse_size

    s = text.strip()
    if s.endswith("%") or not any(ch.isalpha() for ch in s):
        frac = parse_fraction(s)
    else:
        frac = Fraction(parse_size(s, "--headroom", what="a memory size"), gpu_memory)
    if frac >= 1:
        raise InvalidArgument(f"--headroom {text} leaves nothing of the GPU's memory for model states")
    return frac


def _gpu_memory(text: str) -> int:
    """--gpu-memory by the one size rule; a bare small number (``80``) is refused rather than read as 80 bytes."""
    from zckpt.units import parse_size

    nbytes = parse_size(text, "--gpu-memory", what="a memory size")
    if nbytes < 2**20:
        raise InvalidArgument(f"--gpu-memory {text} is {nbytes} bytes, less than any GPU has",
                              hint=f"write the unit: {text.strip()}GiB (= {text.strip()}*2**30) or {text.strip()}GB")
    return nbytes


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


@click.command(epilog=EPILOG, context_settings={"max_content_width": 100})
@click.argument("path", required=False, metavar="[PATH]")
@click.option("--tag", "-t", default=None, metavar="TAG",
              help="Checkpoint tag to read with PATH (default: the one named in 'latest').")
@click.option("--params", "params_text", metavar="P", default=None, help="Total parameters (tied weights once).")
@click.option("--largest-layer", "largest_text", metavar="L", default=None,
              help="Most parameters owned directly by one module (usually the embedding or LM head).")
@click.option("--config", "config_path", metavar="PATH", default=None,
              help="A Hugging Face config.json, or a folder holding one.")
@click.option("--gpus", "--gpus-per-node", "gpus", type=click.IntRange(1), metavar="G", default=1, show_default=True,
              help="GPUs per node.")
@click.option("--nodes", "nodes", type=click.IntRange(1), metavar="N", default=1, show_default=True,
              help="Number of nodes.")
@click.option("--buffer-factor", "buffer_text", metavar="F", default="1.5", show_default=True,
              help="DeepSpeed's additional_buffer_factor (scales the CPU figures only).")
@click.option("--gpu-memory", "gpu_memory_text", metavar="SIZE", default=None,
              help="Memory of one GPU (80GiB, 80GB, 81559MiB): say which setting fits, and why.")
@click.option("--headroom", "headroom_text", metavar="SHARE", default=None,
              help="Part of the GPU kept free for activations: 25% (default), 0.3, or a size like 16GiB.")
@follow_links_option
@global_options()
def estimate(path, tag, params_text, largest_text, config_path, gpus, nodes, buffer_text,
             gpu_memory_text, headroom_text, as_json, quiet):
    """Memory per GPU and per node for each ZeRO stage and offload setting.

    Prints every row DeepSpeed's two estimators print: ZeRO-2 with and without optimizer offload, and
    ZeRO-3 with parameter and optimizer offload, optimizer offload only, and none, each with zero_init on
    and off. The figures equal DeepSpeed's byte values; no DeepSpeed install is needed. With --gpu-memory,
    names the lowest stage and offload setting that leaves the headroom free for activations.
    """
    import importlib

    est = importlib.import_module("zckpt.ops.estimate")  # the module; zckpt.ops.estimate may name the function

    # ---- where the model size comes from
    sources = [name for name, given in (("PATH", path is not None), ("--config", config_path is not None),
                                        ("--params", params_text is not None)) if given]
    if len(sources) > 1:
        raise InvalidArgument(f"give one source of model size, not {' and '.join(sources)}")
    if not sources:
        if largest_text is not None:
            raise InvalidArgument("--largest-layer needs --params")
        raise InvalidArgument("give the model size: --params P --largest-layer L, --config config.json, "
                              "or a checkpoint PATH", hint="see zckpt estimate --help")
    if largest_text is not None and params_text is None:
        raise InvalidArgument("--largest-layer goes with --params (it is computed from PATH or --config)")
    if tag is not None and path is None:
        raise InvalidArgument("--tag goes with a checkpoint PATH")

    if params_text is not None:
        if largest_text is None:
            raise InvalidArgument("--params needs --largest-layer (the ZeRO-3 figures depend on it)",
                                  hint="the most parameters one module owns, usually vocab_size * hidden_size")
        params = _count(params_text, "--params")
        largest = _count(largest_text, "--largest-layer")
        if params < 1:
            raise InvalidArgument(f"--params must be at least 1, got {params}")
        if largest < 1:
            raise InvalidArgument(f"--largest-layer must be at least 1, got {largest}")
        if largest > params:
            raise InvalidArgument(f"--largest-layer ({largest:,}) is larger than --params ({params:,})",
                                  hint="were the two swapped?")
        source, kind, read, model_type = "from --params", "params", None, None
    elif config_path is not None:
        config = _read_config(config_path)
        params, largest = est.count_from_config(config)
        model_type = config.get("model_type") or None
        source = f"from config.json: {model_type or 'model_type unknown'}"
        kind, read = "config", config_path
    else:
        if not os.path.exists(path):
            from zckpt.errors import CheckpointNotFound

            raise CheckpointNotFound("no such file or folder", path=path)
        if os.path.isfile(path) and path.endswith(".json"):
            raise InvalidArgument("this is a JSON file, not a checkpoint", path=path,
                                  hint="pass a config.json with --config")
        params, largest = est.counts_from_checkpoint(path, tag=tag)
        source = f"from checkpoint {path}" + (f", tag {tag}" if tag else "")
        kind, read, model_type = "checkpoint", path, None

    buffer_factor = _buffer_factor(buffer_text)
    rows = est.estimate(params, largest, gpus, nodes, buffer_factor)

    # ---- the fit question
    rec = None
    if gpu_memory_text is not None:
        gpu_memory = _gpu_memory(gpu_memory_text)
        headroom = _headroom(headroom_text if headroom_text is not None else "25%", gpu_memory)
        rec = est.recommend(rows, gpu_memory, headroom)
    elif headroom_text is not None:
        raise InvalidArgument("--headroom goes with --gpu-memory")

    if as_json:
        out = []
        for row in rows:
            item = row.to_dict()
            if rec is not None:
                item["fits"] = rec.fits_row(row)
                item["recommended"] = rec.row == row
            out.append(item)
        # one object like every command's --json: the inputs (info's field names), DeepSpeed's rows, the choice
        emit_json({"source": kind, "path": read, "tag": tag, "model_type": model_type, "parameters": params,
                   "largest_layer": largest, "gpus_per_node": gpus, "nodes": nodes, "world_size": gpus * nodes,
                   "buffer_factor": buffer_factor, "rows": out,
                   "recommendation": rec.to_dict() if rec is not None else None})
        return

    click.echo(_table(rows, params, largest, gpus, nodes, buffer_factor, source, rec))


def _table(rows, params, largest, gpus, nodes, buffer_factor, source, rec) -> str:
    from zckpt.ops.estimate import format_bytes, format_gib

    lines = [
        f"Model states for {params:,} parameters, largest layer {largest:,} ({source})",
        f"on {nodes} {'nodes' if nodes > 1 else 'node'} x {gpus} {'GPUs' if gpus > 1 else 'GPU'}, "
        f"buffer factor {buffer_factor:g}. 1 GiB = 2**30 bytes; per CPU = host RAM per node.",
        "",
    ]
    header = ["stage", "offload_param", "offload_optimizer", "zero_init", "per GPU", "per CPU"]
    body = []
    for row in rows:
        cells = [
            f"ZeRO-{row.stage}",
            row.offload_param or "-",
            row.offload_optimizer,
            "-" if row.zero_init is None else ("on" if row.zero_init else "off"),
            format_gib(row.per_gpu_bytes),
            format_gib(row.per_cpu_bytes),
        ]
        if rec is not None:
            cells.append(("yes" if rec.fits_row(row) else "no") + ("  <- recommended" if rec.row == row else ""))
        body.append(cells)
    if rec is not None:
        header.append("fits")
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    right = {4, 5}

    def fmt(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    lines.append(fmt(header))
    lines.extend(fmt(c) for c in body)
    if rec is not None:
        lines.append("")
        head = (f"GPU memory {format_bytes(rec.gpu_memory_bytes)}, headroom {format_bytes(rec.headroom_bytes)}: "
                f"model states may use {format_bytes(rec.budget_bytes)} per GPU.")
        lines.append(head)
        if rec.row is None:
            lines.append("Recommendation: none of these settings fits.")
        else:
            zi = "" if rec.row.zero_init is None else ", zero_init on"
            lines.append(f"Recommendation: {rec.row.describe()}{zi}.")
        lines.append(textwrap.fill(f"Why: {rec.reason}", width=100, subsequent_indent="     ",
                                   break_on_hyphens=False))
    return "\n".join(lines)
