"""What a DCP checkpoint holds beside the model and the optimizer, and what it does not say: its plain values
by root (``train_state`` counters, ``lr_scheduler``, ``client_state``, the rest left with a reason), which files of
a Trainer FSDP checkpoint are the DCP checkpoint itself, and module tensors that look tied but are not said to be."""

from __future__ import annotations

from zckpt.dcp.reader import TRAINER_PARTS, tie_candidates
from zckpt.errors import UnsupportedLayout
from zckpt.state.model import Checkpoint


SIDE_ROOTS = ("train_state", "lr_scheduler", "client_state")


def side_state(ckpt: Checkpoint) -> dict:
    """The plain values a DCP checkpoint holds beside the model and optimizer, by what DeepSpeed does with them:
    ``train_state`` counters (``global_steps``, ``global_samples``, ``skipped_steps``: zckpt's DeepSpeed -> DCP
    output; ints only), ``lr_scheduler`` (the dict DeepSpeed's ``lr_scheduler.load_state_dict`` gets; None
    without), ``client_state``; ``left``: {root: why} for the rest (``loss_scaler``, ``dataloader``, ...)."""
    md = ckpt.extra["metadata"]
    out = {"train_state": {}, "lr_scheduler": None, "client_state": {}, "left": {}}
    for key, value in (ckpt.extra.get("values") or {}).items():
        p = md.path_of(key)
        if p[0] == "zckpt":
            continue
        if p[0] == "train_state" and len(p) == 2 and isinstance(value, int) and not isinstance(value, bool):
            out["train_state"][p[1]] = value
        elif p[0] == "lr_scheduler" and len(p) >= 2:
            out["lr_scheduler"] = out["lr_scheduler"] or {}
            out["lr_scheduler"][".".join(map(str, p[1:]))] = value
        elif p[0] == "client_state" and len(p) >= 2:
            out["client_state"][".".join(map(str, p[1:]))] = value
        else:
            why = ("the loss scaler's state: DeepSpeed keeps one for fp16 only, and an fp16 target is refused"
                   if p[0] == "loss_scaler" else
                   "DeepSpeed has no place for it")
            out["left"].setdefault(".".join(map(str, p[:1])), why)
    tensors = sorted({md.path_of(k)[0] for k in ckpt.extra.get("other") or [] if k in md.tensors})
    for root in tensors:
        out["left"].setdefault(root, "tensors outside model / optimizer state")
    return out


def check_no_hidden_ties(ckpt: Checkpoint) -> None:
    """A module tensor without optimizer state whose bytes equal a trainable one's is likely a tied alias (most
    small Hugging Face language models tie their embeddings), or a frozen copy: never assumed, refused."""
    pairs = ckpt.extra.get("tie_candidates")
    pairs = tie_candidates(ckpt) if pairs is None else pairs
    if pairs:
        a, b = pairs[0]
        more = f" ({len(pairs) - 1} more such pair{'s' if len(pairs) > 2 else ''})" if len(pairs) > 1 else ""
        raise UnsupportedLayout(f"'{a}' has no optimizer state and the same bytes as the trainable '{b}': a tied "
                                f"weight or a frozen copy, and the files do not say which{more}",
                                path=ckpt.location.tag_dir,
                                hint=f"--tied {a}={b} if it is tied (DeepSpeed's shared_params); --tied '' if "
                                     "nothing is tied (then it is written as a frozen weight)")


def dcp_file(relpath: str) -> bool:
    """A file of the DCP checkpoint itself (its folders, ``.metadata``, data files): replaced by the rank files."""
    top = relpath.split("/")[0]
    return top in TRAINER_PARTS or top == ".metadata" or (top.startswith("__") and top.endswith(".distcp"))
