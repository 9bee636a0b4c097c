"""``zckpt convert``: a training checkpoint in another format, optimizer state included."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    WORKERS_DEFAULT, follow_links_option,
    Progress, emit_json, global_options, output_options, published, settings, storage_option, tag_option, tie_options,
)


@click.command(epilog="""\b
Examples:
  zckpt convert ckpt/ --to dcp -o ckpt-dcp/
  zckpt convert checkpoint-400 --to dcp -o fsdp2-400/
  zckpt convert checkpoint-400 --to dcp --layout dcp -o dcp-400/
  zckpt convert ds_ckpt/ --tag global_step900 --to dcp --adam-mode adamw -o dcp/
  zckpt convert ds_ckpt/ --to dcp --layout torchtitan --ntokens-seen 0 --initial-lr 0.01,0.005 \\
      -o outputs/checkpoint/step-3/     # torchtitan's CheckpointManager.load(step=3)
  zckpt convert ckpt/ --to dcp --dry-run --json
  zckpt convert outputs/ --latest --to dcp -o latest-dcp/   # the newest complete checkpoint
  zckpt convert fsdp2-step-1200/ --to deepspeed --world-size 8 --stage 3 --ds-config ds_config.json -o ds/
  zckpt convert megatron-ckpt/ --groups megatron-default --to dcp -o fsdp2/
  zckpt convert megatron-ckpt/ --groups megatron-default --to deepspeed --world-size 8 --stage 2 --dtype bf16 -o ds/
  zckpt convert megatron-ckpt/ --to megatron --tp 2 --pp 2 -o megatron-tp2pp2/   # any TP/PP/DP (fully_reshardable)
  zckpt convert megatron-moe-ckpt/ --to megatron --ep 4 -o megatron-ep4/   # an MoE run at expert-parallel 4
  zckpt convert checkpoint-400 --to megatron --pp 2 -o megatron-400/ \\
      --megatron-args "--lr 5e-3 --train-iters 1000 --global-batch-size 4 --weight-decay 0.01"   # a DeepSpeed run""")
@click.argument("path")
@click.option("--to", "to", type=click.Choice(["dcp", "deepspeed", "megatron"]), default="dcp", show_default=True,
              help="dcp: a PyTorch Distributed Checkpoint that FSDP2 + torch.optim.AdamW resume from at any world "
                   "size (dcp.load + set_state_dict; keys as get_state_dict makes them, see zckpt help migrate-fsdp2). "
                   "deepspeed: a DCP checkpoint (FSDP2 + AdamW) as DeepSpeed ZeRO files that a plain "
                   "engine.load_checkpoint restores (needs --world-size, --ds-config or --dtype, and --stage unless "
                   "the config states it).")
@click.option("--world-size", "-w", "world_size", type=click.IntRange(1), default=None,
              help="--to deepspeed: the DeepSpeed job's ranks.")
@click.option("--stage", type=click.IntRange(1, 3), default=None,
              help="--to deepspeed: the ZeRO stage (1, 2, 3); default: the --ds-config's zero_optimization.stage.")
@click.option("--ds-config", default=None, metavar="JSON",
              help="--to deepspeed: the DeepSpeed config the job runs with (precision, gradient_clipping and "
                   "zero_optimization shape the files).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="--to deepspeed without --ds-config: the precision the DeepSpeed engine trains in (DeepSpeed's "
                   "defaults shape the rest; gradient clipping is left to the engine).")
@click.option("--buffers", default=None, metavar="NAMES",
              help="--to deepspeed: comma-separated names or fnmatch patterns of the module tensors without "
                   "optimizer state that are buffers (DCP does not record it); '' when none are.")
@click.option("--tied", multiple=True, metavar="ALIAS=SOURCE",
              help="--to deepspeed: a weight FSDP2 saved under two names (e.g. lm_head.weight=embed.weight), "
                   "written as DeepSpeed's shared_params. Repeatable; '' for none. Default: the ties the files "
                   "state (zckpt's own DCP output, tie_word_embeddings in config.json); a tensor without "
                   "optimizer state with the same bytes as a trainable one is refused until named.")
@click.option("-o", "--output", "out", default=None, metavar="OUT",
              help="Output folder (local), never in or around the checkpoint. Default: next to it, e.g. "
                   "outputs/checkpoint-4 -> outputs/converted-checkpoint-4-dcp.")
@click.option("--layout", type=click.Choice(["auto", "dcp", "trainer", "torchtitan", "fully_reshardable",
                                           "dp_reshardable"]), default="auto",
              show_default=True,
              help="--to dcp: dcp = one DCP folder (model, optim, scheduler, counters); trainer = a Hugging Face "
                   "Trainer / Accelerate FSDP2 checkpoint folder (pytorch_model_fsdp_0/, optimizer_0/, the "
                   "Trainer's scheduler.pt, trainer_state.json, rng states); torchtitan = a step-<N> folder "
                   "torchtitan's CheckpointManager loads (model keys at the top, flat optimizer state, "
                   "lr_scheduler, train_state; needs --ntokens-seen); auto = trainer for a checkpoint-N. --to "
                   "megatron: fully_reshardable (the default: resumes at any TP/PP/DP); dp_reshardable = Megatron-LM's "
                   "default layout, the optimizer's buckets for this TP/PP (needs --dp and the DDP settings).")
@click.option("--tp", type=click.IntRange(1), default=None,
              help="--to megatron: the tensor-parallel size the Megatron-LM job resumes at (default: the source's).")
@click.option("--pp", type=click.IntRange(1), default=None,
              help="--to megatron: the pipeline-parallel size (even stages only; default: the source's).")
@click.option("--ep", type=click.IntRange(1), default=None,
              help="--to megatron of a mixture-of-experts save: the expert-parallel size the Megatron-LM job resumes "
                   "at (fully_reshardable; it must divide the experts; default: the source's).")
@click.option("--dp", type=click.IntRange(1), default=None,
              help="--layout dp_reshardable: the data-parallel size the Megatron-LM job resumes at (the buckets' "
                   "padding and each rank's shard depend on it; default: the source's, at its own TP/PP).")
@click.option("--ddp-config", "ddp_config", default=None, metavar="KEY=VALUE[,...]",
              help="--layout dp_reshardable: the target run's DDP settings the buckets depend on, as megatron-core's "
                   "DistributedDataParallelConfig names them: overlap_grad_reduce, bucket_size (elements or none), "
                   "grad_reduce_in_fp32, pad_buckets_for_high_nccl_busbw; default: the source's Megatron-LM args "
                   "(refused where they do not say).")
@click.option("--megatron-args", "megatron_args", default=None, metavar="FLAGS",
              help="--to megatron from a run Megatron did not train (DeepSpeed, FSDP2 under Hugging Face Llama "
                   "names): the pretrain_gpt.py flags the job will resume with that state its schedule and batch, "
                   "e.g. '--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 1000 "
                   "--global-batch-size 8 --weight-decay 0.1'. Needs --lr, --global-batch-size and --train-iters "
                   "(or --train-samples); other flags of the schedule, weight decay and Adam are read, any other is "
                   "refused. The scheduler is made as Megatron-LM makes it, stepped to the source's step.")
@click.option("--ntokens-seen", type=click.IntRange(0), default=None, metavar="N",
              help="--layout torchtitan: train_state.ntokens_seen (no DeepSpeed file records it; 0 restarts the "
                   "count).")
@click.option("--lr-last-epoch", type=click.IntRange(0), default=None, metavar="N",
              help="--layout torchtitan: lr_scheduler.last_epoch, when the source's scheduler state does not say "
                   "it (default: a torch scheduler's last_epoch, DeepSpeed's last_batch_iteration + 1).")
@click.option("--initial-lr", default=None, metavar="LR[,LR...]",
              help="--layout torchtitan: each param group's initial_lr (torchtitan's LambdaLR keeps one per group), "
                   "when the source's groups have none: one value, or one per group in the source's order.")
@click.option("--adam-mode", type=click.Choice(["adamw", "adam"]), default=None,
              help="For DeepSpeed's FusedAdam / DeepSpeedCPUAdam when the checkpoint does not say: adamw "
                   "(decoupled weight decay, their default) or adam (L2). Default: from the saved config.")
@click.option("--groups", "groups", multiple=True, metavar="RULE",
              help="A Megatron-Core source: its param groups, which its files do not list. megatron-default = "
                   "Megatron's standard two (1-D parameters and *.bias without weight decay, the rest with it), "
                   "checked against the groups' wd_mult; or GLOB=K per group (Megatron names, first match wins, "
                   "e.g. '*norm*=1' '*=0'). Repeatable.")
@click.option("--native-names", is_flag=True,
              help="A Megatron-Core source: keep Megatron's tensor names (default: Hugging Face Llama's, when the "
                   "files say the model is Llama-shaped). A DeepSpeed AutoEP source: keep AutoEP's expert and "
                   "router names (default: the model class's, when the config.json beside it says the class).")
@click.option("--hf-config", "hf_config", default=None, metavar="CONFIG.json",
              help="--to deepspeed of a torchtitan Qwen3 / Qwen3-MoE / Llama 3 / DeepSeek-V3 save (its step-N folder): "
                   "the config.json of the transformers class the DeepSpeed job trains (torchtitan saves none); the "
                   "state is written under its names and fusion, the fused qkv's optimizer state split by its heads.")
@tag_option
@tie_options
@click.option("--workers", type=click.IntRange(1, 256), default=None,
              help=f"Copy threads (default: {WORKERS_DEFAULT}).")
@output_options("convert", "files, keys, sizes")
@storage_option
@follow_links_option
@global_options()
def convert(path, to, world_size, stage, ds_config, dtype, buffers, tied, out, layout, tp, pp, ep, dp, ddp_config,
            megatron_args,
            ntokens_seen,
            lr_last_epoch, initial_lr, adam_mode, groups, native_names, hf_config, tag, workers, overwrite, durable,
            dry_run,
            storage_options, as_json, quiet):
    """Convert a DeepSpeed checkpoint into a PyTorch DCP checkpoint, or back (or a Megatron-Core one into any of them,
    or into a Megatron-LM save folder that resumes at any TP/PP/DP), keeping the whole training state.

    The fp32 masters become the model parameters; Adam moments, steps and param groups (lr, betas, eps, weight
    decay) become torch AdamW state under each parameter's name; frozen weights, buffers, the LR scheduler state
    and counters are kept, bit for bit. Bytes stream from the source files; .metadata is written last and the
    folder appears atomically. With --to deepspeed, a DCP checkpoint of FSDP2 + AdamW becomes DeepSpeed ZeRO-1/2/3
    files for the world size and stage named (latest and the marker written last).
    """
    from zckpt.ops.convert import convert as run
    from zckpt.engine.launch import launched
    from zckpt.units import format_size as human_bytes

    settings().output = out
    if to == "deepspeed":  # --stage against the config it names (the options of each --to: cli/_applies.py)
        from zckpt.cli._applies import convert_config
        stage = convert_config(ds_config, stage, dtype, storage_options)
    titan = {"ntokens_seen": ntokens_seen, "lr_last_epoch": lr_last_epoch, "initial_lr": _lrs(initial_lr)}
    with launched() as group:  # under torchrun / srun / deepspeed: every rank writes a share, rank 0 publishes
        quiet = quiet or (group is not None and group.rank != 0)
        with Progress("convert", enabled=not quiet and not as_json and not dry_run) as bar:
            result = run(path, to=to, out=out, tag=tag, dry_run=dry_run, overwrite=overwrite, workers=workers,
                         progress=bar, durable=durable, adam_mode=adam_mode, storage_options=storage_options,
                         world_size=world_size, stage=stage, ds_config=ds_config, buffers=buffers, tied=list(tied),
                         dtype=dtype, layout=layout, group=None if dry_run else group,
                         torchtitan={k: v for k, v in titan.items() if v is not None} or None,
                         groups=list(groups) or None, native_names=native_names, hf_config=hf_config,
                         **({"tp": tp, "pp": pp, "ep": ep, "megatron_args": megatron_args, "dp": dp,
                             "ddp_config": ddp_config}
                            if to == "megatron" else {}))
    if group is not None and group.rank != 0:
        return
    if not dry_run:
        published(result.output)
    if as_json:
        doc = result.to_dict()  # (the fields zckpt.convert's result has)
        doc["path"] = doc.get("path") or path  # the checkpoint read is "path" in every command
        if to in ("dcp", "megatron"):
            doc["format"] = doc.get("format") or to
        emit_json(doc)
        return
    if quiet:  # -q: silent on success
        return
    s = result.plan.summary()
    if to == "deepspeed":
        return _render_deepspeed(s, result, dry_run, human_bytes)
    verb = "would write" if dry_run else "wrote"
    for f in s["files"]:
        click.echo(f"{verb} {f['name']:<48} {human_bytes(f['bytes']):>10}")
    for note in s["notes"]:
        click.echo(f"note: {note}")
    opt = f", optimizer {s['optimizer']}" if s["optimizer"] else ""
    click.echo(f"{'plan' if dry_run else 'converted'}: {s['from']} -> {s['to']} ({s['layout']} layout), "
               f"{s['keys']} keys{opt}, "
               f"{human_bytes(s['total_bytes'])} -> {result.output}"
               + (f" in {result.seconds:.2f}s" if not dry_run else ""))


def _lrs(text: str | None) -> list[float] | None:
    if text is None:
        return None
    from zckpt.cli._errors import CommandLineError
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise CommandLineError(f"--initial-lr: {text!r} is not a number or a comma-separated list of numbers",
                               hint="e.g. --initial-lr 0.01 or --initial-lr 0.01,0.005") from None


def _render_deepspeed(s: dict, result, dry_run: bool, human_bytes) -> None:
    verb = "would write" if dry_run else "wrote"
    for f in s["files"]:
        click.echo(f"{verb} {f['name']:<56} {human_bytes(f['bytes']):>10}")
    for note in s["notes"]:
        click.echo(f"note: {note}")
    to = s["to"]
    src = {"dcp": "DCP", "megatron": "Megatron-Core"}.get(getattr(result.plan, "source_format", "dcp"), "DCP")
    from zckpt.units import counted
    click.echo(f"{'plan' if dry_run else 'converted'}: {src} ({counted(s['from']['world_size'], 'rank')}) -> "
               f"DeepSpeed ZeRO-{to['stage']} x {counted(to['world_size'], 'rank')} ({s['precision']}), "
               f"{human_bytes(s['total_bytes'])} -> "
               f"{result.output}" + (f" in {result.seconds:.2f}s" if not dry_run else ""))
