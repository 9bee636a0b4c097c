"""Backing up checkpoints: ``zckpt push`` and what it stands on, one concept per module.

Which checkpoints and files: :mod:`~zckpt.backup.files` (a checkpoint's files, the one definition push, verify,
info and reshard use), :mod:`~zckpt.backup.find` (the checkpoints a SRC folder holds), :mod:`~zckpt.backup.scan`
(whether one is complete), :mod:`~zckpt.backup.latest` (``--latest``: the newest complete one).

Sending them: :mod:`~zckpt.backup.push` (one push: plan, send, manifest last, keep the last N),
:mod:`~zckpt.backup.schedule` (``push_every``, the background ``Pusher``), :mod:`~zckpt.backup.destinations`
(which DEST: :mod:`~zckpt.backup.objectstore` for a folder, S3 or fsspec URL, :mod:`~zckpt.backup.hub` for the
Hugging Face Hub), :mod:`~zckpt.backup.manifest` (the manifest and push record written beside the files),
:mod:`~zckpt.backup.transfer` (a file to send, a file DEST has), :mod:`~zckpt.backup.hashes` (sha256, cached and
CRC-checked), :mod:`~zckpt.backup.context` (the running push: pool, retries, reachability),
:mod:`~zckpt.backup.faults` (which failures to retry, and how to say them), :mod:`~zckpt.backup.results` (what a
push reports).

Layer: below :mod:`zckpt.ops` (verify, info and reshard use the files and completeness rules), above the format
packages; it never imports :mod:`zckpt.ops`. The public entry points are ``zckpt.push`` and ``zckpt.Pusher``.
"""
