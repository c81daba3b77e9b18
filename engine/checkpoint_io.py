"""Writing a rank's checkpoint files at disk speed: one pass over the bytes, hashed while written.

A rank's files are safetensors files whose header is known before any byte (names, dtypes, shapes), so each file is
written sequentially: the header, then every tensor's bytes in order, in chunks of ``CHUNK_BYTES``. Per chunk:

* **device -> host**: a CPU tensor's bytes are written straight from its storage (no copy); a CUDA tensor's chunk
  is copied into one of two pinned staging buffers on a side stream while the previous chunk goes to disk, so the
  copy and the write overlap and host memory holds two chunks, never the tensor;
* **hash and write overlap**: sha256 runs on a worker thread, in order, while the caller's thread writes the same
  chunk (both release the GIL); the file is never read back to be hashed;
* written pages are dropped from the page cache (``POSIX_FADV_DONTNEED``: the checkpoint is not read back), and the
  file is fsynced once, at the end.

:class:`Snapshot` is the asynchronous save's copy of a rank's tensors in host memory (pinned for CUDA tensors),
reused from one save to the next: its memory is one copy of the rank's checkpoint bytes, allocated at the first
asynchronous save and kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint_format import HashingWriter
from zckpt.writers.safetensors_stream import Entry, build_header

#: bytes per write / per staged device copy; two such pinned buffers per CUDA file write
CHUNK_BYTES = 64 << 20


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class _DeviceStager:
    """Two pinned host buffers and a side stream: chunk i+1 is copied while chunk i is written."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def chunks(self, flat: torch.Tensor):
        spans = [(a, min(a + CHUNK_BYTES, flat.numel())) for a in range(0, flat.numel(), CHUNK_BYTES)]
        self.stream.wait_stream(torch.cuda.current_stream(flat.device))

        def start(i: int) -> None:
            a, b = spans[i]
            with torch.cuda.stream(self.stream):
                self.buffers[i % 2][: b - a].copy_(flat[a:b], non_blocking=True)
                self.events[i % 2].record(self.stream)

        if spans:
            start(0)
        for i, (a, b) in enumerate(spans):
            if i + 1 < len(spans):
                start(i + 1)  # its buffer was released when chunk i-1's write returned
            self.events[i % 2].synchronize()
            yield self.buffers[i % 2][: b - a].numpy()
        flat.record_stream(self.stream)


def _chunks(flat: torch.Tensor, stager: _DeviceStager | None):
    if flat.device.type == "cuda":
        yield from stager.chunks(flat)
        return
    flat = flat.cpu()
    array = flat.numpy()
    for a in range(0, len(array), CHUNK_BYTES):
        yield array[a:a + CHUNK_BYTES]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write ``tensors`` as a safetensors file (same bytes as ``safetensors.torch.save_file`` up to the header's key
    order) in one pass, fsynced; return ``(size, sha256)``."""
    entries = [Entry(name, _dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    stager = None
    if any(t.device.type == "cuda" for t in tensors.values()):
        stager = _DeviceStager(next(t.device for t in tensors.values() if t.device.type == "cuda"))
    out = HashingWriter(path)
    try:
        out.write(build_header(entries, metadata))
        for tensor in tensors.values():
            for chunk in _chunks(_flat_bytes(tensor), stager):
                out.write(chunk)
    except BaseException:
        out.abort()
        raise
    return out.size, out.close()


class Snapshot:
    """Host copies of a rank's checkpoint tensors for an asynchronous save, reused across saves.

    ``take`` copies every tensor into a host buffer of the same name, shape and dtype (pinned when the source is on
    a CUDA device, so the copies run at full speed and overlap), allocating buffers only the first time or when a
    shape changes. The copies are complete when ``take`` returns: training may then change the sources."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        used = set()
        for file_key, tensors in groups.items():
            out[file_key] = {}
            for name, src in tensors.items():
                key = f"{file_key}/{name}"
                used.add(key)
                buf = self._buffers.get(key)
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type == "cuda")
                    self._buffers[key] = buf
                buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
                out[file_key][name] = buf
        for key in set(self._buffers) - used:
            del self._buffers[key]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return out
