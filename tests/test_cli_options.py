"""The command line as a newcomer meets it (issue 50): output names the Trainer's rotation would delete, default
output names for ``.``, options that do not apply, one answer to one mistake, the step push reports."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from zckpt.cli import main
from tests.conftest import FIXTURES, checkpoint_path

TRAINER = checkpoint_path(FIXTURES / "trainer")  # outputs/checkpoint-4 of a real Trainer + DeepSpeed ZeRO-2 run
SAVE = checkpoint_path(FIXTURES / "z2_bf16_ws2")  # a DeepSpeed save folder (latest, global_step3)
MEGATRON = FIXTURES / "megatron" / "gpt_tp2_pp1_dp2"


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """A training output folder: checkpoint-4 (the real Trainer fixture) and checkpoint-2 (a copy)."""
    out = tmp_path_factory.mktemp("run") / "outputs"
    shutil.copytree(TRAINER, out / "checkpoint-4")
    shutil.copytree(TRAINER, out / "checkpoint-2")
    return out


# ------------------------------------------------------------------ item 2: names the Trainer's rotation deletes

def _trainer_sorted(output_dir: Path) -> list[str]:
    """What transformers' own rotation takes for checkpoints in ``output_dir``."""
    from transformers.trainer_utils import sort_checkpoints
    return [Path(p).name for p in sort_checkpoints(str(output_dir))]


@pytest.mark.parametrize("name", ["checkpoint-4-ws2", "checkpoint-4.merged", "checkpoint-4-fsdp", "checkpoint-40x"])
def test_outputs_the_rotation_would_delete_are_refused(outputs, name, tmp_path):
    # the oracle: transformers' sort_checkpoints lists such a folder (so save_total_limit deletes it)
    probe = tmp_path / "probe"
    (probe / "checkpoint-4").mkdir(parents=True)
    (probe / name).mkdir()
    assert name in _trainer_sorted(probe)
    for command in (["merge", outputs / "checkpoint-4"], ["reshard", outputs / "checkpoint-4", "-w", "2"],
                    ["convert", outputs / "checkpoint-4", "--to", "dcp"]):
        code, out, err = run(*command, "-o", outputs / name, "-q")
        (line,) = err.splitlines()
        assert code == 2 and "rotation" in line and str(outputs / name) in line, (command, err)
        word = {"merge": "merged", "reshard": "resharded", "convert": "converted"}[command[0]]
        assert f"-o {outputs / (word + '-' + name)}" in line, line  # a safe name, said
        assert not (outputs / name).exists()
    # in a folder the rotation never sees (no checkpoint-N there, not the source's parent) the name is the user's
    fresh = tmp_path / "new-run"
    code, _, err = run("reshard", outputs / "checkpoint-4", "-w", "2", "-o", fresh / name, "-q")
    assert code == 0, err
    # and in a training output folder that is not the source's parent, too
    other = tmp_path / "other-run"
    (other / "checkpoint-10").mkdir(parents=True)
    code, _, err = run("merge", outputs / "checkpoint-4", "-o", other / name, "-q", "--dry-run")
    assert code == 2 and "rotation" in err, err


def test_safe_names_are_safe_for_the_rotation(outputs, tmp_path):
    """The names zckpt suggests and its defaults: transformers' sort_checkpoints leaves them alone."""
    probe = tmp_path / "probe"
    (probe / "checkpoint-4").mkdir(parents=True)
    names = []
    for command in (["merge"], ["reshard", "-w", "2"], ["reshard", "-w", "2", "--stage", "3"],
                    ["convert", "--to", "dcp"]):
        code, out, err = run(command[0], outputs / "checkpoint-4", *command[1:], "--dry-run", "--json")
        assert code == 0, err
        names.append(Path(json.loads(out)["output"]).name)
        code, _, err = run(command[0], outputs / "checkpoint-4", *command[1:], "--dry-run",
                           "-o", outputs / "checkpoint-4-x")
        names.append(re.search(r"-o (\S+?)\)", err).group(1).rsplit("/", 1)[-1])
    for name in names:
        (probe / name).mkdir(exist_ok=True)
    assert _trainer_sorted(probe) == ["checkpoint-4"], names
    assert "merged-checkpoint-4-fp32" in names and "resharded-checkpoint-4-ws2-z3" in names, names


def test_documented_outputs_are_safe():
    """Every ``-o`` of an example in README.md, docs/*.md and the --help texts (the rotation rule itself aside)."""
    from zckpt.io.publish import rotation_deletes
    root = Path(__file__).resolve().parent.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "zckpt" / "cli").glob("*.py"))]
    bad = []
    for path in texts:
        for line in path.read_text().splitlines():
            for out in re.findall(r"(?:^|\s)(?:-o|--output)[ =](\S+)", line):
                name = out.strip("`'\"").rstrip("/").rsplit("/", 1)[-1]
                if rotation_deletes("outputs", name) and "rotation" not in line and "refused" not in line:
                    bad.append(f"{path.name}: {line.strip()}")
    assert not bad, bad


# ------------------------------------------------------------------------------ item 4: default names for "."

def test_default_output_names_use_the_folder_name(outputs, tmp_path, monkeypatch):
    save = tmp_path / "ckpts"
    shutil.copytree(SAVE, save)
    tag = (save / "latest").read_text().strip()
    cases = [(outputs / "checkpoint-4", ["merge", "."], outputs / "merged-checkpoint-4-fp32"),
             (outputs / "checkpoint-4", ["merge", "./"], outputs / "merged-checkpoint-4-fp32"),
             (outputs / "checkpoint-4", ["reshard", ".", "-w", "4"], outputs / "resharded-checkpoint-4-ws4"),
             (outputs / "checkpoint-4", ["convert", ".", "--to", "dcp"], outputs / "converted-checkpoint-4-dcp"),
             (outputs / "checkpoint-4" / "global_step4", ["merge", "."],
              outputs / "merged-checkpoint-4-global_step4-fp32"),
             (outputs / "checkpoint-4" / "global_step4", ["merge", ".."], outputs / "merged-checkpoint-4-fp32"),
             (save / tag, ["reshard", "../", "-w", "3"], tmp_path / "resharded-ckpts-ws3"),
             (save / tag, ["merge", "."], tmp_path / f"merged-ckpts-{tag}-fp32")]
    for cwd, args, want in cases:
        monkeypatch.chdir(cwd)
        code, out, err = run(*args, "--dry-run", "--json")
        assert code == 0, (args, err)
        doc = json.loads(out)
        assert Path(doc["output"]).resolve() == want.resolve(), (cwd, args, doc["output"])
        assert doc.get("tag") in (None, "global_step4", tag), doc  # never "."
    monkeypatch.chdir(MEGATRON)
    code, out, err = run("merge", ".", "--dry-run", "--json")
    assert code == 0 and Path(json.loads(out)["output"]).name == "merged-gpt_tp2_pp1_dp2-fp32", (err, out)


# ---------------------------------------------------------- items 3 and 7: options that do not apply, one answer

@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory) -> Path:
    """A real DCP checkpoint: torch's dcp.save (one process) of get_state_dict after one AdamW step, and a
    DeepSpeed config saying ZeRO-3 bf16."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    work = tmp_path_factory.mktemp("dcp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "step-3"), no_dist=True)
    (work / "ds_config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                                     "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    return work / "step-3"


def _usage(code, err, *words):
    (line,) = err.splitlines()
    assert code == 2 and line.startswith("zckpt: error: ") and "Traceback" not in err, (code, err)
    for w in words:
        assert w in line, (w, line)
    return line


@pytest.mark.parametrize("extra,flag", [
    (["--world-size", "4"], "--world-size"), (["-w", "4"], "--world-size"), (["--stage", "3"], "--stage"),
    (["--dtype", "bf16"], "--dtype"), (["--ds-config", "c.json"], "--ds-config"), (["--buffers", ""], "--buffers"),
    (["--tied", "a=b"], "--tied")])
def test_deepspeed_options_with_to_dcp_are_refused(extra, flag, tmp_path):
    code, out, err = run("convert", TRAINER, "--to", "dcp", *extra, "-o", tmp_path / "o")
    _usage(code, err, f"{flag}: does not apply here (--to dcp): only with --to deepspeed")
    code, out, err = run("convert", TRAINER, *extra, "-o", tmp_path / "o")  # --to dcp by default: the same
    _usage(code, err, f"{flag}: does not apply")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra,words", [
    (["--layout", "torchtitan"], "--layout: torchtitan does not apply here (--to deepspeed): only with --to dcp"),
    (["--layout", "trainer"], "--layout: trainer does not apply here"),
    (["--adam-mode", "adam"], "--adam-mode: does not apply here (--to deepspeed)"),
    (["--ntokens-seen", "0"], "--ntokens-seen: does not apply here (--to deepspeed, --layout auto): only with --to "
                              "dcp and with --layout torchtitan"),
    (["--tag", "global_step4"], "--tag: does not apply here (--to deepspeed)")])
def test_dcp_options_with_to_deepspeed_are_refused(dcp_ckpt, extra, words, tmp_path):
    code, out, err = run("convert", dcp_ckpt, "--to", "deepspeed", "-w", "2", "--stage", "2", "--dtype", "fp32",
                         *extra, "-o", tmp_path / "o")
    _usage(code, err, words)


def test_torchtitan_options_need_the_torchtitan_layout(tmp_path):
    for extra in (["--ntokens-seen", "0"], ["--lr-last-epoch", "1"], ["--initial-lr", "0.1"]):
        code, _, err = run("convert", TRAINER, "--layout", "dcp", *extra, "-o", tmp_path / "o")
        _usage(code, err, f"{extra[0]}: does not apply here (--layout dcp): only with --to dcp and with --layout torchtitan")


def test_stage_and_dtype_against_the_config(dcp_ckpt, tmp_path):
    cfg = dcp_ckpt.parent / "ds_config.json"
    code, _, err = run("convert", dcp_ckpt, "--to", "deepspeed", "-w", "2", "--stage", "2", "--ds-config", cfg,
                       "-o", tmp_path / "o")
    _usage(code, err, "--stage: 2 contradicts the DeepSpeed config, whose zero_optimization.stage is 3", str(cfg))
    code, _, err = run("convert", dcp_ckpt, "--to", "deepspeed", "-w", "2", "--dtype", "fp32", "--ds-config", cfg,
                       "-o", tmp_path / "o")
    _usage(code, err, "--dtype: fp32 contradicts the DeepSpeed config, which trains in bf16")
    # the config's stage is the stage when --stage is not given; the same stage given is fine
    for extra in ([], ["--stage", "3"]):
        code, out, err = run("convert", dcp_ckpt, "--to", "deepspeed", "-w", "2", "--ds-config", cfg, *extra,
                             "--dry-run", "--json")
        assert code == 0, err
        assert json.loads(out)["to"]["stage"] == 3
    code, _, err = run("convert", dcp_ckpt, "--to", "deepspeed", "-w", "2", "--dtype", "bf16", "-o", tmp_path / "o")
    _usage(code, err, "--stage: missing option, required with --to deepspeed")
    assert not (tmp_path / "o").exists()


def test_one_mistake_one_answer(dcp_ckpt, tmp_path):
    # a missing --world-size: exit 2 in both commands that take it, named alike
    code, _, err = run("convert", dcp_ckpt, "--to", "deepspeed", "--stage", "2", "--dtype", "fp32")
    _usage(code, err, "--world-size: missing option")
    code, _, err = run("reshard", SAVE)
    _usage(code, err, "--world-size: missing option")
    # -w everywhere --world-size is, one --stage type, both ranges said alike
    from zckpt.cli import COMMANDS
    import importlib
    commands = {n: getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for n, t in COMMANDS.items()}
    stages = set()
    for name, command in commands.items():
        for p in command.params:
            if "--world-size" in p.opts:
                assert "-w" in p.opts, name
            if "--stage" in p.opts:
                stages.add(repr(p.type))
    assert len(stages) == 1, stages
    for args in (["reshard", SAVE, "-w", "0"], ["convert", dcp_ckpt, "--to", "deepspeed", "-w", "0"],
                 ["estimate", "--params", "8B", "--largest-layer", "1M", "--gpus", "0"],
                 ["estimate", "--params", "8B", "--largest-layer", "1M", "--nodes", "0"]):
        code, _, err = run(*args)
        _usage(code, err, ": 0 is not in the range x>=1")
    for args in (["reshard", SAVE, "-w", "2", "--stage", "4"], ["convert", dcp_ckpt, "--to", "deepspeed", "-w", "2",
                                                                "--stage", "4"]):
        code, _, err = run(*args)
        _usage(code, err, "--stage: 4 is not in the range 1<=x<=3")
    # the Megatron reshard refusal names the command that does it
    code, _, err = run("reshard", MEGATRON, "-w", "2", "--dry-run")
    assert code == 1 and "zckpt convert PATH --to deepspeed --world-size N --groups megatron-default" in err, err


def test_options_of_other_commands(tmp_path):
    code, _, err = run("push", TRAINER.parent, tmp_path / "dest", "--every", "1m", "--allow-empty")
    _usage(code, err, "--allow-empty: does not apply here (--every 1m): only without --every")
    code, _, err = run("push", TRAINER.parent, tmp_path / "dest", "--part-size", "8MiB", "--dry-run")
    _usage(code, err, "--part-size: does not apply here (DEST ", "only with DEST an s3:// URL")
    code, _, err = run("merge", TRAINER, "-o", tmp_path / "m", "--output-storage-option", "anon=true")
    _usage(code, err, "--output-storage-option: does not apply here (-o ", "only with -o a URL")
    code, _, err = run("estimate", "--params", "10", "--largest-layer", "1", "--headroom", "25%")
    _usage(code, err, "--headroom: does not apply here (no --gpu-memory): only with --gpu-memory")
    code, _, err = run("estimate", SAVE, "--params", "10", "--largest-layer", "1")
    _usage(code, err, "--params: does not apply here (PATH ")
    assert not (tmp_path / "dest").exists() and not (tmp_path / "m").exists()


# ------------------------------------------------------------------- item 6: the step push reports is the checkpoint's

def test_push_step_is_the_checkpoints_own(tmp_path):
    """A Trainer checkpoint under another name keeps its trainer_state.json's step; a folder whose name is no
    framework's convention has none; never digits from an arbitrary name (resharded-checkpoint-4-ws2 was step 2)."""
    src = tmp_path / "src"
    code, _, err = run("reshard", TRAINER, "-w", "2", "-o", src / "resharded-checkpoint-4-ws2", "-q")
    assert code == 0, err
    shutil.copytree(SAVE / (SAVE / "latest").read_text().strip(), src / "snapshot-12")  # a tag folder, renamed
    shutil.copytree(TRAINER, tmp_path / "outputs" / "checkpoint-4")
    want = {"resharded-checkpoint-4-ws2": 4, "snapshot-12": None, "checkpoint-4": 4}
    for name, step in want.items():
        folder = src / name if name != "checkpoint-4" else tmp_path / "outputs"
        code, out, err = run("push", folder, tmp_path / "dest" / name, "--settle", "0", "--json")
        assert code == 0, err
        (ckpt,) = json.loads(out)["checkpoints"]
        assert ckpt["step"] == step, (name, ckpt)


# --------------------------------------------------------------- item 12: containers nested 10**6 deep, real bytes

DEEP = b"]" * 10**6 + b"a" * (10**6 - 1)  # 10**6 nested lists (EMPTY_LIST ... APPEND): 2 MB, no recursion to build


def _with_deep_entry(pickled: bytes, after: bytes = b"") -> bytes:
    """``pickled`` (a real pickle) with an entry 'zdeep' -> 10**6 nested lists in its first dict (the first after
    the text ``after``; frames dropped: they are optional, and the entry is larger than any)."""
    import pickletools
    ops = list(pickletools.genops(pickled))
    out, last = bytearray(), 0
    for op, _, pos in ops:  # drop FRAME opcodes (9 bytes each)
        if op.name == "FRAME":
            out += pickled[last:pos]
            last = pos + 9
    out += pickled[last:]
    m = re.compile(rb"\}(?:\x94|q.|r....)?\(", re.S).search(bytes(out), bytes(out).find(after) if after else 0)
    assert m, "no dict with a MARK in this pickle"
    return bytes(out[:m.end()]) + b"X\x05\x00\x00\x00zdeep" + DEEP + bytes(out[m.end():])


def _rezip(src: Path, dst: Path) -> None:
    """A torch zip whose data.pkl holds the deep entry, every other entry as saved (CRCs recomputed for it)."""
    import zipfile
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, _with_deep_entry(data) if info.filename.endswith("/data.pkl") else data)


def test_containers_nested_a_million_deep_in_dcp_metadata(dcp_ckpt, tmp_path):
    """DCP's .metadata is read in a fixed shape (every value zckpt keeps checked: a string, a tuple of ints), not
    walked whole: 10**6 nested lists where a tensor entry belongs are refused in one line; in a field zckpt does not
    read (as torch may add) they are never touched, and the checkpoint reads as without them."""
    dcp_copy = tmp_path / "dcp"
    shutil.copytree(dcp_ckpt, dcp_copy)
    meta = (dcp_ckpt / ".metadata").read_bytes()
    (dcp_copy / ".metadata").write_bytes(_with_deep_entry(meta, after=b"state_dict_metadata"))
    for command in (["info", dcp_copy], ["verify", dcp_copy], ["merge", dcp_copy, "-o", tmp_path / "m", "--dry-run"]):
        code, out, err = run(*command)
        (line,) = err.splitlines()
        assert code == 1 and str(dcp_copy / ".metadata") in line and "expected TensorStorageMetadata, found list" \
            in line, (command, err)
    (dcp_copy / ".metadata").write_bytes(_with_deep_entry(meta))  # the Metadata object's own fields
    code, out, err = run("info", dcp_copy, "--json")
    assert code == 0, err
    code0, out0, _ = run("info", dcp_ckpt, "--json")
    a, b = json.loads(out), json.loads(out0)
    assert code0 == 0 and [a[k] for k in ("parameters", "counts", "numel", "param_groups")] == \
        [b[k] for k in ("parameters", "counts", "numel", "param_groups")]
    assert [f["name"] for f in a["files"]] == [f["name"] for f in b["files"]]
    assert not (tmp_path / "m").exists()


def test_containers_nested_a_million_deep_are_refused(tmp_path):
    cases = []
    ds = tmp_path / "ds"  # a DeepSpeed rank file (ZeRO-2, 2 ranks) and optimizer file
    shutil.copytree(SAVE, ds)
    tag = ds / (ds / "latest").read_text().strip()
    for name in ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        one = tmp_path / f"ds-{name}"
        shutil.copytree(SAVE, one)
        target = one / tag.name / name
        _rezip(tag / name, target)
        cases.append((one, target))
    meg = tmp_path / "megatron"  # Megatron-Core's common.pt
    shutil.copytree(MEGATRON, meg)
    common = next(meg.glob("iter_*/common.pt"))
    _rezip(next(MEGATRON.glob("iter_*/common.pt")), common)
    cases.append((meg, common))
    for folder, bad in cases:
        for command in (["info", folder],):
            code, out, err = run(*command)
            (line,) = err.splitlines()
            assert code == 1 and str(bad) in line and "nests containers deeper than 200 levels" in line, (command, err)
            assert "RecursionError" not in err and "internal error" not in err


def _bomb(kind: str, depth: int = 40):
    """A value whose containers each hold the one before twice: ``depth`` objects, 2**depth paths."""
    v = {"tuple": (), "list": [], "dict": {}}[kind]
    for _ in range(depth):
        v = {"tuple": lambda: (v, v), "list": lambda: [v, v], "dict": lambda: {"a": v, "b": v}}[kind]()
    return v


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_shared_containers_that_multiply_without_end_are_refused(tmp_path, kind):
    """A "billion laughs" pickle: 40 containers, each holding the one before twice, in a rank file's or
    Megatron-Core's common.pt (a few hundred bytes more, 2**40 paths). Any walk that does not remember what it saw
    (repr, json, a converter) would never end: refused on reading, in one line naming the file, nothing written."""
    import torch
    ds = tmp_path / "ds"
    shutil.copytree(SAVE, ds)
    tag = ds / (ds / "latest").read_text().strip()
    cases = []
    for name in ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        one = tmp_path / f"ds-{name}"
        shutil.copytree(ds, one)
        target = one / tag.name / name
        sd = torch.load(target, weights_only=False)
        sd["extra"] = _bomb(kind)
        torch.save(sd, target)
        cases.append((one, target, ["reshard", one, "-w", "1", "-o", tmp_path / "out"]))
    meg = tmp_path / "megatron"
    shutil.copytree(MEGATRON, meg)
    common = next(meg.glob("iter_*/common.pt"))
    sd = torch.load(common, weights_only=False)
    sd["extra"] = _bomb(kind)
    torch.save(sd, common)
    cases.append((meg, common, ["convert", meg, "--to", "dcp", "--groups", "megatron-default", "-o", tmp_path / "out"]))
    for folder, bad, write in cases:
        for command in (["info", folder], ["verify", folder], write):
            code, out, err = run(*command)
            (line,) = err.splitlines()
            assert code == 1 and str(bad) in line and "(a pickle bomb)" in line, (command, err)
            assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_values_shared_in_a_pickle_stay_shared_when_written(kind):
    """What a pickle shares, the writers' converters (DeepSpeed's objects, DCP's plain values) convert once and
    keep shared: 2**40 paths through 40 objects take 40 steps; a list that holds itself is converted, not walked
    without end."""
    from zckpt.deepspeed.partition import Converter
    from zckpt.engine.dcplayout import plain_value
    for convert in (Converter(), lambda v: plain_value(v, "extra")):
        out = convert(_bomb(kind))
        for _ in range(40):
            a, b = (out["a"], out["b"]) if kind == "dict" else out
            assert a is b
            out = a
        assert out in ((), [], {})
        loop = []
        loop.append(loop)
        got = convert({"x": loop, "y": (loop, 1)})
        assert got["x"][0] is got["x"] and got["y"][0] is got["x"]


def test_source_and_stage_options_that_do_not_apply(tmp_path):
    """--groups / --native-names state a Megatron-Core source's groups and names: for another source they are
    refused, never ignored; --bf16-optimizer is a ZeRO-1 optimizer: not with --stage 2."""
    for extra in (["--groups", "megatron-default"], ["--native-names"]):
        code, _, err = run("convert", TRAINER, "--to", "dcp", *extra, "-o", tmp_path / "o")
        _usage(code, err, f"{extra[0]} applies to a Megatron-Core source", f"drop {extra[0]}")
    code, _, err = run("reshard", SAVE, "-w", "3", "--stage", "2", "--bf16-optimizer", "-o", tmp_path / "o")
    _usage(code, err, "--bf16-optimizer: does not apply here (--stage 2): only with --stage 1 (or no --stage)")
    assert not (tmp_path / "o").exists()
