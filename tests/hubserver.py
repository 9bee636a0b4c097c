"""A small Hugging Face Hub stand-in on 127.0.0.1 for the tests: the HTTP API the real, unmodified
``huggingface_hub`` client speaks for a push and for reading files back (``HF_HUB_DISABLE_XET=1``: the LFS
path; Xet uploads are not served).

Use the fixture from a test module::

    pytest_plugins = ["tests.hubserver"]

    def test_x(hub_server):
        env = hub_server.env()                       # HF_ENDPOINT, HF_TOKEN, HF_HUB_DISABLE_XET=1, ...
        api = hub_server.api()                       # an HfApi pointed at it (for in-process calls)
        hub_server.file_sha256("me/run", "checkpoint-4/x.pt")

What it answers (paths as ``huggingface_hub`` 2.x builds them; ``{t}`` = models | datasets | spaces):

=========================================================  ===============================================
``POST /api/repos/create``                                 create_repo (409 when it exists)
``GET  /api/{t}/{repo}[/revision/{rev}]``                  repo_info / model_info
``GET  /api/{t}/{repo}/tree/{rev}[/{path}]``               list_repo_tree (``recursive``), HfFileSystem.ls
``POST /api/{t}/{repo}/paths-info/{rev}``                  get_paths_info, HfFileSystem.info
``GET  /api/{t}/{repo}/commits/{rev}``                     list_repo_commits
``POST /api/{t}/{repo}/preupload/{rev}``                   upload modes: LFS for binary samples or big files
``POST /{repo}.git/info/lfs/objects/batch``                LFS batch API: basic or multipart transfer;
                                                           objects already stored get no ``actions``
``PUT  /lfs/{oid}``, ``PUT /lfs/{oid}/part/{n}``           the upload itself (a body cut short is dropped)
``POST /lfs/{oid}`` / ``POST /lfs/{oid}/verify``           multipart completion / verify
``POST /api/{t}/{repo}/commit/{rev}``                      the commit, NDJSON: header, file, lfsFile,
                                                           deletedFile, deletedFolder; atomic
``GET|HEAD /{repo}/resolve/{rev}/{path}``                  file bytes, with ``Range``
=========================================================  ===============================================

Anything else is answered 501 and recorded in ``unknown`` (a test fails on it), so a client that starts
calling something new is noticed. Errors carry the Hub's ``X-Error-Code`` header (RepoNotFound,
RevisionNotFound, EntryNotFound), which the client turns into its own exception classes.

Files live in memory (the tests push a few MB). ``throttle`` (bytes/s) slows uploads down so a test can kill a
client mid-upload; ``ranged`` counts ranged reads, ``received`` the bytes of every upload body, ``puts`` the uploads per LFS oid.
``down()`` / ``up()`` make an outage: the port refuses connections, then serves again with the same state.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import http.server
import json
import os
import re
import threading
import time
import uuid
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

TOKEN = "hf_zckpt_test_token"
LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub's: bigger files (or binary ones) go to LFS
MAX_FILE_SIZE = 50 * 1000 ** 3  # the Hub's per-file limit
_LFS_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors", ".ckpt", ".h5", ".npy", ".pkl", ".zip", ".msgpack")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclasses.dataclass
class Entry:
    """One file in a commit: its bytes (regular) or its LFS object id."""

    size: int
    blob_id: str
    data: bytes | None = None
    lfs_oid: str | None = None


@dataclasses.dataclass
class Commit:
    oid: str
    title: str
    message: str
    date: str
    files: dict[str, Entry]


@dataclasses.dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    commits: list[Commit]  # oldest first; the last is main's head

    @property
    def head(self) -> Commit:
        return self.commits[-1]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HubStandIn:
    """The state and the HTTP server (a thread) of one stand-in Hub."""

    def __init__(self):
        self.lock = threading.Lock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs: dict[str, bytes] = {}  # complete LFS objects by sha256
        self.parts: dict[tuple[str, int], bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.unknown: list[str] = []
        self.puts: dict[str, int] = {}  # complete upload bodies received, per LFS oid
        self.received = 0  # bytes of upload bodies received (complete or not)
        self.ranged = 0  # ranged GETs of /resolve/ answered
        self.throttle: float | None = None  # bytes/s for upload bodies
        self.multipart_threshold = 8 * 1024 * 1024
        self.chunk_size = 4 * 1024 * 1024
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.hub = self
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="hub-stand-in", daemon=True)
        self.serving = False

    # ---------------------------------------------------------------- lifecycle and access

    def start(self) -> HubStandIn:
        self.thread.start()
        self.serving = True
        return self

    def stop(self) -> None:
        if self.serving:
            self.server.shutdown()
            self.server.server_close()
            self.serving = False

    def down(self) -> None:
        """An outage: the port is closed (connections refused) until :meth:`up`; what the Hub holds stays."""
        self.stop()

    def up(self) -> None:
        """Back on the same port, with the same repos."""
        self.server = _Server(("127.0.0.1", self.port), _Handler)
        self.server.hub = self
        self.thread = threading.Thread(target=self.server.serve_forever, name="hub-stand-in", daemon=True)
        self.start()

    def env(self, base: dict | None = None) -> dict[str, str]:
        """Environment for a client process: this endpoint, a token, the LFS path (no Xet), no bars muted."""
        env = dict(os.environ if base is None else base)
        for key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_ENABLE_HF_TRANSFER"):
            env.pop(key, None)
        env.update({"HF_ENDPOINT": self.endpoint, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1",
                    "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0"})
        return env

    def api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=TOKEN)

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def files(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        """``{path: content}`` at main's head (LFS files resolved to their objects)."""
        key = (repo_type, repo_id)
        if key not in self.repos:
            return {}
        return {p: self._content(e) for p, e in self.repos[key].head.files.items()}

    def file_sha256(self, repo_id: str, path: str, repo_type: str = "model") -> str:
        return hashlib.sha256(self.files(repo_id, repo_type)[path]).hexdigest()

    def _content(self, entry: Entry) -> bytes:
        return entry.data if entry.data is not None else self.lfs[entry.lfs_oid]

    # ---------------------------------------------------------------- the API, one method per call

    def find_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository Not Found for url: {repo_type}s/{repo_id}.", "RepoNotFound")
        return repo

    def commit_at(self, repo: Repo, rev: str) -> Commit:
        if rev in ("main", "HEAD"):
            return repo.head
        for c in repo.commits:
            if c.oid == rev:
                return c
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def create_repo(self, body: dict) -> dict:
        name, org = body.get("name"), body.get("organization")
        repo_id = f"{org}/{name}" if org else f"{TOKEN_USER}/{name}"
        repo_type = body.get("type") or "model"
        if (repo_type, repo_id) in self.repos:
            raise HubError(409, "You already created this model repo")
        private = body.get("private", body.get("visibility") == "private")
        first = Commit(uuid.uuid4().hex + "00000000", "initial commit", "", _now(), {})
        self.repos[(repo_type, repo_id)] = Repo(repo_type, repo_id, bool(private), [first])
        return {"url": f"{self.endpoint}/{_prefix(repo_type)}{repo_id}", "name": repo_id, "id": repo_id}

    def repo_info(self, repo: Repo, rev: str) -> dict:
        commit = self.commit_at(repo, rev)
        return {"id": repo.repo_id, "_id": repo.repo_id, "sha": commit.oid, "private": repo.private,
                "lastModified": commit.date, "siblings": [{"rfilename": p} for p in sorted(commit.files)]}

    def _entry_json(self, path: str, entry: Entry) -> dict:
        out = {"type": "file", "path": path, "size": entry.size, "oid": entry.blob_id}
        if entry.lfs_oid is not None:
            out["lfs"] = {"oid": entry.lfs_oid, "size": entry.size,
                          "pointerSize": len(lfs_pointer(entry.lfs_oid, entry.size))}
        return out

    @staticmethod
    def _folders(files: dict[str, Entry]) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}

    def tree(self, repo: Repo, rev: str, path: str, recursive: bool) -> list[dict]:
        files = self.commit_at(repo, rev).files
        folders = self._folders(files)
        base = path.strip("/")
        if base and base not in folders:
            if base in files:
                return [self._entry_json(base, files[base])]
            raise HubError(404, f"{base} does not exist on main", "EntryNotFound")
        prefix = base + "/" if base else ""
        out = []
        for f in sorted(folders):
            if f.startswith(prefix) and (recursive or "/" not in f[len(prefix):]):
                out.append({"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()})
        for p in sorted(files):
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):]):
                out.append(self._entry_json(p, files[p]))
        return out

    def paths_info(self, repo: Repo, rev: str, paths: list[str]) -> list[dict]:
        files = self.commit_at(repo, rev).files
        folders = self._folders(files)
        out = []
        for p in paths:
            p = p.strip("/")
            if p in files:
                out.append(self._entry_json(p, files[p]))
            elif p in folders:
                out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()})
        return out

    def commits(self, repo: Repo, rev: str) -> list[dict]:
        head = self.commit_at(repo, rev)
        upto = repo.commits[:repo.commits.index(head) + 1]
        return [{"id": c.oid, "title": c.title, "message": c.message, "authors": [{"user": TOKEN_USER}],
                 "date": c.date} for c in reversed(upto)]

    def preupload(self, repo: Repo, rev: str, body: dict) -> dict:
        files = self.commit_at(repo, rev).files
        out = []
        for f in body.get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            lfs = f["size"] >= LFS_THRESHOLD or b"\0" in sample or f["path"].endswith(_LFS_SUFFIXES)
            there = files.get(f["path"])
            oid = None
            if there is not None:
                oid = there.lfs_oid if there.lfs_oid is not None else there.blob_id
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        return {"files": out, "commitOid": repo.head.oid}

    def lfs_batch(self, repo: Repo, body: dict) -> dict:
        if body.get("operation") != "upload":
            raise HubError(400, "only uploads are served here")
        multipart = "multipart" in body.get("transfers", [])
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            if size > MAX_FILE_SIZE:
                objects.append({"oid": oid, "size": size, "error": {
                    "code": 422, "message": f"files larger than {MAX_FILE_SIZE} bytes are not allowed"}})
                continue
            if oid in self.lfs:
                objects.append({"oid": oid, "size": size})  # already stored: nothing to send
                continue
            href = f"{self.endpoint}/lfs/{oid}"
            action: dict = {"href": href}
            if multipart and size > self.multipart_threshold:
                n = -(-size // self.chunk_size)
                action["header"] = {"chunk_size": str(self.chunk_size),
                                    **{str(i): f"{href}/part/{i}" for i in range(1, n + 1)}}
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                "upload": action, "verify": {"href": f"{href}/verify", "header": {}}}})
        transfer = "multipart" if multipart else "basic"
        return {"transfer": transfer, "objects": objects, "hash_algo": "sha256"}

    def store_object(self, oid: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"sha256 of the uploaded data does not match {oid}")
        self.lfs[oid] = data
        self.puts[oid] = self.puts.get(oid, 0) + 1

    def complete_multipart(self, oid: str, body: dict) -> None:
        numbers = [p["partNumber"] for p in body.get("parts", [])]
        if numbers != list(range(1, len(numbers) + 1)):
            raise HubError(400, "parts out of order")
        for n, p in zip(numbers, body["parts"]):
            data = self.parts.get((oid, n))
            if data is None or p.get("etag") != hashlib.md5(data).hexdigest():
                raise HubError(400, f"part {n} of {oid} missing or etag mismatch")
        self.store_object(oid, b"".join(self.parts.pop((oid, n)) for n in numbers))

    def commit(self, repo: Repo, rev: str, lines: list[dict]) -> dict:
        if rev not in ("main",):
            self.commit_at(repo, rev)
            raise HubError(400, "commits go to main only here")
        header = lines[0]["value"] if lines and lines[0].get("key") == "header" else None
        if header is None:
            raise HubError(400, "the first NDJSON line must be the header")
        parent = header.get("parentCommit")
        if parent and parent != repo.head.oid:
            raise HubError(412, "parent commit is not main's head")
        files = dict(repo.head.files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = value.get("path", "")
            if key == "file":
                data = base64.b64decode(value["content"])
                files[path] = Entry(len(data), git_blob_id(data), data=data)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.lfs:
                    raise HubError(422, f"LFS object {oid} for {path} was not uploaded")
                size = len(self.lfs[oid])
                files[path] = Entry(size, git_blob_id(lfs_pointer(oid, size)), lfs_oid=oid)
            elif key == "deletedFile":
                if path not in files:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[path]
            elif key == "deletedFolder":
                folder = path.strip("/") + "/"
                for p in [p for p in files if p.startswith(folder)]:
                    del files[p]
            else:
                raise HubError(400, f"unknown commit line {key!r}")
        oid = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
        repo.commits.append(Commit(oid, header.get("summary", ""), header.get("description", ""), _now(), files))
        return {"success": True, "commitOid": oid, "commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{oid}",
                "pullRequestUrl": None}


TOKEN_USER = "me"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _prefix(repo_type: str) -> str:
    return "" if repo_type == "model" else f"{repo_type}s/"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: HubStandIn


_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+?)(?:/(revision|tree|paths-info|commits|preupload|"
                  r"commit)/([^/]+)(/.*)?)?$")
_LFS_BATCH = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_LFS = re.compile(r"^/lfs/([0-9a-f]{64})(?:/(part)/(\d+)|/(verify))?$")
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---------------------------------------------------------------- plumbing

    def _body(self, count: bool = False) -> bytes:
        hub = self.server.hub
        chunks = []
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    self.rfile.readline()
                    break
                chunks.append(self._read(n, count))
                self.rfile.readline()
        else:
            chunks.append(self._read(int(self.headers.get("Content-Length") or 0), count))
        return b"".join(chunks)

    def _read(self, n: int, count: bool) -> bytes:
        hub = self.server.hub
        out = bytearray()
        while len(out) < n:
            step = min(64 * 1024, n - len(out))
            got = self.rfile.read(step)
            if not got:
                raise ConnectionError("body cut short")
            out += got
            if count:
                with hub.lock:
                    hub.received += len(got)
                if hub.throttle:
                    time.sleep(len(got) / hub.throttle)
        return bytes(out)

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _error(self, err: HubError) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, json.dumps({"error": err.message}).encode(), headers,
                   head=self.command == "HEAD")

    def _authorized(self) -> bool:
        return self.headers.get("Authorization", "") == f"Bearer {TOKEN}"

    def _dispatch(self) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        with hub.lock:
            hub.requests.append((self.command, url.path))
        try:
            self._route(url)
        except HubError as err:
            self._error(err)
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _dispatch

    # ---------------------------------------------------------------- routes

    def _route(self, url) -> None:
        hub, method, path = self.server.hub, self.command, url.path
        query = parse_qs(url.query)
        if method == "POST" and path == "/api/repos/create":
            body = json.loads(self._body() or b"{}")
            if not self._authorized():
                raise HubError(401, "Invalid credentials in Authorization header")
            with hub.lock:
                self._json(hub.create_repo(body))
            return
        m = _LFS.match(path)
        if m:
            self._lfs(m)
            return
        m = _LFS_BATCH.match(path)
        if m and method == "POST":
            body = json.loads(self._body() or b"{}")
            with hub.lock:
                repo = hub.find_repo((m.group(1) or "models")[:-1], m.group(2))
                self._send(200, json.dumps(hub.lfs_batch(repo, body)).encode(),
                           {"Content-Type": "application/vnd.git-lfs+json"})
            return
        m = _API.match(path)
        if m:
            self._api(m, method, query)
            return
        m = _RESOLVE.match(path)
        if m and method in ("GET", "HEAD"):
            self._resolve(m)
            return
        self._body()
        with hub.lock:
            hub.unknown.append(f"{method} {self.path}")
        self._send(501, b"not served by the stand-in")

    def _api(self, m, method: str, query: dict) -> None:
        hub = self.server.hub
        repo_type, repo_id, call, rev, rest = m.group(1)[:-1], m.group(2), m.group(3), m.group(4), m.group(5)
        rev = unquote(rev) if rev else "main"
        body = self._body() if method in ("POST", "PUT") else b""
        with hub.lock:
            repo = hub.find_repo(repo_type, repo_id)
            if call in (None, "revision") and method == "GET":
                self._json(hub.repo_info(repo, rev))
            elif call == "tree" and method == "GET":
                recursive = query.get("recursive", ["False"])[0].lower() in ("true", "1")
                self._json(hub.tree(repo, rev, unquote(rest or "").strip("/"), recursive))
            elif call == "paths-info" and method == "POST":
                form = parse_qs(body.decode())
                self._json(hub.paths_info(repo, rev, form.get("paths", [])))
            elif call == "commits" and method == "GET":
                self._json(hub.commits(repo, rev))
            elif call == "preupload" and method == "POST":
                self._json(hub.preupload(repo, rev, json.loads(body)))
            elif call == "commit" and method == "POST":
                if not self._authorized():
                    raise HubError(401, "Invalid credentials in Authorization header")
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                self._json(hub.commit(repo, rev, lines))
            else:
                hub.unknown.append(f"{method} {self.path}")
                self._send(501, b"not served by the stand-in")

    def _lfs(self, m) -> None:
        hub, method = self.server.hub, self.command
        oid, part, verify = m.group(1), m.group(3), m.group(4)
        if method == "PUT" and part is not None:
            data = self._body(count=True)
            with hub.lock:
                hub.parts[(oid, int(part))] = data
            self._send(200, b"", {"ETag": hashlib.md5(data).hexdigest()})
        elif method == "PUT":
            data = self._body(count=True)
            with hub.lock:
                hub.store_object(oid, data)
            self._send(200)
        elif method == "POST" and verify:
            body = json.loads(self._body() or b"{}")
            with hub.lock:
                ok = body.get("oid") == oid and oid in hub.lfs and len(hub.lfs[oid]) == body.get("size")
            if not ok:
                raise HubError(404, f"LFS object {oid} not found")
            self._json({"success": True})
        elif method == "POST":
            body = json.loads(self._body() or b"{}")
            with hub.lock:
                hub.complete_multipart(oid, body)
            self._json({"success": True})
        else:
            raise HubError(405, "method not allowed")

    def _resolve(self, m) -> None:
        hub, head = self.server.hub, self.command == "HEAD"
        repo_type = (m.group(1) or "models")[:-1]
        with hub.lock:
            repo = hub.find_repo(repo_type, m.group(2))
            commit = hub.commit_at(repo, unquote(m.group(3)))
            path = unquote(m.group(4))
            entry = commit.files.get(path)
            if entry is None:
                raise HubError(404, f"{path} not found", "EntryNotFound")
            data = hub._content(entry)
        etag = entry.lfs_oid or entry.blob_id
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if entry.lfs_oid:
            headers.update({"X-Linked-Etag": f'"{entry.lfs_oid}"', "X-Linked-Size": str(entry.size)})
        rng = self.headers.get("Range")
        if rng:
            mr = re.match(r"bytes=(\d*)-(\d*)$", rng.strip())
            if not mr:
                raise HubError(416, f"bad range {rng}")
            start = int(mr.group(1)) if mr.group(1) else max(0, len(data) - int(mr.group(2)))
            end = min(int(mr.group(2)), len(data) - 1) if mr.group(1) and mr.group(2) else len(data) - 1
            if start >= len(data) and len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
                return
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            with hub.lock:
                hub.ranged += 1
            self._send(206, data[start:end + 1], headers, head)
            return
        self._send(200, data, headers, head)


@pytest.fixture
def hub_server():
    """A fresh stand-in Hub for one test (its own repos and store)."""
    server = HubStandIn().start()
    try:
        yield server
    finally:
        server.stop()
        assert not server.unknown, f"the client called what the stand-in does not serve: {server.unknown}"


__all__ = ["HubStandIn", "hub_server", "TOKEN", "MAX_FILE_SIZE", "git_blob_id", "quote"]
