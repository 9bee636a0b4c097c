"""``zckpt diff A B``: exit 0 when two checkpoints hold the same training state (within the tolerance), 1 when not."""

from __future__ import annotations

import click

from zckpt.cli._common import Progress, emit_json, global_options, storage_option, tie_options

_SHOWN = 10  # differences named without -v


@click.command(epilog="""\b
Examples:
  zckpt diff ckpt/ ds_ckpt/                     # the same training state?
  zckpt diff ckpt/ ds_ckpt/ --only weights,optimizer --exclude 'blocks.*.bias'
  zckpt diff checkpoint-400 outputs/checkpoint-400 --atol 1e-6 -v
  zckpt diff megatron-ckpt/ megatron-ckpt/ --include 'model.layers.0.*' --json
Check a conversion or reshard: zckpt help check-conversion.""")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--only", "only", default=None, metavar="PARTS",
              help="Compare only these parts, comma-separated: weights (every tensor's value: the fp32 masters where "
                   "both sides hold them), masters, optimizer (every per-element optimizer state), groups (members, "
                   "lr, betas, eps, weight decay, step), counters (global steps, samples, scheduler, DeepSpeed's "
                   "client state). Default: all.")
@click.option("--include", "include", multiple=True, metavar="GLOB",
              help="Compare only tensors whose name (Hugging Face names where the model is Llama-shaped) matches "
                   "GLOB (fnmatch, repeatable).")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
              help="Leave out tensors whose name matches GLOB (repeatable; applied after --include).")
@click.option("--atol", type=float, default=None, metavar="X",
              help="Elements with |a-b| <= X + rtol*|b| count as equal (default: equal bits only).")
@click.option("--rtol", type=float, default=None, metavar="X",
              help="Elements with |a-b| <= atol + X*|b| count as equal (b: the value in B).")
@click.option("--ulp", type=int, default=None, metavar="N",
              help="Elements at most N units in the last place apart count as equal (same dtype on both sides).")
@click.option("--tag-a", "tag_a", default=None, metavar="TAG", help="Tag (or Megatron iteration) of A to read.")
@click.option("--tag-b", "tag_b", default=None, metavar="TAG", help="Tag (or Megatron iteration) of B to read.")
@click.option("--workers", type=int, default=None, metavar="N",
              help="Threads comparing ranges at once (default: the CPUs, at most 8).")
@tie_options
@storage_option
@global_options()
def diff(a, b, only, include, exclude, atol, rtol, ulp, tag_a, tag_b, workers, storage_options, as_json, quiet):
    """Compare two checkpoints of any format and layout: exit 0 when they hold the same training state.

    A and B: any checkpoint zckpt reads (DeepSpeed, DCP / FSDP2 / torchtitan / a Trainer FSDP checkpoint-N,
    Megatron-Core torch_dist, a Hugging Face folder of safetensors or .bin), local or a URL. Tensors are matched
    by name (Megatron's fused tensors split into Hugging Face Llama names where the files say the model is
    Llama-shaped; a tied alias compared once) and streamed in aligned ranges, every byte CRC-checked where the
    files hold one. One summary line (N equal, M differ, K only in A, L only in B), the first differences named;
    -v lists every tensor and value. Exit status 0 when everything compared is equal (within --atol / --rtol /
    --ulp), 1 when anything differs or is on one side only. Under torchrun / srun each rank compares a share.
    """
    from zckpt.cli._common import settings
    from zckpt.engine.launch import launched
    from zckpt.errors import InvalidArgument
    from zckpt.ops.diff import diff as run

    if workers is not None and workers < 1:
        raise InvalidArgument(f"{workers}: at least 1", param="workers")
    with launched() as group:  # under torchrun / srun / deepspeed: each rank compares a share, rank 0 says it
        with Progress("diff", enabled=not quiet and not as_json and (group is None or group.rank == 0)) as bar:
            result = run(a, b, only=only, include=include, exclude=exclude, atol=atol, rtol=rtol, ulp=ulp,
                         tag_a=tag_a, tag_b=tag_b, storage_options=storage_options, workers=workers, progress=bar,
                         group=group)
    if group is not None and group.rank != 0:  # the same verdict (exit status) on every rank, said once
        if not result.ok:
            raise SystemExit(1)
        return
    if as_json:  # (and the verdict's one line on stderr when they differ, as every failing command says it)
        emit_json(result.to_json())
        if not result.ok:
            click.echo(f"zckpt: error: {result.summary()} ({result.a} vs {result.b})", err=True)
    else:
        _render(result, settings().verbose, quiet)
    if not result.ok:
        raise SystemExit(1)


def _render(result, verbose: int, quiet: bool) -> None:
    items = result.tensors + result.values
    if verbose:
        for x in items:
            click.echo(x.line())
    else:
        bad = [x for x in items if x.status == "differ"]
        for x in bad[:_SHOWN]:
            click.echo(x.line(), err=True)
        if len(bad) > _SHOWN:
            click.echo(f"... and {len(bad) - _SHOWN} more (-v lists every tensor)", err=True)
    for what, names in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        shown = names if verbose else names[:_SHOWN]
        for name in shown:
            click.echo(f"{what}: {name}", err=not verbose)
        if len(names) > len(shown):
            click.echo(f"... {len(names) - len(shown)} more {what} (-v lists them)", err=True)
    if not quiet or not result.ok:
        for line in result.not_compared:
            click.echo(f"not compared: {line}", err=True)
        if not quiet:
            for line in result.notes:
                click.echo(f"note: {line}", err=True)
    if result.ok:
        if not quiet:
            click.echo(f"{result.summary()} ({result.a} vs {result.b})")
    else:
        click.echo(f"zckpt: error: {result.summary()} ({result.a} vs {result.b})", err=True)
