"""Assemble tensors from :class:`~zckpt.plan.TensorPlan` fragments with positioned reads. No torch here.

Each tensor's bytes are read by ``os.preadv`` straight into their final place in a buffer the caller provides (no
intermediate copies, no mmap — mapped pages would count toward RSS). Tensors are prepared by a small thread pool
(``preadv`` and the casts release the GIL) with a bounded window of bytes in flight, and handed out in plan order.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

from .errors import CheckpointIncompleteError, InvalidArgumentError
from .plan import DTYPE_SIZES, TensorPlan

T = TypeVar("T")

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "f32": "float32", "float32": "float32",
                  "fp16": "float16", "half": "float16", "f16": "float16", "float16": "float16",
                  "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_dtype(value: object) -> str | None:
    """'bf16' | 'fp16' | 'fp32' | a torch dtype | None (keep as stored) -> canonical name ('bfloat16', ...)."""
    if value is None:
        return None
    name = _DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
    if name is None:
        raise InvalidArgumentError(f"unknown dtype {value!r}; use bf16, fp16 or fp32")
    return name


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


def read_into(plan: TensorPlan, files: FileCache, view: memoryview) -> None:
    """Fill ``view`` (``plan.nbytes`` writable bytes) with the tensor at its stored dtype."""
    read_range(plan, files, 0, plan.numel, view)


def read_range(plan: TensorPlan, files: FileCache, start: int, count: int, view: memoryview) -> None:
    """Fill ``view`` with elements ``[start, start + count)`` of the tensor (row-major), at its stored dtype."""
    itemsize = DTYPE_SIZES[plan.dtype]
    end = start + count
    for frag in plan.fragments:
        lo, hi = max(start, frag.dest), min(end, frag.dest + frag.numel)
        if lo >= hi:
            continue
        dst, want, got = (lo - start) * itemsize, (hi - lo) * itemsize, 0
        src = frag.offset + (lo - frag.dest) * itemsize
        fd = files.fd(frag.path)
        while got < want:
            n = os.preadv(fd, [view[dst + got:dst + want]], src + got)
            if n == 0:
                raise CheckpointIncompleteError(f"{frag.path} is truncated: {plan.name} needs bytes up to "
                                                f"{src + want}; re-save the checkpoint")
            got += n


def iter_assembled(
    tensors: Iterable[TensorPlan],
    job: Callable[[TensorPlan, FileCache], T],
    *,
    workers: int = 4,
    window_bytes: int = 256 * 2**20,
) -> Iterator[tuple[TensorPlan, T]]:
    """Yield ``(plan, job(plan, files))`` in plan order, running up to ``window_bytes`` of jobs ahead in threads."""
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
                pending.append((plan, pool.submit(job, plan, files)))
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
