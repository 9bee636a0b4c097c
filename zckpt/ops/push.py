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

The pieces: :mod:`zckpt.ops.scan` finds the complete checkpoints in SRC, :mod:`zckpt.ops.destinations` lists and sends
files to DEST; this module hashes, plans what to send, runs the pool, keeps the last N and schedules runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from zckpt.io import hashing, links, storage
from zckpt.ops.destinations import (  # noqa: F401 - also the public names of zckpt.ops.push
    MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, RECORD_NAME, FileTask, FsDestination, HubDestination,
    RemoteFile, FileChanged,
    check_unchanged, retryable, unreachable, wait_all, make_destination, parse_hf_url,
)
from zckpt.ops.destinations import RESUME_NOTE, describe_fault
from zckpt.errors import CorruptFile, EndpointUnreachable, InvalidArgument, PushInterrupted, StorageError, ZckptError
from zckpt.encoding.zipentries import LOCAL_SIG, StreamedCrcs, read_file_entries
from zckpt.ops.scan import (  # noqa: F401 - check_complete is also zckpt.ops.push.check_complete
    LocalCheckpoint, check_complete, check_save_tag, checkpoint_files, find_checkpoints, newest_mtime,
)

log = logging.getLogger(__name__)


MIN_PART_SIZE = 5 * 1024 * 1024  # S3 multipart minimum


class NothingPushed(ZckptError):
    """A one-shot push found no checkpoint to push, or none complete: nothing is at DEST that was not before.

    Raised by :func:`push` only with ``allow_empty=False`` (the CLI's default for a one-shot push, so that a cron
    job with a wrong path fails); ``exc.push_result`` holds what was found."""

    default_hint = "check SRC; pass --allow-empty if pushing nothing is fine"


# ============================================================================================ hashing


def _cache_dir() -> str:
    if os.environ.get("ZCKPT_CACHE_DIR"):
        return os.environ["ZCKPT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zckpt")


class HashCache:
    """sha256 of local files keyed by (absolute path, size, mtime_ns), kept in a small JSON file."""

    def __init__(self, path: str | None = None, enabled: bool = True):
        self.path = path or os.path.join(_cache_dir(), "push-hashes.json")
        self.enabled = enabled
        self._lock = threading.Lock()
        self._entries: dict[str, list] = {}
        self._dirty = False
        if enabled:
            with contextlib.suppress(OSError, ValueError):
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if isinstance(data, dict) and data.get("version") == 2 and isinstance(data.get("files"), dict):
                    self._entries = data["files"]

    def get(self, path: str, st: os.stat_result) -> str | None:
        with self._lock:
            entry = self._entries.get(path)
        if entry and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            return entry[2]
        return None

    def put(self, path: str, st: os.stat_result, digest: str) -> None:
        with self._lock:
            self._entries[path] = [st.st_size, st.st_mtime_ns, digest]
            self._dirty = True

    def save(self) -> None:
        if not self.enabled or not self._dirty:
            return
        with self._lock:
            entries = {p: e for p, e in self._entries.items() if os.path.exists(p)}
            self._entries, self._dirty = entries, False
        try:
            storage.write_bytes_atomic(self.path, json.dumps({"version": 2, "files": entries}).encode())
        except OSError as exc:
            log.debug("cannot save hash cache %s: %s", self.path, exc)


# ============================================================================================ results


def human_bytes(n: float) -> str:
    from zckpt.units import format_size  # the one size style of every command

    return format_size(n)


@dataclasses.dataclass
class PushEvent:
    """One progress report. ``kind``: checkpoint-start (``total`` bytes to send), bytes (``nbytes`` sent),
    file-done, checkpoint-done (``result``), skipped (``message``), waiting (settle), retry, removed."""

    kind: str
    checkpoint: str = ""
    path: str = ""
    nbytes: int = 0
    total: int = 0
    files: int = 0
    message: str = ""
    result: CheckpointResult | None = None


@dataclasses.dataclass
class CheckpointResult:
    name: str
    status: str  # pushed | up-to-date | incomplete | unsettled | skipped | failed | not-tried (DEST unreachable)
    #              | interrupted | dry-run | vanished
    reason: str = ""
    step: int | None = None
    dest: str = ""
    files_total: int = 0
    bytes_total: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    files_skipped: int = 0
    bytes_skipped: int = 0
    seconds: float = 0.0
    error: BaseException | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["error"] = str(self.error) if self.error else None
        return out

    def __repr__(self) -> str:
        return f"<CheckpointResult {self.summary()[:200]}>"

    def summary(self) -> str:
        """One line for humans."""
        label = self.name or "SRC"  # SRC itself is the checkpoint
        if self.status == "pushed":
            rate = self.bytes_sent / self.seconds if self.seconds > 0 else 0
            text = (f"{label}: pushed {self.files_sent} file(s), {human_bytes(self.bytes_sent)} in "
                    f"{self.seconds:.1f}s ({human_bytes(rate)}/s)")
            if self.files_skipped:
                text += f", {self.files_skipped} already there"
            return text + f" -> {self.dest}"
        if self.status == "up-to-date":
            return f"{label}: up to date ({self.files_total} file(s), {human_bytes(self.bytes_total)})"
        if self.status == "dry-run":
            return (f"{label}: would send {self.files_sent} file(s), {human_bytes(self.bytes_sent)}"
                    f" ({self.files_skipped} already there) -> {self.dest}")
        return f"{label}: {self.status}" + (f" ({self.reason})" if self.reason else "")


@dataclasses.dataclass
class PushResult:
    src: str
    dest: str
    checkpoints: list[CheckpointResult] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    root_files_sent: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for c in self.checkpoints:
            counts[c.status] = counts.get(c.status, 0) + 1
        states = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no checkpoints"
        return (f"<PushResult {self.src!r} -> {self.dest!r}: {states}; sent {self.files_sent} file(s), "
                f"{human_bytes(self.bytes_sent)}{' (dry run)' if self.dry_run else ''}>")

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.checkpoints if c.status == "pushed")

    @property
    def files_sent(self) -> int:
        return sum(c.files_sent for c in self.checkpoints if c.status == "pushed")

    @property
    def failed(self) -> list[CheckpointResult]:
        return [c for c in self.checkpoints if c.status in ("failed", "not-tried", "interrupted")]

    def to_dict(self) -> dict:
        return {"src": self.src, "dest": self.dest, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                "files_sent": self.files_sent, "bytes_sent": self.bytes_sent,
                "checkpoints": [c.to_dict() for c in self.checkpoints], "removed": list(self.removed),
                "root_files_sent": list(self.root_files_sent)}


#: how long DEST may go unreachable (connection refused, host name not resolved, no route, connect timeout)
#: before a push gives up on it, counted from the start of the first request that failed so (the backend's own
#: retries inside that request included: botocore's take 0-15 s, huggingface_hub's 23 s)
UNREACHABLE_AFTER = 20.0


class Reachability:
    """Whether DEST answers, shared by every request of a push (and by the runs of :func:`push_every` and
    :class:`Pusher`): ``since`` is when the first failed request of the current outage began, None while DEST
    answers; any request that succeeds ends the outage. ``give_up_after``: seconds of outage after which a
    request that cannot connect is not retried any more. The retry notice is logged once per outage."""

    def __init__(self, give_up_after: float = UNREACHABLE_AFTER):
        if give_up_after < 0:
            raise InvalidArgument(f"must not be negative, not {give_up_after}", param="unreachable_after")
        self.give_up_after = give_up_after
        self.lock = threading.Lock()
        self.since: float | None = None
        self.noticed = False

    def failed(self, began: float) -> tuple[float, bool]:
        """A request that began at ``began`` could not connect: (seconds DEST has been unreachable, whether this
        is the outage's first notice)."""
        with self.lock:
            if self.since is None:
                self.since = began
            first, self.noticed = not self.noticed, True
            return time.monotonic() - self.since, first

    def answered(self) -> None:
        if self.since is None:  # (unlocked: the common case, nothing to do)
            return
        with self.lock:
            was, self.since, self.noticed = self.since, None, False
        if was is not None:
            log.info("DEST answers again after %.0fs", time.monotonic() - was)


class PushContext:
    """What a destination needs from the running push: pool, cancel flag, progress, retries, hashes."""

    def __init__(self, pool, cancel, progress, retries, hashes, workers, reach: Reachability | None = None):
        self.pool, self.cancel, self.progress, self.retries = pool, cancel, progress, retries
        self.hashes, self.workers = hashes, workers
        self.reach = reach or Reachability()
        self.gave_up = threading.Event()  # a request of this push gave up on an unreachable DEST: the others stop

    def emit(self, kind: str, **kw) -> None:
        if self.progress is not None:
            try:
                self.progress(PushEvent(kind, **kw))
            except Exception:
                log.debug("progress callback failed", exc_info=True)

    def sha256(self, task: FileTask) -> str:
        """The file's sha256; a torch zip's entries are CRC-checked over the same bytes (a damaged file raises
        :class:`CorruptFile`, and only checked files enter the hash cache)."""
        if task.sha256 is None:
            st = os.stat(task.local)
            digest = self.hashes.get(task.local, st)
            if digest is None:
                digest = checked_sha256(task.local, self.cancel)
                self.hashes.put(task.local, st, digest)
            task.sha256 = digest
        return task.sha256

    def retry(self, fn: Callable[[], Any], what: str, checkpoint: str = "") -> Any:
        """``fn()``, retried when it fails transiently: up to ``retries`` times with pauses of 1, 2, 4, 8, 16 s;
        a DEST that cannot be reached at all only while it has been so for less than ``reach.give_up_after``
        seconds (then the push gives up on DEST; see :func:`push`)."""
        for attempt in range(self.retries + 1):
            if self.cancel.is_set():
                raise PushInterrupted("interrupted", path=what)
            began = time.monotonic()
            try:
                out = fn()
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, PushInterrupted,
                    InvalidArgument):
                raise
            except OSError as exc:
                if not retryable(exc):
                    raise
                if unreachable(exc):
                    delay = self._unreachable_pause(exc, began, attempt, what, checkpoint)
                else:
                    if attempt == self.retries:
                        raise
                    delay = min(2.0 ** attempt, 30.0)
                    msg = f"{_message(exc, what)}; retry {attempt + 1}/{self.retries} in {delay:.0f}s"
                    log.warning("%s", msg)
                    self.emit("retry", checkpoint=checkpoint, path=what, message=msg)
                self._pause(delay, exc, what)
                continue
            self.reach.answered()
            return out
        raise AssertionError("unreachable")

    def _unreachable_pause(self, exc: OSError, began: float, attempt: int, what: str, checkpoint: str) -> float:
        """The pause before retrying a request that could not connect, or ``exc`` raised when DEST has been
        unreachable too long (or the retries are used up, or another request of this push gave up)."""
        down, first = self.reach.failed(began)
        left = self.reach.give_up_after - down
        if attempt == self.retries or left <= 0 or self.gave_up.is_set():
            self.gave_up.set()
            exc.unreachable_for = down  # for push()'s one line
            raise exc
        delay = min(2.0 ** attempt, 30.0, left)
        msg = f"{_message(exc, what)}; retrying for up to {left:.0f}s"
        if first:  # once per outage, not once per request and retry
            log.warning("%s", msg)
        self.emit("retry", checkpoint=checkpoint, path=what, message=msg)
        return delay

    def _pause(self, delay: float, exc: OSError, what: str) -> None:
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            if self.cancel.wait(min(left, 0.25)):
                raise PushInterrupted("interrupted", path=what) from exc
            if self.gave_up.is_set() and unreachable(exc):
                raise exc


TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save zips (rank files, scheduler.pt, rng_state_N.pth, ...)
# and DCP's .distcp files: a torch zip per item, at the offsets the .metadata beside it gives


def checked_sha256(path: str, cancel: threading.Event | None = None) -> str:
    """sha256 of a local file; for a torch zip (or a ``.distcp`` file's items), the CRC-32 of every entry checked
    over the same bytes."""
    crcs = None
    if path.endswith(TORCH_SUFFIXES):
        with open(path, "rb") as f:
            if f.read(4) == LOCAL_SIG:
                crcs = StreamedCrcs(read_file_entries(path).values())
    elif path.endswith(".distcp"):  # DCP: one torch zip per item, where the .metadata beside it says
        from zckpt.dcp.entries import distcp_entries
        entries = distcp_entries(path)
        crcs = StreamedCrcs(entries) if entries is not None else None
    digest = hashing.sha256_file(path, cancel=cancel, on_chunk=crcs)
    bad = crcs.damaged() if crcs is not None else []
    if bad:
        name = bad[0].split("/", 1)[1] if "/" in bad[0] else bad[0]
        raise CorruptFile(f"zip entry {name}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}: the bytes "
                          "do not match the CRC-32 the file records: the file is damaged, so the checkpoint is "
                          "not pushed", path=path,
                          hint="copy the file again from where it was saved, or push another checkpoint")
    return digest


def _message(exc: BaseException, what: str) -> str:
    """``exc`` as one line without its hint, naming ``what`` unless it names its own path."""
    if isinstance(exc, ZckptError):
        text = " ".join(exc.message.split())
        path = exc.path or what
        return text if text.startswith(path) else f"{path}: {text}"
    return f"{what}: {' '.join(str(exc).split())}"


# ============================================================================================ the push


def manifest_bytes(name: str, tasks: list[FileTask]) -> bytes:
    """The manifest: deterministic, so an unchanged checkpoint produces the same bytes."""
    files = [{"path": t.rel, "size": t.size, "sha256": t.sha256} for t in sorted(tasks, key=lambda t: t.rel)]
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": name,
           "total_bytes": sum(t.size for t in tasks), "files": files}
    return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()


def _local_tasks(folder: str) -> list[FileTask]:
    """One task per file of the checkpoint (:func:`zckpt.ops.scan.checkpoint_files`: every file, whatever the
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
    """:func:`check_complete`, and for a tag of the save folder SRC its ``latest`` (:func:`check_save_tag`)."""
    ok, reason = check_complete(ckpt.path)
    if ok and ckpt.save_dir:
        try:
            ok, reason = check_save_tag(ckpt.save_dir, ckpt.name)
        except ZckptError as exc:  # a 'latest' that is a link out of SRC
            ok, reason = False, exc.render()
    return ok, reason


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
        if rel.startswith("latest"):
            tag = data.decode("utf-8", "replace").strip()
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
    :class:`Reachability` shared across pushes (:func:`push_every` and :class:`Pusher` pass one, so that a DEST
    down for a while is tried once per run, and its notice logged once per outage).
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
        message = f"DEST {fault.what if fault else 'unreachable'}: {_message(exc, str(dest))}"
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


# ============================================================================================ schedules


def push_every(src: str, dest, interval: float, *, cancel: threading.Event | None = None,
               on_result: Callable[[PushResult], Any] | None = None,
               on_error: Callable[[BaseException], Any] | None = None, **kwargs) -> None:
    """Push, then again every ``interval`` seconds until ``cancel`` is set (or KeyboardInterrupt).

    Runs never overlap: when a push outlasts the interval the next starts right after it, and being a fresh
    scan it takes the newest complete checkpoint. Failures go to ``on_error`` and the loop goes on.
    Ctrl-C while waiting between runs ends the loop normally; during a push it abandons the push and raises.
    """
    if interval <= 0:
        raise InvalidArgument(f"must be more than zero, not {interval}", param="every")
    cancel = cancel or threading.Event()
    kwargs.setdefault("reachability", Reachability(kwargs.pop("unreachable_after", UNREACHABLE_AFTER)))
    while not cancel.is_set():
        began = time.monotonic()
        try:
            res = push(src, dest, cancel=cancel, **kwargs)
            if on_result is not None:
                on_result(res)
        except PushInterrupted:
            if cancel.is_set():
                break
        except (ZckptError, OSError) as exc:
            if on_error is None or _missing_package(exc):  # no later run can succeed: said once, the loop ends
                raise
            on_error(exc)
        try:
            cancel.wait(max(0.0, began + interval - time.monotonic()))
        except KeyboardInterrupt:
            return  # stopped between runs: nothing was abandoned


def _missing_package(exc: BaseException) -> bool:
    """Whether ``exc`` is a package that is not installed (a DEST backend: s3fs, huggingface_hub)."""
    return isinstance(exc, ImportError) or isinstance(exc.__cause__, ImportError)


class Pusher:
    """Pushes in a background thread: on :meth:`trigger`, and every ``every`` seconds if given.

    ``flush()`` waits until everything triggered so far is pushed, ``stop()`` flushes (or, with
    ``abandon=True``, abandons the current upload cleanly) and ends the thread. Errors are logged when they
    happen, kept in ``errors``, and raised by the next ``flush()`` / ``stop()``: never lost.
    Keyword arguments go to :func:`push`.
    """

    def __init__(self, src: str, dest, *, every: float | None = None, **push_kwargs):
        if every is not None and every <= 0:
            raise InvalidArgument(f"must be more than zero, not {every}", param="every")
        self.src, self.dest, self.every = src, dest, every
        push_kwargs.setdefault("reachability", Reachability(push_kwargs.pop("unreachable_after",
                                                                            UNREACHABLE_AFTER)))
        self.push_kwargs = push_kwargs
        self.errors: list[BaseException] = []
        self.results: list[PushResult] = []
        self._unraised: list[BaseException] = []
        self._cond = threading.Condition()
        self._requested = 0
        self._finished = 0
        self._names: set[str] | None = set()
        self._stopping = False
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def last_result(self) -> PushResult | None:
        return self.results[-1] if self.results else None

    def start(self) -> Pusher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zckpt-pusher", daemon=True)
            self._thread.start()
        return self

    def trigger(self, checkpoint: str | None = None) -> int:
        """Ask for a push soon (coalesced with others); ``checkpoint``: only that one (name relative to src)."""
        with self._cond:
            if checkpoint is None:
                self._names = None
            elif self._names is not None:
                self._names.add(checkpoint)
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def flush(self, timeout: float | None = None, *, push_now: bool = True) -> None:
        """Wait until everything triggered so far is pushed; raise any error not yet raised.

        ``push_now``: also push everything under src now (a full scan) and wait for that too.
        """
        if self._thread is None:
            self.start()
        with self._cond:
            gen = self._requested
        if push_now:
            gen = self.trigger()
        self._wait_for(gen, timeout)
        self._raise_errors()

    def _wait_for(self, gen: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._finished < gen and self._thread is not None and self._thread.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"push to {self.dest} still running after {timeout}s")
                self._cond.wait(remaining if remaining is not None else 1.0)

    def stop(self, timeout: float | None = None, *, abandon: bool = False, push_now: bool = False) -> None:
        """End the thread: finish pending pushes first (``push_now``: and a last full one), or abandon the
        current one (no manifest written)."""
        if abandon:
            self._cancel.set()
        elif self._thread is not None and self._thread.is_alive():
            with self._cond:
                gen = self._requested
            if push_now:
                gen = self.trigger()
            self._wait_for(gen, timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._cond:
            errors, self._unraised = self._unraised, []
        if errors:
            if len(errors) > 1:
                log.error("%d push errors; raising the first, all are in Pusher.errors", len(errors))
            raise errors[0]

    def __enter__(self) -> Pusher:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(abandon=exc_type is not None)

    def _run(self) -> None:
        next_timed = time.monotonic() + self.every if self.every else None
        while True:
            with self._cond:
                while not self._stopping and self._requested == self._finished:
                    wait = None if next_timed is None else next_timed - time.monotonic()
                    if wait is not None and wait <= 0:
                        self._requested += 1
                        self._names = None
                        break
                    self._cond.wait(wait)
                if self._stopping and (self._requested == self._finished or self._cancel.is_set()):
                    return
                gen, names = self._requested, self._names
                self._names = set()
            if next_timed is not None:
                next_timed = time.monotonic() + self.every
            try:
                res = push(self.src, self.dest, cancel=self._cancel, only=sorted(names) if names else None,
                           **self.push_kwargs)
                self.results.append(res)
            except BaseException as exc:  # noqa: BLE001 - surfaced by flush()/stop()
                if isinstance(exc, PushInterrupted) and self._cancel.is_set():
                    pass
                else:
                    log.error("push %s -> %s failed: %s", self.src, self.dest, exc)
                    with self._cond:
                        self.errors.append(exc)
                        self._unraised.append(exc)
            with self._cond:
                self._finished = gen
                self._cond.notify_all()
