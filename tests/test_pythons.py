"""Every declared Python (``requires-python >=3.10``): the core install (the wheel, no torch) on Python 3.10, 3.12
and 3.13 runs the CLI (info, verify --deep, merge) on the shipped fixtures and on checkpoints whose pickles are
large enough (>= 16 KiB) for :mod:`zckpt.encoding.pickles`' regular expression, with the same answers and the
same bytes as the suite's own Python (3.11).

The interpreters come from pyenv (``PYENV_ROOT`` or ``~/.pyenv``) or ``PATH``; a missing one is a loud skip naming
it. Each venv is made once per session under pytest's temporary folder, from the wheel ``tests/test_install.py``
builds, its dependencies from the package index pip is configured with.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path
from tests.test_install import built_wheel  # noqa: F401 - the session's wheel, built once

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.10", "3.12", "3.13")


def find_python(version: str) -> str | None:
    """The newest ``pythonX.Y`` that pyenv has installed, else the one on PATH (run to check it is that version)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(glob.glob(str(root / "versions" / f"{version}.*" / "bin" / f"python{version}")),
                   key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()])
    for cand in [*reversed(found), shutil.which(f"python{version}")]:
        if not cand:
            continue
        res = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
        if res.returncode == 0 and res.stdout.strip() == version:
            return cand
    return None


@pytest.fixture(scope="session")
def venvs(built_wheel, tmp_path_factory) -> dict[str, Path | str]:  # noqa: F811
    """version -> the bin folder of a venv holding the wheel and its core dependencies (or why there is none)."""
    work = tmp_path_factory.mktemp("pythons")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def make(version: str) -> Path | str:
        python = find_python(version)
        if python is None:
            return f"python{version} not found under pyenv or on PATH (pyenv install {version})"
        venv = work / f"py{version}"
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                               "-q", str(built_wheel)], capture_output=True, text=True, timeout=300, env=clean)
        assert inst.returncode == 0, (version, inst.stdout + inst.stderr)
        return venv / "bin"

    with ThreadPoolExecutor(len(VERSIONS)) as pool:
        return dict(zip(VERSIONS, pool.map(make, VERSIONS)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint: the shipped DeepSpeed Trainer fixture and Megatron fixture, an 800-parameter DCP saved
    by torch (``dcp.save``, one process, after an AdamW step; its ``.metadata`` is a 16 KiB+ pickle), and that DCP
    as 2-rank ZeRO-2 DeepSpeed files (by the suite's zckpt; their pickles are 16 KiB+ too)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    work = tmp_path_factory.mktemp("pythons-ckpts")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(400)])  # 800 parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "dcp800"), no_dist=True)
    res = _suite("convert", str(work / "dcp800"), "--to", "deepspeed", "--world-size", "2", "--stage", "2", "--dtype", "fp32",
                 "-o", str(work / "ds800"), cwd=work)
    assert res.returncode == 0, res.stderr
    return {"deepspeed": checkpoint_path(FIXTURES / "trainer"), "megatron": FIXTURES / "megatron" / "gpt_tp2_pp1_dp2",
            "dcp800": work / "dcp800", "ds800": work / "ds800"}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZCKPT_DEBUG")}


def _suite(*args, cwd: Path):
    """The CLI under the suite's own Python (the source tree)."""
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=cwd,
                          env={**_env(), "PYTHONPATH": str(ROOT)}, timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("zckpt_manifest.json", ".zckpt.json")}  # (they record times)


COMMANDS = {"info": ("info", "{ckpt}", "--json"), "verify": ("verify", "{ckpt}", "--deep", "--json"),
            "merge": ("merge", "{ckpt}", "-o", "merged-{name}")}


def _args(command: str, name: str, ckpt: Path) -> list[str]:
    return [a.format(ckpt=ckpt, name=name) for a in COMMANDS[command]]


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory) -> dict[tuple[str, str], object]:
    """(checkpoint, command) -> what the suite's Python answers: info's and verify's JSON, merge's files."""
    work = tmp_path_factory.mktemp("pythons-ref")
    out = {}
    for name, ckpt in checkpoints.items():
        for command in COMMANDS:
            res = _suite(*_args(command, name, ckpt), cwd=work)
            assert res.returncode == 0, (name, command, res.stderr)
            out[name, command] = _files(work / f"merged-{name}") if command == "merge" else json.loads(res.stdout)
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_cli_on_every_declared_python(version, venvs, checkpoints, reference, tmp_path):
    bindir = venvs[version]
    if isinstance(bindir, str):
        pytest.skip(f"NOT TESTED: Python {version}: {bindir}")
    res = subprocess.run([str(bindir / "python"), "-c", "import sys, importlib.util as u; "
                          "print('%d.%d' % sys.version_info[:2], u.find_spec('torch') is None)"],
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == [version, "True"], res.stdout + res.stderr  # that Python, without torch
    for name, ckpt in checkpoints.items():
        for command in COMMANDS:
            res = subprocess.run([str(bindir / "zckpt"), *_args(command, name, ckpt)], capture_output=True,
                                 text=True, cwd=tmp_path, env=_env(), timeout=300)
            assert res.returncode == 0 and "Traceback" not in res.stderr, (version, name, command, res.stderr)
            if command == "merge":
                ours = _files(tmp_path / f"merged-{name}")
                assert any(n.endswith(".safetensors") for n in ours), (version, name, sorted(ours))
            else:
                ours = json.loads(res.stdout)
            assert ours == reference[name, command], (version, name, command)
            if command == "verify":
                assert ours["ok"] is True, (version, name, ours)


@pytest.mark.parametrize("version", VERSIONS)
def test_forked_convert_on_every_declared_python(version, venvs, checkpoints, tmp_path):
    """convert --to deepspeed with bf16 weights (numpy imported for them while a forked child writes the optimizer
    files: zckpt.engine.forked) on each Python: the fork happens, and the files are the suite's Python's."""
    from tests.test_distributed import assert_same_output
    bindir = venvs[version]
    if isinstance(bindir, str):
        pytest.skip(f"NOT TESTED: Python {version}: {bindir}")
    args = ("convert", str(checkpoints["dcp800"]), "--to", "deepspeed", "--world-size", "2", "--stage", "2",
            "--dtype", "bf16", "-vv")
    ref = _suite(*args, "-o", "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    res = subprocess.run([str(bindir / "zckpt"), *args, "-o", "ours"], capture_output=True, text=True, cwd=tmp_path,
                         env={**_env(), "PYTHONWARNINGS": "always::DeprecationWarning"}, timeout=300)
    # (3.12+ warns when a process with threads forks: this one forks before any thread starts)
    assert res.returncode == 0 and "Traceback" not in res.stderr and "multi-threaded" not in res.stderr, res.stderr
    assert "2 file(s) only copied written by a forked process" in res.stderr, res.stderr
    assert_same_output(tmp_path / "ref", tmp_path / "ours")


@pytest.mark.parametrize("run", [b"{0,8192}", b"{0,3}"])
def test_bounded_run_walks_as_the_possessive_one(run, monkeypatch):
    """The expression Python 3.10 gets (a greedy run of at most N opcodes, then the walk resumes) ends every pickle
    where the possessive run of 3.11+ does, here on this interpreter: the Megatron ``.metadata`` pickles (16 KiB+,
    so the expression runs) and a 16 KiB+ pickle of every opcode kind torch writes, whole and cut short."""
    import pickle

    from zckpt.encoding import pickles
    from zckpt.errors import CorruptFile
    monkeypatch.setattr(pickles, "COMPILE_AFTER", 0)  # the expression for every one of them
    data = [Path(p).read_bytes() for p in sorted(glob.glob(str(FIXTURES / "megatron" / "*" / "*" / ".metadata")))]
    data.append(pickle.dumps([{"k%d" % i: (i, -i, 2.5 * i, "x" * (i % 300), b"y" * (i % 70), None, True)}
                              for i in range(600)], protocol=2))
    assert len(data) >= 3 and all(len(d) >= pickles.REGEX_FROM for d in data)

    def outcomes():
        got = []
        for d in data:
            for cut in (d, d[:len(d) // 2]):
                try:
                    got.append(pickles.scan(cut))
                except CorruptFile as exc:
                    got.append((type(exc).__name__, str(exc)))
        return got

    possessive = outcomes()
    assert possessive[0::2] == [len(d) for d in data]
    pickles._run_pattern.cache_clear()
    monkeypatch.setattr(pickles, "_RUN", run)
    try:
        assert outcomes() == possessive
    finally:
        pickles._run_pattern.cache_clear()
