"""Reading torch ``.pt`` files without running pickle code and without loading tensor bytes.

A file written by ``torch.save`` (the zip format, default since torch 1.6) looks like::

    <archive>/data.pkl            the pickled object; tensors appear as persistent ids ('storage', type, key, ...)
    <archive>/byteorder           'little'
    <archive>/data/<key>          raw bytes of storage <key>, stored uncompressed (64-byte aligned by torch)
    <archive>/version, .format_version, .storage_alignment, .data/serialization_id
    ... zip central directory at the end

:func:`load` reads the central directory, unpickles ``data.pkl`` with an unpickler whose ``find_class`` only
answers an allow-list of globals (mapped to inert stand-ins: no DeepSpeed, no torch needed) and returns the
object with every tensor replaced by a :class:`LazyTensor`: dtype, shape, stride and the absolute byte offset
of its storage in the file. Bytes are read later, only for the ranges asked for.

Any other global is refused with :class:`~zckpt.errors.UnsafePickle` naming it; a damaged zip, a truncated
file or a storage that lies outside the file is a :class:`~zckpt.errors.CorruptFile`.

Legacy (non-zip) files (``torch.save(..., _use_new_zipfile_serialization=False)``, DeepSpeed's
``checkpoint_serialization: false``) are read the same way: their object pickle through the same allow-list, their
storages placed by :mod:`zckpt.encoding.legacy` (after each one's 8-byte size field), so a :class:`LazyTensor` of
either kind is a byte range of the file.

Its parts: :mod:`zckpt.encoding.lazytensor` (:class:`LazyTensor`, :class:`StorageRef`, the dtype tables),
:mod:`zckpt.encoding.allowlist` (the allow-list, its stand-ins and copy budget); this module opens the file (zip
or legacy), checks its pickle and places the storages, and keeps the names callers use
(``safeload.load``, ``safeload.LazyTensor``, ``safeload.Inert`` ...).
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Any, BinaryIO, Callable

from zckpt.errors import CorruptFile, UnsupportedLayout, ZckptError
from zckpt.encoding import allowlist, legacy
from zckpt.encoding.allowlist import (ALLOWED_GLOBALS, COPY_BASE, COPY_FACTOR, EnumValue, Inert, SafeUnpickler,
                                     TorchDevice, TorchDtype, gc_paused)
from zckpt.encoding.lazytensor import DTYPE_SIZES, FLOATING, LazyTensor, StorageRef
from zckpt.encoding.pickles import check_nesting, scan
from zckpt.encoding.zipentries import LOCAL_SIG, ZipEntry, read_entries

__all__ = ["load", "load_plain", "legacy_layout", "MAX_PICKLE_BYTES", "DTYPE_SIZES", "FLOATING", "LazyTensor",
           "StorageRef", "ALLOWED_GLOBALS", "COPY_BASE", "COPY_FACTOR", "EnumValue", "Inert", "TorchDevice",
           "TorchDtype", "gc_paused"]

MAX_PICKLE_BYTES = 1 << 30  # a metadata pickle larger than this is not a checkpoint we should trust


# --------------------------------------------------------------------------------------------- the archive

def _METADATA_ENTRIES(name: str, size: int) -> bool:
    """The entries :class:`_Archive` reads whole (fetched with the zip headers from a remote file)."""
    return (name.endswith("/data.pkl") and name.count("/") == 1 and size <= MAX_PICKLE_BYTES) \
        or name.endswith("/byteorder")


class _Archive:
    """The zip directory of one torch file (checked by :func:`zckpt.encoding.zipentries.read_entries`): where each entry's
    bytes start."""

    def __init__(self, path: str, fileobj: BinaryIO, size: int):
        self.path, self.f, self.size = path, fileobj, size
        self.entries = read_entries(fileobj, size, path, payloads=_METADATA_ENTRIES)
        pkls = [n for n in self.entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CorruptFile("zip archive has no torch data.pkl: not a torch checkpoint", path=path)
        self.prefix = pkls[0][: -len("data.pkl")]
        order = self.entries.get(self.prefix + "byteorder")
        if order is not None and self.read_entry(order, 16).strip() not in (b"little", b""):
            raise UnsupportedLayout("big-endian torch files are not supported", path=path)

    def read_entry(self, entry: ZipEntry, limit: int) -> bytes:
        if entry.size > limit:
            raise CorruptFile(f"entry {entry.name} is {entry.size} bytes, over the {limit} limit", path=self.path)
        self.f.seek(entry.data_offset)
        data = self.f.read(entry.size)
        if len(data) != entry.size:
            raise CorruptFile(f"entry {entry.name} is truncated", path=self.path)
        return data

    def storage_ref(self, key: str, dtype: str, numel=None) -> StorageRef:
        if dtype not in DTYPE_SIZES:
            raise UnsupportedLayout(f"storage dtype {dtype} is not supported", path=self.path)
        entry = self.entries.get(f"{self.prefix}data/{key}")
        if entry is None:
            raise CorruptFile(f"storage {key} named in the pickle is missing from the archive", path=self.path)
        return StorageRef(self.path, key, dtype, entry.data_offset, entry.size, entry.crc)


def _check_opcodes(data: bytes, path: str, what: str = "data.pkl") -> None:
    """Refuse pickles that would make the C unpickler allocate far more than their size (a memo index past the
    pickle's length: ``LONG_BINPUT 678654301`` is 5 bytes and gigabytes of memo table), or that are damaged."""
    scan(data, 0, path, what, limit=len(data))


def _default_opener(path: str, storage_options: dict | None = None, size: int | None = None) -> BinaryIO:
    from zckpt.io import storage
    if "://" in str(path):  # fetched in a few parallel rounds (the zip directory, then what it points to)
        return storage.open_ranges(path, storage_options, size_hint=size)
    # unbuffered: each read is one read of exactly the bytes asked for (headers, pickles), nothing ahead of it: a
    # read-ahead of the zip's headers (as remote files have) would read tensor bytes the data path reads again
    return storage.metered(open(path, "rb", buffering=0), path)


class _Head:
    """A file whose first bytes (already read) are served from memory: every byte is read from the file once."""

    def __init__(self, f: BinaryIO, head: bytes):
        self.f, self.head, self.pos = f, head, len(head)

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = self.f.seek(pos, whence)
        return self.pos

    def tell(self) -> int:
        return self.pos

    @property
    def prefetch(self):
        """The file's ``prefetch(ranges)`` (a remote file fetching what the zip directory points to), or None."""
        return getattr(self.f, "prefetch", None)

    def read(self, n: int = -1) -> bytes:
        out = b""
        if self.pos < len(self.head):
            out = self.head[self.pos:self.pos + n if n >= 0 else None]
            self.pos += len(out)
            n = n - len(out) if n >= 0 else n
            if n == 0:
                return out
            self.f.seek(self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return out + data


def load(path: str, opener: Callable[[str], BinaryIO] | None = None, storage_options: dict | None = None,
         size_hint: int | None = None) -> Any:
    """Unpickle a torch zip file's metadata safely. Tensors become :class:`LazyTensor`; no bytes are loaded.

    ``opener`` opens ``path`` for binary random access (defaults to zckpt's storage layer, which handles URLs,
    with the fsspec ``storage_options`` given here; ``size_hint``, the file's size where a listing gave it, lets a
    remote file be fetched in fewer round trips: :func:`zckpt.io.storage.open_ranges`).
    """
    if opener is None:
        opener = functools.partial(_default_opener, storage_options=storage_options, size=size_hint)
    try:
        f = opener(path)
    except FileNotFoundError:
        from zckpt.errors import CheckpointNotFound
        raise CheckpointNotFound("file not found", path=path) from None
    with f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(0)
        magic = f.read(4)
        f = _Head(f, magic)  # the first bytes are not read again for the first header
        if magic != LOCAL_SIG:
            if legacy.is_legacy(magic):
                return _load_legacy(path, f, size)
            raise CorruptFile("not a torch checkpoint (no zip signature)" if size else "file is empty", path=path)
        archive = _Archive(path, f, size)
        info = archive.entries[archive.prefix + "data.pkl"]
        data = archive.read_entry(info, MAX_PICKLE_BYTES)
        if zlib.crc32(data) != info.crc:
            raise CorruptFile("data.pkl fails its CRC check (the file is damaged)", path=path)
        _check_opcodes(data, path)
        unpickler = SafeUnpickler(data, archive)
        obj = _unpickle(unpickler, path, size=len(data))
        return allowlist.unwrap(obj) if unpickler.placeholders else obj


def _unpickle(unpickler: SafeUnpickler, path: str, what: str = "data.pkl", size: int = 0) -> Any:
    """The unpickled object, its nesting checked (:func:`zckpt.encoding.pickles.check_nesting`; ``size``: the
    pickle's bytes, which bound the visits a real one needs)."""
    try:
        obj = unpickler.load()
        check_nesting(obj, path, what, budget=2 * size + 10**6, paths=64 * size + 10**7)
        return obj
    except ZckptError as exc:  # raised by a stand-in deep in the pickle: name the file
        if exc.path is None:
            exc.path = path
        raise
    except RecursionError:
        raise CorruptFile("pickle nests too deeply", path=path) from None
    except Exception as exc:  # pickle.UnpicklingError, EOFError, TypeError from bad arguments ...
        raise CorruptFile(f"damaged pickle in {what} ({type(exc).__name__}: {exc})"[:300], path=path) from None


class _LegacyArchive:
    """A legacy file's storages while its object pickle is read: sizes from the pickle, places found after."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size

    def storage_ref(self, key: str, dtype: str, numel) -> StorageRef:
        if dtype not in DTYPE_SIZES:
            raise UnsupportedLayout(f"storage dtype {dtype} is not supported", path=self.path)
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0 \
                or numel * DTYPE_SIZES[dtype] > self.size:
            raise CorruptFile(f"storage {key} claims {numel!r} elements: more than the file holds", path=self.path)
        return StorageRef(self.path, key, dtype, -1, numel * DTYPE_SIZES[dtype])


def legacy_layout(path: str, f: BinaryIO, size: int) -> tuple[Any, dict, int]:
    """A legacy (non-zip) file read: (the object, key -> :class:`zckpt.encoding.legacy.Place`, bytes read).

    See :mod:`zckpt.encoding.legacy` for the layout and what is refused."""
    header = legacy.read_header(f, size, path)
    unpickler = SafeUnpickler(header.obj_pickle, _LegacyArchive(path, size))
    obj = _unpickle(unpickler, path, "the object pickle", len(header.obj_pickle))
    storages = {k: (st.ref.nbytes // DTYPE_SIZES[st.dtype], DTYPE_SIZES[st.dtype])
                for k, st in unpickler.storages.items()}
    places, read = legacy.locate(f, header, storages)
    for key, st in unpickler.storages.items():
        st.place(places[key].offset)
    return (allowlist.unwrap(obj) if unpickler.placeholders else obj), places, header.bytes_read + read


def _load_legacy(path: str, f: BinaryIO, size: int) -> Any:
    return legacy_layout(path, f, size)[0]


# ------------------------------------------------------------------------------------ pickles outside a zip

class _Named:
    def __init__(self, path: str):
        self.path = path


class _PlainUnpickler(SafeUnpickler):
    """The same allow-list for a pickle that is not a torch zip's data.pkl (DCP's ``.metadata``): ``extra`` adds
    stand-ins for the format's own classes; a persistent id (a tensor storage) is refused."""

    def __init__(self, data: bytes, path: str, extra: dict[str, Any]):
        super().__init__(data, _Named(path))
        self.extra = extra

    def find_class(self, module, name):
        qual = f"{module}.{name}"
        if qual in self.extra:
            return self.extra[qual]
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise CorruptFile("a plain pickle refers to a tensor storage (persistent id)", path=self.archive.path)


def load_plain(data: bytes, path: str, extra: dict[str, Any] | None = None, nesting: bool = True) -> Any:
    """Unpickle ``data`` (a whole pickle, not a torch zip) with the allow-list of :func:`load` plus ``extra``
    (qualified name -> stand-in), after the same opcode checks; nothing outside both is ever constructed.

    ``nesting=False`` skips :func:`~zckpt.encoding.pickles.check_nesting` (a walk of every object: 5 s of a
    10**6-chunk ``.metadata``) for a caller that walks the result in a fixed shape itself, keeps only values it
    checked (strings, tuples of ints) and never recurses into, hashes or prints an unchecked object
    (:func:`zckpt.encoding.dcpmeta.parse`)."""
    if len(data) > MAX_PICKLE_BYTES:
        raise CorruptFile(f"pickle of {len(data)} bytes, over the {MAX_PICKLE_BYTES} limit", path=path)
    _check_opcodes(data, path, str(path).rsplit("/", 1)[-1])  # (a whole file: .metadata, not a zip's data.pkl)
    try:
        unpickler = _PlainUnpickler(data, path, extra or {})
        obj = unpickler.load()
        if nesting or unpickler.placeholders:  # (unwrap walks the whole object)
            check_nesting(obj, path, budget=2 * len(data) + 10**6, paths=64 * len(data) + 10**7)
        return allowlist.unwrap(obj) if unpickler.placeholders else obj
    except ZckptError as exc:
        if exc.path is None:
            exc.path = path
        raise
    except RecursionError:
        raise CorruptFile("pickle nests too deeply", path=path) from None
    except Exception as exc:
        raise CorruptFile(f"damaged pickle ({type(exc).__name__}: {exc})"[:300], path=path) from None
