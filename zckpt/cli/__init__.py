"""The ``zckpt`` command line: a click group of thin commands.

Each command lives in its own module (``zckpt/cli/<name>.py``) and is loaded only when it runs or when help is
listed. Nothing here imports torch: ``zckpt --help`` answers at once.
Errors are mapped to one line on stderr in :func:`_report` (a traceback only with ``--debug`` or
``ZCKPT_DEBUG=1``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from zckpt.errors import ZckptError

COMMANDS = {
    "info": "zckpt.cli.info:info",
    "verify": "zckpt.cli.verify:verify",
    "merge": "zckpt.cli.merge:merge",
    "reshard": "zckpt.cli.reshard:reshard",
    "push": "zckpt.cli.push:push",
    "estimate": "zckpt.cli.estimate:estimate",
}

EXIT_ERROR = 1  # zckpt refused the input or failed cleanly
EXIT_USAGE = 2  # click's own code for bad options
EXIT_INTERRUPTED = 130


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, so one command's imports never slow another."""

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

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("zckpt: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as exc:  # noqa: BLE001 - the one place errors become messages
            _report(exc, ctx)


def debug_enabled(ctx=None) -> bool:
    if os.environ.get("ZCKPT_DEBUG", "") not in ("", "0"):
        return True
    ctx = ctx or click.get_current_context(silent=True)
    return bool(ctx and ctx.find_root().params.get("debug"))


def _report(exc: BaseException, ctx) -> None:
    if debug_enabled(ctx):
        raise exc
    if isinstance(exc, ZckptError):
        msg = str(exc)
    elif isinstance(exc, OSError):
        where = exc.filename if getattr(exc, "filename", None) else ""
        msg = f"{where}: {exc.strerror or exc}" if where else f"{exc.strerror or exc}"
        if isinstance(exc, PermissionError):
            msg += " (check the permissions of that path)"
        elif getattr(exc, "errno", None) == 28:
            msg += " (the disk is full; free space or choose another -o)"
    else:
        msg = f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback and report it)"
    click.echo(f"zckpt: error: {' '.join(msg.split())}", err=True)
    ctx.exit(EXIT_ERROR)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="""\b
Examples:
  zckpt info checkpoint-400
  zckpt merge checkpoint-400 --to safetensors -o model/
  zckpt reshard ckpt/ --world-size 4 -o ckpt-ws4/
  zckpt push outputs/ s3://bucket/run1 --every 30m

Set ZCKPT_DEBUG=1 (or pass --debug) for tracebacks. Docs: docs/guide.md""",
)
@click.version_option(package_name="zckpt", prog_name="zckpt")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.option("-v", "--verbose", count=True, help="More log output (repeatable).")
def main(debug: bool, verbose: int) -> None:
    """zckpt: read, merge, reshard and push DeepSpeed ZeRO checkpoints.

    Safe on files from strangers (no pickle code is ever run), exact to the bit, streaming in bounded memory.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="zckpt: %(levelname)s: %(message)s", stream=sys.stderr)
