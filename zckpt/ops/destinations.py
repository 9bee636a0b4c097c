"""Where ``zckpt push`` sends checkpoints: a local folder, S3 or any fsspec URL (:class:`FsDestination`) or a
Hugging Face Hub repository (:class:`HubDestination`).

A destination lists what is already there (size, sha256 or git blob id), sends the files that differ in
parallel through the push's pool, and writes ``zckpt-manifest.json`` last: a checkpoint at DEST without its
manifest is not complete (the manifest is the commit marker of :mod:`zckpt.io.publish`'s object-store rule, withdrawn
before a changed checkpoint's files are replaced). On the Hub files and manifest go in one commit.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import socket
import threading
from typing import Any, NamedTuple

from zckpt.io import hashing, publish, storage
from zckpt.errors import EndpointUnreachable, InvalidArgument, NetworkError, PushInterrupted, StorageError
from zckpt.ops.scan import MANIFEST_NAME, RECORD_NAME, TAG_STEP_RE, TRAINER_RE, step_of  # noqa: F401

# ``ctx`` arguments are the running push's ``zckpt.ops.push.PushContext`` (pool, cancel flag, retries, hashes); the
# annotation is a name only: this module sits below push and never imports it

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "zckpt-manifest"
MANIFEST_VERSION = 1


def record_bytes(name: str) -> bytes:
    """The push record (``.zckpt-push.json``), written before any file of a checkpoint is sent and kept: it makes
    the folder a push destination, whose checkpoint is complete only with its manifest (a push killed half-way,
    or a manifest deleted later, leaves it incomplete to ``zckpt verify``). Always the same bytes."""
    doc = {"format": "zckpt-push", "version": 1, "checkpoint": name,
           "complete_when": f"{MANIFEST_NAME} is here and every file it lists matches it"}
    return (json.dumps(doc, indent=1) + "\n").encode()


@dataclasses.dataclass
class FileTask:
    rel: str
    local: str
    size: int
    mtime_ns: int
    sha256: str | None = None
    send: bool = True


@dataclasses.dataclass
class RemoteFile:
    size: int
    sha256: str | None = None
    blob_id: str | None = None


#: errnos that repeat however often one asks: bad request, no permission, no such file, disk full, read-only
_PERMANENT_ERRNOS = (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC, errno.EROFS,
                     errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EDQUOT)
#: exception class names (botocore and friends, matched by name so that no backend need be imported)
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                    "NoRegionError", "ParamValidationError", "InvalidS3AddressingStyleError",
                    "UnknownSignatureVersionError", "RepositoryNotFoundError", "GatedRepoError",
                    "RevisionNotFoundError", "EntryNotFoundError", "LocalTokenNotFoundError")
_PERMANENT_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                    "AllAccessDisabled", "InvalidBucketName", "AccountProblem", "ExpiredToken", "InvalidToken")


def retryable(exc: BaseException) -> bool:
    """Transient (connection lost, timeout, server error 5xx, throttling 408/429) rather than a refusal that will
    repeat: an unknown URL scheme, a missing backend (s3fs), missing or wrong credentials, no permission, no such
    bucket or file, a full or read-only disk, a bad argument. Walks the ``__cause__``/``__context__`` chain, since
    zckpt's StorageError wraps the backend's exception."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ImportError, ValueError, TypeError, NotImplementedError, PermissionError,
                            FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                            InvalidArgument, PushInterrupted)):
            return False  # (zckpt's own StorageError is an OSError, not a ValueError: its cause decides)
        if type(exc).__name__ in _PERMANENT_NAMES:
            return False
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            return False
        response = getattr(exc, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in _PERMANENT_CODES:
            return False
        if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
            return False
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1
    return True


class Fault(NamedTuple):
    what: str  # what happened, after the server's name: "unreachable (connection refused)"
    todo: str  # what the user should do
    unreachable: bool  # the server cannot be reached at all (push gives up on DEST: nothing more can get there)


_AGAIN = "run again when it is back"
#: (what the exception chain shows, what zckpt says, what the user should do, connection-level): first match wins
_FAULTS = (
    (("gaierror", "Name or service not known", "nodename nor servname", "Temporary failure in name resolution",
      "getaddrinfo failed", "No address associated with hostname", "ClientConnectorDNSError"),
     "unreachable (host name not resolved)", "check the host name in the endpoint URL and the network", True),
    (("ConnectionRefusedError", "Connection refused", "Connect call failed"),
     "unreachable (connection refused)", f"check that it runs at that address; {_AGAIN}", True),
    (("No route to host", "Network is unreachable", "EHOSTUNREACH", "ENETUNREACH"),
     "unreachable (no route to the host)", f"check the network; {_AGAIN}", True),
    (("ConnectTimeout", "Connect timeout", "connect timed out"),
     "unreachable (connect timed out)", f"check the endpoint and any firewall; {_AGAIN}", True),
    (("EndpointConnectionError", "Could not connect to the endpoint", "ClientConnectorError", "ConnectError"),
     "unreachable (cannot connect)", f"check the endpoint and the network; {_AGAIN}", True),
    (("ReadTimeoutError", "Read timeout", "ReadTimeout", "timed out"),
     "stalled (no answer within the read timeout)", "retry when it answers again", False),
    (("TooManyRequests", "429 Too Many", "(429)"), "throttled the upload (429 Too Many Requests)",
     "retry later, or with fewer --workers", False),
    (("SlowDown", "reduce your request rate", "Throttl"),
     "throttled the upload (503 SlowDown)", "retry later, or with fewer --workers", False),
    (("ConnectionClosedError", "ConnectionResetError", "Connection was closed", "reset by peer", "ProtocolError",
      "RemoteDisconnected", "BrokenPipeError", "IncompleteRead", "Broken pipe"),
     "dropped the connection", "retry when it is stable again", False),
    (("InternalError", "ServiceUnavailable", "BadGateway", "GatewayTimeout", "(500)", "(502)", "(503)", "(504)"),
     "answered with a server error (HTTP 5xx)", "retry when it is healthy again", False),
)
#: errnos of a connection that could not be made at all (the first four entries of _FAULTS, by number)
_UNREACHABLE_ERRNOS = {errno.ECONNREFUSED: 1, errno.EHOSTUNREACH: 2, errno.ENETUNREACH: 2}
RESUME_NOTE = "finished files will not be resent"


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], 0
    while exc is not None and seen < 8:
        out.append(exc)
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1
    return out


def describe_fault(exc: BaseException) -> Fault | None:
    """``(what happened, what to do, connection-level)`` for a network or server fault in ``exc``'s chain, else
    None (a refusal or a local error keeps its own message)."""
    chain = _chain(exc)
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return None
    if any(isinstance(e, socket.gaierror) for e in chain):
        return Fault(*_FAULTS[0][1:])
    for e in chain:
        if isinstance(e, OSError) and not isinstance(e, socket.gaierror) and e.errno in _UNREACHABLE_ERRNOS:
            return Fault(*_FAULTS[_UNREACHABLE_ERRNOS[e.errno]][1:])
    text = " | ".join(f"{type(e).__name__}: {e}" for e in chain)
    if any(isinstance(e, OSError) and e.errno == errno.EBUSY for e in chain):  # s3fs's word for SlowDown
        text += " SlowDown"
    for needles, *fault in _FAULTS:
        if any(n in text for n in needles):
            return Fault(*fault)
    return None


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached at all (connection refused, host name not resolved,
    no route, connect timeout), as opposed to a server that answered badly (throttling, 5xx) or a connection
    that broke once made."""
    if isinstance(exc, EndpointUnreachable):
        return True
    fault = describe_fault(exc)
    return fault is not None and fault.unreachable


def fault_error(server: str, fault: Fault, doing: str, url: str) -> NetworkError:
    """The one-line error for ``fault`` of ``server`` while ``doing`` something to ``url``."""
    cls = EndpointUnreachable if fault.unreachable else NetworkError
    return cls(f"{server} {fault.what} while {doing}", path=url, hint=f"{fault.todo}; {RESUME_NOTE}")


def check_unchanged(task: FileTask) -> None:
    st = os.stat(task.local)
    if st.st_size != task.size or st.st_mtime_ns != task.mtime_ns:
        raise FileChanged(task.rel)


class FileChanged(Exception):
    """A local file changed while it was being pushed."""


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
            if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _chain(exc)):
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
            if TRAINER_RE.match(n) or TAG_STEP_RE.match(n):
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
        for rel, data in files.items():  # latest last (zckpt.ops.scan.find_checkpoints)
            url = self.url_of("", rel)

            def write(url=url, data=data):
                with self._faults("writing it", url):
                    storage.write_bytes_atomic(url, data, self.storage_options)

            ctx.retry(write, url)


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
                if TRAINER_RE.match(n) or TAG_STEP_RE.match(n)]

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


def make_destination(dest, storage_options: dict | None = None, *, hub_api=None, part_size: int | None = None):
    """A destination object for a local path / URL (``hf://`` -> :class:`HubDestination`)."""
    if isinstance(dest, (FsDestination, HubDestination)):
        return dest
    dest = os.fspath(dest)
    if storage.protocol(dest) == "hf":
        return HubDestination(dest, api=hub_api)
    return FsDestination(dest, storage_options, part_size=part_size)


def wait_all(futures: list[cf.Future], ctx: PushContext) -> None:
    """Wait for every future; on the first failure cancel the rest and raise it."""
    try:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    for p in pending:
                        p.cancel()
                    cf.wait(pending)
                    raise fut.exception()
    except BaseException:
        for f in futures:
            f.cancel()
        raise
