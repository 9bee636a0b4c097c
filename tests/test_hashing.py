"""zckpt.io.hashing: streamed digests equal hashlib's (sha256) and git's (blob ids), chunk edges included."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading

import pytest

from zckpt.errors import PushInterrupted, StorageError
from zckpt.io import hashing

CHUNK = 4096
SIZES = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 7]


def _data(n: int) -> bytes:
    return bytes((i * 131 + 7) % 251 for i in range(n))


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("size", SIZES)
def test_sha256_file_and_bytes_equal_hashlib(tmp_path, size):
    data = _data(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert hashing.sha256_bytes(data) == want
    assert hashing.sha256_file(path, chunk=CHUNK) == want
    assert hashing.sha256_file(str(path)) == want  # default chunk: the whole file in one read
    with open(path, "rb") as f:
        assert hashing.sha256_stream(f, chunk=CHUNK) == want


@pytest.mark.parametrize("size", SIZES)
def test_git_blob_sha1_file_and_bytes(tmp_path, size):
    data = _data(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = _git_blob(data)
    assert hashing.git_blob_sha1_bytes(data) == want
    assert hashing.git_blob_sha1_file(path, chunk=CHUNK) == want


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("data", [b"", b"hello\n", _data(CHUNK + 1), _data(100_000), b'{"files": []}\n'])
def test_git_blob_sha1_is_what_git_hash_object_prints(tmp_path, data):
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    git = subprocess.run(["git", "hash-object", "--no-filters", str(path)], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert hashing.git_blob_sha1_file(path, chunk=CHUNK) == git
    assert hashing.git_blob_sha1_bytes(data) == git


def test_on_chunk_sees_every_byte_in_bounded_chunks(tmp_path):
    data = _data(3 * CHUNK + 7)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    seen = []
    hashing.sha256_file(path, chunk=CHUNK, on_chunk=lambda view: seen.append(bytes(view)))
    assert b"".join(seen) == data
    assert max(map(len, seen)) <= CHUNK and len(seen) >= 4


def test_cancel_stops_hashing_early(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(_data(10 * CHUNK))
    cancel = threading.Event()
    chunks = []

    def on_chunk(view):
        chunks.append(len(view))
        if len(chunks) == 2:
            cancel.set()

    with pytest.raises(PushInterrupted) as info:
        hashing.sha256_file(path, cancel=cancel, chunk=CHUNK, on_chunk=on_chunk)
    assert len(chunks) == 2 and sum(chunks) < 10 * CHUNK  # stopped after the chunk that set it
    assert str(path) in str(info.value)
    with pytest.raises(PushInterrupted):  # already set: nothing is read
        hashing.git_blob_sha1_file(path, cancel=cancel, chunk=CHUNK, on_chunk=on_chunk)
    assert len(chunks) == 2


def test_urls_are_streamed_through_fsspec(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    data = _data(2 * CHUNK + 3)
    fs = fsspec.filesystem("memory")
    fs.pipe("/zckpt-hashing-test/f.bin", data)
    try:
        url = "memory://zckpt-hashing-test/f.bin"
        assert hashing.sha256_file(url, chunk=CHUNK) == hashlib.sha256(data).hexdigest()
        assert hashing.git_blob_sha1_file(url, chunk=CHUNK) == _git_blob(data)
    finally:
        fs.rm("/zckpt-hashing-test", recursive=True)


def test_a_backend_error_mid_stream_is_a_storage_error():
    class Broken:
        def readinto(self, buf):
            raise RuntimeError("connection reset by peer")

    with pytest.raises(StorageError, match="connection reset"):
        hashing.sha256_stream(Broken(), name="s3://bucket/key")


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        hashing.sha256_file(tmp_path / "absent")
