#!/usr/bin/env python
"""Coverage-guided fuzzing of the safe loader and the layout readers with atheris.

    python tests/fuzz/fuzz_atheris.py -atheris_runs=20000 [CORPUS_DIR]   # prints a summary line at the end

Input bytes are split into (which fixture file to damage, mutation program); the damaged file is placed in a
copy of a real fixture and every read path runs (tests/fuzz/targets.py). A crash is any exception other than
ZckptError/OSError, or code executed from a pickle. Seeds: the fixtures' own files.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["zckpt"]):
    import zckpt  # noqa: F401
    from zckpt import merge, verify  # noqa: F401
    from zckpt.encoding import safeload
    from zckpt.deepspeed import reader, zero3, zero12  # noqa: F401

from tests.fuzz.targets import (
    SEED_FIXTURES, check, copy_fixture, fixture_files, mutate_file, mutate_pickle_in_zip,
)

WORK = Path(tempfile.mkdtemp(prefix="zckpt-atheris-"))
BASES = {}
stats = {"runs": 0, "ok": 0, "refused": 0, "crashes": 0}


def base(fixture: str) -> Path:
    if fixture not in BASES:
        BASES[fixture] = copy_fixture(fixture, WORK / f"base-{fixture}")
    return BASES[fixture]


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    fixture = SEED_FIXTURES[data[0] % len(SEED_FIXTURES)]
    _, tag, files = fixture_files(fixture)
    victim = files[(data[1] & 0x7F) % len(files)].name
    src = base(fixture)
    ck = WORK / "case"
    if ck.exists():
        shutil.rmtree(ck)
    shutil.copytree(src, ck)
    target = ck / tag / victim
    mutate = mutate_pickle_in_zip if data[1] & 0x80 else mutate_file  # the raw file, or the pickle in a valid zip
    target.write_bytes(mutate(target.read_bytes(), data[2:]))
    stats["runs"] += 1
    try:
        stats[check(str(ck))] += 1
    except BaseException:
        stats["crashes"] += 1
        raise


@atexit.register
def summary():
    print(f"zckpt atheris: {stats['runs']} cases, {stats['ok']} read fine, {stats['refused']} refused cleanly, "
          f"{stats['crashes']} crashes", flush=True)
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    if not any(a.startswith("-max_len") for a in sys.argv):
        sys.argv.append("-max_len=64")
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
