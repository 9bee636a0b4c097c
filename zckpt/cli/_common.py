"""Shared pieces of the thin CLI commands: the options every command takes, progress bars, JSON output.

Every command (and the ``zckpt`` group itself, so they work before or after the sub-command) takes
``--json``, ``-q/--quiet``, ``-v/--verbose`` and ``--debug``; their values live in one :class:`Settings` per run
(``ctx.meta``), which the error reporter reads too. No torch here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import click

_SETTINGS = "zckpt.settings"


@dataclass
class Settings:
    json: bool = False  # results (and errors) as one JSON object per line on stdout
    quiet: bool = False  # silent on success: no progress bars, per-file lines, notes or warnings
    debug: bool = False  # tracebacks instead of one-line errors
    verbose: int = 0  # -v: INFO log lines, -vv: DEBUG
    output: str | None = None  # the command's -o, named by errors about creating it

    @property
    def show_debug(self) -> bool:
        return self.debug or os.environ.get("ZCKPT_DEBUG", "") not in ("", "0")


def settings(ctx: click.Context | None = None) -> Settings:
    """This run's settings (defaults outside a command, e.g. when a library function calls a helper)."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return Settings()
    return ctx.meta.setdefault(_SETTINGS, Settings())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (click's test runner swaps it per run)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure_logging(s: Settings) -> None:
    """Log lines on stderr for this command: warnings, errors only with -q, INFO with -v, DEBUG with -vv."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("zckpt: %(levelname)s: %(message)s"))
        root.addHandler(handler)
    level = logging.ERROR if s.quiet and not s.verbose else max(logging.WARNING - 10 * s.verbose, logging.DEBUG)
    root.setLevel(level)
    logging.getLogger("zckpt").setLevel(level)
    for h in root.handlers:  # (the root's level does not apply to records of libraries' loggers: the handler's does)
        if isinstance(h, _StderrHandler):
            h.setLevel(level)
    _hub_logs_through_ours()


#: huggingface_hub's per-request retry notes (``utils/_http.py``): each retry of one request, as a warning
_HUB_RETRY_NOTES = (" thrown while requesting ", "Retrying in ", "Rate limited. Waiting ")
_HUB_LOGGER, _HUB_HTTP_LOGGER = "huggingface_hub", "huggingface_hub.utils._http"


class _HubRetryNotes(logging.Filter):
    """huggingface_hub's notes on its own retries of one request are detail, like botocore's silent ones: INFO
    lines (-v). What the user needs is zckpt's one line when zckpt gives up (or its own retry notice)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and any(n in record.getMessage() for n in _HUB_RETRY_NOTES):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger("zckpt").isEnabledFor(logging.INFO)
        return True


def _hub_logs_through_ours() -> None:
    """huggingface_hub adds its own stderr handler to its logger when imported, and its records also reach ours
    (the root's): each line was printed twice, once bare and once as ``zckpt: WARNING: ...``. While a command
    runs, its lines go through zckpt's handler only (so -q silences them too), its retry notes at INFO. Its
    logging module is tiny and needs nothing else of huggingface_hub; where it is not installed, nothing to do."""
    import importlib.util

    hub = logging.getLogger(_HUB_LOGGER)
    if getattr(hub, "_zckpt_saved", None) is None:
        try:
            if importlib.util.find_spec(_HUB_LOGGER) is None:
                return
            importlib.import_module("huggingface_hub.utils.logging")  # (adds its handler, once per process)
        except Exception:  # noqa: BLE001 - a broken install is reported where it is used, not here
            return
        own = [h for h in hub.handlers if type(h) is logging.StreamHandler]
        for h in own:
            hub.removeHandler(h)
        hub._zckpt_saved = own
    http = logging.getLogger(_HUB_HTTP_LOGGER)
    if not any(isinstance(f, _HubRetryNotes) for f in http.filters):
        http.addFilter(_HubRetryNotes())


def _hub_logs_restored() -> None:
    hub = logging.getLogger(_HUB_LOGGER)
    saved = getattr(hub, "_zckpt_saved", None)
    if saved is not None:
        for h in saved:
            hub.addHandler(h)
        hub._zckpt_saved = None
    http = logging.getLogger(_HUB_HTTP_LOGGER)
    for f in [f for f in http.filters if isinstance(f, _HubRetryNotes)]:
        http.removeFilter(f)


def logging_state():
    """What :func:`configure_logging` changes, to put back when the command ends (it may run inside a program)."""
    root = logging.getLogger()
    return root.level, logging.getLogger("zckpt").level, list(root.handlers)


def restore_logging(state) -> None:
    root = logging.getLogger()
    root_level, zckpt_level, handlers = state
    for h in list(root.handlers):
        if isinstance(h, _StderrHandler) and h not in handlers:
            root.removeHandler(h)
    root.setLevel(root_level)
    logging.getLogger("zckpt").setLevel(zckpt_level)
    _hub_logs_restored()


def _remember(field: str):
    def callback(ctx: click.Context, param: click.Parameter, value):
        s = settings(ctx)
        if field == "verbose":
            s.verbose += value or 0
            value = s.verbose
        else:
            value = bool(value) or getattr(s, field)  # given before the sub-command counts after it too
            setattr(s, field, value)
        configure_logging(s)
        return value
    return callback


#: the parameters that name local paths or URLs, in every command that has them
WORKERS_DEFAULT = "3/4 of the CPUs, 8 to 16, at most the CPUs"  # engine.works.write_workers, in --workers' help

PATH_PARAMS = ("path", "out", "src", "dest", "ds_config", "config_path")


def expand_home(value):
    """``~/ckpt`` is the home folder's ``ckpt`` also where the shell left the ``~`` alone (``--output=~/m``, a quoted
    path, a script's argument list): it was taken as a folder named ``~`` in the current one. URLs stay as they are."""
    if isinstance(value, str) and value.startswith("~") and "://" not in value:
        return os.path.expanduser(value)
    return value


def _home_expanded(f):
    """The command, with its paths refused when empty and ``~`` expanded (:func:`expand_home`)."""
    @functools.wraps(f)
    def command(*args, **kwargs):
        for name in PATH_PARAMS:
            if kwargs.get(name) == "":  # `-o "$OUT"` with OUT unset: it meant the current folder (push wrote there)
                from zckpt.errors import InvalidArgument
                raise InvalidArgument("an empty path", param=name,
                                      hint="a shell variable that is not set? give the path")
            if name in kwargs:
                kwargs[name] = expand_home(kwargs[name])
        from zckpt.cli import _applies
        _applies.check(click.get_current_context(silent=True))  # options that do not apply: one table
        return f(*args, **kwargs)
    return command


def global_options(expose: bool = True):
    """``--json``, ``-q``, ``-v``, ``--debug`` for the group (``expose=False``) and for every command (the command
    receives ``as_json`` and ``quiet``; its paths, ``~`` expanded: :func:`expand_home`)."""
    def decorate(f):
        if expose:
            f = _home_expanded(f)
        for decorator in reversed([
            click.option("--json", "as_json", is_flag=True, expose_value=expose, callback=_remember("json"),
                         help="Print the result as JSON on stdout, one object per line (errors too)."),
            click.option("-q", "--quiet", "quiet", is_flag=True, expose_value=expose, callback=_remember("quiet"),
                         help="Silent on success: no progress bars, per-file lines or notes; errors still print."),
            click.option("-v", "--verbose", "verbose", count=True, expose_value=False,
                         callback=_remember("verbose"), help="More log output on stderr (repeatable)."),
            click.option("--debug", "debug", is_flag=True, expose_value=False, callback=_remember("debug"),
                         help="Show full tracebacks on errors (or set ZCKPT_DEBUG=1)."),
        ]):
            f = decorator(f)
        return f
    return decorate


_tag = click.option("--tag", "-t", default=None, metavar="TAG",
                    help="Tag folder to read (default: the one named in 'latest').")
_latest = click.option("--latest", is_flag=True,
                       help="PATH is a training output folder (or DeepSpeed save folder): read its newest complete "
                            "checkpoint by step, never an incomplete one; one line says which.")


def tag_option(f):
    """``--tag`` and ``--latest`` of a command reading one checkpoint at ``path``. With ``--latest``, ``path`` is
    replaced by the newest complete checkpoint under it (:func:`zckpt.backup.latest.newest_complete`) before the
    command runs, and one line on stderr says which (not with -q, nor on ranks other than 0 of a launcher)."""
    @functools.wraps(f)
    def command(*args, latest=False, **kwargs):
        if latest:
            from zckpt.errors import InvalidArgument
            from zckpt.backup.latest import newest_complete
            if kwargs.get("tag") is not None:
                raise InvalidArgument("--latest and --tag do not go together (--latest picks a checkpoint, --tag a "
                                      "tag inside one)", hint="pass the checkpoint with --tag, or --latest alone")
            choice = newest_complete(expand_home(kwargs["path"]))
            kwargs["path"] = choice.path
            if not kwargs.get("quiet") and os.environ.get("RANK", "0") == "0":
                click.echo(f"zckpt: {choice.line()}", err=True)
        return f(*args, **kwargs)
    return _tag(_latest(command))


def _ties_callback(ctx, param, values):
    """``--tie NAME=PARAM`` / ``--no-tie NAME``: ties the files cannot tell, declared for this command (both
    callbacks run, in either order; each sets the combined declaration)."""
    from zckpt.cli._errors import CommandLineError
    from zckpt.deepspeed.model import set_declared_ties

    parts = ctx.meta.setdefault("zckpt_ties", {})
    if param.name == "ties":
        out = {}
        for v in values:
            name, sep, src = v.partition("=")
            if not sep or not name or not src:
                raise CommandLineError(f"--tie {v}: expected NAME=PARAM",
                                       hint="e.g. --tie lm_head.weight=embed.weight")
            out[name] = src
    else:
        out = {v: None for v in values}
    parts[param.name] = out
    both = {**parts.get("no_ties", {}), **parts.get("ties", {})}
    set_declared_ties(both or None)
    return None


def tie_options(f):
    """``--tie NAME=PARAM`` and ``--no-tie NAME``: what a checkpoint does not say about a parameter in no optimizer
    group holding the very bytes of another (``zckpt info`` names it)."""
    for decorator in reversed([
        click.option("--tie", "ties", multiple=True, metavar="NAME=PARAM", expose_value=False,
                     callback=_ties_callback,
                     help="NAME (in no optimizer group) is a second name of PARAM: read it as PARAM's value "
                          "(repeatable; only where zckpt info reports the two cannot be told apart)."),
        click.option("--no-tie", "no_ties", multiple=True, metavar="NAME", expose_value=False,
                     callback=_ties_callback,
                     help="NAME (in no optimizer group) is a parameter of its own: read its saved value "
                          "(repeatable)."),
    ]):
        f = decorator(f)
    return f


def output_options(kind: str, plan: str):
    """``--overwrite``, ``--fsync`` and ``--dry-run`` of a command that publishes an output folder (``kind``: the
    command's name in the marker, e.g. "merge"; ``plan``: what the dry run prints)."""
    def decorate(f):
        for decorator in reversed([
            click.option("--overwrite", is_flag=True,
                         help=f"Replace a previous zckpt {kind} output (recognised by its .zckpt.json), only once the "
                              "new one is complete. Any other non-empty folder is refused."),
            click.option("--fsync", "durable", is_flag=True,
                         help="fsync every file before publishing, so the output also survives a power failure."),
            click.option("--dry-run", is_flag=True, help=f"Print the plan ({plan}) and write nothing."),
        ]):
            f = decorator(f)
        return f
    return decorate


def _storage_callback(ctx, param, pairs) -> dict | None:
    """``--storage-option KEY=VALUE`` values as one dict, which the command passes to the library call (nothing is
    set process-wide); none given: ``{}`` (``--output-storage-option``: None, "as the source"). A malformed value
    is a usage error (exit 2), said the same way by every command."""
    from zckpt.cli._errors import CommandLineError
    from zckpt.errors import InvalidArgument
    from zckpt.io import storage

    if not pairs:
        return None if param.name == "output_storage_options" else {}
    try:
        return storage.parse_storage_options(pairs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise CommandLineError(f"{param.opts[0]}: {' '.join(str(exc).split())}",
                               hint="use KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:8333") from None


storage_option = click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
                              callback=_storage_callback,
                              help="fsspec option for URL paths (repeatable), e.g. endpoint_url=http://...")
def _follow_links_callback(ctx: click.Context, param: click.Parameter, value):
    if value:  # the process's setting (zckpt.io.links), inherited by the ranks a distributed command starts
        os.environ["ZCKPT_FOLLOW_LINKS"] = "1"
    return value


follow_links_option = click.option(
    "--follow-links", "follow_links", is_flag=True, expose_value=False, callback=_follow_links_callback,
    help="Follow symbolic links that lead out of the checkpoint folder (refused by default: push would upload "
         "their targets); or set ZCKPT_FOLLOW_LINKS=1.")
output_storage_option = click.option(
    "--output-storage-option", "output_storage_options", multiple=True, metavar="KEY=VALUE",
    callback=_storage_callback,
    help="fsspec option for a URL output that needs other options than the source (repeatable); "
         "default: the --storage-option values.")


def describe_here(exc: BaseException):
    """``exc`` as the error table says it for the running command (its flags, its -o): a
    :class:`zckpt.cli._errors.UserError`."""
    from zckpt.cli._errors import command_names, describe

    ctx = click.get_current_context(silent=True)
    command = ctx.command if ctx is not None else None
    return describe(exc, settings(ctx).output, command_names(command), ctx.info_name if ctx is not None else None)


def published(output) -> None:
    """The library call returned: its result is complete at ``output``. A Ctrl-C from now on is reported as
    coming after the result was published (exit 0), once the report is printed (``zckpt.cli._interrupts``)."""
    from zckpt.cli import _interrupts

    _interrupts.published(output)


#: dtypes as the flags spell them (``--dtype fp32``); others (int64, ...) as torch names them
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def flag_dtypes(value, key: str = ""):
    """``value`` with every dtype field (``dtype``, ``*_dtype``, their lists) spelled as the flags spell it."""
    if isinstance(value, dict):
        return {k: flag_dtypes(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [flag_dtypes(v, key) for v in value]
    if isinstance(value, str) and (key == "dtype" or key.endswith("_dtype")):
        return DTYPE_NAMES.get(value, value)
    return value


def emit_json(obj, command: str | None = None, **fields) -> None:
    """One JSON value on one line of stdout, in the shape docs/json.md writes down. Objects get the common
    fields: ``ok`` (true unless the result says otherwise) and ``command``, plus ``fields`` for keys the result
    lacks (``path``, ``tag``, ``output``); dtypes are spelled as the flags spell them (:func:`flag_dtypes`)."""
    if isinstance(obj, dict):
        obj = {"ok": obj.get("ok", True), "command": command or _command_name(), **obj}
        for key, value in fields.items():
            obj.setdefault(key, value)
        obj = flag_dtypes(obj)
    click.echo(json.dumps(obj, default=str))


def _command_name() -> str | None:
    ctx = click.get_current_context(silent=True)
    return ctx.info_name if ctx is not None and ctx.parent is not None else None


def bars_wanted() -> bool:
    """Progress bars only on a terminal: ``2>log`` gets no ``\\r`` frames. ``ZCKPT_DISABLE_PROGRESS_BARS=1``
    turns them off there too."""
    if os.environ.get("ZCKPT_DISABLE_PROGRESS_BARS", "") not in ("", "0"):
        return False
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def _delay() -> float:
    try:
        return max(0.0, float(os.environ.get("ZCKPT_PROGRESS_DELAY", "0.5")))
    except ValueError:
        return 0.5


#: a bar's text: sizes and speed as every summary prints them (``zckpt.units.format_size``: 254.7 MiB), not tqdm's
#: own SI letters (267M)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {done_size}/{total_size} [{elapsed}<{remaining}, {speed}]"


def byte_bar(total: int, desc: str, file):
    """A tqdm bar of ``total`` bytes on ``file`` whose sizes are zckpt's (:data:`BAR_FORMAT`)."""
    from tqdm import tqdm

    from zckpt.units import format_size

    class _Bar(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            elapsed = d.get("elapsed") or 0
            d.update(done_size=format_size(d["n"]), total_size=format_size(d["total"]),
                     speed=f"{format_size(d['n'] / elapsed)}/s" if elapsed > 0 else "? B/s")
            return d

    return _Bar(total=total, desc=desc, unit="B", bar_format=BAR_FORMAT, file=file, leave=False,
                dynamic_ncols=True, mininterval=0.2)


class Progress:
    """A tqdm bar of bytes on stderr, driven by a library ``progress(done, total)`` callback.

    Only on a terminal (:func:`bars_wanted`); sizes as the summaries print them (binary units, one decimal:
    ``zckpt.units.format_size``). The bar (and the tqdm import) only starts once the work has run for ``delay`` seconds
    (default 0.5, ``ZCKPT_PROGRESS_DELAY``) and has bytes left to do: short jobs and work already done print
    nothing."""

    def __init__(self, desc: str, enabled: bool = True, delay: float | None = None):
        self.desc, self.enabled, self.bar = desc, enabled and bars_wanted(), None
        self.start, self.delay = time.monotonic(), _delay() if delay is None else delay

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.monotonic() - self.start < self.delay or not total or done >= total:
                return
            self.bar = byte_bar(total, self.desc, sys.stderr)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
