"""Megatron-Core's whole training state for another format's writer (``zckpt convert`` of a Megatron checkpoint).

The reader (:mod:`zckpt.megatron.reader`) gives, for a ``fully_reshardable`` save, every parameter's fp32 master
and both Adam moments in model space (for a ``dp_reshardable`` save, :mod:`zckpt.megatron.buckets` places them
from the flat buckets and checks them against the saved weights), and the param groups (hyperparameters and Adam's
one step) -- but not which parameter is in which group: Megatron saves each group's ``params`` as a non-persistent object. So
the membership is never read off the shapes silently; the user states it, and it is checked against what the
files do say:

- ``groups="megatron-default"``: the groups Megatron-Core's ``_get_param_groups`` builds with its standard
  overrides (``get_standard_config_overrides``, megatron-core 0.16): parameters of one dimension or named
  ``*.bias`` in a group of ``wd_mult`` 0.0, the rest in the default group, the default group first. Refused when
  the args say the run changed that rule (``decoupled_lr``, ``apply_wd_to_qk_layernorm``) or when the files'
  groups are not exactly those two (or one) with those ``wd_mult`` / ``lr_mult`` values.
- ``groups=["GLOB=K", ...]``: parameters whose Megatron name matches GLOB (fnmatch, first match wins) are in the
  files' group K; every parameter with optimizer state must match, every group must get one.

The result is a :class:`~zckpt.state.model.Checkpoint` any writer reads (groups with names, records with their
group, Megatron's counters as ``global_steps`` / ``global_samples``, its scheduler and FLOP count as client
state), under Hugging Face Llama's names (weights, masters and moments split the same way) when the files say the
model is Llama-shaped, else Megatron's own.
"""

from __future__ import annotations

import dataclasses
import fnmatch

from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.megatron import buckets, hf_names, moe
from zckpt.state.model import Checkpoint, GroupInfo

DEFAULT_RULE = "megatron-default"
GROUPS_HINT = (f"pass --groups {DEFAULT_RULE} if the run used Megatron's standard groups (1-D parameters and "
               "biases without weight decay), or --groups 'GLOB=K' per group (Megatron names, e.g. "
               "'*norm*=1' '*=0')")
_TORCH_DROP = ("step", "params")  # Adam's step is per parameter in torch's state; params are the names


def _default_rule(ckpt: Checkpoint, stateful: list, files_groups: list[dict], path: str) -> list[list[str]]:
    args = ckpt.extra.get("args") or {}
    for key, bad in (("decoupled_lr", lambda v: v is not None), ("apply_wd_to_qk_layernorm", lambda v: v is True)):
        if key in args and bad(args[key]):
            raise UnsupportedLayout(f"the run's args set {key}={args[key]!r}, so its groups are not Megatron's "
                                    f"standard two; {DEFAULT_RULE} does not apply", path=path,
                                    hint="name each group with --groups 'GLOB=K'")
    # a mixture-of-experts model's experts are the second optimizer's (is_expert_parallel groups, after the dense);
    # at expert-parallel size 1 they are ordinary parameters of the one optimizer (no such group)
    wanted = []
    split = any(g.get("is_expert_parallel") for g in files_groups)
    for expert in (False, True) if split else (False,):
        mine = [r for r in stateful if bool(moe.expert_of(r.name)) == expert] if split else stateful
        no_wd = [r.name for r in mine if len(r.shape) == 1 or r.name.endswith(".bias")]
        rest = [r.name for r in mine if r.name not in set(no_wd)]
        wanted += [(names, wd, expert) for names, wd in ((rest, 1.0), (no_wd, 0.0)) if names]
    moe_run = any(e for _, _, e in wanted)
    got = [(g.get("wd_mult"), g.get("lr_mult"), g.get("is_decoupled_lr"))
           + ((g.get("is_expert_parallel"),) if moe_run else ()) for g in files_groups]
    expect = [(wd, 1.0, False) + ((e,) if moe_run else ()) for _, wd, e in wanted]
    if got != expect:
        raise UnsupportedLayout(f"common.pt's param groups (wd_mult, lr_mult, is_decoupled_lr"
                                f"{', is_expert_parallel' if moe_run else ''}: {got}) are not the "
                                f"groups {DEFAULT_RULE} gives for these parameters ({expect})", path=path,
                                hint="name each group with --groups 'GLOB=K'")
    for i, g in enumerate(files_groups):
        if g.get("wd_mult") == 0.0 and float(g.get("weight_decay", 0.0)) != 0.0:
            raise UnsupportedLayout(f"param group {i} has wd_mult 0 and weight decay {g.get('weight_decay')}",
                                    path=path)
    return [names for names, _, _ in wanted]


def _globs(spec: list[str], stateful: list, n_groups: int, path: str) -> list[list[str]]:
    rules = []
    for item in spec:
        glob, eq, k = item.rpartition("=")
        if not eq or not glob or not k.strip().isdigit():
            raise InvalidArgument(f"--groups {item!r}: expected GLOB=K (K a param group index of the checkpoint) "
                                  f"or {DEFAULT_RULE}")
        if int(k) >= n_groups:
            raise InvalidArgument(f"--groups {item!r}: the checkpoint has {n_groups} param group(s), 0 to "
                                  f"{n_groups - 1}", path=path)
        rules.append((glob, int(k)))
    members: list[list[str]] = [[] for _ in range(n_groups)]
    for rec in stateful:
        k = next((k for glob, k in rules if fnmatch.fnmatchcase(rec.name, glob)), None)
        if k is None:
            raise InvalidArgument(f"--groups: '{rec.name}' matches no GLOB=K", path=path,
                                  hint="every parameter with optimizer state needs a group; end with '*=0'")
        members[k].append(rec.name)
    empty = [i for i, m in enumerate(members) if not m]
    if empty:
        raise InvalidArgument(f"--groups: param group {empty[0]} of the checkpoint gets no parameter", path=path,
                              hint="each group common.pt holds had parameters in the run")
    return members


def training_state(ckpt: Checkpoint, groups, native_names: bool = False) -> Checkpoint:
    """``ckpt`` (read by :mod:`zckpt.megatron.reader`) with its optimizer state placed: groups as ``groups`` says
    (see the module docstring), records under Llama's names unless ``native_names`` or the model is not
    Llama-shaped (a note says which)."""
    path = ckpt.location.tag_dir
    layout = ckpt.extra["megatron"].get("optimizer_layout")
    if layout == "dp_reshardable":  # the buckets' state, placed by the reader and checked against the weights here
        if ckpt.extra.get("bucket_error") is not None:
            raise ckpt.extra["bucket_error"]
        if not groups:
            raise InvalidArgument("Megatron's param groups do not list their parameters, and zckpt does not guess "
                                  "which parameter is in which", path=path, hint=GROUPS_HINT)
        ckpt = buckets.attach(ckpt)  # reads every master and weight once: after the checks that cost nothing
    stateful = [r for r in ckpt.records if r.kind == "trainable" and r.exp_avg]
    files_groups = ckpt.extra.get("param_groups") or []
    if not stateful or not files_groups:
        raise UnsupportedLayout("the checkpoint holds no optimizer state (masters, moments and param groups) to "
                                "carry", path=path, hint="zckpt merge writes the weights")
    if ckpt.extra.get("step") is None:
        raise UnsupportedLayout("common.pt's param groups do not agree on Adam's step", path=path)
    if not groups:
        raise InvalidArgument("Megatron's param groups (common.pt) do not list their parameters, and zckpt does not "
                              "guess which parameter is in which", path=path, hint=GROUPS_HINT)
    spec = [groups] if isinstance(groups, str) else list(groups)
    if spec == [DEFAULT_RULE]:
        members = _default_rule(ckpt, stateful, files_groups, path)
    else:
        members = _globs(spec, stateful, len(files_groups), path)
    group_of = {n: i for i, names in enumerate(members) for n in names}
    records = []
    for rec in ckpt.records:
        if rec.kind == "trainable" and not rec.exp_avg:  # not in the optimizer: a frozen weight, as Megatron held it
            rec = dataclasses.replace(rec, kind="frozen")
        records.append(dataclasses.replace(rec, group=group_of.get(rec.name)))
    notes = [f"param groups as stated ({', '.join(spec)}): " +
             "; ".join(f"{i}: {len(m)} parameter(s), weight decay {files_groups[i].get('weight_decay')}"
                       for i, m in enumerate(members))]
    view = dataclasses.replace(ckpt, records=records)
    mapped = None if native_names else hf_names.state_view(view)
    if mapped is not None:
        records, renamed = mapped
        # (each layer's experts are one fused tensor under Mixtral's names: listed once)
        members = [list(dict.fromkeys(hf for n in names for hf in renamed[n])) for names in members]
        order = {r.name: i for i, r in enumerate(records)}
        members = [sorted(m, key=order.__getitem__) for m in members]
        notes.append("Hugging Face Mixtral names (qkv split per query group, each layer's experts fused as "
                     "MixtralExperts' gate_up_proj and down_proj, the router as mlp.gate; the masters and both "
                     "moments split and fused the same way), in MixtralForCausalLM's parameter order"
                     if ckpt.extra.get("moe_coverage") else
                     "Hugging Face Llama names (qkv split per query group, fc1 into gate and up; the masters and "
                     "both moments split the same way), in LlamaForCausalLM's parameter order")
    else:
        notes.append("Megatron's own names (decoupled from any Hugging Face model: "
                     + ("--native-names)" if native_names else "the files do not say the model is Llama-shaped)"))
    step = ckpt.extra["step"]
    infos = [GroupInfo(i, {k: v for k, v in g.items() if k not in _TORCH_DROP}, step, list(m))
             for i, (g, m) in enumerate(zip(files_groups, members))]
    kept = [n for n in ckpt.notes if not n.startswith("param groups unknown")
            and not (mapped is not None and n.startswith("names are Megatron's"))]
    return dataclasses.replace(ckpt, records=records, groups=infos, state_refusal=None, notes=kept + notes,
                               model_state=_model_state(ckpt, step, path),
                               extra={**ckpt.extra, "state_notes": notes})


def _model_state(ckpt: Checkpoint, step, path: str) -> dict:
    """Megatron's counters and scheduler as the training-state model keeps them: ``global_steps`` (its
    ``iteration``, which must be Adam's step: no skipped iteration), ``global_samples`` (``consumed_train_samples``
    of the args), the rest as client state."""
    f, common = ckpt.extra["megatron"], ckpt.extra.get("common") or {}
    iteration = f.get("iteration")
    if iteration is not None and iteration != step:
        raise UnsupportedLayout(f"iteration {iteration} but Adam's step {step}: iterations were skipped, which "
                                "another format's counters cannot say", path=path)
    out = {"global_steps": step}
    samples = (ckpt.extra.get("args") or {}).get("consumed_train_samples")
    if isinstance(samples, int) and not isinstance(samples, bool):
        out["global_samples"] = samples
    sched = common.get("opt_param_scheduler")
    if isinstance(sched, dict) and sched:
        out["opt_param_scheduler"] = dict(sched)
    flops = common.get("num_floating_point_operations_so_far")
    if isinstance(flops, (int, float)) and not isinstance(flops, bool):
        out["num_floating_point_operations_so_far"] = flops
    return out


def side_state(ckpt: Checkpoint) -> dict:
    """What a state from :func:`training_state` holds beside model and optimizer, as the DeepSpeed writer takes it
    (:func:`zckpt.deepspeed.from_state.deepspeed_source`), and what it leaves out."""
    ms = ckpt.model_state
    counters = {k: ms[k] for k in ("global_steps", "global_samples") if k in ms}
    client = {k: v for k, v in ms.items() if k not in counters}
    left = {"rng_state": "per-rank RNG states of Megatron's ranks (another world size reseeds)",
            "args": "Megatron-LM's argparse Namespace (a run's command line, not training state)"}
    return {"train_state": counters, "lr_scheduler": None, "client_state": client, "left": left}
