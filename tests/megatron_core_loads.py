"""One torchrun of 2 CPU ranks of megatron-core 0.16.1 for every test file whose oracle is megatron-core's own load
of what ``zckpt convert --to megatron`` wrote (tests/test_megatron_write.py, tests/test_megatron_from_runs.py): each
file builds its jobs (``megatron_jobs(tmp)``), the session fixture ``megatron_core_loads`` (tests/conftest.py) hands
all of them to one launch of tests/megatron_write_worker.py (which runs each job with its file's worker) and gives
each file its own results, in its own order. Only the files whose tests asked for the fixture in this session are
built and loaded, so a run of one file launches once for it alone.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: test module -> the worker (tests/<name>.py, with ``check(G, job)``) that loads its jobs
WORKERS = {"tests.test_megatron_write": "megatron_write_worker",
           "tests.test_megatron_from_runs": "megatron_from_runs_worker",
           "tests.test_megatron_write_moe": "megatron_write_moe_worker"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(jobs: list, tmp: Path) -> list:
    """megatron-core's findings for ``jobs`` (each tagged with its ``worker``), one launch of 2 CPU ranks."""
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "tests" / "megatron_write_worker.py"), "--jobs", str(tmp / "jobs.json"),
           "--result", str(tmp / "result.json")]
    from tests import ranks  # (the ranks without torchrun's agent)
    r = ranks.run(cmd, env=env, timeout=900)
    assert r.returncode == 0, r.stdout.decode(errors="replace")[-8000:]
    return json.loads((tmp / "result.json").read_text())


def load_all(modules, tmp: Path) -> dict:
    """{module name: (its results in its jobs' order, what its ``megatron_jobs`` returned beside the jobs)} for the
    test ``modules`` (names in :data:`WORKERS`), after one launch."""
    built, jobs = {}, []
    for name in sorted(set(modules) & set(WORKERS)):
        sub = tmp / name.rsplit(".", 1)[1]
        sub.mkdir()
        mine, extra = importlib.import_module(name).megatron_jobs(sub)
        built[name] = (len(jobs), len(mine), extra)
        jobs += [{**j, "worker": WORKERS[name]} for j in mine]
    results = launch(jobs, tmp) if jobs else []
    return {name: (results[start:start + n], extra) for name, (start, n, extra) in built.items()}
