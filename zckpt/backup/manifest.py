"""The records a push writes next to a checkpoint's files: the manifest at DEST (``zckpt-manifest.json``: every
file with its size and sha256, written last, the commit) and the push record (``.zckpt-push.json``: "a push of
this checkpoint began here", written before any file). Neither is ever one of the checkpoint's files
(:data:`PUSH_FILES`).
"""

from __future__ import annotations

import json

from zckpt.backup.transfer import FileTask

MANIFEST_NAME = "zckpt-manifest.json"  # push's commit record at DEST (zckpt.backup.destinations writes it)
RECORD_NAME = ".zckpt-push.json"  # push's "a push of this checkpoint began here", written before any file
PUSH_FILES = (MANIFEST_NAME, RECORD_NAME)  # describe a checkpoint's files; never one of them

MANIFEST_FORMAT = "zckpt-manifest"
MANIFEST_VERSION = 1


def record_bytes(name: str) -> bytes:
    """The push record (``.zckpt-push.json``), written before any file of a checkpoint is sent and kept: it makes
    the folder a push destination, whose checkpoint is complete only with its manifest (a push killed half-way,
    or a manifest deleted later, leaves it incomplete to ``zckpt verify``). Always the same bytes."""
    doc = {"format": "zckpt-push", "version": 1, "checkpoint": name,
           "complete_when": f"{MANIFEST_NAME} is here and every file it lists matches it"}
    return (json.dumps(doc, indent=1) + "\n").encode()


def manifest_bytes(name: str, tasks: list[FileTask]) -> bytes:
    """The manifest: deterministic, so an unchanged checkpoint produces the same bytes."""
    files = [{"path": t.rel, "size": t.size, "sha256": t.sha256} for t in sorted(tasks, key=lambda t: t.rel)]
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": name,
           "total_bytes": sum(t.size for t in tasks), "files": files}
    return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()
