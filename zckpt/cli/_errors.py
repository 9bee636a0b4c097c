"""One table from exceptions to what the user reads: an exit code and one line that names the path and says what
to do next. Every command goes through it (:func:`describe`), so the same bad input gives the same message and
exit code everywhere; with ``--json`` the same facts are printed as one object (:meth:`UserError.to_json`).

Exit codes: 0 success; 1 zckpt refused the input or the work failed (bad option values, missing or damaged
checkpoints, storage failures); 2 the command line itself is malformed (click: unknown option, missing argument,
a choice not offered, options that exclude each other; zckpt: a value not in the form its option takes, e.g.
``--storage-option`` without ``=``, :class:`CommandLineError`, said in one line); 130 interrupted. No torch here.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

import click

from zckpt.errors import InvalidArgument, OutputExists, StorageError, ZckptError


class CommandLineError(InvalidArgument):
    """A command-line value not in the form its option takes (``--storage-option novalue``: no ``=``).

    A usage error like click's (exit 2, JSON type ``UsageError``), but said in one line naming the option, the
    same in every command that has it."""


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

INTERNAL_HINT = "internal error: rerun with --debug for a traceback and report it"
INSTALL_HINT = "install the missing package (for s3:// URLs: pip install 'zckpt[s3]')"

#: exception type -> (exit code, next step when the exception carries none). First match (in order) wins.
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (KeyboardInterrupt, EXIT_INTERRUPTED, ""),
    (click.UsageError, EXIT_USAGE, "see --help"),
    (CommandLineError, EXIT_USAGE, "see --help"),
    (InvalidArgument, EXIT_ERROR, ""),  # the message names the flag and the accepted forms
    (OutputExists, EXIT_ERROR, "pass --overwrite or choose another -o"),
    (ZckptError, EXIT_ERROR, ""),  # zckpt's own errors carry their hint
    (PermissionError, EXIT_ERROR, "check the permissions of that path"),
    (FileNotFoundError, EXIT_ERROR, "check the path"),
    (FileExistsError, EXIT_ERROR, "choose another -o"),
    (IsADirectoryError, EXIT_ERROR, "a file was expected there, not a folder"),
    (NotADirectoryError, EXIT_ERROR, "a folder was expected there, not a file"),
    (ImportError, EXIT_ERROR, INSTALL_HINT),
    (OSError, EXIT_ERROR, ""),  # next step by errno, below
    (Exception, EXIT_ERROR, INTERNAL_HINT),
]

_ERRNO_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose another -o",
    errno.EDQUOT: "the disk quota is exceeded; free space or choose another -o",
    errno.EROFS: "the file system is read-only; choose another -o",
    errno.EACCES: "check the permissions of that path",
    errno.EPERM: "check the permissions of that path",
    errno.ENOENT: "check the path",
}

# scratch names of a publish in progress: ".<name>.zckpt-tmp-<pid>-<random>" (and variants); the user never
# typed them, so messages name the output the user asked for instead
_SCRATCH = re.compile(r"\.(?P<name>[^/\s]+?)\.zckpt-(?:tmp|new|old|staging)[-.][^/\s:]*")


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


def describe(exc: BaseException, output: str | None = None) -> UserError:
    """The exit code and one-line message for ``exc``, by :data:`ERROR_TABLE`. ``output``: the command's -o, so
    that a failure to create it says so."""
    code, default_hint = next((c, h) for t, c, h in ERROR_TABLE if isinstance(exc, t))
    if isinstance(exc, KeyboardInterrupt):
        return UserError(code, "KeyboardInterrupt", "interrupted", None, "")
    if isinstance(exc, click.UsageError):
        return UserError(code, "UsageError", _one_line(exc.format_message()), None, default_hint)
    if isinstance(exc, ZckptError):
        path = user_path(exc.path)
        hint = exc.hint or default_hint
        # StorageError wraps a backend failure: a missing package or an unknown scheme is not a server problem
        cause = exc.__cause__
        if isinstance(exc, StorageError) and isinstance(cause, ImportError) and not exc.hint:
            hint = INSTALL_HINT
        message = _one_line(exc.message)
        if not message.startswith(str(path)) and path:
            message = f"{path}: {message}"
        kind = "UsageError" if isinstance(exc, CommandLineError) else type(exc).__name__
        return UserError(code, kind, _finish(user_path(message), hint), path, hint)
    if isinstance(exc, OSError):
        path = user_path(exc.filename) if getattr(exc, "filename", None) else None
        scratch = bool(exc.filename and _SCRATCH.search(str(exc.filename))) or _same_path(exc.filename, output)
        what = _one_line(exc.strerror or str(exc))
        hint = default_hint or _ERRNO_HINTS.get(exc.errno or -1, "")
        if scratch:  # failed creating the output: say so about the user's own -o
            what = f"cannot write the output here: {what}"
            hint = hint if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else "choose another -o"
        message = f"{path}: {what}" if path else what
        if getattr(exc, "filename2", None):
            message += f" (-> {user_path(exc.filename2)})"
        return UserError(code, type(exc).__name__, _finish(message, hint), path, hint)
    if isinstance(exc, ImportError):
        name = getattr(exc, "name", None)
        return UserError(code, type(exc).__name__, _finish(f"missing package {name or ''}: {_one_line(exc)}",
                                                           default_hint), None, default_hint)
    text = _one_line(f"{type(exc).__name__}: {exc}")
    return UserError(code, type(exc).__name__, f"internal error: {text} (rerun with --debug for a traceback and "
                                               f"report it)", None, INTERNAL_HINT)


def _finish(message: str, hint: str) -> str:
    message = _one_line(message)
    if hint and f"({hint})" not in message:
        message += f" ({hint})"
    return message

