"""zckpt.io.storage against a local folder, fsspec's memory store and a real S3 server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from zckpt.io import storage
from zckpt.errors import StorageError


@pytest.fixture(params=["local", "memory", "s3"])
def base(request, tmp_path):
    """A fresh, empty location on each backend (S3 configured through the standard AWS variables)."""
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "memory":
        url = f"memory://zckpt-{uuid.uuid4().hex}"
        yield url
        storage.remove(url, recursive=True, missing_ok=True)
    else:
        server = request.getfixturevalue("s3_server")
        with server.environ():
            yield server.url(f"storage-{uuid.uuid4().hex}")


def _local_file(tmp_path, name: str, nbytes: int) -> tuple[str, bytes]:
    data = os.urandom(nbytes)
    path = tmp_path / name
    path.write_bytes(data)
    return str(path), data


# ------------------------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("path,expected", [
    ("s3://bucket/x", True), ("hf://user/repo", True), ("memory://a", True), ("gs://b/c", True),
    ("/data/run", False), ("relative/path", False), ("file:///data/run", False), ("C:\\x", False),
])
def test_is_url(path, expected):
    assert storage.is_url(path) is expected


def test_join_keeps_urls_intact():
    assert storage.join("s3://bucket/run", "checkpoint-4", "x.pt") == "s3://bucket/run/checkpoint-4/x.pt"
    assert storage.join("s3://bucket/", "/a/", "b") == "s3://bucket/a/b"
    assert storage.join("s3://bucket") == "s3://bucket"
    assert storage.join("memory://", "a") == "memory://a"
    assert storage.join("/data", "a", "b") == os.path.join("/data", "a", "b")
    assert storage.basename("s3://bucket/run/checkpoint-4/") == "checkpoint-4"


def test_parent_of_local_paths_and_urls(tmp_path, monkeypatch):
    assert storage.parent("s3://bucket/run/checkpoint-4/") == "s3://bucket/run"
    assert storage.parent("s3://bucket/run") == "s3://bucket"
    assert storage.parent("s3://bucket") == "s3://bucket"  # a bucket is its own parent
    assert storage.parent("/data/run/checkpoint-4/") == "/data/run"
    monkeypatch.chdir(tmp_path)
    assert storage.parent("checkpoint-4") == str(tmp_path)


def test_parse_storage_options():
    opts = storage.parse_storage_options(["anon=true", "endpoint_url=http://127.0.0.1:9000",
                                          'client_kwargs={"region_name": "eu-west-1"}', "max_concurrency=4"])
    assert opts == {"anon": True, "endpoint_url": "http://127.0.0.1:9000",
                    "client_kwargs": {"region_name": "eu-west-1"}, "max_concurrency": 4}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        storage.parse_storage_options(["novalue"])


def test_get_fs_local_and_memory(tmp_path):
    fs, path = storage.get_fs(str(tmp_path))
    assert fs.protocol[0] == "file" and path == str(tmp_path)
    fs, path = storage.get_fs(f"file://{tmp_path}")
    assert path == str(tmp_path)
    fs, path = storage.get_fs("memory://a/b")
    assert "memory" in fs.protocol and path == "/a/b"


def test_s3_endpoint_from_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    fs, path = storage.get_fs("s3://bucket/key")
    assert path == "bucket/key"
    assert fs.endpoint_url == "http://127.0.0.1:2"  # the S3-specific variable wins
    assert fs.storage_options["key"] == "k" and fs.storage_options["secret"] == "s"
    fs3, _ = storage.get_fs("s3://bucket/key", {"endpoint_url": "http://127.0.0.1:3"})  # options win, per call
    assert fs3 is not fs and fs3.endpoint_url == "http://127.0.0.1:3" and fs3.storage_options["key"] == "k"
    again, _ = storage.get_fs("s3://bucket/key")  # and only for that call: nothing is remembered
    assert again.endpoint_url == "http://127.0.0.1:2"
    assert not hasattr(storage, "set_storage_options") and not hasattr(storage, "storage_options")


def test_hf_url_gets_hf_filesystem():
    fs, path = storage.get_fs("hf://user/repo/sub/file.bin")
    assert type(fs).__name__ == "HfFileSystem" and path == "user/repo/sub/file.bin"


# ------------------------------------------------------------------------------------------- every backend


def test_write_read_list_remove(base, tmp_path):
    storage.makedirs(base)
    a = storage.join(base, "ckpt", "a.bin")
    b = storage.join(base, "ckpt", "sub", "b.txt")
    storage.write_bytes_atomic(a, b"\x00\x01abc")
    storage.write_bytes_atomic(b, "héllo".encode())
    assert storage.read_bytes(a) == b"\x00\x01abc"
    assert storage.read_text(b) == "héllo"
    assert storage.read_range(a, 2, 2) == b"ab"
    assert storage.size(a) == 5
    assert storage.exists(a) and storage.isfile(a) and not storage.isdir(a)
    assert storage.isdir(storage.join(base, "ckpt")) and not storage.isfile(storage.join(base, "ckpt"))
    assert storage.listdir(storage.join(base, "ckpt")) == ["a.bin", "sub"]
    assert storage.list_files(storage.join(base, "ckpt")) == {"a.bin": 5, "sub/b.txt": 6}
    assert storage.list_files(storage.join(base, "nothing-here")) == {}
    # overwrite is atomic and complete
    storage.write_bytes_atomic(a, b"new")
    assert storage.read_bytes(a) == b"new"
    storage.remove(a)
    assert not storage.exists(a)
    storage.remove(a, missing_ok=True)
    with pytest.raises(FileNotFoundError):
        storage.remove(a)
    storage.remove(storage.join(base, "ckpt"), recursive=True)
    assert storage.list_files(storage.join(base, "ckpt")) == {}


def test_missing_paths_raise_file_not_found(base):
    missing = storage.join(base, "missing.bin")
    assert not storage.exists(missing)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(missing)
    with pytest.raises(FileNotFoundError):
        storage.size(missing)


def test_put_file_with_progress(base, tmp_path):
    src, data = _local_file(tmp_path, "blob.bin", 3 * 1024 * 1024 + 17)
    seen: list[int] = []
    url = storage.join(base, "up", "blob.bin")
    storage.put_file(src, url, callback=seen.append)
    assert sum(seen) == len(data)
    assert storage.read_bytes(url) == data
    if not storage.is_url(url):
        assert os.listdir(os.path.dirname(url)) == ["blob.bin"]  # no temp file left behind


def test_open_input_random_reads(base, tmp_path):
    src, data = _local_file(tmp_path, "big.bin", 6 * 1024 * 1024)
    url = storage.join(base, "big.bin")
    storage.put_file(src, url)
    with storage.open_input(url) as f:
        f.seek(4 * 1024 * 1024 + 3)
        assert f.read(100) == data[4 * 1024 * 1024 + 3:4 * 1024 * 1024 + 103]
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:]
        assert f.tell() == len(data)
        f.seek(17)
        assert f.read(5) == data[17:22]
        cache = getattr(f, "cache", None)
        if cache is not None and hasattr(cache, "total_requested_bytes"):
            # remote: three small ranges, not the 6 MiB object
            assert cache.total_requested_bytes < 4 * storage.REMOTE_BLOCK_SIZE


# ------------------------------------------------------------------------------------------- S3 specifics


@pytest.fixture(params=["boto3", "s3fs"])
def uploader(request, monkeypatch):
    """put_file to S3 goes through boto3's transfer manager by default; s3fs is the fallback: test both."""
    monkeypatch.setenv("ZCKPT_S3_UPLOADER", request.param)
    return request.param


def test_s3_multipart_upload_and_metadata(s3_server, tmp_path, uploader):
    src, data = _local_file(tmp_path, "multi.bin", 12 * 1024 * 1024 + 5)
    url = s3_server.url(f"mp-{uuid.uuid4().hex}", "multi.bin")
    seen: list[int] = []
    digest = hashlib.sha256(data).hexdigest()
    storage.put_file(src, url, callback=seen.append, storage_options=s3_server.storage_options(),
                     metadata={"sha256": digest}, chunksize=5 * 1024 * 1024)
    assert len(seen) >= 3 and sum(seen) == len(data)  # one update per part
    key = url[len(f"s3://{s3_server.bucket}/"):]
    assert s3_server.get(key) == data
    assert storage.metadata(url, s3_server.storage_options())["sha256"] == digest


def test_s3_options_reach_backend(s3_server):
    """Options given per call work without any AWS variables, and only for that call."""
    url = s3_server.url(f"opts-{uuid.uuid4().hex}", "x.txt")
    storage.write_bytes_atomic(url, b"x", storage_options=s3_server.storage_options())
    assert storage.read_bytes(url, s3_server.storage_options()) == b"x"
    with pytest.raises(PermissionError):  # another call's credentials are its own
        storage.read_bytes(url, {**s3_server.storage_options(), "secret": "wrong"})
    assert storage.read_bytes(url, s3_server.storage_options()) == b"x"


def test_unreachable_endpoint_is_storage_error(tmp_path, uploader):
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "retries": 1,
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    url = "s3://nobucket/x.bin"
    with pytest.raises(StorageError) as info:
        storage.write_bytes_atomic(url, b"x", storage_options=opts)
    assert url in str(info.value)
    assert isinstance(info.value, OSError)
    src, _ = _local_file(tmp_path, "x.bin", 10)
    with pytest.raises(StorageError) as info:
        storage.put_file(src, url, storage_options=opts)
    assert url in str(info.value)


def test_s3_refusals_map_to_builtins(s3_server, tmp_path, uploader):
    """Wrong keys -> PermissionError, a missing bucket -> FileNotFoundError, for both upload paths."""
    src, _ = _local_file(tmp_path, "x.bin", 10)
    bad_keys = {**s3_server.storage_options(), "secret": "wrong"}
    with pytest.raises(PermissionError):
        storage.put_file(src, s3_server.url("denied.bin"), storage_options=bad_keys)
    with pytest.raises(FileNotFoundError):
        storage.put_file(src, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x.bin",
                         storage_options=s3_server.storage_options())


def test_cancel_through_callback(s3_server, tmp_path, uploader):
    """Raising from the progress callback abandons the upload; no object appears."""
    src, _ = _local_file(tmp_path, "cancel.bin", 12 * 1024 * 1024)
    url = s3_server.url(f"cancel-{uuid.uuid4().hex}", "cancel.bin")

    class Stop(Exception):
        pass

    def cb(n):
        raise Stop()

    with pytest.raises((Stop, StorageError)):
        storage.put_file(src, url, callback=cb, storage_options=s3_server.storage_options(),
                         chunksize=5 * 1024 * 1024)
    assert not storage.exists(url, s3_server.storage_options())
