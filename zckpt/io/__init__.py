"""Layer 1, io: where bytes live. ``storage`` (local paths and fsspec URLs: the one surface callers use, over
``paths``, ``filesystems``, ``meters``, ``s3``, ``reading``, ``ranges``, ``fetched`` and ``writing``), ``publish``
(scratch then rename on disks, commit marker last on object stores), ``hashing`` (sha256 and git-blob digests,
streamed)."""
