"""``zckpt convert``: a training checkpoint carried between formats, one (reader, writer) pair per direction, one
engine, one publish path.

Readers describe the source as the one training-state model (:mod:`zckpt.state.model`: per parameter the fp32
master, the Adam moments, its group's hyperparameters and step; frozen weights and buffers; scheduler and
counters); writers plan the target layout from it as plain data (``--dry-run`` prints it); :func:`execute` writes
it through :mod:`zckpt.engine` into a scratch folder published by :mod:`zckpt.io.publish`.

- DeepSpeed -> DCP (``to="dcp"``): the DeepSpeed reader, then the DCP writer (:mod:`zckpt.dcp.fsdp2_state`: what
  ``dcp.save`` gets from FSDP2 + torch's AdamW; :mod:`zckpt.dcp.plan`: one DCP folder or the Trainer's two). What
  is DeepSpeed's to say (the config's ``adam_w_mode``, a ``checkpoint-N``'s own files) is read here and handed on.
- DCP -> DeepSpeed (``to="deepspeed"``): :mod:`zckpt.ops.to_deepspeed`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from zckpt.dcp import writer as dcpw
from zckpt.dcp.fsdp2_state import torch_group as _torch_group
from zckpt.dcp.plan import ConvertPlan, plan_dcp
from zckpt.deepspeed.from_state import config_adam_w_mode
from zckpt.deepspeed import hf_moe, titan_dense
from zckpt.engine import run
from zckpt.engine.checked import InputCheck
from zckpt.errors import InvalidArgument, OptionError
from zckpt.io import links, publish, storage
from zckpt.state import checksums
from zckpt.state.model import Checkpoint
from zckpt.state.open import format_named, open_checkpoint
from zckpt.units import format_size

log = logging.getLogger(__name__)

FORMATS = ("dcp", "deepspeed", "megatron")  # dcp and deepspeed: this module's routes; the rest: the registry's
# writers (a format's plan_convert, zckpt.state.formats), one generic route
_DEEPSPEED_FILES = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")


@dataclass
class ConvertResult:
    output: str
    plan: ConvertPlan
    seconds: float = 0.0
    dry_run: bool = False
    stats: dict = field(default_factory=dict)  # ranks, bytes, seconds, remote reads (as merge and reshard report)

    def to_dict(self) -> dict:
        """The fields ``convert --json`` prints: the checkpoint read is ``path``, what was written ``format`` (as in
        merge and reshard), the source's ``source_format``, the optimizer as ``--adam-mode`` spells it."""
        doc = self.to_json()
        doc["path"] = doc.pop("source", None)
        doc["format"], doc["source_format"] = doc.pop("to", None), doc.pop("from", None)
        mode = doc.pop("optimizer", None)  # (info's "optimizer": the ZeRO optimizer)
        doc["adam_mode"] = mode.lower() if isinstance(mode, str) and mode else None
        return doc

    def to_json(self) -> dict:
        return {"output": self.output, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                **self.plan.summary(), **({"stats": self.stats} if self.stats else {})}

    def __repr__(self) -> str:
        what = "would write" if self.dry_run else f"wrote in {self.seconds:.2f}s"
        s = self.plan.summary()
        return (f"<ConvertResult {self.output!r}: {s.get('from')} -> {s.get('to')}, "
                f"{s.get('keys')} keys, {len(s.get('files') or [])} files, {format_size(s.get('total_bytes') or 0)}, "
                f"{what}>")


def torch_group(hyper: dict, index: int, ds_config: dict, adam_mode: str | None, path: str) -> tuple[dict, str]:
    """:func:`zckpt.dcp.fsdp2_state.torch_group` with a DeepSpeed config's word on ``adam_w_mode``."""
    return _torch_group(hyper, index, adam_mode, path, lambda: config_adam_w_mode(ds_config))


def plan_convert(ckpt: Checkpoint, to: str = "dcp", adam_mode: str | None = None, checkpoint_id: str | None = None,
                 chunk_bytes: int = dcpw.CHUNK_BYTES, file_bytes: int = dcpw.FILE_BYTES,
                 layout: str = "auto", torchtitan: dict | None = None) -> ConvertPlan:
    """The whole output of converting ``ckpt`` to DCP, laid out as plain data (nothing is read or written):
    :func:`zckpt.dcp.plan.plan_dcp`, with what the DeepSpeed source says (its config's ``adam_w_mode``; a
    Trainer ``checkpoint-N``'s own files, copied beside the DCP files)."""
    if to != "dcp":
        raise InvalidArgument(f"plan_convert writes DCP, not {to!r}", hint="convert(..., to='deepspeed') for DCP "
                                                                              "-> DeepSpeed")
    trainer_dir = ckpt.location.trainer_dir
    copies = trainer_copies(trainer_dir, ckpt.location.tag_dir, ckpt.storage_options) if trainer_dir else []
    return plan_dcp(ckpt, adam_mode, checkpoint_id, chunk_bytes, file_bytes, layout, copies,
                    lambda: config_adam_w_mode(ckpt.ds_config), torchtitan)


def trainer_copies(trainer_dir: str, tag_dir: str, storage_options: dict | None = None) -> list[tuple[str, str, int]]:
    """The files of a Trainer ``checkpoint-N`` that are not DeepSpeed's (its tag folders, ``latest``, the
    ``zero_to_*.py`` scripts): (name, path, size) of each, copied as they are."""
    out = []
    for name, size in sorted(storage.list_files(trainer_dir, storage_options).items()):
        if "/" in name or name in _DEEPSPEED_FILES or name == publish.MARKER:
            continue
        out.append((name, storage.join(trainer_dir, name), size))
    links.check([path for _, path, _ in out], trainer_dir)  # copied as they are: none from outside the checkpoint
    return out


# ------------------------------------------------------------------------------------------- execute

def _check_out(out: str, overwrite: bool, source: publish.Source | None) -> None:
    if storage.is_url(out):
        raise InvalidArgument("convert writes to a local folder", path=out,
                              hint="convert locally, then `zckpt push` the result")
    publish.check_output(out, "convert", source, overwrite)


def execute(plan: ConvertPlan, out: str, workers: int | None = None, overwrite: bool = False,
            progress: Callable[[int, int], None] | None = None, durable: bool = False,
            source: publish.Source | None = None, storage_options: dict | None = None,
            check: InputCheck | None = None) -> dict:
    """Write ``plan`` into the local folder ``out`` (:func:`zckpt.engine.run.run_convert`: a scratch sibling, the
    data files, ``.metadata`` (DCP's commit), zckpt's marker, then one rename)."""
    _check_out(out, overwrite, source)
    return run.run_convert(plan, out, workers, overwrite, progress, durable, source, storage_options, check)


def default_output(source: publish.Source, to: str) -> str:
    """``outputs/checkpoint-4`` -> ``outputs/converted-checkpoint-4-dcp`` (never inside, never named like one)."""
    return publish.default_output(source, "converted") + f"-{to}"


def convert(path: str, to: str = "dcp", out: str | None = None, tag: str | None = None, dry_run: bool = False,
            overwrite: bool = False, workers: int | None = None,
            progress: Callable[[int, int], None] | None = None, durable: bool = False,
            adam_mode: str | None = None, storage_options: dict | None = None, world_size: int | None = None,
            stage: int | None = None, ds_config=None, buffers=None, tied=None, dtype: str | None = None,
            layout: str = "auto", group=None, torchtitan: dict | None = None, groups=None,
            native_names: bool = False, tp: int | None = None, pp: int | None = None, megatron_args=None,
            dp: int | None = None, ddp_config=None, hf_config=None, ep: int | None = None):
    """Convert the checkpoint at ``path`` into format ``to`` in the folder ``out``.

    ``to="deepspeed"``: a DCP checkpoint (FSDP2 + AdamW) as native DeepSpeed ZeRO-``stage`` files for
    ``world_size`` ranks, for the DeepSpeed config ``ds_config`` (dict or JSON path) or the precision ``dtype``;
    ``buffers`` / ``tied`` say
    what DCP does not (:func:`zckpt.ops.to_deepspeed.to_deepspeed`, which this returns the result of).

    ``to="dcp"``: a PyTorch Distributed Checkpoint that FSDP2 + ``torch.optim.AdamW`` loads at any world size
    with ``dcp.load`` + ``set_state_dict`` (keys in this module's docstring and docs/migrate-fsdp2.md).
    ``adam_mode``: ``"adamw"`` / ``"adam"`` for DeepSpeed's FusedAdam / DeepSpeedCPUAdam when neither the groups
    nor the config say. ``layout``: ``"dcp"`` (one DCP folder), ``"trainer"`` (a Trainer / Accelerate FSDP2
    checkpoint folder; see :func:`plan_convert`), ``"torchtitan"`` (a ``step-<N>`` folder that torchtitan's
    ``CheckpointManager.load`` resumes; ``torchtitan={"ntokens_seen": N, "lr_last_epoch": E, "initial_lr": LR}``
    states what the source does not hold: :mod:`zckpt.dcp.titan`), ``"auto"`` (trainer for a checkpoint-N, else dcp).
    ``progress(done_bytes, total_bytes)``; ``durable=True`` fsyncs before publishing.
    Default ``out``: ``outputs/checkpoint-4`` -> ``outputs/converted-checkpoint-4-dcp``; ``overwrite`` replaces only
    a previous zckpt convert output. ``storage_options``: fsspec options for a URL ``path``. ``group``: the ranks
    of a launcher's job (:func:`zckpt.engine.launch.launched`): each writes a share, rank 0 publishes.

    A Megatron-Core ``fully_reshardable`` source (either target): ``groups`` states its param groups, which its
    files do not record (``"megatron-default"`` or ``["GLOB=K", ...]``: :mod:`zckpt.megatron.state`); the state is
    written under Hugging Face Llama's names when the files say the model is Llama-shaped, unless
    ``native_names``.

    ``to="megatron"``: a Megatron-LM save folder (:mod:`zckpt.megatron.writer`) that megatron-core resumes at any
    TP / PP / DP; ``tp`` / ``pp``: the target's sizes, checked against the model (default: the source's);
    ``layout``: ``"fully_reshardable"`` (the default). ``megatron_args``: for a run Megatron did not train (DeepSpeed,
    FSDP2 under Hugging Face Llama names), the ``pretrain_gpt.py`` flags that state its schedule and global batch
    (one string, or a list of words: ``"--lr 3e-4 --train-iters 1000 --global-batch-size 8 ..."``;
    :mod:`zckpt.megatron.run_args`), from which the scheduler, the groups' Megatron settings and the consumed
    samples are made; refused for a source that holds Megatron's own. ``layout="dp_reshardable"``: the
    distributed optimizer's buckets for ``dp`` data-parallel ranks and the DDP settings ``ddp_config``
    (``"overlap_grad_reduce=false,..."``; :mod:`zckpt.megatron.writer_buckets`).

    ``hf_config`` (``to="deepspeed"``): the transformers class's ``config.json`` of a torchtitan Qwen3 save, whose
    state is then written under that class's names (:mod:`zckpt.dcp.titan_hf`)."""
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise InvalidArgument(f"unknown target format {to!r}", hint=f"choose one of {', '.join(FORMATS)}")
    if to not in ("dcp", "deepspeed"):
        others = {"--world-size": world_size, "--stage": stage, "--ds-config": ds_config, "--buffers": buffers,
                  "--tied": tied, "--dtype": dtype, "--adam-mode": adam_mode, "--torchtitan options": torchtitan,
                  "--groups": groups, "--native-names": native_names, "--hf-config": hf_config}
        given = sorted({k.strip() for k, v in others.items() if v not in (None, False, [], (), {}, "")})
        if given:
            raise InvalidArgument(f"{', '.join(given)} do not apply to --to {to}", hint=f"drop {', '.join(given)}")
        return convert_to(path, to, out, tag, dry_run, overwrite, workers, progress, durable, storage_options, group,
                          {"tp": tp, "pp": pp, "layout": None if layout == "auto" else layout,
                           "megatron_args": megatron_args, "dp": dp, "ddp_config": ddp_config, "ep": ep})
    if megatron_args is not None:
        raise OptionError(f"--megatron-args states a Megatron target's schedule; --to {to} has none",
                          hint="drop --megatron-args")
    if tp is not None or pp is not None or ep is not None or dp is not None or ddp_config is not None:
        raise InvalidArgument(f"--tp / --pp / --ep / --dp / --ddp-config set a Megatron target's shape; --to {to} "
                              "has none",
                              hint="drop them")
    if to == "deepspeed":
        from zckpt.ops import to_deepspeed
        if group is not None:
            raise InvalidArgument("convert --to deepspeed runs in one process, not under a launcher",
                                  hint="run it without torchrun / srun (then zckpt reshard can use many)")
        if tag is not None:
            raise InvalidArgument("--tag picks a DeepSpeed tag; --to deepspeed reads a DCP folder",
                                  hint="pass the DCP folder itself")
        return to_deepspeed.to_deepspeed(path, out, world_size, stage, ds_config, buffers, tied, dtype, dry_run=dry_run,
                                         overwrite=overwrite, workers=workers, progress=progress, durable=durable,
                                         storage_options=storage_options, groups=groups, native_names=native_names,
                                         hf_config=hf_config)
    if hf_config is not None:
        raise OptionError("--hf-config names the transformers class a torchtitan save is written as, for --to "
                          "deepspeed and merge", path=path, hint="drop --hf-config")
    ckpt = open_checkpoint(path, tag, storage_options)
    fmt = format_named(ckpt.format)
    view = fmt.training_state  # the source's state placed for another format's writer (Megatron's groups)
    if view is not None:
        ckpt = view(ckpt, groups, native_names)
    elif ckpt.format == "deepspeed" and not groups:  # AutoEP: the model class's names, unless native_names
        ckpt = hf_moe.training_view(ckpt, native_names, layout)
        if layout == "torchtitan" and not ckpt.extra.get("titan_names"):  # a Llama: torchtitan's Llama 3 names
            ckpt = titan_dense.titan_view(ckpt)
    elif groups or native_names:  # a Megatron source's options: never ignored for another
        raise OptionError(f"--{'groups' if groups else 'native-names'} applies to a Megatron-Core source; this "
                          f"{ckpt.format} checkpoint records its own groups and names", path=path,
                          hint=f"drop --{'groups' if groups else 'native-names'}")
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, to)
    _check_out(out, overwrite, source)  # before planning or writing anything
    plan = plan_convert(ckpt, to, adam_mode, checkpoint_id=os.path.abspath(out), layout=layout, torchtitan=torchtitan)
    if view is not None:  # what the source holds that no DCP key carries
        for what, why in fmt.side_state(ckpt)["left"].items():
            plan.not_carried[what] = why
            plan.notes.append(f"left out {what}: {why}")
    result = ConvertResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    return _execute(result, ckpt, source, t0, group, workers, overwrite, progress, durable)


def convert_to(path: str, to: str, out: str | None, tag: str | None, dry_run: bool, overwrite: bool, workers,
               progress, durable: bool, storage_options: dict | None, group, options: dict) -> ConvertResult:
    """The generic route: the target format's writer from the registry (its ``plan_convert(ckpt, out, options)``),
    one engine, one publish path. ``options``: the target's own (the others were refused before)."""
    t0 = time.perf_counter()
    target = format_named(to)
    given = {k for k, v in options.items() if v is not None}
    if target.plan_convert is None or not given <= set(target.convert_options):
        raise InvalidArgument(f"--to {to}: " + ("zckpt does not write this format" if target.plan_convert is None else
                                                f"{', '.join(sorted(given - set(target.convert_options)))} do not "
                                                "apply"))
    if group is not None:
        raise InvalidArgument(f"convert --to {to} runs in one process, not under a launcher",
                              hint="run it without torchrun / srun")
    ckpt = open_checkpoint(path, tag, storage_options)
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, to)
    _check_out(out, overwrite, source)  # before planning or writing anything
    source_fmt = format_named(ckpt.format)
    if source_fmt.name != to and source_fmt.side_state is not None:  # what the source holds beside the state
        options = {**options, "side": source_fmt.side_state(ckpt)}
        if source_fmt.name == "deepspeed":  # DeepSpeed's own Adam: its config says whether it was AdamW
            options["side"]["adam_w_mode"] = config_adam_w_mode(ckpt.ds_config)
    plan = target.plan_convert(ckpt, os.path.abspath(out), options)
    result = ConvertResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    return _execute(result, ckpt, source, t0, None, workers, overwrite, progress, durable)


def _execute(result: ConvertResult, ckpt, source, t0: float, group, workers, overwrite: bool, progress,
             durable: bool) -> ConvertResult:
    """Run ``result.plan`` (in this process, or split over a launcher's ranks), every input byte CRC-checked; the
    result's timings."""
    plan, out = result.plan, result.output
    t_plan = time.perf_counter()
    check = checksums.input_check(ckpt)
    try:
        if group is not None:
            from zckpt.engine import distributed
            stats = distributed.run_convert(group, plan, out, workers=workers, overwrite=overwrite,
                                            progress=progress, durable=durable, source=source,
                                            storage_options=ckpt.storage_options, check=check).to_json()
        else:
            stats = {"ranks": 1, **(execute(plan, out, workers, overwrite, progress, durable, source,
                                            ckpt.storage_options, check) or {})}
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {**stats, "plan_seconds": round(t_plan - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    return result
