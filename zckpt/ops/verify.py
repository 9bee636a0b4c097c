"""Is a checkpoint complete and consistent? Checks from metadata, and with ``deep=True`` every byte.

Metadata checks (reading only the pickles): every rank file present and readable, ``partition_count`` agrees
with the files, partitions agree with ``param_shapes`` (and each rank's ``param_slice_mappings``), every file
names the same DeepSpeed version and world size, ``latest`` names an existing tag, ``module`` shapes agree.
Every file of the checkpoint (:func:`zckpt.backup.files.checkpoint_files`, the definition push uses): torch zips'
directories intact, safetensors headers matching their sizes. Push manifests (``zckpt-manifest.json``) in the
folder, its tag, or above a tag: sizes (``deep``: sha256); a push record without one: not complete.
Deep checks: every byte of every file read, the CRC-32 of every zip entry (a flipped bit anywhere in tensor data is
caught). Legacy (non-zip) torch files have no CRCs: for them every byte is read and hashed,
the layout re-checked (pickles, storage keys, storage sizes that end the file) and every storage's size field
compared with the pickle in the stream. zckpt outputs (merged weights, reshard results) are checked against their ``.zckpt.json`` marker:
without a complete one they are incomplete. docs/guide.md has the table of what each level checks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Callable

from zckpt.io import hashing, publish, storage
from zckpt.state import experts
from zckpt.state.model import Checkpoint, metadata_errors
from zckpt.state.open import open_checkpoint
from zckpt.backup.files import TAG_STEP_RE, TITAN_STEP_RE, TRAINER_RE, CheckpointFile, NotBackedUp, files_in_folder, is_rank_file
from zckpt.backup.find import step_of
from zckpt.backup.manifest import MANIFEST_NAME, RECORD_NAME
from zckpt.errors import CheckpointNotFound, CorruptFile, IncompleteCheckpoint, InvalidArgument, ZckptError
from zckpt.units import counted, format_size
from zckpt.ops.verify_checks import (
    DISTCP_FORMATS, check_bytes, check_latest, check_metadata, check_structure, ckpt_rank_files, path_key,
)
from zckpt.ops.verify_report import NEXT_STEPS, Check, VerifyReport  # noqa: F401 - the report's names, for callers

MANIFEST = MANIFEST_NAME  # written by zckpt push

log = logging.getLogger(__name__)




def verify(path: str, tag: str | None = None, deep: bool = False,
           progress: Callable[[int, int], None] | None = None, storage_options: dict | None = None) -> VerifyReport:
    """Verify the checkpoint at ``path``. Structural failures raise :class:`~zckpt.errors.ZckptError`
    (the checkpoint cannot even be read); inconsistencies are reported as failed checks.

    What is checked, at every level (a save folder, a tag folder, a ``checkpoint-N``, a push destination):
    the rank files' metadata; every file of the checkpoint in ``path`` (:func:`zckpt.backup.files.checkpoint_files`)
    readable as a file, torch zips' directories and safetensors headers intact; every push manifest
    (``zckpt-manifest.json``) that covers ``path`` (in it, in its tag folder, or in the folder above a tag): each
    listed file there at its size, and a push record without its manifest is a push that did not finish. With
    ``deep``: every byte of every file read (the CRC of every zip entry, sha256 against the manifests). A folder
    holding several checkpoints (a push destination of a training output folder) has each of them verified.
    ``storage_options``: fsspec options for a URL ``path`` (the CLI's ``--storage-option``), for this call only."""
    report = VerifyReport(str(path))
    opts = storage_options
    try:
        ckpt = open_checkpoint(path, tag, opts)
    except (CheckpointNotFound, IncompleteCheckpoint, CorruptFile, InvalidArgument) as exc:
        # not a DeepSpeed checkpoint: a zckpt merge output (marker) or a folder published with a manifest still is;
        # a folder with what only checkpoints have (a `latest` naming a missing tag...) gets the reader's error
        if tag is None and _unfinished_push(str(path), report, opts):
            return report
        if not isinstance(exc, CheckpointNotFound):  # damaged, or incomplete: the reader's error
            if isinstance(exc, InvalidArgument) and tag is None and _verify_folder_of_checkpoints(
                    str(path), report, deep, progress, opts):  # "a training output folder, not a checkpoint"
                return report
            raise
        if tag is None and not _is_checkpoint_like(str(path), opts) and _is_merge_output(str(path), opts):
            check_output_marker(str(path), report, opts)
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        if tag is None and storage.exists(storage.join(str(path), MANIFEST), opts):
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        if tag is None and _verify_folder_of_checkpoints(str(path), report, deep, progress, opts):
            return report
        raise
    if ckpt.format == "hf":  # weights only (a merge output, a save_pretrained folder): its marker, headers, manifest
        check_output_marker(str(path), report, opts)
        check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
        return report
    report.tag = ckpt.location.tag
    t0 = time.perf_counter()
    with metadata_errors(ckpt.location.tag_dir):
        check_metadata(ckpt, report)
    try:  # mixture of experts: every layer's experts once, each with its value and state, and its router
        moe = experts.summary(ckpt)
    except (CorruptFile, IncompleteCheckpoint) as exc:
        report.add("MoE experts", False, exc.message)
    else:
        if moe:
            report.add("MoE experts", True, experts.render(moe))
    if ckpt.format not in DISTCP_FORMATS:  # (Megatron's latest file: check_megatron_metadata)
        check_latest(ckpt, report, tag_given=tag is not None)
    log.info("metadata: %d checks, %d failed, in %.2fs", len(report.checks),
             sum(not c.ok for c in report.checks), time.perf_counter() - t0)
    if storage.exists(storage.join(ckpt.location.input_path, publish.MARKER), opts):  # a zckpt reshard/convert output
        report.add("zckpt output committed", *publish.output_state(ckpt.location.input_path, opts, check_files=False))
    files = checkpoint_scope(ckpt, report)
    manifests = [m for m in _manifest_folders(ckpt) if _push_state(m, report, opts)]
    hashes: dict[str, str] = {}
    if deep:
        t0 = time.perf_counter()
        hashes = check_bytes(ckpt, report, progress, files=files,
                             extra=_manifest_bytes(manifests, files, opts))
        log.info("read every byte: %d files, %s in %.2fs", len(files), format_size(report.bytes_read),
                 time.perf_counter() - t0)
    else:  # (a DCP folder's .distcp files are series of zips, checked item by item when it opened)
        check_structure([f for f in files if ckpt.format not in DISTCP_FORMATS
                         or not f.rel.endswith((".distcp", ".metadata"))],
                        report, opts)
    for folder in manifests:
        check_manifest(folder, report, hashes=deep, known=hashes, storage_options=opts, scope=files)
    return report


def checkpoint_scope(ckpt: Checkpoint, report: VerifyReport | None = None) -> list[CheckpointFile]:
    """The checkpoint's files in the folder verified (:func:`zckpt.backup.files.files_in_folder`). A file that cannot
    be read as a file is a failed check ``files`` (then only the rank files are read)."""
    try:
        return files_in_folder(ckpt.location, ckpt.format, ckpt.storage_options)
    except NotBackedUp as exc:
        if report is not None:
            report.add("files", False, exc.message)
        return ckpt_rank_files(ckpt)


def _manifest_folders(ckpt: Checkpoint) -> list[str]:
    """Where a push manifest covering the folder verified can be: in it, in its tag folder, or (a tag folder given)
    in the folder above, where a pushed Trainer checkpoint keeps it."""
    loc = ckpt.location
    out = [loc.input_path]
    if ckpt.format != "dcp":
        if path_key(loc.tag_dir) != path_key(loc.input_path):
            out.append(loc.tag_dir)
        elif loc.save_dir and path_key(loc.save_dir) != path_key(loc.tag_dir):
            out.append(loc.save_dir)
    return list(dict.fromkeys(out))


def _push_state(folder: str, report: VerifyReport, storage_options: dict | None = None) -> bool:
    """True when ``folder`` has a manifest to check. A push record (``.zckpt-push.json``) without a manifest is a
    push that began and never finished, or whose manifest was lost: a failed check, the backup is not complete."""
    if storage.exists(storage.join(folder, MANIFEST), storage_options):
        return True
    if storage.exists(storage.join(folder, RECORD_NAME), storage_options):
        report.add("manifest", False, f"{storage.join(folder, MANIFEST)} missing: a zckpt push to {folder} began "
                                      f"({RECORD_NAME} is there) and never wrote it: the backup is not complete")
    return False


def _unfinished_push(path: str, report: VerifyReport, storage_options: dict | None = None) -> bool:
    """A folder that cannot be read as a checkpoint but has a push record and no manifest: not complete (said as a
    failed check rather than the reader's error about a missing rank file)."""
    try:
        if storage.exists(storage.join(path, MANIFEST), storage_options) or not storage.exists(
                storage.join(path, RECORD_NAME), storage_options):
            return False
    except (OSError, ZckptError):
        return False
    _push_state(path, report, storage_options)  # says so, as a failed check
    return True


def _verify_folder_of_checkpoints(path: str, report: VerifyReport, deep: bool, progress,
                                  storage_options: dict | None = None) -> bool:
    """A folder holding checkpoints (a training output folder, or where ``zckpt push`` sent one): each checkpoint
    in it is verified, its checks named after it. False when there are none."""
    try:
        listing = storage.listdir(path, storage_options)
        if any(n in ("latest", "latest_universal", "trainer_state.json") or is_rank_file(n) for n in listing):
            return False  # a checkpoint itself: the reader's error about it stands
        names = [n for n in listing if storage.isdir(storage.join(path, n), storage_options)]
    except (OSError, ZckptError):
        return False
    inside = [n for n in names if TRAINER_RE.match(n) or TAG_STEP_RE.match(n) or TITAN_STEP_RE.match(n) or any(
        storage.exists(storage.join(path, n, m), storage_options) for m in (MANIFEST, RECORD_NAME))]
    if not inside:
        return False
    for name in sorted(inside, key=lambda n: (step_of(n) if step_of(n) is not None else -1, n)):
        try:
            sub = verify(storage.join(path, name), deep=deep, progress=progress, storage_options=storage_options)
        except ZckptError as exc:
            report.add(f"{name}", False, f"cannot be read: {exc.message}")
            continue
        report.bytes_read += sub.bytes_read
        for c in sub.checks:
            report.add(f"{name}: {c.name}", c.ok, c.detail)
    return True


def _manifest_bytes(folders: list[str], scope: list[CheckpointFile], storage_options: dict | None) -> list[str]:
    """Files the manifests list that are outside the folder verified (the Trainer files above a tag folder): read
    too with ``deep``, so that every file of the pushed checkpoint is compared with its sha256."""
    have = {path_key(f.path) for f in scope}
    extra = []
    for folder in folders:
        for rel in _manifest_entries(folder, storage_options):
            p = storage.join(folder, rel)
            if path_key(p) not in have:
                extra.append(p)
                have.add(path_key(p))
    return extra


def _manifest_entries(folder: str, storage_options: dict | None) -> list[str]:
    try:
        doc = json.loads(storage.read_bytes(storage.join(folder, MANIFEST), storage_options))
        entries = doc["files"]
        return [str(rel) for rel in (entries if isinstance(entries, dict) else [e["path"] for e in entries])]
    except (OSError, ValueError, KeyError, TypeError, ZckptError):
        return []


_MERGED = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


def _is_checkpoint_like(folder: str, storage_options: dict | None = None) -> bool:
    try:
        return publish.looks_like_checkpoint(folder, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _is_merge_output(folder: str, storage_options: dict | None = None) -> bool:
    """A zckpt merge output, committed or not: its marker, or merged weight files without one."""
    try:
        names = storage.listdir(folder, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return publish.MARKER in names or any(_MERGED.match(n) for n in names)


def check_output_marker(folder: str, report: VerifyReport, storage_options: dict | None = None) -> None:
    """A zckpt output is complete only with its ``.zckpt.json`` marker saying so and every file it lists there
    (on object stores the marker is written last: without it the output was interrupted or is being written)."""
    ok, detail = publish.output_state(folder, storage_options)
    report.add("zckpt output committed", ok, detail)
    if ok and not storage.is_url(folder):
        from zckpt.backup.scan import check_safetensors
        bad = [why for n in sorted(storage.listdir(folder)) if n.endswith(".safetensors")
               for why in [check_safetensors(storage.join(folder, n))] if why]
        if any(n.endswith(".safetensors") for n in storage.listdir(folder)):
            report.add("safetensors headers", not bad, "; ".join(bad[:3]) or "every header matches its file size")


def check_manifest(folder: str, report: VerifyReport, hashes: bool = True, progress=None,
                   known: dict[str, str] | None = None, storage_options: dict | None = None,
                   scope: list[CheckpointFile] | None = None) -> None:
    """Check files against ``zckpt-manifest.json`` (sizes; with ``hashes`` also sha256), if the folder has one.
    ``known``: sha256 already computed for some paths (by the CRC pass), so they are not read again.
    ``storage_options``: fsspec options for a URL ``folder``."""
    opts = storage_options
    mpath = storage.join(folder, MANIFEST)
    if not storage.exists(mpath, opts):
        return
    try:
        manifest = json.loads(storage.read_bytes(mpath, opts))
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError):
        report.add("manifest", False, f"{MANIFEST} is not a valid manifest")
        return
    bad = []
    items = list(entries.items()) if isinstance(entries, dict) else [(e.get("path"), e) for e in entries]
    total = sum(int(meta.get("size", 0)) for _, meta in items) if hashes else 0

    def count(chunk: memoryview) -> None:
        report.bytes_read += len(chunk)
        if progress:
            progress(report.bytes_read, total)

    for rel, meta in items:
        p = storage.join(folder, rel)
        try:
            if storage.size(p, opts) != int(meta["size"]):
                bad.append(f"{rel}: size")
                continue
            if not hashes:
                continue
            if known and known.get(path_key(p)):
                if known[path_key(p)] != meta["sha256"]:
                    bad.append(f"{rel}: sha256 differs")
                continue
            if hashing.sha256_file(p, on_chunk=count, storage_options=opts) != meta["sha256"]:
                bad.append(f"{rel}: sha256 differs")
        except (OSError, ZckptError, KeyError, TypeError, ValueError):
            bad.append(f"{rel}: missing or unreadable")
    what = "sizes and sha256" if hashes else "sizes; --deep compares sha256"
    where = storage.join(folder, MANIFEST)
    detail = "; ".join(bad[:5]) or \
        f"{counted(len(items), 'file')} match{'es' if len(items) == 1 else ''} {where} ({what})"
    if scope is not None and not bad:  # files under the manifest's folder it does not list: not checked by it
        listed = {path_key(storage.join(folder, rel)) for rel, _ in items}
        base = path_key(folder).rstrip("/") + ("/" if storage.is_url(folder) else os.sep)
        others = [f.rel for f in scope if path_key(f.path).startswith(base) and path_key(f.path) not in listed]
        if others:
            detail += f"; {len(others)} file(s) here it does not list (not pushed by zckpt), e.g. {others[0]}"
    report.add("manifest", not bad, detail)
