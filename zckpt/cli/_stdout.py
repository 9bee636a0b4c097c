"""stdout whose reader may go away: ``zckpt reshard ... | head -1`` must not turn a finished job into an error.

When the program reading zckpt's stdout exits early (``| head``, a closed pager), every later write to stdout fails
with EPIPE. That says nothing about the work: the output may already be published, a push may be halfway. So, when
zckpt runs as its own program, stdout is replaced by one that drops what it cannot deliver once the reader is gone,
and the command finishes with the exit status its work earned (verify's verdict, a failure's 1). Errors still go to
stderr, whose reader is the user.
"""

from __future__ import annotations

import io
import os
import sys


class _ReaderMayLeave(io.RawIOBase):
    """fd 1, where EPIPE means "nobody reads any more": the rest is dropped, not raised."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self.reader_gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data) -> int:
        n = len(data)
        if self.reader_gone:
            return n
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            self.reader_gone = True
            return n

    def close(self) -> None:  # never closes fd 1 itself (the interpreter's own stdout does not either)
        super().close()


def tolerate_closed_reader() -> None:
    """Replace ``sys.stdout`` (a real fd) by one that ignores a reader that went away; same encoding, buffering."""
    old = sys.stdout
    try:
        fd = old.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test runner's capture): leave it alone
        return
    try:
        old.flush()
    except (BrokenPipeError, ValueError):
        pass
    raw = _ReaderMayLeave(fd)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding=old.encoding, errors=old.errors,
                                  line_buffering=old.line_buffering,
                                  write_through=getattr(old, "write_through", False))  # python -u
