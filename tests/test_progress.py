"""Progress callbacks: ``verify --deep`` advances by bytes as they are read (not once per whole file), and every
callback ends with done == total (merge: the weight files' bytes, headers counted in both)."""

from __future__ import annotations

import os

import pytest

import zckpt
from zckpt.ops import verify_checks
from tests.conftest import FIXTURES, checkpoint_path

TRAINER = checkpoint_path(FIXTURES / "trainer")


@pytest.mark.parametrize("fmt,shard", [("safetensors", "8KB"), ("pt", "8KB"), ("safetensors", "5GB")])
def test_merge_progress_ends_at_its_total(tmp_path, fmt, shard):
    calls = []
    zckpt.merge(str(TRAINER), str(tmp_path / "m"), fmt=fmt, max_shard_size=shard,
                progress=lambda done, total: calls.append((done, total)))
    written = sum(os.path.getsize(tmp_path / "m" / f) for f in os.listdir(tmp_path / "m")
                  if f.startswith(("model", "pytorch_model")) and not f.endswith(".json"))
    assert calls and calls[-1] == (written, written), (calls[-1], written)
    assert all(t == written and 0 < d <= t for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def _deep(path, monkeypatch, chunk=4096):
    monkeypatch.setattr(verify_checks, "READ_CHUNK", chunk)
    calls = []
    report = zckpt.verify(str(path), deep=True, progress=lambda done, total: calls.append((done, total)))
    assert report.ok, report.checks
    return report, calls


@pytest.mark.parametrize("fixture", ["z2_bf16_ws2", "z3_bf16_ws2", "z1_fp32_ws3_legacy"])
def test_verify_deep_progress_by_bytes(monkeypatch, fixture):
    """Every file of the checkpoint read in 4 KiB blocks: the bar moves with each block (many more calls than
    files), never past its total, and ends at it; torch zips and legacy files alike."""
    path = checkpoint_path(FIXTURES / fixture)
    report, calls = _deep(path, monkeypatch)
    total = calls[-1][1]
    assert calls[-1] == (total, total) and report.bytes_read == total
    files = sum(1 for c in report.checks if c.name.startswith("CRC"))  # (one CRC check over every file)
    n_files = len(verify_checks.ckpt_rank_files(zckpt.open_checkpoint(str(path))))
    assert len(calls) >= total // 4096 > 2 * n_files, (len(calls), n_files, total, files)
    assert all(0 < d <= t == total for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_verify_deep_progress_by_bytes_dcp(monkeypatch, tmp_path):
    """A DCP folder's .distcp items: the bar moves within an item, not only when a whole item is read."""
    zckpt.convert(str(checkpoint_path(FIXTURES / "z2_bf16_ws2")), to="dcp", out=str(tmp_path / "d"))
    report, calls = _deep(tmp_path / "d", monkeypatch, chunk=64)
    total = calls[-1][1]
    assert calls[-1] == (total, total) and all(0 < d <= t == total for d, t in calls)
    ckpt = zckpt.open_checkpoint(str(tmp_path / "d"))
    from zckpt.encoding.distcp import items_by_file
    items = sum(len(v) for v in items_by_file(ckpt.extra["metadata"], ckpt.location.tag_dir).values())
    assert len(calls) > 3 * items, (len(calls), items)  # (once per item before)
