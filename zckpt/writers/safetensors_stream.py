"""Write a safetensors file one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape, data_offsets}}`` plus
``__metadata__``), padded with spaces to a multiple of 8, then the tensors' bytes back to back. Since a plan knows
every name, shape and dtype up front, the header is written first and each tensor's bytes follow as they are
produced: memory holds one tensor, never the whole file (``safetensors.torch.save_file`` needs them all at once).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def build_header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> memoryview:
    """The raw little-endian bytes of ``tensor`` cast to ``dtype`` (as ``Tensor.to`` casts), without numpy.

    The cast is one ``copy_`` into a buffer we own, so the bytes cost a single pass over the tensor.
    """
    dtype = dtype or tensor.dtype
    if tensor.numel() == 0:
        return memoryview(b"")
    out = bytearray(tensor.numel() * torch.empty((), dtype=dtype).element_size())
    torch.frombuffer(out, dtype=dtype).view(tensor.shape).copy_(tensor)
    return memoryview(out)


class StreamingWriter:
    """Writes ``entries`` in order to ``fh``; call :meth:`write` once per entry with the matching tensor."""

    def __init__(self, fh: BinaryIO, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self._fh = fh
        self._entries = entries
        self._next = 0
        fh.write(build_header(entries, metadata))

    def write(self, name: str, data: memoryview) -> int:
        """Append the bytes of the next entry (see :func:`tensor_bytes`)."""
        entry = self._entries[self._next]
        if name != entry.name or len(data) != entry.nbytes:
            raise RuntimeError(f"internal: expected {entry} next, got {name} with {len(data)} bytes")
        self._next += 1
        self._fh.write(data)
        return len(data)

    def close(self) -> None:
        if self._next != len(self._entries):
            raise RuntimeError(f"internal: {len(self._entries) - self._next} tensors were not written")
