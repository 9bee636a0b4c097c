"""Layer 1, io: where bytes live. ``storage`` (local paths and fsspec URLs), ``publish`` (scratch then rename on
disks, commit marker last on object stores), ``hashing`` (sha256 and git-blob digests, streamed)."""
