"""Is a checkpoint complete and consistent? Checks from metadata, and with ``deep=True`` every byte.

Metadata checks (reading only the pickles): every rank file present and readable, ``partition_count`` agrees
with the files, partitions agree with ``param_shapes`` (and each rank's ``param_slice_mappings``), every file
names the same DeepSpeed version and world size, ``latest`` names an existing tag, ``module`` shapes agree.
Deep checks: the CRC-32 of every zip entry (a flipped bit anywhere in tensor data is caught), and the hashes of a
``zckpt-manifest.json`` when one is present (written by ``zckpt push``). Legacy (non-zip) torch files have no
CRCs: for them every byte is read and hashed (and checked against the manifest's sha256 when there is one), the
layout re-checked (pickles, storage keys, storage sizes that end the file) and every storage's size field compared
with the pickle in the stream. zckpt outputs (merged weights, reshard
results) are checked against their ``.zckpt.json`` marker: without a complete one they are incomplete.
"""

from __future__ import annotations

import json
import logging
import math
import time
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from zckpt.io import hashing, publish, storage
from zckpt.deepspeed.layout import Checkpoint, metadata_errors, open_checkpoint
from zckpt.ops.destinations import MANIFEST_NAME
from zckpt.errors import CheckpointNotFound, CorruptFile, ZckptError, names_rendered
from zckpt.formats import legacy
from zckpt.formats.safeload import LazyTensor, legacy_layout
from zckpt.formats.zipentries import read_entries
from zckpt.units import format_size

MANIFEST = MANIFEST_NAME  # written by zckpt push

log = logging.getLogger(__name__)


#: what to do when a check fails, by check name (parameters in backquotes, shown as flags by the CLI)
NEXT_STEPS = {
    "CRC of every entry": "the bytes of that file are damaged: copy it again from where it was saved (or a "
                          "backup), or use an earlier tag with `tag`",
    "manifest": "files differ from what zckpt push sent: push again from the source, or copy them again",
    "zckpt output committed": "the output was interrupted or is still being written: run the command again",
    "safetensors headers": "a weight file is damaged or truncated: run the merge again",
    "versions agree": "the rank files come from different saves: use an earlier tag with `tag`",
    "dp_world_size": "the rank files come from different saves: use an earlier tag with `tag`",
    "shapes agree": "the rank files come from different saves or are damaged: use an earlier tag with `tag`",
    "optimizer state": "some parameters have no Adam moments: use an earlier tag with `tag`",
    "steps agree": "the rank files come from different steps: use an earlier tag with `tag`",
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""

    @property
    def hint(self) -> str:
        """What to do about a failed check ("" when it passed)."""
        return "" if self.ok else NEXT_STEPS.get(self.name, "")

    def __repr__(self) -> str:
        return f"<Check {'ok' if self.ok else 'BAD'} {self.name}: {self.detail[:80]}>"


@dataclass
class VerifyReport:
    path: str
    checks: list[Check] = field(default_factory=list)
    bytes_read: int = 0
    tag: str | None = None  # the tag checked (None: a merge output or pushed folder, which have none)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __repr__(self) -> str:
        bad = [c.name for c in self.checks if not c.ok]
        verdict = "consistent" if not bad else f"NOT consistent ({', '.join(bad[:3])})"
        read = f", read {format_size(self.bytes_read)}" if self.bytes_read else ""
        return f"<VerifyReport {self.path!r}: {verdict}, {len(self.checks)} checks{read}>"

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def to_json(self) -> dict:
        return {"path": self.path, "tag": self.tag, "ok": self.ok, "bytes_read": self.bytes_read,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                            "hint": names_rendered(c.hint) or None} for c in self.checks]}


def verify(path: str, tag: str | None = None, deep: bool = False,
           progress: Callable[[int, int], None] | None = None, storage_options: dict | None = None) -> VerifyReport:
    """Verify the checkpoint at ``path``. Structural failures raise :class:`~zckpt.errors.ZckptError`
    (the checkpoint cannot even be read); inconsistencies are reported as failed checks.
    ``storage_options``: fsspec options for a URL ``path`` (the CLI's ``--storage-option``), for this call only."""
    report = VerifyReport(str(path))
    opts = storage_options
    try:
        ckpt = open_checkpoint(path, tag, opts)
    except CheckpointNotFound:
        # not a DeepSpeed checkpoint: a zckpt merge output (marker) or a folder published with a manifest still is;
        # a folder with what only checkpoints have (a `latest` naming a missing tag...) gets the reader's error
        if tag is None and not _is_checkpoint_like(str(path), opts) and _is_merge_output(str(path), opts):
            check_output_marker(str(path), report, opts)
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        if tag is None and storage.exists(storage.join(str(path), MANIFEST), opts):
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        raise
    report.tag = ckpt.location.tag
    t0 = time.perf_counter()
    with metadata_errors(ckpt.location.tag_dir):
        check_metadata(ckpt, report)
    log.info("metadata: %d checks, %d failed, in %.2fs", len(report.checks),
             sum(not c.ok for c in report.checks), time.perf_counter() - t0)
    if storage.exists(storage.join(ckpt.location.input_path, publish.MARKER), opts):  # a zckpt reshard output
        report.add("zckpt output committed", *publish.output_state(ckpt.location.input_path, opts, check_files=False))
    if deep:
        t0 = time.perf_counter()
        check_bytes(ckpt, report, progress)
        log.info("read every byte: %d files, %s in %.2fs", len(ckpt.files), format_size(report.bytes_read),
                 time.perf_counter() - t0)
    else:
        check_manifest(ckpt.location.input_path, report, hashes=False, storage_options=opts)
    return report


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
        from zckpt.ops.scan import check_safetensors
        bad = [why for n in sorted(storage.listdir(folder)) if n.endswith(".safetensors")
               for why in [check_safetensors(storage.join(folder, n))] if why]
        if any(n.endswith(".safetensors") for n in storage.listdir(folder)):
            report.add("safetensors headers", not bad, "; ".join(bad[:3]) or "every header matches its file size")


def _entries(ckpt: Checkpoint) -> str:
    """``21 state-dict entries (1 tied alias, which merge stores once)``: why merge reports one tensor fewer."""
    tied = len(ckpt.of_kind("tied"))
    return f"{len(ckpt.records)} state-dict entries" + (
        f" ({tied} tied alias{'es' if tied > 1 else ''}, which merge stores once)" if tied else "")


def check_metadata(ckpt: Checkpoint, report: VerifyReport) -> None:
    loc = ckpt.location
    if ckpt.format == "dcp":
        return check_dcp_metadata(ckpt, report)
    if loc.universal:
        report.add("rank files", True, f"universal: {len(loc.optim_files)} files under zero/ + "
                                       f"{len(loc.model_files)} model-states files")
    else:
        report.add("rank files", True, f"{len(loc.optim_files)} optimizer + {len(loc.model_files)} model-states "
                                       f"files for world size {ckpt.world_size}")
    if loc.has_latest:
        report.add("latest", True, f"names existing tag {loc.tag}")
    versions = {str(s.get("ds_version")) for s in ckpt.model_states + ckpt.optim_states}
    report.add("versions agree", len(versions) == 1, ", ".join(sorted(str(v) for v in versions)))
    dp = {ms.get("dp_world_size") for ms in ckpt.model_states if isinstance(ms.get("dp_world_size"), int)}
    dp.discard(None)
    report.add("dp_world_size", dp <= {ckpt.world_size},
               f"model files say {sorted(dp)}, optimizer partitions {ckpt.world_size}")
    # tensor parallel (AutoTP): module holds this rank's shards; zckpt.deepspeed.tp checks them against its map
    module = (ckpt.model_state.get("module") or {}) if int(ckpt.model_state.get("mp_world_size") or 1) == 1 else {}
    bad = []
    for rec in ckpt.records:
        t = module.get(rec.name)
        if ckpt.stage < 3 and isinstance(t, LazyTensor) and rec.kind != "tied" and tuple(t.shape) != tuple(rec.shape):
            bad.append(f"{rec.name} {list(t.shape)} vs {list(rec.shape)}")
        have = sum(p.numel for p in rec.value)
        if rec.kind != "tied" and have != math.prod(rec.shape):
            bad.append(f"{rec.name}: {have} elements for shape {list(rec.shape)}")
    report.add("shapes agree", not bad, "; ".join(bad[:5]) or _entries(ckpt))
    moments = [r for r in ckpt.of_kind("trainable") if not r.exp_avg or not r.exp_avg_sq]
    report.add("optimizer state", not moments or len(moments) == len(ckpt.of_kind("trainable")),
               "Adam moments present" if not moments else f"no moments for {len(moments)} params")
    steps = {g.step for g in ckpt.groups}
    report.add("steps agree", len(steps) <= 1, f"step {sorted(map(str, steps))}")


def check_dcp_metadata(ckpt: Checkpoint, report: VerifyReport) -> None:
    """A DCP folder: the metadata's checks passed when it was read (every item inside its file, chunks tiling
    every tensor); what is left is the model's own consistency."""
    md = ckpt.extra["metadata"]
    data = [f for f in ckpt.files if f.kind == "data"]
    report.add("metadata", True, f"DCP {md.version}: {len(md.tensors)} tensors, {len(md.values)} values; chunks "
                                 "cover every tensor exactly once")
    report.add("data files", True, f"{len(data)} .distcp files, every item inside its file")
    bad = [f"{r.name}: {sum(p.numel for p in r.value)} elements for shape {list(r.shape)}" for r in ckpt.records
           if r.kind != "tied" and sum(p.numel for p in r.value) != math.prod(r.shape)]
    report.add("shapes agree", not bad, "; ".join(bad[:5]) or _entries(ckpt))
    groups = {n for g in ckpt.groups for n in g.names}
    moments = [r for r in ckpt.of_kind("trainable") if r.name in groups and (not r.exp_avg or not r.exp_avg_sq)]
    report.add("optimizer state", not moments or len(moments) == len(groups),
               "Adam moments present" if not moments else f"no moments for {len(moments)} params")
    steps = {g.step for g in ckpt.groups}
    report.add("steps agree", len(steps) <= 1, f"step {sorted(map(str, steps))}")


def check_dcp_bytes(ckpt: Checkpoint, report: VerifyReport, progress=None) -> None:
    """Every item of every ``.distcp`` file read: each is a torch zip whose entries' CRC-32 must match."""
    from zckpt.dcp import reader as dcp_reader
    by_file = dcp_reader.items(ckpt)
    total = sum(length for its in by_file.values() for _, length, _ in its)
    damaged, done = [], 0
    for path, its in by_file.items():
        with storage.open_input(path, ckpt.storage_options) as f:
            for offset, length, key in its:
                window = dcp_reader.Window(f, offset, length)
                try:
                    entries = read_entries(window, length, path)
                except CorruptFile as exc:
                    damaged.append(f"{storage.basename(path)}@{offset} ({key}): {exc.message}")
                    continue
                for e in entries.values():
                    window.seek(e.data_offset)
                    crc, left = 0, e.size
                    while left:
                        block = window.read(min(left, 4 << 20))
                        if not block:
                            break
                        crc, left = zlib.crc32(block, crc), left - len(block)
                    if left or crc != e.crc:
                        damaged.append(f"{storage.basename(path)}@{offset} ({key}):{e.name}")
                done += length
                report.bytes_read += length
                if progress:
                    progress(done, total)
    report.add("CRC of every entry", not damaged, "; ".join(damaged[:5]) or
               f"{sum(len(v) for v in by_file.values())} items in {len(by_file)} files, {done} bytes")


def _scan_file(path: str, storage_options: dict | None = None) -> tuple[int, list[str], str]:
    """One sequential pass over a rank file: the CRC of every zip entry and the sha256 of the whole file.

    Returns (bytes read, damaged entry names, sha256 hex); the hash lets a manifest be checked without a second
    read of the same bytes."""
    with storage.open_input(path, storage_options) as f:
        if legacy.is_legacy(f.read(4)):
            return _scan_legacy(f, path)
        try:
            entries = read_entries(f, None, path)
        except CorruptFile as exc:  # any damage to the directory is a failed check
            return 0, [exc.message], ""
        # [data start, data end, expected CRC, name, running CRC]
        spans = [[e.data_offset, e.data_offset + e.size, e.crc, e.name, 0] for e in entries.values()]
        spans.sort()
        f.seek(0)
        pos, first = 0, 0

        def add_crcs(chunk: memoryview) -> None:  # each entry's CRC over the bytes as they are hashed
            nonlocal pos, first
            end = pos + len(chunk)
            for span in spans[first:]:
                if span[0] >= end:
                    break
                lo, hi = max(span[0], pos), min(span[1], end)
                if lo < hi:
                    span[4] = zlib.crc32(chunk[lo - pos:hi - pos], span[4])
            while first < len(spans) and spans[first][1] <= end:
                first += 1
            pos = end

        digest = hashing.sha256_stream(f, on_chunk=add_crcs, name=path)
    bad = [name for start, stop, want, name, crc in spans if stop > pos or crc != want]
    return pos, bad, digest


def _scan_legacy(f, path: str) -> tuple[int, list[str], str]:
    """A legacy (non-zip) file has no CRCs: its layout is checked (pickles, storage keys, sizes that end the file,
    each storage's size field), then every byte is read and hashed, the size fields compared again in the stream."""
    size = f.seek(0, 2)
    try:
        _obj, places, _n = legacy_layout(path, f, size)
    except ZckptError as exc:
        return 0, [exc.message], ""
    check = legacy.FieldCheck(legacy.size_fields(places))
    f.seek(0)
    digest = hashing.sha256_stream(f, on_chunk=check, name=path)
    return check.pos, check.problems(size), digest


def check_bytes(ckpt: Checkpoint, report: VerifyReport, progress=None) -> None:
    if ckpt.format == "dcp":
        return check_dcp_bytes(ckpt, report, progress)
    files = [f.path for f in ckpt.files]
    total = sum(max(f.size, 0) for f in ckpt.files)
    done = 0
    damaged = []
    hashes = {}
    with ThreadPoolExecutor(4) as pool:
        for path, (n, bad, digest) in zip(files, pool.map(lambda p: _scan_file(p, ckpt.storage_options), files)):
            done += n
            report.bytes_read += n
            hashes[path] = digest
            if progress:
                progress(done, total)
            damaged += [f"{storage.basename(path)}:{b}" for b in bad]
            log.debug("  %s: %s, %s", path, format_size(n), f"{len(bad)} damaged entries" if bad else "CRCs match")
    n_legacy = sum(1 for f in ckpt.files if _is_legacy_file(f.path, ckpt.storage_options))
    note = f" ({n_legacy} legacy files: no CRCs; layout, size fields and every byte read)" if n_legacy else ""
    report.add("CRC of every entry", not damaged,
               "; ".join(damaged[:5]) or f"{len(files)} files, {format_size(done)}{note}")
    check_manifest(ckpt.location.input_path, report, hashes=True, known=hashes, storage_options=ckpt.storage_options)


def _is_legacy_file(path: str, storage_options: dict | None = None) -> bool:
    try:
        with storage.open_input(path, storage_options) as f:
            return legacy.is_legacy(f.read(4))
    except OSError:
        return False


def check_manifest(folder: str, report: VerifyReport, hashes: bool = True, progress=None,
                   known: dict[str, str] | None = None, storage_options: dict | None = None) -> None:
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
            if known and known.get(p):
                if known[p] != meta["sha256"]:
                    bad.append(f"{rel}: sha256 differs")
                continue
            if hashing.sha256_file(p, on_chunk=count, storage_options=opts) != meta["sha256"]:
                bad.append(f"{rel}: sha256 differs")
        except (OSError, ZckptError, KeyError, TypeError, ValueError):
            bad.append(f"{rel}: missing or unreadable")
    what = "sizes and sha256" if hashes else "sizes"
    report.add("manifest", not bad, "; ".join(bad[:5]) or f"{len(items)} files match {MANIFEST} ({what})")
