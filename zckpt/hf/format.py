"""The Hugging Face folder's declaration in the format registry (:mod:`zckpt.state.formats`): written by merge
(:mod:`zckpt.hf.writer`); read as weights only (:mod:`zckpt.hf.reader`: no optimizer state, so reshard and convert
refuse it), never claiming a folder that also holds a training checkpoint (a Trainer checkpoint-N's
model.safetensors beside its global_stepN)."""

from __future__ import annotations

from zckpt.state.formats import Format


class HuggingFace(Format):
    name = "hf"

    def claims(self, path, storage_options=None) -> bool:
        from zckpt.hf import reader
        return reader.claims(path, storage_options)

    def preload(self) -> None:
        from zckpt.hf import reader  # noqa: F401

    def read(self, path, tag=None, storage_options=None):
        from zckpt.hf import reader
        return reader.read(path, tag, storage_options)


FORMAT = HuggingFace()
