"""Which option applies to what: one table for every command, checked before any command runs.

An option given on the command line that does not apply to the target, layout, format or command chosen is a
usage error (exit 2, :class:`zckpt.errors.OptionError`) naming it, never silently ignored; so is a required one
left out, and one that contradicts the config file another option names. A row says, for one option of one
command (its click parameter name), under which values of the other parameters it applies (``when``: parameter
-> the values it must have, or a predicate); ``values`` narrows the row to some of the option's own values
(``--layout torchtitan`` applies to ``--to dcp``, another target's layouts to it); ``required``: it must be given
whenever the row's ``when`` holds. An option without rows applies everywhere. A new target (``--to X``) or
option is new rows here and nothing else: :func:`check` runs for every command (``global_options``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import click


@dataclass(frozen=True)
class Cond:
    """A predicate on one parameter's value, with the words that say it (``--to deepspeed``, ``a URL``)."""

    test: Callable[[Any], bool]
    words: str  # what the value must be, e.g. "given", "a URL"


GIVEN = Cond(lambda v: v is not None and v != () and v is not False, "given")
ABSENT = Cond(lambda v: v is None or v == () or v is False, "not given")
URL = Cond(lambda v: isinstance(v, str) and "://" in v, "a URL")
S3 = Cond(lambda v: isinstance(v, str) and v.startswith("s3://"), "an s3:// URL")


@dataclass(frozen=True)
class Row:
    command: str
    option: str
    when: dict = field(default_factory=dict)  # parameter -> tuple of values, or a Cond
    values: tuple | None = None  # the option's own values this row is about (None: any)
    required: bool = False


_TO_DEEPSPEED = {"to": ("deepspeed",)}
_TORCHTITAN = {"to": ("dcp",), "layout": ("torchtitan",)}

RULES: list[Row] = [
    # convert: what each target takes
    Row("convert", "world_size", _TO_DEEPSPEED, required=True),
    Row("convert", "stage", _TO_DEEPSPEED),  # required unless --ds-config states it (check_convert_config)
    Row("convert", "ds_config", _TO_DEEPSPEED),
    Row("convert", "dtype", _TO_DEEPSPEED),
    Row("convert", "buffers", _TO_DEEPSPEED),
    Row("convert", "tied", _TO_DEEPSPEED),
    Row("convert", "layout", {}, values=("auto",)),
    Row("convert", "layout", {"to": ("dcp",)}, values=("dcp", "trainer", "torchtitan")),
    Row("convert", "ntokens_seen", _TORCHTITAN),
    Row("convert", "lr_last_epoch", _TORCHTITAN),
    Row("convert", "initial_lr", _TORCHTITAN),
    Row("convert", "adam_mode", {"to": ("dcp",)}),  # DeepSpeed's FusedAdam / CPUAdam, written as torch AdamW
    Row("convert", "tag", {"to": ("dcp", "megatron")}),  # a DeepSpeed tag or Megatron iteration; --to deepspeed
    # reads a DCP / Megatron folder
    Row("convert", "workers", {"to": ("dcp", "deepspeed", "megatron")}),
    Row("convert", "tp", {"to": ("megatron",)}),  # the Megatron target's parallel sizes (zckpt/megatron/writer.py)
    Row("convert", "pp", {"to": ("megatron",)}),
    Row("convert", "ep", {"to": ("megatron",)}),  # an MoE target's expert-parallel size (megatron/writer_moe.py)
    Row("convert", "megatron_args", {"to": ("megatron",)}),  # a non-Megatron run's schedule (megatron/run_args.py)
    Row("convert", "dp", {"to": ("megatron",), "layout": ("dp_reshardable",)}),  # the buckets' shape (writer_buckets)
    Row("convert", "ddp_config", {"to": ("megatron",), "layout": ("dp_reshardable",)}),  # the target's DDP settings (writer_buckets)
    Row("convert", "layout", {"to": ("megatron",)}, values=("fully_reshardable", "dp_reshardable")),
    Row("convert", "groups", {"to": ("dcp", "deepspeed")}),  # a Megatron source's groups for another format
    Row("convert", "native_names", {"to": ("dcp", "deepspeed")}),
    Row("convert", "hf_config", _TO_DEEPSPEED),  # a torchtitan save's transformers class (dcp/titan_hf.py)
    # reshard: DeepSpeed's BF16 optimizer is a ZeRO-1 optimizer (stage 1, or the source's when --stage is not given)
    Row("reshard", "bf16_optimizer", {"stage": (None, 1)}),
    # merge: an output URL's own storage options
    Row("merge", "output_storage_options", {"out": URL}),
    # push
    Row("push", "once", {"every": ABSENT}),
    Row("push", "allow_empty", {"every": ABSENT}),  # --every always goes on waiting
    Row("push", "part_size", {"dest": S3}),  # S3 multipart uploads
    # estimate: the model size from exactly one source
    Row("estimate", "largest_text", {"params_text": GIVEN}),
    Row("estimate", "largest_text", {"params_text": GIVEN}, required=True),
    Row("estimate", "params_text", {"path": ABSENT, "config_path": ABSENT}),
    Row("estimate", "config_path", {"path": ABSENT}),
    Row("estimate", "tag", {"path": GIVEN}),
    Row("estimate", "headroom_text", {"gpu_memory_text": GIVEN}),
]


def _given(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def _flag(ctx: click.Context, name: str) -> str:
    """A parameter as the user types it (as error messages name it: ``-o``, ``--world-size``, ``DEST``)."""
    for p in ctx.command.params:
        if p.name == name:
            if isinstance(p, click.Argument):
                return p.name.upper()
            longs = [o for o in p.opts if o.startswith("--")]
            return "-o" if "-o" in p.opts else (longs[0] if longs else p.opts[0])
    return "--" + name.replace("_", "-")


def _holds(cond, value) -> bool:
    return cond.test(value) if isinstance(cond, Cond) else value in cond


def _say(ctx: click.Context, name: str, cond) -> str:
    """What ``cond`` asks of parameter ``name``: ``--to deepspeed``, ``--every not given``, ``-o a URL``."""
    flag = _flag(ctx, name)
    if cond is ABSENT:
        return f"without {flag}"
    if isinstance(cond, Cond):
        return f"with {flag} {cond.words}" if cond is not GIVEN else f"with {flag}"
    said = f"with {flag} {'/'.join(str(v) for v in cond if v is not None)}"
    return f"{said} (or no {flag})" if None in cond else said


def _now(ctx: click.Context, name: str, cond) -> str:
    """What parameter ``name`` is now, where ``cond`` does not hold: ``--to dcp``, ``--every 30m``, ``no PATH``."""
    flag, value = _flag(ctx, name), ctx.params.get(name)
    if isinstance(cond, Cond):
        if cond is GIVEN:
            return f"no {flag}"
        return f"{flag} {value}" if value not in (None, True) else flag
    return f"{flag} {value}"


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return "" if value is True else f" {value}"


def check(ctx: click.Context | None) -> None:
    """Refuse (:class:`OptionError`) an option of ``ctx``'s command given where it does not apply, or missing where
    it is required, by :data:`RULES`."""
    if ctx is None or ctx.command is None:
        return
    from zckpt.errors import OptionError

    command, params = ctx.command.name, ctx.params
    rows = [r for r in RULES if r.command == command]
    for option in dict.fromkeys(r.option for r in rows):
        if option not in params:
            continue
        value = params[option]
        own = [r for r in rows if r.option == option and (r.values is None or value in r.values)]
        if _given(ctx, option) and own and not any(all(_holds(c, params.get(p)) for p, c in r.when.items())
                                                   for r in own):
            row = own[0]
            wrong = [(p, c) for p, c in row.when.items() if not _holds(c, params.get(p))]
            needs = " and ".join(_say(ctx, p, c) for p, c in row.when.items())
            alts = [" and ".join(_say(ctx, p, c) for p, c in r.when.items()) for r in own[1:] if r.when]
            needs = " or ".join(dict.fromkeys([needs, *alts]))
            now = ", ".join(_now(ctx, p, c) for p, c in wrong)
            flag = _flag(ctx, option)
            what = f"{_shown(value).strip()} " if row.values else ""
            raise OptionError(f"{what}does not apply here ({now}): only {needs}", param=option,
                              hint=f"drop {flag}, or see zckpt {command} --help")
        for r in rows:
            if r.option == option and r.required and not _given(ctx, option) and value in (None, ()) \
                    and all(_holds(c, params.get(p)) for p, c in r.when.items()):
                needs = " and ".join(_say(ctx, p, c) for p, c in r.when.items())
                raise OptionError(f"missing option, required {needs}", param=option,
                                  hint=f"pass {_flag(ctx, option)}, see zckpt {command} --help")


def convert_config(ds_config: str | None, stage: int | None, dtype: str | None, storage_options=None) -> int | None:
    """``convert --to deepspeed``: the ZeRO stage to write, checked against the config ``--ds-config`` names:
    ``--stage`` (or, without it, the config's ``zero_optimization.stage``); ``--stage`` or ``--dtype`` that
    contradicts the config is refused (:class:`OptionError`), and so is no stage from either. A config that cannot
    be read is left to the library, which says why."""
    import json

    from zckpt.errors import OptionError
    from zckpt.io import storage

    cfg = None
    if ds_config is not None:
        try:
            cfg = json.loads(storage.read_bytes(ds_config, storage_options))
        except (OSError, ValueError, TypeError):
            cfg = None
    said = None
    if isinstance(cfg, dict) and isinstance(cfg.get("zero_optimization"), dict):
        said = cfg["zero_optimization"].get("stage")
    if stage is not None and said is not None and said != stage:
        raise OptionError(f"{stage} contradicts the DeepSpeed config, whose zero_optimization.stage is {said}",
                          param="stage", path=ds_config, hint="drop --stage (the config says it), or fix the config")
    if isinstance(cfg, dict) and dtype is not None:
        from zckpt.deepspeed.from_state import precision_of
        if precision_of(cfg) != dtype:
            raise OptionError(f"{dtype} contradicts the DeepSpeed config, which trains in {precision_of(cfg)}",
                              param="dtype", path=ds_config, hint="drop --dtype (the config says it)")
    if stage is None and said in (1, 2, 3):
        return said
    if stage is None:
        raise OptionError("missing option, required with --to deepspeed" + (" (the DeepSpeed config names no "
                          "zero_optimization.stage)" if cfg is not None else ""), param="stage",
                          hint="pass --stage 1, 2 or 3")
    return stage
