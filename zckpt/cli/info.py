"""``zckpt info``: what a checkpoint holds, from metadata alone."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    emit_json, follow_links_option, global_options, storage_option, tag_option, tie_options,
)


@click.command(epilog="""\b
Examples:
  zckpt info checkpoint-400
  zckpt info outputs/ds_ckpt --tag global_step1200 --json
  zckpt info s3://bucket/run1/checkpoint-400""")
@click.argument("path")
@tag_option
@tie_options
@storage_option
@follow_links_option
@global_options()
def info(path, tag, storage_options, as_json, quiet):
    """Show a checkpoint's ZeRO stage, precision, world size, parameters, steps and files.

    PATH is a DeepSpeed save folder (with 'latest'), a tag folder (global_stepN) or a Hugging Face Trainer
    checkpoint-N folder, local or a URL (s3://, hf://). Only metadata is read: no tensor bytes, no code run.
    """
    from zckpt.ops.info import info as run, render

    result = run(path, tag, storage_options=storage_options)
    emit_json(result, tag=None) if as_json else click.echo(render(result))  # a DCP folder has no tag
