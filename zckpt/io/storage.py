"""zckpt's one storage layer: local paths on a fast path, S3 through one boto3 client, other URLs through fsspec.

Paths are plain ``str`` everywhere (a ``pathlib.Path`` would collapse the ``//`` of ``s3://``)::

    /data/run1/checkpoint-4          local (also file:///data/...)   builtin open / os calls
    s3://bucket/run1                 s3fs; endpoint and keys from AWS_ENDPOINT_URL(_S3), AWS_ACCESS_KEY_ID, ...
    hf://user/repo/path              huggingface_hub.HfFileSystem (hf://datasets/user/repo/... too)
    memory://scratch/x               fsspec's in-process memory store (tests)

Backend options (fsspec/s3fs keyword arguments such as ``endpoint_url``, ``key``, ``secret``; ``--storage-option
key=value`` in the CLI) are passed, never kept: every function here takes ``storage_options=`` and uses exactly
what it is given (on S3 on top of the standard AWS variables). There is no process-wide default, so two calls
with different endpoints or credentials in one process (a library inside a trainer) never see each other's.
The callers thread them: :func:`zckpt.state.open.open_checkpoint` records them on the ``Checkpoint``
(``ckpt.storage_options``) and the ops hand them on to the readers, the executor and the publisher.

On S3 every call (stat, list, ranged GET, upload) goes through one shared, thread-safe boto3 client built from the
same options (:func:`zckpt.io.s3.boto3_client`; s3fs only when the options need it or ``ZCKPT_S3_UPLOADER=s3fs``):
a reading command never imports s3fs, and GETs run in parallel threads. Opening a remote torch file for its metadata is
:func:`open_ranges` (a few parallel rounds; nothing fetched twice).

Failures: missing paths raise ``FileNotFoundError``, refused access ``PermissionError`` (the builtins fsspec
backends already use); any other backend failure becomes :class:`zckpt.errors.StorageError` naming the URL.

Object-store rules kept here, in one place:

* no rename on S3: :func:`write_bytes_atomic` is a single PUT (atomic on S3), :func:`put_file` a PUT or a
  multipart upload that only becomes visible when it completes; locally both write a temp file and rename it;
* listings are not cached (a pusher running for days must see what others changed);
* "directories" on object stores are key prefixes: :func:`makedirs` is a no-op there.

The layer is this module's names, what every caller uses (``from zckpt.io import storage; storage.join(...)``);
they live in modules of one concept each::

    paths        protocol, is_url, local_path, join, basename, parent
    filesystems  parse_storage_options, get_fs (the fsspec filesystem and options of a URL), backend errors
    meters       read_meter, count_read, metered (bytes read under a folder)
    s3           the boto3 client: HEAD / LIST / GET / upload on s3://
    reading      open_input, listdir, list_files, file_sizes, exists, isdir, isfile, size, read_bytes,
                 read_range, ...
    ranges       open_ranges, RangeFile (a remote torch file's metadata in a few parallel rounds; its
                 TAIL_BYTES / HEAD_BYTES / WHOLE_BYTES are read there)
    fetched      keep_fetched (what RangeFiles fetched, answering read_range while a checkpoint opens)
    writing      makedirs, put_file, write_bytes_atomic, remove, fsync_dir, umask
"""

from __future__ import annotations

from zckpt.io.fetched import keep_fetched
from zckpt.io.filesystems import get_fs, parse_storage_options
from zckpt.io.meters import ReadMeter, count_read, metered, read_meter
from zckpt.io.paths import basename, is_url, join, local_path, parent, protocol
from zckpt.io.ranges import RangeFile, open_ranges
from zckpt.io.reading import (REMOTE_BLOCK_SIZE, exists, file_sizes, isdir, isfile, list_files, listdir, listings_kept,
                              metadata, open_input, read_bytes, read_range, read_text, size)
from zckpt.io.writing import fsync_dir, makedirs, put_file, remove, umask, write_bytes_atomic

__all__ = [
    "protocol", "is_url", "local_path", "join", "basename", "parent",
    "parse_storage_options", "get_fs",
    "ReadMeter", "read_meter", "count_read", "metered",
    "open_input", "listdir", "listings_kept", "list_files", "file_sizes", "exists", "isdir", "isfile", "size",
    "read_bytes", "read_range", "read_text", "metadata", "REMOTE_BLOCK_SIZE",
    "RangeFile", "open_ranges",
    "keep_fetched",
    "makedirs", "fsync_dir", "umask", "put_file", "write_bytes_atomic", "remove",
]
