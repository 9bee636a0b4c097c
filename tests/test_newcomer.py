"""What a new user meets first (issue 32): the guides in the terminal, one exit-status table everywhere, errors
that name their path, and words that say what they mean."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _run_in_terminal(args, env) -> str:
    """Run ``args`` with stdin and stdout on a pseudo-terminal; what it wrote there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    return out.decode("utf-8", "replace").replace("\r\n", "\n")


def test_help_guide_uses_a_pager_on_a_terminal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PAGER="sed s/^/PAGED:/", TERM="xterm")
    out = _run_in_terminal([sys.executable, "-m", "zckpt", "help", "guide"], env)
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines and all(line.startswith("PAGED:") for line in lines), out[:500]
    assert len(lines) > 100
    # piped: the text as it is, no pager
    res = subprocess.run([sys.executable, "-m", "zckpt", "help", "guide"], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout == (ROOT / "docs" / "guide.md").read_text()


def test_help_lists_user_guides_only():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "zckpt", "help"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    topics = [line.split()[0] for line in res.stdout.splitlines() if line.strip() and not line.startswith("(")]
    assert "guide" in topics and "gpu-validation" not in topics, topics
    assert not re.search(r"\bissue \d+", res.stdout), res.stdout  # internal notes are not user guides
    for doc in (ROOT / "docs").glob("*.md"):
        assert not re.search(r"\(issue \d+", doc.read_text()), doc.name


def _flat(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_one_exit_status_table_everywhere():
    """zckpt/cli/_errors.py (its table and docstring), docs/guide.md, README.md and zckpt --help say the same
    statuses in the same words, and the one Ctrl-C that is not 130 (push --every between runs)."""
    from zckpt.cli import _errors
    codes = [c for c, _ in _errors.EXIT_STATUSES]
    assert sorted({c for _, c, _ in _errors.ERROR_TABLE} | {_errors.EXIT_OK}) == sorted(codes)
    doc = _errors.__doc__
    table = doc[doc.index("===="):doc.rindex("====")]
    assert [int(m) for m in re.findall(r"^(\d+) {2,}", table, re.M)] == codes, table
    assert _errors.STOPPED_BETWEEN_RUNS in _flat(table)

    guide = (ROOT / "docs" / "guide.md").read_text()
    rows = guide[guide.index("| status | kind of mistake |"):].split("\n\n")[0]
    assert [int(m) for m in re.findall(r"^\| (\d+) \|", rows, re.M)] == codes, rows
    assert _errors.STOPPED_BETWEEN_RUNS in _flat(rows)

    readme = _flat((ROOT / "README.md").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    helptext = _flat(subprocess.run([sys.executable, "-m", "zckpt", "--help"], capture_output=True, text=True,
                                    env=env).stdout)
    for where, text in (("README.md", readme), ("zckpt --help", helptext), ("docs/cli.md",
                                                                           _flat((ROOT / "docs/cli.md").read_text()))):
        said = text[text.index("exit status"  if where == "README.md" else "Exit status:"):][:400]
        listed = ", ".join(f"{c} {words}" for c, words in _errors.EXIT_STATUSES)
        assert all(f"{c} {words}" in said for c, words in _errors.EXIT_STATUSES), (where, said, listed)
        assert _errors.STOPPED_BETWEEN_RUNS in said, (where, said)
    # --json's error object: the non-zero statuses
    schema = (ROOT / "docs" / "json.md").read_text()
    assert re.search(r'"exit_code": \{"type": "integer", "enum": \[1, 2, 75, 130\]\}', schema)
    assert codes[1:] == [1, 2, 75, 130]


def test_every_cited_doc_exists():
    """Each ``docs/NAME.md`` that the code, the docs or the fixtures cite is in the repository (no citations of
    notes that never shipped, like a docs/deepspeed-format.md with sections 2.1-2.4)."""
    cited = {}
    for path in [*ROOT.glob("zckpt/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("fixtures/*.py"),
                 *ROOT.glob("fixtures/*.md"), *ROOT.glob("benchmarks/*.md"), *ROOT.glob("benchmarks/*.py")]:
        for name in re.findall(r"\bdocs/([\w.-]+\.md)\b", path.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(name, path.relative_to(ROOT).as_posix())
    missing = {name: where for name, where in cited.items() if not (ROOT / "docs" / name).is_file()}
    assert cited and not missing, missing


def _zckpt(cwd, *args):
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, ZCKPT_DEBUG="", PYTHONPATH=str(ROOT)), timeout=300)


def test_verify_dcp_and_convert_outputs_say_what_they_are(tmp_path):
    """verify --deep of a DCP folder: one check per name (the .distcp items, then the other files); a
    convert --to deepspeed output is called a convert output, and --overwrite replaces it."""
    import json

    from tests.conftest import FIXTURES, checkpoint_path
    for layout in ("trainer", "dcp"):
        res = _zckpt(tmp_path, "convert", str(checkpoint_path(FIXTURES / "trainer")), "--to", "dcp", "--layout",
                     layout, "-o", f"dcp-{layout}", "-q")
        assert res.returncode == 0, res.stderr
        res = _zckpt(tmp_path, "verify", f"dcp-{layout}", "--deep", "--json")
        assert res.returncode == 0, res.stderr
        names = [c["name"] for c in json.loads(res.stdout)["checks"]]
        assert len(names) == len(set(names)) and "CRC of every item" in names, names
        other = [c for c in json.loads(res.stdout)["checks"] if c["name"] == "CRC of the other files"]
        assert all("besides the .distcp items" in c["detail"] for c in other), other
    args = ["convert", "dcp-trainer", "--to", "deepspeed", "--world-size", "2", "--stage", "2", "--dtype", "bf16",
            "--buffers", "", "-o", "ds", "-q"]
    assert _zckpt(tmp_path, *args).returncode == 0
    assert json.loads((tmp_path / "ds" / ".zckpt.json").read_text())["kind"] == "convert"
    res = _zckpt(tmp_path, "verify", "ds")
    assert "zckpt convert output, committed" in res.stdout and "reshard output" not in res.stdout, res.stdout
    res = _zckpt(tmp_path, *args, "--overwrite")
    assert res.returncode == 0, res.stderr


def test_a_full_disk_under_a_launcher_names_the_output(tmp_path):
    """A rank's OSError (ENOSPC while writing the output) reaches every rank as that OSError, so the one error
    table names the output and says the disk is full (it was "zckpt: error: OSError: [Errno 28] No space left on
    device": no path, no hint). Through a real gloo group of one process; the CLI's rendering of the result."""
    code = """
import errno, socket, sys
import torch.distributed as dist
from zckpt.engine.launch import agree
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
try:
    agree(OSError(errno.ENOSPC, "No space left on device"))
except BaseException as e:
    from zckpt.cli._errors import describe
    print(type(e).__name__, e.errno, describe(e, output=sys.argv[1]).message)
try:
    agree(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y"))
except BaseException as e:
    print(type(e).__name__, e.filename)
dist.destroy_process_group()
"""
    res = subprocess.run([sys.executable, "-c", code, "out/model"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first == ("OSError 28 out/model: cannot write the output here: No space left on device (the disk is "
                     "full; free space or choose another -o)"), first
    assert second == "FileNotFoundError /x/y", second


def test_progress_bar_sizes_are_the_summary_sizes():
    """The bar says 254.6 MiB where the summary does (it said tqdm's 267M next to a summary's 254.7 MiB)."""
    import io
    import time

    from zckpt.cli._common import byte_bar
    from zckpt.units import format_size
    out = io.StringIO()
    bar = byte_bar(280_000_000, "merge", out)
    time.sleep(0.25)
    bar.update(267_000_000)
    bar.refresh()
    bar.close()
    frame = out.getvalue().split("\r")[-2] if out.getvalue().endswith("\r") else out.getvalue().split("\r")[-1]
    assert f"{format_size(267_000_000)}/{format_size(280_000_000)}" in out.getvalue(), out.getvalue()
    assert "267M" not in out.getvalue() and "MiB/s" in out.getvalue(), frame
