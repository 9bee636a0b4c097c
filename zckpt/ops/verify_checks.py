"""The checks ``zckpt verify`` runs on one checkpoint: its metadata (every tensor placed, groups and steps agree),
``latest``, a DCP folder's metadata and items, and every file's bytes (each zip entry's CRC-32, a legacy file read
whole, safetensors headers against their files); each adds its line to a
:class:`zckpt.ops.verify_report.VerifyReport`."""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from zckpt.io import hashing, storage
from zckpt.state.model import Checkpoint
from zckpt.errors import CorruptFile, ZckptError
from zckpt.encoding import legacy
from zckpt.encoding.safeload import LazyTensor, legacy_layout
from zckpt.encoding.zipentries import LOCAL_SIG, StreamedCrcs, read_entries
from zckpt.backup.files import CheckpointFile
from zckpt.backup.scan import latest_problem, safetensors_problem
from zckpt.ops.verify_report import VerifyReport
from zckpt.units import counted, format_size

log = logging.getLogger(__name__)


def path_key(path: str) -> str:
    """A path as the checks compare it: a URL as it is, a local path absolute."""
    return path if storage.is_url(path) else os.path.abspath(storage.local_path(path))


def ckpt_rank_files(ckpt: Checkpoint) -> list[CheckpointFile]:
    return [CheckpointFile(f.name, f.path, max(f.size, 0)) for f in ckpt.files]


def _entries(ckpt: Checkpoint) -> str:
    """``21 state-dict entries (1 tied alias, which merge stores once)``: why merge reports one tensor fewer."""
    tied = len(ckpt.of_kind("tied"))
    return f"{len(ckpt.records)} state-dict entries" + (
        f" ({tied} tied alias{'es' if tied > 1 else ''}, which merge stores once)" if tied else "")


def check_metadata(ckpt: Checkpoint, report: VerifyReport) -> None:
    loc = ckpt.location
    if ckpt.format == "dcp":
        return check_dcp_metadata(ckpt, report)
    if ckpt.format == "megatron":
        return check_megatron_metadata(ckpt, report)
    if loc.universal:
        report.add("rank files", True, f"universal: {counted(len(loc.optim_files), 'file')} under zero/ + "
                                       f"{counted(len(loc.model_files), 'model-states file')}")
    else:
        report.add("rank files", True, f"{len(loc.optim_files)} optimizer + "
                                       f"{counted(len(loc.model_files), 'model-states file')} for world size "
                                       f"{ckpt.world_size}")
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
    folder = loc.save_dir if loc.save_dir and path_key(loc.save_dir) != path_key(loc.tag_dir) else None
    if folder is None:  # a tag folder with no folder above it (a bucket's top): nothing to say
        return
    explicit = tag_given or path_key(loc.input_path) == path_key(loc.tag_dir)
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
    report.add("metadata", True, f"DCP {md.version}: {counted(len(md.tensors), 'tensor')}, "
                                 f"{counted(len(md.values), 'value')}; chunks cover every tensor exactly once")
    report.add("data files", True, f"{counted(len(data), '.distcp file')}, every item inside its file")
    bad = [f"{r.name}: {sum(p.numel for p in r.value)} elements for shape {list(r.shape)}" for r in ckpt.records
           if r.kind != "tied" and sum(p.numel for p in r.value) != math.prod(r.shape)]
    report.add("shapes agree", not bad, "; ".join(bad[:5]) or _entries(ckpt))
    groups = {n for g in ckpt.groups for n in g.names}
    moments = [r for r in ckpt.of_kind("trainable") if r.name in groups and (not r.exp_avg or not r.exp_avg_sq)]
    held = sum(1 for r in ckpt.records if r.exp_avg) + len(ckpt.extra.get("fused_qkv") or {})
    report.add("optimizer state", not moments or len(moments) == len(groups),
               f"no moments for {len(moments)} params" if moments else
               f"Adam moments of {counted(held, 'parameter')}" if held else "none saved (weights only)")
    if ckpt.groups:
        steps, whose = {g.step for g in ckpt.groups}, "param groups'"
    else:  # flattened optimizer state (torchtitan's): each parameter's own step
        steps, whose = set((ckpt.extra.get("step_values") or {}).values()), "each parameter's (no param groups saved)"
    report.add("steps agree", len(steps) <= 1, f"{whose} step {sorted(map(str, steps))}" if steps else
               "no optimizer step saved")


def check_megatron_metadata(ckpt: Checkpoint, report: VerifyReport) -> None:
    """A Megatron torch_dist iteration: its DCP metadata (as :func:`check_dcp_metadata`), the optimizer layout
    read, and whether ``latest_checkpointed_iteration.txt`` names it."""
    md, f = ckpt.extra["metadata"], ckpt.extra["megatron"]
    data = [x for x in ckpt.files if x.kind == "data"]
    report.add("metadata", True, f"torch_dist (DCP {md.version}): {counted(len(md.tensors), 'tensor')}, "
                                 f"{counted(len(md.values), 'value')}; chunks cover every tensor exactly once")
    report.add("data files", True, f"{counted(len(data), '.distcp file')}, every item inside its file")
    bad = [f"{r.name}: {sum(p.numel for p in r.value)} elements for shape {list(r.shape)}" for r in ckpt.records
           if r.kind != "tied" and sum(p.numel for p in r.value) != math.prod(r.shape)]
    report.add("shapes agree", not bad, "; ".join(bad[:5]) or _entries(ckpt))
    trainable = ckpt.of_kind("trainable")
    if f["optimizer_layout"] == "fully_reshardable":
        missing = [r.name for r in trainable if not r.exp_avg or not r.exp_avg_sq]
        report.add("optimizer state", not missing, f"no moments for {missing[:3]}" if missing else
                   f"fully_reshardable: fp32 master and Adam moments for all {len(trainable)} parameters")
    else:
        report.add("optimizer state", True, f"{f['optimizer_layout']}: not read ({ckpt.state_refusal})")
    steps = {g.get("step") for g in ckpt.extra.get("param_groups") or []}
    report.add("steps agree", len(steps) <= 1, f"step {sorted(map(str, steps))}" if steps else "no param groups saved")
    report.add("megatron", True, f"torch_dist, iteration {f['iteration']}, tp {f['tp']} x pp {f['pp']} x dp "
                                 f"{f['dp']}, optimizer {f['optimizer_layout']}")
    loc = ckpt.location
    if loc.has_latest:
        report.add("latest", True, f"latest_checkpointed_iteration.txt names {loc.tag}"
                   if path_key(loc.input_path) == path_key(loc.save_dir) else f"tag {loc.tag} chosen")


DISTCP_FORMATS = ("dcp", "megatron")  # formats whose data files are DCP .distcp files of torch-zip items


def dcp_items(ckpt: Checkpoint) -> dict:
    """path -> [(offset, length, key)]: the items of a DCP (or torch_dist) checkpoint's ``.distcp`` files."""
    from zckpt.encoding.distcp import items_by_file
    items = items_by_file(ckpt.extra["metadata"], ckpt.location.tag_dir)
    names = ckpt.extra.get("item_names")  # a reader's own words for some items (Megatron MoE: layer and expert)
    if names:
        items = {path: [(o, n, names.get((storage.basename(path), o), key)) for o, n, key in its]
                 for path, its in items.items()}
    return items


def check_dcp_bytes(ckpt: Checkpoint, report: VerifyReport, progress=None, tick=None) -> None:
    """Every item of every ``.distcp`` file read: each is a torch zip whose entries' CRC-32 must match. ``tick``:
    the :class:`Ticker` the bytes read are reported to (default: one of ``progress``, over the items' bytes)."""
    from zckpt.encoding.zipentries import Window
    from zckpt.encoding.distcp import layouts_by_file
    by_file = dcp_items(ckpt)
    laid = layouts_by_file(ckpt.extra["metadata"], ckpt.location.tag_dir)  # chunks placed by a zip layout at open
    tick = tick or Ticker(sum(length for its in by_file.values() for _, length, _ in its), progress)
    damaged, first = [], tick.done
    for path, its in by_file.items():
        with storage.open_input(path, ckpt.storage_options) as f:
            for offset, length, key in its:
                window = Window(f, offset, length)
                start = tick.done
                try:
                    entries = read_entries(window, length, path)
                except CorruptFile as exc:
                    damaged.append(f"{storage.basename(path)}@{offset} ({key}): {exc.message}")
                    entries = {}
                lay = laid.get(path, {}).get(offset) if entries else None
                why = lay[0].mismatch(entries) if lay is not None else None
                if why is not None:
                    damaged.append(f"{storage.basename(path)}@{offset} ({key}): {why}, unlike the layout it was read "
                                   f"by ({lay[0].sample})")
                for e in entries.values():
                    window.seek(e.data_offset)
                    crc, left = 0, e.size
                    while left:
                        block = window.read(min(left, READ_CHUNK))
                        if not block:
                            break
                        crc, left = hashing.crc32(block, crc), left - len(block)
                        tick(len(block))  # the bar advances by bytes, not by whole items
                    if left or crc != e.crc:
                        damaged.append(f"{storage.basename(path)}@{offset} ({key}):{e.name}")
                tick(length - (tick.done - start))  # the item's headers: each item counts its length once
                report.bytes_read += length
    done = tick.done - first
    report.add("CRC of every item", not damaged, "; ".join(damaged[:5]) or
               f"{counted(sum(len(v) for v in by_file.values()), 'item')} in {counted(len(by_file), '.distcp file')}, "
               f"{format_size(done)}")


READ_CHUNK = 4 << 20  # bytes read at a time by verify --deep (and reported to its progress bar)


class Ticker:
    """``tick(n)``: ``n`` more bytes read, reported to ``progress(done, total)`` as they are read (thread-safe: the
    files are read by several threads), so that ``verify --deep``'s bar advances by bytes as merge's does."""

    def __init__(self, total: int, progress=None):
        self.total, self.progress, self.done = total, progress, 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self.done += n
            if self.progress:
                self.progress(self.done, self.total)


def _scan_file(path: str, storage_options: dict | None = None, tick=None) -> tuple[int, list[str], str]:
    """One sequential pass over a rank file: the CRC of every zip entry and the sha256 of the whole file.

    Returns (bytes read, damaged entry names, sha256 hex); the hash lets a manifest be checked without a second
    read of the same bytes."""
    with storage.open_input(path, storage_options) as f:
        if legacy.is_legacy(f.read(4)):
            return _scan_legacy(f, path, tick)
        try:
            entries = read_entries(f, None, path)
        except CorruptFile as exc:  # any damage to the directory is a failed check
            return 0, [exc.message], ""
        crcs = StreamedCrcs(entries.values())  # each entry's CRC over the bytes as they are hashed
        f.seek(0)
        digest = hashing.sha256_stream(f, on_chunk=_ticking(crcs, tick), name=path, chunk=READ_CHUNK)
    return crcs.pos, crcs.damaged(), digest


def _ticking(on_chunk, tick):
    """``on_chunk`` that also reports each chunk's length to ``tick``."""
    if tick is None:
        return on_chunk

    def both(chunk) -> None:
        if on_chunk is not None:
            on_chunk(chunk)
        tick(len(chunk))
    return both


def _scan_legacy(f, path: str, tick=None) -> tuple[int, list[str], str]:
    """A legacy (non-zip) file has no CRCs: its layout is checked (pickles, storage keys, sizes that end the file,
    each storage's size field), then every byte is read and hashed, the size fields compared again in the stream."""
    size = f.seek(0, 2)
    try:
        _obj, places, _n = legacy_layout(path, f, size)
    except ZckptError as exc:
        return 0, [exc.message], ""
    check = legacy.FieldCheck(legacy.size_fields(places))
    f.seek(0)
    digest = hashing.sha256_stream(f, on_chunk=_ticking(check, tick), name=path, chunk=READ_CHUNK)
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


def _read_whole(path: str, storage_options: dict | None = None, tick=None) -> tuple[int, list[str], str]:
    """Every byte of one file: (bytes read, damaged zip entries, sha256). Torch zips get the CRC of every entry.
    ``tick(n)``: called as the bytes are read."""
    if _is_zip_file(path, storage_options):
        n, bad, digest = _scan_file(path, storage_options, tick)
        if not digest:  # the zip directory itself is damaged: still hash every byte for the manifest
            digest = hashing.sha256_file(path, storage_options=storage_options, on_chunk=_ticking(None, tick),
                                         chunk=READ_CHUNK)
        return max(n, storage.size(path, storage_options)), bad, digest
    with storage.open_input(path, storage_options) as f:
        digest = hashing.sha256_stream(f, name=path, on_chunk=_ticking(None, tick), chunk=READ_CHUNK)
        return f.tell(), [], digest


def check_bytes(ckpt: Checkpoint, report: VerifyReport, progress=None, files: list[CheckpointFile] | None = None,
                extra: list[str] | None = None) -> dict[str, str]:
    """Read every byte of ``files`` (default: the rank files) and of ``extra`` paths: the CRC of every torch zip
    entry, every safetensors header against its size, and the sha256 of each file (returned by path, for the
    manifests)."""
    opts = ckpt.storage_options
    items = 0
    if ckpt.format in DISTCP_FORMATS:  # .distcp items by their CRCs; .metadata was read whole at open
        items = sum(length for its in dcp_items(ckpt).values() for _, length, _ in its)
        files = [f for f in (files or []) if not f.rel.endswith(".distcp") and f.rel.rsplit("/", 1)[-1] != ".metadata"]
    elif files is None:
        files = ckpt_rank_files(ckpt)
    paths = [f.path for f in files] + list(extra or [])
    total = items + sum(f.size for f in files) + sum(_size_or_zero(p, opts) for p in extra or [])
    # one bar over every byte read, by bytes as the threads read them; each file's count settled when it ends
    tick = Ticker(total, progress)
    if ckpt.format in DISTCP_FORMATS:
        check_dcp_bytes(ckpt, report, progress, tick)
    if not paths:
        return {}
    done, damaged, zips, hashes = 0, [], 0, {}

    def read(p):
        mine = Ticker(0)
        result = _try_read(p, opts, lambda n: (mine(n), tick(n)))
        if not isinstance(result, str):
            tick(result[0] - mine.done)  # bytes counted without being streamed (a damaged zip directory)
        return result

    with ThreadPoolExecutor(4) as pool:
        for path, result in zip(paths, pool.map(read, paths)):
            if isinstance(result, str):
                damaged.append(f"{storage.basename(path)}: {result}")
                continue
            n, bad, digest = result
            done += n
            report.bytes_read += n
            hashes[path_key(path)] = digest
            zips += _is_zip_file(path, opts)
            damaged += [f"{storage.basename(path)}:{b}" for b in bad]
            log.debug("  %s: %s, %s", path, format_size(n), f"{len(bad)} damaged entries" if bad else
                      "CRCs match" if _is_zip_file(path, opts) else "read")
    n_legacy = sum(1 for f in files if _is_legacy_file(f.path, opts))
    note = f"; {n_legacy} legacy files: no CRCs; layout, size fields and every byte read" if n_legacy else ""
    besides = " besides the .distcp items" if ckpt.format in DISTCP_FORMATS else ""  # (those: "CRC of every item")
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


def _try_read(path: str, storage_options: dict | None, tick=None):
    try:
        return _read_whole(path, storage_options, tick)
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
    report.add("files", not bad, "; ".join(bad[:5]) or f"{counted(len(files), 'file')} of the checkpoint; "
               f"{counted(len(zips), 'torch file')} with intact directories")
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
