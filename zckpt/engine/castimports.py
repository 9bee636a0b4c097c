"""The casts' imports beside the copies (ZCKPT_IMPORT_AHEAD=1, off by default): numpy, and ml_dtypes where it pays,
imported on a side thread while :mod:`zckpt.engine.lanes` writes the files that need no cast and holds back those
that do (:func:`zckpt.engine.lanes._deal`)."""

from __future__ import annotations

import os
import sys
import threading

from zckpt.engine.executor import env_int

# ZCKPT_IMPORT_AHEAD=1: the casts' imports (numpy, and ml_dtypes where it pays: 0.1-0.2 s on the lent 16-core host
# before a job of convert --to deepspeed can start) run on a side thread while the files that need no cast are
# written (zckpt.engine.lanes), with the interpreter's switch interval lowered to IMPORT_SWITCH_US meanwhile (the
# import holds the GIL between its file reads; a copying thread back from a read or a write waits for it at most
# that long, where the default 5 ms is longer than a 4 MiB job). Off by default: on the lent host, convert --to
# deepspeed ran 0.95-1.59 s with it (median 1.36) against 1.11-1.33 s without (median 1.21), five runs each
# alternated (docs/benchmarks.md, issue 49, fourth session): its best run the best yet, its median worse.
IMPORT_SWITCH_US = env_int("ZCKPT_IMPORT_SWITCH_US", 500)
IMPORT_AHEAD = os.environ.get("ZCKPT_IMPORT_AHEAD", "0") == "1"


class CastImports:
    """:func:`zckpt.encoding.casting.prepare` of ``pairs`` on a side thread; ``ready()``, and ``wait()`` (raises
    what the import raised)."""

    def __init__(self, pairs: set, bf16: int):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(pairs, bf16), name="zckpt-imports", daemon=True)
        self._thread.start()

    def _run(self, pairs: set, bf16: int) -> None:
        old = sys.getswitchinterval()
        try:
            sys.setswitchinterval(min(old, IMPORT_SWITCH_US / 1e6))
            from zckpt.encoding import casting
            casting.prepare(pairs, bf16)
        except BaseException as e:  # handed to the thread that waits
            self._error = e
        finally:
            sys.setswitchinterval(old)
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def ready(pairs: set) -> bool:
    """Whether the imports of casts ``pairs`` are done already (numpy, and for fp32 -> bf16 the choice made)."""
    if "numpy" not in sys.modules:
        return False
    from zckpt.encoding import casting
    return ("float32", "bfloat16") not in pairs or casting.decided()
