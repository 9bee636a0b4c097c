"""The PyTorch Distributed Checkpoint (DCP, FSDP2) reader: a DCP folder as the same training-state model the
DeepSpeed readers produce (:mod:`zckpt.state.model`). :func:`zckpt.dcp.reader.open_dcp` builds it;
:func:`zckpt.deepspeed.layout.open_checkpoint` calls it when the folder has a ``.metadata``."""
