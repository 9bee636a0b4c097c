"""DEST on the Hugging Face Hub (:class:`HubDestination`, ``hf://owner/repo[@rev][/path]``): one commit per
checkpoint (files and manifest together, atomic there), the files' content uploaded to LFS before it.
huggingface_hub is imported only when a Hub destination is used.
"""

from __future__ import annotations

import contextlib
import io
import threading
from typing import Any

from zckpt.io import hashing, storage
from zckpt.errors import InvalidArgument, PushInterrupted, StorageError
from zckpt.backup.faults import describe_fault, fault_error
from zckpt.backup.files import is_checkpoint_name
from zckpt.backup.find import step_of
from zckpt.backup.manifest import MANIFEST_NAME, RECORD_NAME
from zckpt.backup.transfer import FileTask, RemoteFile, check_unchanged, wait_all

# ``ctx`` arguments are the running push's :class:`zckpt.backup.context.PushContext` (pool, cancel flag, retries,
# hashes); the annotation is a name only: this module sits below the push and never imports it


def parse_hf_url(url: str) -> tuple[str, str, str | None, str]:
    """``hf://[datasets/|spaces/|models/]owner/repo[@rev][/path]`` -> (repo_type, repo_id, revision, path)."""
    rest = url[len("hf://"):].strip("/")
    parts = rest.split("/")
    repo_type = "model"
    if parts and parts[0] in ("datasets", "spaces", "models"):
        repo_type = {"datasets": "dataset", "spaces": "space", "models": "model"}[parts[0]]
        parts = parts[1:]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise InvalidArgument("a Hub destination is hf://owner/repo[/path] (or hf://datasets/owner/repo)",
                              path=url)
    name, _, revision = parts[1].partition("@")
    return repo_type, f"{parts[0]}/{name}", revision or None, "/".join(parts[2:])


#: the Hub's per-file limit (https://huggingface.co/docs/hub/storage-limits): bigger files are refused before any upload
HUB_MAX_FILE_SIZE = 50 * 1000 ** 3

_bars_lock = threading.Lock()
_bars_depth = 0
_bars_restore = False


@contextlib.contextmanager
def hub_bars_off():
    """huggingface_hub's own progress bars off while zckpt talks to the Hub (zckpt draws its own bar of the bytes
    sent). The switch is process-wide in huggingface_hub, so the calls of all workers are counted and the bars come
    back as they were when the last one ends; ``HF_HUB_DISABLE_PROGRESS_BARS=0`` (bars forced on) is left alone."""
    global _bars_depth, _bars_restore
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    forced_on = constants.HF_HUB_DISABLE_PROGRESS_BARS is False
    with _bars_lock:
        if _bars_depth == 0 and not forced_on:
            _bars_restore = not are_progress_bars_disabled()
            if _bars_restore:
                disable_progress_bars()
        _bars_depth += 1
    try:
        yield
    finally:
        with _bars_lock:
            _bars_depth -= 1
            if _bars_depth == 0 and _bars_restore:
                _bars_restore = False
                enable_progress_bars()


@contextlib.contextmanager
def _hub_errors(url: str, op: str, endpoint: str | None = None):
    """huggingface_hub's failures as zckpt's: an abandon stays one; anything else becomes a StorageError naming
    ``url`` whose cause chain :func:`retryable` reads (an HTTP 4xx or a ValueError is final, a lost connection or
    a 5xx is retried)."""
    try:
        yield
    except (PushInterrupted, InvalidArgument, StorageError):
        raise
    except Exception as exc:
        cur, seen = exc, 0
        while cur is not None and seen < 8:
            if isinstance(cur, PushInterrupted):
                raise cur from None
            cur, seen = cur.__cause__ or cur.__context__, seen + 1
        fault = describe_fault(exc)
        if fault is not None and endpoint:
            raise fault_error(f"the Hub at {endpoint}", fault, op, url) from exc
        inner = exc.__cause__ if isinstance(exc, RuntimeError) and exc.__cause__ is not None else exc
        text = " ".join(str(inner).split()) or type(inner).__name__
        raise StorageError(f"{op} failed: {type(inner).__name__}: {text}", path=url,
                           hint="check HF_TOKEN, the repo name and that the Hub is reachable") from exc


class _CountingReader(io.BufferedReader):
    """A local file for huggingface_hub to upload from, reporting the bytes read from it: each byte once, however
    often the client seeks back to retry a request (its position's high-water mark)."""

    def __init__(self, path: str, on_bytes):
        super().__init__(io.FileIO(path, "rb"), buffer_size=1024 * 1024)
        self._on_bytes, self._high = on_bytes, 0

    def _advance(self) -> None:
        pos = self.tell()
        if pos > self._high:
            n, self._high = pos - self._high, pos
            self._on_bytes(n)

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self._advance()
        return data

    def read1(self, size: int = -1) -> bytes:
        data = super().read1(size)
        self._advance()
        return data

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        self._advance()
        return n

    @property
    def counted(self) -> int:
        return self._high


class HubDestination:
    """DEST on the Hugging Face Hub: one commit per checkpoint (files + manifest), atomic on the Hub.

    ``send`` uploads each file's content before the commit (``preupload_lfs_files``, one file per worker: the LFS
    batch API, then a basic or multipart transfer), so that zckpt's bar shows the bytes as they go and a push killed
    mid-way resends nothing the Hub already stored (its LFS batch answer has no upload action for those);
    ``finish`` then makes the one commit, which carries the small non-LFS files and the manifest. Nothing is
    visible in the repo before that commit. ``api`` is an ``huggingface_hub.HfApi`` (injectable, for tests and
    custom endpoints/tokens).
    """

    def __init__(self, url: str, api=None, *, private: bool = True):
        self.url = url
        self.repo_type, self.repo_id, self.revision, self.prefix = parse_hf_url(url)
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        self.api = api
        self.private = private
        self._tree: dict[str, Any] | None = None
        self._repo_missing = False
        self._ops: dict[str, dict[str, Any]] = {}

    def __str__(self) -> str:
        return self.url

    @property
    def _endpoint(self) -> str | None:
        return getattr(self.api, "endpoint", None)

    @staticmethod
    def _xet() -> bool:
        """Whether huggingface_hub will upload through Xet (then it reads the files itself, by path)."""
        import importlib.util

        from huggingface_hub import constants

        return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None

    def path_of(self, name: str, rel: str = "") -> str:
        return "/".join(p.strip("/") for p in (self.prefix, name, rel) if p and p.strip("/"))

    def url_of(self, name: str, rel: str = "") -> str:
        return storage.join(self.url, *(p for p in (name, rel) if p))

    def _list(self, refresh: bool = False) -> dict[str, Any]:
        if self._tree is None or refresh:
            from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

            try:
                with _hub_errors(self.url, "listing the repo", self._endpoint):
                    try:
                        entries = list(self.api.list_repo_tree(self.repo_id, path_in_repo=self.prefix or None,
                                                               recursive=True, repo_type=self.repo_type,
                                                               revision=self.revision))
                    except RepositoryNotFoundError:
                        entries, self._repo_missing = [], True
                    except EntryNotFoundError:
                        entries = []
            except StorageError as exc:
                if isinstance(exc.__cause__, RevisionNotFoundError):
                    raise StorageError(f"revision {self.revision!r} not found", path=self.url,
                                       hint="create the branch first") from exc.__cause__
                raise
            self._tree = {e.path: e for e in entries if hasattr(e, "blob_id")}
        return self._tree

    def remote_files(self, name: str) -> dict[str, RemoteFile]:
        base = self.path_of(name)
        prefix = base + "/" if base else ""
        out = {}
        for path, entry in self._list(refresh=True).items():
            if path.startswith(prefix):
                lfs = getattr(entry, "lfs", None)
                sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
                out[path[len(prefix):]] = RemoteFile(entry.size, sha, entry.blob_id)
        return out

    def read_manifest(self, name: str) -> dict | None:
        return {} if self.path_of(name, MANIFEST_NAME) in self._list() else None

    def has_manifest(self, name: str) -> bool:
        return self.path_of(name, MANIFEST_NAME) in self._list()

    def remote_sha256(self, name: str, rel: str, remote: RemoteFile, ctx: PushContext) -> str | None:
        return remote.sha256

    def same_blob(self, local: str, remote: RemoteFile) -> bool:
        return (remote.blob_id is not None and remote.sha256 is None
                and hashing.git_blob_sha1_file(local) == remote.blob_id)

    def manifest_matches(self, name: str, manifest: bytes, remote_manifest: dict | None) -> bool:
        entry = self._list().get(self.path_of(name, MANIFEST_NAME))
        return entry is not None and entry.blob_id == hashing.git_blob_sha1_bytes(manifest)

    def begin(self, name: str, ctx: PushContext, withdraw: bool = True, record: bool = True) -> None:
        pass  # the commit replaces files and manifest at once (no push record: nothing is ever half there)

    def check_sizes(self, name: str, tasks: list[FileTask]) -> None:
        """Refuse, before anything is uploaded, a file over the Hub's per-file limit."""
        too_big = [t for t in tasks if t.size > HUB_MAX_FILE_SIZE]
        if too_big:
            from zckpt.units import format_size

            t = max(too_big, key=lambda t: t.size)
            raise InvalidArgument(
                f"{t.rel} is {format_size(t.size)} ({t.size} bytes), over the Hub's per-file limit of 50 GB"
                + (f" ({len(too_big)} such files)" if len(too_big) > 1 else "") + "; nothing was uploaded",
                path=self.url_of(name, t.rel),
                hint="reshard to more ranks so each rank file is smaller (zckpt reshard CKPT --world-size N "
                     "-o OUT), or push to S3 or a folder")

    def send(self, name: str, tasks: list[FileTask], ctx: PushContext) -> None:
        self.check_sizes(name, tasks)
        wait_all([ctx.pool.submit(ctx.sha256, t) for t in tasks], ctx)  # hashes for the manifest and LFS
        self._ops[name] = {}
        if not tasks:
            return
        self._ensure_repo(ctx, name)
        futures = [ctx.pool.submit(self._upload_one, name, t, ctx) for t in tasks]
        wait_all(futures, ctx)
        self._ops[name] = {t.rel: f.result() for t, f in zip(tasks, futures)}

    def _upload_one(self, name: str, task: FileTask, ctx: PushContext):
        """One file's content to the Hub's LFS store (a no-op for small text files, which the commit carries)."""
        from huggingface_hub import CommitOperationAdd

        url = self.url_of(name, task.rel)
        xet = self._xet()

        def attempt():
            op = CommitOperationAdd(path_in_repo=self.path_of(name, task.rel), path_or_fileobj=task.local)
            op.upload_info.sha256 = bytes.fromhex(ctx.sha256(task))  # known: the client need not read it again
            sent = [0]

            def on_bytes(n: int) -> None:
                if ctx.cancel.is_set():
                    raise PushInterrupted("upload abandoned", path=url)
                sent[0] += n
                ctx.emit("bytes", checkpoint=name, path=task.rel, nbytes=n)

            reader = None
            if not xet:  # (Xet reads the file by its path itself; it would refuse a file object)
                reader = op.path_or_fileobj = _CountingReader(task.local, on_bytes)
            try:
                with hub_bars_off(), _hub_errors(url, "uploading it", self._endpoint):
                    self.api.preupload_lfs_files(self.repo_id, additions=[op], repo_type=self.repo_type,
                                                 revision=self.revision, num_threads=1, free_memory=False)
            except BaseException:
                if sent[0]:
                    ctx.emit("bytes", checkpoint=name, path=task.rel, nbytes=-sent[0])  # this try did not count
                raise
            finally:
                if reader is not None:
                    reader.close()
                    op.path_or_fileobj = task.local
            return op, sent[0]

        op, sent = ctx.retry(attempt, url, name)
        check_unchanged(task)
        if xet:
            ctx.emit("bytes", checkpoint=name, path=task.rel, nbytes=task.size)
        if sent or xet:
            ctx.emit("file-done", checkpoint=name, path=task.rel, nbytes=task.size)
        return op, bool(sent or xet)

    def _ensure_repo(self, ctx: PushContext, name: str = "") -> None:
        if self._repo_missing:
            def create():
                with _hub_errors(self.url, "creating the repo", self._endpoint):
                    self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private,
                                         exist_ok=True)

            ctx.retry(create, f"create {self.repo_id}", name)
            self._repo_missing = False

    def _commit(self, operations: list, message: str, ctx: PushContext, name: str = ""):
        self._ensure_repo(ctx, name)

        def commit():
            with hub_bars_off(), _hub_errors(self.url_of(name), "committing", self._endpoint):
                return self.api.create_commit(self.repo_id, operations=operations, commit_message=message,
                                              repo_type=self.repo_type, revision=self.revision,
                                              num_threads=max(1, ctx.workers))

        return ctx.retry(commit, self.url_of(name), name)

    def finish(self, name: str, tasks: list[FileTask], sends: list[FileTask], manifest: bytes, step, ctx) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        local = {t.rel for t in tasks}
        remote = self.remote_files(name)
        stale = [rel for rel in remote if rel not in local and rel not in (MANIFEST_NAME, RECORD_NAME)]
        uploaded = self._ops.pop(name, {})
        ops, readers, pending = [], [], []
        for t in sends:
            op, done = uploaded.get(t.rel) or (CommitOperationAdd(path_in_repo=self.path_of(name, t.rel),
                                                                  path_or_fileobj=t.local), False)
            if not done and not self._xet():  # carried by the commit itself (or stored already): count what is read
                def on_bytes(n: int, rel=t.rel) -> None:
                    ctx.emit("bytes", checkpoint=name, path=rel, nbytes=n)

                reader = _CountingReader(t.local, on_bytes)
                readers.append((op, reader, t))
                op.path_or_fileobj = reader
            if not done:
                pending.append(t)
            ops.append(op)
        ops += [CommitOperationDelete(path_in_repo=self.path_of(name, rel)) for rel in stale]
        ops.append(CommitOperationAdd(path_in_repo=self.path_of(name, MANIFEST_NAME), path_or_fileobj=manifest))
        label = name or self.prefix or self.repo_id
        message = f"zckpt push: {label}" + (f" (step {step})" if step is not None else "")
        try:
            if ctx.cancel.is_set():
                raise PushInterrupted("interrupted before the commit", path=self.url_of(name))
            self._commit(ops, message, ctx, name)
        finally:
            for op, reader, t in readers:
                reader.close()
                op.path_or_fileobj = t.local
        for t in sends:
            check_unchanged(t)
        for t in pending:
            ctx.emit("file-done", checkpoint=name, path=t.rel, nbytes=t.size)
        self._tree = None

    def list_remote_checkpoints(self) -> list[tuple[str, int, bool]]:
        tree = self._list(refresh=True)
        prefix = self.prefix + "/" if self.prefix else ""
        names = {p[len(prefix):].split("/", 1)[0] for p in tree if p.startswith(prefix) and "/" in p[len(prefix):]}
        return [(n, step_of(n), self.has_manifest(n)) for n in sorted(names)
                if is_checkpoint_name(n)]

    def remove_checkpoints(self, names: list[str], ctx: PushContext) -> None:
        if not names:
            return
        from huggingface_hub import CommitOperationDelete

        ops = [CommitOperationDelete(path_in_repo=self.path_of(n, MANIFEST_NAME)) for n in names]
        ops += [CommitOperationDelete(path_in_repo=self.path_of(n) + "/", is_folder=True) for n in names]
        self._commit(ops, f"zckpt push: remove {', '.join(names)} (--keep-last)", ctx)
        self._tree = None

    def root_matches(self, rel: str, data: bytes) -> bool:
        entry = self._list().get(self.path_of("", rel))
        return entry is not None and entry.blob_id == hashing.git_blob_sha1_bytes(data)

    def write_root_files(self, files: dict[str, bytes], ctx: PushContext) -> None:
        from huggingface_hub import CommitOperationAdd

        ops = [CommitOperationAdd(path_in_repo=self.path_of("", rel), path_or_fileobj=data)
               for rel, data in files.items()]
        self._commit(ops, f"zckpt push: {', '.join(files)}", ctx)
        self._tree = None
