"""``zckpt convert``: a training checkpoint in another format, optimizer state included."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    Progress, emit_json, global_options, output_options, published, settings, storage_option, tag_option,
)


@click.command(epilog="""\b
Examples:
  zckpt convert ckpt/ --to dcp -o ckpt-dcp/
  zckpt convert checkpoint-400 --to dcp -o checkpoint-400-dcp/
  zckpt convert ds_ckpt/ --tag global_step900 --to dcp --adam-mode adamw -o dcp/
  zckpt convert ckpt/ --to dcp --dry-run --json""")
@click.argument("path")
@click.option("--to", "to", type=click.Choice(["dcp"]), default="dcp", show_default=True,
              help="dcp: a PyTorch Distributed Checkpoint that FSDP2 + torch.optim.AdamW resume from at any world "
                   "size (dcp.load + set_state_dict; keys as get_state_dict makes them, see zckpt help migrate-fsdp2).")
@click.option("-o", "--output", "out", default=None, metavar="OUT",
              help="Output folder (local), never in or around the checkpoint. Default: next to it, e.g. "
                   "outputs/checkpoint-4 -> outputs/converted-checkpoint-4-dcp.")
@click.option("--adam-mode", type=click.Choice(["adamw", "adam"]), default=None,
              help="For DeepSpeed's FusedAdam / DeepSpeedCPUAdam when the checkpoint does not say: adamw "
                   "(decoupled weight decay, their default) or adam (L2). Default: from the saved config.")
@tag_option
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Copy threads (default: CPU count, <= 8).")
@output_options("convert", "files, keys, sizes")
@storage_option
@global_options()
def convert(path, to, out, adam_mode, tag, workers, overwrite, durable, dry_run, storage_options, as_json, quiet):
    """Convert a DeepSpeed checkpoint into a PyTorch DCP checkpoint, keeping the whole training state.

    The fp32 masters become the model parameters; Adam moments, steps and param groups (lr, betas, eps, weight
    decay) become torch AdamW state under each parameter's name; frozen weights, buffers, the LR scheduler state
    and counters are kept, bit for bit. Bytes stream from the source files; .metadata is written last and the
    folder appears atomically.
    """
    from zckpt.ops.convert import convert as run
    from zckpt.units import format_size as human_bytes

    settings().output = out
    with Progress("convert", enabled=not quiet and not as_json and not dry_run) as bar:
        result = run(path, to=to, out=out, tag=tag, dry_run=dry_run, overwrite=overwrite, workers=workers,
                     progress=bar, durable=durable, adam_mode=adam_mode, storage_options=storage_options)
    if not dry_run:
        published(result.output)
    if as_json:
        doc = result.to_json()
        doc["path"] = doc.pop("source", path)  # the checkpoint read is "path" in every command
        # "format" is what was written, as in merge and reshard ("to"/"from" are reshard's layouts)
        doc["format"], doc["source_format"] = doc.pop("to", to), doc.pop("from", None)
        mode = doc.pop("optimizer", None)  # as --adam-mode spells it (info's "optimizer" is the ZeRO optimizer)
        doc["adam_mode"] = mode.lower() if isinstance(mode, str) and mode else None
        emit_json(doc)
        return
    if quiet:  # -q: silent on success
        return
    s = result.plan.summary()
    verb = "would write" if dry_run else "wrote"
    for f in s["files"]:
        click.echo(f"{verb} {f['name']:<40} {human_bytes(f['bytes']):>10}")
    for note in s["notes"]:
        click.echo(f"note: {note}")
    opt = f", optimizer {s['optimizer']}" if s["optimizer"] else ""
    click.echo(f"{'plan' if dry_run else 'converted'}: {s['from']} -> {s['to']}, {s['keys']} keys{opt}, "
               f"{human_bytes(s['total_bytes'])} -> {result.output}"
               + (f" in {result.seconds:.2f}s" if not dry_run else ""))
