"""Resume a Hugging Face Trainer or Accelerate run at another GPU count or ZeRO stage: one line.

    from zckpt.integrations import resume_anywhere

    with resume_anywhere():
        trainer.train(resume_from_checkpoint="out/checkpoint-400")     # saved at 8 GPUs, resumed at 6
    with resume_anywhere():
        accelerator.load_state("ckpt/")                                # Accelerate, the same way

Inside the block, every ``DeepSpeedEngine.load_checkpoint(load_dir, tag, ...)`` (the call the Trainer's
``deepspeed_load_checkpoint`` and Accelerate's ``load_state`` make) goes through
:func:`zckpt.deepspeed.load_checkpoint`: each rank reads its own new partition straight from the checkpoint and
DeepSpeed loads it in memory; a checkpoint of the engine's own layout loads as before. ``patch_deepspeed()`` does
the same for the rest of the process.

The Trainer's own files are used as they are (``trainer_state.json``, ``scheduler.pt``...). RNG: ranks r that
the old run had restore ``rng_state_{r}.pth``, others start from the seeded state (the Trainer's usual message);
a single process resuming a multi-rank run reads ``rng_state_0.pth`` (the Trainer looks for ``rng_state.pth``,
the name ``zckpt reshard`` gives that file), so both routes continue alike. See docs/resume.md.
"""

from __future__ import annotations

import os
import tempfile

from zckpt.ops.resume import patch_deepspeed, unpatch_deepspeed
from zckpt.ops.resume import resume_anywhere as deepspeed_resume_anywhere

__all__ = ["resume_anywhere", "patch_deepspeed", "unpatch_deepspeed"]

_RNG = {}


def _patch_trainer_rng() -> None:
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - Accelerate without transformers
        return
    if "original" in _RNG or not hasattr(Trainer, "_load_rng_state"):
        return
    original = Trainer._load_rng_state
    _RNG["original"] = original

    def _load_rng_state(self, checkpoint):
        if checkpoint is not None and self.args.world_size <= 1:
            one, zero = os.path.join(checkpoint, "rng_state.pth"), os.path.join(checkpoint, "rng_state_0.pth")
            if not os.path.isfile(one) and os.path.isfile(zero):
                with tempfile.TemporaryDirectory(prefix="zckpt-rng-") as tmp:
                    os.symlink(os.path.abspath(zero), os.path.join(tmp, "rng_state.pth"))
                    return original(self, tmp)
        return original(self, checkpoint)

    Trainer._load_rng_state = _load_rng_state


def _unpatch_trainer_rng() -> None:
    original = _RNG.pop("original", None)
    if original is not None:
        from transformers import Trainer
        Trainer._load_rng_state = original


class resume_anywhere(deepspeed_resume_anywhere):  # noqa: N801 - a context manager, like torch.no_grad
    """``with resume_anywhere(): trainer.train(resume_from_checkpoint=...)`` resumes at any world size / stage:
    :class:`zckpt.deepspeed.resume_anywhere` (``storage_options`` for a URL checkpoint) plus the Trainer's RNG file
    name for a single process resuming a multi-rank run."""

    def __enter__(self):
        self._rng_owner = "original" not in _RNG
        super().__enter__()
        _patch_trainer_rng()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self._rng_owner:
            _unpatch_trainer_rng()
        return False
