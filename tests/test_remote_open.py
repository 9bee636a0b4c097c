"""Opening a checkpoint over S3: few requests, in parallel rounds, nothing fetched twice, the same refusals.

The requests are counted on the wire, by :class:`tests.faultproxy.FaultProxy` in front of the real S3 server of
:mod:`tests.s3server`: a regression to one small GET per zip header (the old read-ahead file: 34 GETs for a
3-file checkpoint, one after another) fails here.

Per rank file, :func:`zckpt.io.storage.open_ranges` makes at most three GETs: a small file whole (one GET); a
large one its tail (zip directory) and head (pickle) side by side, then one parallel round for the local headers
the directory points to. The fixtures are small, so the large-file path is forced by shrinking its thresholds.
"""

from __future__ import annotations

import collections
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_DIRS, checkpoint_path
from tests.faultproxy import FaultProxy
from tests.test_damaged import ZIP_CASES, damage, make_copy
from zckpt.state.open import open_checkpoint
from zckpt.io import fetched, ranges, s3, storage

pytest_plugins = ["tests.s3server"]

FIXTURE = next((d for d in FIXTURE_DIRS if d.name == "z2_bf16_ws4"), None)


@pytest.fixture
def proxy(s3_server):
    p = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    yield p
    p.stop()


@pytest.fixture(params=["whole", "tail-head"])
def thresholds(request, monkeypatch):
    """``whole``: the defaults (fixture files are fetched whole); ``tail-head``: the large-file path, forced."""
    if request.param == "tail-head":
        monkeypatch.setattr(ranges, "WHOLE_BYTES", 0)
        monkeypatch.setattr(ranges, "TAIL_BYTES", 2048)
        monkeypatch.setattr(ranges, "HEAD_BYTES", 1024)
    return request.param


def upload(folder: Path, url: str, opts: dict) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and "expected" not in p.parts:
            storage.put_file(str(p), storage.join(url, p.relative_to(folder).as_posix()), storage_options=opts)


def via(proxy: FaultProxy, s3_server) -> dict:
    s3._boto_clients.clear()  # a client of its own for the proxy's endpoint (keyed by options anyway)
    return {**s3_server.storage_options(), "endpoint_url": proxy.endpoint}


def ranged_gets(proxy: FaultProxy) -> dict[str, list[tuple[int, int]]]:
    """{object key: [(start, end) of each GET with a Range]} (suffix ranges as (-n, 0))."""
    out = collections.defaultdict(list)
    for method, target, rng in proxy.ranges:
        if method == "GET" and "?" not in target:
            name = target.rsplit("/", 1)[-1]
            if not rng:
                out[name].append((0, -1))
            elif rng.startswith("bytes=-"):
                out[name].append((-int(rng[7:]), 0))
            else:
                lo, hi = rng[6:].split("-")
                out[name].append((int(lo), int(hi) + 1))
    return out


def records(ckpt) -> list:
    """What a checkpoint's records say, with the file named by its base name (local and S3 compare equal)."""
    def pieces(ps):
        return [(os.path.basename(p.path), p.offset, p.numel, p.dtype) for p in ps or ()]

    return [(r.name, r.shape, r.kind, r.dtype, r.group, pieces(r.value), pieces(r.exp_avg), pieces(r.exp_avg_sq))
            for r in ckpt.records]


@pytest.mark.skipif(FIXTURE is None, reason="no committed fixtures")
def test_open_over_s3_is_a_few_parallel_rounds(s3_server, proxy, thresholds):
    src = checkpoint_path(FIXTURE)
    url = s3_server.url(f"open-{uuid.uuid4().hex}")
    upload(src, url, s3_server.storage_options())
    opts = via(proxy, s3_server)
    proxy.ranges.clear()
    remote = open_checkpoint(url, storage_options=opts)
    gets = ranged_gets(proxy)
    local = open_checkpoint(str(src))
    assert records(remote) == records(local)

    rank_files = [f.name for f in local.location.model_files + local.location.optim_files]
    assert len(rank_files) == 5
    for name in rank_files:
        spans = gets.get(name, [])
        if thresholds == "whole":
            assert spans == [(0, -1)], (name, spans)  # the whole file, one GET
            continue
        assert 2 <= len(spans) <= 3, (name, spans)  # tail + head, then one round of local headers
        size = os.path.getsize(src / local.location.tag / name)
        absolute = sorted((size + lo, size) if hi == 0 else (lo, hi) for lo, hi in spans)
        for (a_lo, a_hi), (b_lo, b_hi) in zip(absolute, absolute[1:]):
            assert a_hi <= b_lo, f"{name}: bytes {b_lo}..{a_hi} fetched twice ({spans})"
    # the listing and the stat of each file; no per-header GETs anywhere
    others = len(proxy.ranges) - sum(len(v) for v in gets.values())
    assert others <= 10 + len(rank_files), "\n".join(map(str, proxy.ranges))


@pytest.mark.skipif(FIXTURE is None, reason="no committed fixtures")
def test_rank_files_are_fetched_side_by_side(s3_server, proxy, monkeypatch):
    """The 5 rank files are opened at once (a barrier of 5 that only concurrent opens pass), not in turn."""
    src = checkpoint_path(FIXTURE)
    url = s3_server.url(f"par-{uuid.uuid4().hex}")
    upload(src, url, s3_server.storage_options())
    opts = via(proxy, s3_server)
    import threading

    gate = threading.Barrier(5, timeout=30)  # the 5 files' loads must all be running at once to pass this
    real_open = storage.open_ranges

    def gated(*args, **kwargs):
        gate.wait()
        return real_open(*args, **kwargs)

    monkeypatch.setattr(storage, "open_ranges", gated)
    proxy.ranges.clear()
    ckpt = open_checkpoint(url, storage_options=opts)
    assert len(ckpt.location.optim_files) == 4


@pytest.mark.parametrize("case", ZIP_CASES)
def test_damaged_files_are_refused_over_s3_as_locally(s3_server, tmp_path, case, monkeypatch):
    """The same refusal, word for word, from a damaged rank file read over S3 (large-file path forced: the zip
    directory and headers come from prefetched blocks) as from the local copy."""
    monkeypatch.setattr(ranges, "WHOLE_BYTES", 0)
    monkeypatch.setattr(ranges, "TAIL_BYTES", 1024)
    monkeypatch.setattr(ranges, "HEAD_BYTES", 512)
    ck, target = make_copy(tmp_path)
    damage(target, case)
    with pytest.raises(Exception) as local:
        open_checkpoint(str(ck))
    url = s3_server.url(f"dmg-{uuid.uuid4().hex}")
    opts = s3_server.storage_options()
    upload(ck, url, opts)
    with pytest.raises(Exception) as remote:
        open_checkpoint(url, storage_options=opts)
    assert type(remote.value) is type(local.value)
    assert str(remote.value).replace(url, "ROOT") == str(local.value).replace(str(ck), "ROOT")
    shutil.rmtree(ck)


def test_range_file_reads_what_a_local_file_reads(s3_server, tmp_path, monkeypatch):
    """Random reads through :class:`RangeFile` (prefetched or not, across blocks) return the local bytes."""
    import random

    monkeypatch.setattr(ranges, "TAIL_BYTES", 3000)
    monkeypatch.setattr(ranges, "HEAD_BYTES", 1000)
    data = os.urandom(50_000)
    local = tmp_path / "blob"
    local.write_bytes(data)
    url = s3_server.url(f"rf-{uuid.uuid4().hex}", "blob")
    opts = s3_server.storage_options()
    storage.put_file(str(local), url, storage_options=opts)
    rng = random.Random(0)
    for hint in (None, len(data)):
        with storage.open_ranges(url, opts, size_hint=hint) as f:
            assert f.size == len(data)
            f.prefetch([(10_000, 10_100), (10_200, 12_000), (40_000, 40_010)])
            for _ in range(200):
                lo = rng.randrange(0, len(data) + 10)
                n = rng.choice([0, 1, 7, 100, 5000, 20_000])
                f.seek(lo)
                assert f.read(n) == data[lo:lo + n]
                assert f.tell() == lo + len(data[lo:lo + n])
            f.seek(0)
            assert f.read() == data


@pytest.mark.skipif(FIXTURE is None, reason="no committed fixtures")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_remote_merge_written_from_fetched_blocks_is_the_local_merge(s3_server, tmp_path, monkeypatch, dtype):
    """Fetched blocks written straight out (pieces across several small GETs, zero fill between them; bf16: cast
    first) give the local merge's bytes."""
    from zckpt.engine import executor
    from zckpt.ops.merge import merge

    monkeypatch.setattr(executor, "MAX_REQUEST_BYTES", 96)
    monkeypatch.setattr(executor, "MIN_REQUEST_BYTES", 96)
    src = checkpoint_path(FIXTURE)
    url = s3_server.url(f"mrg-{uuid.uuid4().hex}")
    opts = s3_server.storage_options()
    upload(src, url, opts)
    res = merge(url, str(tmp_path / "remote"), dtype=dtype, storage_options=opts)
    merge(str(src), str(tmp_path / "local"), dtype=dtype)
    assert res.to_json()["stats"]["remote_requests"] > 10
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir())
    names.remove(".zckpt.json")  # the marker names the source
    for name in names:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "remote" / name).read_bytes(), name


def test_keep_fetched_scopes_of_two_threads_stay_apart():
    """Two opens at once (two threads, each its own scope) leave and enter in any order."""
    import threading

    both_in, a_out = threading.Barrier(2, timeout=10), threading.Event()
    errors = []

    def scope(first: bool):
        try:
            with storage.keep_fetched():
                both_in.wait()
                if not first:
                    a_out.wait(10)
            if first:
                a_out.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=scope, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not fetched._KEPT
