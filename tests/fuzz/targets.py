"""Fuzz targets shared by the hypothesis tests and the atheris fuzzer (tests/fuzz/fuzz_atheris.py).

Each target takes bytes, builds a damaged input from a real fixture, and runs zckpt on it. The only allowed
outcomes are success or a :class:`zckpt.errors.ZckptError` (or ``OSError`` from the file system); anything else
(IndexError, KeyError, TypeError, a hang, code executed) is a bug.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

from zckpt.errors import ZckptError

ROOT = Path(__file__).resolve().parents[2]
SEED_FIXTURES = ["z2_bf16_ws2", "z3_bf16_ws2", "bf16opt_z1_ws2", "z1_fp32_ws3"]
MARKER = "/tmp/zckpt-fuzz-pwned"


def fixture_files(name: str) -> tuple[Path, str, list[Path]]:
    save = ROOT / "fixtures" / name
    tag = (save / "latest").read_text().strip()
    return save, tag, sorted((save / tag).glob("*.pt"))


def copy_fixture(name: str, dst: Path) -> Path:
    save, _, _ = fixture_files(name)
    shutil.copytree(save, dst, ignore=shutil.ignore_patterns("expected", "*.py"))
    return dst


def run_all(path: str) -> None:
    """Every read path a user has: open, info, verify --deep, merge (dry run and real)."""
    import zckpt
    from zckpt.ops.info import info
    out = tempfile.mkdtemp(prefix="zckpt-fuzz-out-")
    try:
        info(path)
        zckpt.verify(path, deep=True)
        zckpt.merge(path, os.path.join(out, "m"), max_shard_size="1KB")
        zckpt.load_state_dict(path, dtype="bf16")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def mutate_file(data: bytes, ops: bytes) -> bytes:
    """Apply a mutation program: every 5 bytes = (kind, position u32)."""
    buf = bytearray(data)
    for i in range(0, len(ops) - 4, 5):
        kind = ops[i] % 6
        pos = struct.unpack("<I", ops[i + 1:i + 5])[0] % max(len(buf), 1)
        if kind == 0:
            buf[pos] ^= 1 << (ops[i] % 8)  # bit flip
        elif kind == 1:
            del buf[pos:]  # truncate
        elif kind == 2:
            buf[pos:pos + 4] = b"\xff\xff\xff\x7f"  # huge little-endian int (sizes, offsets)
        elif kind == 3:
            buf[pos:pos + 1] = b"\x00"
        elif kind == 4:
            buf[pos:pos] = ops[i:i + 5]  # insertion shifts everything after
        else:
            buf[pos:pos + 2] = b"c\n"  # pickle GLOBAL opcode with a newline: forged global names
        if not buf:
            break
    return bytes(buf)


def mutate_pickle_in_zip(data: bytes, ops: bytes) -> bytes:
    """Damage only data.pkl and rebuild a valid zip (right CRCs) around it: reaches the unpickler."""
    import io
    import zipfile
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        blobs = {i.filename: zf.read(i) for i in zf.infolist()}
    name = next(n for n in blobs if n.endswith("data.pkl"))
    blobs[name] = mutate_file(blobs[name], ops)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for n, b in blobs.items():
            zf.writestr(n, b)
    return out.getvalue()


def check(path: str) -> str:
    """Run every read path; return 'ok' or 'refused'. Raises for any other exception."""
    try:
        run_all(path)
        return "ok"
    except ZckptError:
        return "refused"
    except OSError:
        return "refused"
    finally:
        assert not os.path.exists(MARKER), "code from a checkpoint was executed"
