"""``zckpt diff A B``: do two checkpoints hold the same training state, whatever their formats and layouts?

1. Both sides are opened (metadata only; a folder no training-checkpoint reader claims, as a Hugging Face folder of
   weights: :mod:`zckpt.hf.reader`) and named one way: Hugging Face names where the model is Llama-shaped.
   DeepSpeed, DCP and Hugging Face folders use the module's own names; a Megatron-Core checkpoint whose files say
   it is Llama-shaped goes through merge's map (:func:`zckpt.megatron.hf_names.state_view`: q/k/v split per query
   group, fc1 into gate and up, masters and moments split as the weights), else keeps Megatron's names (a note
   says why); a Megatron ``dp_reshardable`` save's masters and moments are placed from its buckets and checked
   against its weights (:func:`zckpt.megatron.buckets.attach`), except against a folder of weights only (then its
   saved weights, what merge writes). A tied alias is compared once, through the tensor it names. Names on one
   side only are listed, never guessed.
2. What is compared, each part selectable (``only``): ``weights`` (every tensor's value: the fp32 masters where both
   sides hold them, else the weights as stored), ``masters`` (only the values both sides hold as masters),
   ``optimizer`` (every per-element optimizer state: Adam's moments, SGD's momentum...), ``groups`` (each param
   group's members, lr, betas, eps, weight decay and step; torchtitan's flattened groups per parameter),
   ``counters`` (global steps and samples, the scheduler's state). ``include`` / ``exclude``: name globs (fnmatch)
   on the common names; a selection that leaves nothing to compare is refused, never a pass. fp32 values against
   bf16 / fp16 weights without masters (a ``merge --dtype bf16``) are cast as torch rounds, then compared.
3. Tensors are streamed in aligned element ranges of at most 16 MiB (:mod:`zckpt.engine.compare`), several at
   once on a thread pool, every byte read reported to each side's CRC check (:func:`zckpt.state.checksums
   .input_check`): a damaged byte is a :class:`~zckpt.errors.CorruptFile` naming the file, never a difference.
   Under a launcher (``group``) each rank compares a share of the ranges by bytes; rank 0 checks the CRCs from
   every rank's spans, and every rank returns the same result.
4. The result (:class:`DiffResult`): per tensor equal bits, or how many elements differ, max |a-b|, max relative
   difference, max ULP distance and the first difference's index; dtype and shape mismatches; what was not
   compared and why. ``ok`` when everything compared is equal within the tolerance and no name is on one side only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from zckpt.encoding.tensors import Reader
from zckpt.engine import compare
from zckpt.engine.compare import (  # noqa: F401 - the result's names, for callers
    DiffResult, Stats, TensorDiff, Tolerance, ValueDiff,
)
from zckpt.engine.checked import InputCheck
from zckpt.errors import CheckpointNotFound, InvalidArgument, ZckptError
from zckpt.ops.diff_values import (
    CLIENT_COUNTERS, client_state, compare_counters, equal_values, flat, plain, side_counters,
)
from zckpt.state.model import Checkpoint, TensorRecord
from zckpt.state.open import open_checkpoint
from zckpt.state import checksums

log = logging.getLogger(__name__)

PARTS = ("weights", "masters", "optimizer", "groups", "counters")


#: the hyperparameters compared per param group
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass
class Side:
    """One side of the diff: its records under the common names, its param groups (hyperparameters, step and
    members: None where the files do not list them) and counters (global steps and samples, the scheduler)."""

    path: str
    ckpt: Checkpoint
    records: dict[str, TensorRecord]  # common name -> record (tied aliases included, kind "tied")
    groups: list[dict] | None  # None: the checkpoint holds no param groups
    counters: dict  # name -> plain value
    notes: list[str] = field(default_factory=list)
    # DeepSpeed's client state (what load_checkpoint returns; a DCP checkpoint's ``client_state``, as convert
    # carries it) flattened: "client_state.<key>" -> plain value; None where the format has no such place
    client: dict | None = None
    client_skipped: list[str] = field(default_factory=list)  # keys whose values are not plain data

    @property
    def tag(self) -> str | None:
        tag = self.ckpt.location.tag
        return None if self.ckpt.format in ("dcp", "hf") else tag

    @property
    def has_state(self) -> bool:
        """Whether it holds optimizer state (masters and per-element state) at all."""
        return any(r.kind == "trainable" and (r.exp_avg or r.other_state) for r in self.records.values())

    def target(self, name: str) -> TensorRecord | None:
        """The record holding ``name``'s bytes (a tied alias: the tensor it names)."""
        rec = self.records.get(name)
        seen = 0
        while rec is not None and rec.kind == "tied" and seen < 8:
            rec, seen = self.records.get(rec.tied_to), seen + 1
        return rec


def open_any(path: str, tag: str | None, storage_options: dict | None) -> Checkpoint:
    """The opener's answer; a folder none of its readers claims, when it holds Hugging Face weights: those."""
    try:
        return open_checkpoint(path, tag, storage_options)
    except CheckpointNotFound:
        from zckpt.hf import reader as hf
        if tag is None and hf.claims(path, storage_options):
            return hf.read(path, None, storage_options)
        raise


def _opened(path: str, tag: str | None, storage_options: dict | None, which: str) -> Checkpoint:
    """:func:`open_any`; a reader's words about its ``tag`` said of this side's (``tag_a`` / ``tag_b``)."""
    try:
        return open_any(path, tag, storage_options)
    except ZckptError as exc:
        exc.param = which if exc.param == "tag" else exc.param
        exc.message, exc.hint = (x.replace("`tag`", f"`{which}`") if x else x for x in (exc.message, exc.hint))
        raise


def read_side(path: str, ckpt: Checkpoint, state_wanted: bool) -> Side:
    """``ckpt`` (opened from ``path``) as one side of a diff (see the module docstring); ``state_wanted``: masters
    or optimizer state are compared (a Megatron ``dp_reshardable`` save's buckets are then placed)."""
    ckpt.check_ties()
    notes: list[str] = []
    groups = counters = None
    if ckpt.format == "megatron":
        ckpt, groups, counters = _megatron(ckpt, state_wanted, notes)
    records = {r.name: r for r in ckpt.records}
    if groups is None:
        groups = [_group(g.index, g.hyperparams, g.step, list(g.names)) for g in ckpt.groups] or None
    if groups is None and ckpt.extra.get("flat_groups"):  # torchtitan: each parameter's group values, no list
        from zckpt.state.model import scalar_value
        steps = ckpt.extra.get("step_tensors") or {}
        groups = [_group(-1, hyper, scalar_value(steps[name], ckpt.storage_options) if name in steps else None,
                         [name]) for name, hyper in ckpt.extra["flat_groups"].items()]
    if counters is None:
        counters = side_counters(ckpt)
    client, skipped = client_state(ckpt)
    return Side(str(path), ckpt, records, groups, counters, notes, client, skipped)


def _group(index: int, hyper: dict, step, names: list[str] | None) -> dict:
    out = {"index": index, "step": plain(step), "members": names}
    for k in GROUP_KEYS:
        out[k] = plain(hyper.get(k))
    return out


def _megatron(ckpt: Checkpoint, state_wanted: bool, notes: list[str]):
    """A Megatron-Core checkpoint under Llama's names where its files say it is Llama-shaped; its groups (members
    unknown) and counters."""
    from zckpt.megatron import buckets, hf_names
    f = ckpt.extra["megatron"]
    if state_wanted and f.get("optimizer_layout") == "dp_reshardable":
        try:
            ckpt = buckets.attach(ckpt)
        except ZckptError as exc:
            notes.append(f"{ckpt.location.tag_dir}: masters and moments not placed ({exc.message}): its weights "
                         "are compared")
    mapped = hf_names.state_view(ckpt)
    if mapped is not None:
        ckpt = dataclasses.replace(ckpt, records=mapped[0])
    else:
        why = hf_names.why_not(f) or "the files do not say whether the output layer is tied"
        notes.append(f"{ckpt.location.tag_dir}: Megatron's own names ({why})")
    step = ckpt.extra.get("step")
    groups = [_group(i, g, g.get("step", step), None) for i, g in enumerate(ckpt.extra.get("param_groups") or [])]
    counters: dict = {}
    if isinstance(f.get("iteration"), int):
        counters["global_steps"] = f["iteration"]
    samples = (ckpt.extra.get("args") or {}).get("consumed_train_samples")
    if isinstance(samples, int) and not isinstance(samples, bool):
        counters["global_samples"] = samples
    common = ckpt.extra.get("common") or {}
    for k in CLIENT_COUNTERS:
        if k in common:
            flat(k, common[k], counters)
    return ckpt, groups or None, counters


def parse_parts(only) -> list[str]:
    """``only`` ("weights,optimizer" or a list) as a list of :data:`PARTS`; None: all of them."""
    if only is None:
        return list(PARTS)
    items = [p.strip() for p in (only.split(",") if isinstance(only, str) else only) if p.strip()]
    bad = [p for p in items if p not in PARTS]
    if bad or not items:
        raise InvalidArgument(f"{(bad[0] if bad else ','.join(items))!r}: not a part diff compares",
                              param="only", hint=f"use a comma-separated list of {', '.join(PARTS)}")
    return list(dict.fromkeys(items))


def _tolerance(atol, rtol, ulp) -> Tolerance:
    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InvalidArgument(f"{v!r}: not a finite number >= 0", param=name)
    if ulp is not None and not (isinstance(ulp, int) and ulp >= 0):
        raise InvalidArgument(f"{ulp!r}: not a whole number >= 0", param="ulp")
    return Tolerance(None if atol is None else float(atol), None if rtol is None else float(rtol), ulp)


def diff(a: str, b: str, only=None, include=None, exclude=None, atol: float | None = None,
         rtol: float | None = None, ulp: int | None = None, tag_a: str | None = None, tag_b: str | None = None,
         storage_options: dict | None = None, storage_options_b: dict | None = None, workers: int | None = None,
         progress=None, group=None) -> DiffResult:
    """Compare the checkpoints at ``a`` and ``b`` (any format zckpt reads, local or URL; see the module docstring).

    ``only``: parts to compare ("weights,optimizer" or a list of :data:`PARTS`; default all); ``include`` /
    ``exclude``: name globs (a list; a tensor is compared when it matches an ``include`` glob, or there are none,
    and no ``exclude`` glob); ``atol`` / ``rtol`` / ``ulp``: the tolerance (default: equal bits); ``tag_a`` /
    ``tag_b``: a tag or iteration of each side; ``storage_options``: fsspec options for URLs (``b`` too, unless
    ``storage_options_b``); ``workers``: threads comparing at once (default: the CPUs, at most 8);
    ``progress(done_bytes, total_bytes)``: called as bytes are compared (under a launcher: this rank's share).
    ``group``: the ranks of a launcher's job (:func:`zckpt.engine.launch.launched`): each compares a share of the
    ranges (by bytes), rank 0 checks every CRC from the spans all read, and every rank returns the same result."""
    t0 = time.perf_counter()
    parts = parse_parts(only)
    tol = _tolerance(atol, rtol, ulp)
    include, exclude = list(include or []), list(exclude or [])
    state_wanted = bool({"masters", "optimizer"} & set(parts))
    opts_b = storage_options if storage_options_b is None else storage_options_b
    ca, cb = _opened(a, tag_a, storage_options, "tag_a"), _opened(b, tag_b, opts_b, "tag_b")
    # against a folder of weights only, a Megatron dp_reshardable save's weights are compared as saved (what merge
    # writes), its masters not placed from the buckets
    sa = read_side(a, ca, state_wanted and cb.format != "hf")
    sb = read_side(b, cb, state_wanted and ca.format != "hf")
    result = DiffResult(str(a), str(b), sa.tag, sb.tag, sa.ckpt.format, sb.ckpt.format, parts, tol,
                        notes=sa.notes + sb.notes)
    for side, c, other in (("A", ca, cb), ("B", cb, ca)):
        if state_wanted and c.state_refusal and c.format in ("deepspeed", "dcp"):  # (a state not elementwise, a
            # fused-qkv state whose split the files do not say)
            result.not_compared.append(f"part of the optimizer state of {side}: {c.state_refusal}")
        if state_wanted and other.format == "hf" and c.format == "megatron" and \
                c.extra["megatron"].get("optimizer_layout") == "dp_reshardable":
            result.not_compared.append(f"masters and optimizer state of {side}: the other side holds weights only "
                                       f"({side}'s saved weights are compared)")

    def wanted(name: str) -> bool:
        return (not include or any(fnmatch.fnmatchcase(name, g) for g in include)) and \
            not any(fnmatch.fnmatchcase(name, g) for g in exclude)

    jobs = _pair_tensors(sa, sb, parts, wanted, result)
    if "groups" in parts:
        _compare_groups(sa, sb, result)
    if "counters" in parts:
        compare_counters(sa, sb, result)
    names = set(sa.records) | set(sb.records)
    if include and not any(wanted(n) for n in names):  # a typo in a glob is no verdict
        raise InvalidArgument(f"{' '.join(include)}: no tensor of either side matches", param="include",
                              hint="check the names with zckpt info; they are Hugging Face names where the model is "
                                   "Llama-shaped")
    if not (jobs or result.values or result.only_in_a or result.only_in_b):
        what = ["--include " + " ".join(include)] * bool(include) + ["--exclude " + " ".join(exclude)] * bool(exclude)
        what.append("--only " + ",".join(parts))
        raise InvalidArgument(f"nothing to compare: {', '.join(what)} leave no tensor or value that both sides hold",
                              hint="check the names with zckpt info, or widen --include / --only")
    _run(jobs, sa, sb, tol, result, workers, progress, group)
    result.seconds = time.perf_counter() - t0
    log.info("diff: %s in %.2fs (%d bytes compared, %d CRC-checked zip entries)", result.summary(), result.seconds,
             result.bytes_compared, result.crc_checked_entries)
    return result


def _pair_tensors(sa: Side, sb: Side, parts: list[str], wanted, result: DiffResult) -> list:
    """Match the names; the pairs of piece lists to compare, as [(TensorDiff, a pieces, b pieces)]."""
    jobs = []
    state_skipped = {"A": 0, "B": 0}
    names = list(dict.fromkeys(list(sa.records) + list(sb.records)))
    for name in names:
        if not wanted(name):
            continue
        ra, rb = sa.records.get(name), sb.records.get(name)
        if ra is None or rb is None:
            one, here = (rb, "B") if ra is None else (ra, "A")
            if one.kind == "tied":  # an alias on one side only: its tensor is compared under its own name
                result.notes.append(f"'{name}' is a tied alias of '{one.tied_to}' in {here} only: compared once, "
                                    f"as '{one.tied_to}'")
            elif "weights" in parts or ("masters" in parts and one.kind == "trainable") or \
                    ("optimizer" in parts and one.exp_avg):
                (result.only_in_b if ra is None else result.only_in_a).append(name)
            continue
        if ra.kind == "tied" and rb.kind == "tied":
            if "weights" in parts:
                same = ra.tied_to == rb.tied_to
                result.values.append(ValueDiff(f"{name} (tied to)", "weights", "equal" if same else "differ",
                                               ra.tied_to, rb.tied_to))
            continue
        ta, tb = sa.target(name), sb.target(name)
        if ta is None or tb is None:
            continue  # a tie to a name that is not there: check_records and the readers refuse it before
        masters = ta.kind == "trainable" and tb.kind == "trainable"
        part = "masters" if masters else "weights"
        if "weights" in parts or ("masters" in parts and masters):
            jobs.append(_job(name, "value", part, ta, tb, ta.value, tb.value, ta.dtype, tb.dtype,
                             (sa.ckpt.format == "hf", sb.ckpt.format == "hf")))
        if "optimizer" not in parts:
            continue
        sta, stb = _states(ta), _states(tb)
        for key in sta:
            if key in stb:
                jobs.append(_job(name, key, "optimizer", ta, tb, sta[key], stb[key], _dtype(sta[key], ta),
                                 _dtype(stb[key], tb)))
        for key, side in [(k, "A") for k in sta if k not in stb] + [(k, "B") for k in stb if k not in sta]:
            state_skipped[side] += 1
    for side, n in state_skipped.items():
        if n:
            other = "B" if side == "A" else "A"
            result.not_compared.append(f"{n} optimizer state tensor(s) of {side}: {other} holds none for them"
                                       + (f" ({other} holds no optimizer state)" if not
                                          (sb if other == "B" else sa).has_state else ""))
    for side, s, o in (("A", sa, sb), ("B", sb, sa)):
        if s.has_state and not o.has_state and "masters" in parts:
            result.not_compared.append(f"masters of {side}: the other side holds weights only (its weights are "
                                       f"compared with {side}'s values)")
    return jobs


def _states(rec) -> dict:
    out = {}
    if rec.kind == "trainable":
        if rec.exp_avg:
            out["exp_avg"] = rec.exp_avg
        if rec.exp_avg_sq:
            out["exp_avg_sq"] = rec.exp_avg_sq
        out.update(rec.other_state)
    return out


def _dtype(pieces, rec) -> str:
    return pieces[0].dtype if pieces else rec.dtype


def _job(name, state, part, ta, tb, pa, pb, da, db, weights_only=(False, False)):
    td = TensorDiff(name, state, part, "equal", da, db, list(ta.shape), list(tb.shape))
    if list(ta.shape) != list(tb.shape):
        td.status, td.reason = "differ", "shape"
        return td, None, None
    if da != db:
        td.reason = "dtype"
        # fp32 masters against weights stored in the training dtype (a bf16 merge, a weights-only folder): the
        # masters cast to that dtype as torch rounds (what merge --dtype and the training step's copy hold); a
        # Hugging Face folder's every floating tensor likewise (merge --dtype casts buffers and frozen weights too)
        for side, mine, theirs, other, hf in (("a", ta, tb, db, weights_only[1]), ("b", tb, ta, da, weights_only[0])):
            if state == "value" and ((mine.kind == "trainable" and theirs.kind != "trainable") or hf) \
                    and (da if side == "a" else db) == "float32" and other in ("bfloat16", "float16"):
                td.cast, td.reason = side, None
    return td, pa, pb


def _share(tasks: list, group) -> list[int]:
    """The ranges this rank compares: all of them, or under a launcher its share by bytes (the largest first, each
    to the rank with the fewest bytes so far: the same answer on every rank)."""
    if group is None:
        return list(range(len(tasks)))
    loads = [0] * group.world
    mine = []
    for k in sorted(range(len(tasks)), key=lambda k: (-tasks[k][5], k)):
        r = loads.index(min(loads))
        loads[r] += tasks[k][5]
        if r == group.rank:
            mine.append(k)
    return sorted(mine)


def _gathered(group, got: dict, checks: list[InputCheck]) -> tuple[dict, int]:
    """Every rank's results and CRC spans on rank 0, which checks each zip entry whole (a damaged byte: every rank
    raises the same one-line error); every rank then gets every range's result."""
    mine = json.dumps({"stats": [[k, dataclasses.asdict(st)] for k, st in got.items()],
                       "spans": [c.export() for c in checks]}).encode()
    parts = group.gather_bytes(mine)
    out, checked = {}, 0

    def check() -> None:
        nonlocal checked
        for data in parts or []:
            doc = json.loads(data)
            for c, spans in zip(checks, doc["spans"]):
                c.absorb(spans)
            out.update({k: Stats(**st) for k, st in doc["stats"]})
        for c in checks:
            c.finish()
        checked = sum(c.checked for c in checks)

    group.phase(check if group.rank == 0 else (lambda: None))
    doc = json.loads(group.broadcast_bytes(json.dumps({"stats": [[k, dataclasses.asdict(st)] for k, st in
                                                                 out.items()], "checked": checked}).encode()
                                           if group.rank == 0 else None))
    return {k: Stats(**st) for k, st in doc["stats"]}, doc["checked"]


def _run(jobs, sa: Side, sb: Side, tol: Tolerance, result: DiffResult, workers, progress, group=None) -> None:
    """Compare every pair, range by range, on a thread pool (under a launcher: this rank's share); each side's CRCs
    checked before anything is said."""
    checks: list[InputCheck] = [_check(sa), _check(sb)]
    readers = [Reader(sa.ckpt.storage_options), Reader(sb.ckpt.storage_options)]
    for r, c in zip(readers, checks):
        r.check = c
    tasks = []
    for i, (td, pa, pb) in enumerate(jobs):
        result.tensors.append(td)
        if pa is None:
            continue
        td.stats = Stats(max_ulp=0 if td.dtype_a == td.dtype_b or td.cast else None)
        width = max(compare.DTYPE_SIZES[td.dtype_a], compare.DTYPE_SIZES[td.dtype_b])
        numel = sum(p.numel for p in pa)
        tasks += [(i, pa, pb, s, n, n * (compare.DTYPE_SIZES[td.dtype_a] + compare.DTYPE_SIZES[td.dtype_b]))
                  for s, n in compare.ranges(numel, width)]
    mine = _share(tasks, group)
    total = sum(tasks[k][5] for k in mine)
    done = 0
    n_workers = workers or min(8, os.cpu_count() or 1)
    got: dict[int, Stats] = {}

    def one(task):
        i, pa, pb, start, n, _ = task
        td = result.tensors[i]
        cast_to = (td.dtype_b if td.cast == "a" else None, td.dtype_a if td.cast == "b" else None)
        return compare.compare_range(readers, pa, td.dtype_a, pb, td.dtype_b, start, n, tol, cast_to)

    def compare_mine() -> None:
        nonlocal done
        with ThreadPoolExecutor(max(1, n_workers)) as pool:
            window = max(2, 2 * n_workers)  # ranges in flight: memory stays a few chunks per thread
            for lo in range(0, len(mine), window):
                batch = mine[lo:lo + window]
                for k, st in zip(batch, pool.map(lambda k: one(tasks[k]), batch)):
                    got[k] = st
                    done += tasks[k][5]
                    if progress:
                        progress(done, total)

    try:
        if group is None:
            compare_mine()
            for c in checks:  # a damaged byte: CorruptFile naming the file, before any verdict
                c.finish()
            checked = sum(c.checked for c in checks)
        else:
            group.phase(compare_mine)
            got, checked = _gathered(group, got, checks)
    finally:
        for r in readers:
            r.close()
        for c in checks:
            c.close()
    for k in sorted(got):
        result.tensors[tasks[k][0]].stats.merge(got[k])
    result.bytes_compared = sum(t[5] for t in tasks)
    result.crc_checked_entries = checked
    for td in result.tensors:
        st = td.stats
        if st is None:
            continue
        if st.outside:
            td.status, td.reason = "differ", "values"
        elif st.differing:
            td.status, td.reason = "close", td.reason or "values"


def _check(side: Side) -> InputCheck:
    if side.ckpt.format == "hf":  # not in the opener's formats: a .bin file's own zip directory guards it
        return InputCheck(None, checksums.describer(side.ckpt), side.ckpt.storage_options)
    return checksums.input_check(side.ckpt)


def _per_parameter(side: Side) -> dict | None:
    """{parameter: its group's values}, where the members are known."""
    if side.groups is None or any(g["members"] is None for g in side.groups):
        return None
    return {n: g for g in side.groups for n in g["members"]}


def _compare_groups(sa: Side, sb: Side, result: DiffResult) -> None:
    if sa.groups is None or sb.groups is None:
        for side, s in (("A", sa), ("B", sb)):
            if s.groups is not None:
                result.not_compared.append(f"param groups of {side}: the other side holds none")
        return
    flat = [s for s in (sa, sb) if s.groups and s.groups[0]["index"] == -1]
    pa, pb = _per_parameter(sa), _per_parameter(sb)
    if flat and pa is not None and pb is not None:  # torchtitan's per-parameter values: compared per parameter
        for key in ("step",) + GROUP_KEYS:
            bad = [(n, pa[n][key], pb[n][key]) for n in pa if n in pb and not equal_values(pa[n][key], pb[n][key])]
            result.values += [ValueDiff(f"{n} {key}", "groups", "differ", x, y) for n, x, y in bad] or \
                [ValueDiff(f"{key} of every parameter", "groups", "equal", len(pa), len(pb))]
        if set(pa) != set(pb):
            result.values.append(ValueDiff("parameters with optimizer state", "groups", "differ",
                                           sorted(set(pa) - set(pb))[:8], sorted(set(pb) - set(pa))[:8]))
        return
    if flat:
        result.not_compared.append("param groups: one side records each parameter's values, the other does not "
                                   "list its groups' members")
        return
    order = list(range(len(sb.groups)))  # B's group for A's i: by index, or where both list members, by the most
    if pa is not None and pb is not None:  # shared (a conversion may order the groups otherwise)
        for i, g in enumerate(sa.groups[:len(order)]):
            j = max(order[i:], key=lambda j: (len(set(g["members"]) & set(sb.groups[j]["members"])), -j))
            order[order.index(j)], order[i] = order[i], j
    for i in range(max(len(sa.groups), len(sb.groups))):
        ga = sa.groups[i] if i < len(sa.groups) else None
        gb = sb.groups[order[i]] if i < len(order) else None
        if ga is None or gb is None:
            result.values.append(ValueDiff(f"group {i}", "groups", "differ", "present" if ga else None,
                                           "present" if gb else None))
            continue
        i = i if order[i] == i else f"{i} (B's {order[i]})"
        for key in ("step",) + GROUP_KEYS:
            same = equal_values(ga[key], gb[key])
            result.values.append(ValueDiff(f"group {i} {key}", "groups", "equal" if same else "differ",
                                           ga[key], gb[key]))
        if ga["members"] is None or gb["members"] is None:
            side = "A" if ga["members"] is None else "B"
            result.not_compared.append(f"group {i} members: {side}'s files do not list them (Megatron's param "
                                       "groups do not say which parameter is in which)")
            continue
        ma, mb = set(ga["members"]), set(gb["members"])
        if ma == mb:
            result.values.append(ValueDiff(f"group {i} members", "groups", "equal", len(ma), len(mb)))
        else:
            result.values.append(ValueDiff(f"group {i} members", "groups", "differ",
                                           sorted(ma - mb)[:8] or len(ma), sorted(mb - ma)[:8] or len(mb)))
