"""Megatron-Core distributed checkpoints (``torch_dist``, Megatron-LM's default ``--ckpt-format``), read as a peer
of the other formats (docs/architecture.md, docs/megatron.md).

Reader: :mod:`zckpt.megatron.reader` (the opener's ``claims`` / ``read``: a save folder with
``latest_checkpointed_iteration.txt`` or an ``iter_NNNNNNN`` folder, as the training-state model),
:mod:`zckpt.megatron.entries` (the zip entries guarding its ``.distcp`` items).
"""
