"""What the command line says: hints name flags (--tag, never tag=...), verify --json's failure also as the one line
on stderr, a missing backend named by the URL given (push: DEST), counts in the singular for one, -v speeds in
binary units, and every error raised with a next step."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, checkpoint_path

Z2 = FIXTURES / "z2_bf16_ws2"


def _zckpt(*args, pre: str = "", cwd=ROOT):
    code = f"import sys; {pre}\nsys.argv = ['zckpt', *sys.argv[1:]]\nfrom zckpt.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def _flip_a_tensor_byte(folder: Path) -> None:
    p = next(folder.glob("global_step*/*optim_states.pt"))
    z = zipfile.ZipFile(p)
    e = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    b = bytearray(p.read_bytes())
    n, x = struct.unpack("<HH", b[e.header_offset + 26:e.header_offset + 30])
    b[e.header_offset + 30 + n + x + 5] ^= 1
    p.write_bytes(bytes(b))


def test_verify_json_failure_also_says_the_one_line_with_flags(tmp_path):
    ck = shutil.copytree(Z2, tmp_path / "ck")
    _flip_a_tensor_byte(ck)
    res = _zckpt("verify", ck, "--deep", "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert bad and "--tag" in bad[0]["hint"] and "tag=" not in res.stdout, bad
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zckpt: error: {ck}: NOT consistent: {bad[0]['name']}"), lines
    assert "--tag" in lines[0] and "tag=" not in lines[0]
    ok = _zckpt("verify", checkpoint_path(Z2), "--json")
    assert ok.returncode == 0 and ok.stderr == "" and json.loads(ok.stdout)["ok"]


@pytest.mark.parametrize("cmd,url,blocked,extra", [
    ("info", "hf://me/run1", "huggingface_hub", "hub"),
    ("verify", "hf://me/run1/checkpoint-4", "huggingface_hub", "hub"),
    ("info", "s3://bucket/run1", "boto3", "s3"),
])
def test_missing_backend_names_the_url_given(cmd, url, blocked, extra):
    res = _zckpt(cmd, url, pre=f"sys.modules[{blocked!r}] = None; sys.modules['botocore'] = None")
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == f"zckpt: error: {url}: no backend for {url.split(':')[0]}:// is installed " \
                                 f"(pip install 'zckpt[{extra}]')", res.stderr


def test_push_missing_backend_names_dest(tmp_path):
    res = _zckpt("push", FIXTURES / "trainer", "hf://me/run1", "--settle", "0",
                 pre="sys.modules['huggingface_hub'] = None")
    assert res.returncode == 1
    assert res.stderr.strip() == "zckpt: error: hf://me/run1: no backend for hf:// is installed " \
                                 "(pip install 'zckpt[hub]')", res.stderr


_ONE_PLURAL = re.compile(r"(?<![\d.,])1 (ranks|files|tensors|keys|params|items|values|\.distcp files|groups)\b")


def test_one_is_singular(tmp_path):
    """A checkpoint of one rank and one data file: "1 rank", "1 .distcp file", never "1 ranks"."""
    src = checkpoint_path(FIXTURES / "z2_bf16_ws1")
    runs = [_zckpt("convert", src, "--to", "dcp", "-o", tmp_path / "d")]
    runs.append(_zckpt("-v", "verify", tmp_path / "d"))
    runs.append(_zckpt("info", tmp_path / "d"))
    runs.append(_zckpt("convert", tmp_path / "d", "--to", "deepspeed", "--world-size", "1", "--stage", "2",
                       "--dtype", "bf16", "--buffers", "", "-o", tmp_path / "ds"))
    for res in runs:
        assert res.returncode == 0, res.stderr
    text = "\n".join(r.stdout + r.stderr for r in runs)
    assert "DCP (1 rank) -> DeepSpeed ZeRO-2 x 1 rank" in text and "1 .distcp file," in text, text
    assert not _ONE_PLURAL.search(text), _ONE_PLURAL.search(text)


def test_verbose_speeds_in_binary_units(tmp_path):
    for cmd in (["merge", checkpoint_path(Z2), "-o", tmp_path / "m"],
                ["reshard", checkpoint_path(Z2), "--world-size", "1", "-o", tmp_path / "r"]):
        res = _zckpt("-v", *cmd)
        assert res.returncode == 0, res.stderr
        speed = re.search(r"; ([\d.]+ (B|KiB|MiB|GiB|TiB))/s, ", res.stderr)
        assert speed and " MB/s" not in res.stderr and " GB/s" not in res.stderr, res.stderr


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_error_says_what_to_do():
    """Whatever zckpt raises without a hint of its own, the one line ends with a next step (the table's)."""
    import errno

    import click

    from zckpt import errors
    from zckpt.cli._errors import describe

    raised = [cls("something is wrong", path="/x") for cls in {errors.ZckptError, *_subclasses(errors.ZckptError)}
              if cls.__module__.startswith("zckpt")]
    raised += [OSError(errno.EIO, "Input/output error", "/x"), OSError(errno.ENOSPC, "No space left", "/x"),
               ImportError("no module named s3fs", name="s3fs"), RuntimeError("boom"),
               click.UsageError("no such option: --x")]
    assert len(raised) > 15
    for exc in raised:
        err = describe(exc, command="merge")
        assert err.hint and err.message.endswith(")"), (type(exc).__name__, err.message)
