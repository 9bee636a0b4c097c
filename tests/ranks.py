"""The test oracles' launcher: a ``python -m torch.distributed.run`` command of one node run as its ranks alone.

torchrun's own process (an elastic agent: torch imported, a rendezvous, a monitor loop) costs about 4 s of wall time
per launch on the 2-core box before and after the ranks' own work (a trivial 2-rank script: 4.0 s under torchrun,
0.2 s as two processes), and the suite launches the frameworks' loads (DeepSpeed, FSDP2, accelerate) a few hundred
times. :func:`run` starts the ranks itself, with the environment torchrun gives them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``...; rank 0 hosts the store, as without an
agent), their output in one stream as torchrun's, and torchrun's failure rule: the first rank to fail stops the
others. What the oracle loads and checks is unchanged: the same scripts in the same ranks; only the launcher differs.
Tests of zckpt's own distributed mode keep the real torchrun (tests/test_distributed.py): that is what users run.
A command with an option this launcher does not know runs under torchrun, as written, and so does every command
while ``ZCKPT_TEST_TORCHRUN=1`` is set (to compare or to rule the launcher out).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

_MODULE = ["-m", "torch.distributed.run"]
_VALUED = {"--nnodes", "--nproc-per-node", "--nproc_per_node", "--master-addr", "--master_addr", "--master-port",
           "--master_port"}


def parse(cmd: list) -> tuple[int, str, int, list] | None:
    """(ranks, master address, master port, the rank command) of a single-node torchrun command, or None."""
    cmd = [str(c) for c in cmd]
    if cmd[1:3] != _MODULE:
        return None
    opts, i = {}, 3
    while i < len(cmd) and cmd[i].startswith("--"):
        key, eq, value = cmd[i].partition("=")
        if key not in _VALUED:
            return None
        if not eq:
            i += 1
            if i >= len(cmd):
                return None
            value = cmd[i]
        opts[key.replace("_", "-")] = value
        i += 1
    if i >= len(cmd) or opts.get("--nnodes", "1") != "1" or "--master-port" not in opts:
        return None
    nproc = opts.get("--nproc-per-node", "1")
    if not nproc.isdigit() or int(nproc) < 1:
        return None
    return int(nproc), opts.get("--master-addr", "127.0.0.1"), int(opts["--master-port"]), \
        [cmd[0], "-u"] + cmd[i:]


def run(cmd: list, env: dict | None = None, timeout: float | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, stdout=PIPE, stderr=STDOUT)`` of a torchrun command, its ranks started here (see the
    module's docstring); return code 0 when every rank exits 0, else 1 as torchrun's (the output's last line names
    the rank that failed first). ``subprocess.TimeoutExpired`` after ``timeout`` s, the ranks killed."""
    parsed = None if os.environ.get("ZCKPT_TEST_TORCHRUN") else parse(cmd)  # (=1: torchrun itself, to compare)
    if parsed is None:
        return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                              cwd=cwd)
    n, addr, port, argv = parsed
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                 "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(n),
                 "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                 "TORCHELASTIC_MAX_RESTARTS": "0"})
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # (no agent: rank 0 hosts the store)
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryFile() as out:
        procs = []
        try:
            for r in range(n):
                renv = dict(base, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r))
                procs.append(subprocess.Popen(argv, env=renv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                              start_new_session=True))
            codes, first = _wait(procs, deadline)
        except BaseException:  # (Ctrl-C, a rank that could not start: none is left running)
            _stop(procs)
            raise
        if codes is None:
            out.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read())
        failed = [(r, c) for r, c in enumerate(codes) if c != 0]
        if failed:
            r = first if first is not None else failed[0][0]
            out.write((f"\nranks.run: rank {r} exited {codes[r]}" + (", the other ranks stopped" if first is not None
                                                                    and len(procs) > 1 else "") + "\n").encode())
        out.seek(0)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, out.read(), None)


def _wait(procs: list, deadline: float | None) -> tuple[list | None, int | None]:
    """(every rank's exit code, the rank that failed while others ran: they were stopped, as torchrun does), or
    (None, None) at the deadline."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, None
        bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if bad is not None:
            _stop(procs)
            return [p.wait() for p in procs], bad
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            return None, None
        time.sleep(0.02)


def _stop(procs: list, grace: float = 5.0) -> None:
    """SIGTERM to each running rank's process group, SIGKILL to what is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for p in procs:
        p.wait()


if __name__ == "__main__":  # python tests/ranks.py <torchrun's arguments>: as torchrun, for a quick try
    res = run([sys.executable] + _MODULE + sys.argv[1:])
    sys.stdout.buffer.write(res.stdout)
    sys.exit(res.returncode)
