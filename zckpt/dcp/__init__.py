"""PyTorch Distributed Checkpoint (DCP, FSDP2, torchtitan): the layout ``torch.distributed.checkpoint`` saves and
loads, read and written as a peer of the other formats (docs/architecture.md).

Reader: :mod:`zckpt.dcp.reader` (the opener's ``claims`` / ``read``: a DCP folder, or a Trainer FSDP checkpoint of
two, as the training-state model), :mod:`zckpt.dcp.entries` (the zip entries guarding its bytes),
:mod:`zckpt.dcp.sidestate` (what it holds beside model and optimizer). Writer: :mod:`zckpt.dcp.fsdp2_state` (the
state dict FSDP2 + AdamW's ``get_state_dict`` makes, from the model), :mod:`zckpt.dcp.plan` (one DCP folder or the
Trainer's two), :mod:`zckpt.dcp.writer` (``.distcp`` files and ``.metadata``, without torch).
"""
