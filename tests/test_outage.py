"""``zckpt push`` to a destination that cannot be reached, with real servers on loopback: the SeaweedFS S3 server
of :mod:`tests.s3server` (behind the proxy of :mod:`tests.faultproxy`, whose port can be closed and opened again)
and the Hub stand-in of :mod:`tests.hubserver`.

With the defaults, a push to a server that refuses connections gives up within tens of seconds, after the first
checkpoint, with exit status 75 and one line naming the server and what to do; nothing is marked complete there;
a later run with the server up pushes everything (compared file by file with what the server stored). ``--every``
goes on across an outage, says each failed run in one line (the retry notice once per outage), and pushes once the
server is back. huggingface_hub's log lines are printed once, through zckpt's handler.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.test_push import local_files, write_tag, write_trainer_checkpoint

pytest_plugins = ["tests.s3server", "tests.hubserver"]

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "zckpt-manifest.json"
SIDE = (MANIFEST, ".zckpt-push.json")
EXIT_NETWORK = 75
REPO = "me/run1"


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "ZCKPT_"))}
    env.update({"PYTHONPATH": str(ROOT), "ZCKPT_CACHE_DIR": str(tmp_path / "zckpt-cache"), "COLUMNS": "200"})
    env.update(extra)
    return env


def _s3_env(server, tmp_path, endpoint: str, **extra) -> dict:
    return _env(tmp_path, **{**server.env(), "AWS_ENDPOINT_URL": endpoint, **extra})


def _hub_env(hub, tmp_path, endpoint: str | None = None) -> dict:
    env = hub.env(_env(tmp_path, HF_HOME=str(tmp_path / "hf-home")))
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def _zckpt(env, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "zckpt", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("zckpt: error:")]


def _trainer_run(tmp_path, steps=(2, 4, 6)) -> Path:
    src = tmp_path / "out"
    for step in steps:
        write_trainer_checkpoint(src, step, ws=2, payload=20_000)
    return src


def _s3_files(server, prefix: str) -> dict[str, str]:
    """``{path below prefix: sha256}`` of what the S3 server stored."""
    return {k[len(prefix) + 1:]: hashlib.sha256(server.get(k)).hexdigest() for k in server.keys(prefix + "/")}


def _same_as_local(stored: dict[str, str], src: Path, names) -> None:
    """What arrived, file by file, is what SRC holds; every checkpoint has its manifest, listing those files."""
    for name in names:
        there = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + "/")}
        assert MANIFEST in there, (name, sorted(there))
        assert {k: v for k, v in there.items() if k not in SIDE} == local_files(src / name), name


def _figures(name: str, **values) -> None:
    print(f"\nFIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


class _Lines:
    """The stderr of a running process, line by line, as it comes."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(list(self.lines)):
                return True
            time.sleep(0.05)
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ============================================================================================ S3


@pytest.mark.slow
def test_s3_refused_fails_fast_after_the_first_checkpoint(s3_server, tmp_path):
    """Connections refused, default --retries: one checkpoint tried for about 20 s (botocore's own retries
    included), the other two not tried; exit 75, one line naming the endpoint; nothing at DEST. The same command
    with the server up pushes all three, identical file by file."""
    src = _trainer_run(tmp_path)
    prefix = f"outage-{uuid.uuid4().hex[:10]}"
    dest = s3_server.url(prefix)
    port = _closed_port()
    started = time.monotonic()
    run = _zckpt(_s3_env(s3_server, tmp_path, f"http://127.0.0.1:{port}"), "push", str(src), dest, "--settle", "0",
                 "--json")
    took = time.monotonic() - started
    assert run.returncode == EXIT_NETWORK, run.stderr
    [line] = _error_lines(run.stderr)
    assert f"{dest}/checkpoint-6: S3 endpoint http://127.0.0.1:{port} unreachable (connection refused)" in line, line
    assert "stopped, 2 more checkpoints not tried" in line and "run again when it is back" in line, line
    notices = [x for x in run.stderr.splitlines() if x.startswith("zckpt: WARNING:")]
    assert len(notices) == 1 and "retrying for up to" in notices[0], run.stderr  # once, not once per retry
    assert 15 < took < 60, took  # about UNREACHABLE_AFTER (20 s) plus one request's own retries
    doc = json.loads(run.stdout)
    assert doc["error"]["type"] == "EndpointUnreachable" and doc["error"]["exit_code"] == EXIT_NETWORK
    assert [(c["name"], c["status"]) for c in doc["result"]["checkpoints"]] == [
        ("checkpoint-6", "failed"), ("checkpoint-4", "not-tried"), ("checkpoint-2", "not-tried")]
    assert not s3_server.keys(prefix + "/")

    again = _zckpt(_s3_env(s3_server, tmp_path, s3_server.endpoint), "push", str(src), dest, "--settle", "0",
                   "--json")
    assert again.returncode == 0, again.stderr
    assert {c["status"] for c in json.loads(again.stdout)["checkpoints"]} == {"pushed"}
    _same_as_local(_s3_files(s3_server, prefix), src, ["checkpoint-2", "checkpoint-4", "checkpoint-6"])
    _figures("s3-refused", gave_up_s=round(took, 1), tried=1, not_tried=2)


def test_s3_refused_with_no_retries_and_dns_failure(s3_server, tmp_path):
    """--retries 0 is honoured (one request; here botocore's own retries are off too); a host name that does not resolve is said
    as such. Both exit 75 and leave nothing at DEST, a save folder's `latest` included."""
    src = tmp_path / "ds"
    write_tag(src / "global_step3", 3)
    (src / "latest").write_text("global_step3")
    prefix = f"outage-{uuid.uuid4().hex[:10]}"
    dest = s3_server.url(prefix)
    port = _closed_port()
    started = time.monotonic()
    run = _zckpt(_s3_env(s3_server, tmp_path, f"http://127.0.0.1:{port}", AWS_MAX_ATTEMPTS="1"), "push", str(src),
                 dest, "--settle", "0", "--retries", "0")
    took = time.monotonic() - started
    assert run.returncode == EXIT_NETWORK, run.stderr
    [line] = _error_lines(run.stderr)
    assert "unreachable (connection refused)" in line and "not tried" not in line, line
    assert "WARNING" not in run.stderr  # no retry: no notice
    assert took < 15, took
    dns = _zckpt(_s3_env(s3_server, tmp_path, "http://no-such-host.invalid:8333", AWS_MAX_ATTEMPTS="1"), "push",
                 str(src), dest, "--settle", "0", "--retries", "1")
    assert dns.returncode == EXIT_NETWORK, dns.stderr
    [line] = _error_lines(dns.stderr)
    assert "S3 endpoint http://no-such-host.invalid:8333 unreachable (host name not resolved)" in line, line
    assert "check the host name" in line, line
    assert not s3_server.keys(prefix + "/")


def test_s3_every_goes_on_across_an_outage(s3_server, tmp_path):
    """`push --every 1s` started while the server's port is closed: each failed run is one error line (the retry
    notice once for the whole outage, not per run or per request), the loop goes on, and once the port opens the
    next run pushes everything, identical file by file."""
    src = _trainer_run(tmp_path, steps=(2, 4))
    prefix = f"outage-{uuid.uuid4().hex[:10]}"
    dest = s3_server.url(prefix)
    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port), mirror=False).start()
    proxy.down()
    went_down = time.monotonic()
    env = _s3_env(s3_server, tmp_path, proxy.endpoint, AWS_MAX_ATTEMPTS="1")  # botocore: one try per request
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(src), dest, "--every", "1s", "--settle",
                             "0", "--retries", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = _Lines(proc.stderr)
    try:
        failed_runs = lambda lines: sum(x.startswith("zckpt: error:") for x in lines)  # noqa: E731
        assert err.wait_for(lambda lines: failed_runs(lines) >= 3, 60), err.lines
        proxy.up()
        back = time.monotonic()
        deadline = back + 60
        while time.monotonic() < deadline and not all(
                f"{prefix}/checkpoint-{s}/{MANIFEST}" in s3_server.keys(f"{prefix}/checkpoint-{s}/") for s in (2, 4)):
            time.sleep(0.2)
        pushed_after = time.monotonic() - back
    finally:
        _stop(proc)
        proxy.stop()
    out = proc.stdout.read()
    err.thread.join(10)
    lines = err.lines
    assert "Traceback" not in "\n".join(lines), lines
    errors = [x for x in lines if x.startswith("zckpt: error:")]
    assert len(errors) >= 3 and all(f"S3 endpoint {proxy.endpoint} unreachable (connection refused)" in x
                                    and x.endswith("(trying again next run)") for x in errors), errors
    warnings = [x for x in lines if x.startswith("zckpt: WARNING:")]
    assert len(warnings) == 1 and "retrying for up to" in warnings[0], lines  # once for the whole outage
    others = {x for x in lines if x not in errors and x not in warnings}
    assert others <= {"zckpt: stopped", "zckpt: interrupted"} or (
        len(others - {"zckpt: stopped"}) == 1 and list(others - {"zckpt: stopped"})[0].endswith(
            "not finished (no manifest at DEST); run again to resume")), lines
    assert "checkpoint-4: pushed" in out and "checkpoint-2: pushed" in out, out
    _same_as_local(_s3_files(s3_server, prefix), src, ["checkpoint-2", "checkpoint-4"])
    _figures("s3-every-outage", failed_runs=len(errors), pushed_s_after_back=round(pushed_after, 1),
             outage_s=round(back - went_down, 1))


# ============================================================================================ the Hub


@pytest.mark.slow
def test_hub_refused_fails_fast_then_a_later_run_pushes_everything(hub_server, tmp_path):
    """The Hub's port closed: huggingface_hub's own retries (23 s) are the whole wait; one checkpoint tried,
    exit 75, one line naming the Hub; none of huggingface_hub's retry notes at the default verbosity (each once,
    as zckpt's INFO lines, with -v). With the Hub up, the same command pushes everything, identical file by
    file."""
    hub = hub_server
    src = _trainer_run(tmp_path)
    port = _closed_port()
    started = time.monotonic()
    run = _zckpt(_hub_env(hub, tmp_path, f"http://127.0.0.1:{port}"), "push", str(src), f"hf://{REPO}",
                 "--settle", "0", "-v")
    took = time.monotonic() - started
    assert run.returncode == EXIT_NETWORK, run.stderr
    [line] = _error_lines(run.stderr)
    assert f"hf://{REPO}: the Hub at http://127.0.0.1:{port} unreachable (connection refused)" in line, line
    assert "stopped, 2 more checkpoints not tried" in line, line
    assert took < 60, took
    lines = run.stderr.splitlines()
    notes = [x for x in lines if "thrown while requesting" in x or "Retrying in" in x]
    assert notes and all(x.startswith("zckpt: INFO: ") for x in notes), lines  # through zckpt's handler only
    retries = [x.split("[Retry ")[1] for x in notes if "Retrying in" in x]
    assert sorted(retries) == [f"{i}/5]." for i in range(1, 6)], notes  # one request, each retry said once
    assert not [x for x in lines if x and not x.startswith("zckpt: ")], lines  # nothing printed bare (twice)
    assert hub.requests == [] and hub.files(REPO) == {}

    again = _zckpt(_hub_env(hub, tmp_path), "push", str(src), f"hf://{REPO}", "--settle", "0")
    assert again.returncode == 0, again.stderr
    files = hub.files(REPO)
    stored = {p: hashlib.sha256(data).hexdigest() for p, data in files.items()}
    _same_as_local(stored, src, ["checkpoint-2", "checkpoint-4", "checkpoint-6"])
    _figures("hub-refused", gave_up_s=round(took, 1), tried=1, not_tried=2)


def test_hub_every_rides_out_a_short_outage(hub_server, tmp_path):
    """`push --every` started while the Hub is down for a few seconds: huggingface_hub's own retries wait it out
    without a line at the default verbosity (its retry notes are INFO), and the checkpoint is committed once."""
    hub = hub_server
    src = _trainer_run(tmp_path, steps=(2,))
    hub.down()
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(src), f"hf://{REPO}", "--every", "1s",
                             "--settle", "0"], cwd=ROOT, env=_hub_env(hub, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = _Lines(proc.stderr)
    try:
        time.sleep(2.5)
        hub.up()
        back = time.monotonic()
        deadline = back + 60
        while time.monotonic() < deadline and f"checkpoint-2/{MANIFEST}" not in hub.files(REPO):
            time.sleep(0.2)
        pushed_after = time.monotonic() - back
        time.sleep(1.5)  # another run or two: up to date, nothing sent
    finally:
        _stop(proc)
    out = proc.stdout.read()
    err.thread.join(10)
    assert "Traceback" not in "\n".join(err.lines), err.lines
    assert [x for x in err.lines if x.startswith(("zckpt: WARNING", "zckpt: error"))] == [], err.lines
    assert not [x for x in err.lines if "Retrying in" in x or "thrown while requesting" in x], err.lines
    assert out.count("checkpoint-2: pushed") == 1, out
    assert [c.title for c in hub.repo(REPO).commits[1:]] == ["zckpt push: checkpoint-2 (step 2)"]
    stored = {p: hashlib.sha256(data).hexdigest() for p, data in hub.files(REPO).items()}
    _same_as_local(stored, src, ["checkpoint-2"])
    _figures("hub-every-outage", pushed_s_after_back=round(pushed_after, 1))


def test_hub_log_lines_are_printed_once(tmp_path):
    """huggingface_hub's logger has its own stderr handler (added when it is imported) and its records also reach
    zckpt's: under the CLI each line is printed once, as zckpt's, and -q silences it; its per-request retry notes
    are INFO (shown with -v)."""
    code = (
        "import logging, sys\n"
        "from zckpt.cli._common import Settings, configure_logging, logging_state, restore_logging\n"
        "state = logging_state()\n"
        "configure_logging(Settings(verbose=int(sys.argv[1]), quiet=sys.argv[2] == 'q'))\n"
        "from huggingface_hub.utils import logging as hl\n"
        "log = hl.get_logger('huggingface_hub.utils._http')\n"
        "log.warning('a warning of the client')\n"
        "log.warning(\"'[Errno 111] Connection refused' thrown while requesting GET http://x/api\")\n"
        "log.warning('Retrying in 1s [Retry 1/5].')\n"
        "restore_logging(state)\n"
        "print(len(logging.getLogger('huggingface_hub').handlers))\n")

    def run(verbose, quiet=""):
        r = subprocess.run([sys.executable, "-c", code, str(verbose), quiet or "-"], cwd=ROOT, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "1"  # its own handler is back once the command is over
        return r.stderr.splitlines()

    assert run(0) == ["zckpt: WARNING: a warning of the client"]
    assert run(1) == ["zckpt: WARNING: a warning of the client",
                      "zckpt: INFO: '[Errno 111] Connection refused' thrown while requesting GET http://x/api",
                      "zckpt: INFO: Retrying in 1s [Retry 1/5]."]
    assert run(0, "q") == []
