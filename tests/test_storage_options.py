"""Storage options are passed, never kept process-wide: every op takes ``storage_options=`` for that call only.

The backend here is a fake fsspec filesystem, ``optfs://``: each ``endpoint`` option is a separate store that only
its own ``key`` opens, and a call without options is refused. Any read or write that lost its options on the way
(a reader, the executor, the publisher, a side file) fails; two calls with different options in one process
(two S3-like servers, two sets of credentials) each see their own store only.
"""

from __future__ import annotations

import ast
import os
import threading
import uuid
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

import zckpt
from zckpt.errors import StorageError
from zckpt.io import storage
from tests.conftest import FIXTURES, checkpoint_path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "zckpt"


class OptionsFS(MemoryFileSystem):
    """``optfs://``: one in-memory store per ``endpoint``; refuses a call without the endpoint's ``key``."""

    protocol = ("optfs",)
    keys = {"http://server-a": "key-a", "http://server-b": "key-b"}
    stores: dict[str, dict] = {}
    dirs: dict[str, list] = {}
    seen: list[tuple[str | None, str | None]] = []
    lock = threading.Lock()

    def __init__(self, endpoint_url=None, key=None, **kwargs):
        with self.lock:
            self.seen.append((endpoint_url, key))
        if endpoint_url not in self.keys:
            raise PermissionError(13, f"no such endpoint: {endpoint_url!r} (storage options not passed?)")
        if key != self.keys[endpoint_url]:
            raise PermissionError(13, f"wrong key for {endpoint_url}")
        super().__init__(**kwargs)
        with self.lock:
            self.store = self.stores.setdefault(endpoint_url, {})
            self.pseudo_dirs = self.dirs.setdefault(endpoint_url, [""])

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path.removeprefix("optfs://"))


A = {"endpoint_url": "http://server-a", "key": "key-a"}
B = {"endpoint_url": "http://server-b", "key": "key-b"}


@pytest.fixture(autouse=True)
def optfs():
    import fsspec

    fsspec.register_implementation("optfs", OptionsFS, clobber=True)
    yield OptionsFS
    OptionsFS.stores.clear()
    OptionsFS.dirs.clear()
    OptionsFS.seen.clear()
    OptionsFS.clear_instance_cache()


def _upload(local: Path, url: str, options: dict) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file() and "expected" not in p.relative_to(local).parts:
            storage.put_file(str(p), storage.join(url, p.relative_to(local).as_posix()), storage_options=options)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != ".zckpt.json"}


# ------------------------------------------------------------------------------------------- no global state


def test_storage_has_no_process_wide_options():
    for name in ("set_storage_options", "get_storage_options", "storage_options", "_default_options",
                 "_options_lock"):
        assert not hasattr(storage, name), name
    assert hasattr(storage, "parse_storage_options")


def test_no_module_keeps_storage_options():
    """No module under zckpt/ holds storage options at module level (a dict, list or set named *option*), sets
    one through ``global``, or still names the removed setter."""
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for word in ("set_storage_options", "get_storage_options"):
            if word in text:
                found.append(f"{rel}: names {word}")
        tree = ast.parse(text)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            is_mutable = isinstance(value, mutable) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict"))
            for t in targets:
                if isinstance(t, ast.Name) and "option" in t.id.lower() and is_mutable:
                    found.append(f"{rel}:{node.lineno}: module-level {t.id}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global) and any("option" in n.lower() for n in node.names):
                found.append(f"{rel}:{node.lineno}: global {', '.join(node.names)}")
    assert not found, "\n".join(found)


def test_get_fs_uses_only_what_it_is_given():
    fs_a, inner = storage.get_fs("optfs://bucket/x", A)
    fs_b, _ = storage.get_fs("optfs://bucket/x", B)
    assert inner == "/bucket/x" and fs_a is not fs_b and fs_a.store is not fs_b.store
    with pytest.raises(PermissionError, match="not passed"):  # nothing was remembered from the calls above
        storage.get_fs("optfs://bucket/x")
    with pytest.raises(PermissionError, match="wrong key"):
        storage.get_fs("optfs://bucket/x", {**A, "key": "key-b"})


def test_s3_options_do_not_outlive_the_call(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    one, _ = storage.get_fs("s3://bucket/key", {"endpoint_url": "http://127.0.0.1:1", "key": "k1", "secret": "s1"})
    two, _ = storage.get_fs("s3://bucket/key", {"endpoint_url": "http://127.0.0.1:2", "key": "k2", "secret": "s2"})
    plain, _ = storage.get_fs("s3://bucket/key")
    assert (one.endpoint_url, one.key) == ("http://127.0.0.1:1", "k1")
    assert (two.endpoint_url, two.key) == ("http://127.0.0.1:2", "k2")
    assert "key" not in plain.storage_options and "endpoint_url" not in plain.storage_options


# ------------------------------------------------------------------------------------ ops pass their options


@pytest.mark.parametrize("fixture", ["trainer", "z0_bf16_ws2", "z0_bf16_ws2_fused", "z1_bf16_ws2", "z3_bf16_ws2",
                                     "pp2_z1_bf16_ws2", "moe_z2_bf16_ws2_ep2", "tp2_z1_bf16_ws2"])
def test_every_reader_reads_with_the_given_options(fixture):
    """open_checkpoint(url, storage_options=...) reads every file (listings, pickles, step scalars, fp32 masters
    the ZeRO-0 reader samples) with the options; the Checkpoint keeps them for the bytes read later."""
    from zckpt.encoding.tensors import Reader

    local = checkpoint_path(FIXTURES / fixture)
    url = f"optfs://bucket/{fixture}/{local.name}"
    _upload(local, url, A)
    ckpt, ref = zckpt.open_checkpoint(url, storage_options=A), zckpt.open_checkpoint(str(local))
    assert ckpt.storage_options == A and "key-a" not in repr(ckpt.location)  # credentials are never shown
    assert [(r.name, r.shape, r.kind, r.dtype) for r in ckpt.records] == \
        [(r.name, r.shape, r.kind, r.dtype) for r in ref.records]
    assert [g.step for g in ckpt.groups] == [g.step for g in ref.groups]
    with Reader(ckpt.storage_options) as remote, Reader() as here:
        for r, q in zip(ckpt.records, ref.records):
            for mine, theirs in ((r.value, q.value), (r.exp_avg, q.exp_avg)):
                n = sum(p.nbytes for p in mine)
                a, b = bytearray(n), bytearray(n)
                remote.read_pieces(mine, memoryview(a))
                here.read_pieces(theirs, memoryview(b))
                assert a == b, r.name
    with pytest.raises(PermissionError):
        zckpt.open_checkpoint(url)  # the same URL without options: refused, nothing was kept
    assert (None, None) not in OptionsFS.seen[:-1]  # every call before that one had its options


def test_universal_checkpoint_reads_with_the_given_options(tmp_path):
    src = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    zckpt.reshard(str(src), str(tmp_path / "u"), world_size=2, fmt="universal")
    _upload(tmp_path / "u", "optfs://bucket/u", B)
    ckpt = zckpt.open_checkpoint("optfs://bucket/u", storage_options=B)
    ref = zckpt.open_checkpoint(str(tmp_path / "u"))
    assert [(r.name, r.shape) for r in ckpt.records] == [(r.name, r.shape) for r in ref.records]
    assert [g.step for g in ckpt.groups] == [g.step for g in ref.groups]


def test_two_merges_with_different_options_in_one_process(tmp_path):
    """Two S3-like sources at the same URL on two endpoints with two keys, merged at the same time in two threads:
    each merge reads its own checkpoint (equal to a local merge of it) and writes its own output."""
    sources = {"a": (checkpoint_path(FIXTURES / "trainer"), A), "b": (checkpoint_path(FIXTURES / "z3_bf16_ws2"), B)}
    url = "optfs://bucket/run/checkpoint-4"
    for local, options in sources.values():
        _upload(local, url, options)
    errors = []

    def run(name):
        local, options = sources[name]
        try:
            zckpt.merge(url, str(tmp_path / f"remote-{name}"), storage_options=options, max_shard_size="100KB")
            zckpt.merge(url, f"optfs://bucket/merged-{name}", storage_options=options)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, (local, options) in sources.items():
        zckpt.merge(str(local), str(tmp_path / f"local-{name}"), max_shard_size="100KB")
        assert _files(tmp_path / f"remote-{name}") == _files(tmp_path / f"local-{name}"), name
        other = B if options is A else A
        assert storage.exists(f"optfs://bucket/merged-{name}/.zckpt.json", options)
        assert not storage.exists(f"optfs://bucket/merged-{name}", other)  # written where its options say only
        assert zckpt.verify(f"optfs://bucket/merged-{name}", storage_options=options).ok
    assert "config.json" in _files(tmp_path / "remote-a")  # the Trainer files came through the options too
    assert (None, None) not in OptionsFS.seen
    with pytest.raises(PermissionError):
        zckpt.merge(url, str(tmp_path / "no-options"))


def test_merge_reads_and_writes_with_their_own_options(tmp_path):
    """A source on endpoint A merged to an output on endpoint B (``output_storage_options``, the CLI's
    ``--output-storage-option``): the output lands on B only, equal to a local merge; without the output options
    the write goes to A."""
    from click.testing import CliRunner

    from zckpt.cli import main

    local = checkpoint_path(FIXTURES / "trainer")
    url = "optfs://bucket/run/checkpoint-4"
    _upload(local, url, A)
    zckpt.merge(url, "optfs://out/api", storage_options=A, output_storage_options=B)
    pairs = [f"{k}={v}" for k, v in B.items()]
    argv = ["merge", url, "-o", "optfs://out/cli", "-q", "--storage-option", f"endpoint_url={A['endpoint_url']}",
            "--storage-option", f"key={A['key']}"]
    for pair in pairs:
        argv += ["--output-storage-option", pair]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    zckpt.merge(str(local), str(tmp_path / "local"))
    want = {n: d for n, d in _files(tmp_path / "local").items() if n != ".zckpt.json"}
    for out in ("optfs://out/api", "optfs://out/cli"):
        assert zckpt.verify(out, storage_options=B).ok
        assert not storage.exists(out, A)
        got = {n: storage.read_bytes(storage.join(out, n), B) for n in want}
        assert got == want, out
    zckpt.merge(url, "optfs://out/same", storage_options=A)  # no output options: the source's
    assert storage.exists("optfs://out/same/.zckpt.json", A) and not storage.exists("optfs://out/same", B)


def test_info_verify_reshard_take_storage_options(tmp_path):
    from zckpt.ops.info import info

    local = checkpoint_path(FIXTURES / "trainer")
    url = "optfs://bucket/t/checkpoint-4"
    _upload(local, url, A)
    assert info(url, storage_options=A)["parameters"] == info(str(local))["parameters"]
    report = zckpt.verify(url, deep=True, storage_options=A)
    assert report.ok and report.bytes_read > 0
    res = zckpt.reshard(url, str(tmp_path / "r"), world_size=1, storage_options=A)
    ref = zckpt.reshard(str(local), str(tmp_path / "r-local"), world_size=1)
    mine, theirs = _files(Path(res.output)), _files(Path(ref.output))
    assert sorted(mine) == sorted(theirs) and any(n.startswith("rng_state") for n in mine)
    for name in mine:  # side files (rng states, scripts, trainer files) copied through A; rank files rebuilt
        same = mine[name] == theirs[name] if "/" not in name else len(mine[name]) == len(theirs[name])
        assert same, name
    assert (None, None) not in OptionsFS.seen
    for call in (lambda: info(url), lambda: zckpt.verify(url),
                 lambda: zckpt.reshard(url, str(tmp_path / "r2"), world_size=1)):
        with pytest.raises((PermissionError, StorageError)):
            call()


def test_op_signatures_document_storage_options():
    import inspect

    from zckpt.backup import push
    from zckpt.ops import estimate, info, merge, reshard, resume, verify

    functions = [merge.merge, merge.iter_tensors, merge.load_state_dict, merge.load_into_module, reshard.reshard,
                 info.info, verify.verify, push.push, resume.load_checkpoint, estimate.counts_from_checkpoint,
                 zckpt.open_checkpoint]
    for f in functions:
        param = inspect.signature(f).parameters.get("storage_options")
        assert param is not None and param.default is None, f.__qualname__
        assert "storage_options" in (f.__doc__ or ""), f.__qualname__


def test_cli_passes_options_to_the_op(tmp_path):
    """``--storage-option`` reaches the op as an argument: the optfs source opens, and nothing stays behind."""
    from click.testing import CliRunner

    from zckpt.cli import main

    local = checkpoint_path(FIXTURES / "z2_bf16_ws2")
    url = f"optfs://bucket/{uuid.uuid4().hex[:8]}"
    _upload(local, url, B)
    opts = ["--storage-option", "endpoint_url=http://server-b", "--storage-option", "key=key-b"]
    for cmd in (["info", url], ["verify", url], ["merge", url, "-o", str(tmp_path / "m")],
                ["reshard", url, "-w", "1", "-o", str(tmp_path / "r")]):
        res = CliRunner().invoke(main, [*cmd, *opts, "-q"])
        assert res.exit_code == 0, (cmd, res.output)
        res = CliRunner().invoke(main, cmd)  # the next command without the options does not inherit them
        assert res.exit_code == 1 and "server-b" not in res.output, (cmd, res.output)
    assert os.path.isfile(tmp_path / "m" / "model.safetensors")
