"""``zckpt merge``: ZeRO shards to ordinary safetensors / .bin weights."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    WORKERS_DEFAULT, follow_links_option,
    Progress, emit_json, global_options, output_options, output_storage_option, published, settings, storage_option,
    tag_option, tie_options,
)


@click.command(epilog="""\b
Examples:
  zckpt merge checkpoint-400 --to safetensors -o model/
  zckpt merge checkpoint-400 --dtype bf16 -o model-bf16/ --max-shard-size 2GB
  zckpt merge ds_ckpt/ --tag global_step900 --to pt -o weights/
  zckpt merge checkpoint-400 -o s3://bucket/models/run1 --dtype bf16
  zckpt merge s3://a/ckpt-400 -o s3://b/model --storage-option profile=a --output-storage-option profile=b
  zckpt merge checkpoint-400 --dry-run --json
  zckpt merge outputs/ --latest -o model/          # the newest complete checkpoint of a training run
  torchrun --standalone --nproc-per-node 8 -m zckpt merge checkpoint-400 -o model/   # 8 processes
  (under torchrun, srun or the deepspeed launcher the processes share the work: zckpt help distributed)""")
@click.argument("path")
@click.option("--to", "fmt", type=click.Choice(["safetensors", "pt"]), default="safetensors", show_default=True,
              help="Output format (Hugging Face layout: model.safetensors or pytorch_model.bin, sharded with an "
                   "index when larger than --max-shard-size).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="dtype of floating tensors (fp32 masters are cast with torch's rounding).")
@click.option("-o", "--output", "out", default=None, metavar="OUT",
              help="Output folder (local or URL), never in or around the checkpoint. Default: next to it, "
                   "e.g. outputs/checkpoint-4 -> outputs/merged-checkpoint-4-DTYPE.")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Largest output file: 5GB = 5G = 5*10**9 bytes, 2GiB = 2*2**30, 500MB.")
@tag_option
@tie_options
@click.option("--exclude-frozen", is_flag=True, help="Leave out frozen (requires_grad=False) parameters.")
@click.option("--keep-tied", is_flag=True,
              help="Also write tied aliases (e.g. lm_head.weight) as copies; by default each tied tensor is "
                   "stored once under its source name, as save_pretrained does.")
@click.option("--native-names", is_flag=True,
              help="Keep the source format's own tensor names: a Megatron-Core checkpoint of a Llama-shaped model "
                   "(SwiGLU, RMSNorm, RoPE, no biases) is written under Hugging Face Llama names with a "
                   "config.json unless this is given.")
@click.option("--hf-config", "hf_config", default=None, metavar="CONFIG.json",
              help="A torchtitan Qwen3 / Qwen3-MoE / Llama 3 / DeepSeek-V3 save (its step-N folder): the config.json "
                   "of the transformers class to write it as (torchtitan saves none); its names, fused experts and the "
                   "config are written, so from_pretrained loads the output.")
@click.option("--workers", type=click.IntRange(1, 256), default=None,
              help=f"Threads for reading, casting and writing (default: {WORKERS_DEFAULT}); they write "
                   "several output files at once.")
@output_options("merge", "files, tensors, sizes")
@storage_option
@follow_links_option
@output_storage_option
@global_options()
def merge(path, fmt, dtype, out, max_shard_size, tag, exclude_frozen, keep_tied, native_names, hf_config, workers,
          overwrite,
          durable, dry_run, storage_options, output_storage_options, as_json, quiet):
    """Consolidate a ZeRO checkpoint into weights that from_pretrained / load_state_dict can load.

    Trainable parameters come from the fp32 masters; frozen parameters and buffers are included. A Trainer
    checkpoint-N also gets its config.json (dtype set), generation config and tokenizer files copied, so the
    output folder loads with AutoModel*.from_pretrained. Bytes stream through a fixed-size buffer; the output
    appears atomically.
    """
    from zckpt.engine.launch import launched
    from zckpt.ops.merge import merge as run, parse_size
    from zckpt.units import format_size as human_bytes

    settings().output = out
    with launched() as group:  # under torchrun / srun / deepspeed: every rank writes a share, rank 0 publishes
        quiet = quiet or (group is not None and group.rank != 0)
        with Progress("merge", enabled=not quiet and not as_json and not dry_run) as bar:
            result = run(path, out, fmt=fmt, dtype=dtype, tag=tag, max_shard_size=parse_size(max_shard_size),
                         exclude_frozen=exclude_frozen, keep_tied=keep_tied, workers=workers, dry_run=dry_run,
                         overwrite=overwrite, durable=durable, progress=bar, storage_options=storage_options,
                         output_storage_options=output_storage_options, group=None if dry_run else group,
                         native_names=native_names, hf_config=hf_config)
    if group is not None and group.rank != 0:
        return
    if not dry_run:
        published(result.output)
    if as_json:
        emit_json(result.to_json())
        return
    if quiet:  # -q: silent on success
        return
    s = result.plan.summary()
    for f in s["files"]:
        size = human_bytes(f["bytes"]) if f["bytes"] is not None else ""
        count = f"  {f['tensors']} tensor{'s' if f['tensors'] != 1 else ''}" if f["tensors"] else "  (index)"
        click.echo(f"{'would write' if dry_run else 'wrote'} {f['name']:<44} {size:>10}{count}")
    for name in result.copied:
        click.echo(f"{'would copy' if dry_run else 'copied'} {name}")
    for note in result.notes:
        click.echo(f"note: {note}")
    tied = ", ".join(f"{a} as {b}" for a, b in s["tied"].items())
    from zckpt.units import counted
    click.echo(f"{'plan' if dry_run else 'merged'}: {counted(s['tensors'], 'tensor')}, {human_bytes(s['total_bytes'])} "
               f"{dtype} {fmt} -> {result.output}" + (f" in {result.seconds:.2f}s" if not dry_run else "")
               + (f"; {len(s['tied'])} tied alias{'es' if len(s['tied']) > 1 else ''} stored once, as "
                  f"save_pretrained does ({tied}; --keep-tied writes them too)" if tied else ""))
