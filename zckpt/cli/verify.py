"""``zckpt verify``: exit 0 only for a complete, consistent checkpoint."""

from __future__ import annotations

import click

from zckpt.cli._common import (
    Progress, emit_json, follow_links_option, global_options, storage_option, tag_option, tie_options,
)


@click.command(epilog="""\b
Examples:
  zckpt verify checkpoint-400
  zckpt verify checkpoint-400 --deep          # also read every byte (CRC of every entry)
  zckpt verify outputs/ --latest              # the newest complete checkpoint of a training run
  zckpt verify s3://bucket/run1/checkpoint-400 --json""")
@click.argument("path")
@tag_option
@tie_options
@click.option("--deep", is_flag=True,
              help="Read every byte of every file: the CRC of every zip entry, sha256 against any push manifest.")
@storage_option
@follow_links_option
@global_options()
def verify(path, tag, deep, storage_options, as_json, quiet):
    """Check that a checkpoint is complete and consistent.

    Every rank file present and readable, partition_count agrees with the files, partitions agree with
    param_shapes, versions agree; resumable as saved ('latest' there and naming the tag: with --tag, or a tag
    folder as PATH, a note); no link leading out of the folder; every file of the checkpoint readable (zip
    directories, safetensors headers); a push manifest's files present (a push that never wrote its manifest is
    not complete). PATH: a save folder, tag, checkpoint-N or push destination. Exit status 0 when all checks pass,
    1 otherwise: then one line on stderr names the first failed check (-v prints every check).
    """
    from zckpt.cli._common import settings
    from zckpt.cli._errors import command_names
    from zckpt.errors import names_rendered
    from zckpt.ops.verify import verify as run
    from zckpt.units import format_size

    from zckpt.backup.latest import with_earlier_checkpoint

    with Progress("verify", enabled=deep and not quiet and not as_json) as bar:
        report = run(path, tag, deep=deep, progress=bar, storage_options=storage_options)
    for c in report.checks:  # a checkpoint-N's earlier state is the checkpoint next to it, not another tag
        if not c.ok and c.hint:
            c.advice = with_earlier_checkpoint(c.hint, path)
    flags = command_names(click.get_current_context().command)
    if as_json:  # (hints name the flags, as every message on the command line does: --tag)
        emit_json(report.to_json(flags))
    if not report.ok and (as_json or not settings().verbose):  # one line, as every error (--json: on stderr too)
        bad = [c for c in report.checks if not c.ok]
        c = bad[0]
        hint = f" ({names_rendered(c.hint, flags)})" if c.hint else ""
        more = f"; {len(bad) - 1} more failed check(s): {', '.join(b.name for b in bad[1:4])}" \
               f"{'...' if len(bad) > 4 else ''} (-v lists every check)" if len(bad) > 1 else ""
        click.echo(f"zckpt: error: {path}: NOT consistent: {c.name}: {c.detail}{hint}{more}", err=True)
    elif not as_json and not (quiet and report.ok):  # -q: silent on success
        for c in report.checks:
            if not (quiet and c.ok):
                hint = f" ({names_rendered(c.hint, flags)})" if c.hint else ""
                click.echo(f"{'ok ' if c.ok else 'BAD'}  {c.name}: {c.detail}{hint}")
        click.echo(f"{path}: {'complete and consistent' if report.ok else 'NOT consistent'}"
                   + (f" (read {format_size(report.bytes_read)})" if deep else ""))
    if not report.ok:
        raise SystemExit(1)
