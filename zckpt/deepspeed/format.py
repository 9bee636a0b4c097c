"""DeepSpeed's declaration in the format registry (:mod:`zckpt.state.formats`): it reads every layout DeepSpeed
saves, claiming whatever the other formats leave (its discovery says why a folder is no checkpoint at all), and
names its side files (a Trainer checkpoint's own files, the recovery scripts). Its writer is reshard's
(:mod:`zckpt.deepspeed.writer`) and convert's ``--to deepspeed``."""

from __future__ import annotations

from zckpt.state.formats import Format


class DeepSpeed(Format):
    name = "deepspeed"

    def claims(self, path, storage_options=None) -> bool:
        return True  # the last reader asked: read() says in one line what a folder lacks

    def preload(self) -> None:
        from zckpt.deepspeed import reader  # noqa: F401

    def read(self, path, tag=None, storage_options=None):
        from zckpt.deepspeed import reader
        return reader.read(path, tag, storage_options)

    def merge_view(self, ckpt, dtype):  # AutoEP layers under the Hugging Face model class's names (issue 47)
        if not ckpt.extra.get("moe_coverage"):  # no MoE layer, so none of AutoEP's: nothing to rename
            return ckpt, {}, list(ckpt.extra.get("merge_notes") or [])
        from zckpt.deepspeed import hf_moe
        return hf_moe.merge_view(ckpt, dtype)

    def side_state(self, ckpt) -> dict:
        """The counters (``global_steps``, ``global_samples``, ``skipped_steps``) and the client state (every key of
        the model-states file that is not DeepSpeed's own) beside model and optimizer."""
        from zckpt.deepspeed.target import MODEL_KEYS
        ms = ckpt.model_state or {}
        counters = {k: ms[k] for k in ("global_steps", "global_samples", "skipped_steps")
                    if isinstance(ms.get(k), int) and not isinstance(ms.get(k), bool)}
        client = {k: v for k, v in ms.items() if k not in MODEL_KEYS}
        return {"train_state": counters, "lr_scheduler": ms.get("lr_scheduler"), "client_state": client, "left": {}}

    def side_files(self, ckpt) -> list:
        from zckpt.deepspeed.discover import side_files
        return side_files(ckpt.location, ckpt.storage_options)


FORMAT = DeepSpeed()
