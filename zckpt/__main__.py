"""``python -m zckpt`` and the ``zckpt`` program (``[project.scripts]``): Ctrl-C is one line from the first moment.

Until the CLI is loaded (click and the commands take ~0.1 s to import) a Ctrl-C or SIGTERM just prints ``zckpt:
interrupted`` (with ``--json`` also the error object) and exits with status 130: nothing has started yet (the handler
that ``zckpt/__init__.py`` sets when it sees it runs as the program; this one otherwise). From then on ``zckpt.cli._interrupts`` takes over.
"""

import os
import signal


def _interrupted_while_starting(signum, frame):
    os.write(2, b"zckpt: interrupted\n")
    os._exit(130)


def run() -> None:
    # numpy's OpenBLAS starts a thread per CPU that spins waiting for matrix work zckpt never gives it (7-9% of
    # convert --to deepspeed's CPU on 2 cores, more threads on more); a setting of the user's own is kept
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for signum in (signal.SIGINT, signal.SIGTERM):  # kill = Ctrl-C
        if signal.getsignal(signum) in (signal.default_int_handler, signal.SIG_DFL):  # else zckpt's own (--json)
            signal.signal(signum, _interrupted_while_starting)
    from zckpt.cli import _interrupts, _stdout, main

    _interrupts.ENTRY_POINT = True
    _stdout.tolerate_closed_reader()  # `zckpt ... | head -1`: a reader that left is not the work's failure
    try:
        main(prog_name="zckpt")
    except KeyboardInterrupt:  # between the CLI's own handlers (they answer every other moment): still one line
        _interrupted_while_starting(signal.SIGINT, None)


if __name__ == "__main__":
    run()
