"""The items of a DCP checkpoint's ``.distcp`` data files, whatever wrote them (``dcp.save``, Megatron-Core's
``torch_dist``): each item is a small torch.save zip at ``[offset, offset + length)`` of its data file, named by
``.metadata`` (:mod:`zckpt.encoding.dcpmeta`).

- :class:`Items`: loads items through :func:`zckpt.encoding.safeload.load` on that byte window, one open file per
  data file: a chunk becomes a ``LazyTensor`` whose offsets are absolute in its data file (no tensor byte read), a
  bytes item the (allow-listed) value it pickles;
- :func:`tensor_runs`: the elements ``[start, start + length)`` of a tensor's row-major flat form as
  (chunk tensor, start inside it, length) runs, from :func:`zckpt.encoding.dcpmeta.chunk_runs` (a format's reader
  turns each run into pieces);
- :func:`items_by_file` / :func:`item_entries`: every item of a checkpoint by data file, and the zip entries (with
  their CRC-32s) of items, for the input check and ``verify --deep``.
"""

from __future__ import annotations

from zckpt.encoding import dcpmeta, safeload
from zckpt.encoding.safeload import LazyTensor, StorageRef
from zckpt.encoding.zipentries import Window, ZipEntry, read_entries
from zckpt.errors import CorruptFile
from zckpt.io import storage


class Items:
    """Loads DCP items (each a torch.save zip inside a data file of ``folder``) through :func:`safeload.load`,
    one open file per data file."""

    def __init__(self, folder: str, opts: dict | None):
        self.folder, self.opts, self.files = folder, opts, {}

    def load(self, name: str, offset: int, length: int):
        path = storage.join(self.folder, name)
        f = self.files.get(name)
        if f is None:
            f = self.files[name] = open(path, "rb") if not storage.is_url(path) else storage.open_input(path, self.opts)
        return safeload.load(path, opener=lambda _p: Window(f, offset, length))

    def tensor(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk) -> LazyTensor:
        """The chunk as a LazyTensor whose offsets are absolute in its data file."""
        path = storage.join(self.folder, c.file)
        t = self.load(c.file, c.offset, c.length)
        if not isinstance(t, LazyTensor):
            raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset} is not a tensor", path=path)
        if t.dtype != te.dtype or tuple(t.shape) != tuple(c.sizes):
            raise CorruptFile(f"DCP chunk of '{te.key}' at byte {c.offset} holds {t.dtype} {list(t.shape)}, the "
                              f"metadata says {te.dtype} {list(c.sizes)}", path=path)
        s = t.storage
        return LazyTensor(StorageRef(path, s.key, s.dtype, s.offset + c.offset, s.nbytes), t.storage_offset,
                          t.shape, t.stride, t.dtype)

    def close(self):
        for f in self.files.values():
            f.close()


def tensor_runs(items: Items, te: dcpmeta.TensorEntry, path: str, start: int = 0,
                length: int | None = None, cache: dict | None = None) -> list[tuple[LazyTensor, int, int]]:
    """Elements ``[start, start + length)`` of ``te``'s row-major flat tensor (default: all of it) as
    ``(chunk tensor, start inside the chunk, length)`` runs, in order. ``cache``: chunk -> LazyTensor, kept across
    calls so a chunk's zip is read once when a tensor is taken in several ranges."""
    end = te.numel if length is None else start + length
    chunks = {} if cache is None else cache
    out = []
    for flat, c, local, n in dcpmeta.chunk_runs(te, path):
        lo, hi = max(flat, start), min(flat + n, end)
        if lo >= hi:
            continue
        if c not in chunks:
            chunks[c] = items.tensor(te, c)
        out.append((chunks[c], local + lo - flat, hi - lo))
    return out


def items_by_file(md: dcpmeta.DcpMetadata, folder: str) -> dict[str, list[tuple[int, int, str]]]:
    """Every item of ``md`` by data file path (in ``folder``): (offset, length, key), sorted."""
    out: dict[str, list] = {}
    for te in md.tensors.values():
        for c in te.chunks:
            out.setdefault(storage.join(folder, c.file), []).append((c.offset, c.length, te.key))
    for v in md.values.values():
        out.setdefault(storage.join(folder, v.file), []).append((v.offset, v.length, v.key))
    return {k: sorted(v) for k, v in sorted(out.items())}


def item_entries(path: str, spans: list[tuple[int, int]], storage_options: dict | None = None) -> list[ZipEntry]:
    """The entries of the torch zips at ``(offset, length)`` ``spans`` of a DCP data file, at their offsets in it."""
    out = []
    opener = storage.open_ranges if storage.is_url(path) else storage.open_input
    with opener(path, storage_options) as f:
        for offset, length in spans:
            for e in read_entries(Window(f, offset, length), length, path).values():
                out.append(ZipEntry(e.name, offset + e.header_offset, offset + e.data_offset, e.size, e.crc))
    return out


def crc_entries_of(md: dcpmeta.DcpMetadata, folder: str, storage_options: dict | None = None):
    """``entries(path)``: the zip entries of the items of each data file of ``md`` (a file's directories are read
    on first use): the hook :mod:`zckpt.state.checksums` asks a format for."""
    by_file = items_by_file(md, folder)
    return lambda path: item_entries(path, [(off, n) for off, n, _ in by_file.get(path, ())], storage_options)
