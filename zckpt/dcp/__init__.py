"""PyTorch Distributed Checkpoint (DCP, FSDP2): the layout ``torch.distributed.checkpoint`` saves and loads.

:mod:`zckpt.dcp.reader` reads a DCP folder as the same training-state model the DeepSpeed readers produce
(:mod:`zckpt.state.model`): :func:`zckpt.dcp.reader.open_dcp` builds it; :func:`zckpt.state.open.open_checkpoint`
calls it when the folder has a ``.metadata``. :mod:`zckpt.dcp.writer` lays a state dict (plain data with
:class:`~zckpt.engine.torchzip.TensorOut` leaves, whose bytes are pieces of a source checkpoint) out as DCP's
``.distcp`` files and ``.metadata``, without torch.
"""
