"""zckpt's exception hierarchy.

Every error zckpt raises on purpose is a :class:`ZckptError`. Subclasses also inherit the matching builtin
(a missing shard is a ``FileNotFoundError`` too) so callers can catch what they already know. Each carries the
path it is about, the parameter at fault (``param``: the Python keyword, e.g. ``max_shard_size``) and a hint for
what to do. Messages and hints name other parameters in backquotes (```tag```): ``str(err)``, what a Python
caller reads, shows the keyword (``tag``); the CLI's error table shows the command's flag (``--tag``), so a
library error never names a flag the caller did not type.
"""

from __future__ import annotations

import os
import re


class ZckptError(Exception):
    """Base class. ``path``: the file or folder concerned; ``hint``: what the user can do about it."""

    default_hint = ""

    def __init__(self, message: str, path: str | os.PathLike | None = None, hint: str | None = None,
                 param: str | None = None):
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint if hint is not None else self.default_hint
        self.param = param
        super().__init__(message)

    def render(self, name=None) -> str:
        """The one-line text, with each parameter shown as ``name(param)``; the CLI passes its flag lookup. By
        default the message names the Python keyword (``tag global_step9: no such tag folder``) and the hint says
        it as a Python caller passes it (``use an earlier tag with tag=...``, ``pass overwrite=True``:
        :func:`python_name`)."""
        message = names_rendered(self.message, name or (lambda param: param))
        if self.param:
            message = f"{name(self.param) if name else self.param}: {message}"
        name = name or python_name
        # a message that already opens with its path (a list of missing files, say) is not prefixed again
        text = f"{self.path}: {message}" if self.path and not message.startswith(self.path) else message
        if self.hint:
            text += f" ({names_rendered(self.hint, name)})"
        return text

    def __str__(self) -> str:
        return self.render()

    # builtin OSError subclasses take (errno, strerror); keep our own constructor everywhere
    def __reduce__(self):
        return (self.__class__, (self.message, self.path, self.hint, self.param))


#: ```tag``` names a parameter; ```tag`=global_step9`` a parameter with a value (CLI: ``--tag global_step9``;
#: Python: ``tag='global_step9'``)
_NAMED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`(?:=([^\s,;()]+))?")


def _with_value(named: str, value: str | None) -> str:
    if value is None:
        return named
    if named.endswith("=..."):  # a Python keyword
        literal = value if re.fullmatch(r"-?\d+(\.\d+)?|True|False|None", value) else repr(value)
        return named[:-3] + literal
    return f"{named} {value}"


#: keyword parameters that are switches: a Python caller passes ``overwrite=True``
_SWITCHES = {"overwrite", "strict", "exclude_frozen", "keep_tied", "dry_run", "durable", "allow_empty", "deep",
             "bf16_optimizer", "latest"}


def python_name(param: str) -> str:
    """A parameter as a Python caller writes it in a hint: ``tag=...``, ``overwrite=True``. (Bare, ``tag`` would
    read as a word of the sentence: "use an earlier tag with tag".)"""
    if param.startswith("-") or param.isupper():  # already a flag or a placeholder
        return param
    return f"{param}=True" if param in _SWITCHES else f"{param}=..."


def names_rendered(text: str, name=lambda param: param) -> str:
    """``text`` with each backquoted parameter (```tag```) replaced by ``name(param)``, and a parameter with a
    value (```tag`=global_step9``) by that and the value, as ``name`` writes it (a flag and its value, or a
    keyword argument)."""
    return _NAMED.sub(lambda m: _with_value(name(m.group(1)), m.group(2)), text) if "`" in text else text


class CheckpointNotFound(ZckptError, FileNotFoundError):
    """A path, tag or rank file that should exist does not."""

    default_hint = "check the path and `tag`"


class IncompleteCheckpoint(ZckptError, FileNotFoundError):
    """Rank files are missing or disagree: a save was interrupted or overwritten."""

    default_hint = "the save may have been interrupted; use an earlier tag with `tag`"


class CorruptFile(ZckptError, ValueError):
    """A file is truncated, damaged, or not what its name says."""

    default_hint = "the file is damaged or truncated; re-copy it or use an earlier tag"


class UnsafePickle(ZckptError, ValueError):
    """A pickle names a global outside the allow-list: zckpt refuses it without running anything."""

    default_hint = "zckpt never runs code from checkpoints; this file is not a plain DeepSpeed checkpoint"


class UnsupportedLayout(ZckptError, NotImplementedError):
    """A real checkpoint layout zckpt does not handle (yet): pipeline, tensor parallel, MoE ..."""


class InvalidArgument(ZckptError, ValueError):
    """A bad parameter value (``param`` names it) or combination of parameters."""


class OptionError(InvalidArgument):
    """A usage mistake the command line shows by itself (exit 2, as click's own): an option that does not apply to
    the target, command or format chosen, or contradicts another option or the config file it names; a missing
    option; an output name that the Trainer's checkpoint rotation would delete."""


class LinkOutside(InvalidArgument):
    """A symbolic link in a checkpoint folder leads outside it (:mod:`zckpt.io.links`): not read, never uploaded,
    unless links are allowed (``ZCKPT_FOLLOW_LINKS=1``, the CLI's ``--follow-links``)."""

    default_hint = ("copy the file into the checkpoint folder (cp --dereference), or allow links out of it: "
                    "--follow-links (ZCKPT_FOLLOW_LINKS=1)")


class OutputExists(ZckptError, FileExistsError):
    """The output location holds something zckpt will not overwrite."""

    default_hint = "pass `overwrite` or choose another `out`"


class StorageError(ZckptError, OSError):
    """A storage backend (local disk, S3, the Hub) failed."""


class NetworkError(StorageError):
    """A network or server fault that outlasted the retries: throttling, HTTP 5xx, a dropped or stalled
    connection, or the server not reachable at all (:class:`EndpointUnreachable`). Transient by nature: the same
    command should succeed later. The CLI exits with its own status for it (75, ``EX_TEMPFAIL``)."""

    default_hint = "run again later"


class EndpointUnreachable(NetworkError):
    """The server cannot be reached at all: connection refused, host name not resolved, no route to the host, or
    the connection not accepted within the connect timeout. ``zckpt push`` stops at the first one that outlasts
    its retries (nothing more can get there)."""

    default_hint = "check the endpoint and the network; run again when it answers"


class MissingDependency(ZckptError, ImportError):
    """An optional package this call needs is not installed: torch for the functions that return tensors
    (``iter_tensors``, ``load_state_dict``, ``load_into_module``) and for runs under a distributed launcher
    (torch.distributed). The hint is the install line (:data:`TORCH_INSTALL`)."""


#: how to get torch for zckpt; the second half for machines whose default index serves CUDA builds
TORCH_INSTALL = ("pip install 'zckpt[torch]'; a CPU-only torch: pip install torch "
                 "--index-url https://download.pytorch.org/whl/cpu")


def require_torch(needed_for: str, module: str = "torch", also: str = ""):
    """``import module`` (torch or one of its submodules), or :class:`MissingDependency` saying that
    ``needed_for`` needs torch and how to install it (``also``: another way out, after the install line).
    zckpt's core (every command on one process) needs no torch."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if not (getattr(exc, "name", None) or "torch").split(".")[0] == "torch":
            raise  # torch is there but something it needs is not: that message says what
        raise MissingDependency(f"{needed_for} needs torch, which is not installed", hint=TORCH_INSTALL + (f"; {also}" if also else "")) from exc


class PushInterrupted(ZckptError, InterruptedError):
    """A push was stopped (Ctrl-C, ``Pusher.stop(abandon=True)``); what finished stays, no manifest was written."""

    default_hint = "run the push again to resume; finished files are not resent"
