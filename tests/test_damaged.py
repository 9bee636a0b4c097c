"""Damaged copies of real checkpoints: every command refuses them in one line that names the damaged file.

Each case damages one rank file of a committed 4-rank fixture the way disks, copies and interrupted saves do
(truncation, a central-directory size past the end of the file, a broken local header, flipped pickle bytes, a
missing rank file). ``torch.load`` refuses every one of these files; ``info``, ``verify``, ``merge`` and push's
completeness check must refuse them too, without ``--deep``, and say which file (which rank) is wrong, with the
path as the user typed it.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURE_DIRS, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = next((d for d in FIXTURE_DIRS if d.name == "z2_bf16_ws4"), FIXTURE_DIRS[0] if FIXTURE_DIRS else None)
RANK = 2  # the rank whose optimizer file is damaged


def _central_record(data: bytes, cd_start: int, name: str) -> int:
    """Offset of the central-directory record of entry ``name``."""
    pos = data.index(b"PK\x01\x02", cd_start)
    while data[pos + 46:pos + 46 + len(name)] != name.encode():
        pos = data.index(b"PK\x01\x02", pos + 4)
    return pos


def _entry(infos, suffix: str) -> zipfile.ZipInfo:
    return next(i for i in infos if i.filename.endswith(suffix))


def damage(path: Path, case: str) -> None:
    """Damage the torch zip at ``path`` in place."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        infos, cd_start = zf.infolist(), zf.start_dir
    if case == "truncated":
        data = data[: len(data) * 2 // 3]
    elif case in ("cd_size_tensor", "cd_size_unread"):
        # the directory gives a storage (or an entry zckpt never reads, 'version') a size past the end of the file
        info = _entry(infos, "/data/1" if case == "cd_size_tensor" else "/version")
        struct.pack_into("<II", data, _central_record(data, cd_start, info.filename) + 20, 1 << 20, 1 << 20)
    elif case == "cd_offset":  # the directory points an entry at a byte that is no local header
        info = _entry(infos, "/data/0")
        struct.pack_into("<I", data, _central_record(data, cd_start, info.filename) + 42, info.header_offset + 7)
    elif case == "local_header":
        off = _entry(infos, "/data/2").header_offset
        data[off:off + 4] = b"XXXX"
    elif case == "local_name":
        info = _entry(infos, "/byteorder")
        data[info.header_offset + 30 + len(info.filename) - 1] ^= 0x20
    elif case == "compressed":
        info = _entry(infos, "/data/1")
        struct.pack_into("<H", data, _central_record(data, cd_start, info.filename) + 10, 8)
    elif case in ("pickle_crc", "pickle_bytes"):
        info = _entry(infos, "/data.pkl")
        start = info.header_offset + 30 + struct.unpack_from("<HH", data, info.header_offset + 26)[0] \
            + struct.unpack_from("<HH", data, info.header_offset + 26)[1]
        for k in range(40, 48):
            data[start + k] ^= 0xA5
        if case == "pickle_bytes":  # a damaged pickle with a matching CRC: only the unpickler can tell
            crc = zlib.crc32(bytes(data[start:start + info.file_size]))
            struct.pack_into("<I", data, _central_record(data, cd_start, info.filename) + 16, crc)
    else:
        raise ValueError(case)
    path.write_bytes(bytes(data))


def make_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the fixture as ``tmp_path/ck`` and its rank-RANK optimizer file."""
    if FIXTURE is None:
        pytest.skip("no committed fixtures")
    src = checkpoint_path(FIXTURE)
    ck = tmp_path / "ck"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("expected"))
    tag = (ck / "latest").read_text().strip()
    ranks = sorted((ck / tag).glob("*optim_states.pt"))
    target = next((p for p in ranks if f"zero_pp_rank_{RANK}_" in p.name), ranks[-1])
    return ck, target


def cli(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, ZCKPT_DEBUG="", PYTHONPATH=str(ROOT)))


def assert_one_line_error(proc, *must_name):
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zckpt: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for text in must_name:
        assert text in lines[0], (text, lines[0])
    return lines[0]


ZIP_CASES = ["truncated", "cd_size_tensor", "cd_size_unread", "cd_offset", "local_header", "local_name",
             "compressed", "pickle_crc", "pickle_bytes"]
ALL_COMMANDS = ("truncated", "cd_size_tensor", "cd_size_unread", "pickle_bytes")


def _refused(fn) -> bool:
    try:
        fn()
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


def _torch_reads(path: Path) -> None:
    reader = torch._C.PyTorchFileReader(str(path))  # torch's zip layer (miniz), every record
    for name in reader.get_all_records():
        reader.get_record(name)
    torch.load(path, weights_only=False, map_location="cpu")  # our own committed fixture: trusted


def _zipfile_reads(path: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            zf.read(info)  # checks the local header against the directory, decompresses, checks the CRC


@pytest.mark.parametrize("case", ZIP_CASES)
def test_the_damage_is_real(tmp_path, case):
    """torch (its miniz reader or its unpickler) or Python's zipfile refuses each damaged file: refusing it is
    right. torch itself tolerates a broken local header or a compression flag on a stored entry; zipfile
    does not, and zckpt follows the stricter reading."""
    _, target = make_copy(tmp_path)
    assert not _refused(lambda: _torch_reads(target)) and not _refused(lambda: _zipfile_reads(target))
    damage(target, case)
    assert _refused(lambda: _torch_reads(target)) or _refused(lambda: _zipfile_reads(target))


@pytest.mark.parametrize("case", ZIP_CASES)
def test_commands_name_the_damaged_rank_file(tmp_path, case):
    ck, target = make_copy(tmp_path)
    damage(target, case)
    rel = os.path.join("ck", os.path.relpath(target, ck))  # the path as the user's command names it
    commands = [["verify", "ck"]]
    if case in ALL_COMMANDS:  # every command on the cases of the issue; verify alone on the others (2 CPUs)
        commands += [["info", "ck"], ["merge", "ck", "-o", "out"]]
    for cmd in commands:
        line = assert_one_line_error(cli(tmp_path, *cmd), rel)
        assert str(tmp_path) not in line, line  # the user's relative path, not an absolute or scratch one
        assert not (tmp_path / "out").exists()
    if not case.startswith("pickle"):  # push's completeness check reads the zip structure, not the pickle
        from zckpt.backup.scan import check_complete
        ok, reason = check_complete(str(ck))
        assert not ok and target.name in reason, reason


def test_iter_tensors_names_the_damaged_rank_file(tmp_path):
    import zckpt
    from zckpt.errors import CorruptFile
    ck, target = make_copy(tmp_path)
    damage(target, "cd_size_unread")
    with pytest.raises(CorruptFile) as err:
        next(iter(zckpt.iter_tensors(str(ck))))
    assert err.value.path == str(target) and "version" in str(err.value)


def copy_of(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A copy of committed fixture ``name`` as ``tmp_path/ck`` (what the user's command names) and its tag folder."""
    fixture = next((d for d in FIXTURE_DIRS if d.name == name), None)
    if fixture is None:
        pytest.skip(f"no committed fixture {name}")
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_path(fixture), ck, ignore=shutil.ignore_patterns("expected"))
    return ck, ck / (ck / "latest").read_text().strip()


# (fixture, files deleted from its tag folder, files the one-line error names, words it says)
MISSING_CASES = {
    "optim_rank": ("z2_bf16_ws4", ["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"],
                   ["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"], "missing: optimizer states of rank 2 of 4"),
    "optim_rank0_trainer": ("trainer", ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                            ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                            "missing: optimizer states of rank 0 of 2"),
    "optim_three": ("z2_bf16_ws4", [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 2, 3)],
                    [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 2, 3)],
                    "missing: optimizer states of ranks 1-3 of 4"),
    "zero3_model_rank": ("z3_bf16_ws2", ["zero_pp_rank_1_mp_rank_00_model_states.pt"],
                         ["zero_pp_rank_1_mp_rank_00_model_states.pt"], "missing: ZeRO-3 model states of rank 1 of 2"),
    "zero3_every_model_file": ("z3_bf16_ws4", [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(4)],
                               [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)],
                               "and 1 more: missing: ZeRO-3 model states of ranks 0-3 of 4"),
    "model_states": ("z2_bf16_ws2", ["mp_rank_00_model_states.pt"], ["mp_rank_00_model_states.pt"],
                     "missing: the model states file of model-parallel rank 0"),
}


@pytest.mark.parametrize("case", list(MISSING_CASES))
def test_missing_rank_file_is_named(tmp_path, case):
    """A rank file deleted from the tag folder: info, verify and merge each say which file (as the user's path
    leads to it) and which rank, in one line, exit 1, and merge writes nothing."""
    fixture, delete, named, words = MISSING_CASES[case]
    ck, tag_dir = copy_of(tmp_path, fixture)
    for name in delete:
        (tag_dir / name).unlink()
    rels = [os.path.join("ck", tag_dir.name, name) for name in named]
    for cmd in (["info", "ck"], ["verify", "ck"], ["merge", "ck", "-o", "out"]):
        line = assert_one_line_error(cli(tmp_path, *cmd), *rels, words, "use an earlier tag with --tag")
        assert line.startswith(f"zckpt: error: {rels[0]}"), line  # the file first, not the tag folder
        assert str(tmp_path) not in line, line
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), list(tmp_path.iterdir())


def test_missing_rank_file_json_error(tmp_path):
    """--json: the error object's path is the missing file, as typed; the same one line on stderr."""
    import json

    ck, tag_dir = copy_of(tmp_path, "z3_bf16_ws2")
    (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    rel = os.path.join("ck", tag_dir.name, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for cmd in (["info", "ck"], ["verify", "ck"], ["merge", "ck", "-o", "out"]):
        proc = cli(tmp_path, *cmd, "--json")
        line = assert_one_line_error(proc, rel, "rank 0 of 2")
        doc = json.loads(proc.stdout)
        assert doc["ok"] is False and doc["command"] == cmd[0], doc
        assert doc["error"]["path"] == rel and doc["error"]["type"] == "IncompleteCheckpoint"
        assert doc["error"]["exit_code"] == 1 and line.endswith(doc["error"]["message"])


def test_stale_extra_rank_file_is_named(tmp_path):
    """A rank file beyond partition_count (left by a larger run under the same tag) is named too."""
    ck, tag_dir = copy_of(tmp_path, "z2_bf16_ws2")
    shutil.copy(tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag_dir / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    rel = os.path.join("ck", tag_dir.name, "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    line = assert_one_line_error(cli(tmp_path, "verify", "ck"), rel, "partition_count says 2 ranks")
    assert line.startswith(f"zckpt: error: {rel}: unexpected"), line


def test_missing_file_error_text_for_python_callers(tmp_path):
    """str() of the error (what a Python caller prints) names the files once, not path: path: ..."""
    from zckpt.state.open import open_checkpoint
    from zckpt.errors import IncompleteCheckpoint

    ck, tag_dir = copy_of(tmp_path, "z2_bf16_ws4")
    for r in (0, 3):
        (tag_dir / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(IncompleteCheckpoint) as err:
        open_checkpoint(str(ck))
    first = str(tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert err.value.path == first
    assert str(err.value).startswith(f"{first}, {tag_dir / 'bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt'}: "
                                     "missing: optimizer states of ranks 0, 3 of 4"), str(err.value)
    assert str(err.value).count(first) == 1


def test_missing_tag_names_the_tag_not_latest(tmp_path):
    ck, _ = make_copy(tmp_path)
    tag = (ck / "latest").read_text().strip()
    for cmd in (["info", "ck"], ["verify", "ck"], ["merge", "ck", "-o", "out"]):
        line = assert_one_line_error(cli(tmp_path, *cmd, "--tag", "global_step9"), "--tag global_step9",
                                     os.path.join("ck", "global_step9"), tag)
        assert "latest" not in line, line


@pytest.mark.parametrize("latest", ["global_step9", "../../etc"])
def test_bad_latest_in_a_folder_with_weights_is_the_readers_error(tmp_path, latest):
    """A checkpoint folder that also holds merged-looking weights (a Trainer's model.safetensors) whose 'latest'
    names a missing or invalid tag: every command says what is wrong with 'latest'; verify does not take the folder
    for an uncommitted merge output."""
    ck, _ = make_copy(tmp_path)
    (ck / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (ck / "latest").write_text(latest)
    for cmd in (["info", "ck"], ["verify", "ck"], ["merge", "ck", "-o", "out"]):
        line = assert_one_line_error(cli(tmp_path, *cmd), "'latest'", latest)
        assert ".zckpt.json" not in line, line
    assert not (tmp_path / "out").exists()


def test_verify_deep_still_reports_a_flipped_tensor_bit(tmp_path):
    """Structure intact, a bit of tensor data flipped: only the CRC pass (--deep) can see it."""
    ck, target = make_copy(tmp_path)
    with zipfile.ZipFile(target) as zf:
        info = _entry(zf.infolist(), "/data/1")
    data = bytearray(target.read_bytes())
    start = info.header_offset + 30 + sum(struct.unpack_from("<HH", data, info.header_offset + 26))
    data[start + 3] ^= 0x01
    target.write_bytes(bytes(data))
    assert cli(tmp_path, "verify", "ck").returncode == 0
    proc = cli(tmp_path, "verify", "ck", "--deep")
    assert proc.returncode != 0 and target.name in proc.stdout + proc.stderr
