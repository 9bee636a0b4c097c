"""Docs that cannot rot: every ``zckpt ...`` example in README.md and docs/*.md (the --help examples included, via
the generated docs/cli.md) runs here, against small copies of the committed fixtures, and must succeed.

Names the docs use stand for fixtures: ``checkpoint-400`` is the Trainer checkpoint, ``ckpt/``, ``ds_ckpt/`` and
``ds_save/`` a DeepSpeed save folder, ``outputs/`` a training output folder holding both, ``config.json`` and
``Qwen3-8B/`` a Qwen3-8B config, ``fsdp2-step-1200/`` a DCP checkpoint (``dcp.save`` of ``get_state_dict`` of a
small model and its AdamW), ``megatron-ckpt/`` a Megatron-Core save folder (``fully_reshardable``), ``megatron-moe-ckpt/`` a Megatron-LM MoE save, ``qwen3-moe-ckpt/`` an AutoEP save of
Qwen3-MoE, ``fsdp2-moe-step-2/`` an FSDP2 DCP of Qwen3-MoE, ``titan-outputs/`` torchtitan's own Qwen3-MoE save
(``qwen3-moe-config/`` its transformers config), ``titan-llama/`` torchtitan's own Llama 3 save (``llama-config/``
its LlamaForCausalLM config), ``moe-ckpt/`` a native DeepSpeed MoE save and
``ds_config.json`` a DeepSpeed config. Examples that cannot run here are skipped with the reason: S3 and Hub URLs
(tests/test_push.py covers them against a real local S3 server), ``--every`` (runs until Ctrl-C), and synopsis lines
with placeholders (``--params P``).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAINER = FIXTURES / "trainer" / "checkpoint-4"
DEEPSPEED = FIXTURES / "z2_bf16_ws2"  # a plain DeepSpeed save folder (latest + global_stepN)
QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "tie_word_embeddings": False}


def examples() -> list[tuple[str, str]]:
    """``(where, command line)`` for every line of a fenced code block that runs zckpt."""
    found = []
    for doc in DOCS:
        fenced, pending, start = False, "", 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            text = pending + " " + line.strip() if pending else line.strip()
            start = start if pending else number
            if text.endswith("\\"):
                pending = text[:-1].strip()
                continue
            pending = ""
            text = re.sub(r"^\$\s+", "", text)
            command = re.sub(r"\s+#.*$", "", text).strip()
            if re.match(r"^([A-Z_]+=\S+\s+)*zckpt\s+[a-z]", command):
                found.append((f"{doc.relative_to(ROOT)}:{start}", command))
    return found


EXAMPLES = examples()


def skip_reason(command: str) -> str | None:
    if re.search(r"\b(s3|hf)://", command):
        return "needs S3 or the Hub (tests/test_push.py runs push against a local S3 server)"
    if "--every" in command:
        return "--every runs until Ctrl-C"
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    if any(re.fullmatch(r"[A-Z][A-Z0-9_]*", w) or "|" in w or "..." in w for w in words):
        return "a synopsis with placeholders, not an example"
    return None


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A folder holding the names the docs use, each a copy of a committed fixture."""
    copy = lambda src, dst: shutil.copytree(src, tmp_path / dst, ignore=shutil.ignore_patterns("expected"))  # noqa
    copy(TRAINER, "checkpoint-400")
    for name in ("ckpt", "ds_ckpt", "ds_save", "outputs/ds_ckpt"):
        copy(DEEPSPEED, name)
    copy(TRAINER, "outputs/checkpoint-400")
    copy(FIXTURES / "megatron" / "gpt_tp1_pp1_dp2_fullyresh", "megatron-ckpt")
    copy(FIXTURES / "megatron" / "moe16_ep2_dp4", "megatron-moe-ckpt")  # Megatron-LM MoE: 2 layers x 8 experts, ep 2
    copy(FIXTURES / "moe_autoep_z3_bf16_ws4_ep2_l2", "qwen3-moe-ckpt")  # AutoEP Qwen3-MoE, its config.json beside
    copy(FIXTURES / "moe_z2_bf16_ws2_ep2", "moe-ckpt")  # native deepspeed.moe MoE layers, ep 2
    copy(FIXTURES / "fsdp2_moe_qwen3_ws2" / "dcp", "fsdp2-moe-step-2")  # FSDP2 dcp.save of Qwen3-MoE, config.json
    copy(FIXTURES / "titan_qwen3_ws2" / "moe", "titan-outputs")  # torchtitan's own Qwen3-MoE save: checkpoint/step-2
    copy(FIXTURES / "titan_qwen3_ws2" / "hf" / "moe", "qwen3-moe-config")  # its transformers config.json
    copy(FIXTURES / "titan_llama3_ws2" / "llama", "titan-llama")  # torchtitan's own Llama 3 save: checkpoint/step-2
    copy(FIXTURES / "titan_llama3_ws2" / "hf" / "llama", "llama-config")  # its LlamaForCausalLM config.json
    for where in ("config.json", "Qwen3-8B/config.json"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(json.dumps(QWEN3_8B))
    _dcp(tmp_path / "fsdp2-step-1200")
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                                                         "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    (tmp_path / "fixtures").symlink_to(FIXTURES)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _dcp(path: Path) -> None:
    """A real DCP checkpoint: torch's dcp.save (one process) of get_state_dict after one AdamW step."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)


def _args(command: str, workspace: Path) -> list[str]:
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    words = words[words.index("zckpt") + 1:]
    words = [("mnt/" + w[len("/mnt/"):]) if w.startswith("/mnt/") else w for w in words]
    if "--tag" in words:  # the docs' tag names stand for the fixture's own tag
        path = next(w for w in words[1:] if not w.startswith("-"))
        words[words.index("--tag") + 1] = (workspace / path / "latest").read_text().strip()
    return words


def test_examples_were_found():
    runnable = [c for _, c in EXAMPLES if skip_reason(c) is None]
    assert len(EXAMPLES) >= 40 and len(runnable) >= 25, (len(EXAMPLES), len(runnable))
    commands = {shlex.split(c)[1] for _, c in EXAMPLES if c.startswith("zckpt")}
    assert {"info", "verify", "merge", "reshard", "push", "estimate"} <= commands


#: docs whose code blocks are recipes (a line reads what the line above wrote): run in order by their own test
RECIPES = {"docs/check-conversion.md": "tests/test_diff.py::test_check_conversion_recipe_runs_in_order"}


@pytest.mark.parametrize("where,command", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_doc_example_runs(where, command, workspace):
    reason = skip_reason(command) or (f"a recipe's step, run in order by {RECIPES[where.split(':')[0]]}"
                                      if where.split(":")[0] in RECIPES else None)
    if reason:
        pytest.skip(reason)
    from zckpt.cli import main

    args = _args(command, workspace)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, f"{where}: zckpt {' '.join(args)}\n{res.output}"
    if "--json" in args:
        for line in res.stdout.splitlines():
            json.loads(line)  # one JSON object per line


# ------------------------------------------------------------------------- fixtures/README.md: the table of sizes

def fixture_folders() -> list[Path]:
    """Every committed fixture: a folder under fixtures/ (or fixtures/ambiguous/) holding a checkpoint."""
    found = []
    for d in sorted(p for p in FIXTURES.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if (d / "expected").is_dir() or (d / "latest").exists():
            found.append(d)
        else:
            found += [c for c in sorted(d.iterdir()) if c.is_dir() and ((c / "expected").is_dir() or
                                                                        (c / "latest").exists())]
    return found


def fixtures_table() -> str:
    """The Sizes table of fixtures/README.md, from the files themselves."""
    from zckpt.units import format_size
    lines = ["| fixture | files | size | of which the checkpoint |", "|---|---:|---:|---:|"]
    total = 0
    for d in fixture_folders():
        files = [p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        size = sum(p.stat().st_size for p in files)
        ckpt = sum(p.stat().st_size for p in files if "expected" not in p.relative_to(d).parts)
        total += size
        lines.append(f"| `{d.relative_to(FIXTURES).as_posix()}` | {len(files)} | {format_size(size)} | "
                     f"{format_size(ckpt)} |")
    lines.append(f"| all | | {format_size(total)} | |")
    return "\n".join(lines)


def test_fixtures_readme_lists_every_fixture_with_its_size():
    text = (FIXTURES / "README.md").read_text()
    start, end = "<!-- fixtures-table -->\n", "<!-- /fixtures-table -->"
    assert start in text and end in text
    table = text[text.index(start) + len(start):text.index(end)].strip()
    assert table == fixtures_table(), "fixtures/README.md is stale: run python -m tests.test_docs_examples " \
                                      "--fixtures-table and paste it between the fixtures-table markers"
    # every fixture is also described: a row of its own in one of the README's tables
    described = set(re.findall(r"^\| `([\w./-]+)` \|", text[:text.index(start)], re.M))
    missing = [d.name for d in fixture_folders() if d.name not in described]
    assert not missing, f"fixtures without a row in fixtures/README.md: {missing}"


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--fixtures-table"]:
        print(fixtures_table())
