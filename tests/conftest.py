"""Shared test fixtures: the committed DeepSpeed checkpoints under fixtures/ and their expected answers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.s3server"]  # one SeaweedFS server for the whole session

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's JIT-built CPU ops of this suite live in the repo, never in a ~/.cache shared with other venvs
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def fixture_dirs() -> list[Path]:
    """Committed fixture folders (each has expected/spec.json)."""
    return sorted(p for p in FIXTURES.iterdir() if (p / "expected" / "spec.json").exists()) if FIXTURES.exists() else []


def checkpoint_path(fixture: Path) -> Path:
    """The path a user would pass: the save folder (or checkpoint-N for the Trainer fixture)."""
    spec = json.loads((fixture / "expected" / "spec.json").read_text())
    if spec.get("kind") == "trainer":
        return fixture / "checkpoint-4"
    for cand in (fixture / "checkpoint", fixture):
        if (cand / "latest").exists():
            return cand
    raise FileNotFoundError(f"no save folder in {fixture}")


FIXTURE_DIRS = fixture_dirs()
FIXTURE_IDS = [p.name for p in FIXTURE_DIRS]


@pytest.fixture(params=FIXTURE_DIRS, ids=FIXTURE_IDS)
def fixture_dir(request) -> Path:
    return request.param


@pytest.fixture
def ckpt_path(fixture_dir) -> Path:
    return checkpoint_path(fixture_dir)


@pytest.fixture(scope="session")
def megatron_core_loads(request, tmp_path_factory) -> dict:
    """megatron-core's own loads of zckpt's Megatron outputs for every test file of this session that asks (its
    ``megatron_jobs``), in one torchrun: {module name: (results, extra)} (tests/megatron_core_loads.py)."""
    pytest.importorskip("megatron.core")
    from tests.megatron_core_loads import load_all
    modules = {item.module.__name__ for item in request.session.items
               if "megatron_core_loads" in getattr(item, "fixturenames", ())}
    return load_all(modules, tmp_path_factory.mktemp("megatron_core_loads"))


@pytest.fixture(scope="session")
def titan_deepspeed_loads(request, tmp_path_factory) -> dict:
    """DeepSpeed 0.19.8's own loads of the torchtitan saves converted by every test file of this session that asks
    (its ``deepspeed_jobs(tmp)``: (cases for tests/moe_dcp_worker.py's ``deepspeed`` mode, what it keeps)), in one
    launch of 2 gloo ranks: {module name: what its ``deepspeed_jobs`` kept}."""
    import importlib
    from tests.test_moe_dcp import _torchrun
    modules = sorted({item.module.__name__ for item in request.session.items
                      if "titan_deepspeed_loads" in getattr(item, "fixturenames", ())})
    kept, cases = {}, []
    for name in modules:
        mine, kept[name] = importlib.import_module(name).deepspeed_jobs(tmp_path_factory.mktemp(name.split(".")[-1]))
        cases += mine
    if cases:
        _torchrun({"deepspeed": True, "cases": cases})
    return kept


_FIXTURES_AT_START = set(os.listdir(FIXTURES)) if FIXTURES.exists() else set()

# DeepSpeed's CPU Adam (ZeRO-Offload's optimizer) is compiled by torch's JIT on its first use: about 60 s on the
# 2-core box, which the first offload test of a fresh clone used to wait for (88-98 s in CI, 26 s once built).
# When the session holds such a test and the build is not there yet, it starts with the session, in a background
# process at the lowest CPU priority, while the tests before that one run. torch's lock file in the build folder
# makes the test that needs it wait for that build (or build it itself, had the background one failed).
_CPU_ADAM_TESTS = ("offload", "cpu_adam")
_BACKGROUND: list = []


def pytest_collection_finish(session):
    import importlib.util
    import subprocess
    build = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "cpu_adam"
    if (build / "cpu_adam.so").exists() or importlib.util.find_spec("deepspeed") is None:
        return
    if not any(k in item.nodeid for item in session.items for k in _CPU_ADAM_TESTS):
        return
    _BACKGROUND.append(subprocess.Popen(
        [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19)))


def _stop_background() -> None:
    """A build still running when the session ends (a subset that never needed it, an interrupted run): stopped
    as Ctrl-C would (torch then removes its lock file), killed if it does not end, and its lock file removed."""
    import signal
    import subprocess
    for proc in _BACKGROUND:
        if proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lock = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "cpu_adam" / "lock"
        if lock.exists():
            lock.unlink()


def pytest_sessionfinish(session, exitstatus):
    """The committed fixtures are read-only: a test that writes an output beside them (a merge without -o) fails
    the run, and its stray folder is named. A background build still running is stopped."""
    _stop_background()
    stray = sorted(set(os.listdir(FIXTURES)) - _FIXTURES_AT_START) if FIXTURES.exists() else []
    if stray:
        print(f"\nERROR: the test run wrote into fixtures/: {', '.join(stray)}", file=sys.stderr)
        session.exitstatus = 1
