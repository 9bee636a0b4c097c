"""``zckpt estimate``: DeepSpeed's ZeRO memory estimates without DeepSpeed, and which setting fits.

No torch here (nor in zckpt.ops.estimate): the command answers in milliseconds.
"""

from __future__ import annotations

import textwrap

import click

from zckpt.cli._common import emit_json, global_options, follow_links_option

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
    from zckpt.ops.estimate import estimate_memory

    res = estimate_memory(path, tag, params_text, largest_text, config_path, gpus, nodes, buffer_text,
                          gpu_memory_text, headroom_text)
    if as_json:
        emit_json(res.to_dict())  # one object like every command's --json: the inputs, DeepSpeed's rows, the choice
        return
    click.echo(_table(res.rows, res.parameters, res.largest_layer, gpus, nodes, res.buffer_factor, res.described,
                      res.recommendation))


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
