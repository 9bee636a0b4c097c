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


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """The zckpt wheel, built once per session from a copy of the tree."""
    work = tmp_path_factory.mktemp("wheel")
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
    return wheel


@pytest.fixture(scope="module")
def installed(built_wheel, tmp_path_factory):
    """(bin folder of a fresh venv with the zckpt wheel installed, the wheel path)."""
    work = tmp_path_factory.mktemp("install")
    wheel = built_wheel
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
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert {p.rsplit("/", 1)[-1] for p in declared["share/doc/zckpt"]} <= docs, docs  # the users' guides
    assert not {"architecture.md", "benchmarks.md", "reliability.md"} & docs, docs  # developers' pages stay out


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


# ------------------------------------------------------------------------------------- the core, without torch

@pytest.fixture(scope="session")
def bare(built_wheel, tmp_path_factory):
    """bin folder of a fresh venv holding the wheel and its own dependencies as pip resolves them (the package
    indexes pip is configured with), without torch: what ``pip install zckpt`` gives a login node."""
    work = tmp_path_factory.mktemp("bare")
    venv = work / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           str(built_wheel)], capture_output=True, text=True, timeout=300, env=clean)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    return venv / "bin"


def test_core_install_has_no_torch(built_wheel, bare, tmp_path):
    meta = next(n for n in zipfile.ZipFile(built_wheel).namelist() if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in zipfile.ZipFile(built_wheel).read(meta).decode()
                .splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert core and not [r for r in core if r.split(";")[0].strip().lower().startswith(("torch", "huggingface"))], core
    extras = {r.split("extra ==")[1].strip(" '\"") for r in requires if "extra ==" in r}
    assert {"torch", "s3", "hub", "test"} <= extras, extras
    assert any(r.startswith("torch") and "extra == \"torch\"" in r for r in requires), requires
    res = _run(bare, "python", "-c", "import importlib.util as u; print([m for m in ('torch', 'huggingface_hub', "
               "'s3fs', 'deepspeed') if u.find_spec(m)])", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    size = sum(f.stat().st_size for f in bare.parent.rglob("*") if f.is_file())
    assert size < 300 * 2**20, size  # numpy is the largest part; torch alone is ~700 MiB (CPU), GBs with CUDA


def _ok(res, *needles):
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    for n in needles:
        assert n in res.stdout + res.stderr, (n, res.stdout, res.stderr)
    return res


def test_every_command_without_torch(bare, tmp_path):
    """info, verify --deep, merge (safetensors, pt, bf16), reshard, convert both ways, estimate, help: each as the
    suite's torch install gives it, byte for byte where it writes files."""
    ckpt = checkpoint_path(FIXTURES / "trainer")
    with_torch = tmp_path / "with-torch"
    with_torch.mkdir()

    def both(*args):
        """Run in the bare venv (cwd tmp_path) and in the suite's (cwd with_torch); the results."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        ref = subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True,
                             cwd=with_torch, env=env, timeout=180)
        _ok(ref)
        return _ok(_run(bare, "zckpt", *args, cwd=tmp_path)), ref

    res, ref = both("info", str(ckpt), "--json")
    assert json.loads(res.stdout) == json.loads(ref.stdout)
    _ok(_run(bare, "zckpt", "info", str(ckpt), cwd=tmp_path), "ZeRO-2")
    _ok(_run(bare, "zckpt", "verify", str(ckpt), "--deep", cwd=tmp_path))
    outputs = {"st": ("--to", "safetensors"), "pt": ("--to", "pt"), "bf16": ("--dtype", "bf16")}
    for out, flags in outputs.items():
        both("merge", str(ckpt), *flags, "-o", out)
    both("reshard", str(ckpt), "--world-size", "1", "-o", "ws1")
    both("convert", str(ckpt), "--to", "dcp", "-o", "dcp")
    for out in (*outputs, "ws1", "dcp"):
        files = sorted(p.relative_to(tmp_path / out) for p in (tmp_path / out).rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(with_torch / out) for p in (with_torch / out).rglob("*")
                               if p.is_file()), out
        for f in files:
            a, b = tmp_path / out / f, with_torch / out / f
            if zipfile.is_zipfile(a):  # torch zips: each entry but the random serialization_id
                za, zb = zipfile.ZipFile(a), zipfile.ZipFile(b)
                assert za.namelist() == zb.namelist(), (out, f)
                for n in za.namelist():
                    if not n.endswith("/serialization_id"):
                        assert za.read(n) == zb.read(n), (out, f, n)
            elif f.name == ".metadata":  # DCP: all but its StorageMeta (the folder's path, a fresh uuid4 each save)
                ma, mb = a.read_bytes(), b.read_bytes()
                assert ma[:ma.index(b"StorageMeta")] == mb[:mb.index(b"StorageMeta")], (out, f)
            elif f.name not in ("zckpt_manifest.json", ".zckpt.json"):  # (they record times)
                assert a.read_bytes() == b.read_bytes(), (out, f)
    _ok(_run(bare, "zckpt", "verify", "ws1", "--deep", cwd=tmp_path))
    _ok(_run(bare, "zckpt", "info", "dcp", cwd=tmp_path))
    _ok(_run(bare, "zckpt", "verify", "dcp", "--deep", cwd=tmp_path))
    _ok(_run(bare, "zckpt", "merge", "dcp", "-o", "from-dcp", cwd=tmp_path))
    _ok(_run(bare, "zckpt", "estimate", "--params", "8B", "--largest-layer", "600M", "--gpu-memory", "80GiB",
             cwd=tmp_path), "Recommendation")
    _ok(_run(bare, "zckpt", "help", cwd=tmp_path), "guide")
    _ok(_run(bare, "zckpt", "help", "guide", cwd=tmp_path), "zckpt")


def test_tensor_functions_without_torch_say_how_to_install(bare, tmp_path):
    ckpt = checkpoint_path(FIXTURES / "trainer")
    code = ("import zckpt, sys\n"
            "for call in (lambda: zckpt.iter_tensors(sys.argv[1]), lambda: zckpt.load_state_dict(sys.argv[1])):\n"
            "    try:\n"
            "        call()\n"
            "    except zckpt.MissingDependency as e:\n"
            "        assert isinstance(e, ImportError) and isinstance(e, zckpt.ZckptError)\n"
            "        print(e)\n")
    res = _run(bare, "python", "-c", code, str(ckpt), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("iter_tensors") and lines[1].startswith("load_state_dict"), lines
    for line in lines:
        assert "needs torch, which is not installed" in line and "pip install 'zckpt[torch]'" in line, line
        assert "download.pytorch.org/whl/cpu" in line and "ModuleNotFoundError" not in line, line


def test_launcher_without_torch_says_torch_distributed(bare, tmp_path):
    ckpt = checkpoint_path(FIXTURES / "trainer")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZCKPT_DEBUG")}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    res = subprocess.run([str(bare / "zckpt"), "merge", str(ckpt), "-o", "m"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith("zckpt: error:") and "torch.distributed" in line and "zckpt[torch]" in line, line
    assert not (tmp_path / "m").exists()


def test_missing_backend_without_extra_is_one_line(bare, tmp_path):
    res = _run(bare, "zckpt", "info", "s3://bucket/run1/checkpoint-4", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    (line,) = res.stderr.splitlines()
    assert "pip install 'zckpt[s3]'" in line and "((" not in line and line.count("(") == line.count(")"), line
    res = _run(bare, "zckpt", "info", "hf://me/run/checkpoint-4", cwd=tmp_path)
    (line,) = res.stderr.splitlines()
    assert res.returncode == 1 and "pip install 'zckpt[hub]'" in line, line


def test_push_missing_backend_is_said_once(bare, tmp_path):
    """Three checkpoints, no s3fs: one line before any checkpoint, also with --every (no later run can succeed)."""
    src = tmp_path / "outputs"
    for step in (4, 8, 12):
        shutil.copytree(checkpoint_path(FIXTURES / "trainer"), src / f"checkpoint-{step}")
    for mode in (["--once"], ["--every", "1s"]):
        res = _run(bare, "zckpt", "push", str(src), "s3://bucket/run1", *mode, cwd=tmp_path)
        assert res.returncode == 1 and "Traceback" not in res.stderr, (mode, res.stderr)
        (line,) = res.stderr.splitlines()
        assert line == ("zckpt: error: s3://bucket/run1: no backend for s3:// is installed "
                        "(pip install 'zckpt[s3]')"), (mode, line)


def test_make_setup_installs_the_tested_torch_then_every_extra():
    """``make demo`` / ``make test`` (the README's two commands): torch 2.13.0 first (the CPU wheel from this
    machine's index, or TORCH_INDEX's), then zckpt with the extras the suite needs, all of which pyproject has."""
    import tomllib
    recipe = (ROOT / "Makefile").read_text()
    torch_at = recipe.index("pip install -q torch==2.13.0 $(TORCH_INDEX)")
    extras_at = recipe.index("pip install -q -e '.[torch,s3,hub,test]'")
    assert torch_at < extras_at
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"torch", "s3", "hub", "test"} <= set(extras)
    readme = (ROOT / "README.md").read_text()
    assert "https://download.pytorch.org/whl/cpu" in readme and "pip install 'zckpt[torch]'" in readme


def test_documented_examples_without_torch(bare, tmp_path, monkeypatch):
    """Every ``zckpt ...`` example of README.md and docs/ that tests/test_docs_examples.py runs, run as written by
    the console script of the torch-free install (each in a fresh copy of the same workspace)."""
    from tests import test_docs_examples as docs
    (tmp_path / "template").mkdir()
    template = docs.workspace.__wrapped__(tmp_path / "template", monkeypatch)  # the names the docs use
    runnable = list(dict.fromkeys(c for w, c in docs.EXAMPLES  # (a recipe's lines run in order by its own test)
                                  if not docs.skip_reason(c) and w.split(":")[0] not in docs.RECIPES))  # (a line in two docs:
    where = {c: w for w, c in reversed(docs.EXAMPLES)}                                     # run once)

    def run(i: int, command: str) -> str | None:
        ws = tmp_path / f"ws{i}"
        shutil.copytree(template, ws, symlinks=True)
        args = docs._args(command, ws)
        res = _run(bare, "zckpt", *args, cwd=ws)
        shutil.rmtree(ws)
        if res.returncode != 0 or "Traceback" in res.stderr:
            return f"{where[command]}: zckpt {' '.join(args)}: {res.stderr.strip()[-300:]}"
        return None

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:  # (subprocesses: the examples are independent, each in its own copy)
        failed = [f for f in pool.map(run, range(len(runnable)), runnable) if f]
    ran = len(runnable)
    assert ran >= 25 and not failed, "\n".join(failed)
