"""The plain values ``zckpt diff`` compares beside the tensors (:mod:`zckpt.ops.diff`): each side's counters
(global steps and samples, the scheduler's state, Megatron-Core's scheduler and FLOP count) and DeepSpeed's client
state (what ``load_checkpoint`` returns; ``client_state.<key>`` in a DCP conversion), flattened as DCP flattens a
state; compared into the diff's result. ``sa`` / ``sb``: the two :class:`zckpt.ops.diff.Side` s."""

from __future__ import annotations

import math

from zckpt.engine.compare import DiffResult, ValueDiff
from zckpt.errors import ZckptError
from zckpt.state.model import Checkpoint


#: counters a training state keeps as client state (Megatron-Core's scheduler and FLOP count, as convert carries them)
CLIENT_COUNTERS = ("opt_param_scheduler", "num_floating_point_operations_so_far")


def plain(value):
    """A metadata value as JSON holds it (tuples as lists, numbers as numbers, the rest as text)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def flat(prefix: str, value, out: dict, skipped: list[str] | None = None) -> None:
    """``value`` flattened into ``prefix.key`` plain values as DCP flattens a state (dicts and lists of containers
    by key and index, a list of scalars whole: a scheduler's state dict, a client state); ``skipped``: where a value
    is not plain data (a tensor, an object)."""
    if isinstance(value, dict):
        for k, v in value.items():
            flat(f"{prefix}.{k}", v, out, skipped)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        for i, v in enumerate(value):
            flat(f"{prefix}.{i}", v, out, skipped)
    elif _scalar(value) or (isinstance(value, (list, tuple)) and all(_scalar(v) for v in value)):
        out[prefix] = plain(value)
    elif skipped is not None:
        skipped.append(f"{prefix} (a {type(value).__name__})")


def side_counters(ckpt: Checkpoint) -> dict:
    out: dict = {}
    if ckpt.format == "dcp":
        from zckpt.dcp import sidestate
        try:
            side = sidestate.side_state(ckpt)
        except ZckptError:
            return out
        out.update({k: v for k, v in side["train_state"].items()})
        if side.get("lr_scheduler"):
            for k, v in side["lr_scheduler"].items():
                flat(f"lr_scheduler.{k}", v, out)
        for k, v in (side.get("client_state") or {}).items():  # (a Megatron source's scheduler, as convert kept it)
            if k.split(".")[0] in CLIENT_COUNTERS:
                flat(k, v, out)
        return out
    ms = ckpt.model_state or {}
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if isinstance(ms.get(k), (int, float)) and not isinstance(ms.get(k), bool):
            out[k] = ms[k]
    sched = ms.get("lr_scheduler")
    if isinstance(sched, dict):
        flat("lr_scheduler", sched, out)
    for k in CLIENT_COUNTERS:
        if k in ms:
            flat(k, ms[k], out)
    return out


def client_state(ckpt: Checkpoint) -> tuple[dict | None, list[str]]:
    """The client state (:attr:`Side.client`) and the keys left out as not plain data; (None, []) for a format
    without one (Hugging Face weights, Megatron-Core, whose scheduler and FLOP count are counters) and a DCP
    checkpoint that holds none."""
    if ckpt.format == "deepspeed":
        items = ckpt.client_state.items()
    elif ckpt.format == "dcp":  # (none: a layout without the place, torchtitan's or a Trainer's, or none kept)
        from zckpt.dcp import sidestate
        try:
            items = sidestate.side_state(ckpt)["client_state"].items()
        except ZckptError:
            return None, []
        if not items:
            return None, []
    else:
        return None, []
    out: dict = {}
    skipped: list[str] = []
    for k, v in items:
        if str(k).split(".")[0] not in CLIENT_COUNTERS:  # (compared as counters)
            flat(f"client_state.{k}", v, out, skipped)
    return out, skipped


def equal_values(x, y) -> bool:
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(equal_values(p, q) for p, q in zip(x, y))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) \
            and not isinstance(y, bool):
        return float(x) == float(y)
    return x == y


def compare_counters(sa, sb, result: DiffResult) -> None:
    for key in [k for k in sa.counters if k in sb.counters]:
        x, y = sa.counters[key], sb.counters[key]
        result.values.append(ValueDiff(key, "counters", "equal" if equal_values(x, y) else "differ", x, y))
    for side, s, o in (("A", sa, sb), ("B", sb, sa)):
        alone = [k for k in s.counters if k not in o.counters]
        if alone:
            result.not_compared.append(f"counters of {side} the other side does not hold: "
                                       f"{', '.join(alone[:6])}{' ...' if len(alone) > 6 else ''}")
    compare_client(sa, sb, result)


def compare_client(sa, sb, result: DiffResult) -> None:
    """Client state: each key both sides hold compared as a value; a key one side holds and the other not is a
    difference (what DeepSpeed's load_checkpoint returns would differ); a side without such a place is said."""
    for side, s in (("A", sa), ("B", sb)):
        if s.client_skipped:
            more = " ..." if len(s.client_skipped) > 6 else ""
            result.not_compared.append(f"client state of {side} that is not plain data: "
                                       f"{', '.join(s.client_skipped[:6])}{more}")
    if sa.client is None or sb.client is None:
        for side, s, o in (("A", sa, sb), ("B", sb, sa)):
            if s.client and o.client is None:
                result.not_compared.append(f"client state of {side}: the other side holds none (its format or "
                                           f"layout, {o.ckpt.format}, may have no place for it)")
        return
    for key in [k for k in sa.client if k in sb.client]:
        x, y = sa.client[key], sb.client[key]
        result.values.append(ValueDiff(key, "counters", "equal" if equal_values(x, y) else "differ", x, y))
    result.only_in_a.extend(k for k in sa.client if k not in sb.client)
    result.only_in_b.extend(k for k in sb.client if k not in sa.client)
