"""Where optimizer state and stage-3 parameter partitions live: device, CPU, or (optimizer state) NVMe files.

* ``offload_optimizer.device = cpu``: fp32 master partition, gradient partition and Adam moments are allocated on
  CPU. Gradients are reduced on the compute device and each unit's piece copied to CPU (stages 0-2 keep it there in
  the reduce dtype until the step, then make the fp32 gradient partition for the step only, see
  :mod:`engine.zero.flat`, stage 3 too); the Adam step runs on CPU (torch's fused AdamW kernel next to a GPU, on
  :func:`engine.optimizer.host_step_threads` threads); updated masters are cast on the host into pinned staging and
  uploaded into the compute-dtype parameters (:class:`Uploader`). On a CPU-only machine this is the default
  placement anyway (foreach kernels there).
* ``offload_optimizer.device = nvme``, **stage 3**: the fp32 masters and both Adam moments live in files
  (:class:`engine.nvme.OptimizerFiles`, ``<nvme_path>/zckpt-engine-rank<r>/optimizer/``); the step streams each
  group through a bounded host buffer in chunks of ``min(sub_group_size, 16M)`` elements (read chunk i+1 / step
  chunk i / write chunk i-1 back, on two I/O threads: 3 slots x 3 fp32 tensors x chunk), with the same torch Adam
  kernel and arguments as the CPU path (bit-identical, tested). Each updated master chunk is cast straight into the
  parameter partition (memory or file). The fp32 gradient partition stays on CPU as with ``cpu``.
  Stages 1/2: as CPU, plus the Adam moments swapped to files between steps (:class:`NvmeStateSwapper`: synchronous,
  whole tensors; DeepSpeed offers NVMe optimizer offload for stage 3 only).
* ``offload_param.device = cpu`` (stage 3): the compute-dtype parameter partitions live on CPU; each gather copies the
  rank's slice to the device, all-gathers there, and the full unit is freed after use.
* ``offload_param.device = nvme`` (stage 3): the compute-dtype partitions live in files
  (:class:`engine.nvme.ParamFiles`, ``.../param/``); nothing of them is kept in memory except ``buffer_count``
  staging buffers of ``max(min(buffer_size, largest partition), largest unit slice)`` elements (pinned on CUDA with ``pin_memory``). The
  units of the next recorded events are read ahead on a background thread; a unit's all-gather is prefetched only
  once its read started at an earlier event. Written back (cast from the masters) after every step.

Files are removed by ``Engine.destroy()`` and at interpreter exit; a stale directory from a killed run is replaced.
Checkpoints read the state back from the files: the same bytes whatever the offload, and a run can resume with
another offload setting. **Not optimised**: plain ``pread``/``pwrite`` through the page cache (no O_DIRECT, no
libaio/io_uring, no GPUDirect Storage), one I/O thread each way, ``max_in_cpu`` and ``pipeline_read/write`` ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def _device_name(sub) -> str:
    if sub is None:
        return "none"
    dev = getattr(sub, "device", None) if not isinstance(sub, dict) else sub.get("device")
    return str(dev or "none").lower()


def _nvme_path(sub) -> str | None:
    if sub is None:
        return None
    return sub.get("nvme_path") if isinstance(sub, dict) else getattr(sub, "nvme_path", None)


@dataclass(frozen=True)
class Placement:
    """Resolved placement of the engine's state."""

    master_device: torch.device  # fp32 masters, gradient partitions, Adam moments
    param_device: torch.device  # stage-3 compute-dtype parameter partitions
    nvme_path: str | None  # set when Adam moments are swapped to files
    pin_memory: bool


def resolve_placement(zero_cfg, compute_device: torch.device) -> Placement:
    """Read ``offload_optimizer`` / ``offload_param`` from the ZeRO config section."""
    opt_sub = getattr(zero_cfg, "offload_optimizer", None)
    par_sub = getattr(zero_cfg, "offload_param", None)
    opt_dev, par_dev = _device_name(opt_sub), _device_name(par_sub)
    cpu = torch.device("cpu")
    master = cpu if opt_dev in ("cpu", "nvme") else compute_device
    param = cpu if par_dev in ("cpu", "nvme") else compute_device
    nvme = None
    if opt_dev == "nvme":
        nvme = _nvme_path(opt_sub)
        if not nvme:
            raise ValueError("zero_optimization.offload_optimizer.device is 'nvme' but nvme_path is not set; "
                             "set offload_optimizer.nvme_path to a writable local directory")
    return Placement(master, param, nvme, compute_device.type == "cuda" and master.type == "cpu")


class HostBuffers:
    """Host buffers the offloaded paths reuse from step to step (pinned when ``pin``), by name.

    Allocating a partition-sized host tensor every step costs a page fault per 4 KiB page (and pinning it, a
    ``cudaHostRegister``); at 1B parameters that alone was a large part of the offloaded step. The buffers are
    returned uninitialised: callers write (or zero) what they read. Host memory held: the largest size asked
    under each name, for the life of the engine.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._bufs[key] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


class Uploader:
    """Copies fp32 host masters into compute-dtype device tensors: the cast runs on the host into a reused pinned
    staging buffer, chunk by chunk, and each chunk's copy to the device is issued without waiting, so the host casts
    chunk k+1 while the device receives chunk k (``copy_`` from pageable fp32 would cast into a temporary and copy
    synchronously). The cast is the same ``.to(dtype)`` rounding as on the device, so values are identical.

    A staging slice is rewritten only after the device has read it: :meth:`begin` waits for the previous round's
    event."""

    CHUNK = 1 << 24  # elements per cast + copy

    def __init__(self, buffers: HostBuffers):
        self.buffers = buffers
        self._done = None  # torch.cuda.Event recorded after the last round's copies
        self._cuda = False

    def begin(self) -> None:
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, key, offset: int, total: int) -> None:
        """``dst.copy_(src)`` for a device ``dst`` and a host fp32 ``src``; ``src`` is the slice at ``offset`` of a
        ``total``-element host tensor named ``key`` (its staging slice is the same range)."""
        stage = self.buffers.get(("upload", key), total, dst.dtype)[offset: offset + src.numel()]
        self._cuda = self._cuda or dst.is_cuda
        for lo in range(0, src.numel(), self.CHUNK):
            hi = min(lo + self.CHUNK, src.numel())
            stage[lo:hi].copy_(src[lo:hi])
            dst[lo:hi].copy_(stage[lo:hi], non_blocking=True)

    def end(self) -> None:
        if self._cuda:
            self._done = torch.cuda.Event()
            self._done.record()


def host_staging(master_device: torch.device, target_device: torch.device) -> tuple[HostBuffers | None,
                                                                                   Uploader | None]:
    """An offloaded optimizer next to a GPU (fp32 masters on the host, ``target_device`` CUDA) reuses pinned host
    buffers for the gradient stores and the upload staging: ``(HostBuffers, Uploader)``; otherwise ``(None, None)``."""
    if master_device.type == "cpu" and target_device.type == "cuda":
        host = HostBuffers(pin=True)
        return host, Uploader(host)
    return None, None


def allocate(numel: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A zeroed fp32 flat buffer; pinned host memory when ``pin`` (CPU offload next to a GPU)."""
    t = torch.zeros(numel, dtype=torch.float32, device=device)
    return t.pin_memory() if pin and device.type == "cpu" else t


class NvmeStateSwapper:
    """Moves an optimizer's tensor state to raw files between steps (one file per group and state key).

    Stages 1/2 only (stage 3 streams masters and moments through :class:`engine.nvme.OptimizerFiles`).
    Files: ``<nvme_path>/zckpt-engine-rank<r>/optimizer/group<g>.<key>.bin``, raw little-endian element bytes (numpy
    ``tofile``; no pickle). While swapped out, each state tensor is replaced by an empty tensor of the same dtype.
    """

    def __init__(self, nvme_path: str, rank: int):
        from engine.nvme import NvmeDir

        self._dir = NvmeDir(nvme_path, rank, "optimizer")  # fresh; removed by cleanup() or at exit
        self.dir = self._dir.path
        self.meta: dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype, torch.device]] = {}
        self.swapped = False

    def _file(self, g: int, key: str) -> Path:
        return self.dir / f"group{g}.{key}.bin"

    def swap_out(self, optimizer: torch.optim.Optimizer) -> None:
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key, t in state.items():
                    if isinstance(t, torch.Tensor) and t.numel() > 1:
                        self.meta[(g, key)] = (tuple(t.shape), t.dtype, t.device)
                        t.detach().cpu().numpy().tofile(self._file(g, key))
                        state[key] = torch.empty(0, dtype=t.dtype, device=t.device)
        self.swapped = True

    def swap_in(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.swapped:
            return
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in list(state.keys()):
                    if (g, key) in self.meta:
                        shape, dtype, device = self.meta[(g, key)]
                        arr = np.fromfile(self._file(g, key), dtype=np.dtype(str(dtype).replace("torch.", "")))
                        state[key] = torch.from_numpy(arr).reshape(shape).to(device)
        self.swapped = False

    def cleanup(self) -> None:
        self._dir.close()
