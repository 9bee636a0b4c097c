"""The command line: every command through click's runner, one-line errors, no torch at start-up, fresh docs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zckpt.cli import COMMANDS, main
from tests.conftest import FIXTURE_DIRS, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_is_fast_and_imports_no_torch():
    code = "import sys, zckpt.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "zckpt", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "merge" in res.stdout
    assert time.perf_counter() - t0 < 5  # typically ~0.3 s; generous for a loaded CI box


def test_every_command_has_help_with_examples():
    for name in COMMANDS:
        res = run(name, "--help")
        assert res.exit_code == 0, name
        assert "Examples:" in res.output and f"zckpt {name}" in res.output, name


def test_cli_reference_is_current():
    from zckpt.cli._docs import render_reference
    assert (ROOT / "docs" / "cli.md").read_text() == render_reference(), \
        "docs/cli.md is stale: run `python -m zckpt.cli._docs > docs/cli.md`"


def test_guide_mentions_every_command():
    guide = (ROOT / "docs" / "guide.md").read_text()
    for name in COMMANDS:
        assert f"zckpt {name}" in guide, name


def test_info_json(ckpt_path):
    res = run("info", str(ckpt_path), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["zero_stage"] in (1, 2, 3) and d["dp_world_size"] >= 1 and d["parameters"] > 0
    assert d["precision"] in ("bf16", "fp16", "fp32")
    human = run("info", str(ckpt_path))
    assert "ZeRO-" in human.output and "world size" in human.output


def test_verify_ok_and_deep(ckpt_path):
    res = run("verify", str(ckpt_path), "--deep", "--json", "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True


def test_verify_detects_flipped_bit(tmp_path):
    import shutil
    src = checkpoint_path(FIXTURE_DIRS[0])
    ck = tmp_path / "ck"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("expected"))
    tag = (ck / "latest").read_text().strip()
    f = sorted((ck / tag).glob("*optim_states.pt"))[0]
    from zckpt import safeload
    obj = safeload.load(str(f))
    t = obj["optimizer_state_dict"].get("single_partition_of_fp32_groups", obj["optimizer_state_dict"].get(
        "fp32_flat_groups"))[0]
    data = bytearray(f.read_bytes())
    data[t.byte_offset + 1] ^= 0x10
    f.write_bytes(bytes(data))
    assert run("verify", str(ck)).exit_code == 0  # metadata is intact
    res = run("verify", str(ck), "--deep", "--quiet")
    assert res.exit_code == 1 and "BAD" in res.output and "CRC" in res.output


def test_merge_cli(tmp_path, ckpt_path):
    out = tmp_path / "m"
    res = run("merge", str(ckpt_path), "-o", str(out), "--dtype", "bf16", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["dtype"] == "bfloat16" and (out / "model.safetensors").exists()
    res = run("merge", str(ckpt_path), "-o", str(out))
    assert res.exit_code == 1 and "not empty" in res.output


@pytest.mark.parametrize("case", ["missing", "file", "truncated", "evil", "missing_rank", "not_ckpt", "bad_latest"])
def test_errors_are_one_line_no_traceback(tmp_path, case):
    import shutil
    src = checkpoint_path(FIXTURE_DIRS[0])
    ck = tmp_path / "ck"
    if case != "missing":
        shutil.copytree(src, ck, ignore=shutil.ignore_patterns("expected"))
    tag = (src / "latest").read_text().strip()
    if case == "file":
        ck = ck / "latest"
    elif case == "truncated":
        f = sorted((ck / tag).glob("*model_states.pt"))[0]
        f.write_bytes(f.read_bytes()[:300])
    elif case == "evil":
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned > /tmp/zckpt-evil",))
        f = sorted((ck / tag).glob("*model_states.pt"))[0]
        torch.save({"module": {}, "x": Evil()}, f)
    elif case == "missing_rank":
        sorted((ck / tag).glob("*optim_states.pt"))[-1].unlink()
    elif case == "not_ckpt":
        shutil.rmtree(ck / tag)
        (ck / "latest").unlink()
    elif case == "bad_latest":
        (ck / "latest").write_text("global_step999")
    for cmd in (["info"], ["verify"], ["merge", "-o", str(tmp_path / "out")]):
        proc = subprocess.run([sys.executable, "-m", "zckpt", *cmd[:1], str(ck), *cmd[1:]], capture_output=True,
                              text=True, cwd=ROOT, env=dict(os.environ, ZCKPT_DEBUG=""))
        assert proc.returncode == 1, (case, cmd, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("zckpt: error:"), (case, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()
    assert not os.path.exists("/tmp/zckpt-evil")


def test_debug_shows_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zckpt", "--debug", "info", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_progress_bar_starts_only_after_its_delay(monkeypatch):
    """Short jobs print nothing and never import tqdm; a job that runs past the delay gets a bar on stderr."""
    import io
    from zckpt.cli._common import Progress
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    quick = Progress("merge", delay=60)
    for done in range(0, 101, 10):
        quick(done, 100)
    assert quick.bar is None
    slow = Progress("merge", delay=0.05)
    slow(10, 100)
    assert slow.bar is None
    time.sleep(0.06)
    slow(50, 100)
    assert slow.bar is not None and slow.bar.n == 50 and slow.bar.total == 100
    slow(100, 100)
    slow.close()
    assert "merge" in sys.stderr.getvalue()


def test_plain_fp32_merge_imports_neither_numpy_nor_torch(tmp_path):
    """Copies and small bf16 -> fp32 upcasts (frozen weights, buffers) need no numpy: start-up stays small."""
    from tests.conftest import FIXTURES
    ckpt = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    code = ("import sys; from zckpt.merge import merge; "
            f"merge({str(ckpt)!r}, {str(tmp_path / 'out')!r}); "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
