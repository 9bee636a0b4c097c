"""The resume reader's own parts (zckpt.ops.resume.Materializer): large pieces read in chunks by every thread and
still CRC-checked as whole entries, tensors backed by huge-page maps, and what ZCKPT_HUGEPAGES=0 turns off. The
engine-level oracle (DeepSpeed's state after zckpt.deepspeed.load_checkpoint) is tests/test_resume.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zckpt.engine.checked import InputCheck, zip_entries  # noqa: E402
from zckpt.engine.segments import Piece  # noqa: E402
from zckpt.engine.torchzip import TensorOut  # noqa: E402
from zckpt.errors import CorruptFile  # noqa: E402
from zckpt.ops import resume  # noqa: E402


def _saved(tmp_path, n=300_000):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(n, generator=g)
    path = tmp_path / "x.pt"
    torch.save({"t": t}, path)
    (entry,) = [e for e in zip_entries(str(path)) if e.name.endswith("data/0")]
    return str(path), entry, t


@pytest.mark.parametrize("workers", [1, 4])
def test_chunked_reads_are_the_tensor_and_are_checked(tmp_path, monkeypatch, workers):
    path, e, t = _saved(tmp_path)
    monkeypatch.setattr(resume, "READ_CHUNK", 64 << 10)  # ~19 reads of the 1.2 MB piece
    jobs = list(resume._chunks(Piece(path, e.data_offset, t.numel(), "float32"), 0, 0))
    assert len(jobs) == -(-t.numel() * 4 // (64 << 10)) and sum(j[0].nbytes for j in jobs) == t.numel() * 4
    assert all(j[2] == j[0].offset - e.data_offset for j in jobs)
    check = InputCheck()
    mat = resume.Materializer(workers, check=check)
    # two outputs over the same bytes: the second is copied from the first, not read again
    a, b = (TensorOut("float32", (t.numel(),), [Piece(path, e.data_offset, t.numel(), "float32")]) for _ in range(2))
    got = mat.fill([a, b])
    check.finish()
    mat.close()
    assert torch.equal(got[0], t) and torch.equal(got[1], t)
    assert mat.bytes_read == t.numel() * 4 and check.checked == 1 and check.unchecked == 0


def test_a_flipped_byte_in_one_chunk_is_refused(tmp_path, monkeypatch):
    path, e, t = _saved(tmp_path)
    with open(path, "r+b") as f:  # one byte in the middle of the 10th chunk
        f.seek(e.data_offset + 9 * (64 << 10) + 77)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    monkeypatch.setattr(resume, "READ_CHUNK", 64 << 10)
    check = InputCheck()
    mat = resume.Materializer(4, check=check)
    mat.fill([TensorOut("float32", (t.numel(),), [Piece(path, e.data_offset, t.numel(), "float32")])])
    mat.close()
    with pytest.raises(CorruptFile, match="data/0.*CRC-32"):
        check.finish()


def _vmflags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_huge_tensors_are_maps_advised_huge_pages(monkeypatch):
    monkeypatch.setattr(resume, "HUGE_BYTES", 1 << 20)
    small = resume._empty(1000, torch.float32)
    big = resume._empty(1 << 20, torch.bfloat16)  # 2 MiB
    assert small.numel() == 1000 and big.numel() == 1 << 20 and big.dtype == torch.bfloat16
    assert "hg" in _vmflags(big.data_ptr())  # MADV_HUGEPAGE
    big.fill_(1.5)
    big[7] = 3.0
    assert big[7].item() == 3.0 and big[:7].eq(1.5).all() and big[8:].eq(1.5).all()
    monkeypatch.setenv("ZCKPT_HUGEPAGES", "0")

    def no_map(*a, **k):
        raise AssertionError("mapped with ZCKPT_HUGEPAGES=0")

    monkeypatch.setattr(resume.mmap, "mmap", no_map)
    assert resume._empty(1 << 20, torch.bfloat16).numel() == 1 << 20  # torch.empty


def test_map_backed_tensor_works_as_deepspeed_uses_its_moments(monkeypatch, tmp_path):
    """What DeepSpeed does with the optimizer moments it keeps: in-place updates, torch.save, and the map lives as
    long as the tensor (a view outliving its base)."""
    monkeypatch.setattr(resume, "HUGE_BYTES", 1 << 20)
    m = resume._empty(1 << 18, torch.float32)
    view = m[10:20]
    m.zero_().add_(2.0).mul_(0.5)
    torch.save({"exp_avg": m}, tmp_path / "s.pt")
    del m
    import gc
    gc.collect()
    assert view.eq(1.0).all()
    assert torch.load(tmp_path / "s.pt")["exp_avg"].eq(1.0).all()
