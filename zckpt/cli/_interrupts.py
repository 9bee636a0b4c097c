"""Ctrl-C at any moment: one line on stderr, exit status 130, no traceback; after the result was published, it is
reported as published and the exit status is 0. SIGTERM (``kill``, a job scheduler, torchrun stopping the other
ranks) is answered the same way, so that the scratch folder of an interrupted merge is removed rather than left
for the next run to sweep.

The moments, and who answers:

- interpreter start-up, before any zckpt code runs: Python itself (nothing can be done there; a few tens of ms);
- imports (``zckpt.__main__.run`` before the CLI is loaded): a handler that prints the line and exits at once,
  since nothing has started that needs cleaning up;
- the command (:func:`begin`): SIGINT raises ``KeyboardInterrupt`` so that the library removes its scratch files;
  the group's ``main`` reports it (``_interrupted`` in ``cli/__init__.py``). One that lands in a finalizer or a
  weakref callback, where Python would print a traceback and drop it, is raised again (:func:`_redelivering`);
- the library published the result but had not returned yet: the output's commit marker, written by this run, says
  it is complete (:func:`published_output`);
- the result is published (:func:`published`, called by each command as soon as the library call returns): Ctrl-C
  no longer stops the report from printing; it is noted once at the end, exit 0;
- after the outcome is decided (:func:`end`): ignored, when zckpt runs as the ``zckpt`` program.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import sys
import threading

import click

#: True when zckpt runs as its own program (``zckpt.__main__.run``), not inside another (tests, notebooks)
ENTRY_POINT = False

_PUBLISHED = "zckpt.published"
_LATE = "zckpt.late-interrupt"
_MARKER = ".zckpt.json"  # zckpt.io.publish.MARKER (not imported: this runs while interrupted)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: the signals that interrupt a command: Ctrl-C and kill's default
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _redelivering(hook):
    """``sys.unraisablehook`` while a command runs. A ``KeyboardInterrupt`` raised by the handlers above inside a
    finalizer or a weakref callback (the import system's module locks, a file closed by the collector) is one
    Python prints as "Exception ignored ..." with a traceback, and then drops: it is raised again instead, in the
    main thread's next step (``_thread.interrupt_main``: SIGINT's handler, which SIGTERM's answer equals), so that
    it interrupts the command like any other. Anything else goes to ``hook``."""
    def redeliver(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            gate = threading.Lock()
            gate.acquire()

            def interrupt():  # from another thread, once this hook has let go: raised in it, it would be dropped
                with gate:
                    _thread.interrupt_main()
            try:
                threading.Thread(target=interrupt, name="zckpt-interrupt", daemon=True).start()
            except RuntimeError:  # (the interpreter is shutting down: nothing left to interrupt)
                pass
            gate.release()
            return
        hook(unraisable)
    redeliver.previous = hook
    return redeliver


def begin():
    """While the command runs, Ctrl-C or SIGTERM raises ``KeyboardInterrupt`` (cleanup runs), also where it lands
    in a finalizer (:func:`_redelivering`); returns the handlers to put back."""
    if not _main_thread():
        return None
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_interrupt)
    sys.unraisablehook = _redelivering(sys.unraisablehook)
    return previous


def published(output, ctx: click.Context | None = None) -> None:
    """The command's result is complete at ``output``: from now on a Ctrl-C waits for the report to print."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return
    ctx.meta[_PUBLISHED] = str(output) if output else "the output"
    if _main_thread():
        def later(signum, frame):
            ctx.meta[_LATE] = True
        for signum in SIGNALS:
            signal.signal(signum, later)


def published_output(ctx: click.Context | None) -> str | None:
    """What this run already published, or None: the command said so, or the ``-o`` folder holds a complete
    marker that this run wrote (the library was interrupted after its rename, before it returned)."""
    if ctx is None:
        return None
    if ctx.meta.get(_PUBLISHED):
        return ctx.meta[_PUBLISHED]
    settings = ctx.meta.get("zckpt.settings")
    out, started = getattr(settings, "output", None), ctx.meta.get("zckpt.started")
    if not out or started is None or "://" in str(out):
        return None
    marker = os.path.join(str(out), _MARKER)
    try:
        if os.stat(marker).st_mtime < started - 1:
            return None
        with open(marker, encoding="utf-8") as fh:
            return str(out) if json.load(fh).get("state") == "complete" else None
    except (OSError, ValueError, AttributeError):
        return None


def end(previous, ctx: click.Context | None, code: int) -> int:
    """The outcome is decided: note a Ctrl-C that came after publishing, stop listening; returns the status."""
    if ctx is not None and ctx.meta.get(_LATE) and code == 0:
        click.echo(f"zckpt: interrupted, but the result was already published: {ctx.meta.get(_PUBLISHED)} is "
                   "complete", err=True)
    if _main_thread() and previous is not None:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if ENTRY_POINT else (handler if handler is not None else
                                                                       signal.SIG_DFL))
        if hasattr(sys.unraisablehook, "previous"):
            sys.unraisablehook = sys.unraisablehook.previous
    if ENTRY_POINT and code == 130:
        # interrupted, cleanup done, the line said: leave now, so that nothing in the interpreter's shutdown (worker
        # threads still being joined) can turn the exit status into death by signal
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)
    return code
