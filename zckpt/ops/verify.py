"""Is a checkpoint complete and consistent? Checks from metadata, and with ``deep=True`` every byte.

Metadata checks (reading only the pickles): every rank file present and readable, ``partition_count`` agrees
with the files, partitions agree with ``param_shapes`` (and each rank's ``param_slice_mappings``), every file
names the same DeepSpeed version and world size, ``latest`` names an existing tag, ``module`` shapes agree.
Every file of the checkpoint (:func:`zckpt.backup.files.checkpoint_files`, the definition push uses): torch zips'
directories intact, safetensors headers matching their sizes. Push manifests (``zckpt-manifest.json``) in the
folder, its tag, or above a tag: sizes (``deep``: sha256); a push record without one: not complete.
Deep checks: every byte of every file read, the CRC-32 of every zip entry (a flipped bit anywhere in tensor data is
caught). Legacy (non-zip) torch files have no CRCs: for them every byte is read and hashed,
the layout re-checked (pickles, storage keys, storage sizes that end the file) and every storage's size field
compared with the pickle in the stream. zckpt outputs (merged weights, reshard results) are checked against their ``.zckpt.json`` marker:
without a complete one they are incomplete. docs/guide.md has the table of what each level checks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from zckpt.io import hashing, publish, storage
from zckpt.state.model import Checkpoint, metadata_errors
from zckpt.state.open import open_checkpoint
from zckpt.errors import (
    CheckpointNotFound, CorruptFile, IncompleteCheckpoint, InvalidArgument, ZckptError, names_rendered, python_name,
)
from zckpt.encoding import legacy
from zckpt.encoding.safeload import LazyTensor, legacy_layout
from zckpt.encoding.zipentries import LOCAL_SIG, StreamedCrcs, read_entries
from zckpt.backup.files import TAG_STEP_RE, TRAINER_RE, CheckpointFile, NotBackedUp, files_in_folder, is_rank_file
from zckpt.backup.find import step_of
from zckpt.backup.manifest import MANIFEST_NAME, RECORD_NAME
from zckpt.backup.scan import latest_problem, safetensors_problem
from zckpt.units import format_size

MANIFEST = MANIFEST_NAME  # written by zckpt push

log = logging.getLogger(__name__)


#: what to do when a check fails, by check name (parameters in backquotes, shown as flags by the CLI)
NEXT_STEPS = {
    "latest": "write the tag's name into 'latest' as DeepSpeed does (printf TAG > latest), or choose the tag with "
              "`tag`",
    "CRC of every entry": "the bytes of that file are damaged: copy it again from where it was saved (or a "
                          "backup), or use an earlier tag with `tag`",
    "CRC of every item": "the bytes of that .distcp file are damaged: copy it again from where it was saved (or a "
                         "backup)",
    "CRC of the other files": "the bytes of that file are damaged: copy it again from where it was saved (or a "
                              "backup)",
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
    advice: str = ""  # what to do, from a caller that knows more (the CLI: the checkpoint next to a checkpoint-N)

    @property
    def hint(self) -> str:
        """What to do about a failed check ("" when it passed)."""
        return "" if self.ok else (self.advice or NEXT_STEPS.get(self.name, ""))

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

    def to_json(self, name=None) -> dict:
        """``name``: parameter -> how the caller names it (the CLI: its flags); by default as Python passes it."""
        return {"path": self.path, "tag": self.tag, "ok": self.ok, "bytes_read": self.bytes_read,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                            "hint": names_rendered(c.hint, name or python_name) or None} for c in self.checks]}


def verify(path: str, tag: str | None = None, deep: bool = False,
           progress: Callable[[int, int], None] | None = None, storage_options: dict | None = None) -> VerifyReport:
    """Verify the checkpoint at ``path``. Structural failures raise :class:`~zckpt.errors.ZckptError`
    (the checkpoint cannot even be read); inconsistencies are reported as failed checks.

    What is checked, at every level (a save folder, a tag folder, a ``checkpoint-N``, a push destination):
    the rank files' metadata; every file of the checkpoint in ``path`` (:func:`zckpt.backup.files.checkpoint_files`)
    readable as a file, torch zips' directories and safetensors headers intact; every push manifest
    (``zckpt-manifest.json``) that covers ``path`` (in it, in its tag folder, or in the folder above a tag): each
    listed file there at its size, and a push record without its manifest is a push that did not finish. With
    ``deep``: every byte of every file read (the CRC of every zip entry, sha256 against the manifests). A folder
    holding several checkpoints (a push destination of a training output folder) has each of them verified.
    ``storage_options``: fsspec options for a URL ``path`` (the CLI's ``--storage-option``), for this call only."""
    report = VerifyReport(str(path))
    opts = storage_options
    try:
        ckpt = open_checkpoint(path, tag, opts)
    except (CheckpointNotFound, IncompleteCheckpoint, CorruptFile, InvalidArgument) as exc:
        # not a DeepSpeed checkpoint: a zckpt merge output (marker) or a folder published with a manifest still is;
        # a folder with what only checkpoints have (a `latest` naming a missing tag...) gets the reader's error
        if tag is None and _unfinished_push(str(path), report, opts):
            return report
        if not isinstance(exc, CheckpointNotFound):  # damaged, or incomplete: the reader's error
            if isinstance(exc, InvalidArgument) and tag is None and _verify_folder_of_checkpoints(
                    str(path), report, deep, progress, opts):  # "a training output folder, not a checkpoint"
                return report
            raise
        if tag is None and not _is_checkpoint_like(str(path), opts) and _is_merge_output(str(path), opts):
            check_output_marker(str(path), report, opts)
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        if tag is None and storage.exists(storage.join(str(path), MANIFEST), opts):
            check_manifest(str(path), report, hashes=True, progress=progress, storage_options=opts)
            return report
        if tag is None and _verify_folder_of_checkpoints(str(path), report, deep, progress, opts):
            return report
        raise
    report.tag = ckpt.location.tag
    t0 = time.perf_counter()
    with metadata_errors(ckpt.location.tag_dir):
        check_metadata(ckpt, report)
    if ckpt.format != "dcp":
        check_latest(ckpt, report, tag_given=tag is not None)
    log.info("metadata: %d checks, %d failed, in %.2fs", len(report.checks),
             sum(not c.ok for c in report.checks), time.perf_counter() - t0)
    if storage.exists(storage.join(ckpt.location.input_path, publish.MARKER), opts):  # a zckpt reshard/convert output
        report.add("zckpt output committed", *publish.output_state(ckpt.location.input_path, opts, check_files=False))
    files = checkpoint_scope(ckpt, report)
    manifests = [m for m in _manifest_folders(ckpt) if _push_state(m, report, opts)]
    hashes: dict[str, str] = {}
    if deep:
        t0 = time.perf_counter()
        hashes = check_bytes(ckpt, report, progress, files=files,
                             extra=_manifest_bytes(manifests, files, opts))
        log.info("read every byte: %d files, %s in %.2fs", len(files), format_size(report.bytes_read),
                 time.perf_counter() - t0)
    else:  # (a DCP folder's .distcp files are series of zips, checked item by item when it opened)
        check_structure([f for f in files if ckpt.format != "dcp" or not f.rel.endswith((".distcp", ".metadata"))],
                        report, opts)
    for folder in manifests:
        check_manifest(folder, report, hashes=deep, known=hashes, storage_options=opts, scope=files)
    return report


def _key(path: str) -> str:
    return path if storage.is_url(path) else os.path.abspath(storage.local_path(path))


def checkpoint_scope(ckpt: Checkpoint, report: VerifyReport | None = None) -> list[CheckpointFile]:
    """The checkpoint's files in the folder verified (:func:`zckpt.backup.files.files_in_folder`). A file that cannot
    be read as a file is a failed check ``files`` (then only the rank files are read)."""
    try:
        return files_in_folder(ckpt.location, ckpt.format, ckpt.storage_options)
    except NotBackedUp as exc:
        if report is not None:
            report.add("files", False, exc.message)
        return ckpt_rank_files(ckpt)


def ckpt_rank_files(ckpt: Checkpoint) -> list[CheckpointFile]:
    return [CheckpointFile(f.name, f.path, max(f.size, 0)) for f in ckpt.files]


def _manifest_folders(ckpt: Checkpoint) -> list[str]:
    """Where a push manifest covering the folder verified can be: in it, in its tag folder, or (a tag folder given)
    in the folder above, where a pushed Trainer checkpoint keeps it."""
    loc = ckpt.location
    out = [loc.input_path]
    if ckpt.format != "dcp":
        if _key(loc.tag_dir) != _key(loc.input_path):
            out.append(loc.tag_dir)
        elif loc.save_dir and _key(loc.save_dir) != _key(loc.tag_dir):
            out.append(loc.save_dir)
    return list(dict.fromkeys(out))


def _push_state(folder: str, report: VerifyReport, storage_options: dict | None = None) -> bool:
    """True when ``folder`` has a manifest to check. A push record (``.zckpt-push.json``) without a manifest is a
    push that began and never finished, or whose manifest was lost: a failed check, the backup is not complete."""
    if storage.exists(storage.join(folder, MANIFEST), storage_options):
        return True
    if storage.exists(storage.join(folder, RECORD_NAME), storage_options):
        report.add("manifest", False, f"{storage.join(folder, MANIFEST)} missing: a zckpt push to {folder} began "
                                      f"({RECORD_NAME} is there) and never wrote it: the backup is not complete")
    return False


def _unfinished_push(path: str, report: VerifyReport, storage_options: dict | None = None) -> bool:
    """A folder that cannot be read as a checkpoint but has a push record and no manifest: not complete (said as a
    failed check rather than the reader's error about a missing rank file)."""
    try:
        if storage.exists(storage.join(path, MANIFEST), storage_options) or not storage.exists(
                storage.join(path, RECORD_NAME), storage_options):
            return False
    except (OSError, ZckptError):
        return False
    _push_state(path, report, storage_options)  # says so, as a failed check
    return True


def _verify_folder_of_checkpoints(path: str, report: VerifyReport, deep: bool, progress,
                                  storage_options: dict | None = None) -> bool:
    """A folder holding checkpoints (a training output folder, or where ``zckpt push`` sent one): each checkpoint
    in it is verified, its checks named after it. False when there are none."""
    try:
        listing = storage.listdir(path, storage_options)
        if any(n in ("latest", "latest_universal", "trainer_state.json") or is_rank_file(n) for n in listing):
            return False  # a checkpoint itself: the reader's error about it stands
        names = [n for n in listing if storage.isdir(storage.join(path, n), storage_options)]
    except (OSError, ZckptError):
        return False
    inside = [n for n in names if TRAINER_RE.match(n) or TAG_STEP_RE.match(n) or any(
        storage.exists(storage.join(path, n, m), storage_options) for m in (MANIFEST, RECORD_NAME))]
    if not inside:
        return False
    for name in sorted(inside, key=lambda n: (step_of(n) if step_of(n) is not None else -1, n)):
        try:
            sub = verify(storage.join(path, name), deep=deep, progress=progress, storage_options=storage_options)
        except ZckptError as exc:
            report.add(f"{name}", False, f"cannot be read: {exc.message}")
            continue
        report.bytes_read += sub.bytes_read
        for c in sub.checks:
            report.add(f"{name}: {c.name}", c.ok, c.detail)
    return True


def _manifest_bytes(folders: list[str], scope: list[CheckpointFile], storage_options: dict | None) -> list[str]:
    """Files the manifests list that are outside the folder verified (the Trainer files above a tag folder): read
    too with ``deep``, so that every file of the pushed checkpoint is compared with its sha256."""
    have = {_key(f.path) for f in scope}
    extra = []
    for folder in folders:
        for rel in _manifest_entries(folder, storage_options):
            p = storage.join(folder, rel)
            if _key(p) not in have:
                extra.append(p)
                have.add(_key(p))
    return extra


def _manifest_entries(folder: str, storage_options: dict | None) -> list[str]:
    try:
        doc = json.loads(storage.read_bytes(storage.join(folder, MANIFEST), storage_options))
        entries = doc["files"]
        return [str(rel) for rel in (entries if isinstance(entries, dict) else [e["path"] for e in entries])]
    except (OSError, ValueError, KeyError, TypeError, ZckptError):
        return []


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
        from zckpt.backup.scan import check_safetensors
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
    trainable = ckpt.of_kind("trainable")
    other = ckpt.other_state_keys
    moments = [r for r in trainable if not r.exp_avg or not r.exp_avg_sq]
    stateless = [r for r in trainable if not (r.exp_avg and r.exp_avg_sq) and set(r.other_state) != set(other)] \
        if other else moments
    report.add("optimizer state", not stateless or len(stateless) == len(trainable),
               (f"optimizer state {', '.join(other)} present (per element)" if other else "Adam moments present")
               if not stateless else f"no moments for {len(stateless)} params")
    steps = {g.step for g in ckpt.groups}
    report.add("steps agree", len(steps) <= 1, f"step {sorted(map(str, steps))}")
    if ckpt.no_group or ckpt.ambiguous_ties:  # reported, never failed: DeepSpeed loads these checkpoints
        detail = f"{len(ckpt.no_group)} parameters in no optimizer group, read from 'module'" if ckpt.no_group else ""
        for a, b in ckpt.ambiguous_ties:
            detail += (("; " if detail else "") + f"'{a}' holds the very bytes of '{b}', no tie recorded: merge, "
                       f"reshard and convert need --no-tie {a} or --tie {a}={b}")
        report.add("parameters outside the optimizer", True, detail)


def check_latest(ckpt: Checkpoint, report: VerifyReport, tag_given: bool = False) -> None:
    """Complete means resumable: a save folder or Trainer ``checkpoint-N`` verified without ``tag`` passes only if
    DeepSpeed's ``load_checkpoint(path)`` (``tag=None``, how the Trainer resumes) loads the tag checked
    (:func:`zckpt.backup.scan.latest_problem`: ``latest`` there, naming that tag). A tag chosen (``tag``, or a tag
    folder named as ``path``) is how the user will load it (``load_checkpoint(save_dir, tag=...)``): what ``latest``
    says is then a note, the check passes. (A ``latest`` naming a missing tag stops the reading before this.)"""
    loc = ckpt.location
    folder = loc.save_dir if loc.save_dir and _key(loc.save_dir) != _key(loc.tag_dir) else None
    if folder is None:  # a tag folder with no folder above it (a bucket's top): nothing to say
        return
    explicit = tag_given or _key(loc.input_path) == _key(loc.tag_dir)
    named, why = latest_problem(folder, ckpt.storage_options)
    if not explicit:
        if why is None and named != loc.tag:  # (latest_universal read by the reader, latest by DeepSpeed)
            why = f"'latest' names {named!r}, not the tag checked {loc.tag!r}"
        elif why is not None and named is None:
            why += f" (the tag here: {loc.tag})"
        report.add("latest", why is None, f"not resumable: {why}" if why else
                   f"names existing tag {loc.tag}: load_checkpoint resumes it")
        return
    how = f"resume it with load_checkpoint(..., tag='{loc.tag}')"
    if why is None and named == loc.tag:
        note = "'latest' names this tag"
    elif why is None:
        note = f"'latest' names {named!r}, not this tag: load_checkpoint without a tag resumes that one; {how}"
    else:
        note = f"{why}; {how} (a Trainer resume reads 'latest')"
    report.add("latest", True, f"tag {loc.tag} chosen; {note}")


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
    from zckpt.dcp.entries import items
    from zckpt.encoding.zipentries import Window
    by_file = items(ckpt)
    total = sum(length for its in by_file.values() for _, length, _ in its)
    damaged, done = [], 0
    for path, its in by_file.items():
        with storage.open_input(path, ckpt.storage_options) as f:
            for offset, length, key in its:
                window = Window(f, offset, length)
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
                        crc, left = hashing.crc32(block, crc), left - len(block)
                    if left or crc != e.crc:
                        damaged.append(f"{storage.basename(path)}@{offset} ({key}):{e.name}")
                done += length
                report.bytes_read += length
                if progress:
                    progress(done, total)
    report.add("CRC of every item", not damaged, "; ".join(damaged[:5]) or
               f"{sum(len(v) for v in by_file.values())} items in {len(by_file)} .distcp files, {format_size(done)}")


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
        crcs = StreamedCrcs(entries.values())  # each entry's CRC over the bytes as they are hashed
        f.seek(0)
        digest = hashing.sha256_stream(f, on_chunk=crcs, name=path)
    return crcs.pos, crcs.damaged(), digest


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


def _is_zip_file(path: str, storage_options: dict | None = None) -> bool:
    """A torch zip by name (``.pt``, ``.pth``: a damaged first byte is still damage) or by its first bytes."""
    name = storage.basename(path)
    if name.endswith((".pt", ".pth")):
        return True
    if name.endswith(".safetensors"):
        return False
    try:
        head = storage.read_range(path, 0, 4, storage_options)
    except OSError:
        return False  # (a legacy torch file, by its pickle's first bytes, only when named like one: .bin)
    return head == LOCAL_SIG or (name.endswith(".bin") and legacy.is_legacy(head))


def _read_whole(path: str, storage_options: dict | None = None) -> tuple[int, list[str], str]:
    """Every byte of one file: (bytes read, damaged zip entries, sha256). Torch zips get the CRC of every entry."""
    if _is_zip_file(path, storage_options):
        n, bad, digest = _scan_file(path, storage_options)
        if not digest:  # the zip directory itself is damaged: still hash every byte for the manifest
            digest = hashing.sha256_file(path, storage_options=storage_options)
        return max(n, storage.size(path, storage_options)), bad, digest
    with storage.open_input(path, storage_options) as f:
        digest = hashing.sha256_stream(f, name=path)
        return f.tell(), [], digest


def check_bytes(ckpt: Checkpoint, report: VerifyReport, progress=None, files: list[CheckpointFile] | None = None,
                extra: list[str] | None = None) -> dict[str, str]:
    """Read every byte of ``files`` (default: the rank files) and of ``extra`` paths: the CRC of every torch zip
    entry, every safetensors header against its size, and the sha256 of each file (returned by path, for the
    manifests)."""
    if ckpt.format == "dcp":  # .distcp items by their CRCs; .metadata was read whole when the checkpoint opened
        check_dcp_bytes(ckpt, report, progress)
        files = [f for f in (files or []) if not f.rel.endswith(".distcp") and f.rel != ".metadata"]
    elif files is None:
        files = ckpt_rank_files(ckpt)
    paths = [f.path for f in files] + list(extra or [])
    opts = ckpt.storage_options
    if not paths:
        return {}
    total = sum(f.size for f in files) + sum(_size_or_zero(p, opts) for p in extra or [])
    done, damaged, zips, hashes = 0, [], 0, {}
    with ThreadPoolExecutor(4) as pool:
        for path, result in zip(paths, pool.map(lambda p: _try_read(p, opts), paths)):
            if isinstance(result, str):
                damaged.append(f"{storage.basename(path)}: {result}")
                continue
            n, bad, digest = result
            done += n
            report.bytes_read += n
            hashes[_key(path)] = digest
            zips += _is_zip_file(path, opts)
            if progress:
                progress(done, total)
            damaged += [f"{storage.basename(path)}:{b}" for b in bad]
            log.debug("  %s: %s, %s", path, format_size(n), f"{len(bad)} damaged entries" if bad else
                      "CRCs match" if _is_zip_file(path, opts) else "read")
    n_legacy = sum(1 for f in files if _is_legacy_file(f.path, opts))
    note = f"; {n_legacy} legacy files: no CRCs; layout, size fields and every byte read" if n_legacy else ""
    besides = " besides the .distcp items" if ckpt.format == "dcp" else ""  # (those: "CRC of every item")
    report.add("CRC of the other files" if besides else "CRC of every entry", not damaged, "; ".join(damaged[:5]) or
               f"{len(paths)} file{'s' if len(paths) != 1 else ''}{besides} read ({zips} torch "
               f"file{'s' if zips != 1 else ''}, every entry's CRC matches{note}), {format_size(done)}")
    _check_safetensors(files, report, opts)
    return hashes


def _size_or_zero(path: str, storage_options: dict | None) -> int:
    try:
        return storage.size(path, storage_options)
    except (OSError, ZckptError):
        return 0


def _try_read(path: str, storage_options: dict | None):
    try:
        return _read_whole(path, storage_options)
    except (OSError, ZckptError) as exc:
        return f"cannot be read ({getattr(exc, 'message', None) or exc})"


def check_structure(files: list[CheckpointFile], report: VerifyReport, storage_options: dict | None = None) -> None:
    """Without reading tensor bytes: every torch zip's directory intact (entries inside the file, agreeing with
    their local headers), every safetensors header matching its file's size."""
    bad = []
    zips = [f for f in files if _is_zip_file(f.path, storage_options)]
    for f in zips:
        try:
            with storage.open_input(f.path, storage_options) as fh:
                if legacy.is_legacy(fh.read(4)):  # no zip directory: its pickles and storage sizes instead
                    legacy_layout(f.path, fh, f.size)
                else:
                    read_entries(fh, None, f.path)
        except ZckptError as exc:
            bad.append(f"{f.rel}: {exc.message}")
        except OSError as exc:
            bad.append(f"{f.rel}: cannot be read ({exc})")
    report.add("files", not bad, "; ".join(bad[:5]) or f"{len(files)} files of the checkpoint; {len(zips)} torch "
               "files with intact directories")
    _check_safetensors(files, report, storage_options)


def _check_safetensors(files: list[CheckpointFile], report: VerifyReport, storage_options: dict | None) -> None:
    st = [f for f in files if f.rel.endswith(".safetensors")]
    if not st:
        return
    bad = [f"{f.rel}: {why}" for f in st for why in [safetensors_problem(f.path, storage_options)] if why]
    report.add("safetensors headers", not bad, "; ".join(bad[:3]) or
               f"{len(st)} file(s), every header matches its file size (their data has no checksum: a manifest's "
               "sha256 checks it)")


def _is_legacy_file(path: str, storage_options: dict | None = None) -> bool:
    try:
        with storage.open_input(path, storage_options) as f:
            return legacy.is_legacy(f.read(4))
    except OSError:
        return False


def check_manifest(folder: str, report: VerifyReport, hashes: bool = True, progress=None,
                   known: dict[str, str] | None = None, storage_options: dict | None = None,
                   scope: list[CheckpointFile] | None = None) -> None:
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
            if known and known.get(_key(p)):
                if known[_key(p)] != meta["sha256"]:
                    bad.append(f"{rel}: sha256 differs")
                continue
            if hashing.sha256_file(p, on_chunk=count, storage_options=opts) != meta["sha256"]:
                bad.append(f"{rel}: sha256 differs")
        except (OSError, ZckptError, KeyError, TypeError, ValueError):
            bad.append(f"{rel}: missing or unreadable")
    what = "sizes and sha256" if hashes else "sizes; --deep compares sha256"
    where = storage.join(folder, MANIFEST)
    detail = "; ".join(bad[:5]) or f"{len(items)} files match {where} ({what})"
    if scope is not None and not bad:  # files under the manifest's folder it does not list: not checked by it
        listed = {_key(storage.join(folder, rel)) for rel, _ in items}
        base = _key(folder).rstrip("/") + ("/" if storage.is_url(folder) else os.sep)
        others = [f.rel for f in scope if _key(f.path).startswith(base) and _key(f.path) not in listed]
        if others:
            detail += f"; {len(others)} file(s) here it does not list (not pushed by zckpt), e.g. {others[0]}"
    report.add("manifest", not bad, detail)
