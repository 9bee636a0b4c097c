"""PyTorch Distributed Checkpoint (DCP): the layout ``torch.distributed.checkpoint`` saves and loads.

:mod:`zckpt.dcp.writer` lays a state dict (plain data with :class:`~zckpt.engine.torchzip.TensorOut` leaves, whose
bytes are pieces of a source checkpoint) out as DCP's ``.distcp`` files and ``.metadata``, without torch.
"""
