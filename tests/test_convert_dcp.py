"""``zckpt convert --to dcp``: DeepSpeed checkpoints as PyTorch Distributed Checkpoints, read back by torch's own
DCP reader (``dcp_to_torch_save``: ``FileSystemReader`` + ``.metadata`` unpickled by torch) and compared bit for bit
with DeepSpeed's save-time view (``expected/oracle.*``: ``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``, module weights, buffers, step, lrs). FSDP2 resuming from the output at other
world sizes is tests/test_convert_fsdp2.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, checkpoint_path

torch = pytest.importorskip("torch")

from zckpt.errors import InvalidArgument, OutputExists, UnsupportedLayout  # noqa: E402
from zckpt.ops.convert import convert, torch_group  # noqa: E402

ENGINE = ["z2_bf16_ws2", "z3_bf16_ws2", "z2_fp16_ws2", "z3_fp16_ws2", "z1_bf16_ws2", "z2_fp32_ws3", "z3_fp32_ws3",
          "bf16opt_z1_ws2", "z2_bf16master_ws2", "z3_bf16master_ws2", "z3_bf16_ws4", "z0_bf16_ws2", "z0_fp32_ws2",
          "z2_bf16_ws2_align", "z3_lora_ws2", "trainer"]


def load_dcp(folder: Path) -> dict:
    """The whole checkpoint as torch's DCP reader gives it (a torch.save file, then loaded)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dst = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(dst))
    return torch.load(dst, weights_only=False)


def oracle(name: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    exp = FIXTURES / name / "expected"
    return load_file(exp / "oracle.safetensors"), json.loads((exp / "oracle.json").read_text())


def same_bits(a, b) -> bool:
    """Bit-equal; where DeepSpeed's API upcasts what its files keep narrower (bf16 masters' moments, returned as
    fp32), ours is the stored value and must upcast to exactly the API's."""
    if a.dtype != b.dtype:
        if a.element_size() >= b.element_size():
            return False
        a = a.to(b.dtype)
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_against_oracle(sd: dict, name: str) -> None:
    tensors, info = oracle(name)
    model, optim = sd["model"], sd["optim"]
    tied = dict(map(tuple, info.get("tied") or []))
    for key, want in tensors.items():
        kind, pname = key.split("/", 1)
        if kind == "fp32":  # the master: bit-equal, in the dtype DeepSpeed keeps it (bf16 masters stay bf16)
            assert same_bits(model[pname], want), key
        elif kind in ("exp_avg", "exp_avg_sq"):
            src = tied.get(pname, pname)
            assert same_bits(optim["state"][src][kind], want), key
        elif kind == "buffer":
            assert same_bits(model[pname], want), key
        elif kind == "module" and pname in info["frozen"]:
            assert same_bits(model[pname], want), key  # frozen: the module's own weight, its training dtype
    for alias, src in tied.items():
        assert torch.equal(model[alias], model[src]), alias
        assert alias not in optim["state"]
    groups = optim["param_groups"]
    assert [g["params"] for g in groups] == [g["names"] for g in info["param_groups"]]
    assert [g["lr"] for g in groups] == info["lrs"]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in info["param_groups"]]
    betas = (0.9, 0.999) if info.get("kind") == "trainer" or name == "trainer" else (0.9, 0.95)  # HF's default
    assert all(g["betas"] == betas and g["eps"] == 1e-8 and g["decoupled_weight_decay"] for g in groups)
    steps = {float(st["step"]) for st in optim["state"].values()}
    assert steps == {float(info["step"])}, steps
    assert all(st["step"].dtype == torch.float32 and st["step"].dim() == 0 for st in optim["state"].values())
    assert set(optim["state"]) == set(info["trainable"])
    if info.get("lr_scheduler"):
        assert sd["lr_scheduler"] == info["lr_scheduler"]
    assert sd["train_state"]["global_steps"] == info["global_steps"]


@pytest.mark.parametrize("name", ENGINE)
def test_dcp_holds_deepspeeds_training_state(name, tmp_path):
    out = tmp_path / "dcp"
    res = convert(str(checkpoint_path(FIXTURES / name)), out=str(out), layout="dcp")
    assert (out / ".metadata").is_file() and (out / ".zckpt.json").is_file()
    assert res.plan.optimizer == "AdamW"
    check_against_oracle(load_dcp(out), name)


def test_universal_source(tmp_path):
    """A universal checkpoint (zckpt's own, which DeepSpeed's load_universal loads: tests/test_reshard.py) converts
    to the same training state as its source."""
    from zckpt.ops.reshard import reshard
    reshard(str(FIXTURES / "z3_bf16_ws2"), str(tmp_path / "u"), world_size=3, fmt="universal")
    res = convert(str(tmp_path / "u"), out=str(tmp_path / "dcp"))
    assert any("universal" in n for n in res.plan.notes)
    check_against_oracle(load_dcp(tmp_path / "dcp"), "z3_bf16_ws2")


def test_keys_and_metadata_are_torchs_own(tmp_path):
    """Saving the loaded state again with torch's dcp.save gives the same keys, sizes, dtypes and nesting (torch's
    chunks differ: one per tensor); the .metadata is torch's Metadata dataclass."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    out = tmp_path / "dcp"
    convert(str(checkpoint_path(FIXTURES / "z2_bf16_ws2")), out=str(out), workers=2)
    sd = load_dcp(out)
    dcp.save(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    ours = pickle.loads((out / ".metadata").read_bytes())
    theirs = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert isinstance(ours, Metadata) and ours.version == theirs.version
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    for key, m in theirs.state_dict_metadata.items():
        o = ours.state_dict_metadata[key]
        assert type(o) is type(m), key
        if isinstance(m, TensorStorageMetadata):
            assert (o.size, o.properties.dtype) == (m.size, m.properties.dtype), key
    assert ours.planner_data == theirs.planner_data
    for idx, info in ours.storage_data.items():  # every chunk's bytes are a torch.save zip torch can load
        raw = (out / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        import io
        torch.load(io.BytesIO(raw), weights_only=True)
    tied = [i for k, i in ours.storage_data.items() if k.fqn == "model.head.weight"]
    assert tied == [i for k, i in ours.storage_data.items() if k.fqn == "model.emb.weight"]  # stored once


def test_fp16_loss_scaler_names_torchs_dtype(tmp_path):
    """The fp16 loss scaler's ``dtype`` is written as ``torch.float16`` (was zckpt's own stand-in class, which
    torch's reader would import from zckpt and zckpt's own reader refused): torch loads it with weights_only=True,
    and zckpt reopens the output."""
    from zckpt.state.open import open_checkpoint
    out = tmp_path / "dcp"
    convert(str(checkpoint_path(FIXTURES / "z2_fp16_ws2")), out=str(out), workers=2)
    for f in [out / ".metadata", *out.glob("*.distcp")]:  # no GLOBAL opcode naming a module of zckpt's
        assert b"czckpt." not in f.read_bytes() and b"TorchDtype" not in f.read_bytes(), f.name
    sd = load_dcp(out)
    assert sd["loss_scaler"]["dtype"] is torch.float16 and sd["loss_scaler"]["cur_scale"] == 256
    assert open_checkpoint(str(out)).format == "dcp"


def test_standins_never_reach_an_output(tmp_path):
    """A stand-in the writers do not convert (an inert object of another class) is refused, never pickled under
    zckpt's class name."""
    from zckpt.encoding.allowlist import Inert
    from zckpt.engine import torchzip
    stray = type("Thing", (Inert,), {"_qualname": "somepkg.Thing", "__module__": Inert.__module__})()
    with pytest.raises(UnsupportedLayout, match="stand-in"):
        torchzip.plan_archive({"x": stray}, "archive")


def test_large_tensors_are_split_into_row_blocks(tmp_path):
    from zckpt.state.open import open_checkpoint
    from zckpt.dcp.writer import write_plan  # noqa: F401
    from zckpt.ops.convert import execute, plan_convert
    ckpt = open_checkpoint(str(FIXTURES / "z2_bf16_ws2"))
    plan = plan_convert(ckpt, chunk_bytes=64, file_bytes=4096)  # 16 fp32 per chunk, files of ~4 KiB
    (_, layout), = plan.parts
    emb = next(i for i in layout.items if i.key == "model.emb.weight")
    assert [c.offsets for c in emb.chunks] == [(r, 0) for r in range(0, 13, 2)]  # 2 rows of 7 per chunk
    assert len(layout.files) > 3
    execute(plan, str(tmp_path / "dcp"))
    check_against_oracle(load_dcp(tmp_path / "dcp"), "z2_bf16_ws2")


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(UnsupportedLayout, match="elastic_checkpoint"):
        convert(str(FIXTURES / "z2_bf16_ws2_elastic"), out=str(tmp_path / "a"))
    with pytest.raises(UnsupportedLayout, match="adam_w_mode") as e:
        convert(str(FIXTURES / "z2_bf16_ws2_offload"), out=str(tmp_path / "a"))
    assert "--adam-mode" in e.value.hint
    assert not (tmp_path / "a").exists()
    fused = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    with pytest.raises(UnsupportedLayout, match="bias_correction off"):
        torch_group({**fused, "bias_correction": False}, 0, {}, "adamw", "p")
    with pytest.raises(UnsupportedLayout, match="amsgrad"):
        torch_group({**fused, "amsgrad": True}, 0, {}, "adamw", "p")
    with pytest.raises(UnsupportedLayout, match="not an Adam"):
        torch_group({"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}, 0, {}, None, "p")
    with pytest.raises(UnsupportedLayout, match="Lamb"):
        torch_group(fused, 0, {"optimizer": {"type": "Lamb"}}, None, "p")
    # the config says how DeepSpeed built it; a group without weight decay needs no mode
    assert torch_group(fused, 0, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, None, "p")[1] \
        == "Adam"
    assert torch_group(fused, 0, {"optimizer": {"type": "Adam"}}, None, "p")[1] == "AdamW"
    assert torch_group({**fused, "weight_decay": 0.0}, 0, {}, None, "p")[1] == "AdamW"
    with pytest.raises(InvalidArgument):
        convert(str(FIXTURES / "z2_bf16_ws2"), to="nope", out=str(tmp_path / "a"))
    with pytest.raises(InvalidArgument, match="Trainer checkpoint-N"):
        convert(str(FIXTURES / "z2_bf16_ws2"), out=str(tmp_path / "a"), layout="trainer")


def test_fused_adam_mapped_with_mode(tmp_path):
    """DeepSpeedCPUAdam (offload): the same moments and step; adam_w_mode given -> AdamW / Adam groups."""
    res = convert(str(FIXTURES / "z2_bf16_ws2_offload"), out=str(tmp_path / "w"), adam_mode="adamw")
    sd = load_dcp(tmp_path / "w")
    tensors, info = oracle("z2_bf16_ws2_offload")
    assert res.plan.optimizer == "AdamW"
    for g in sd["optim"]["param_groups"]:
        assert g["decoupled_weight_decay"] is True and "bias_correction" not in g and g["amsgrad"] is False
    for key, want in tensors.items():
        kind, pname = key.split("/", 1)
        if kind in ("exp_avg", "exp_avg_sq") and pname in sd["optim"]["state"]:
            assert same_bits(sd["optim"]["state"][pname][kind], want), key
    assert {float(s["step"]) for s in sd["optim"]["state"].values()} == {float(info["step"])}
    res = convert(str(FIXTURES / "z2_bf16_ws2_offload"), out=str(tmp_path / "l2"), adam_mode="adam")
    assert res.plan.optimizer == "Adam" and any("torch.optim.Adam" in n for n in res.plan.notes)
    sd = load_dcp(tmp_path / "l2")
    assert all(g["decoupled_weight_decay"] is False for g in sd["optim"]["param_groups"])


def test_output_rules(tmp_path):
    src = str(FIXTURES / "z2_bf16_ws2")
    out = tmp_path / "o"
    res = convert(src, out=str(out), dry_run=True)
    assert not out.exists() and res.plan.total_bytes > 0
    convert(src, out=str(out))
    with pytest.raises(OutputExists):
        convert(src, out=str(out))
    convert(src, out=str(out), overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(OutputExists):
        convert(src, out=str(tmp_path / "other"), overwrite=True)
    with pytest.raises(InvalidArgument):
        convert(src, out=str(FIXTURES / "z2_bf16_ws2" / "inside"))


def test_cli_convert(tmp_path):
    from click.testing import CliRunner
    from zckpt.cli import main
    out = tmp_path / "c"
    res = CliRunner().invoke(main, ["convert", str(FIXTURES / "z3_bf16_ws2"), "--to", "dcp", "-o", str(out),
                                    "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "dcp" and doc["source_format"] == "deepspeed" and doc["adam_mode"] == "adamw"
    assert doc["files"][-1]["name"] == ".metadata"
    res = CliRunner().invoke(main, ["convert", str(FIXTURES / "z2_bf16_ws2_offload"), "-o", str(tmp_path / "d")])
    assert res.exit_code != 0 and res.stderr.count("\n") == 1 and "--adam-mode" in res.stderr
