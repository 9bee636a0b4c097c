"""``zckpt reshard``: re-partition a ZeRO checkpoint for another world size or stage, loadable natively."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    WORKERS_DEFAULT, follow_links_option,
    Progress, emit_json, global_options, output_options, published, settings, storage_option, tag_option, tie_options,
)


def _ep_sizes(value):
    """``--ep 4`` -> 4, ``--ep 4,2`` -> (4, 2): one expert-parallel size, or one per MoE layer."""
    if value is None:
        return None
    try:
        sizes = tuple(int(x) for x in str(value).split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter(f"{value!r} is not a positive size or a comma-separated list of them (4, or 4,2)")
    return sizes[0] if len(sizes) == 1 else sizes


@click.command(epilog="""\b
Examples:
  zckpt reshard ckpt/ --world-size 4 -o ckpt-ws4/
  zckpt reshard checkpoint-400 --world-size 3 --stage 3 -o resharded-400-z3/
  zckpt reshard ckpt/ --world-size 2 --stage 1 --bf16-optimizer -o ckpt-bf16opt/
  zckpt reshard ckpt/ --world-size 8 --format universal -o ckpt-universal/
  zckpt reshard ckpt/ --world-size 4 --dry-run --json
  zckpt reshard outputs/ --latest --world-size 2 -o resume-ws2/   # the newest complete checkpoint
  torchrun --standalone --nproc-per-node 8 -m zckpt reshard ckpt/ -w 64 -o ckpt-ws64/   # 8 processes""")
@click.argument("path")
@click.option("--world-size", "-w", "world_size", type=click.IntRange(1, None), required=True,
              help="Data-parallel world size the output is for.")
@click.option("--stage", type=click.IntRange(1, 3), default=None,
              help="ZeRO stage of the output (default: the source's).")
@click.option("--ep", "ep", callback=lambda ctx, param, v: _ep_sizes(v), default=None, metavar="N[,N...]",
              help="Expert-parallel size of the output (DeepSpeed MoE or AutoEP; default: the source's): one size "
                   "for every MoE layer, or one per MoE layer in order (2,4).")
@click.option("--max-group-size", "max_group_size", type=click.IntRange(1, None), default=None, metavar="N",
              help="DeepSpeed MoE (ZeRO-1/2; AutoEP at ZeRO-3 too) with --ep: the max_group_size the run passed to DeepSpeed's split_params_into_"
                   "different_moe_groups_for_optimizer (which cuts an expert group into several param groups); "
                   "needed only where the source's own cut does not say how the output's groups are cut.")
@click.option("--bf16-optimizer/--no-bf16-optimizer", "bf16_optimizer", default=None,
              help="Stage 1 + bf16 only: write for DeepSpeed's BF16 optimizer (config data_types.grad_accum_dtype "
                   "= fp32) or for the ZeRO-1 optimizer. Default: as the source, when the stage stays 1.")
@click.option("-o", "--output", "out", default=None, metavar="OUT",
              help="Output folder (local), never in or around the checkpoint. Default: next to it, e.g. "
                   "outputs/checkpoint-4 -> outputs/resharded-checkpoint-4-ws<M>[-z<S>][-universal].")
@click.option("--format", "fmt", type=click.Choice(["deepspeed", "universal"]), default="deepspeed",
              show_default=True,
              help="deepspeed: native files that a plain engine.load_checkpoint(OUT) loads at M ranks. "
                   "universal: DeepSpeed's universal layout (load with checkpoint.load_universal=true).")
@tag_option
@tie_options
@click.option("--workers", type=click.IntRange(1, 256), default=None,
              help=f"Copy threads (default: {WORKERS_DEFAULT}).")
@output_options("reshard", "files, partitions, sizes")
@storage_option
@follow_links_option
@global_options()
def reshard(path, world_size, stage, ep, max_group_size, bf16_optimizer, out, fmt, tag, workers, overwrite, durable,
            dry_run, storage_options, as_json, quiet):
    """Rewrite a DeepSpeed checkpoint as DeepSpeed would have saved it at another world size / ZeRO stage.

    Every rank file is rebuilt with the target's partitions, paddings, sub-groups and metadata: fp32 masters,
    Adam moments and step, frozen weights, buffers, loss scaler, scheduler, global steps and client state are
    all kept, bit for bit. A Trainer checkpoint-N stays one (its files are copied; see zckpt help reshard for the
    RNG files). Bytes stream from the source files; the source is never modified; OUT appears atomically.
    """
    from zckpt.engine.launch import launched
    from zckpt.ops.reshard import reshard as run
    from zckpt.units import format_size as human_bytes

    settings().output = out
    with launched() as group:  # under torchrun / srun / deepspeed: every rank writes a share, rank 0 publishes
        quiet = quiet or (group is not None and group.rank != 0)
        with Progress("reshard", enabled=not quiet and not as_json and not dry_run) as bar:
            result = run(path, out, world_size=world_size, stage=stage, fmt=fmt, tag=tag,
                         dry_run=dry_run, overwrite=overwrite, workers=workers, progress=bar,
                         bf16_optimizer=bf16_optimizer, durable=durable, storage_options=storage_options,
                         group=None if dry_run else group, ep=ep, max_group_size=max_group_size)
    if group is not None and group.rank != 0:
        return
    if not dry_run:
        published(result.output)
    doc = result.to_json()  # sizes are the planned files' (a dry run's too); payload_bytes: the tensor bytes
    if as_json:
        doc["path"] = doc.pop("source", path)  # the checkpoint read is "path" in every command
        emit_json(doc)
        return
    if quiet:  # -q: silent on success
        return
    s = result.plan.summary()
    verb = "would write" if dry_run else "wrote"
    for f in s["files"]:
        click.echo(f"{verb} {f['name']:<56} {human_bytes(f['bytes']):>10}")
    for note in s["notes"]:
        click.echo(f"note: {note}")
    src, dst = s["from"], s["to"]
    click.echo(f"{'plan' if dry_run else 'resharded'}: stage {src['stage']} ({src['optimizer']}) x{src['world_size']}"
               f" -> stage {dst['stage']} ({dst['optimizer']}) x{dst['world_size']}, {fmt}, "
               f"{human_bytes(s['total_bytes'])} -> {result.output}"
               + (f" in {result.seconds:.2f}s" if not dry_run else ""))

