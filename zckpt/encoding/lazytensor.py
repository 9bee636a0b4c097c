"""What :func:`zckpt.encoding.safeload.load` returns for a tensor: a :class:`LazyTensor` (dtype, shape, stride,
element offset) over a :class:`StorageRef` (where its storage's bytes are in the file), and the dtype tables."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

# dtype name -> bytes per element
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
FLOATING = {"float64", "float32", "float16", "bfloat16",
            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple, stride: tuple) -> bool:
    """Row-major contiguity of ``shape`` / ``stride`` (a DCP checkpoint's 10**5 chunks have a few shapes)."""
    expected = 1
    for dim, st in zip(reversed(shape), reversed(stride)):
        if dim != 1 and st != expected:
            return False
        expected *= dim
    return True


@dataclass(frozen=True)
class StorageRef:
    """One storage of a .pt file: where its bytes are (absolute offset in ``path``) and how many."""

    path: str
    key: str
    dtype: str
    offset: int
    nbytes: int
    crc: int | None = field(default=None, compare=False)  # the zip entry's CRC-32 (None: a legacy file has none)

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]


@dataclass
class LazyTensor:
    """A tensor described, not loaded: its storage, element offset, shape, stride and dtype."""

    storage: StorageRef
    storage_offset: int
    shape: tuple
    stride: tuple
    dtype: str
    attrs: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        shape, stride = self.shape, self.stride
        if len(shape) == 1 and len(stride) == 1:  # flat partitions: the common case
            return shape[0] == 1 or stride[0] == 1
        return _contiguous(tuple(shape), tuple(stride))

    @property
    def byte_offset(self) -> int:
        """Absolute file offset of the first element (for contiguous tensors)."""
        return self.storage.offset + self.storage_offset * self.itemsize

    def __repr__(self) -> str:
        return f"LazyTensor({self.dtype}, shape={list(self.shape)}, file={os.path.basename(self.storage.path)})"
