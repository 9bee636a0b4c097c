"""One vocabulary: every command reads ``5G``/``5GB``/``5GiB`` and ``30m`` the same way, and prints sizes alike."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, strategies as st

from tests.conftest import FIXTURES, checkpoint_path
from zckpt import units
from zckpt.errors import InvalidArgument

SIZES = [
    ("5G", 5 * 10**9), ("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("5 GB", 5 * 10**9), ("5GiB", 5 * 2**30),
    ("5gib", 5 * 2**30), ("500M", 500 * 10**6), ("500MB", 500 * 10**6), ("8MiB", 8 * 2**20), ("1K", 1000),
    ("1KB", 1000), ("1KiB", 1024), ("2T", 2 * 10**12), ("2TiB", 2 * 2**40), ("1024", 1024), ("1_000_000", 10**6),
    ("7B", 7), ("1.5GiB", 3 * 2**29), ("0.5KB", 500), ("79.6GiB", round(Fraction("79.6") * 2**30)), (4096, 4096),
]


@pytest.mark.parametrize("text,expected", SIZES)
def test_parse_size(text, expected):
    assert units.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "GiB", "5X", "5 gigs", "-1GB", "0", "0GB", "1e3GB", "nan", "inf",
                                  "5GiBs", "5.5.5G", True, None])
def test_parse_size_refuses_with_flag_named(text):
    with pytest.raises(InvalidArgument) as info:
        units.parse_size(text, "--max-shard-size")
    assert str(info.value).startswith("--max-shard-size: ")


def test_every_size_parser_is_the_one_rule():
    """merge --max-shard-size, push --part-size and estimate --gpu-memory read a size the same way."""
    from zckpt.cli.push import parse_size as push_size
    from zckpt.ops.estimate import parse_size as estimate_size
    from zckpt.ops.merge import parse_size as merge_size
    for text, expected in SIZES:
        assert merge_size(text) == push_size(text) == estimate_size(text) == expected, text
    for bad in ("5X", "0", "lots"):
        for parse in (merge_size, push_size, estimate_size):
            with pytest.raises(InvalidArgument):
                parse(bad)


@given(st.integers(min_value=1, max_value=10**15), st.sampled_from(sorted(units.SIZE_UNITS)))
def test_parse_size_round_trip(n, unit):
    assert units.parse_size(f"{n}{unit}") == n * units.SIZE_UNITS[unit]
    assert units.parse_size(f"{n} {unit.upper()}") == n * units.SIZE_UNITS[unit]


@pytest.mark.parametrize("n,text", [
    (None, "?"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (27033, "26.4 KiB"), (3 * 2**29, "1.5 GiB"),
    (5 * 2**40, "5.0 TiB"), (2**60, "1048576.0 TiB"),
])
def test_format_size(n, text):
    assert units.format_size(n) == text


def test_one_formatter_everywhere():
    from zckpt.ops.info import human_bytes as info_bytes
    from zckpt.backup.results import human_bytes as push_bytes
    for n in (0, 999, 1000, 123456, 5 * 10**9):
        assert info_bytes(n) == push_bytes(n) == units.format_size(n)


@pytest.mark.parametrize("text,seconds", [
    ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("1h 30m", 5400), ("500ms", 0.5),
    ("0", 0), ("15", 15), ("1.5h", 5400), ("2H", 7200), (10, 10),
])
def test_parse_duration(text, seconds):
    assert units.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "m", "30x", "-5s", "1h-30m", "soon", "30 minutes"])
def test_parse_duration_refuses(text):
    with pytest.raises(InvalidArgument) as info:
        units.parse_duration(text, "--every")
    assert str(info.value).startswith("--every: ")


def test_units_imports_neither_torch_nor_numpy():
    code = "import sys, zckpt.units; print([m for m in ('torch', 'numpy', 'click') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -------------------------------------------------------------------------------------------- through the CLI

def _cli(*args):
    from zckpt.cli import main
    return CliRunner().invoke(main, list(args))


def test_cli_sizes_mean_the_same_in_every_command(tmp_path):
    ckpt = checkpoint_path(FIXTURES / "trainer")
    # 5G and 5GB are the same shard limit for merge (one file either way); 20KB splits this 28 KiB model
    plans = {size: json.loads(_cli("merge", str(ckpt), "-o", str(tmp_path / "o"), "--dry-run", "--json",
                                   "--max-shard-size", size).stdout) for size in ("5G", "5GB", "5GiB", "20KB")}
    assert len(plans["5G"]["files"]) == len(plans["5GB"]["files"]) == len(plans["5GiB"]["files"]) == 1
    assert len(plans["20KB"]["files"]) > 2  # two shards and their index
    # estimate: 80G = 80GB = 80*10**9 (the table's headline says so), 80GiB is more
    gb = [_cli("estimate", "--params", "8B", "--largest-layer", "600M", "--gpu-memory", g, "--json").stdout
          for g in ("80G", "80GB", "80GiB")]
    assert gb[0] == gb[1]
    bad = [_cli(*cmd) for cmd in (["merge", str(ckpt), "--dry-run", "--max-shard-size", "5X"],
                                  ["push", str(tmp_path), "s3://bucket/run", "--part-size", "5X"],  # read before any request
                                  ["estimate", "--params", "8B", "--largest-layer", "1M", "--gpu-memory", "5X"])]
    for res in bad:
        assert res.exit_code == 1 and res.stderr.startswith("zckpt: error: --") and "'5X'" in res.stderr, res.output
        assert "5GB = 5*10**9, 5GiB = 5*2**30" in res.stderr


def test_cli_gpu_memory_needs_a_unit():
    res = _cli("estimate", "--params", "8B", "--largest-layer", "600M", "--gpu-memory", "80")
    assert res.exit_code == 1 and "80 bytes" in res.stderr and "80GiB" in res.stderr
    assert _cli("estimate", "--params", "8B", "--largest-layer", "600M", "--gpu-memory", "85899345920").exit_code == 0


def test_cli_durations(tmp_path):
    res = _cli("push", str(tmp_path), str(tmp_path / "d"), "--settle", "1x")
    assert res.exit_code == 1 and res.stderr.startswith("zckpt: error: --settle: cannot read '1x' as a duration")
    res = _cli("push", str(tmp_path), str(tmp_path / "d"), "--every", "soon")
    assert res.exit_code == 1 and "--every: cannot read 'soon'" in res.stderr
