"""One table from exceptions to what the user reads: an exit status and one line that names the option or path
and says what to do next. Every failure goes through it (:func:`describe`), click's own usage errors included, so
the same mistake gives the same message and exit status in every command; with ``--json`` the same facts are
printed as one object (:meth:`UserError.to_json`). No torch here.

Exit status, by kind of mistake (the same in every command; docs/guide.md has this table too):

====  ===============================================================================================
0     success (also when Ctrl-C comes after the result was published: it is reported as published);
      push --every stopped by Ctrl-C between runs exits 0 ("zckpt: stopped"; during an upload: 130)
1     the command line was read, but zckpt refused it or the work failed: a value its option does not
      take (``--world-size 0``, ``--dtype fp8``, ``--max-shard-size banana``, ``--every soon``,
      ``--storage-option novalue``), options that do not go together, a missing, incomplete or damaged
      checkpoint (``verify``: a check failed), an output that cannot be written, a storage failure
2     the command line could not be read: an unknown command or option, a missing argument or option
      value, an extra argument (click's parse errors), said in one line with the usage; a value outside
      its option's range or choices; an option that does not apply to the command, target or format
      chosen, or contradicts the config it names; an output name the Trainer's rotation would delete
      (``OptionError``)
75    a network or server fault outlasted the retries (``NetworkError``): the server unreachable
      (connection refused, host name not resolved, no route, connect timeout), throttling, HTTP 5xx, a
      dropped or stalled connection; nothing is wrong with the command: run it again later
      (75 is ``EX_TEMPFAIL`` of sysexits.h, "temporary failure, retry later", for cron jobs and schedulers)
130   interrupted (Ctrl-C or SIGTERM) while a command works: one line, no traceback (``--json``: also the error
      object)
====  ===============================================================================================

Parameters are named as the user typed them: a library error's ``param`` (``max_shard_size``) and backquoted
names in its text become the command's flags (``--max-shard-size``) through the ``name`` lookup the CLI passes.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

import click

from zckpt.errors import (
    InvalidArgument, NetworkError, OptionError, OutputExists, StorageError, UnsupportedLayout, ZckptError,
    names_rendered,
)


class CommandLineError(InvalidArgument):
    """A command-line value not in the form its option takes (``--storage-option novalue``: no ``=``): a bad value
    like any other (exit 1, JSON type ``InvalidArgument``), said in one line naming the option, the same in every
    command that has it."""


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NETWORK = 75
EXIT_INTERRUPTED = 130

#: each status in a few words, as ``zckpt --help``, README.md and docs/guide.md say them (tests/test_newcomer.py
#: compares them with this table and the one above)
EXIT_STATUSES = ((EXIT_OK, "done"), (EXIT_ERROR, "refused or failed"), (EXIT_USAGE, "command line unreadable"),
                 (EXIT_NETWORK, "network or server fault after the retries"), (EXIT_INTERRUPTED, "interrupted"))
#: the one Ctrl-C that is not 130, said in each of them
STOPPED_BETWEEN_RUNS = "push --every stopped by Ctrl-C between runs exits 0"

INTERNAL_HINT = "internal error: rerun with --debug for a traceback and report it"
#: the next step of an error raised without one (every error says what to do; tests/test_messages.py)
STORAGE_HINT = "check the URL, the credentials and that the server is reachable"
NO_HINT = "rerun with --debug to see where it stopped, and report it"
LAYOUT_HINT = ("zckpt refuses what it cannot read exactly rather than guess; zckpt info shows what it reads, and "
               "--debug where it stopped (report the layout if a framework wrote it)")
INSTALL_HINT = "install the missing package; s3:// URLs: pip install 'zckpt[s3]', hf:// URLs: pip install 'zckpt[hub]'"
#: a missing package (ImportError.name, its top level) -> the install line of the extra that brings it
_EXTRAS = {"torch": "torch", "s3fs": "s3", "boto3": "s3", "botocore": "s3", "aiobotocore": "s3",
           "huggingface_hub": "hub"}


def install_hint(exc: BaseException) -> str:
    """The install line for the package whose import failed in ``exc`` (its chain is walked): the zckpt extra that
    brings it, else :data:`INSTALL_HINT`."""
    seen = 0
    while exc is not None and seen < 8:
        name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        extra = _EXTRAS.get((name or "").split(".")[0])
        if extra:
            return f"pip install 'zckpt[{extra}]'"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return INSTALL_HINT

#: exception type -> (exit code, next step when the exception carries none). First match (in order) wins.
#: Hints name parameters in backquotes (```out```): shown as the command's flag (``-o``; push: ``DEST``).
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (KeyboardInterrupt, EXIT_INTERRUPTED, ""),
    (click.BadParameter, EXIT_USAGE, "see --help"),  # outside its option's range / choices: a usage error
    (click.UsageError, EXIT_USAGE, "see --help"),  # the command line could not be read
    (OptionError, EXIT_USAGE, "see --help"),  # an option that does not apply, is missing or contradicts another: as click's
    (InvalidArgument, EXIT_ERROR, "see --help"),  # the message names the parameter and the accepted forms
    (OutputExists, EXIT_ERROR, "pass `overwrite` or choose another `out`"),
    (NetworkError, EXIT_NETWORK, ""),  # transient: the same command should succeed later (the hint says when)
    (StorageError, EXIT_ERROR, STORAGE_HINT),
    (UnsupportedLayout, EXIT_ERROR, LAYOUT_HINT),
    (ZckptError, EXIT_ERROR, ""),  # zckpt's own errors carry their hint (one without: NO_HINT)
    (PermissionError, EXIT_ERROR, "check the permissions of that path"),
    (FileNotFoundError, EXIT_ERROR, "check the path"),
    (FileExistsError, EXIT_ERROR, "choose another `out`"),
    (IsADirectoryError, EXIT_ERROR, "a file was expected there, not a folder"),
    (NotADirectoryError, EXIT_ERROR, "a folder was expected there, not a file"),
    (ImportError, EXIT_ERROR, INSTALL_HINT),
    (OSError, EXIT_ERROR, ""),  # next step by errno, below
    (Exception, EXIT_ERROR, INTERNAL_HINT),
]

_ERRNO_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose another `out`",
    errno.EDQUOT: "the disk quota is exceeded; free space or choose another `out`",
    errno.EROFS: "the file system is read-only; choose another `out`",
    errno.EFBIG: "a file is larger than this file system or the file-size limit (ulimit -f) allows; choose another "
                 "`out`",
    errno.EACCES: "check the permissions of that path",
    errno.EPERM: "check the permissions of that path",
    errno.ENOENT: "check the path",
}

# scratch names of a publish in progress: ".<name>.zckpt-tmp-<pid>-<random>" (and variants), and of one file being
# written into place (".<name>.<8 hex>.tmp", zckpt.io.storage); the user never typed them, so messages name the
# output the user asked for instead
_SCRATCH = re.compile(r"\.(?P<name>[^/\s]+?)\.(?:zckpt-(?:tmp|new|old|staging)[-.][^/\s:]*|[0-9a-f]{8}\.tmp(?![^/\s:]))")
#: errors of writing bytes, which name no file (a write into an open file): the output is what failed
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

#: parameters with the same name in every command, as the CLI spells them when the command has no such option
_NAMES = {"out": "-o", "fmt": "--to", "src": "SRC", "dest": "DEST", "path": "PATH"}


def default_name(param: str) -> str:
    """A library parameter as a flag, without a command to ask: ``max_shard_size`` -> ``--max-shard-size``."""
    if param.startswith("-") or param.isupper():  # already as typed (the CLI's own checks: "--gpus", "SRC")
        return param
    return _NAMES.get(param) or ("--" + param.replace("_", "-"))


def command_names(command: click.Command | None):
    """The ``name`` lookup for ``command``: each parameter as the user types it (``out`` -> ``-o``, ``fmt`` ->
    ``--to`` or ``--format``, ``dest`` -> ``DEST``); ``out`` of a command without ``-o`` (push) is its ``DEST``."""
    table: dict[str, str] = {}
    for p in getattr(command, "params", []):
        if isinstance(p, click.Argument):
            table[p.name] = p.human_readable_name
        elif p.opts:
            longs = [o for o in p.opts if o.startswith("--")]
            table[p.name] = "-o" if "-o" in p.opts else (longs[0] if longs else p.opts[0])
    if "out" not in table and "dest" in table:
        table["out"] = table["dest"]
    return lambda param: table.get(param) or default_name(param)


def _click_text(text: str) -> str:
    """click's sentence as a clause of zckpt's line: one line, no closing full stop."""
    text = _one_line(text)
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


@dataclass
class UserError:
    exit_code: int
    type: str
    message: str  # one line: "<path>: <what is wrong> (<what to do>)"
    path: str | None
    hint: str

    def to_json(self, command: str | None = None) -> dict:
        return {"ok": False, "command": command,
                "error": {"type": self.type, "message": self.message, "path": self.path, "hint": self.hint or None,
                          "exit_code": self.exit_code}}


def user_path(path: str | None) -> str | None:
    """A path as the user knows it: a publish's scratch folder is shown as the output it becomes."""
    if not path:
        return path
    return _SCRATCH.sub(lambda m: m.group("name"), str(path))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _same_path(a, b) -> bool:
    try:
        return bool(a and b) and os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))
    except (TypeError, ValueError):
        return False


def describe(exc: BaseException, output: str | None = None, name=None, command: str | None = None) -> UserError:
    """The exit code and one-line message for ``exc``, by :data:`ERROR_TABLE`. ``output``: the command's -o, so
    that a failure to create it says so; ``name``: parameter -> flag (:func:`command_names`); ``command``: the
    command's name, for "see zckpt CMD --help"."""
    name = name or default_name
    code, default_hint = next((c, h) for t, c, h in ERROR_TABLE if isinstance(exc, t))
    if isinstance(exc, click.MissingParameter):
        code, default_hint = EXIT_USAGE, "see --help"
    default_hint = names_rendered(default_hint, name)
    if default_hint == "see --help":
        default_hint = f"see zckpt {command} --help" if command else "see zckpt --help"
    if isinstance(exc, KeyboardInterrupt):
        return UserError(code, "KeyboardInterrupt", "interrupted", None, "")
    if isinstance(exc, click.UsageError):
        return _usage(exc, code, default_hint, name)
    if isinstance(exc, ZckptError):
        return _zckpt(exc, code, default_hint, name)
    if isinstance(exc, OSError):
        return _os_error(exc, code, default_hint, name, output)
    if isinstance(exc, ImportError):
        missing = getattr(exc, "name", None)
        hint = install_hint(exc)
        return UserError(code, type(exc).__name__, _finish(f"missing package {missing or ''}: {_one_line(exc)}",
                                                           hint), None, hint)
    text = _one_line(f"{type(exc).__name__}: {exc}")
    return UserError(code, type(exc).__name__, f"internal error: {text} (rerun with --debug for a traceback and "
                                               f"report it)", None, INTERNAL_HINT)


def _usage(exc: click.UsageError, code: int, hint: str, name) -> UserError:
    """click's errors in zckpt's one line: ``--world-size: 0 is not in the range x>=1 (see zckpt reshard --help)``."""
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter):
        param = exc.param
        label = name(param.name) if param is not None and param.name else (exc.param_hint or "")
        if isinstance(label, (list, tuple)):
            label = label[0]
        label = str(label).strip("'\"")
        message = f"{label}: {_click_text(exc.message)}" if label else _click_text(exc.message)
        return UserError(code, "InvalidArgument", _finish(message, hint), None, hint)
    message = _click_text(exc.format_message())
    if isinstance(exc, click.MissingParameter) and exc.param is not None and exc.param.name:
        what = "argument" if isinstance(exc.param, click.Argument) else "option"
        message = f"{name(exc.param.name)}: missing {what}"
    usage = exc.ctx.get_usage() if exc.ctx is not None else ""
    root = exc.ctx.find_root().info_name if exc.ctx is not None else None
    if usage and root and root != "zckpt":  # the program is zckpt, however it was started
        usage = usage.replace(f"Usage: {root}", "Usage: zckpt", 1)
    if usage:
        hint = f"{_one_line(usage).replace('Usage: ', 'usage: ', 1)}; {hint}"
    return UserError(code, "UsageError", _finish(message, hint), None, hint)


def _zckpt(exc: ZckptError, code: int, default_hint: str, name) -> UserError:
    path = user_path(exc.path)
    raw_hint = exc.hint
    if raw_hint and "earlier tag" in raw_hint:  # a checkpoint-N's earlier state is the checkpoint next to it
        from zckpt.backup.latest import with_earlier_checkpoint
        raw_hint = with_earlier_checkpoint(raw_hint, exc.path)
    own_hint = names_rendered(raw_hint, name) if raw_hint else ""
    table_type = next(t for t, _, _ in ERROR_TABLE if isinstance(exc, t))
    if (type(exc).default_hint and raw_hint == type(exc).default_hint and default_hint
            and getattr(table_type, "default_hint", None) == type(exc).default_hint):
        own_hint = default_hint  # the table's wording for the CLI (never a broader class's over a subclass's own)
    hint = own_hint or default_hint or NO_HINT
    # StorageError wraps a backend failure: a missing package or an unknown scheme is not a server problem
    cause = exc.__cause__
    if isinstance(exc, StorageError) and isinstance(cause, ImportError) and not exc.hint:
        hint = install_hint(cause)
    message = _one_line(names_rendered(exc.message, name))
    if exc.param:
        message = f"{name(exc.param)}: {message}"
    if not message.startswith(str(path)) and path:
        message = f"{path}: {message}"
    kind = "InvalidArgument" if isinstance(exc, CommandLineError) else type(exc).__name__
    return UserError(code, kind, _finish(user_path(message), hint), path, hint)


def _os_error(exc: OSError, code: int, default_hint: str, name, output) -> UserError:
    path = user_path(exc.filename) if getattr(exc, "filename", None) else None
    scratch = bool(exc.filename and _SCRATCH.search(str(exc.filename))) or _same_path(exc.filename, output)
    if path is None and output and exc.errno in _WRITE_ERRNOS:  # a write into the output: name it
        path, scratch = str(output), True
    what = _one_line(exc.strerror or str(exc))
    hint = default_hint or names_rendered(_ERRNO_HINTS.get(exc.errno or -1, "check that path and run again"), name)
    if scratch:  # failed creating the output: say so about the user's own -o
        what = f"cannot write the output here: {what}"
        if exc.errno == errno.EBUSY and exc.filename and os.path.ismount(os.fspath(exc.filename)):
            what, hint = _mount_point(os.fspath(exc.filename), name)
        elif exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
            hint = names_rendered("choose another `out`", name)
    message = f"{path}: {what}" if path else what
    if getattr(exc, "filename2", None):
        message += f" (-> {user_path(exc.filename2)})"
    return UserError(code, type(exc).__name__, _finish(message, hint), path, hint)


def _mount_point(path: str, name) -> tuple[str, str]:
    """EBUSY on a mount point: an output is renamed into place when complete, which no mount point can take."""
    flag = name("out")
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return ("cannot write the output here: a read-only file system is mounted here",
                f"choose another {flag} on a writable disk")
    inside = os.path.join(path, "model")
    return ("cannot write the output here: it is a mount point, and a finished output is renamed into place, "
            "which a mount point cannot be", f"choose a folder inside it, e.g. {flag} {inside}")


def _finish(message: str, hint: str) -> str:
    message = _one_line(message)
    if hint and f"({hint})" not in message:
        message += f" ({hint})"
    return message
