"""Writing a PyTorch Distributed Checkpoint (DCP) by streaming, without torch and without tensors in memory: the
layout is :mod:`zckpt.engine.dcplayout` (shared with Megatron-Core's ``torch_dist`` writer, so it lives below the
formats); this module names it for the DCP format and writes a plan through the engine."""

from __future__ import annotations

from zckpt.engine import run
from zckpt.engine.dcplayout import (  # noqa: F401 - the DCP writer's names, for callers
    CHUNK_BYTES, DCP_VERSION, FILE_BYTES, METADATA, Chunk, DcpFile, DcpPlan, Item, SameAs, check_plain, flatten,
    key_of, metadata_bytes, metadata_object, plan_dcp,
)


# ------------------------------------------------------------------------------------------- writing


def write_plan(plan: DcpPlan, pub, pool=None, worker=None, maps=None, progress=None, fsync: bool = False,
               folder: str = "") -> None:
    """Write ``plan`` through ``pub`` (:func:`zckpt.engine.run.write_dcp_part`: the ``.distcp`` files, then
    ``.metadata`` last, DCP's commit marker)."""
    run.write_dcp_part(plan, pub, pool, worker, maps, progress, fsync, folder)
