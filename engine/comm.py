"""The only module that calls torch.distributed.

Process-group setup (:func:`init_distributed`) and the handful of collectives the engine needs, each issued once per
*unit* (a flat bucket of parameters, see :mod:`engine.partition`), never once per parameter:

* :func:`all_reduce_` -- stage 0 gradient averaging, norms, overflow flags;
* :func:`reduce_scatter_` -- stages 1-3 gradients: full flat unit gradient in, this rank's slice out;
* :func:`all_gather_` -- stages 1-3 parameters: this rank's slice in, full flat unit out;
* :func:`broadcast_` -- initial parameters and buffers from rank 0;
* :class:`Pending` -- the handle of a collective issued with ``async_op=True`` (stage 3 prefetch and overlapped
  gradient reduction); its :meth:`Pending.wait` is the only place the engine waits on one. On NCCL the collective
  runs on the process group's internal stream and ``wait()`` makes the *current* stream wait for it (the host does
  not block); on gloo it runs on a gloo worker thread and ``wait()`` blocks the host until the buffers are written.
* :func:`broadcast_json` / :func:`all_gather_json` -- small control messages (checkpoint tag, file hashes) carried as
  uint8 tensors: no pickle, unlike ``broadcast_object_list``.

Backend choice: NCCL with ``device = cuda:LOCAL_RANK`` when CUDA is available, gloo on CPU. Launchers (torchrun,
``accelerate launch``, the ``deepspeed`` launcher) all export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT, so ``env://`` covers them. Without those variables a single process forms a world of size 1 over an
in-memory store.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Who we are: rank, world size, local rank, the compute device and the backend name."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _pick_backend() -> tuple[str, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return "nccl", device
    return "gloo", torch.device("cpu")


def init_distributed(timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the default process group and return the :class:`DistContext`.

    Idempotent: an existing default group (e.g. from ``deepspeed.init_distributed`` or an earlier call) is reused.
    """
    backend, device = _pick_backend()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            kwargs: dict[str, Any] = {"init_method": "env://"}
            if backend == "nccl":
                kwargs["device_id"] = device
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        backend = dist.get_backend()
        if backend == "gloo":
            device = torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), device,
                       backend)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


@torch.no_grad()
def all_reduce_(tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
    """In-place all-reduce (``op`` in sum/max/min) of ``tensor``; a no-op in a world of one.

    With ``async_op`` returns a :class:`Pending` to wait on before reading ``tensor``."""
    work = None
    if world_size() > 1:
        work = dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                           "min": dist.ReduceOp.MIN}[op], async_op=async_op)
    return Pending(work) if async_op else None


class Pending:
    """An in-flight collective (or an already finished one: world of one, ``async_op=False``).

    ``wait()`` is idempotent; the output buffer must not be read, and the input buffer not written or freed, before
    it returns. ``issued`` counts collectives started with this class, for tests and reports.
    """

    __slots__ = ("_work",)
    issued = 0

    def __init__(self, work=None):
        self._work = work
        Pending.issued += 1

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.no_grad()
def reduce_scatter_(out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
    """Sum ``full`` (``world_size * out.numel()`` elements, flat) across ranks; rank r receives slice r in ``out``.

    With ``async_op`` returns a :class:`Pending` to wait on before reading ``out`` or reusing ``full``."""
    if world_size() == 1:
        out.copy_(full)
        return Pending() if async_op else None
    work = _reduce_scatter(out, full, async_op=async_op)
    return Pending(work) if async_op else None


@torch.no_grad()
def all_gather_(full: torch.Tensor, piece: torch.Tensor, async_op: bool = False):
    """Concatenate every rank's ``piece`` into ``full`` (flat, ``world_size * piece.numel()`` elements).

    ``piece`` may be this rank's slice of ``full`` (in place) or a separate tensor (cheaper on gloo: no clone).
    With ``async_op`` returns a :class:`Pending` to wait on before reading ``full``."""
    if world_size() == 1:
        if full.data_ptr() != piece.data_ptr():
            full.copy_(piece)
        return Pending() if async_op else None
    if dist.get_backend() == "gloo":
        # gloo's all_gather_single splits ``full`` into multi-output views on its worker thread (where autograd
        # view checks still apply) and may not support an aliased input: use the list form over narrow slices.
        n = piece.numel()
        outs = [full[r * n:(r + 1) * n] for r in range(world_size())]
        work = dist.all_gather(outs, piece.clone() if _aliases(piece, full) else piece, async_op=async_op)
    else:
        work = _all_gather(full, piece, async_op=async_op)
    return Pending(work) if async_op else None


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr()


@torch.no_grad()
def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    if world_size() > 1:
        dist.broadcast(tensor, src)
    return tensor


def _device_for_control() -> torch.device:
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """Broadcast a JSON-serialisable object from ``src`` (length first, then the UTF-8 bytes)."""
    if world_size() == 1:
        return obj
    device = _device_for_control()
    data = json.dumps(obj).encode() if rank() == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable ``obj``, in rank order (two collectives: lengths, then padded bytes)."""
    if world_size() == 1:
        return [obj]
    device = _device_for_control()
    data = json.dumps(obj).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.zeros(world_size(), dtype=torch.int64, device=device)
    _all_gather(lengths, length)
    longest = int(lengths.max().item())
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = torch.zeros(longest * world_size(), dtype=torch.uint8, device=device)
    _all_gather(out, buf)
    raw = out.cpu().view(world_size(), longest)
    return [json.loads(bytes(raw[r, : int(lengths[r])].tolist()).decode()) for r in range(world_size())]


def any_true(flag: bool, device: torch.device) -> bool:
    """Logical OR of ``flag`` across ranks (one all-reduce): e.g. "some rank saw inf/nan"."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce_(t, "max")
    return bool(t.item() > 0)


def exit_without_finalizing(code: int = 0) -> None:
    """End a finished worker process now, skipping interpreter finalization (for scripts, after
    ``destroy_process_group``).

    On gloo, a worker thread of the process group may still be releasing the last reference to a finished
    collective's tensor; that needs the GIL, and during ``Py_FinalizeEx`` the thread is made to exit, so the C++
    runtime aborts ("terminate called without an active exception", SIGABRT; seen in core dumps as
    ``~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit``). Real DeepSpeed processes hit it too.
    Asynchronous checkpoint saves still writing are joined and output is flushed first; files must be closed by the
    caller.
    """
    import sys

    checkpoint = sys.modules.get("engine.checkpoint")
    if checkpoint is not None:
        checkpoint.join_pending_saves()  # an asynchronous save still writing finishes first
    nvme = sys.modules.get("engine.nvme")
    if nvme is not None:
        nvme.remove_all()  # NVMe offload files (os._exit skips atexit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
