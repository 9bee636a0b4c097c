"""The Python API mirrors the command line: each command's options are its function's parameters (named one way,
below), merge/reshard/convert take (checkpoint, output) first, every result has .to_dict() with the fields --json
prints, and dir(zckpt) lists the public names only."""

from __future__ import annotations

import inspect
import json

import click
import pytest
from click.testing import CliRunner

import zckpt
from zckpt.cli import main
from tests.conftest import FIXTURES, checkpoint_path

#: a flag (without --, dashes as underscores) -> the parameter's name in the API, where they differ
FLAG = {"output": "out", "storage_option": "storage_options", "output_storage_option": "output_storage_options",
        "tie": "ties", "no_tie": "ties", "format": "fmt"}
#: the same, for one command
COMMAND_FLAG = {"merge": {"to": "fmt"},
                "convert": {"ntokens_seen": "torchtitan", "lr_last_epoch": "torchtitan", "initial_lr": "torchtitan"}}
#: how the command line prints: the API returns objects instead
RENDERING = {"json", "quiet", "verbose", "debug"}
#: options whose API is another function (push --every: zckpt.Pusher(src, dest, every=...); --once: one push() call)
ELSEWHERE = {"push": {"every": lambda: "every" in inspect.signature(zckpt.Pusher).parameters, "once": lambda: True}}
#: parameters only a Python caller has (callbacks, objects, what a launcher passes), with no flag of their own
LIBRARY_ONLY = {"progress", "group", "storage_options_b", "hub_api", "hash_cache", "only", "wait_settle", "cancel",
                "unreachable_after", "reachability", "torchtitan"}
COMMANDS = ("merge", "reshard", "convert", "verify", "info", "diff", "push", "estimate")


def _cli_names(name: str) -> set[str]:
    cmd = main.get_command(click.Context(main), name)
    out = set()
    for p in cmd.params:
        if isinstance(p, click.Argument):
            out.add(p.name)
            continue
        flag = max((o for o in p.opts if o.startswith("--")), key=len)[2:].replace("-", "_")
        if flag in RENDERING:
            continue
        out.add(COMMAND_FLAG.get(name, {}).get(flag) or FLAG.get(flag, flag))
    return out


@pytest.mark.parametrize("name", COMMANDS)
def test_each_option_is_a_parameter(name):
    params = set(inspect.signature(getattr(zckpt, name)).parameters)
    cli = _cli_names(name)
    elsewhere = ELSEWHERE.get(name, {})
    assert all(check() for check in elsewhere.values())
    assert not (cli - params - set(elsewhere)), f"zckpt {name}: options with no parameter {cli - params}"
    extra = params - cli - LIBRARY_ONLY
    # diff's library takes per-side tags and options; the CLI's --tag-a/--tag-b map to them
    assert not extra, f"zckpt.{name}: parameters with no option {extra}"
    assert "durable" not in params and "to_json" not in dir(zckpt)


def test_one_vocabulary():
    for name in ("merge", "reshard", "convert"):
        first = list(inspect.signature(getattr(zckpt, name)).parameters)[:2]
        assert first == ["path", "out"], (name, first)
    for name in ("merge", "reshard", "convert", "verify", "info"):
        ps = inspect.signature(getattr(zckpt, name)).parameters
        assert ps["latest"].default is False and ps["ties"].default is None, name
    assert set(dir(zckpt)) == set(zckpt.__all__) and "annotations" not in dir(zckpt)
    assert all(not n.startswith("_") or n == "__version__" for n in dir(zckpt))


def _cli_json(*args):
    res = CliRunner().invoke(main, [*map(str, args), "--json"], catch_exceptions=False)
    assert res.exit_code in (0, 1) and res.stdout, res.output  # (diff: 1 when the two differ)
    doc = json.loads(res.stdout)
    return {k for k in doc if k not in ("ok", "command")}


def test_results_to_dict_have_the_json_fields(tmp_path):
    ck = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    ws1 = checkpoint_path(FIXTURES / "z2_bf16_ws1")
    runs = [
        (zckpt.merge(ck, tmp_path / "m", dry_run=True), ("merge", ck, "-o", tmp_path / "m", "--dry-run")),
        (zckpt.reshard(ck, tmp_path / "r", world_size=1, dry_run=True),
         ("reshard", ck, "-o", tmp_path / "r", "-w", "1", "--dry-run")),
        (zckpt.convert(ck, tmp_path / "c", to="dcp", dry_run=True),
         ("convert", ck, "-o", tmp_path / "c", "--to", "dcp", "--dry-run")),
        (zckpt.verify(ck), ("verify", ck)),
        (zckpt.info(ck), ("info", ck)),
        (zckpt.diff(ck, ws1), ("diff", ck, ws1)),
        (zckpt.estimate(ck, gpus_per_node=4, gpu_memory="24GiB"), ("estimate", ck, "--gpus", "4", "--gpu-memory", "24GiB")),
    ]
    for result, cli in runs:
        doc = result.to_dict()
        assert isinstance(doc, dict)
        # (path, tag, output: what the command line adds from its own arguments where a result lacks them)
        assert set(doc) >= _cli_json(*cli) - {"path", "tag", "output"}, (cli[0], _cli_json(*cli) - set(doc))
    est = runs[-1]  # estimate's result is the --json object itself
    assert est[0].to_dict() == {k: v for k, v in json.loads(CliRunner().invoke(
        main, [*map(str, est[1]), "--json"]).stdout).items() if k not in ("ok", "command")}


def test_convert_output_second_fsync_and_latest(tmp_path):
    """zckpt.convert(src, out): the output is the second argument, as merge's and reshard's (to= still a keyword);
    latest= picks the newest complete checkpoint as --latest does; fsync= is --fsync."""
    res = zckpt.convert(checkpoint_path(FIXTURES / "z2_bf16_ws2"), tmp_path / "dcp", fsync=True)
    assert res.output == str(tmp_path / "dcp") and (tmp_path / "dcp" / ".metadata").exists()
    info = zckpt.info(FIXTURES / "trainer", latest=True)
    assert info["path"].endswith("checkpoint-4") and info.to_dict() == dict(info) and info["tag"] == "global_step4"
    with pytest.raises(zckpt.InvalidArgument, match="do not go together"):
        zckpt.verify(FIXTURES / "trainer", tag="global_step4", latest=True)


def test_convert_old_order_is_refused_not_guessed(tmp_path, monkeypatch):
    """zckpt.convert(path, "deepspeed") was (path, to): now the second argument is the output, and a format name
    there is refused in one line rather than written to a folder called "deepspeed" as DCP."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zckpt.InvalidArgument, match="second argument of convert is the output"):
        zckpt.convert(checkpoint_path(FIXTURES / "z2_bf16_ws2").resolve(), "deepspeed")
    assert not any(tmp_path.iterdir())
