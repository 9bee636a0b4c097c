"""``zckpt push``: copy complete checkpoints to a folder, S3 or the Hub, incrementally, manifest last.

Thin: parse the options, call :func:`zckpt.backup.push.push` / :func:`zckpt.backup.schedule.push_every`, draw
progress, print one line per checkpoint (or JSON). No torch import here.
"""

from __future__ import annotations

import os
import signal
import logging
import threading

import click

from zckpt.cli._common import (
    Progress, describe_here, emit_json, follow_links_option, global_options, published, storage_option,
)
from zckpt.errors import InvalidArgument

log = logging.getLogger(__name__)

def parse_duration(text: str, flag: str | None = None, positive: bool = False) -> float:
    """``90s``, ``30m``, ``2h``, ``1h30m``, ``0`` -> seconds (:func:`zckpt.units.parse_duration`)."""
    from zckpt.units import parse_duration as _parse

    return _parse(text, flag, positive=positive)


def _check_src(src: str) -> None:
    """SRC must be an existing local folder: said as every command says a missing path."""
    from zckpt.errors import CheckpointNotFound

    if "://" in src:
        return  # push() says SRC must be local
    if not os.path.exists(src):
        raise CheckpointNotFound("no such file or folder", path=src, hint="check the path")
    if not os.path.isdir(src):
        raise InvalidArgument("expected a folder holding checkpoints, got a file", path=src, param="src",
                              hint="pass the training output folder (or one checkpoint folder)")


def parse_size(text: str, flag: str | None = "--part-size") -> int:
    """``64MB`` = ``64M`` -> 64*10**6, ``8MiB`` -> 8*2**20, ``5000000`` -> bytes (:func:`zckpt.units.parse_size`)."""
    from zckpt.units import parse_size as _parse

    return _parse(text, flag, what="a part size")


class _Progress:
    """Turns PushEvents into one progress bar per checkpoint being sent (:class:`Progress`: a terminal only, fed
    by the bytes the destination reports, none for a checkpoint already up to date) and summary lines on stdout."""

    def __init__(self, quiet: bool, as_json: bool):
        self.bars_on = not quiet and not as_json
        self.quiet, self.as_json = quiet, as_json
        self.lock = threading.Lock()
        self.bars: dict[str, list] = {}  # checkpoint -> [Progress, bytes done, total]
        self.sending: list[str] = []  # checkpoints started and not done (what a Ctrl-C leaves unfinished)

    def __call__(self, event) -> None:
        _log_event(event)
        with self.lock:
            if event.kind == "checkpoint-start":
                self.sending.append(event.checkpoint)
            elif event.kind == "checkpoint-done" and event.checkpoint in self.sending:
                self.sending.remove(event.checkpoint)
            if event.kind == "checkpoint-start" and self.bars_on and event.total:
                self.bars[event.checkpoint] = [Progress(event.checkpoint or "checkpoint"), 0, event.total]
            elif event.kind == "bytes" and event.checkpoint in self.bars:
                entry = self.bars[event.checkpoint]
                entry[1] += event.nbytes
                entry[0](entry[1], entry[2])
            elif event.kind == "checkpoint-done":
                entry = self.bars.pop(event.checkpoint, None)
                if entry is not None:
                    entry[0].close()
                if not self.as_json and not self.quiet and event.result is not None:
                    if event.result.status != "failed":  # failures are printed once, as errors, at the end
                        click.echo(event.result.summary())
            elif event.kind == "skipped" and not self.as_json and not self.quiet:
                click.echo(f"{_label(event.checkpoint)}: {event.message}, not pushed")
            elif event.kind == "waiting" and not self.quiet and not self.as_json:  # retries are logged
                click.echo(f"zckpt: {_label(event.checkpoint)}: {event.message}", err=True)
            elif event.kind == "removed" and not self.as_json and not self.quiet:
                click.echo(f"{event.checkpoint}: removed from DEST (--keep-last)")

    def close(self) -> None:
        with self.lock:
            for entry in self.bars.values():
                entry[0].close()
            self.bars.clear()


def _log_event(event) -> None:
    """-v: what push does, checkpoint by checkpoint, with timings; -vv: every file."""
    from zckpt.units import format_size

    name = _label(event.checkpoint)
    if event.kind == "checkpoint-start":
        log.info("%s: sending %d file(s), %s", name, getattr(event, "files", 0) or 0, format_size(event.total))
    elif event.kind == "file-done":
        log.debug("  %s/%s: sent (%s)", name, event.path, format_size(event.nbytes))
    elif event.kind == "checkpoint-done" and event.result is not None:
        r = event.result
        log.info("%s: %s in %.2fs (%d file(s) sent, %d already at DEST)", name, r.status, r.seconds, r.files_sent,
                 r.files_skipped)
    elif event.kind == "retry":
        log.info("%s: %s", name, event.message)


def _label(checkpoint: str | None) -> str:
    """A checkpoint as the user knows it: SRC itself (name "") is "SRC", never "."."""
    return checkpoint if checkpoint and checkpoint != "." else "SRC"


def result_json(result) -> dict:
    """A PushResult as --json says it: SRC is ``path`` and DEST ``output``, as in every command (each checkpoint's
    own place at DEST is its ``output`` too)."""
    doc = result.to_dict()
    doc = {"path": doc.pop("src"), "output": doc.pop("dest"), **doc}
    doc["checkpoints"] = [{("output" if k == "dest" else k): v for k, v in c.items()} for c in doc["checkpoints"]]
    return doc


def _render(result, as_json: bool, quiet: bool) -> None:
    if as_json:
        emit_json(result_json(result), command="push")
    elif not quiet:
        for name in result.root_files_sent:
            click.echo(f"{name}: {'would update' if result.dry_run else 'updated'} at DEST")
        if not result.checkpoints:
            click.echo("no checkpoints found in SRC")  # a one-shot push then fails, unless --allow-empty


@click.command(epilog="""\b
Examples:
  zckpt push outputs/ s3://bucket/run1                  # every complete checkpoint, once
  zckpt push outputs/ s3://bucket/run1 --every 30m --keep-last 3
  zckpt push outputs/ hf://me/run1-checkpoints --once   # one commit per checkpoint
  zckpt push ds_save/ /mnt/backup/run1 --dry-run        # what would be sent
  AWS_ENDPOINT_URL=http://127.0.0.1:8333 zckpt push outputs/ s3://bucket/run1 --json

\b
S3 credentials and endpoint come from the usual AWS variables (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...); --storage-option passes any fsspec/s3fs option. Guide: zckpt help push""")
@click.argument("src")
@click.argument("dest")
@click.option("--every", "every", metavar="INTERVAL", help="Push again every INTERVAL (90s, 30m, 2h) until Ctrl-C.")
@click.option("--once", is_flag=True, help="Push once and exit (the default).")
@click.option("--keep-last", type=click.IntRange(min=1), metavar="N",
              help="Push only the newest N checkpoints and remove older complete ones from DEST.")
@click.option("--settle", default="10s", show_default=True, metavar="DURATION",
              help="A checkpoint is pushed once no file in it changed for this long (waits if needed).")
@click.option("--dry-run", is_flag=True, help="Show what would be sent; send nothing.")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True, help="Parallel uploads.")
@click.option("--part-size", metavar="SIZE",
              help="S3 multipart part size (default 50MiB): 64MB = 64M = 64*10**6 bytes, 8MiB = 8*2**20.")
@click.option("--retries", type=click.IntRange(min=0), default=5, show_default=True,
              help="Retries per file and request, with growing pauses, before a checkpoint fails.")
@click.option("--allow-empty", is_flag=True,
              help="Exit 0 when nothing was pushed (no checkpoint found, none complete); by default that is an error "
                   "(--every always goes on waiting).")
@storage_option
@follow_links_option
@global_options()
def push(src, dest, every, once, keep_last, settle, dry_run, workers, part_size, retries, allow_empty,
         storage_options, as_json, quiet):
    """Copy complete checkpoints from SRC to DEST (a folder, s3://..., hf://...).

    Only whole checkpoints are pushed (all rank files with intact zips, trainer_state.json, a DCP
    folder's .metadata, a Megatron-LM iteration its tracker file names, no file changed for --settle). Files go in parallel; DEST/<checkpoint>/zckpt-manifest.json is written last,
    so a checkpoint without it is not complete. Files already at DEST with the same size and sha256 are
    not sent again: an interrupted push resumes where it stopped.
    """
    if every and once:
        raise InvalidArgument("--every and --once exclude each other", hint="give one of them")
    _check_src(src)
    interval = parse_duration(every, "--every", positive=True) if every else None
    kwargs = {"settle": parse_duration(settle, "--settle"), "keep_last": keep_last, "workers": workers,
              "dry_run": dry_run, "retries": retries, "part_size": parse_size(part_size) if part_size else None,
              "storage_options": storage_options}
    progress = kwargs["progress"] = _Progress(quiet, as_json)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # kill = Ctrl-C: abandon cleanly
    try:
        if every:
            _run_every(src, dest, interval, kwargs, as_json, quiet)
        else:
            _run_once(src, dest, {**kwargs, "allow_empty": allow_empty}, as_json, quiet)
    except KeyboardInterrupt as exc:
        progress.close()
        if as_json:  # errors too are one object on stdout
            emit_json(describe_here(exc).to_json("push"), command="push")
        if progress.sending:  # between --every runs nothing is unfinished
            names = ", ".join(_label(n) for n in progress.sending)
            click.echo(f"zckpt: interrupted; {names} not finished (no manifest at DEST); run again to resume", err=True)
        else:
            click.echo("zckpt: interrupted", err=True)
        raise SystemExit(130) from None
    finally:
        progress.close()
        signal.signal(signal.SIGTERM, previous)


def _run_once(src, dest, kwargs, as_json, quiet) -> None:
    from zckpt.backup.push import push

    try:
        result = push(src, dest, **kwargs)
    except Exception as exc:
        partial = getattr(exc, "push_result", None)
        if partial is not None and not as_json and partial.checkpoints:  # --json: the error object carries it
            _render(partial, as_json, quiet)
            _report_other_failures(partial, exc)
        raise
    if not kwargs.get("dry_run"):
        published(dest)
    _render(result, as_json, quiet)


def _report_other_failures(partial, raised) -> None:
    """push() raises its first failure (printed by the error reporter); say each other distinct one once here
    (the same unknown scheme or read-only DEST fails every checkpoint alike: said once)."""
    said = {describe_here(raised).message}
    for c in partial.checkpoints:
        if c.status == "failed" and c.error is not None and c.error not in (raised, raised.__cause__):
            message = describe_here(c.error).message
            if message not in said:
                said.add(message)
                click.echo(f"zckpt: error: {message}", err=True)


def _run_every(src, dest, interval, kwargs, as_json, quiet) -> None:
    def on_error(exc):
        err = describe_here(exc)
        if as_json:
            doc = err.to_json("push")
            if getattr(exc, "push_result", None) is not None:
                doc["result"] = {"ok": False, "command": "push", **result_json(exc.push_result)}
            emit_json(doc, command="push")
        click.echo(f"zckpt: error: {err.message} (trying again next run)", err=True)

    from zckpt.backup.schedule import push_every

    push_every(src, dest, interval, on_result=lambda r: _render(r, as_json, quiet), on_error=on_error, **kwargs)
    click.echo("zckpt: stopped", err=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
