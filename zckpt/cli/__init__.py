"""The ``zckpt`` command line: a click group of thin commands.

Each command lives in its own module (``zckpt/cli/<name>.py``) and is loaded only when it runs or when help is
listed. Nothing here imports torch: ``zckpt --help`` answers at once.
Errors, click's usage errors included, are mapped to one line on stderr in :func:`_report`, by the one table in
``_errors.py`` (a traceback only with ``--debug`` or ``ZCKPT_DEBUG=1``; with ``--json`` also one error object on
stdout). Ctrl-C at any moment is one line and exit 130 (``_interrupts.py``; ``push --every`` between runs: 0);
after the result was published it is reported as published, exit 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import time

import click

from zckpt.cli import _interrupts as interrupts
from zckpt.cli._common import (
    Settings, configure_logging, flag_dtypes, global_options, logging_state, restore_logging, settings,
)
from zckpt.cli._errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, command_names, describe  # noqa: F401

COMMANDS = {
    "info": "zckpt.cli.info:info",
    "verify": "zckpt.cli.verify:verify",
    "merge": "zckpt.cli.merge:merge",
    "reshard": "zckpt.cli.reshard:reshard",
    "convert": "zckpt.cli.convert:convert",
    "push": "zckpt.cli.push:push",
    "estimate": "zckpt.cli.estimate:estimate",
    "diff": "zckpt.cli.diff:diff",
    "help": "zckpt.cli.help:help_command",
}



class LazyGroup(click.Group):
    """A group whose commands are imported on first use, so one command's imports never slow another.

    It is also the one place errors become messages (:meth:`main`, by the table in ``_errors.py``): click's usage
    errors, zckpt's errors and Ctrl-C alike."""

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
        ctx.meta["zckpt.started"] = time.time()
        ctx.meta.setdefault("zckpt.logging", logging_state())
        ctx.call_on_close(lambda: restore_logging(ctx.meta["zckpt.logging"]))
        return super().parse_args(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's ``main``, but every way out (result, error, Ctrl-C) is decided here: one line, one exit
        status from the table in ``_errors.py``, then ``sys.exit``."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        args = sys.argv[1:] if args is None else list(args)
        previous = interrupts.begin()
        ctx, code = None, EXIT_OK
        try:
            self._main_shell_completion(extra, prog_name or "zckpt", complete_var)
            with self.make_context(prog_name or "zckpt", args, **extra) as ctx:
                self.invoke(ctx)
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            code = exc.exit_code
        except (KeyboardInterrupt, click.exceptions.Abort):
            code = _interrupted(ctx)
        except SystemExit as exc:  # a command's own verdict (verify: 1)
            code = exc.code if isinstance(exc.code, int) else EXIT_ERROR
        except Exception as exc:  # noqa: BLE001 - the one place errors become messages
            failed = getattr(exc, "ctx", None) or ctx
            try:
                code = _interrupted(failed) if _raised_while_interrupted(exc) else _report(exc, failed)
            except KeyboardInterrupt:
                code = _interrupted(failed)
        code = interrupts.end(previous, ctx, code)
        sys.exit(code)


def _raised_while_interrupted(exc: BaseException) -> bool:
    """``exc`` came from cleanup code that ran because of a Ctrl-C (its context is the KeyboardInterrupt): what
    happened is the interrupt, not a failure; the cleanup's own error is logged (-v). Also an error raised FROM the
    interrupt: Python 3.11 wraps a Ctrl-C that lands in a class body's ``__set_name__`` (a dataclass being imported)
    as ``RuntimeError("Error calling __set_name__ ...")`` with the KeyboardInterrupt as its cause."""
    seen, todo = set(), [exc.__cause__, exc.__context__]
    while todo:
        context = todo.pop()
        if context is None or id(context) in seen:
            continue
        if isinstance(context, KeyboardInterrupt):
            logging.getLogger("zckpt").info("while interrupted: %s: %s", type(exc).__name__, exc)
            return True
        seen.add(id(context))
        todo += [context.__cause__, context.__context__]
    return False


def _json_wanted(ctx) -> bool:
    """--json given anywhere on the command line (also when parsing stopped before it was read)."""
    if ctx is None:
        return False
    argv = ctx.meta.get("zckpt.argv", [])
    argv = argv[:argv.index("--")] if "--" in argv else argv
    return settings(ctx).json or "--json" in argv


def debug_enabled(ctx=None) -> bool:
    return settings(ctx).show_debug


def _report(exc: BaseException, ctx) -> int:
    """Print ``exc`` as one line on stderr (and, with --json, as one object on stdout); return the exit status."""
    if ctx is not None and debug_enabled(ctx) and not isinstance(exc, click.ClickException):
        raise exc
    s = settings(ctx) if ctx is not None else Settings()
    command = _command_of(ctx)
    err = describe(exc, s.output, command_names(_command_object(ctx, command)), command)
    if _json_wanted(ctx):
        doc = err.to_json(command)
        partial = getattr(exc, "push_result", None)  # what a failed push did finish
        if partial is not None and hasattr(partial, "to_dict"):
            from zckpt.cli.push import result_json

            doc["result"] = flag_dtypes({"ok": False, "command": command, **result_json(partial)})
        click.echo(json.dumps(doc, default=str))
    if not getattr(exc, "zckpt_reported", False):
        click.echo(f"zckpt: error: {err.message}", err=True)
    return err.exit_code


def _interrupted(ctx) -> int:
    """Ctrl-C: one line. What was already published stays published and is said so (exit 0)."""
    done = interrupts.published_output(ctx)
    if done is not None:
        click.echo(f"zckpt: interrupted, but the result was already published: {done} is complete", err=True)
        return EXIT_OK
    click.echo("zckpt: interrupted", err=True)
    if ctx is not None and _json_wanted(ctx):
        click.echo(json.dumps(describe(KeyboardInterrupt()).to_json(_command_of(ctx))))
    return EXIT_INTERRUPTED


def _command_of(ctx) -> str | None:
    if ctx is None:
        return None
    root = ctx.find_root()
    if root.invoked_subcommand:
        return root.invoked_subcommand
    return next((a for a in ctx.meta.get("zckpt.argv", []) if a in COMMANDS), None)


def _command_object(ctx, command):
    if ctx is None or command is None:
        return None
    try:
        return main.get_command(ctx, command)
    except Exception:  # noqa: BLE001 - only used to name flags
        return None


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

\b
Guides (installed with zckpt): zckpt help [TOPIC]. Every option: zckpt COMMAND --help.
Exit status: 0 done, 1 refused or failed, 2 command line unreadable, 75 network or server
fault after the retries (run again later), 130 interrupted; push --every stopped by Ctrl-C
between runs exits 0.
Set ZCKPT_DEBUG=1 (or pass --debug) for tracebacks.""",
)
@click.version_option(package_name="zckpt", prog_name="zckpt")
@global_options(expose=False)
def main() -> None:
    """zckpt: read, merge, reshard, convert and push training checkpoints (DeepSpeed ZeRO, PyTorch DCP / FSDP2,
    Megatron-Core torch_dist).

    Safe on files from strangers (no pickle code is ever run), exact to the bit, streaming in bounded memory.
    --json, -q, -v and --debug work before or after the command name.
    """
    configure_logging(settings())
