"""What Megatron-LM needs to resume a run that Megatron did not train (``convert --to megatron --megatron-args``):
the learning-rate and weight-decay schedule, the global batch and the run's length, stated as the flags the user will
give ``pretrain_gpt.py``; from them the scheduler state, the param groups' Megatron settings and the consumed
samples, made as Megatron-LM makes them.

Only the flags below are read (each as Megatron-LM's argparse defines it, its default where not given); any other
is refused in one line, never ignored. From them, as Megatron-LM ``core_v0.16.1`` does:

- ``validate_args``: iteration- or sample-based, never both; ``--weight-decay-incr-style constant`` makes
  ``start_weight_decay`` = ``end_weight_decay`` = ``--weight-decay`` (and refuses either being given), another style
  needs both;
- ``training.get_optimizer_param_scheduler``: ``lr_decay_steps`` = ``--lr-decay-iters`` (default ``--train-iters``)
  x global batch, or ``--lr-decay-samples`` (default ``--train-samples``); ``wd_incr_steps`` = the run's length in
  samples; ``lr_warmup_steps`` = ``--lr-warmup-fraction`` x ``lr_decay_steps``, else ``--lr-warmup-iters`` x global
  batch (``--lr-warmup-samples``); WSD's decay steps likewise; the ``OptimizerParamScheduler`` asserts;
- the scheduler stepped to the source's step: ``num_steps`` = Adam's step x global batch (one
  ``step(increment=global batch)`` per successful iteration), its ``state_dict()`` and the lr and weight decay its
  ``get_lr`` / ``get_wd`` give each group there (the same arithmetic, in the same order);
- megatron-core's ``_get_param_groups`` with the standard overrides: group 0 ``wd_mult`` 1 (every parameter of two or
  more dimensions that is not a bias), group 1 ``wd_mult`` 0 (1-D parameters and biases); ``lr_mult`` 1,
  ``max_lr`` = ``--lr``, ``min_lr`` = ``--min-lr``; betas and eps carried from the source's groups.

What both the source and the flags say is checked: each parameter's weight decay in the source equals the one
Megatron gives it at that step, the groups' betas / eps equal ``--adam-beta1/2`` / ``--adam-eps`` where given, one lr
for every group (Megatron's standard groups share one schedule), decoupled weight decay (Megatron's Adam), no
amsgrad, the source's sample count equal to step x global batch, a run (``--train-iters`` / ``--train-samples``)
that goes past the source's iteration. A contradiction is refused in one line naming both values; nothing is picked
silently.
"""

from __future__ import annotations

import math
import shlex

from zckpt.errors import OptionError, UnsupportedLayout

OPTION = "--megatron-args"
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")
#: flag -> (args name, type or choices, Megatron-LM 0.16.1's default)
FLAGS = {
    "--lr": ("lr", float, None),
    "--min-lr": ("min_lr", float, 0.0),
    "--lr-decay-style": ("lr_decay_style", DECAY_STYLES, "linear"),
    "--lr-wsd-decay-style": ("lr_wsd_decay_style", WSD_STYLES, "exponential"),
    "--lr-decay-iters": ("lr_decay_iters", int, None),
    "--lr-decay-samples": ("lr_decay_samples", int, None),
    "--lr-wsd-decay-iters": ("lr_wsd_decay_iters", int, None),
    "--lr-wsd-decay-samples": ("lr_wsd_decay_samples", int, None),
    "--lr-warmup-fraction": ("lr_warmup_fraction", float, None),
    "--lr-warmup-iters": ("lr_warmup_iters", int, 0),
    "--lr-warmup-samples": ("lr_warmup_samples", int, 0),
    "--lr-warmup-init": ("lr_warmup_init", float, 0.0),
    "--train-iters": ("train_iters", int, None),
    "--train-samples": ("train_samples", int, None),
    "--global-batch-size": ("global_batch_size", int, None),
    "--weight-decay": ("weight_decay", float, 0.01),
    "--start-weight-decay": ("start_weight_decay", float, None),
    "--end-weight-decay": ("end_weight_decay", float, None),
    "--weight-decay-incr-style": ("weight_decay_incr_style", WD_STYLES, "constant"),
    "--adam-beta1": ("adam_beta1", float, None),  # None: the source's (checked where given)
    "--adam-beta2": ("adam_beta2", float, None),
    "--adam-eps": ("adam_eps", float, None),
}
REQUIRED = ("--lr", "--global-batch-size")
EXAMPLE = ("--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 1000 "
           "--global-batch-size 8")


def _bad(message: str) -> OptionError:
    return OptionError(f"{OPTION}: {message}", hint=f"e.g. {OPTION} '{EXAMPLE}'; the flags are pretrain_gpt.py's")


def parse(text) -> dict:
    """``text`` (one string, split as a shell does, or a list of words) -> {args name: value}, every known flag
    present (Megatron-LM's default where not given) plus ``given``: the flags stated. One line
    (:class:`OptionError`, exit 2) for a flag not understood, a value of the wrong type, a flag given twice."""
    words = shlex.split(text) if isinstance(text, str) else [str(w) for w in text]
    out, given = {dest: default for dest, _, default in FLAGS.values()}, []
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, value = word.partition("=")
        if flag not in FLAGS:
            raise _bad(f"{word!r} is not a flag zckpt reads (it reads {', '.join(FLAGS)})" if word.startswith("-")
                       else f"{word!r} is not a flag")
        if not eq:
            if i + 1 >= len(words):
                raise _bad(f"{flag} needs a value")
            value, i = words[i + 1], i + 1
        i += 1
        if flag in given:
            raise _bad(f"{flag} is given twice")
        dest, kind, _ = FLAGS[flag]
        out[dest] = _value(flag, kind, value)
        given.append(flag)
    out["given"] = given
    return out


def _value(flag: str, kind, value: str):
    if isinstance(kind, tuple):
        if value not in kind:
            raise _bad(f"{flag} {value!r} is not one of {', '.join(kind)}")
        return value
    try:
        v = kind(value)
    except ValueError:
        raise _bad(f"{flag} {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(v):
        raise _bad(f"{flag} {value!r} is not a finite number")
    return v


def schedule(a: dict) -> dict:
    """The ``OptimizerParamScheduler``'s constructor values as ``get_optimizer_param_scheduler`` makes them from the
    args ``a`` (after ``validate_args``), checked as both check them; ``a`` gains what ``validate_args`` sets."""
    missing = [f for f in REQUIRED if a[FLAGS[f][0]] is None]
    if not a["train_iters"] and not a["train_samples"]:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise _bad(f"{', '.join(missing)} not given: Megatron's scheduler and batch are made from them")
    gbs = a["global_batch_size"]
    if gbs < 1:
        raise _bad(f"--global-batch-size {gbs} is not a positive integer")
    if a["train_iters"]:
        for f in ("--train-samples", "--lr-decay-samples", "--lr-wsd-decay-samples"):
            if a[FLAGS[f][0]] is not None:
                raise _bad(f"{f} with --train-iters: Megatron-LM expects iteration-based training")
        if a["lr_warmup_samples"]:
            raise _bad("--lr-warmup-samples with --train-iters: Megatron-LM expects iteration-based warm-up")
        if a["lr_warmup_fraction"] is not None and a["lr_warmup_iters"]:
            raise _bad("both --lr-warmup-fraction and --lr-warmup-iters: Megatron-LM takes one")
        if a["lr_decay_iters"] is None:
            a["lr_decay_iters"] = a["train_iters"]
        decay = a["lr_decay_iters"] * gbs
        wd_steps = a["train_iters"] * gbs
        wsd = a["lr_wsd_decay_iters"] * gbs if a["lr_wsd_decay_iters"] is not None else None
        warmup = a["lr_warmup_fraction"] * decay if a["lr_warmup_fraction"] is not None else a["lr_warmup_iters"] * gbs
    else:
        for f in ("--lr-decay-iters", "--lr-wsd-decay-iters"):
            if a[FLAGS[f][0]] is not None:
                raise _bad(f"{f} with --train-samples: Megatron-LM expects sample-based training")
        if a["lr_warmup_iters"]:
            raise _bad("--lr-warmup-iters with --train-samples: Megatron-LM expects sample-based warm-up")
        if a["lr_warmup_fraction"] is not None and a["lr_warmup_samples"]:
            raise _bad("both --lr-warmup-fraction and --lr-warmup-samples: Megatron-LM takes one")
        if a["lr_decay_samples"] is None:
            a["lr_decay_samples"] = a["train_samples"]
        decay = a["lr_decay_samples"]
        wd_steps = a["train_samples"]
        wsd = a["lr_wsd_decay_samples"]
        warmup = a["lr_warmup_fraction"] * decay if a["lr_warmup_fraction"] is not None else a["lr_warmup_samples"]
    if a["weight_decay_incr_style"] == "constant":
        if a["start_weight_decay"] is not None or a["end_weight_decay"] is not None:
            raise _bad("--start-weight-decay / --end-weight-decay with --weight-decay-incr-style constant (Megatron-LM "
                       "takes --weight-decay then)")
        a["start_weight_decay"] = a["end_weight_decay"] = a["weight_decay"]
    elif a["start_weight_decay"] is None or a["end_weight_decay"] is None:
        raise _bad(f"--weight-decay-incr-style {a['weight_decay_incr_style']} needs --start-weight-decay and "
                   "--end-weight-decay")
    s = {"init_lr": a["lr_warmup_init"], "max_lr": float(a["lr"]), "min_lr": a["min_lr"], "lr_warmup_steps": warmup,
         "lr_decay_steps": decay, "lr_decay_style": a["lr_decay_style"], "start_wd": a["start_weight_decay"],
         "end_wd": a["end_weight_decay"], "wd_incr_steps": wd_steps, "wd_incr_style": a["weight_decay_incr_style"],
         "wsd_decay_steps": wsd, "lr_wsd_decay_style": a["lr_wsd_decay_style"]}
    checks = [(s["min_lr"] >= 0.0, "--min-lr is negative"), (s["max_lr"] >= s["min_lr"], "--lr is below --min-lr"),
              (s["init_lr"] <= s["max_lr"], "--lr-warmup-init is above --lr"),
              (s["lr_decay_steps"] > 0, "the decay comes to 0 steps"),
              (s["lr_warmup_steps"] < s["lr_decay_steps"], "the warm-up is not shorter than the decay"),
              (s["lr_decay_style"] != "WSD" or wsd is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters "
                                                                "(or -samples)"),
              (s["start_wd"] >= 0.0, "the start weight decay is negative"),
              (s["end_wd"] >= s["start_wd"], "the end weight decay is below the start")]
    for ok, why in checks:
        if not ok:
            raise _bad(f"{why}: Megatron-LM's OptimizerParamScheduler refuses it")
    return s


def check_length(a: dict, iteration: int) -> None:
    """The run the flags state goes past the source's ``iteration``: Megatron-LM trains ``while iteration <
    args.train_iters`` (``--train-samples``: ``train_samples // global batch`` iterations, ``update_train_iters``),
    so a run that ends at or before it stops at once and nothing is trained: refused (exit 2), naming both."""
    gbs, iters, samples = a["global_batch_size"], a["train_iters"], a["train_samples"]
    if iters:
        if iters <= iteration:
            raise _bad(f"--train-iters {iters} is not past the source's iteration {iteration}: Megatron-LM would stop "
                       "at once, nothing trained")
    elif samples is not None and samples // gbs <= iteration:
        raise _bad(f"--train-samples {samples} ({samples // gbs} iterations of --global-batch-size {gbs}) is not past "
                   f"the source's {iteration * gbs} samples (iteration {iteration}): Megatron-LM would stop at once, "
                   "nothing trained")


def lr_at(s: dict, n: int) -> float:
    """``OptimizerParamScheduler.get_lr`` (megatron-core 0.16.1) at ``num_steps`` ``n`` for a group whose max/min lr
    are the scheduler's."""
    max_lr, min_lr = s["max_lr"], s["min_lr"]
    if s["lr_warmup_steps"] > 0 and n <= s["lr_warmup_steps"]:
        return s["init_lr"] + ((max_lr - s["init_lr"]) * float(n) / float(s["lr_warmup_steps"]))
    style = s["lr_decay_style"]
    if style == "constant":
        return max_lr
    if n > s["lr_decay_steps"]:
        return min_lr
    if style == "inverse-square-root":
        warmup_steps = max(s["lr_warmup_steps"], 1)
        num_steps = max(n, 1)
        lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
        return max(min_lr, lr)
    decay_ratio = float(n - s["lr_warmup_steps"]) / float(s["lr_decay_steps"] - s["lr_warmup_steps"])
    delta_lr = max_lr - min_lr
    if style == "linear":
        coeff = 1.0 - decay_ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    else:  # WSD
        anneal_start = s["lr_decay_steps"] - s["wsd_decay_steps"]
        if n <= anneal_start:
            coeff = 1.0
        else:
            r = float(n - anneal_start) / float(s["wsd_decay_steps"])
            coeff = {"linear": lambda: 1.0 - r, "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": lambda: (2.0 * math.pow(0.5, r)) - 1.0,
                     "minus_sqrt": lambda: 1.0 - math.sqrt(r)}[s["lr_wsd_decay_style"]]()
    return min_lr + coeff * delta_lr


def wd_at(s: dict, n: int) -> float:
    """``OptimizerParamScheduler.get_wd`` at ``num_steps`` ``n``."""
    start, end = s["start_wd"], s["end_wd"]
    if n > s["wd_incr_steps"] or s["wd_incr_style"] == "constant":
        return end
    ratio = float(n) / float(s["wd_incr_steps"])
    coeff = ratio if s["wd_incr_style"] == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def state_dict(s: dict, n: int) -> dict:
    """``OptimizerParamScheduler.state_dict()`` at ``num_steps`` ``n`` (its keys, in its order)."""
    return {"max_lr": s["max_lr"], "lr_warmup_steps": s["lr_warmup_steps"], "num_steps": n,
            "lr_decay_style": s["lr_decay_style"], "lr_decay_steps": s["lr_decay_steps"], "min_lr": s["min_lr"],
            "start_wd": s["start_wd"], "end_wd": s["end_wd"], "wd_incr_style": s["wd_incr_style"],
            "wd_incr_steps": s["wd_incr_steps"]}


def no_decay(name: str, shape) -> bool:
    """megatron-core's standard overrides (``get_standard_config_overrides``): 1-D parameters and biases get
    ``wd_mult`` 0."""
    return len(shape) == 1 or name.endswith(".bias")


_SAME = ("betas", "eps")


def megatron_groups(ckpt, a: dict, step: int, adam_w_mode: bool | None = None) -> tuple[list[dict], dict, dict]:
    """(the param groups megatron-core makes, as its optimizer saves them at ``step``; the scheduler's state; the
    facts the notes say) for the source ``ckpt`` (Hugging Face names) and the parsed flags ``a``; every contradiction
    between the source's groups and the flags refused in one line. ``adam_w_mode``: whether the source's Adam
    decoupled its weight decay where its groups do not say (DeepSpeed's FusedAdam / CPUAdam: its config says)."""
    path = ckpt.location.input_path
    s = schedule(a)
    check_length(a, int(step))
    n = int(step) * a["global_batch_size"]
    lr, wd = lr_at(s, n), wd_at(s, n)
    shapes = {r.name: r.shape for r in ckpt.records}
    hyper = [g.hyperparams for g in ckpt.groups]
    for key in _SAME:
        values = {repr(h.get(key)) for h in hyper}
        if len(values) != 1 or hyper[0].get(key) is None:
            raise UnsupportedLayout(f"the param groups do not share one {key} ({', '.join(sorted(values))}): "
                                    "megatron-core's groups do", path=path)
    betas, eps = tuple(hyper[0]["betas"]), hyper[0]["eps"]
    for flag, stated, held in (("--adam-beta1", a["adam_beta1"], betas[0]),
                               ("--adam-beta2", a["adam_beta2"], betas[1]), ("--adam-eps", a["adam_eps"], eps)):
        if stated is not None and stated != held:
            raise OptionError(f"{OPTION} says {flag} {stated!r} but the source's groups hold {held!r}", path=path,
                              hint=f"give {flag} {held!r} (the moments were made with it), or leave it out")
    for h in hyper:
        if h.get("amsgrad") or h.get("maximize"):
            raise UnsupportedLayout(f"the source's Adam ran with {'amsgrad' if h.get('amsgrad') else 'maximize'}, "
                                    "which Megatron's Adam does not", path=path)
        decoupled = h.get("decoupled_weight_decay", adam_w_mode)
        if decoupled is not True:
            raise UnsupportedLayout("the source's Adam did not decouple its weight decay (AdamW), as Megatron's does "
                                    f"(decoupled_weight_decay / the DeepSpeed config's adam_w_mode: {decoupled!r})",
                                    path=path)
    lrs = sorted({h.get("lr") for h in hyper}, key=repr)
    if len(lrs) != 1:
        raise UnsupportedLayout(f"the param groups ran at different learning rates ({', '.join(map(repr, lrs))}): "
                                "megatron-core's standard groups share one schedule", path=path)
    members = {0: [], 1: []}  # wd_mult 1, wd_mult 0
    for g in ckpt.groups:
        for name in g.names:
            off = no_decay(name, shapes[name])
            want = 0.0 if off else wd
            if g.hyperparams.get("weight_decay") != want:
                what = ("1-D parameters and biases get none in megatron-core's standard groups" if off else
                        f"Megatron's at step {step} from {OPTION} is {want!r}")
                raise OptionError(f"the source trained '{name}' with weight decay "
                                  f"{g.hyperparams.get('weight_decay')!r}; {what}", path=path,
                                  hint="state the run's --weight-decay (and its schedule) in --megatron-args"
                                  if not off else "a run whose groups follow megatron-core's split converts")
            members[1 if off else 0].append(name)
    groups = []
    for idx, mult in ((0, 1.0), (1, 0.0)):
        if not members[idx]:
            continue
        groups.append({"is_expert_parallel": False, "default_config": True, "wd_mult": mult, "lr_mult": 1.0,
                       "is_decoupled_lr": False, "max_lr": s["max_lr"], "min_lr": s["min_lr"], "lr": lr,
                       "betas": betas, "eps": eps, "weight_decay": wd * mult, "amsgrad": False, "maximize": False,
                       "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                       "decoupled_weight_decay": True, "step": float(step)})
    facts = {"num_steps": n, "lr": lr, "weight_decay": wd, "source_lr": lrs[0], "members": members}
    return groups, state_dict(s, n), facts


def args_of(a: dict, betas, eps, consumed: int) -> dict:
    """The args Megatron-LM saves for these flags (after ``validate_args``), the source's betas / eps, and
    ``consumed_train_samples``."""
    out = {dest: a[dest] for dest, _, _ in FLAGS.values() if a.get(dest) is not None}
    out.update(adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, consumed_train_samples=consumed)
    return out
