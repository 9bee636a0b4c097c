"""tests/ranks.py, the oracles' launcher: the ranks get torchrun's environment, the first to fail stops the others,
a hang ends at the timeout with every rank killed, and what it does not know goes to torchrun as written."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests import ranks

SCRIPT = r"""
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
mode, rank = sys.argv[1], int(os.environ["RANK"])
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(120)
"""


def _cmd(tmp_path, mode, n=3, *extra):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
            "--master-addr", "127.0.0.1", "--master-port", "29999", *extra, str(script), mode]


def test_each_rank_gets_torchruns_environment(tmp_path):
    res = ranks.run(_cmd(tmp_path, "ok"), env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert res.returncode == 0, res.stdout
    envs = sorted((json.loads(line[4:]) for line in res.stdout.decode().splitlines() if line.startswith("ENV ")),
                  key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert all(e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3" and e["MASTER_ADDR"] == "127.0.0.1"
               and e["MASTER_PORT"] == "29999" and e["TORCHELASTIC_RUN_ID"] == "none"
               and e["TORCHELASTIC_USE_AGENT_STORE"] is None and e["OMP_NUM_THREADS"] == "1" for e in envs)


def test_the_first_failure_stops_the_other_ranks(tmp_path):
    t = time.monotonic()
    res = ranks.run(_cmd(tmp_path, "fail"), timeout=100)
    assert time.monotonic() - t < 30
    assert res.returncode == 1 and b"rank 1 exited 3, the other ranks stopped" in res.stdout, res.stdout


def test_a_hang_ends_at_the_timeout_with_every_rank_killed(tmp_path):
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as exc:
        ranks.run(_cmd(tmp_path, "hang", 2), timeout=3)
    assert time.monotonic() - t < 20 and b"ENV " in exc.value.output
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "rank.py")], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_what_it_does_not_know_goes_to_torchrun_as_written(tmp_path):
    assert ranks.parse(_cmd(tmp_path, "ok")) is not None
    assert ranks.parse(_cmd(tmp_path, "ok", 2, "--rdzv-backend", "c10d")) is None
    assert ranks.parse([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                        "--master-port", "1", "x.py"]) is None
    assert ranks.parse([sys.executable, "-m", "zckpt", "info"]) is None
