"""Whether a path is PyTorch DCP's: a folder with DCP's ``.metadata``, or a Trainer FSDP checkpoint of two, and
nothing else of the reader (the opener asks every format before reading one; this keeps asking DCP cheap for a
checkpoint that is not its own)."""

from __future__ import annotations

from zckpt.io import storage

METADATA = ".metadata"
TRAINER_PARTS = ("pytorch_model_fsdp_0", "optimizer_0")  # accelerate's FSDP_MODEL_NAME_0 / OPTIMIZER_NAME_0 folders


def dcp_parts(path: str, storage_options: dict | None = None) -> list[str]:
    """The DCP folders ``path`` stands for, relative to it: ``[""]`` for a DCP folder; a Trainer / Accelerate FSDP
    checkpoint (``SHARDED_STATE_DICT``) holds two, ``pytorch_model_fsdp_0`` ({"model": ...}) and ``optimizer_0``
    ({"optimizer": ...}), read as one checkpoint. ``[]``: not DCP."""
    try:
        if storage.isfile(storage.join(str(path), METADATA), storage_options):
            return [""]
        if storage.isfile(storage.join(str(path), TRAINER_PARTS[0], METADATA), storage_options):
            return [p for p in TRAINER_PARTS if p == TRAINER_PARTS[0]
                    or storage.isfile(storage.join(str(path), p, METADATA), storage_options)]
    except (FileNotFoundError, NotADirectoryError, ValueError):  # not there: discovery names what is missing
        pass  # a refused or failed request (PermissionError, a lost connection) is the caller's error, said once
    return []


def claims(path: str, storage_options: dict | None = None) -> bool:
    """The opener's question (:mod:`zckpt.state.open`): a DCP folder, or a Trainer FSDP checkpoint of them."""
    return is_dcp(path, storage_options)


def is_dcp(path: str, storage_options: dict | None = None) -> bool:
    """A folder with DCP's ``.metadata`` (its commit marker), or a Trainer FSDP checkpoint of DCP folders."""
    return bool(dcp_parts(path, storage_options))
