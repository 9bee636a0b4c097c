"""Publishing zckpt outputs: where a result may go, and one way to make it appear whole or not at all.

Every output folder that ``merge`` and ``reshard`` write carries a marker, ``OUT/.zckpt.json``
(``{"format": "zckpt-output", "kind": "merge" | "reshard", "state": "complete", "zckpt": version, "source": ...,
"created": ..., "files": {relpath: size}}``). It says what the folder is, so ``--overwrite`` can tell a previous
zckpt output of the same kind (replaced) from anything else (refused), and it is the commit record on object stores.

How a result is published (orbax's temporary-path-then-finalize)::

    local disk   <parent>/.<name>.zckpt-tmp-<pid>-XXXX/   every file, then the marker (fsync'd with durable=True)
                 -> rename to <parent>/<name>              an older output is swapped out in one step
                                                           (renameat2 RENAME_EXCHANGE) where the kernel has it,
                                                           else moved aside to .<name>.zckpt-old-<pid>-XXXX first;
                                                           it is deleted only after the new one is in place
    object store <out>/.zckpt.json  state "writing"        first: a zckpt output is being written here
    (s3://, ...) <out>/<files>                             each uploaded once it is complete (PUT/multipart: whole)
                 <out>/<stale files of an older output>    removed
                 <out>/.zckpt.json  state "complete"       LAST, after every file is listed with its size: the commit

Readers (``zckpt verify``, :func:`output_state`) treat an output whose marker is missing or not "complete" as
incomplete. Scratch folders of killed runs are swept by the next run that publishes next to them (a moved-aside
old output whose new one never arrived is put back). ``zckpt push`` commits the same way with its own marker
(``zckpt-manifest.json``, :func:`begin_remote` / :func:`commit_remote`).

Where an output may go (:func:`check_output`, before any byte is written): never the source checkpoint, inside it,
or containing it, where "the source" is the whole save folder (``latest`` and every tag) or Trainer
``checkpoint-N`` folder, plus the ``checkpoint-N`` / ``global_stepN`` folders next to it; and never a folder next to
it named like one (``checkpoint-N``, ``global_stepN``), whether or not it exists yet. Default outputs
(:func:`default_output`) are siblings of the source whose names cannot be taken for checkpoints::

    outputs/checkpoint-4  ->  outputs/merged-checkpoint-4-fp32/         zckpt merge
                          ->  outputs/resharded-checkpoint-4-ws8/       zckpt reshard -w 8

(``checkpoint-4.merged`` would not do: the Trainer's rotation globs ``checkpoint-*`` and deletes what it finds.
An output so named in a training output folder is refused: :func:`rotation_deletes`.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from zckpt.io import storage
from zckpt.errors import InvalidArgument, OptionError, OutputExists, StorageError
from zckpt.units import counted

log = logging.getLogger(__name__)

MARKER = ".zckpt.json"
MARKER_FORMAT = "zckpt-output"
KINDS = ("merge", "reshard", "convert")
_CHECKPOINT_NAME = re.compile(r"^(checkpoint-\d+|global_step\d+(_universal)?)$")
_CHECKPOINT_FILES = ("latest", "latest_universal", "trainer_state.json")
_RANK_FILE = re.compile(r"_(model|optim)_states\.pt$")
#: transformers' ``sort_checkpoints`` (trainer_utils.py, under ``rotate_checkpoints`` / ``save_total_limit``): the
#: folders of ``output_dir`` that ``Path(output_dir).glob("checkpoint-*")`` lists and whose whole path
#: ``re.match(".*checkpoint-([0-9]+)", path)`` matches are checkpoints; the oldest are deleted
_ROTATION_GLOB, _ROTATION_STEP = "checkpoint-*", re.compile(r".*checkpoint-([0-9]+)")
#: the word a default output name starts with, by kind (:func:`default_output`): never matched by the rotation
_OUTPUT_WORDS = {"merge": "merged", "reshard": "resharded", "convert": "converted"}


# ================================================================================================ marker


def marker_bytes(kind: str, source: str | None, files: dict[str, int] | None, state: str = "complete") -> bytes:
    from zckpt import __version__
    doc = {"format": MARKER_FORMAT, "version": 1, "kind": kind, "state": state, "zckpt": __version__,
           "source": source, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if files is not None:
        doc["files"] = dict(sorted(files.items()))
    return (json.dumps(doc, indent=1) + "\n").encode()


def read_marker(folder: str, storage_options: dict | None = None) -> dict | None:
    """The marker of ``folder``: None when it has none, ``{}`` when it is not a zckpt marker (unreadable)."""
    try:
        data = storage.read_bytes(storage.join(folder, MARKER), storage_options)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT else {}


def has_marker(folder: str) -> bool:
    """Whether a local folder is a zckpt output (cheap: one stat; used by push's scanner)."""
    return os.path.isfile(os.path.join(storage.local_path(folder), MARKER))


def output_state(folder: str, storage_options: dict | None = None, check_files: bool = True) -> tuple[bool, str]:
    """``(True, detail)`` when ``folder`` is a committed zckpt output with every listed file at its size
    (``check_files=False``: the commit only, e.g. for a reshard output that training has since saved into)."""
    doc = read_marker(folder, storage_options)
    if doc is None:
        return False, f"no {MARKER}: not committed (interrupted, still being written, or not a zckpt output)"
    if not doc:
        return False, f"{MARKER} is not a zckpt marker"
    if doc.get("state") != "complete":
        return False, f"{MARKER} says {doc.get('state')!r}: the {doc.get('kind')} was interrupted or is running"
    files = doc.get("files")
    if not isinstance(files, dict):
        return False, f"{MARKER} lists no files"
    if not check_files:
        return True, f"zckpt {doc.get('kind')} output, committed"
    have = storage.list_files(folder, storage_options)
    bad = [rel for rel, size in files.items() if have.get(rel) != size]
    if bad:
        return False, f"{len(bad)} file(s) missing or of the wrong size, e.g. {bad[0]}"
    return True, f"zckpt {doc.get('kind')} output, {counted(len(files), 'file')} committed"


# ============================================================================= where an output may go


@dataclass
class Source:
    """The checkpoint an output is made from, as far as output placement is concerned."""

    root: str  # the folder that is the checkpoint as a whole (Trainer checkpoint-N, save folder, or tag folder)
    own: list[str] = field(default_factory=list)  # root, tag folder, the path given: "the source checkpoint"
    neighbours: list[str] = field(default_factory=list)  # checkpoint-N / global_stepN folders next to root
    label: str = ""  # names default outputs: root's name (+ "-<tag>" when a tag was picked)


def source_of(loc, picked_tag: bool = False, storage_options: dict | None = None) -> Source:
    """The :class:`Source` of a located checkpoint (:class:`zckpt.deepspeed.discover.Location`).

    ``storage_options``: for listing a remote source's parent folder; by default the ones the checkpoint was
    located with (``loc.storage_options``)."""
    if storage_options is None:
        storage_options = getattr(loc, "storage_options", None)
    if loc.trainer_dir:
        root = loc.trainer_dir
    elif loc.save_dir != loc.tag_dir and (loc.has_latest or loc.input_path == loc.save_dir):
        root = loc.save_dir
    else:
        root = loc.tag_dir  # a tag folder on its own
    own = list(dict.fromkeys([root, loc.tag_dir, loc.input_path]))
    neighbours = []
    parent = storage.parent(root)
    if parent != root:
        with contextlib.suppress(OSError, ValueError):
            for name in storage.listdir(parent, storage_options):
                if _CHECKPOINT_NAME.match(name) and storage.join(parent, name) not in own:
                    neighbours.append(storage.join(parent, name))
    label = storage.basename(root)
    if root != loc.tag_dir and (picked_tag or loc.input_path == loc.tag_dir):
        label += f"-{loc.tag}"
    return Source(root, own, neighbours, label)


def default_output(source: Source, what: str) -> str:
    """``<parent of the source>/<what>-<label>`` e.g. ``outputs/merged-checkpoint-4-fp32`` for what="merged" and
    a label suffix given by the caller: never inside the checkpoint, never named like one."""
    return storage.join(storage.parent(source.root), f"{what}-{source.label}")


def _norm(path: str) -> tuple[str, str]:
    path = os.fspath(path)
    if storage.is_url(path):
        return storage.protocol(path), path.rstrip("/")
    return "file", os.path.realpath(storage.local_path(path))


def rotation_deletes(folder: str, name: str) -> bool:
    """Whether the Trainer's checkpoint rotation (``save_total_limit``) of output folder ``folder`` counts a folder
    ``name`` in it as a checkpoint, and so may delete it (transformers' ``sort_checkpoints``: :data:`_ROTATION_GLOB`,
    then :data:`_ROTATION_STEP` on the whole path)."""
    import fnmatch

    return (fnmatch.fnmatchcase(name, _ROTATION_GLOB) and not name.startswith(".")
            and _ROTATION_STEP.match(storage.join(folder, name)) is not None)


def _training_output_folder(folder: str, name: str, source: Source | None, storage_options) -> bool:
    """``folder`` is where a training run rotates its checkpoints: the source checkpoint's parent, or a folder that
    holds a checkpoint-N folder (other than ``name``)."""
    if source is not None and _relation(folder, storage.parent(source.root)) == "is":
        return True
    with contextlib.suppress(OSError, ValueError, StorageError):
        if storage.is_url(folder):
            return False  # (the Trainer rotates local folders; a URL's listing is not worth a request here)
        return any(n != name and rotation_deletes(folder, n) and os.path.isdir(os.path.join(folder, n))
                   for n in os.listdir(folder))
    return False


def _check_output_name(out: str, kind: str, source: Source | None, storage_options) -> None:
    """Refuse (:class:`OptionError`, before anything is written) an output named so that the folder it lands in
    would take it for a checkpoint: a name the Trainer's rotation deletes in a training output folder, or
    ``checkpoint-N`` / ``global_stepN`` next to the source (resuming would take it for the newest checkpoint)."""
    name, folder = storage.basename(out), storage.parent(out)
    safe = storage.join(folder, f"{_OUTPUT_WORDS.get(kind, 'out')}-{name}")
    hint = f"name it so that it does not start with checkpoint-, e.g. `out` {safe}"
    if rotation_deletes(folder, name) and _training_output_folder(folder, name, source, storage_options):
        raise OptionError(f"the output would be named like a checkpoint ({name}) in a training output folder: the "
                          f"Trainer's checkpoint rotation (save_total_limit) lists {_ROTATION_GLOB} folders whose "
                          "name holds checkpoint-<digits> and deletes the oldest", path=out, hint=hint)
    if source is not None and _CHECKPOINT_NAME.match(name) and _relation(folder, storage.parent(source.root)) == "is":
        raise OptionError(f"the output would be named like a checkpoint ({name}) next to the source checkpoint: "
                          "resuming would take it for one", path=out, hint=f"choose another name, e.g. `out` {safe}")


def _relation(out: str, other: str) -> str | None:
    (po, a), (pb, b) = _norm(out), _norm(other)
    if po != pb:
        return None
    if a == b:
        return "is"
    sep = "/" if po != "file" else os.sep
    if a.startswith(b.rstrip(sep) + sep):
        return "inside"
    if b.startswith(a.rstrip(sep) + sep):
        return "contains"
    return None


def looks_like_checkpoint(folder: str, storage_options: dict | None = None) -> bool:
    """Whether ``folder`` holds what only a checkpoint (or a training output folder) has: ``latest``,
    ``trainer_state.json``, rank files or tag / checkpoint-N folders."""
    names = set(storage.listdir(folder, storage_options))
    return bool(names & set(_CHECKPOINT_FILES)) or any(_RANK_FILE.search(n) for n in names) or any(
        _CHECKPOINT_NAME.match(n) for n in names)


def check_output(out: str, kind: str, source: Source | None = None, overwrite: bool = False,
                 storage_options: dict | None = None) -> None:
    """Refuse, before anything is written, an output that would touch the source or replace something else.

    Raises :class:`InvalidArgument` when ``out`` is, contains or sits inside the source checkpoint (or a
    checkpoint folder next to it), :class:`OutputExists` when it holds something ``--overwrite`` may not replace:
    anything but a previous zckpt output of the same ``kind`` (recognised by its marker)."""
    out = os.fspath(out)
    hint = "choose an `out` outside the checkpoint; the source is never modified"
    places = [(p, True) for p in source.own] + [(p, False) for p in source.neighbours] if source else []
    relations = [(_relation(out, other), other, own) for other, own in places]
    relations.sort(key=lambda r: r[0] != "is")  # name the folder itself before one around it
    for rel, other, own in relations:
        what = f"the source checkpoint {other}" if own else f"checkpoint {other}, next to the source"
        if rel == "is":
            what = "the source checkpoint itself" if own else what
            raise InvalidArgument(f"the output would be {what}", path=out, hint=hint)
        if rel == "inside":
            raise InvalidArgument(f"the output would be inside {what}", path=out, hint=hint)
        if rel == "contains":
            raise InvalidArgument(f"the output folder contains {what}; replacing it would delete it", path=out,
                                  hint=hint)
    _check_output_name(out, kind, source, storage_options)
    if storage.is_url(out):
        if storage.isfile(out, storage_options):
            raise OutputExists("output exists and is not a folder", path=out, hint="choose another `out`")
        if not storage.list_files(out, storage_options):
            return
    else:
        if not os.path.exists(out):
            return
        if not os.path.isdir(out):
            raise OutputExists("output exists and is not a folder", path=out, hint="choose another `out`")
        if not os.listdir(out):
            return
    marker = read_marker(out, storage_options)
    same = bool(marker) and marker.get("kind") == kind
    if not overwrite:
        what = f"holds a previous zckpt {kind} output" if same else "is not empty"
        raise OutputExists(f"output folder {what}", path=out,
                           hint="pass `overwrite` to replace it, or choose another `out`" if same else
                           f"choose another `out` (`overwrite` replaces only a previous zckpt {kind} output)")
    if same:
        _check_only_ours(out, marker, kind, storage_options)
        return
    if marker:
        why = f"holds a zckpt {marker.get('kind')} output, not a {kind} output"
    elif marker is not None:
        why = f"has a {MARKER} that zckpt did not write"
    elif looks_like_checkpoint(out, storage_options):
        why = "holds a checkpoint"
    else:
        why = f"is not empty and has no {MARKER}"
    raise OutputExists(f"output folder {why}; `overwrite` replaces only a previous zckpt {kind} output", path=out,
                       hint="choose another `out`, or remove the folder yourself")


def _check_only_ours(out: str, marker: dict, kind: str, storage_options: dict | None = None) -> None:
    """``--overwrite`` replaces only what the previous output's marker lists: a file anyone else put in the folder
    (a model card, notes, a later save) makes it refuse, naming the file, so nothing the user wrote is deleted. A
    remote output still marked "writing" lists no files yet (an interrupted run): it is replaced whole."""
    listed = marker.get("files")
    if not isinstance(listed, dict):
        if marker.get("state") == "complete":
            raise OutputExists(f"output folder has a {MARKER} without its file list", path=out,
                               hint="choose another `out`, or remove the folder yourself")
        return
    ours = set(listed) | {MARKER}
    others = sorted(rel for rel in storage.list_files(out, storage_options) if rel not in ours)
    if others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise OutputExists(f"output folder holds {others[0]}{more}, which the previous zckpt {kind} output did not "
                           f"write; `overwrite` replaces only the files its {MARKER} lists",
                           path=out, hint=f"move {others[0]} out of the folder, or choose another `out`")


# ================================================================================= local: scratch + rename


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(out: str, parent: str | None = None) -> None:
    """Remove scratch folders of earlier runs for ``out`` whose process is gone; an output that such a run had
    moved aside (``.<name>.zckpt-old-*``) and not yet replaced is put back."""
    name = storage.basename(out) or "out"
    parent = parent or os.path.dirname(os.path.abspath(out)) or "."
    target = os.path.join(parent, name)
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return
    for kind in ("old", "tmp"):  # old first: restore before sweeping
        head = f".{name}.zckpt-{kind}-"
        for entry in entries:
            if not entry.startswith(head):
                continue
            pid = entry[len(head):].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            path = os.path.join(parent, entry)
            if kind == "old" and not os.path.exists(target):
                with contextlib.suppress(OSError):
                    os.rename(path, target)
                    log.warning("%s: restored the previous output that an interrupted run had moved aside", target)
                    continue
            shutil.rmtree(path, ignore_errors=True)


def scratch_dir(out: str, parent: str | None = None) -> str:
    """A new temporary folder next to ``out`` (same file system, so publishing is a rename), named after this
    process; scratch folders of earlier runs that were killed are swept first. Errors name ``out``."""
    name = storage.basename(out) or "out"
    parent = parent or os.path.dirname(os.path.abspath(out)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        sweep(out, parent)
        return tempfile.mkdtemp(prefix=f".{name}.zckpt-tmp-{os.getpid()}-", dir=parent)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror or str(exc), out) from exc


_libc = None


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where not available."""
    global _libc
    if os.environ.get("ZCKPT_NO_RENAME_EXCHANGE"):
        return False
    try:
        if _libc is None:
            import ctypes  # only when an output is replaced (start-up of every command stays lean)
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    import ctypes
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def publish_dir(tmp: str, out: str, durable: bool = False) -> None:
    """Move the finished folder ``tmp`` to ``out``. An existing ``out`` is swapped out in one step, or (where the
    kernel cannot) moved aside first; either way it is deleted only once the new one is in place."""
    os.chmod(tmp, 0o777 & ~storage.umask())  # mkdtemp made it 0700: give it what mkdir would
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        if _exchange(tmp, out):  # tmp is now the old output
            if os.path.islink(tmp):
                os.unlink(tmp)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = tempfile.mkdtemp(prefix=f".{storage.basename(out)}.zckpt-old-{os.getpid()}-", dir=parent)
            os.rmdir(old)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    if durable:
        storage.fsync_dir(parent)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# =========================================================================================== the publisher


class Publisher:
    """Writes one output folder so that it appears complete or not at all::

        check_output(out, "merge", source, overwrite)     # up front, before any byte is written
        with Publisher(out, "merge", source=src) as pub:
            write pub.path("model.safetensors") ...; pub.done("model.safetensors")   # remote: uploaded now
            pub.write_bytes("config.json", data)
            pub.commit()                                   # marker last; local: rename into place

    Files go to a scratch folder (local outputs: next to OUT; URLs: in the temp dir, one file at a time).
    Leaving the block without :meth:`commit` removes the scratch folder and leaves any previous output (local)
    or an output marked "writing" (object store: incomplete to every reader). ``durable=True`` fsyncs files,
    marker and folder (local) before publishing."""

    def __init__(self, out: str, kind: str, source: str | None = None, durable: bool = False,
                 storage_options: dict | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown output kind {kind!r}")
        self.out, self.kind, self.source, self.durable = os.fspath(out), kind, source, durable
        self.storage_options = storage_options
        self.remote = storage.is_url(self.out)
        self.files: dict[str, int] = {}
        self.tmp: str | None = None
        self.committed = False

    def __enter__(self) -> Publisher:
        self.tmp = scratch_dir(self.out, tempfile.gettempdir() if self.remote else None)
        if self.remote:  # from now on the location is a zckpt output being written: incomplete to readers
            storage.write_bytes_atomic(storage.join(self.out, MARKER),
                                       marker_bytes(self.kind, self.source, None, state="writing"),
                                       self.storage_options)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, OSError) and isinstance(exc.filename, str) and self.tmp and \
                exc.filename.startswith(self.tmp):  # name the user's path, not the scratch folder
            with contextlib.suppress(AttributeError, TypeError):
                exc.filename = storage.join(self.out, os.path.relpath(exc.filename, self.tmp))

    def path(self, rel: str) -> str:
        """The local file to write ``rel`` into (its folder is created)."""
        dst = os.path.join(self.tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        return dst

    def done(self, rel: str) -> None:
        """``rel`` is written: record it (and on object stores upload it now and drop the local copy)."""
        local = os.path.join(self.tmp, rel)
        self.files[rel.replace(os.sep, "/")] = os.path.getsize(local)
        if self.remote:
            storage.put_file(local, storage.join(self.out, rel.replace(os.sep, "/")),
                             storage_options=self.storage_options)
            os.remove(local)

    def adopt(self, rel: str, size: int) -> None:
        """``rel`` (``size`` bytes) was written into the output by another process (a distributed run's rank):
        list it in the marker; :meth:`commit` checks it is there, at that size, on object stores."""
        self.files[rel.replace(os.sep, "/")] = int(size)

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.remote:
            storage.write_bytes_atomic(storage.join(self.out, rel), data, self.storage_options)
            self.files[rel] = len(data)
            return
        with open(self.path(rel), "wb") as f:
            f.write(data)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        self.done(rel)

    def commit(self) -> None:
        """Write the marker last and make the output visible."""
        if self.remote:
            self._commit_remote()
        else:
            with open(os.path.join(self.tmp, MARKER), "wb") as f:
                f.write(marker_bytes(self.kind, self.source, self.files))
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            if self.durable:
                storage.fsync_dir(self.tmp)
            publish_dir(self.tmp, self.out, self.durable)
        self.committed = True

    def _commit_remote(self) -> None:
        there = storage.list_files(self.out, self.storage_options)
        for rel in sorted(set(there) - set(self.files) - {MARKER}):  # what an older output left behind
            storage.remove(storage.join(self.out, rel), storage_options=self.storage_options, missing_ok=True)
        missing = [rel for rel, size in self.files.items() if there.get(rel) != size]
        if missing:
            raise StorageError(f"{len(missing)} file(s) missing after upload, e.g. {missing[0]}; not committed",
                               path=self.out, hint="run it again with `overwrite`")
        commit_remote(self.out, MARKER, marker_bytes(self.kind, self.source, self.files), self.storage_options)


# ============================================================== object-store commit markers (push uses these)


def begin_remote(folder: str, marker: str = MARKER, storage_options: dict | None = None) -> None:
    """Withdraw the commit marker of ``folder`` before any of its files is replaced."""
    storage.remove(storage.join(folder, marker), storage_options=storage_options, missing_ok=True)


def missing_remote(folder: str, expected: dict[str, int], storage_options: dict | None = None) -> list[str]:
    """Files of ``expected`` (relpath -> size) not at ``folder`` with that size."""
    there = storage.list_files(folder, storage_options)
    return [rel for rel, size in expected.items() if there.get(rel) != size]


def commit_remote(folder: str, marker: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write the commit marker, last, in one PUT (whole or not at all)."""
    storage.write_bytes_atomic(storage.join(folder, marker), data, storage_options)
