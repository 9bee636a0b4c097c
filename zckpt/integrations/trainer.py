"""Push each checkpoint a ``transformers.Trainer`` saves, in the background, from the main process.

    from zckpt.integrations import ZckptPushCallback

    trainer = Trainer(..., callbacks=[ZckptPushCallback("s3://bucket/run1", keep_last=3)])
    trainer.train()   # each checkpoint-N is pushed while training goes on; train() returns after the last one

``on_save`` (world process 0 only) asks a background :class:`zckpt.backup.schedule.Pusher` to push
``output_dir/checkpoint-{global_step}`` and returns at once; ``on_train_end`` waits for the pending uploads and
raises the first error, if any (errors are also logged as they happen and kept in ``callback.pusher.errors``).
Checkpoints are pushed only when complete (every rank file, ``trainer_state.json``), manifest last.
"""

from __future__ import annotations

import logging

from zckpt.backup.schedule import Pusher

try:  # the class works (duck-typed) without transformers, but is a real TrainerCallback when it is there
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a test dependency
    TrainerCallback = object

log = logging.getLogger(__name__)


class ZckptPushCallback(TrainerCallback):
    """A ``TrainerCallback`` that pushes every saved checkpoint to ``dest`` (folder, ``s3://``, ``hf://``).

    ``keep_last``: keep only the newest N complete checkpoints at ``dest``. ``settle``: seconds with no file
    change required (0: ``on_save`` already means the Trainer finished writing). ``raise_errors``: raise the
    first upload error from ``on_train_end`` (else only log it). Other keywords go to :func:`zckpt.backup.push.push`
    (``workers``, ``storage_options``, ``hub_api``, ``retries``, ``part_size``, ``progress``...).
    """

    def __init__(self, dest, *, keep_last: int | None = None, settle: float = 0.0, raise_errors: bool = True,
                 **push_kwargs):
        self.dest = dest
        self.raise_errors = raise_errors
        self.push_kwargs = dict(push_kwargs, keep_last=keep_last, settle=settle)
        self.pusher: Pusher | None = None

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        if self.pusher is None:
            self.pusher = Pusher(args.output_dir, self.dest, **self.push_kwargs).start()
        self.pusher.trigger(f"checkpoint-{state.global_step}")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.pusher is None:
            return control
        pusher, self.pusher = self.pusher, None
        try:
            pusher.stop()  # waits for every pending upload
        except Exception as exc:
            log.error("zckpt push to %s failed: %s", self.dest, exc)
            if self.raise_errors:
                raise
        return control
