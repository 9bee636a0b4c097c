"""Push complete checkpoints to local folders, S3 and the Hub: incrementally, manifest last, on a schedule.

What is pushed (``SRC`` is scanned, ``DEST`` mirrors its relative paths)::

    SRC/                                   DEST/
      checkpoint-4/            Trainer       checkpoint-4/...                 every file, sent in parallel
        global_step4/*.pt      DeepSpeed     checkpoint-4/zckpt-manifest.json written LAST
        latest  trainer_state.json ...
      global_step7/            DeepSpeed     global_step7/... + manifest
      latest  zero_to_fp32.py  (save dir)    latest  (rewritten only once its tag's manifest exists)

A checkpoint is pushed only when :func:`check_complete` says it is whole and no file in it changed for
``settle`` seconds. A checkpoint at DEST without ``zckpt-manifest.json`` is not complete: the manifest lists
every file with its size and sha256 and is written after every file has arrived (on the Hub the files and the
manifest go in one commit, which is atomic there). A file already at DEST with the same size and sha256 is not
sent again (S3 objects carry their sha256 as ``x-amz-meta-sha256``; the Hub reports LFS sha256 and git blob
ids), so a push killed at any moment resumes without resending finished files, and pushing an unchanged SRC
sends nothing.

Local file hashes are cached in ``$ZCKPT_CACHE_DIR/push-hashes.json`` (default ``~/.cache/zckpt``), keyed by
(absolute path, size, mtime_ns), so an unchanged multi-GB shard is hashed once, not every cycle.

Library code reports progress through ``progress(PushEvent)`` (called from worker threads); the CLI draws bars.

The pieces (:mod:`zckpt.backup`): :mod:`zckpt.backup.find` finds the checkpoints in SRC and :mod:`zckpt.backup.scan`
says which are complete; :mod:`zckpt.backup.destinations` lists and sends files to DEST (a folder or object store:
:mod:`zckpt.backup.objectstore`; the Hub: :mod:`zckpt.backup.hub`); :mod:`zckpt.backup.hashes` hashes the local
files and :mod:`zckpt.backup.context` retries requests; this module plans what to send, runs the pool and keeps the
last N; :mod:`zckpt.backup.schedule` runs it on a schedule.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from zckpt.io import links, storage
from zckpt.errors import EndpointUnreachable, InvalidArgument, PushInterrupted, StorageError, ZckptError
from zckpt.backup.context import UNREACHABLE_AFTER, PushContext, Reachability
from zckpt.backup.destinations import make_destination
from zckpt.backup.faults import RESUME_NOTE, describe_fault, one_line, unreachable
from zckpt.backup.files import MEGATRON_TRACKER
from zckpt.backup.find import LocalCheckpoint, find_checkpoints
from zckpt.backup.files import checkpoint_files
from zckpt.backup.hashes import HashCache
from zckpt.backup.hub import HubDestination
from zckpt.backup.manifest import RECORD_NAME, manifest_bytes
from zckpt.backup.objectstore import FsDestination
from zckpt.backup.results import CheckpointResult, PushEvent, PushResult
from zckpt.backup.scan import check_checkpoint, newest_mtime
from zckpt.backup.transfer import FileChanged, FileTask, check_unchanged, wait_all

log = logging.getLogger(__name__)


MIN_PART_SIZE = 5 * 1024 * 1024  # S3 multipart minimum


class NothingPushed(ZckptError):
    """A one-shot push found no checkpoint to push, or none complete: nothing is at DEST that was not before.

    Raised by :func:`push` only with ``allow_empty=False`` (the CLI's default for a one-shot push, so that a cron
    job with a wrong path fails); ``exc.push_result`` holds what was found."""

    default_hint = "check SRC; pass --allow-empty if pushing nothing is fine"


def _local_tasks(folder: str) -> list[FileTask]:
    """One task per file of the checkpoint (:func:`zckpt.backup.files.checkpoint_files`: every file, whatever the
    folder is called)."""
    tasks = []
    for f in checkpoint_files(folder):
        st = os.stat(f.path)
        tasks.append(FileTask(f.rel, f.path, st.st_size, st.st_mtime_ns))
    return tasks


def _plan(ckpt: LocalCheckpoint, dest, ctx: PushContext) -> tuple[list[FileTask], dict | None, dict]:
    """Decide which files to send: a file is skipped when DEST has it with the same size and sha256."""
    tasks = _local_tasks(ckpt.path)
    remote = ctx.retry(lambda: dest.remote_files(ckpt.name), dest.url_of(ckpt.name), ckpt.name)
    manifest = ctx.retry(lambda: dest.read_manifest(ckpt.name), dest.url_of(ckpt.name), ckpt.name)
    listed = {f["path"]: f for f in (manifest or {}).get("files", []) if isinstance(f, dict) and "path" in f}

    def decide(task: FileTask) -> None:
        there = remote.get(task.rel)
        if there is None or there.size != task.size:
            task.send = True
            return
        entry = listed.get(task.rel)
        if entry and entry.get("size") == task.size and entry.get("sha256"):
            remote_sha = entry["sha256"]
        else:
            remote_sha = ctx.retry(lambda: dest.remote_sha256(ckpt.name, task.rel, there, ctx),
                                   dest.url_of(ckpt.name, task.rel), ckpt.name)
        if remote_sha is None and isinstance(dest, HubDestination):
            task.send = not dest.same_blob(task.local, there)
            if not task.send:
                ctx.sha256(task)
            return
        task.send = remote_sha is None or remote_sha != ctx.sha256(task)

    comparable = [t for t in tasks if t.rel in remote and remote[t.rel].size == t.size]
    for t in tasks:
        t.send = True
    wait_all([ctx.pool.submit(decide, t) for t in comparable], ctx)
    return tasks, manifest, remote


def _push_one(ckpt: LocalCheckpoint, dest, ctx: PushContext, dry_run: bool) -> CheckpointResult:
    started = time.monotonic()
    result = CheckpointResult(ckpt.name, "failed", step=ckpt.step, dest=dest.url_of(ckpt.name))
    tasks, remote_manifest, remote = _plan(ckpt, dest, ctx)
    sends = [t for t in tasks if t.send]
    result.files_total, result.bytes_total = len(tasks), sum(t.size for t in tasks)
    result.files_sent, result.bytes_sent = len(sends), sum(t.size for t in sends)
    result.files_skipped = len(tasks) - len(sends)
    result.bytes_skipped = result.bytes_total - result.bytes_sent
    if not sends:
        for t in tasks:
            ctx.sha256(t)  # cached: every unsent file was compared by hash
        manifest = manifest_bytes(ckpt.name, tasks)
        if dest.manifest_matches(ckpt.name, manifest, remote_manifest):
            result.status, result.seconds = "up-to-date", time.monotonic() - started
            return result
    if dry_run:
        result.status, result.seconds = "dry-run", time.monotonic() - started
        return result
    dest.check_sizes(ckpt.name, sends)  # what DEST cannot take is refused before anything is read
    list(ctx.pool.map(ctx.sha256, sends))  # every file read (torch zips CRC-checked) before anything is sent
    ctx.emit("checkpoint-start", checkpoint=ckpt.name, total=result.bytes_sent, files=len(sends))
    # the old manifest goes before any file of the checkpoint is replaced; the push record comes before any file
    dest.begin(ckpt.name, ctx, withdraw=remote_manifest is not None, record=RECORD_NAME not in remote)
    dest.send(ckpt.name, sends, ctx)
    for t in tasks:
        ctx.sha256(t)
        check_unchanged(t)
    dest.finish(ckpt.name, tasks, sends, manifest_bytes(ckpt.name, tasks), ckpt.step, ctx)
    result.status, result.seconds = "pushed", time.monotonic() - started
    return result


def _complete(ckpt: LocalCheckpoint) -> tuple[bool, str]:
    """:func:`check_checkpoint`: whole, and resumable from its save folder's ``latest`` or tracker file."""
    return check_checkpoint(ckpt)


def _select(checkpoints, settle, wait_settle, ctx, results):
    """Complete, settled checkpoints (waiting for ``settle`` where that is all they lack)."""
    ready = []
    for ckpt in checkpoints:
        if ckpt.kind == "skip":  # next to the checkpoints, not one: said, never silently left out
            results.append(CheckpointResult(ckpt.name, "skipped", ckpt.reason, ckpt.step))
            ctx.emit("skipped", checkpoint=ckpt.name, message=ckpt.reason)
            continue
        ok, reason = _complete(ckpt)
        if not ok:
            results.append(CheckpointResult(ckpt.name, "incomplete", reason, ckpt.step))
            ctx.emit("skipped", checkpoint=ckpt.name, message=f"incomplete: {reason}")
            log.info("%s: incomplete, not pushed: %s", ckpt.name or ckpt.path, reason)
            continue
        ready.append(ckpt)
    if settle <= 0:
        return ready
    settled = []
    for ckpt in ready:
        age = time.time() - newest_mtime(ckpt.path)
        if age < settle and wait_settle:
            wait = settle - age
            ctx.emit("waiting", checkpoint=ckpt.name, message=f"waiting {wait:.1f}s for files to settle")
            if ctx.cancel.wait(wait):
                raise PushInterrupted("interrupted while waiting for files to settle", path=ckpt.path)
            ok, reason = _complete(ckpt)
            age = time.time() - newest_mtime(ckpt.path)
            if not ok:
                results.append(CheckpointResult(ckpt.name, "incomplete", reason, ckpt.step))
                continue
        if age < settle:
            results.append(CheckpointResult(ckpt.name, "unsettled", f"a file changed {age:.1f}s ago "
                                            f"(--settle {settle:g}s)", ckpt.step))
            ctx.emit("skipped", checkpoint=ckpt.name, message="files still changing")
            continue
        settled.append(ckpt)
    return settled


def _retention(dest, keep_last: int, protect: set[str], ctx: PushContext, dry_run: bool) -> list[str]:
    remote = ctx.retry(dest.list_remote_checkpoints, str(dest))
    complete = sorted((r for r in remote if r[2]), key=lambda r: (r[1] if r[1] is not None else -1, r[0]))
    if len(complete) <= keep_last:
        drop = []
    else:
        drop = [r[0] for r in complete[:-keep_last]]
    if complete:
        oldest = complete[-keep_last:][0][1]
        drop += [r[0] for r in remote if not r[2] and r[0] not in protect and r[1] is not None
                 and oldest is not None and r[1] < oldest]
    if drop and not dry_run:
        dest.remove_checkpoints(drop, ctx)
        for n in drop:
            ctx.emit("removed", checkpoint=n, message="removed (--keep-last)")
    return drop


def _push_roots(src: str, roots: list[str], dest, ctx: PushContext, dry_run: bool) -> list[str]:
    files = {}
    for rel in roots:
        with open(os.path.join(src, rel), "rb") as f:
            data = f.read()
        if rel.startswith("latest"):  # DeepSpeed's latest / latest_universal, Megatron-LM's tracker file
            tag = data.decode("utf-8", "replace").strip()
            if rel == MEGATRON_TRACKER and tag.isdigit():
                tag = f"iter_{int(tag):07d}"
            if not ctx.retry(functools.partial(dest.has_manifest, tag), dest.url_of(tag)):
                log.info("not updating %s at DEST: %s is not complete there", rel, tag)
                continue
        if not ctx.retry(functools.partial(dest.root_matches, rel, data), dest.url_of("", rel)):
            files[rel] = data
    if files and not dry_run:
        dest.write_root_files(files, ctx)
    return list(files)


def push(src: str, dest, *, settle: float = 10.0, keep_last: int | None = None, workers: int = 4,
         dry_run: bool = False, storage_options: dict | None = None, progress: Callable[[PushEvent], Any] | None = None,
         hub_api=None, retries: int = 5, part_size: int | None = None, hash_cache: bool | str = True,
         only: Iterable[str] | None = None, wait_settle: bool = True,
         cancel: threading.Event | None = None, allow_empty: bool = True,
         unreachable_after: float = UNREACHABLE_AFTER, reachability: Reachability | None = None) -> PushResult:
    """Push every complete checkpoint under ``src`` to ``dest`` (newest first) and return what happened.

    ``settle``: seconds no file may have changed (a complete but recent checkpoint is waited for when
    ``wait_settle``). ``keep_last``: push only the newest N and remove older complete ones at DEST afterwards.
    ``only``: checkpoint names (relative to src) to consider. ``cancel``: set it to abandon the push
    cleanly. ``hub_api``: an ``HfApi`` for ``hf://`` destinations. ``storage_options``: fsspec options for a URL
    ``dest`` (endpoint, credentials...: the CLI's ``--storage-option``), for this call only; ``src`` is always a
    local folder. Raises the first failure after trying every
    checkpoint (the result is attached as ``exc.push_result``); incomplete checkpoints are not failures, unless
    none at all was pushed or found at DEST up to date and ``allow_empty`` is False: then :class:`NothingPushed`
    (saying why: nothing found, or each checkpoint's reason) is raised, with the result attached.

    A DEST that cannot be reached at all (connection refused, host name not resolved, no route, connect timeout)
    is retried only while it has been so for less than ``unreachable_after`` seconds (and at most ``retries``
    times); then the push stops at once: the checkpoints not started are ``not-tried``, ``latest`` and retention
    are left alone, and :class:`zckpt.errors.EndpointUnreachable` is raised. ``reachability``: a
    :class:`Reachability` shared across pushes (:func:`zckpt.backup.schedule.push_every` and
    :class:`zckpt.backup.schedule.Pusher` pass one, so that a DEST down for a while is tried once per run, and its
    notice logged once per outage).
    """
    started = time.monotonic()
    if workers < 1:
        raise InvalidArgument(f"must be at least 1, not {workers}", param="workers")
    if keep_last is not None and keep_last < 1:
        raise InvalidArgument(f"must be at least 1, not {keep_last}", param="keep_last")
    if settle < 0:
        raise InvalidArgument(f"must not be negative, not {settle}", param="settle")
    if storage.is_url(src):
        raise InvalidArgument("must be a local folder (the machine the checkpoints are written on)", path=src, param="src")
    src = os.path.abspath(storage.local_path(src))
    target = make_destination(dest, storage_options, hub_api=hub_api, part_size=part_size)
    if part_size is not None and part_size < MIN_PART_SIZE and str(dest).startswith(("s3://", "s3a://")):
        # S3's multipart minimum; other destinations (a folder, the Hub) send whole files and ignore part_size
        raise InvalidArgument(f"must be at least 5 MiB (S3's minimum part) for an s3:// destination, not "
                              f"{part_size} bytes", param="part_size", hint="e.g. 8MiB or 64MB")
    if isinstance(target, FsDestination) and not storage.is_url(target.url):
        d = os.path.abspath(storage.local_path(target.url))
        if d == src or d.startswith(src + os.sep) or src.startswith(d + os.sep):
            raise InvalidArgument("must not be inside `src` or contain it", path=target.url, param="dest",
                                  hint="choose a `dest` outside `src`")
    checkpoints, roots = find_checkpoints(src)
    # the save folder's own files (latest, zero_to_fp32.py): one that is a link out of SRC refuses the push at once
    links.check([os.path.join(src, rel) for rel in roots], src, "not uploaded")
    if only is not None:
        wanted = {os.path.normpath(n) for n in only}
        checkpoints = [c for c in checkpoints if os.path.normpath(c.name or ".") in wanted]
    result = PushResult(src, str(target), dry_run=dry_run)
    if isinstance(target, FsDestination) and storage.is_url(target.url):
        try:  # a missing backend (s3fs) or an unknown scheme: no checkpoint can get there; said once, for DEST
            storage.get_fs(target.url, storage_options)
        except StorageError as exc:
            result.checkpoints = [CheckpointResult(c.name, "skipped", c.reason, c.step) if c.kind == "skip" else
                                  CheckpointResult(c.name, "failed", str(exc), c.step, target.url_of(c.name), error=exc)
                                  for c in checkpoints]
            exc.push_result = result
            raise
    hashes = HashCache(hash_cache if isinstance(hash_cache, str) else None, enabled=bool(hash_cache))
    cancel = cancel or threading.Event()
    first_error: BaseException | None = None
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zckpt-push") as pool:
        ctx = PushContext(pool, cancel, progress, retries, hashes, workers,
                          reachability or Reachability(unreachable_after))
        try:
            ready = _select(checkpoints, settle, wait_settle and not dry_run, ctx, result.checkpoints)
            ready.sort(key=lambda c: (c.step if c.step is not None else -1, c.name), reverse=True)
            if keep_last is not None:
                for ckpt in ready[keep_last:]:
                    result.checkpoints.append(CheckpointResult(ckpt.name, "skipped", f"older than the newest "
                                                               f"{keep_last} (--keep-last)", ckpt.step))
                ready = ready[:keep_last]
            gone = False  # DEST unreachable: nothing more can get there
            for i, ckpt in enumerate(ready):
                if cancel.is_set():
                    result.checkpoints.append(CheckpointResult(ckpt.name, "interrupted", "not started", ckpt.step))
                    continue
                res = _run_one(ckpt, target, ctx, dry_run)
                result.checkpoints.append(res)
                ctx.emit("checkpoint-done", checkpoint=ckpt.name, result=res)
                if res.status == "failed" and first_error is None:
                    first_error = res.error
                hashes.save()
                if res.status == "failed" and unreachable(res.error):
                    rest = ready[i + 1:]
                    result.checkpoints += [CheckpointResult(c.name, "not-tried", "DEST unreachable", c.step,
                                                            target.url_of(c.name)) for c in rest]
                    first_error, gone = _unreachable_error(res.error, target, len(rest)), True
                    break
            if roots and not cancel.is_set() and not gone and any(  # only beside a checkpoint that is there
                    c.status in ("pushed", "up-to-date", "dry-run") for c in result.checkpoints):
                result.root_files_sent = _push_roots(src, roots, target, ctx, dry_run)
            if keep_last is not None and not cancel.is_set() and not gone and any(
                    c.status in ("pushed", "up-to-date") for c in result.checkpoints):
                result.removed = _retention(target, keep_last, {c.name for c in ready}, ctx, dry_run)
        except KeyboardInterrupt:
            cancel.set()
            raise
        finally:
            hashes.save()
    result.seconds = time.monotonic() - started
    if first_error is not None:
        with contextlib.suppress(AttributeError):
            first_error.push_result = result
        raise first_error
    if any(c.status == "interrupted" for c in result.checkpoints):
        exc = PushInterrupted("push interrupted", path=src)
        exc.push_result = result
        raise exc
    why = None if allow_empty else nothing_pushed(result)
    if why is not None:
        found = any(c.status != "skipped" for c in result.checkpoints)
        exc = NothingPushed(why, path=src, hint="run it again once the checkpoint is complete; --allow-empty "
                            "makes this exit 0" if found else None)
        exc.push_result = result
        raise exc
    return result


def _unreachable_error(exc: BaseException, dest, not_tried: int) -> EndpointUnreachable:
    """The one line for a push that gave up on DEST: what could not be reached, for how long, what was not tried."""
    down = getattr(exc, "unreachable_for", None)
    if isinstance(exc, EndpointUnreachable):
        message, path, hint = exc.message, exc.path, exc.hint
    else:  # (a backend error that reached push() unwrapped)
        fault = describe_fault(exc)
        message = f"DEST {fault.what if fault else 'unreachable'}: {one_line(exc, str(dest))}"
        path, hint = str(dest), f"{fault.todo if fault else 'check the network'}; {RESUME_NOTE}"
    if down is not None:
        message += f", for {down:.0f}s"
    if not_tried:
        message += f"; stopped, {not_tried} more checkpoint{'s' if not_tried > 1 else ''} not tried"
    err = EndpointUnreachable(message, path=path, hint=hint)
    err.__cause__ = exc
    return err


def nothing_pushed(result: PushResult) -> str | None:
    """Why ``result`` leaves nothing at DEST (no checkpoint found, or none complete), or None when at least one
    checkpoint was pushed, is up to date there, or would be sent (``--dry-run``)."""
    if any(c.status in ("pushed", "up-to-date", "dry-run") for c in result.checkpoints):
        return None
    if not any(c.status != "skipped" for c in result.checkpoints):
        skipped = [c for c in result.checkpoints if c.status == "skipped"]
        found = f"; {skipped[0].name}: {skipped[0].reason}" if skipped else ""
        return "nothing pushed: no checkpoint found (a checkpoint-N or tag folder, a save folder, or a training " \
               f"output folder holding them){found}"
    first = next(c for c in result.checkpoints if c.status != "skipped")
    n = sum(c.status != "skipped" for c in result.checkpoints)
    return (f"nothing pushed: {'no checkpoint is' if n > 1 else 'the checkpoint is not'} complete "
            f"({first.name or '.'}: {first.status}{': ' + first.reason if first.reason else ''}"
            + (f"; and {n - 1} more" if n > 1 else "") + ")")


def _run_one(ckpt: LocalCheckpoint, dest, ctx: PushContext, dry_run: bool) -> CheckpointResult:
    try:
        return _push_one(ckpt, dest, ctx, dry_run)
    except PushInterrupted as exc:
        return CheckpointResult(ckpt.name, "interrupted", "abandoned; no manifest written", ckpt.step,
                                dest.url_of(ckpt.name), error=exc)
    except FileChanged as exc:
        return CheckpointResult(ckpt.name, "unsettled", f"{exc} changed during the push; not marked complete",
                                ckpt.step, dest.url_of(ckpt.name))
    except KeyboardInterrupt:
        ctx.cancel.set()
        raise
    except Exception as exc:  # noqa: BLE001 - recorded and raised by push() after the other checkpoints
        if not os.path.isdir(ckpt.path):
            return CheckpointResult(ckpt.name, "vanished", "removed locally during the push (rotated?)",
                                    ckpt.step, dest.url_of(ckpt.name))
        if isinstance(exc, FileNotFoundError) and not isinstance(exc, ZckptError):
            exc = StorageError(f"{ckpt.name or ckpt.path}: {exc}", path=dest.url_of(ckpt.name))
        log.debug("%s: push failed: %s", ckpt.name or ckpt.path, exc)  # raised by push(): said once there
        return CheckpointResult(ckpt.name, "failed", str(exc), ckpt.step, dest.url_of(ckpt.name), error=exc)
