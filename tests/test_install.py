"""The package as a user gets it: build the wheel, install it into a fresh virtual environment, run the console
script from outside the source tree.

The editable install the suite runs under hides packaging mistakes: the source tree is importable, and its
``.pth`` hooks import modules (``importlib.util``) that a clean interpreter has not loaded. Here the wheel is
installed into a new venv whose only other entries are the dependencies (the suite venv's site-packages, added
as a plain path so none of its ``.pth`` hooks run), and every command runs with cwd outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin folder of a fresh venv with the zckpt wheel installed, the wheel path)."""
    work = tmp_path_factory.mktemp("install")
    # build from a copy: the build writes build/ and *.egg-info, and other runs share the working tree
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "zckpt", src / "zckpt", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(ROOT / "docs", src / "docs")  # installed for `zckpt help`
    wheels = work / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=180)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    boxes = [line for line in log.splitlines() if "Warning" in line or "deprecat" in line.lower()]
    assert not boxes, boxes  # setuptools' deprecation boxes (e.g. project.license as a table)
    (wheel,) = wheels.glob("zckpt-*.whl")

    venv = work / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    site = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, click, ...) from the suite's venv, as a plain path: its .pth hooks do not run
    Path(site, "zckpt-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --force-reinstall: the suite's own zckpt (an editable install, seen through the .pth above) has the same
    # version, and pip would otherwise call the wheel "already installed"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index",
                           "--force-reinstall", "-q", str(wheel)], capture_output=True, text=True, timeout=180,
                          env=clean)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    return venv / "bin", wheel


def _run(bindir: Path, *args, cwd: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZCKPT_DEBUG")}
    return subprocess.run([str(bindir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def test_wheel_holds_every_module(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "zckpt").rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    # the license text itself, as the repository has it
    (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "License-File: LICENSE" in text
    body = zipfile.ZipFile(wheel).read(license_name).decode()
    assert body == (ROOT / "LICENSE").read_text() and "Apache License" in body and "END OF TERMS" in body
    assert "Version 2.0, January 2004" in body
    # the guides, for `zckpt help`
    docs = {n.rsplit("/", 1)[-1] for n in names if "/share/doc/zckpt/" in n}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= docs, docs


def test_help_reaches_the_installed_guides(installed, tmp_path):
    bindir, _ = installed
    res = _run(bindir, "zckpt", "--help", cwd=tmp_path)
    assert "zckpt help" in res.stdout and "docs/guide.md" not in res.stdout
    res = _run(bindir, "zckpt", "help", cwd=tmp_path)
    assert res.returncode == 0 and "guide" in res.stdout and str(bindir.parent) in res.stdout, res.stdout
    res = _run(bindir, "zckpt", "help", "guide", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == (ROOT / "docs" / "guide.md").read_text()
    for name in ("info", "verify", "merge", "reshard", "push", "estimate", "convert", "help"):
        res = _run(bindir, "zckpt", name, "--help", cwd=tmp_path)
        assert "docs/" not in res.stdout.replace("zckpt help", ""), (name, res.stdout)


def test_installed_package_is_the_wheel(installed, tmp_path):
    bindir, _ = installed
    res = _run(bindir, "python", "-c", "import sys, zckpt.cli; print(zckpt.__file__); "
               "print('importlib.util' in sys.modules)", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where = res.stdout.splitlines()[0]
    assert str(bindir.parent) in where and str(ROOT) not in where, where


def test_console_script_help_info_merge(installed, tmp_path):
    bindir, _ = installed
    ckpt = checkpoint_path(FIXTURES / "trainer")
    res = _run(bindir, "zckpt", "--help", cwd=tmp_path)
    assert res.returncode == 0 and "merge" in res.stdout and "Traceback" not in res.stderr, res.stderr
    for name in ("info", "verify", "merge", "reshard", "push", "estimate"):
        res = _run(bindir, "zckpt", name, "--help", cwd=tmp_path)
        assert res.returncode == 0 and "Examples:" in res.stdout, (name, res.stderr)
    res = _run(bindir, "zckpt", "info", str(ckpt), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["zero_stage"] == 2
    res = _run(bindir, "zckpt", "merge", str(ckpt), "-o", "merged", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    res = _run(bindir, "zckpt", "estimate", "--params", "8B", "--largest-layer", "600M", "--gpu-memory", "80GiB",
               cwd=tmp_path)
    assert res.returncode == 0 and "Recommendation" in res.stdout, res.stderr
    res = _run(bindir, "zckpt", "info", str(tmp_path / "nope"), cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.startswith("zckpt: error:") and "internal error" not in res.stderr
