"""The ``zckpt`` command line: a click group of thin commands.

Each command lives in its own module (``zckpt/cli/<name>.py``) and is loaded only when it runs or when help is
listed. Nothing here imports torch: ``zckpt --help`` answers at once.
Errors are mapped to one line on stderr in :func:`_report`, by the one table in ``_errors.py`` (a traceback only
with ``--debug`` or ``ZCKPT_DEBUG=1``; with ``--json`` also one error object on stdout).
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import click

from zckpt.cli._common import configure_logging, global_options, logging_state, restore_logging, settings
from zckpt.cli._errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, describe  # noqa: F401

COMMANDS = {
    "info": "zckpt.cli.info:info",
    "verify": "zckpt.cli.verify:verify",
    "merge": "zckpt.cli.merge:merge",
    "reshard": "zckpt.cli.reshard:reshard",
    "convert": "zckpt.cli.convert:convert",
    "push": "zckpt.cli.push:push",
    "estimate": "zckpt.cli.estimate:estimate",
}



class LazyGroup(click.Group):
    """A group whose commands are imported on first use, so one command's imports never slow another.

    It is also the one place errors become messages (:func:`_report`, by the table in ``_errors.py``)."""

    def list_commands(self, ctx):
        return [name for name in COMMANDS if self._available(name)]

    @staticmethod
    def _available(name):
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def get_command(self, ctx, name):
        if name not in COMMANDS or not self._available(name):
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def parse_args(self, ctx, args):
        ctx.meta["zckpt.argv"] = list(args)
        ctx.meta.setdefault("zckpt.logging", logging_state())
        ctx.call_on_close(lambda: restore_logging(ctx.meta["zckpt.logging"]))
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if _json_wanted(ctx):
                _report(exc, ctx)
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.UsageError as exc:
            if _json_wanted(ctx):
                _report(exc, ctx)
            raise
        except click.ClickException:
            raise
        except KeyboardInterrupt as exc:
            exc.zckpt_reported = True  # said below as "zckpt: interrupted", not as an error
            click.echo("zckpt: interrupted", err=True)
            _report(exc, ctx)
        except Exception as exc:  # noqa: BLE001 - the one place errors become messages
            _report(exc, ctx)


def _json_wanted(ctx) -> bool:
    """--json given anywhere on the command line (also when parsing stopped before it was read)."""
    argv = ctx.meta.get("zckpt.argv", [])
    argv = argv[:argv.index("--")] if "--" in argv else argv
    return settings(ctx).json or "--json" in argv


def debug_enabled(ctx=None) -> bool:
    return settings(ctx).show_debug


def _report(exc: BaseException, ctx) -> None:
    """Print ``exc`` as one line on stderr (and, with --json, as one object on stdout), then exit."""
    if debug_enabled(ctx) and not isinstance(exc, (click.UsageError, KeyboardInterrupt)):
        raise exc
    err = describe(exc, settings(ctx).output)
    if _json_wanted(ctx):
        doc = err.to_json(_command_of(ctx))
        partial = getattr(exc, "push_result", None)  # what a failed push did finish
        if partial is not None and hasattr(partial, "to_dict"):
            doc["result"] = partial.to_dict()
        click.echo(json.dumps(doc, default=str))
    if not getattr(exc, "zckpt_reported", False):
        click.echo(f"zckpt: error: {err.message}", err=True)
    ctx.exit(err.exit_code)


def _command_of(ctx) -> str | None:
    if ctx.invoked_subcommand:
        return ctx.invoked_subcommand
    return next((a for a in ctx.meta.get("zckpt.argv", []) if a in COMMANDS), None)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="""\b
Examples:
  zckpt info checkpoint-400
  zckpt merge checkpoint-400 --to safetensors -o model/
  zckpt reshard ckpt/ --world-size 4 -o ckpt-ws4/
  zckpt convert ckpt/ --to dcp -o ckpt-dcp/
  zckpt push outputs/ s3://bucket/run1 --every 30m

Set ZCKPT_DEBUG=1 (or pass --debug) for tracebacks. Docs: docs/guide.md""",
)
@click.version_option(package_name="zckpt", prog_name="zckpt")
@global_options(expose=False)
def main() -> None:
    """zckpt: read, merge, reshard and push DeepSpeed ZeRO checkpoints.

    Safe on files from strangers (no pickle code is ever run), exact to the bit, streaming in bounded memory.
    --json, -q, -v and --debug work before or after the command name.
    """
    configure_logging(settings())
