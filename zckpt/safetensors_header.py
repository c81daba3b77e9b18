"""Reading a safetensors header, once, for every place that checks a file before trusting its offsets.

Format: an 8-byte little-endian header length, then a JSON object ``{name: {dtype, shape, data_offsets}}`` (plus
``__metadata__``), then the tensors' bytes; ``data_offsets`` are relative to the end of the header. (The writing
side is :func:`zckpt.writers.safetensors_stream.build_header`.) No torch, no safetensors import: only the header is
read, and every offset is validated before a caller uses it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .plan import DTYPE_SIZES, DTYPES_BY_SAFETENSORS_CODE

#: a larger header is not a model file (safetensors itself caps it at 100 MB)
MAX_HEADER = 100 * 2**20


class HeaderError(ValueError):
    """The header is missing, unreadable or inconsistent; ``truncated`` when the file ends before its header does."""

    def __init__(self, message: str, *, truncated: bool = False):
        super().__init__(message)
        self.truncated = truncated


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of the file: torch dtype name, shape, and its bytes ``[begin, end)`` after the header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> tuple[int, dict[str, TensorSpan]]:
    """``(byte offset where tensor data starts, {name: TensorSpan})``, every tensor checked: a known dtype, as many
    bytes as its shape needs, inside the file, no two overlapping."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path}: truncated safetensors file (no header)", truncated=True)
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER or 8 + length > size:
            raise HeaderError(f"{path}: safetensors header length {length} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + length
    tensors: dict[str, TensorSpan] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        tensors[key] = _span(path, key, info, size - data_start)
    spans = sorted((t.begin, t.end) for t in tensors.values())
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        if s2 < e1:
            raise HeaderError(f"{path}: tensors overlap in the safetensors header")
    return data_start, tensors


def _span(path: Path, key: str, info, data_bytes: int) -> TensorSpan:
    try:
        begin, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        dtype = DTYPES_BY_SAFETENSORS_CODE.get(info["dtype"])
    except (TypeError, KeyError, ValueError, OverflowError):  # OverflowError: int(Infinity)
        raise HeaderError(f"{path}: tensor {key!r} has a malformed header entry") from None
    if dtype is None or any(d < 0 for d in shape) or begin < 0 or end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise HeaderError(f"{path}: tensor {key!r} has inconsistent dtype/shape/offsets")
    if end > data_bytes:
        raise HeaderError(f"{path}: tensor {key!r} ends {end - data_bytes} bytes past the end of the file: truncated",
                          truncated=True)
    return TensorSpan(dtype, shape, begin, end)
