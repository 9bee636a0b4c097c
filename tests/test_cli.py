"""The command line: every command through click's runner, one-line errors, no torch at start-up, fresh docs."""

from __future__ import annotations

import json
import shutil
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


def test_the_program_gives_openblas_one_thread_unless_told():
    """zckpt never asks numpy for matrix work: the program starts numpy's OpenBLAS with one thread (its default, a
    spinning thread per CPU, cost convert 7-9% of its CPU); a user's own OPENBLAS_NUM_THREADS is kept."""
    code = ("import os, sys; sys.argv = ['zckpt', '--version']; import zckpt.__main__ as m\n"
            "try:\n    m.run()\nexcept SystemExit:\n    pass\n"
            "import numpy; print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')), file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stderr.split() == ["1", "1"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**env, "OPENBLAS_NUM_THREADS": "3"})
    assert out.stderr.split()[0] == "3", out.stderr


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
    assert d["zero_stage"] in (0, 1, 2, 3) and d["dp_world_size"] >= 1 and d["parameters"] > 0
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
    from zckpt.encoding import safeload
    obj = safeload.load(str(f))
    t = obj["optimizer_state_dict"].get("single_partition_of_fp32_groups", obj["optimizer_state_dict"].get(
        "fp32_flat_groups"))[0]
    data = bytearray(f.read_bytes())
    data[t.byte_offset + 1] ^= 0x10
    f.write_bytes(bytes(data))
    assert run("verify", str(ck)).exit_code == 0  # metadata is intact
    res = run("verify", str(ck), "--deep", "--quiet")  # a failure: one error line on stderr, nothing on stdout
    assert res.exit_code == 1 and res.stdout == "" and res.stderr.count("\n") == 1, res.output
    line = res.stderr
    assert line.startswith(f"zckpt: error: {ck}: NOT consistent: ") and "CRC" in line
    assert "copy it again" in line and "--tag" in line  # says what to do next
    res = run("verify", str(ck), "--deep", "-v")  # -v: the checklist
    assert res.exit_code == 1 and "CRC" in res.stdout
    bad = next(line for line in res.stdout.splitlines() if line.startswith("BAD"))
    assert "copy it again" in bad and "--tag" in bad
    doc = json.loads(run("verify", str(ck), "--deep", "--json").stdout)  # (stderr: the one line)
    crc = next(c for c in doc["checks"] if not c["ok"])
    assert "copy it again" in crc["hint"] and "--tag" in crc["hint"]  # flags, as the error objects name them


def test_merge_cli(tmp_path, ckpt_path):
    out = tmp_path / "m"
    # a parameter in no group with another's bytes (z2_bf16_ws2_twin) is said to be one of its own: the flag, once
    ties = [a for a, _ in json.loads(run("info", str(ckpt_path), "--json").output).get("ambiguous_ties") or []]
    if ties:
        res = run("merge", str(ckpt_path), "-o", str(out))
        assert res.exit_code == 1 and f"--no-tie {ties[0]}" in res.stderr and not out.exists()
    res = run("merge", str(ckpt_path), "-o", str(out), "--dtype", "bf16", "--json",
              *[x for a in ties for x in ("--no-tie", a)])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["dtype"] == "bf16" and (out / "model.safetensors").exists()  # as the flag spells it
    assert d["tag"] == json.loads(run("info", str(ckpt_path), "--json").output)["tag"]  # the tag it read
    res = run("merge", str(ckpt_path), "-o", str(out), *[x for a in ties for x in ("--no-tie", a)])
    assert res.exit_code == 1 and str(out) in res.stderr and "--overwrite" in res.stderr  # refused, says how


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

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
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
    code = ("import sys; from zckpt.ops.merge import merge; "
            f"merge({str(ckpt)!r}, {str(tmp_path / 'out')!r}); "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_casts_import_numpy_before_the_writing_threads_start(tmp_path):
    """A down-casting job imports what its casts need before any job runs (``Worker.prepare``): the writing threads'
    first casts do not all wait on one import. Every job sees numpy (and, for bf16, ml_dtypes) already there."""
    from tests.conftest import FIXTURES
    ckpt = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    for dtype, module in (("fp16", "numpy"), ("bf16", "ml_dtypes")):
        code = ("import sys; from zckpt.engine import executor; seen = []; write = executor.Worker.write\n"
                "from zckpt.encoding import casting; casting.ML_SLOW_FROM = 0  # ml_dtypes' import paying\n"
                "def spy(self, *a, **k):\n"
                f"    seen.append({module!r} in sys.modules); return write(self, *a, **k)\n"
                "executor.Worker.write = spy\n"
                "from zckpt.engine import mapped; mapped_write = mapped.write  # (the jobs a map takes)\n"
                "def spy_mapped(*a, **k):\n"
                f"    ready = {module!r} in sys.modules; got = mapped_write(*a, **k)\n"
                "    seen.extend([ready] if got is not None else []); return got\n"
                "mapped.write = spy_mapped\n"
                "from zckpt.ops.merge import merge\n"
                f"merge({str(ckpt)!r}, {str(tmp_path / dtype)!r}, dtype={dtype!r}); print(len(seen), all(seen))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        jobs, before = out.split()
        assert int(jobs) > 1 and before == "True", (dtype, out)


# ------------------------------------------------------------------------------ one vocabulary: flags and errors

def invoke(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_global_flags_before_or_after_the_command(tmp_path):
    ckpt = str(checkpoint_path(FIXTURE_DIRS[0]))
    after, before = invoke("info", ckpt, "--json"), invoke("--json", "info", ckpt)
    assert after.exit_code == before.exit_code == 0
    assert json.loads(after.stdout) == json.loads(before.stdout)
    for cmd in (["info", ckpt], ["verify", ckpt], ["merge", ckpt, "--dry-run", "-o", str(tmp_path / "o")],
                ["reshard", ckpt, "-w", "1", "--dry-run", "-o", str(tmp_path / "r")],
                ["estimate", "--params", "8B", "--largest-layer", "600M"]):
        for flags in (["-q"], ["--json"], ["-v"], ["--debug"], ["-q", "--json"]):
            a, b = invoke(*cmd, *flags), invoke(*flags, *cmd)
            assert a.exit_code == b.exit_code == 0, (cmd, flags, a.output, b.output)
            assert a.stdout == b.stdout or "seconds" in a.stdout, (cmd, flags)
    # --debug after the command shows the traceback too
    proc = subprocess.run([sys.executable, "-m", "zckpt", "info", str(tmp_path / "nope"), "--debug"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_quiet_is_silent_on_success_and_still_reports_failures(tmp_path):
    ckpt = str(checkpoint_path(FIXTURE_DIRS[0]))
    for make in (lambda o: ["verify", ckpt], lambda o: ["merge", ckpt, "-o", o],
                 lambda o: ["reshard", ckpt, "-w", "1", "-o", o]):
        cmd = make(str(tmp_path / "quiet"))
        res = invoke(*cmd, "-q")
        assert res.exit_code == 0 and res.output == "", (cmd, res.output)
        assert invoke(*make(str(tmp_path / "loud"))).output != ""  # not quiet: it does say something
        for out in ("quiet", "loud"):
            shutil.rmtree(tmp_path / out, ignore_errors=True)
    res = invoke("verify", str(tmp_path / "nope"), "-q")
    assert res.exit_code == 1 and res.stderr.startswith("zckpt: error:")


@pytest.mark.parametrize("cmd", ["info", "verify", "merge", "reshard"])
def test_json_errors_are_one_object_on_stdout(tmp_path, cmd):
    extra = {"merge": ["-o", str(tmp_path / "o")], "reshard": ["-w", "1", "-o", str(tmp_path / "o")]}.get(cmd, [])
    res = invoke(cmd, str(tmp_path / "missing"), *extra, "--json")
    assert res.exit_code == 1
    (line,) = res.stdout.splitlines()
    doc = json.loads(line)
    assert doc["ok"] is False and doc["command"] == cmd
    assert doc["error"]["type"] == "CheckpointNotFound" and doc["error"]["path"] == str(tmp_path / "missing")
    assert doc["error"]["exit_code"] == 1 and doc["error"]["message"] in res.stderr
    # malformed command lines too (exit 2), --json before or after
    res = invoke("--json", cmd, "--no-such-flag")
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]["type"] == "UsageError"


def test_json_results_share_field_names(tmp_path):
    ckpt = str(checkpoint_path(FIXTURE_DIRS[0]))
    docs = {"info": invoke("info", ckpt, "--json"), "verify": invoke("verify", ckpt, "--json"),
            "merge": invoke("merge", ckpt, "--dry-run", "--json", "-o", str(tmp_path / "m")),
            "reshard": invoke("reshard", ckpt, "-w", "1", "--dry-run", "--json", "-o", str(tmp_path / "r"))}
    for name, res in docs.items():
        assert res.exit_code == 0, res.output
        (line,) = res.stdout.splitlines()
        doc = json.loads(line)
        assert doc["ok"] is True and doc["command"] == name and "path" in doc, name
        for f in doc.get("files", []):
            assert {"name", "bytes"} <= set(f), name
    assert json.loads(docs["merge"].stdout)["output"] == str(tmp_path / "m")


def test_same_bad_input_same_message_everywhere(tmp_path):
    ckpt = str(checkpoint_path(FIXTURE_DIRS[0]))
    out = str(tmp_path / "o")
    errors, docs = set(), []
    args = {"info": [ckpt], "verify": [ckpt], "merge": [ckpt, "-o", out, "--dry-run"],
            "reshard": [ckpt, "-w", "1", "-o", out, "--dry-run"], "push": [str(tmp_path), str(tmp_path / "d")],
            "convert": [ckpt, "--to", "dcp", "-o", out, "--dry-run"], "diff": [ckpt, ckpt]}
    having = [name for name in COMMANDS
              if any("--storage-option" in p.opts for p in main.get_command(None, name).params)]
    assert set(having) == set(args), having  # every command that takes --storage-option is checked here
    for name in having:
        for bad in ("oops", "=value"):
            res = invoke(name, *args[name], "--storage-option", bad)
            assert res.exit_code == 1, (name, res.output)  # a value zckpt reads and refuses, as --max-shard-size banana
            assert res.stderr.count("\n") == 1 and res.stderr.startswith("zckpt: error: --storage-option")
            assert "internal error" not in res.stderr and "Usage:" not in res.stderr
            errors.add(res.stderr.replace(repr(bad), "BAD"))
        res = invoke(name, *args[name], "--storage-option", "oops", "--json")
        (line,) = res.stdout.splitlines()
        docs.append(json.loads(line))
        assert res.exit_code == 1 and docs[-1]["command"] == name
    assert len(errors) == 1 and "KEY=VALUE" in errors.pop()
    assert all(d["error"] == docs[0]["error"] for d in docs)
    assert docs[0]["error"]["type"] == "InvalidArgument" and docs[0]["error"]["exit_code"] == 1
    missing = {invoke(*cmd).stderr for cmd in (["info", str(tmp_path / "x")], ["verify", str(tmp_path / "x")],
                                               ["merge", str(tmp_path / "x"), "-o", out],
                                               ["reshard", str(tmp_path / "x"), "-w", "1", "-o", out],
                                               ["convert", str(tmp_path / "x"), "--to", "dcp", "-o", out])}
    assert len(missing) == 1 and str(tmp_path / "x") in missing.pop()


def test_unwritable_output_names_the_users_path(tmp_path):
    ckpt = str(checkpoint_path(FIXTURE_DIRS[0]))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for cmd in (["merge", ckpt], ["reshard", ckpt, "-w", "1"]):
        res = invoke(*cmd, "-o", str(blocker / "out"))
        assert res.exit_code == 1 and str(blocker / "out") in res.stderr, res.output
        assert "zckpt-tmp" not in res.stderr and "-o" in res.stderr


def test_a_tilde_the_shell_left_is_the_home_folder(tmp_path, monkeypatch):
    """``--output=~/model`` (bash expands no ``~`` after ``=``) and quoted paths: the home folder, as the shell would
    have said it; it made a folder named ``~`` in the current one (which ``rm -rf ~`` then "cleans up")."""
    from tests.conftest import FIXTURES
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    shutil.copytree(checkpoint_path(FIXTURES / "trainer"), home / "ck")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    for cmd in (["merge", "~/ck", "--output=~/m"], ["reshard", "~/ck", "-w", "1", "--output=~/r"],
                ["convert", "~/ck", "-o", "~/c"], ["push", "~/ck", "~/p", "--settle", "0"], ["info", "~/ck"],
                ["verify", "~/ck"], ["estimate", "~/ck"]):
        res = run(*cmd, "--json")
        assert res.exit_code == 0, (cmd, res.output)
    assert list(cwd.iterdir()) == []
    assert (home / "m" / ".zckpt.json").exists() and (home / "r" / ".zckpt.json").exists()
    assert (home / "c" / ".zckpt.json").exists() and (home / "p").is_dir()
    assert json.loads(run("info", "~/ck", "--json").output)["path"] == str(home / "ck")


def test_an_empty_path_is_refused(tmp_path, monkeypatch):
    """``zckpt push ckpt "$DEST"`` with DEST unset: an empty path is refused, naming it (push wrote the checkpoint
    into the current folder, then failed with an internal error; -o "" said ".: No such file or directory")."""
    from tests.conftest import FIXTURES
    ck = str(checkpoint_path(FIXTURES / "trainer"))
    monkeypatch.chdir(tmp_path)
    for cmd, flag in ((["push", ck, ""], "DEST"), (["push", "", "d"], "SRC"), (["merge", ck, "-o", ""], "-o"),
                      (["reshard", ck, "-w", "1", "-o", ""], "-o"), (["convert", ck, "-o", ""], "-o"),
                      (["info", ""], "PATH"), (["verify", ""], "PATH"), (["merge", "", "-o", "m"], "PATH"),
                      (["estimate", "--config", ""], "--config"), (["estimate", ""], "[PATH]")):
        _one_line_error(invoke(*cmd), 1, f"{flag}: an empty path", "variable that is not set")
        res = invoke(*cmd, "--json")
        assert json.loads(res.stdout)["error"]["type"] == "InvalidArgument", res.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["empty", "half"])
def test_a_truncated_dcp_metadata_is_one_line(tmp_path, damage):
    """A DCP folder whose .metadata was cut short (a copy that stopped): one line naming it, what to do, exit 1 in
    every command that reads it (it was "internal error: KeyError: <class '...Truncated'>")."""
    from tests.conftest import FIXTURES
    dcp = tmp_path / "dcp"
    assert invoke("convert", str(checkpoint_path(FIXTURES / "trainer")), "-o", str(dcp), "-q").exit_code == 0
    meta = dcp / "pytorch_model_fsdp_0" / ".metadata"
    meta.write_bytes(b"" if damage == "empty" else meta.read_bytes()[: meta.stat().st_size // 2])
    for cmd in (["info", str(dcp)], ["verify", str(dcp)], ["merge", str(dcp), "-o", str(tmp_path / "m")],
                ["convert", str(dcp), "--to", "deepspeed", "--world-size", "1", "--stage", "2", "--dtype", "bf16", "--buffers",
                 "", "-o", str(tmp_path / "d")]):
        res = invoke(*cmd)
        if cmd[0] == "verify":  # verify reports it as a failed check, exit 1
            assert res.exit_code == 1 and "internal error" not in res.output, res.output
            continue
        _one_line_error(res, 1, str(meta), "damaged")
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()


def test_push_into_its_own_source_says_what_to_do(tmp_path):
    from tests.conftest import FIXTURES
    src = tmp_path / "ck"
    shutil.copytree(checkpoint_path(FIXTURES / "trainer"), src)
    res = invoke("push", str(src), str(src / "backup"), "--settle", "0")
    _one_line_error(res, 1, "DEST: must not be inside SRC", "(choose a DEST outside SRC)")
    assert not (src / "backup").exists()


def test_error_table_scratch_names_become_the_output():
    from zckpt.cli._errors import describe
    err = describe(FileNotFoundError(2, "No such file or directory", "/data/.model.zckpt-tmp-123-abcd/x.bin"))
    assert err.path == "/data/model/x.bin" and "zckpt-tmp" not in err.message and "-o" in err.message
    err = describe(PermissionError(13, "Permission denied", "/data/out"), output="/data/out")
    assert err.message.startswith("/data/out: cannot write the output here")
    # a file being written into place by push (zckpt.io.storage): named as the file the user will see
    err = describe(OSError(30, "Read-only file system", "/mnt/ro/.zero_to_fp32.py.11bae98f.tmp"))
    assert err.path == "/mnt/ro/zero_to_fp32.py" and ".tmp" not in err.message, err
    assert describe(OSError(2, "x", "/d/.hidden.tmp")).path == "/d/.hidden.tmp"  # not a scratch name: as it is
    # a failed write names no file: the output it was for is named (it said only "No space left on device")
    for code, words in ((28, "disk is full"), (27, "ulimit -f")):
        err = describe(OSError(code, os.strerror(code)), output="model/")
        assert err.path == "model/" and err.message.startswith("model/: cannot write the output here: "), err
        assert words in err.message and "-o" in err.message, err
    assert describe(OSError(28, os.strerror(28))).path is None  # no output to name (push names its own files)
    assert describe(RuntimeError("boom")).message.startswith("internal error: RuntimeError: boom")
    assert describe(ModuleNotFoundError("No module named 's3fs'", name="s3fs")).exit_code == 1


# ------------------------------------------------------------------------------ push: only transient errors retry

def test_retryable_only_transient():
    import errno as E
    from zckpt.backup.faults import retryable
    from zckpt.errors import StorageError

    def wrapped(cause):
        try:
            try:
                raise cause
            except BaseException as exc:
                raise StorageError("upload failed", path="s3://b/k") from exc
        except StorageError as exc:
            return exc

    class NoCredentialsError(Exception):
        pass

    class Response:
        def __init__(self, code):
            self.status_code = code

    def http(code):
        exc = OSError("http error")
        exc.response = Response(code)
        return exc

    assert retryable(wrapped(ConnectionResetError(E.ECONNRESET, "reset")))
    assert retryable(wrapped(TimeoutError("timed out")))
    assert retryable(http(503)) and retryable(http(429)) and retryable(http(408))
    for permanent in (ValueError("Protocol not known: foo"), ImportError("No module named 's3fs'"),
                      NoCredentialsError("Unable to locate credentials"), PermissionError(E.EACCES, "denied"),
                      FileNotFoundError(E.ENOENT, "no such bucket"), OSError(E.ENOSPC, "disk full")):
        assert not retryable(wrapped(permanent)), permanent
    assert not retryable(http(403)) and not retryable(http(404))


def _push_cli(src, dest, *extra, env=None):
    t0 = time.monotonic()
    env = {k: v for k, v in dict(os.environ, ZCKPT_DEBUG="", **(env or {})).items() if v is not None}
    proc = subprocess.run([sys.executable, "-m", "zckpt", "push", str(src), dest, "--settle", "0", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    return proc, time.monotonic() - t0


def test_push_permanent_errors_fail_at_once_and_are_said_once(tmp_path):
    from tests.test_push import write_trainer_checkpoint
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    proc, seconds = _push_cli(src, "foo://bucket/run")
    assert proc.returncode == 1 and seconds < 20, (seconds, proc.stderr)
    assert "retry" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr  # said once
    assert proc.stderr.startswith("zckpt: error:") and proc.stdout == ""
    proc, _ = _push_cli(src, "foo://bucket/run", "--json")
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["error"]["type"] == "StorageError"
    assert doc["result"]["checkpoints"][0]["status"] == "failed"


def test_push_without_credentials_or_permission_is_not_retried(s3_server, tmp_path):
    from tests.test_push import write_trainer_checkpoint
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    clean = {k: None for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                               "AWS_DEFAULT_PROFILE")}
    clean.update(AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                 AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=s3_server.endpoint)
    for extra in ([], ["--storage-option", "key=wrong", "--storage-option", "secret=wrong"]):
        proc, seconds = _push_cli(src, s3_server.url(f"cli-{time.time_ns()}"), *extra, env=clean)
        assert proc.returncode == 1 and seconds < 30, (extra, seconds, proc.stderr)
        assert "retry" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("zckpt: error:") and "internal error" not in proc.stderr


def test_reshard_reports_file_sizes_as_info_does(tmp_path):
    from tests.conftest import FIXTURES
    out = tmp_path / "r"
    res = invoke("reshard", str(checkpoint_path(FIXTURES / "z3_bf16_ws2")), "-w", "2", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    info = json.loads(invoke("info", str(out), "--json").stdout)
    sizes = {f["name"].rsplit("/", 1)[-1]: f["bytes"] for f in doc["files"]}
    assert info["files"] and all(sizes[f["name"]] == f["bytes"] for f in info["files"])
    assert all(f["bytes"] == (out / f["name"]).stat().st_size for f in doc["files"])
    assert doc["total_bytes"] == sum(f["bytes"] for f in doc["files"])


# ------------------------------------------------------------------------ one error table: every bad input, one line

def _one_line_error(res, code, *words):
    assert res.exit_code == code, (code, res.exit_code, res.output)
    assert res.stdout == "" and res.stderr.count("\n") == 1 and res.stderr.startswith("zckpt: error: "), res.stderr
    assert "Usage:" not in res.stderr and "Traceback" not in res.stderr and "internal error" not in res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    return res.stderr


def test_click_usage_errors_and_bad_values_go_through_the_table(tmp_path):
    """click's own errors and zckpt's are said alike, one line naming the option: a value outside the range or
    choices its option lists in --help (--stage 4) is a usage error, exit 2, as a command line that cannot be read;
    a value zckpt reads and refuses (--max-shard-size banana) is exit 1 in every command; an option that does not
    apply (--once with --every) is exit 2."""
    ck = str(checkpoint_path(FIXTURE_DIRS[0]))
    out = str(tmp_path / "o")
    ranges = [  # (command line, words): exit 2, the flag first
        (["reshard", ck, "--world-size", "0", "-o", out], ["--world-size: 0 is not in the range", "zckpt reshard --help"]),
        (["reshard", ck, "-w", "1", "--stage", "0", "-o", out], ["--stage: 0 is not in the range 1<=x<=3"]),
        (["push", ck, str(tmp_path / "d"), "--every", "1m", "--once"], ["--once: does not apply here (--every 1m)"]),
        (["estimate", "--params", "8B", "--largest-layer", "1M", "--gpus", "0"], ["--gpus: 0 is not in the range"]),
        (["merge", ck, "--dtype", "fp8", "-o", out], ["--dtype: 'fp8' is not one of 'fp32', 'bf16', 'fp16'"]),
        (["push", ck, str(tmp_path / "d"), "--workers", "0"], ["--workers: 0 is not in the range"]),
        (["convert", ck, "--to", "deepspeed", "--world-size", "2", "--stage", "4", "-o", out],
         ["--stage: 4 is not in the range 1<=x<=3", "zckpt convert --help"]),
    ]
    for cmd, words in ranges:
        _one_line_error(invoke(*cmd), 2, *words)
    values = [  # (command line, words): exit 1, the flag first
        (["merge", ck, "--max-shard-size", "banana", "-o", out], ["--max-shard-size: cannot read 'banana'"]),
        (["push", ck, str(tmp_path / "d"), "--every", "0"], ["--every: must be more than zero"]),
        (["push", ck, str(tmp_path / "d"), "--every", "soon"], ["--every: cannot read 'soon'"]),
    ]
    for cmd, words in values:
        _one_line_error(invoke(*cmd), 1, *words)
    for cmd in (["push", ck, str(tmp_path / "d"), "--every", "0"], ["push", ck, str(tmp_path / "d"), "--every", "x"]):
        err = invoke(*cmd).stderr
        assert "examples: 90s, 30m, 2h, 1h30m)" in err and ", 0" not in err  # never offers what it refuses
    unreadable = [  # exit 2, with the usage
        (["push"], ["SRC: missing argument", "usage: zckpt push [OPTIONS] SRC DEST"]),
        (["push", ck], ["DEST: missing argument"]),
        (["info"], ["PATH: missing argument"]),
        (["merge", ck, "--no-such-flag"], ["No such option '--no-such-flag'", "zckpt merge --help"]),
        (["info", ck, "--tag"], ["'--tag' requires an argument"]),
        (["nosuchcommand"], ["No such command 'nosuchcommand'", "zckpt --help"]),
        (["info", ck, "extra"], ["unexpected extra argument"]),
    ]
    for cmd, words in unreadable:
        _one_line_error(invoke(*cmd), 2, *words)
    # a missing path is the same mistake in every command: exit 1, the path named
    for cmd in (["info", str(tmp_path / "x")], ["push", str(tmp_path / "x"), str(tmp_path / "d")],
                ["estimate", str(tmp_path / "x")], ["merge", str(tmp_path / "x"), "-o", out]):
        _one_line_error(invoke(*cmd), 1, f"{tmp_path / 'x'}: no such file or folder")
    # --json: the same, as one object
    res = invoke("reshard", ck, "-w", "0", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 and doc["error"]["type"] == "InvalidArgument" and doc["error"]["exit_code"] == 2
    res = invoke("merge", ck, "--max-shard-size", "banana", "-o", out, "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["error"]["type"] == "InvalidArgument" and doc["error"]["exit_code"] == 1
    res = invoke("push", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 and doc["error"]["type"] == "UsageError" and doc["command"] == "push"


def test_python_api_errors_name_parameters_and_the_cli_names_flags(tmp_path):
    import zckpt
    from zckpt.errors import InvalidArgument, CheckpointNotFound
    ck = str(checkpoint_path(FIXTURE_DIRS[0]))
    cases = [(lambda: zckpt.merge(ck, str(tmp_path / "o"), max_shard_size="banana"), InvalidArgument,
              "max_shard_size: cannot read 'banana'"),
             (lambda: zckpt.merge(ck, str(tmp_path / "o"), dtype="fp8"), InvalidArgument, "dtype: unknown dtype"),
             (lambda: zckpt.reshard(ck, str(tmp_path / "o"), world_size=0), InvalidArgument, "world_size: must be"),
             (lambda: zckpt.merge(ck, str(tmp_path / "o"), tag="global_step999"), CheckpointNotFound,
              "tag global_step999: no such tag folder")]
    for call, kind, words in cases:
        with pytest.raises(kind) as info:
            call()
        assert words in str(info.value) and "--" not in str(info.value), str(info.value)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("x")
    with pytest.raises(zckpt.OutputExists) as info:
        zckpt.merge(ck, str(tmp_path / "o"))
    assert "--" not in str(info.value) and "overwrite" in str(info.value)
    # the CLI says the same with its flags
    _one_line_error(invoke("merge", ck, "-o", str(tmp_path / "o")), 1, "choose another -o", "--overwrite")
    _one_line_error(invoke("merge", ck, "--tag", "global_step999", "-o", str(tmp_path / "p")), 1,
                    "--tag global_step999: no such tag folder")


def test_error_hints_name_the_commands_own_output():
    """push has no -o: a read-only or full DEST says DEST; merge says -o."""
    import errno as E
    from zckpt.cli._errors import command_names, describe
    push_names, merge_names = (command_names(main.get_command(None, n)) for n in ("push", "merge"))
    ro = OSError(E.EROFS, "Read-only file system", "/mnt/ro/run")
    assert describe(ro, None, push_names, "push").message.endswith("(the file system is read-only; choose another DEST)")
    assert describe(ro, None, merge_names, "merge").message.endswith("(the file system is read-only; choose another -o)")
    assert "choose another DEST" in describe(FileExistsError(E.EEXIST, "File exists", "/d"), None, push_names).message


def _mount_read_only(where: Path) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_read_only_outputs_say_what_to_do(tmp_path):
    """A read-only mount point as merge -o (EBUSY from the rename) and as push DEST: one line each, what to do."""
    from tests.test_push import write_trainer_checkpoint
    ro = tmp_path / "ro"
    if not _mount_read_only(ro):
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        ck = str(checkpoint_path(FIXTURE_DIRS[0]))
        err = _one_line_error(invoke("merge", ck, "-o", str(ro)), 1, str(ro), "read-only", "choose another -o")
        assert "Device or resource busy" not in err
        _one_line_error(invoke("merge", ck, "-o", str(ro / "sub")), 1, "read-only", "choose another -o")
        src = tmp_path / "out"
        for step in (2, 4):
            write_trainer_checkpoint(src, step)
        proc, _ = _push_cli(src, str(ro / "run"))
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr  # two checkpoints, said once
        assert "choose another DEST" in proc.stderr and "choose another -o" not in proc.stderr
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_part_size_is_for_s3_only(tmp_path):
    """--part-size is S3's multipart size (5 MiB minimum); for a folder it does not apply: exit 2, not ignored."""
    from tests.test_push import write_trainer_checkpoint
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    res = invoke("push", str(src), str(tmp_path / "d"), "--settle", "0", "--part-size", "1MB")
    _one_line_error(res, 2, "--part-size: does not apply here", "only with DEST an s3:// URL")
    res = invoke("push", str(src), "s3://bucket/run", "--settle", "0", "--part-size", "1MB")
    _one_line_error(res, 1, "--part-size: must be at least 5 MiB", "s3://")


# ------------------------------------------------------------------------------------ a reader that left

def _reader_gone(*args):
    """Run the ``zckpt`` program with stdout a pipe nobody reads any more (``zckpt ... | head -1`` once head has
    exited): every write to stdout fails with EPIPE. Returns (exit status, stderr)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "zckpt", *args], stdout=w, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, timeout=120, env=dict(os.environ, ZCKPT_DEBUG=""))
    finally:
        os.close(w)
    return proc.returncode, proc.stderr


def test_a_reader_that_left_is_not_a_failure(tmp_path):
    """``zckpt reshard ... | head -1``: the output is published; that nobody reads the report is not an error (it
    was "zckpt: error: Broken pipe", exit 1, after a complete reshard). The exit status stays the work's own."""
    from tests.conftest import FIXTURES
    ck = str(checkpoint_path(FIXTURES / "trainer"))
    for name, args, out in [("reshard", ["-w", "1"], "r"), ("convert", [], "c"), ("merge", [], "m"),
                            ("merge", ["--json"], "mj")]:
        code, stderr = _reader_gone(name, ck, *args, "-o", str(tmp_path / out))
        assert (code, stderr) == (0, ""), (name, code, stderr)
        assert (tmp_path / out / ".zckpt.json").exists(), name
    for args in (["info", ck], ["verify", ck, "--deep"], ["estimate", "--params", "8B", "--largest-layer", "1B"]):
        assert _reader_gone(*args) == (0, ""), args
    # a failure is still said on stderr, with its own status; verify's verdict too
    code, stderr = _reader_gone("info", str(tmp_path / "nope"))
    assert code == 1 and stderr.startswith("zckpt: error: ") and "Broken pipe" not in stderr, stderr
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    tag = (bad / "latest").read_text().strip()
    victim = sorted((bad / tag).glob("*optim_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:-8])
    code, stderr = _reader_gone("verify", str(bad))
    assert code == 1 and "Broken pipe" not in stderr, (code, stderr)


# ------------------------------------------------------------------------------------ Ctrl-C at any moment

_SIGINT_CODE = r"""
import os, signal, subprocess, sys, time
delay, sig, cmd = float(sys.argv[1]), getattr(signal, sys.argv[2]), sys.argv[3:]
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
os.set_blocking(p.stderr.fileno(), False)
seen, t0 = b"", time.monotonic()
while b"zckpt.lazy" not in seen and p.poll() is None and time.monotonic() - t0 < 60:
    seen += p.stderr.read() or b""  # -X importtime: zckpt.lazy is imported right after zckpt's handler is set
    time.sleep(0.001)
time.sleep(delay)
p.send_signal(sig)
os.set_blocking(p.stderr.fileno(), True)
out, err = p.communicate()
err = b"".join(l for l in (seen + err).splitlines(True) if not l.startswith(b"import time:"))
sys.stdout.write(repr((p.returncode, out.decode(), err.decode())))
"""


def _interrupt(delay, *args, sig="SIGINT"):
    cmd = [sys.executable, "-X", "importtime", "-m", "zckpt", *args]
    proc = subprocess.run([sys.executable, "-c", _SIGINT_CODE, str(delay), sig, *cmd], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=dict(os.environ, ZCKPT_DEBUG=""))
    return eval(proc.stdout)  # noqa: S307 - our own repr of (int, str, str)


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.5, 3.0])
def test_ctrl_c_at_any_moment_is_one_line(tmp_path, delay):
    """A real SIGINT at moments from the imports to after the result: either one line and exit 130 with nothing
    published, or the result reported as published and exit 0; never a traceback, never a half output."""
    from tests.conftest import FIXTURES
    out = tmp_path / "m"
    code, stdout, stderr = _interrupt(delay, "merge", str(checkpoint_path(FIXTURES / "trainer")), "-o", str(out))
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    if code == 130:
        assert stderr == "zckpt: interrupted\n" and stdout == "", (stdout, stderr)
        assert not out.exists()
    else:
        assert code == 0, (code, stdout, stderr)
        assert (out / "model.safetensors").exists() and (out / ".zckpt.json").exists()
        assert stderr in ("", f"zckpt: interrupted, but the result was already published: {out} is complete\n")
        assert "merged:" in stdout  # the report is printed whole
    assert not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name]  # no scratch left behind


_FINALIZER_CODE = r"""
import sys
import zckpt.ops.merge as merge


class Late:
    def __del__(self):
        raise KeyboardInterrupt  # what the CLI's SIGINT handler raises, landing in a finalizer


real = merge.plan_merge


def plan_merge(*args, **kwargs):
    late = Late()
    del late  # Python prints "Exception ignored" and drops it, unless zckpt raises it again
    return real(*args, **kwargs)


merge.plan_merge = plan_merge
sys.argv = ["zckpt", *sys.argv[1:]]
from zckpt.__main__ import run
run()
"""


def test_ctrl_c_landing_in_a_finalizer_still_interrupts(tmp_path):
    """A Ctrl-C whose KeyboardInterrupt is raised inside a finalizer or weakref callback (in CI: the import
    system's module-lock callback, while merge imported a reader) is not printed as "Exception ignored" with a
    traceback and then lost (the merge went on and exited 0): it interrupts the command, one line, exit 130."""
    from tests.conftest import FIXTURES
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-c", _FINALIZER_CODE, "merge",
                           str(checkpoint_path(FIXTURES / "trainer")), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env=dict(os.environ, ZCKPT_DEBUG=""))
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "zckpt: interrupted\n")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name]


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.5])
def test_sigterm_is_answered_as_ctrl_c(tmp_path, delay):
    """kill (a job scheduler's SIGTERM) during reshard: one line, exit 130 and the scratch folder removed, as for
    Ctrl-C (it was death by signal, status -15, the scratch folder left for a later run to sweep)."""
    from tests.conftest import FIXTURES
    out = tmp_path / "r"
    code, stdout, stderr = _interrupt(delay, "reshard", str(checkpoint_path(FIXTURES / "trainer")), "-w", "3", "-o",
                                      str(out), sig="SIGTERM")
    assert "Traceback" not in stderr, stderr
    if code == 130:
        assert stderr == "zckpt: interrupted\n" and stdout == "" and not out.exists(), (stdout, stderr)
    else:
        assert code == 0 and (out / ".zckpt.json").exists() and "resharded:" in stdout, (code, stdout, stderr)
        assert stderr in ("", f"zckpt: interrupted, but the result was already published: {out} is complete\n")
    assert not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name]  # no scratch left behind


def test_ctrl_c_during_push_and_info(tmp_path):
    from tests.test_push import write_trainer_checkpoint
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    for delay in (0.0, 0.3, 1.0):
        code, stdout, stderr = _interrupt(delay, "push", str(src), str(tmp_path / "d"), "--every", "1h", "--settle", "0")
        assert "Traceback" not in stderr and stderr.count("\n") <= 2, stderr
        assert code in (0, 130) and stderr.strip().splitlines()[-1].startswith("zckpt: "), (code, stderr)
        code, stdout, stderr = _interrupt(delay, "push", str(src), str(tmp_path / "dj"), "--every", "1h", "--settle",
                                          "0", "--json")
        if code == 130:  # --json: the interruption is one error object on stdout too (it printed nothing)
            doc = json.loads(stdout.splitlines()[-1])
            assert doc["ok"] is False and doc["error"]["type"] == "KeyboardInterrupt", stdout
            assert doc["error"]["exit_code"] == 130 and doc["command"] == "push", doc
        code, stdout, stderr = _interrupt(delay, "info", str(checkpoint_path(FIXTURE_DIRS[0])))
        assert code in (0, 130) and "Traceback" not in stderr and stderr in ("", "zckpt: interrupted\n"), stderr


def test_ctrl_c_before_push_sends_anything_says_nothing_is_unfinished(tmp_path):
    """Ctrl-C while push waits for a recent checkpoint to settle: nothing was started, so the line is just
    "interrupted", exit 130 (it said "the unfinished checkpoint has no manifest" with nothing unfinished)."""
    import signal
    from tests.test_push import write_trainer_checkpoint
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2, age=0)
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", "push", str(src), str(tmp_path / "d"), "--settle", "1h"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.splitlines()[-1] == "zckpt: interrupted", (proc.returncode, err)
    assert not list((tmp_path / "d").rglob("zckpt-manifest.json"))


def test_a_cleanup_failure_during_ctrl_c_is_still_the_interrupt(tmp_path, monkeypatch):
    """Cleanup that fails while a Ctrl-C unwinds (a map still in use, a scratch file already gone) must not turn the
    interrupt into "internal error" (exit 1): the user pressed Ctrl-C; it is one line and 130."""
    import zckpt.ops.estimate as estimate_mod

    def interrupted(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        finally:
            raise BufferError("cannot close exported pointers exist")

    monkeypatch.setattr(estimate_mod, "estimate", interrupted)
    for extra in ([], ["--json"]):
        res = invoke("estimate", "--params", "8B", "--largest-layer", "1B", *extra)
        assert res.exit_code == 130 and res.stderr == "zckpt: interrupted\n", (res.exit_code, res.output)
        if extra:
            assert json.loads(res.stdout)["error"]["type"] == "KeyboardInterrupt"
    res = invoke("estimate", "--params", "x", "--largest-layer", "1")  # an error of its own: reported as before
    assert res.exit_code == 1 and "internal error" not in res.stderr


def test_ctrl_c_during_an_import_is_still_the_interrupt(monkeypatch):
    """Python 3.11 wraps a Ctrl-C that lands in ``__set_name__`` while a class is being created (a dataclass of a
    module the command imports lazily) as ``RuntimeError("Error calling __set_name__ ...")`` raised from the
    KeyboardInterrupt: that is still the interrupt (one line, 130), not "internal error" (it made
    test_ctrl_c_at_any_moment_is_one_line flaky)."""
    import zckpt.ops.estimate as estimate_mod

    class Interrupting:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def interrupted(*args, **kwargs):
        type("Location", (), {"field": Interrupting()})

    monkeypatch.setattr(estimate_mod, "estimate", interrupted)
    for extra in ([], ["--json"]):
        res = invoke("estimate", "--params", "8B", "--largest-layer", "1B", *extra)
        assert res.exit_code == 130 and res.stderr == "zckpt: interrupted\n", (res.exit_code, res.output)


def test_ctrl_c_in_another_program_is_not_zckpts():
    """Importing zckpt (or its CLI) from another program leaves that program's Ctrl-C alone."""
    import signal
    code = "import signal, zckpt, zckpt.cli; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    # the program starts with Ctrl-C at its default (a suite run in the background inherits it ignored, and
    # Python then keeps it ignored)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.stdout.strip() == "True"
    before = signal.getsignal(signal.SIGINT)
    invoke("estimate", "--params", "8B", "--largest-layer", "1M")
    assert signal.getsignal(signal.SIGINT) is before


# ------------------------------------------------------------------------------ progress bars and logging

def _on_a_terminal(*args, env=None):
    """Run zckpt with stderr on a pseudo-terminal (stdout a pipe): (exit status, stdout, what the terminal got)."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    env = dict(os.environ, ZCKPT_DEBUG="", ZCKPT_PROGRESS_DELAY="0", COLUMNS="120", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "zckpt", *args], stdout=subprocess.PIPE, stderr=slave, cwd=ROOT,
                            env=env)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=120), out, seen.decode(errors="replace")


def test_progress_bars_only_on_a_terminal_in_zckpts_units(tmp_path):
    import re

    from zckpt.units import format_size
    from tests.test_push import write_trainer_checkpoint
    ck = str(checkpoint_path(FIXTURE_DIRS[0]))
    total = json.loads(invoke("info", ck, "--json").stdout)["checkpoint_bytes"]  # verify --deep reads every file
    code, out, tty = _on_a_terminal("verify", ck, "--deep")
    assert code == 0 and "complete and consistent" in out, (out, tty)
    totals = set(re.findall(r"/([0-9.]+ [KMG]?i?B) \[", tty))
    assert totals == {format_size(total)}, (totals, total, tty)  # as the summaries print sizes (zckpt.units)
    # the same run with stderr redirected: no frames at all
    proc = subprocess.run([sys.executable, "-m", "zckpt", "verify", ck, "--deep"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, ZCKPT_PROGRESS_DELAY="0"))
    assert proc.returncode == 0 and proc.stderr == "" and "\r" not in proc.stdout
    # push: one bar per checkpoint being sent, fed by its bytes; none for one already up to date
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    code, out, tty = _on_a_terminal("push", str(src), str(tmp_path / "d"), "--settle", "0")
    assert code == 0 and "checkpoint-2: pushed" in out and "checkpoint-2:" in tty and "B/s" in tty, (out, tty)
    code, out, tty = _on_a_terminal("push", str(src), str(tmp_path / "d"), "--settle", "0")
    assert code == 0 and "up to date" in out and tty.strip() == "", (out, tty)
    # -q, --json and ZCKPT_DISABLE_PROGRESS_BARS: no bar on a terminal either
    for extra, env in ((["-q"], None), (["--json"], None), ([], {"ZCKPT_DISABLE_PROGRESS_BARS": "1"})):
        code, out, tty = _on_a_terminal("verify", ck, "--deep", *extra, env=env)
        assert code == 0 and tty.strip() == "", (extra, tty)


def test_verbose_logs_what_happens(tmp_path):
    from tests.test_push import write_trainer_checkpoint
    ck = str(checkpoint_path(FIXTURE_DIRS[0]))
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    cases = {"info": ["info", ck], "verify": ["verify", ck, "--deep"],
             "merge": ["merge", ck, "-o", str(tmp_path / "m")],
             "reshard": ["reshard", ck, "-w", "1", "-o", str(tmp_path / "r")],
             "push": ["push", str(src), str(tmp_path / "d"), "--settle", "0"]}
    info_words = {"info": ["opened", "rank files", "read metadata in"], "verify": ["metadata:", "read every byte:"],
                  "merge": ["opened", "plan:", "tensors", "wrote and published"],
                  "reshard": ["plan:", "wrote and published"], "push": ["sending", "pushed in"]}
    debug_words = {"info": "read ", "verify": "CRCs match", "merge": "wrote model", "reshard": "_states.pt",
                   "push": "sent ("}
    for name, cmd in cases.items():
        quiet = invoke(*cmd)
        assert quiet.exit_code == 0 and "INFO" not in quiet.stderr, (name, quiet.stderr)
        for out in ("m", "r", "d"):
            shutil.rmtree(tmp_path / out, ignore_errors=True)
        res = invoke(*cmd, "-v")
        assert res.exit_code == 0, (name, res.output)
        lines = [line for line in res.stderr.splitlines() if line.startswith("zckpt: INFO: ")]
        assert lines and "DEBUG" not in res.stderr, (name, res.stderr)
        for w in info_words[name]:
            assert w in res.stderr, (name, w, res.stderr)
        for out in ("m", "r", "d"):
            shutil.rmtree(tmp_path / out, ignore_errors=True)
        res = invoke(*cmd, "-vv")
        assert res.exit_code == 0 and "zckpt: DEBUG: " in res.stderr and debug_words[name] in res.stderr, \
            (name, res.stderr)
        for out in ("m", "r", "d"):
            shutil.rmtree(tmp_path / out, ignore_errors=True)



# ------------------------------------------------------------------------------ --json: one written schema each

def _schemas() -> dict:
    """The JSON schemas of docs/json.md: {"info": ..., ..., "error": ...}, by the heading above each block."""
    import re
    text = (ROOT / "docs" / "json.md").read_text()
    out = {}
    for m in re.finditer(r"^## (zckpt (\w+)|Errors)\n(.*?)```json\n(.*?)```", text, re.S | re.M):
        out[m.group(2) or "error"] = json.loads(m.group(4))
    return out


_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool,
          "null": type(None)}


def _check(value, schema, where="$"):
    """The subset of JSON Schema docs/json.md uses: type, enum, required, properties, items."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, _TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in names)
        assert ok, f"{where}: {value!r} is not {names}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        missing = [k for k in schema.get("required", []) if k not in value]
        assert not missing, f"{where}: missing {missing}"
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                _check(value[k], sub, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]")


def test_json_outputs_match_the_written_schemas(tmp_path):
    from tests.conftest import FIXTURES
    from tests.test_push import write_trainer_checkpoint
    schemas = _schemas()
    # every command has its schema written down (help too: its topics, and with TOPIC the guide)
    assert set(schemas) == set(COMMANDS) | {"error"}, sorted(schemas)
    # one field name, one type, in every command that has it
    seen: dict[str, tuple] = {}
    for name, schema in schemas.items():
        for field, sub in schema.get("properties", {}).items():
            t = tuple(sorted(set([sub["type"]] if isinstance(sub["type"], str) else sub["type"]) - {"null"}))
            if field in seen and field not in ("ok", "command"):
                assert seen[field][0] == t, (field, name, t, seen[field])
            seen.setdefault(field, (t, name))
    ck = str(checkpoint_path(FIXTURES / "trainer"))
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    runs = [("info", [str(checkpoint_path(d)) for d in FIXTURE_DIRS]),
            ("verify", [ck, "--deep"]), ("merge", [ck, "-o", str(tmp_path / "m")]),
            ("merge", [ck, "--dry-run", "--max-shard-size", "20KB", "--dtype", "bf16", "-o", str(tmp_path / "m2")]),
            ("reshard", [ck, "-w", "1", "-o", str(tmp_path / "r")]),
            ("reshard", [ck, "-w", "3", "--stage", "3", "--dry-run", "-o", str(tmp_path / "r2")]),
            ("convert", [ck, "-o", str(tmp_path / "c")]), ("push", [str(src), str(tmp_path / "d"), "--settle", "0"]),
            ("push", [str(src), str(tmp_path / "d"), "--settle", "0"]),  # up to date
            ("estimate", ["--params", "8B", "--largest-layer", "600M", "--gpu-memory", "80GiB"]),
            ("estimate", [ck]), ("verify", [str(tmp_path / "m")]), ("help", []), ("help", ["json"])]
    docs = []
    for name, args in runs:
        if name == "info":
            for path in args:
                docs.append(("info", invoke("info", path, "--json")))
            continue
        docs.append((name, invoke(name, *args, "--json")))
    for name, res in docs:
        assert res.exit_code == 0, (name, res.output)
        (line,) = res.stdout.splitlines()
        doc = json.loads(line)
        _check(doc, schemas[name], name)
        if name not in ("push", "estimate", "help") and doc.get("tag") is None:
            assert name == "verify" and doc["path"] == str(tmp_path / "m")  # a merge output has no tag
    # errors: the same object for every command, whatever went wrong
    errors = [invoke("info", str(tmp_path / "missing"), "--json"), invoke("merge", ck, "--dtype", "fp8", "--json"),
              invoke("push", "--json"), invoke("reshard", ck, "--json"),
              invoke("push", str(src), "foo://bucket/run", "--settle", "0", "--json")]
    for res in errors:
        assert res.exit_code in (1, 2), res.output
        _check(json.loads(res.stdout), schemas["error"], "error")
    failed = json.loads(errors[-1].stdout)
    _check(failed["result"], schemas["push"], "error.result")


def test_json_dtypes_are_spelled_as_the_flags_spell_them():
    from tests.conftest import FIXTURES
    for name, master in (("z2_bf16master_ws2", "bf16"), ("z2_bf16_ws2", "fp32")):
        doc = json.loads(invoke("info", str(checkpoint_path(FIXTURES / name)), "--json").stdout)
        assert doc["master_dtype"] == master and doc["precision"] == "bf16"


# ------------------------------------------------------------------------------------------------ reprs

def test_reprs_are_short_and_say_what_matters(tmp_path):
    import zckpt
    from tests.conftest import FIXTURES
    from tests.test_push import write_trainer_checkpoint
    ck = str(checkpoint_path(FIXTURES / "trainer"))
    c = zckpt.open_checkpoint(ck)
    r = repr(c)
    assert len(r) < 300 and "ZeRO-2" in r and "bf16" in r and "world size 2" in r and "6,736 parameters" in r, r
    assert "global_step4" in r and "3 files" in r and "KiB" in r
    for obj in (c.records[0], c.groups[0], c.files[0], c.location):
        assert len(repr(obj)) < 300, repr(obj)
    m = zckpt.merge(ck, str(tmp_path / "m"))
    assert len(repr(m)) < 300 and "20 tensors" in repr(m) and "fp32 safetensors" in repr(m), repr(m)
    assert "header" not in repr(m) and "\\x" not in repr(m) and len(repr(m.plan)) < 300
    rs = zckpt.reshard(ck, str(tmp_path / "r"), world_size=1)
    assert len(repr(rs)) < 300 and "x2 -> ZeRO-2 x1" in repr(rs), repr(rs)
    v = zckpt.verify(ck)
    assert len(repr(v)) < 300 and "consistent" in repr(v) and f"{len(v.checks)} checks" in repr(v), repr(v)
    src = tmp_path / "out"
    write_trainer_checkpoint(src, 2)
    p = zckpt.push(str(src), str(tmp_path / "d"), settle=0)
    assert len(repr(p)) < 300 and "1 pushed" in repr(p) and len(repr(p.checkpoints[0])) < 300, repr(p)
    from zckpt.ops import estimate as est
    rec = est.recommend(est.estimate(8 * 10**9, 6 * 10**8, 8, 1, 1.5), 80 * 2**30, 0.25)
    assert len(repr(rec)) < 300 and "GiB" in repr(rec), repr(rec)
