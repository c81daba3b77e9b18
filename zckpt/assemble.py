"""Turn :class:`~zckpt.plan.TensorPlan` s into torch tensors: positioned reads, then one cast.

Each tensor is assembled in a fresh buffer by ``os.preadv`` straight into its final place (no intermediate copies,
no mmap — mapped pages would count toward RSS), then cast with ``Tensor.copy_`` into the output dtype, which is what
``Tensor.to(dtype)`` does. Tensors are prepared by a small thread pool (reads and casts release the GIL) with a
bounded window of bytes in flight, and handed out strictly in plan order.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import torch

from .errors import CheckpointIncompleteError, InvalidArgumentError
from .plan import TensorPlan

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"fp32": "float32", "float": "float32", "f32": "float32", "fp16": "float16", "half": "float16",
            "f16": "float16", "bf16": "bfloat16", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def parse_dtype(value: "str | torch.dtype | None") -> "torch.dtype | None":
    """'bf16' | 'fp16' | 'fp32' | torch dtype | None (keep as stored) -> torch dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = _ALIASES.get(str(value).lower().removeprefix("torch."))
    if name is None:
        raise InvalidArgumentError(f"unknown dtype {value!r}; use bf16, fp16 or fp32")
    return DTYPES[name]


class FileCache:
    """Open file descriptors shared by reader threads (pread is position-free, so sharing is safe)."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy, no numpy). Keep ``tensor`` alive while used."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_tensor(plan: TensorPlan, files: FileCache) -> torch.Tensor:
    """The tensor at its stored dtype, assembled from its fragments straight into its own (uninitialised) memory."""
    dtype = DTYPES[plan.dtype]
    tensor = torch.empty(plan.shape, dtype=dtype)
    itemsize = tensor.element_size()
    view = byte_view(tensor)
    for frag in plan.fragments:
        start = frag.dest * itemsize
        want = frag.numel * itemsize
        got = 0
        fd = files.fd(frag.path)
        while got < want:
            n = os.preadv(fd, [view[start + got:start + want]], frag.offset + got)
            if n == 0:
                raise CheckpointIncompleteError(f"{frag.path} is truncated: {plan.name} needs bytes up to "
                                                f"{frag.offset + want}; re-save the checkpoint")
            got += n
    return tensor


def cast(tensor: torch.Tensor, dtype: "torch.dtype | None") -> torch.Tensor:
    """Floating tensors to ``dtype`` exactly as ``tensor.to(dtype)``; other tensors unchanged."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def iter_assembled(
    tensors: Iterable[TensorPlan],
    transform: Callable[[TensorPlan, torch.Tensor], object],
    *,
    workers: int = 4,
    window_bytes: int = 256 * 2**20,
) -> Iterator[tuple[TensorPlan, object]]:
    """Yield ``(plan, transform(plan, tensor))`` in order, preparing up to ``window_bytes`` ahead in threads."""
    files = FileCache()
    pending: deque[tuple[TensorPlan, Future]] = deque()
    in_flight = 0
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="zckpt-read") as pool:
            for plan in tensors:
                while pending and in_flight + plan.nbytes > window_bytes:
                    done_plan, fut = pending.popleft()
                    in_flight -= done_plan.nbytes
                    yield done_plan, fut.result()
                pending.append((plan, pool.submit(lambda p=plan: transform(p, read_tensor(p, files)))))
                in_flight += plan.nbytes
            while pending:
                done_plan, fut = pending.popleft()
                yield done_plan, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()
        files.close()


def default_workers() -> int:
    return max(2, min(8, (os.cpu_count() or 2)))
