"""DEST on a local disk, S3 or any fsspec URL (:class:`FsDestination`): parallel uploads (multipart on S3), then
``zckpt-manifest.json`` last, written by :mod:`zckpt.io.publish`'s object-store rule (the commit marker, withdrawn
before a changed checkpoint's files are replaced).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os

from zckpt.io import hashing, publish, storage
from zckpt.errors import InvalidArgument, PushInterrupted, StorageError
from zckpt.backup.faults import RESUME_NOTE, cause_chain, describe_fault, fault_error
from zckpt.backup.files import is_checkpoint_name
from zckpt.backup.find import step_of
from zckpt.backup.manifest import MANIFEST_NAME, RECORD_NAME, record_bytes
from zckpt.backup.transfer import FileTask, RemoteFile, check_unchanged, wait_all

# ``ctx`` arguments are the running push's :class:`zckpt.backup.context.PushContext` (pool, cancel flag, retries,
# hashes); the annotation is a name only: this module sits below the push and never imports it


log = logging.getLogger(__name__)


class FsDestination:
    """DEST on a local disk, S3 or any fsspec URL: parallel uploads, then the manifest."""

    def __init__(self, url: str, storage_options: dict | None = None, *, part_size: int | None = None):
        self.url = os.fspath(url)
        self.storage_options = storage_options
        self.part_size = part_size
        self._hash_remote = storage.protocol(self.url) not in ("s3", "s3a")  # local/memory: read it back

    def __str__(self) -> str:
        return self.url

    def url_of(self, name: str, rel: str = "") -> str:
        return storage.join(self.url, *(p for p in (name, rel) if p))

    @property
    def endpoint(self) -> str:
        """The server DEST is on, as the user would name it (S3: the endpoint URL)."""
        proto = storage.protocol(self.url)
        if proto not in ("s3", "s3a"):
            return f"{proto}:// server"
        opts = self.storage_options or {}
        url = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
               or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        return f"S3 endpoint {url}" if url else "S3"

    @contextlib.contextmanager
    def _faults(self, doing: str, url: str):
        """Say a network or server fault, or a full disk, in one line naming the cause and what to do; the cause
        chain stays for :func:`retryable`."""
        try:
            yield
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, PushInterrupted,
                InvalidArgument):
            raise
        except Exception as exc:
            if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in cause_chain(exc)):
                raise StorageError(f"no space left at DEST while {doing}", path=url,
                                   hint=f"free space at DEST and run again; {RESUME_NOTE}") from exc
            fault = describe_fault(exc) if storage.is_url(url) else None
            if fault is None:
                raise
            raise fault_error(self.endpoint, fault, doing, url) from exc

    # ---------------------------------------------------------------- state

    def remote_files(self, name: str) -> dict[str, RemoteFile]:
        with self._faults("listing it", self.url_of(name)):
            files = storage.list_files(self.url_of(name), self.storage_options)
        return {rel: RemoteFile(size) for rel, size in files.items()}

    def read_manifest(self, name: str) -> dict | None:
        try:
            with self._faults("reading its manifest", self.url_of(name, MANIFEST_NAME)):
                data = storage.read_bytes(self.url_of(name, MANIFEST_NAME), self.storage_options)
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(data)
        except ValueError:
            return {}
        return manifest if isinstance(manifest, dict) else {}

    def check_sizes(self, name: str, tasks: list[FileTask]) -> None:
        """A folder or object store takes files of any size."""

    def has_manifest(self, name: str) -> bool:
        with self._faults("looking for its manifest", self.url_of(name, MANIFEST_NAME)):
            return storage.exists(self.url_of(name, MANIFEST_NAME), self.storage_options)

    def remote_sha256(self, name: str, rel: str, remote: RemoteFile, ctx: PushContext) -> str | None:
        url = self.url_of(name, rel)
        with self._faults("comparing it", url):
            if self._hash_remote:
                if not storage.is_url(url):
                    return ctx.sha256(FileTask(rel, storage.local_path(url), remote.size, 0))
                return hashing.sha256_file(url, cancel=ctx.cancel, storage_options=self.storage_options)
            return storage.metadata(url, self.storage_options).get("sha256")

    # ---------------------------------------------------------------- writing

    def begin(self, name: str, ctx: PushContext, withdraw: bool = True, record: bool = True) -> None:
        """Before any file of the checkpoint is sent: withdraw the commit (the manifest) of a changed checkpoint,
        then write the push record (unless it is there), so that from now on a reader (``zckpt verify``) knows
        this folder is a push destination, complete only once its manifest is there."""
        if withdraw:
            url = self.url_of(name, MANIFEST_NAME)

            def withdraw_manifest():
                with self._faults("withdrawing the old manifest", url):
                    publish.begin_remote(self.url_of(name), MANIFEST_NAME, self.storage_options)

            ctx.retry(withdraw_manifest, url, name)
        if record:
            rurl = self.url_of(name, RECORD_NAME)

            def write_record():
                with self._faults("writing the push record", rurl):
                    storage.write_bytes_atomic(rurl, record_bytes(name), self.storage_options)

            ctx.retry(write_record, rurl, name)

    def send(self, name: str, tasks: list[FileTask], ctx: PushContext) -> None:
        # fewer files than workers: let each file use the spare workers as parallel multipart streams
        parts = max(1, ctx.workers // max(1, min(len(tasks), ctx.workers)))
        futures = [ctx.pool.submit(self._send_one, name, t, ctx, parts) for t in tasks]
        wait_all(futures, ctx)

    def _send_one(self, name: str, task: FileTask, ctx: PushContext, parts: int = 1) -> None:
        digest = ctx.sha256(task)
        url = self.url_of(name, task.rel)

        def upload():
            sent = [0]

            def on_bytes(n: int) -> None:
                if ctx.cancel.is_set():
                    raise PushInterrupted("upload abandoned", path=url)
                sent[0] += n
                ctx.emit("bytes", checkpoint=name, path=task.rel, nbytes=n)

            try:
                with self._faults("uploading it" if storage.is_url(url) else "copying it", url):
                    storage.put_file(task.local, url, callback=on_bytes, storage_options=self.storage_options,
                                     metadata={"sha256": digest}, chunksize=self.part_size,
                                     max_concurrency=parts if parts > 1 else None)
            except BaseException:
                if sent[0]:
                    ctx.emit("bytes", checkpoint=name, path=task.rel, nbytes=-sent[0])  # this try did not count
                raise

        ctx.retry(upload, url, name)
        if not storage.is_url(url):
            with contextlib.suppress(OSError):
                ctx.hashes.put(storage.local_path(url), os.stat(storage.local_path(url)), digest)
        check_unchanged(task)
        ctx.emit("file-done", checkpoint=name, path=task.rel, nbytes=task.size)

    def finish(self, name: str, tasks: list[FileTask], sends: list[FileTask], manifest: bytes, step, ctx) -> None:
        # every file must be there with its size before the manifest says so (repair once if the store lost any)
        expected = {t.rel: t.size for t in tasks}
        def not_there():
            with self._faults("checking what arrived", self.url_of(name)):
                return publish.missing_remote(self.url_of(name), expected, self.storage_options)

        for attempt in range(2):
            gone = set(ctx.retry(not_there, self.url_of(name), name))
            missing = [t for t in tasks if t.rel in gone]
            if not missing:
                break
            if attempt == 1:
                raise StorageError(f"{len(missing)} file(s) missing after upload, e.g. {missing[0].rel}",
                                   path=self.url_of(name))
            log.warning("%s: %d file(s) missing at DEST after upload; sending them again", name, len(missing))
            self.send(name, missing, ctx)
        url = self.url_of(name, MANIFEST_NAME)  # the commit, last (zckpt.io.publish's object-store rule)

        def commit():
            with self._faults("writing the manifest", url):
                publish.commit_remote(self.url_of(name), MANIFEST_NAME, manifest, self.storage_options)

        ctx.retry(commit, url, name)

    def manifest_matches(self, name: str, manifest: bytes, remote_manifest: dict | None) -> bool:
        return remote_manifest is not None and json.dumps(remote_manifest, sort_keys=True) == json.dumps(
            json.loads(manifest), sort_keys=True)

    # ---------------------------------------------------------------- retention and root files

    def list_remote_checkpoints(self) -> list[tuple[str, int, bool]]:
        """``(name, step, complete)`` for each checkpoint-looking folder at DEST."""
        try:
            with self._faults("listing it", self.url):
                names = storage.listdir(self.url, self.storage_options)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for n in names:
            if is_checkpoint_name(n):
                out.append((n, step_of(n), self.has_manifest(n)))
        return out

    def remove_checkpoints(self, names: list[str], ctx: PushContext) -> None:
        for n in names:  # manifest first: from then on nobody treats it as complete
            url, folder = self.url_of(n, MANIFEST_NAME), self.url_of(n)

            def withdraw():
                with self._faults("withdrawing its manifest (--keep-last)", url):
                    publish.begin_remote(folder, MANIFEST_NAME, self.storage_options)

            def remove():
                with self._faults("removing it (--keep-last)", folder):
                    storage.remove(folder, recursive=True, storage_options=self.storage_options, missing_ok=True)

            ctx.retry(withdraw, url, n)
            ctx.retry(remove, folder, n)

    def root_matches(self, rel: str, data: bytes) -> bool:
        url = self.url_of("", rel)
        try:
            with self._faults("reading it", url):
                return storage.read_bytes(url, self.storage_options) == data
        except FileNotFoundError:
            return False

    def write_root_files(self, files: dict[str, bytes], ctx: PushContext) -> None:
        for rel, data in files.items():  # latest last (zckpt.backup.find.find_checkpoints)
            url = self.url_of("", rel)

            def write(url=url, data=data):
                with self._faults("writing it", url):
                    storage.write_bytes_atomic(url, data, self.storage_options)

            ctx.retry(write, url)
