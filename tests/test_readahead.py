"""Read-ahead hints (zckpt.engine.readahead): each job's local input ranges, casts included, merged where they
touch, advised WILLNEED once as the job is queued; URLs, fills and literal bytes left out; a file that cannot be
opened skipped (the job's own read reports it); on unless ZCKPT_READ_HINTS=0; and the outputs of merge, reshard
and convert the same, byte for byte, with the hints as without."""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

import zckpt
from zckpt.engine import readahead
from zckpt.engine.segments import Cast, Fill, Piece

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_local_ranges_merge_touching_pieces_per_file_casts_included():
    parts = [Piece("/a", 0, 4, "float32"), Piece("/a", 16, 2, "float32"), Piece("/b", 100, 8, "bfloat16"),
             Fill(5, "float32"), b"hdr", Cast([Piece("/a", 24, 4, "float32"), Piece("/a", 64, 1, "float32")],
                                              "float32"),
             Piece("s3://bucket/x", 0, 10, "float32")]
    # /a's first piece [0, 16), its next [16, 24) and the cast's [24, 40) touch: one range; [64, 68) apart
    assert readahead.local_ranges(parts) == [("/a", 0, 40), ("/b", 100, 16), ("/a", 64, 4)]
    # a gap between two pieces of one file is not read: two ranges
    assert readahead.local_ranges([Piece("/a", 0, 1, "uint8"), Piece("/a", 2, 1, "uint8")]) == \
        [("/a", 0, 1), ("/a", 2, 1)]
    # overlapping and backwards pieces: a backwards one starts a range of its own
    assert readahead.local_ranges([Piece("/a", 10, 10, "uint8"), Piece("/a", 12, 3, "uint8"),
                                   Piece("/a", 0, 5, "uint8")]) == [("/a", 10, 10), ("/a", 0, 5)]
    assert readahead.local_ranges([Fill(3, "uint8"), b"x"]) == []


def test_hints_are_given_once_per_job_before_it_is_queued(monkeypatch):
    monkeypatch.setenv("ZCKPT_READ_HINTS", "1")
    calls = []
    monkeypatch.setattr(readahead, "_ADVISE", lambda fd, off, n, advice: calls.append((fd, off, n, advice)))
    fds = {"/a": 3, "/b": 4}

    def fd_of(path):
        if path not in fds:
            raise FileNotFoundError(path)
        return fds[path]

    items = [[Piece("/a", 0, 4, "uint8")], [Piece("/missing", 0, 4, "uint8"), Piece("/b", 8, 8, "uint8")],
             [Piece("/missing", 8, 4, "uint8")], [Fill(4, "uint8")]]
    seen = []
    for item in readahead.hinted(items, lambda it: it, fd_of):
        seen.append((item, len(calls)))
    # every item yielded as it was, in order; its hints given before it (the missing file skipped, tried once)
    assert [it for it, _ in seen] == items
    assert [n for _, n in seen] == [1, 2, 2, 2]
    assert calls == [(3, 0, 4, os.POSIX_FADV_WILLNEED), (4, 8, 8, os.POSIX_FADV_WILLNEED)]


@pytest.mark.parametrize("value", [None, "1", "0"])
def test_on_unless_turned_off(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("ZCKPT_READ_HINTS", raising=False)
    else:
        monkeypatch.setenv("ZCKPT_READ_HINTS", value)
    calls = []
    monkeypatch.setattr(readahead, "_ADVISE", lambda *a: calls.append(a))
    items = [[Piece("/a", 0, 4, "uint8")]]
    assert list(readahead.hinted(items, lambda it: it, lambda p: 3)) == items
    assert len(calls) == (0 if value == "0" else 1)


def _files(root: Path) -> dict[str, object]:
    """Every file's bytes; a torch zip's entries instead, less its ``serialization_id``, DCP's ``.metadata`` less
    its ``save_id`` (both random in each save, as torch's own), and the output marker less its ``created`` time."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if p.name == ".zckpt.json":
            out[p.name] = {k: v for k, v in json.loads(p.read_text()).items() if k != "created"}
        elif p.is_file() and zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                out[str(p.relative_to(root))] = {n: z.read(n) for n in z.namelist()
                                                 if not n.endswith("/serialization_id")}
        elif p.is_file():
            out[str(p.relative_to(root))] = re.sub(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                                                   b"save_id", p.read_bytes())
    return out


def test_outputs_are_the_same_with_hints(monkeypatch, tmp_path):
    """The real engine with hints on: the advice reaches the source files (counted), and merge (a cast), reshard
    and convert write the same bytes as with hints off."""
    ck = FIXTURES / "z2_bf16_ws2"
    real = readahead._ADVISE
    advised = []

    def counting(fd, off, n, advice):
        advised.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        return real(fd, off, n, advice)

    monkeypatch.setattr(readahead, "_ADVISE", counting)
    runs = {
        "merge": lambda out: zckpt.merge(ck, out, dtype="bf16", workers=3),
        "reshard": lambda out: zckpt.reshard(ck, out, world_size=1, workers=3),
        "convert": lambda out: zckpt.convert(ck, out, to="dcp", workers=3),
    }
    for name, run in runs.items():
        outs = {}
        for hints in ("0", "1"):
            monkeypatch.setenv("ZCKPT_READ_HINTS", hints)
            monkeypatch.setenv("ZCKPT_FORK_COPIES", "0")  # every job through this process's deal
            before = len(advised)
            run(tmp_path / name)  # one output path (DCP's .metadata names it)
            outs[hints] = _files(tmp_path / name)
            shutil.rmtree(tmp_path / name)
            assert (len(advised) > before) == (hints == "1"), (name, hints)
        assert outs["0"] == outs["1"] and outs["0"], name
    assert any("optim_states" in str(p) for p in advised)
