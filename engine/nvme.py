"""NVMe offload: stage-3 parameter partitions and optimizer state (fp32 masters + Adam moments) kept in files.

Directory: ``<nvme_path>/zckpt-engine-rank<r>/`` (one per rank; a stale one left by a killed run is removed and
re-created at start). Files are raw little-endian element bytes, written with ``os.pwrite`` and read with
``os.preadv`` (both release the GIL, so reads on the background thread overlap compute); no O_DIRECT, no libaio, no
pickle. The directory is removed by :meth:`NvmeDir.close` (engine ``destroy()``, normal end), when the engine is
garbage-collected, at interpreter exit (``weakref.finalize``) and by ``engine.comm.exit_without_finalizing``.

* :class:`ParamFiles` (``offload_param.device = nvme``): ``param.group<g>.bin`` holds group ``g``'s compute-dtype
  partition. Units are read into a pool of ``buffer_count`` staging buffers of ``max(buffer_size, largest unit slice)``
  elements (pinned when ``pin_memory`` and CUDA), ahead of use by one background thread; a unit needed before its
  read-ahead was issued is read synchronously straight into its gather buffer (CPU) or one extra staging buffer.
* :class:`OptimizerFiles` (``offload_optimizer.device = nvme``, stage 3): ``optim.group<g>.<key>.bin`` for ``key`` in
  ``fp32_partition``, ``exp_avg``, ``exp_avg_sq``. :meth:`OptimizerFiles.stream` walks a group in chunks of
  ``chunk_numel`` elements: chunk i+1 is read on a reader thread while chunk i is stepped and chunk i-1 written back on
  a writer thread (3 rotating slots x 3 tensors x ``chunk_numel`` fp32 on the host, nothing else).
"""

from __future__ import annotations

import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

STATE_KEYS = ("fp32_partition", "exp_avg", "exp_avg_sq")
DEFAULT_CHUNK = 1 << 24  # elements per optimizer chunk when sub_group_size is not smaller


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU tensor ``out`` from ``fd`` at byte ``offset`` (loops over short reads)."""
    view, done = _bytes(out), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read from NVMe swap file at byte {offset + done}")
        done += n


def pwrite_from(fd: int, src: torch.Tensor, offset: int) -> None:
    view, done = _bytes(src.contiguous()), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class NvmeDir:
    """``<nvme_path>/zckpt-engine-rank<r>/``: created fresh (a stale one is removed first), removed on close/exit."""

    def __init__(self, nvme_path: str, rank: int, name: str):
        root = Path(nvme_path) / f"zckpt-engine-rank{rank}"
        path, n = root / name, 1
        while path in _LIVE:  # another engine of this process uses it (tests build several engines)
            n += 1
            path = root / f"{name}.{n}"
        if path.exists():  # left by a killed run: its files are meaningless now
            shutil.rmtree(path)
        path.mkdir(parents=True)
        self.path = path
        self.fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, self.path, self.fds)  # also runs at interpreter exit
        _LIVE[path] = self._finalizer

    def open(self, fname: str, nbytes: int) -> int:
        fd = os.open(self.path / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, nbytes)  # sparse: reads of never-written bytes give zeros
        self.fds[fname] = fd
        return fd

    def close(self) -> None:
        self._finalizer()


_LIVE: dict = {}  # path -> finalizer of every NvmeDir of this process still in use


def remove_all() -> None:
    """Remove every NVMe offload directory of this process (``engine.comm.exit_without_finalizing`` calls it: that
    exit skips ``atexit``)."""
    for finalizer in list(_LIVE.values()):
        finalizer()


def _remove(path: Path, fds: dict) -> None:
    _LIVE.pop(path, None)
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()  # the rank directory, once param and optimizer files are both gone
    except OSError:
        pass


class ParamFiles:
    """Stage-3 compute-dtype parameter partitions in files, with a bounded read-ahead staging pool."""

    def __init__(self, nvme_path: str, rank: int, group_numel: list[int], dtype: torch.dtype, *,
                 buffer_count: int, buffer_numel: int, pin: bool):
        self.dir = NvmeDir(nvme_path, rank, "param")
        self.dtype, self.esize = dtype, torch.empty(0, dtype=dtype).element_size()
        self.fds = [self.dir.open(f"param.group{g}.bin", n * self.esize) for g, n in enumerate(group_numel)]
        self.buffer_numel = buffer_numel
        self.pool = [self._buffer(pin) for _ in range(max(1, buffer_count))]
        self.spare = self._buffer(pin) if pin else None  # synchronous reads bound for a device
        self.staged: dict[int, tuple[Future, torch.Tensor]] = {}  # unit -> (read, staging buffer)
        self.tags: dict[int, int] = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="zckpt-nvme-param")
        self.stats = {"reads": 0, "read_ahead_hits": 0, "writes": 0}

    def _buffer(self, pin: bool) -> torch.Tensor:
        return torch.empty(self.buffer_numel, dtype=self.dtype, pin_memory=pin)

    def staging_bytes(self) -> int:
        """Host bytes of the staging buffers (fixed at start: the whole in-memory footprint of the params)."""
        return (len(self.pool) + len(self.staged) + (self.spare is not None)) * self.buffer_numel * self.esize

    def read_ahead(self, unit_id: int, group: int, offset: int, numel: int, tag: int = 0) -> bool:
        """Start reading a unit's slice on the background thread; False when no staging buffer is free. ``tag``
        (the caller's event counter) is kept in ``tags`` so the caller can tell reads started earlier."""
        if unit_id in self.staged:
            return True
        if not self.pool or numel > self.buffer_numel:
            return False
        buf = self.pool.pop()[:numel]
        fut = self.reader.submit(pread_into, self.fds[group], buf, offset * self.esize)
        self.staged[unit_id] = (fut, buf)
        self.tags[unit_id] = tag
        return True

    def read_into(self, unit_id: int, group: int, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (CPU or device) with a unit's slice: from its read-ahead if issued, else read now."""
        self.stats["reads"] += 1
        entry = self.staged.pop(unit_id, None)
        if entry is not None:
            fut, buf = entry
            fut.result()
            out.copy_(buf, non_blocking=False)
            self.pool.append(buf._base if buf._base is not None else buf)
            self.stats["read_ahead_hits"] += 1
            return
        if out.device.type == "cpu" and out.is_contiguous():
            pread_into(self.fds[group], out, offset * self.esize)
            return
        tmp = (self.spare if self.spare is not None and out.numel() <= self.buffer_numel
               else torch.empty(out.numel(), dtype=self.dtype))[:out.numel()]
        pread_into(self.fds[group], tmp, offset * self.esize)
        out.copy_(tmp)

    def drop_staged(self) -> None:
        """Forget every read-ahead (the files are about to change): wait for the reads, return the buffers."""
        for fut, buf in self.staged.values():
            fut.result()
            self.pool.append(buf._base if buf._base is not None else buf)
        self.staged.clear()

    def write(self, group: int, offset: int, src: torch.Tensor) -> None:
        """Write ``src`` (any dtype/device; cast to the compute dtype in ``buffer_numel`` pieces) at ``offset``."""
        self.stats["writes"] += 1
        src = src.reshape(-1)
        for start in range(0, src.numel(), self.buffer_numel):
            piece = src[start: start + self.buffer_numel]
            host = piece.to(device="cpu", dtype=self.dtype)
            pwrite_from(self.fds[group], host, (offset + start) * self.esize)

    def read(self, group: int, offset: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=self.dtype)
        pread_into(self.fds[group], out, offset * self.esize)
        return out

    def close(self) -> None:
        self.drop_staged()
        self.reader.shutdown(wait=True)
        self.dir.close()


class OptimizerFiles:
    """fp32 masters and Adam moments of each group in files; streamed through the step in chunks."""

    def __init__(self, nvme_path: str, rank: int, group_numel: list[int], chunk_numel: int):
        self.dir = NvmeDir(nvme_path, rank, "optimizer")
        self.numel = list(group_numel)
        self.chunk = max(1, min(int(chunk_numel), max(group_numel or [1])))
        self.fds = [{k: self.dir.open(f"optim.group{g}.{k}.bin", n * 4) for k in STATE_KEYS}
                    for g, n in enumerate(group_numel)]
        self.slots = [{k: torch.empty(self.chunk, dtype=torch.float32) for k in STATE_KEYS} for _ in range(3)]
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="zckpt-nvme-optim-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="zckpt-nvme-optim-write")

    def host_bytes(self) -> int:
        return 3 * len(STATE_KEYS) * self.chunk * 4

    # -- whole tensors (init, checkpoints) ------------------------------------------------------------------------
    def write(self, g: int, key: str, src: torch.Tensor, offset: int = 0) -> None:
        src = src.detach().reshape(-1)
        for start in range(0, src.numel(), self.chunk):
            pwrite_from(self.fds[g][key], src[start: start + self.chunk].to("cpu", torch.float32),
                        (offset + start) * 4)

    def read(self, g: int, key: str) -> torch.Tensor:
        out = torch.empty(self.numel[g], dtype=torch.float32)
        pread_into(self.fds[g][key], out, 0)
        return out

    def chunks(self, g: int, key: str = "fp32_partition"):
        """``(offset, tensor)`` pieces of one file, one chunk buffer reused (synchronous; loads and casts)."""
        buf = torch.empty(self.chunk, dtype=torch.float32)
        for off in range(0, self.numel[g], self.chunk):
            piece = buf[: min(self.chunk, self.numel[g] - off)]
            pread_into(self.fds[g][key], piece, off * 4)
            yield off, piece

    # -- the streamed step ----------------------------------------------------------------------------------------
    def _read(self, g: int, off: int, slot: dict) -> dict:
        n = min(self.chunk, self.numel[g] - off)
        views = {k: slot[k][:n] for k in STATE_KEYS}
        for k in STATE_KEYS:
            pread_into(self.fds[g][k], views[k], off * 4)
        return views

    def _write(self, g: int, off: int, views: dict) -> None:
        for k in STATE_KEYS:
            pwrite_from(self.fds[g][k], views[k], off * 4)

    def stream(self, g: int, fn) -> None:
        """Call ``fn(offset, {key: chunk})`` on every chunk of group ``g`` in order; chunks are written back after
        ``fn`` (which updates them in place). Read of i+1 and write of i-1 overlap ``fn`` on chunk i."""
        offsets = list(range(0, self.numel[g], self.chunk))
        writes: list[Future | None] = [None, None, None]
        nxt = self.reader.submit(self._read, g, offsets[0], self.slots[0]) if offsets else None
        for i, off in enumerate(offsets):
            views = nxt.result()
            if i + 1 < len(offsets):
                s = (i + 1) % 3
                if writes[s] is not None:  # chunk i-2's write-back still owns that slot
                    writes[s].result()
                nxt = self.reader.submit(self._read, g, offsets[i + 1], self.slots[s])
            fn(off, views)
            writes[i % 3] = self.writer.submit(self._write, g, off, views)
        for w in writes:
            if w is not None:
                w.result()

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        self.dir.close()
