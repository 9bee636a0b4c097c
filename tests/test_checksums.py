"""One flipped byte in the tensor data of a real checkpoint never becomes an output, exit 0.

torch.save records each storage's CRC-32 in the zip directory and ``torch.load`` never checks it. zckpt checks it
on every read (:mod:`zckpt.engine.checked`): each case flips one bit in the middle of one tensor's bytes (a fp32
master, an Adam moment, a module weight, a DCP item) of a copy of a committed fixture and runs every command that
reads those bytes. Each must refuse in one line naming the file and the entry, exit 1, and leave no output (and no
scratch folder) behind. A command that does not read the damaged bytes (merge does not read the moments) gives the
same output as on the undamaged copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent

# (fixture, what is damaged): ZeRO-2 bf16 (Trainer), ZeRO-3 bf16, ZeRO-1 fp32 at 3 ranks, ZeRO-2 fp16
CASES = [(f, w) for f in ("trainer", "z3_bf16_ws2", "z1_fp32_ws3", "z2_fp16_ws2")
         for w in ("master", "exp_avg", "module")]


def zckpt(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def target_piece(ckpt_path: Path, what: str):
    """A piece of tensor bytes of the kind ``what``, from zckpt's own reading of the checkpoint."""
    import zckpt
    ckpt = zckpt.open_checkpoint(str(ckpt_path))
    if what == "module":  # a module tensor that is not a master: a buffer or a frozen weight, else a bf16 weight
        recs = [r for r in ckpt.records if r.kind in ("buffer", "frozen") and r.value]
        if recs:
            return recs[0].value[0], recs[0].name
        pytest.skip("no module-only tensor in this fixture")
    rec = next(r for r in ckpt.records if r.kind == "trainable" and getattr(r, what if what != "master" else "value"))
    return (rec.value if what == "master" else getattr(rec, what))[0], rec.name


def damaged_copy(tmp_path: Path, fixture: str, what: str):
    src = checkpoint_path(FIXTURES / fixture)
    dst = tmp_path / "in" / src.relative_to(FIXTURES)
    shutil.copytree(FIXTURES / fixture, tmp_path / "in" / fixture, symlinks=True)
    piece, name = target_piece(dst, what)
    flip(piece.path, piece.offset + piece.nbytes // 2)
    return dst, piece, name


def assert_refused(res, piece, out: Path):
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert os.path.basename(piece.path) in lines[0] and "CRC-32" in lines[0] and "zip entry data/" in lines[0], \
        lines[0]
    assert "Traceback" not in res.stderr
    assert not out.exists()
    leftovers = [p for p in out.parent.iterdir() if p.name.startswith(".") and out.name in p.name]
    assert not leftovers, leftovers


COMMANDS = {
    "merge": lambda ck, out: ("merge", ck, "-o", out),
    "merge-bf16": lambda ck, out: ("merge", ck, "-o", out, "--dtype", "bf16"),
    "reshard": lambda ck, out: ("reshard", ck, "--world-size", 1, "-o", out),
    "convert": lambda ck, out: ("convert", ck, "--to", "dcp", "-o", out),
}
READS = {"merge": {"master", "module"}, "merge-bf16": {"master", "module"},
         "reshard": {"master", "exp_avg", "module"}, "convert": {"master", "exp_avg", "module"}}


@pytest.mark.parametrize("fixture,what", CASES, ids=[f"{f}-{w}" for f, w in CASES])
def test_flipped_byte_is_refused_by_every_command_that_reads_it(tmp_path, fixture, what):
    ck, piece, name = damaged_copy(tmp_path, fixture, what)
    clean = checkpoint_path(FIXTURES / fixture)
    for cmd, argv in COMMANDS.items():
        out = tmp_path / f"out-{cmd}"
        res = zckpt(*argv(ck, out), cwd=tmp_path)
        if what in READS[cmd]:
            assert_refused(res, piece, out)
        else:  # the bytes are not read: the output is the undamaged checkpoint's, byte for byte
            assert res.returncode == 0, res.stderr
            ref = tmp_path / f"ref-{cmd}"
            assert zckpt(*argv(clean, ref), cwd=tmp_path).returncode == 0
            for f in sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file() and p.name != ".zckpt.json"):
                assert (out / f).read_bytes() == (ref / f).read_bytes(), f


@pytest.mark.parametrize("what", ["master", "module"])
def test_iter_tensors_stops_before_the_damaged_tensor(tmp_path, what):
    import zckpt
    from zckpt.errors import CorruptFile
    ck, piece, name = damaged_copy(tmp_path, "trainer", what)
    seen = []
    with pytest.raises(CorruptFile) as info:
        for n, _ in zckpt.iter_tensors(str(ck)):
            seen.append(n)
    assert name not in seen
    assert os.path.basename(piece.path) in str(info.value)
    with pytest.raises(CorruptFile):
        zckpt.load_state_dict(str(ck))


def test_dcp_item_flipped_is_refused(tmp_path):
    src = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    dcp = tmp_path / "dcp"
    res = zckpt("convert", src, "--to", "dcp", "--layout", "dcp", "-o", dcp, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    import zckpt as z
    ckpt = z.open_checkpoint(str(dcp))
    for what in ("value", "exp_avg"):
        bad = tmp_path / f"dcp-{what}"
        shutil.copytree(dcp, bad)
        rec = next(r for r in ckpt.records if r.kind == "trainable")
        piece = getattr(rec, what)[0]
        flip(str(bad / os.path.relpath(piece.path, dcp)), piece.offset + piece.nbytes // 2)
        for cmd in (("merge", bad, "-o", tmp_path / f"m-{what}"),
                    ("convert", bad, "--to", "deepspeed", "--world-size", 2, "--stage", 2, "--dtype", "bf16",
                     "--buffers", "", "-o", tmp_path / f"m-{what}")):
            res = zckpt(*cmd, cwd=tmp_path)
            if what == "exp_avg" and cmd[0] == "merge":
                assert res.returncode == 0, res.stderr  # merge does not read the moments
                shutil.rmtree(tmp_path / f"m-{what}")
                continue
            assert_refused(res, piece, tmp_path / f"m-{what}")


def test_push_refuses_a_damaged_checkpoint_and_sends_nothing_of_it(tmp_path):
    ck, piece, _ = damaged_copy(tmp_path, "trainer", "exp_avg")  # push reads every byte, moments too
    dest = tmp_path / "dest"
    env_cache = tmp_path / "cache"
    res = subprocess.run([sys.executable, "-m", "zckpt", "push", str(ck.parent), str(dest), "--settle", "0"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), ZCKPT_CACHE_DIR=str(env_cache)))
    assert res.returncode == 1, res.stderr
    assert os.path.basename(piece.path) in res.stderr and "CRC-32" in res.stderr
    sent = [p for p in dest.rglob("*") if p.is_file()] if dest.exists() else []
    assert not [p for p in sent if "manifest" in p.name], sent
    assert not [p for p in sent if p.name.endswith(".pt")], sent  # checked before anything was sent


def test_push_checks_the_items_of_a_distcp_file(tmp_path):
    """A Trainer FSDP2 checkpoint (DCP folders inside checkpoint-N): a flipped byte in an item of a .distcp file is
    found by push's hashing through the .metadata beside it, and nothing of the checkpoint is sent."""
    out = tmp_path / "run" / "checkpoint-4"
    res = zckpt("convert", checkpoint_path(FIXTURES / "trainer"), "--to", "dcp", "-o", out, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (out / ".zckpt.json").unlink()  # as a training job would have written it
    import zckpt as z
    rec = next(r for r in z.open_checkpoint(str(out)).records if r.kind == "trainable")
    piece = rec.exp_avg[0]
    flip(piece.path, piece.offset + piece.nbytes // 2)
    dest = tmp_path / "dest"
    res = subprocess.run([sys.executable, "-m", "zckpt", "push", str(out.parent), str(dest), "--settle", "0"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), ZCKPT_CACHE_DIR=str(tmp_path / "cache")))
    assert res.returncode == 1, res.stderr
    assert "__0_0.distcp" in res.stderr and "CRC-32" in res.stderr
    assert not (dest.exists() and [p for p in dest.rglob("*") if p.is_file()])
