"""Stages 0-2: full parameters on every rank, as views into one flat compute-dtype buffer per unit (bucket).

Memory layout (see :mod:`engine.partition`): unit ``u`` has a flat buffer ``full[u]`` of ``padded_numel`` elements on
the compute device; every trainable parameter's ``.data`` is a view into it. Rank ``r`` owns slice
``full[u][r*S:(r+1)*S]`` whose fp32 master copy sits at ``unit.partition_offset`` of the rank's flat master partition.

Communication phases per optimizer step
---------------------------------------
1. init: one broadcast per unit from rank 0 (all ranks start from rank 0's weights).
2. backward, gradient reduction, one collective per unit:
   * stage 0 (DDP): ``param.grad`` are plain autograd tensors (micro-steps accumulate into them in place); at the
     accumulation boundary each unit is packed straight into the gradient store and all-reduced in place there.
   * stage 1: same gradients; at the boundary each unit is packed, reduce-scattered into the rank's slice of the
     store, and its ``param.grad`` freed.
   * stage 2: a post-accumulate-grad hook counts each unit's gradients; once all arrived (during backward) they are
     packed (each ``param.grad`` freed as soon as it is copied), reduce-scattered into the store. Units not
     completed by the end of backward (unused parameters) are flushed in unit order by :meth:`after_backward`.
3. after the optimizer step: the rank's updated fp32 slice is cast into its slice of ``full[u]`` and all-gathered
   (one all-gather per unit; none for stage 0, whose "partition" is the whole model). Stages 1/2 with
   ``overlap_comm`` overlap these with the step (:meth:`FlatParamManager.step_buckets`): units are grouped into
   buckets of at most ``allgather_bucket_size`` elements in unit order; the optimizer steps one bucket's master
   slices, then they are cast and the bucket's all-gathers issued asynchronously, and the next bucket is stepped
   while they run (on NCCL on the communication stream, beside the step's kernels; on gloo on its worker thread). The
   handles go through the shared :class:`~engine.zero.collectives.CollectiveQueue` (oldest waited once more than a
   bucket's worth is in flight), and :meth:`FlatParamManager.update_params` waits for the rest before the step
   returns -- nothing is left in flight into the next forward, so parameters are plain tensors again when the user
   sees them. The granule is the unit (a reduce bucket): with ``reduce_bucket_size`` as large as half the model
   there are two units and at most half the all-gather time can hide. Same bytes either way (Adam is elementwise,
   an all-gather moves bytes); ``ENGINE_STEP_ALLGATHER_OVERLAP=0`` turns it off for A/B measurements.
Gradient sums are divided by the data-parallel world size later, once, by the optimizer.

Gradient memory (nothing gradient-sized outlives a step)
--------------------------------------------------------
``P`` = elements of the rank's partition (the whole padded model for stage 0), ``B`` = a unit's padded numel.

* pack buffer: ``B`` elements of the reduce dtype, alive only around one unit's collective (stage 0 with a 16-bit
  store packs into the store itself: no pack buffer).
* :class:`GradStore`, one per optimizer group, created at the window's first reduction and dropped after the step:
  - ``low``: when the reduce dtype is 16-bit, a 16-bit partition (2P bytes); the collective writes each unit's
    slice directly, once. :meth:`FlatParamManager.grad_partitions` turns it into fp32 at step time.
  - ``acc``: an fp32 accumulator (4P bytes, zero-initialised; pieces are added). Used when the reduce dtype is fp32,
    and when a unit's slice is reduced a second time in one window: stage 2 with gradient accumulation widens
    ``low`` into ``acc`` at the end of every non-boundary backward (no activations are alive then), so micro-steps
    still accumulate in fp32.

Exactness: every fp32 gradient element handed to the optimizer is ``((0 + p1) + p2) + ...`` in fp32, ``p_k`` being
the collective's output in the reduce dtype -- the same operations, in the same order, as a persistent fp32
gradient partition that is zeroed after each step and has every piece added into it. ``low`` holds ``p1`` exactly
(same dtype) and is converted as ``zeros(fp32).add_(low)`` (``0 + p1``, which also turns ``-0`` into ``+0``).
"""

from __future__ import annotations

import functools
import weakref

import torch

from engine import comm
from engine.offload import HostBuffers, host_staging
from engine.optimizer import StepBucket
from engine.partition import PartitionTable, Unit
from engine.zero.collectives import CollectiveQueue, step_overlap_enabled


def pack_unit_grads(unit: Unit, params: list, out: torch.Tensor) -> None:
    """Copy the unit's gradients (``None`` = zero) into ``out`` (``padded_numel`` elements), freeing each
    ``param.grad`` as soon as it is copied; the padding is zeroed (no full memset). Shared by stages 0-2 and 3."""
    out[unit.numel:].zero_()
    for slot in unit.params:
        p, dst = params[slot.index], out[slot.offset: slot.offset + slot.numel]
        if p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.reshape(-1))
            p.grad = None


class GradStore:
    """One optimizer group's reduced gradient partition for the current accumulation window (see module doc)."""

    def __init__(self, numel: int, device: torch.device, reduce_dtype: torch.dtype,
                 host: HostBuffers | None = None, key=0):
        self.numel, self.device, self.reduce_dtype = numel, device, reduce_dtype
        self.low: torch.Tensor | None = None  # reduce dtype (16-bit); each unit's slice written once
        self.acc: torch.Tensor | None = None  # fp32 accumulator
        self.written: set[int] = set()  # units whose slice of ``low`` holds a piece
        # offloaded store (``host``): ``low``/``acc`` are reused host buffers, left uninitialised; the slices of
        # ``low`` no piece wrote are zeroed when it is widened. Device pieces are copied into pinned ``low`` without
        # waiting; ``_copied`` is the event to wait for before the host reads it.
        self.host, self.key = host, key
        self.ranges: list[tuple[int, int]] = []
        self._copied = None

    def _buffer(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        if self.host is None:
            return torch.zeros(self.numel, dtype=dtype, device=self.device)
        buf = self.host.get((kind, self.key), self.numel, dtype)
        return buf if kind == "low" else buf.zero_()

    def direct_slice(self, unit: Unit, compute_device: torch.device) -> torch.Tensor | None:
        """The slice a collective may write the unit's piece into (first piece of a 16-bit store on the compute
        device), marking it written; ``None`` when the piece must go through :meth:`add` instead."""
        if self.reduce_dtype == torch.float32 or self.acc is not None or unit.index in self.written:
            return None
        if self.device != compute_device:
            return None
        if self.low is None:
            self.low = torch.zeros(self.numel, dtype=self.reduce_dtype, device=self.device)
        self.written.add(unit.index)
        return self.low[unit.partition_offset: unit.partition_offset + unit.slice_numel]

    def add(self, unit: Unit, piece: torch.Tensor) -> None:
        """Store the unit's reduced piece (reduce dtype, any device): copied into ``low`` if that is its first piece
        there, else added into the fp32 accumulator (which is created, or widened from ``low``, on demand)."""
        lo, hi = unit.partition_offset, unit.partition_offset + unit.slice_numel
        if self.reduce_dtype != torch.float32 and self.acc is None and unit.index not in self.written:
            if self.low is None:
                self.low = self._buffer("low", self.reduce_dtype)
            if self.host is not None and piece.is_cuda and self.host.pin:
                self.low[lo:hi].copy_(piece, non_blocking=True)  # the host reads it after widen() waits
                self._copied = torch.cuda.Event()
                self._copied.record()
            else:
                self.low[lo:hi].copy_(piece)
            self.ranges.append((lo, hi))
            self.written.add(unit.index)
            return
        self.widen()
        self.acc[lo:hi].add_(piece.to(self.device))

    def widen(self) -> None:
        """Switch to the fp32 accumulator: ``acc = 0 + low`` (exact), ``low`` freed."""
        if self.acc is not None:
            return
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self.host is not None and self.low is not None:
            self._zero_unwritten()
            self.acc = self.host.get(("acc", self.key), self.numel, torch.float32)
            self.acc.copy_(self.low)  # exact widening; + 0.0 turns -0 into +0 as 0 + low does below (torch.add
            self.acc.add_(0.0)  # with a bf16 input and an fp32 out= takes a slow path: 4x these two passes)
            self.low = None
        else:
            self.acc = self._buffer("acc", torch.float32)
            if self.low is not None:
                self.acc.add_(self.low)
                self.low = None
        self.written.clear()
        self.ranges.clear()

    def _zero_unwritten(self) -> None:
        at = 0
        for lo, hi in sorted(self.ranges):
            if lo > at:
                self.low[at:lo].zero_()
            at = max(at, hi)
        if at < self.numel:
            self.low[at:].zero_()

    def fp32(self) -> torch.Tensor:
        """The window's fp32 gradient partition (zeros if nothing was reduced); ``low`` is consumed."""
        self.widen()
        return self.acc

    def step_input(self) -> torch.Tensor:
        """What the optimizer step reads: the 16-bit partition itself while the window's gradients are only that
        (device store: the optimizer widens it chunk by chunk), else :meth:`fp32`."""
        if self.host is None and self.acc is None and self.low is not None:
            return self.low
        return self.fp32()

    def nbytes(self) -> dict[str, int]:
        return {"grad_partition_16bit": self.low.nbytes if self.low is not None else 0,
                "grad_partition_fp32": self.acc.nbytes if self.acc is not None else 0}


def gradient_buffer_bytes(stores: list[GradStore], params) -> dict[str, int]:
    """Bytes of a rank's live gradient buffers: its stores (16-bit, fp32) and the parameters' ``.grad`` tensors."""
    out = {"grad_partition_16bit": 0, "grad_partition_fp32": 0}
    for store in stores:
        for k, v in store.nbytes().items():
            out[k] += v
    out["param_grads"] = sum(p.grad.nbytes for p in params if p.grad is not None)
    return out


class FlatParamManager:
    """Owns parameter storage, gradient reduction and the post-step all-gather for stages 0, 1 and 2."""

    def __init__(self, params: list[torch.nn.Parameter], table: PartitionTable, *, stage: int, device: torch.device,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, master_device: torch.device,
                 overlap_comm: bool = False, reduce_bucket_size: int = 500_000_000,
                 allgather_bucket_size: int = 500_000_000, step_overlap: bool | None = None):
        if stage not in (0, 1, 2):
            raise ValueError(f"FlatParamManager handles stages 0-2, got {stage}")
        self.params, self.table, self.stage = params, table, stage
        # overlap_comm: collectives are issued asynchronously and finished oldest first (the same adds in the same
        # order, so results are bit-identical) once more than reduce_bucket_size elements are in flight
        self.overlap_comm, self.reduce_bucket_size = overlap_comm, max(int(reduce_bucket_size), 1)
        self._reductions = CollectiveQueue()  # gradient reductions in flight (overlap_comm)
        # post-step all-gathers overlapped with the step (stages 1/2, world > 1): see step_buckets
        self.allgather_bucket_size = max(int(allgather_bucket_size), 1)
        # (overlap_comm, like stage 3's: off means every collective is synchronous)
        self.step_overlap = overlap_comm and (step_overlap_enabled() if step_overlap is None else step_overlap) \
            and stage > 0 and table.world_size > 1
        self._gathers = CollectiveQueue()
        self._gathered: set[int] = set()  # units cast and all-gathered during this step
        self.device, self.compute_dtype, self.reduce_dtype = device, compute_dtype, reduce_dtype
        self.master_device = master_device
        # offloaded optimizer next to a GPU: gradient stores and the upload staging are reused pinned host buffers
        self.host, self.uploader = host_staging(master_device, device)
        self.shard_rank = comm.rank() if table.world_size > 1 else 0
        self.masters = [torch.zeros(n, dtype=torch.float32, device=master_device)
                        for n in table.group_partition_numel]
        self.stores = self._new_stores()
        self.full: list[torch.Tensor] = [self._build_unit(u) for u in table.units]
        self._hooks = []
        if stage == 2:
            self._pending = [set() for _ in table.units]
            self._reduced = [False] * len(table.units)
            for i, p in enumerate(params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _new_stores(self) -> list[GradStore]:
        return [GradStore(n, self.master_device, self.reduce_dtype, host=self.host, key=g)
                for g, n in enumerate(self.table.group_partition_numel)]

    # -- init ---------------------------------------------------------------------------------------------------
    def _build_unit(self, unit: Unit) -> torch.Tensor:
        """Flatten the unit's params in fp32, broadcast from rank 0, keep our fp32 slice, re-point params (bf16/fp16
        compute keeps the original fp32 values in the master, not the rounded ones)."""
        buf = torch.zeros(unit.padded_numel(self.table.world_size), dtype=torch.float32, device=self.device)
        for slot in unit.params:
            buf[slot.offset: slot.offset + slot.numel].copy_(self.params[slot.index].data.reshape(-1))
        comm.broadcast_(buf, 0)
        s, r = unit.slice_numel, self.shard_rank
        self.masters[unit.group][unit.partition_offset: unit.partition_offset + s].copy_(buf[r * s:(r + 1) * s])
        full = buf if self.compute_dtype == torch.float32 else buf.to(self.compute_dtype)
        for slot in unit.params:
            p = self.params[slot.index]
            p.data = full[slot.offset: slot.offset + slot.numel].view(p.shape)
        return full

    # -- reduction of one unit ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _reduce_unit(self, unit: Unit) -> None:
        """One collective for the unit: all-reduce (stage 0) or reduce-scatter (stages 1/2) of its packed gradients,
        this rank's piece into the group's :class:`GradStore` (asynchronously with ``overlap_comm``)."""
        store = self.stores[unit.group]
        # A unit's second piece in a 16-bit store widens it to fp32 (acc = 0 + low, GradStore.add): every piece in
        # flight must have landed in ``low`` before, and none may be issued into ``low`` until it has happened.
        widens = store.acc is None and unit.index in store.written
        if widens:
            self.finish_reductions()
        asynchronous = self.overlap_comm and not widens
        direct = store.direct_slice(unit, self.device)
        if self.stage == 0:  # the "partition" is the whole unit: pack into the store and all-reduce there
            flat = direct if direct is not None else torch.empty(unit.slice_numel, dtype=self.reduce_dtype,
                                                                 device=self.device)
            pack_unit_grads(unit, self.params, flat)
            piece = flat
            handle = comm.all_reduce_(flat, async_op=asynchronous)
        else:
            flat = torch.empty(unit.padded_numel(self.table.world_size), dtype=self.reduce_dtype, device=self.device)
            pack_unit_grads(unit, self.params, flat)
            piece = direct if direct is not None else torch.empty(unit.slice_numel, dtype=self.reduce_dtype,
                                                                  device=self.device)
            handle = comm.reduce_scatter_(piece, flat, async_op=asynchronous)
        # a piece the collective wrote into the store directly is already there; else it is added once landed
        finish = None if direct is not None else functools.partial(store.add, unit, piece)
        self._reductions.push(handle, flat.numel(), finish, keep=(piece, flat), limit=self.reduce_bucket_size)

    def finish_reductions(self) -> None:
        """Wait for every reduction in flight and store its piece, oldest first."""
        self._reductions.drain()

    # -- stage 2 hooks ------------------------------------------------------------------------------------------
    def _make_hook(self, index: int):
        unit_id = self.table.param_unit[index]
        n_params = len(self.table.units[unit_id].params)
        ref = weakref.ref(self)  # the hook lives in C++ (autograd): a strong reference would keep the manager alive

        def hook(_param):
            mgr = ref()
            if mgr is None:
                return
            pending = mgr._pending[unit_id]
            pending.add(index)
            if len(pending) == n_params:
                mgr._reduce_stage2_unit(unit_id)
        return hook

    def _reduce_stage2_unit(self, unit_id: int) -> None:
        self._reduce_unit(self.table.units[unit_id])
        self._pending[unit_id].clear()
        self._reduced[unit_id] = True

    # -- engine-facing protocol ---------------------------------------------------------------------------------
    def after_backward(self, boundary: bool = True) -> None:
        """Stage 2: flush units whose gradients did not all arrive (unused parameters), in unit order. When more
        micro-steps follow (``boundary`` false), widen the 16-bit stores to fp32 so accumulation happens in fp32."""
        if self.stage == 2:
            for unit_id, done in enumerate(self._reduced):
                if not done:
                    self._reduce_stage2_unit(unit_id)
            self._reduced = [False] * len(self.table.units)
            self.finish_reductions()
            if not boundary:
                for store in self.stores:
                    store.widen()

    @torch.no_grad()
    def reduce_at_boundary(self) -> None:
        """Stages 0/1: reduce the accumulated gradients, one collective per unit, into the gradient stores."""
        if self.stage == 2:
            return
        for unit in self.table.units:
            self._reduce_unit(unit)
        self.finish_reductions()

    def grad_partitions(self) -> list[torch.Tensor]:
        """This window's flat fp32 gradient partitions, one per group (allocated now when the store is 16-bit);
        the optimizer may scale them in place. Released by :meth:`zero_grads`."""
        self.finish_reductions()
        return [store.fp32() for store in self.stores]

    def zero_grads(self) -> None:
        """End the window: drop the gradient stores and any ``param.grad`` (their memory is freed)."""
        self.finish_reductions()
        self.stores = self._new_stores()
        for p in self.params:
            p.grad = None
        if self.stage == 2:
            for pending in self._pending:
                pending.clear()

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of this rank's live gradient buffers (for memory reports and tests)."""
        return gradient_buffer_bytes(self.stores, self.params)

    # -- after the optimizer step ---------------------------------------------------------------------------------
    def step_buckets(self) -> list[StepBucket] | None:
        """The optimizer step in all-gather buckets (see module doc): consecutive units up to
        ``allgather_bucket_size`` padded elements (at least one unit each), their master ranges merged per group;
        ``done()`` casts and all-gathers them. ``None`` when nothing would overlap (stage 0, one rank, no
        ``overlap_comm``, ``ENGINE_STEP_ALLGATHER_OVERLAP=0``)."""
        if not self.step_overlap:
            return None
        if self.uploader is not None:  # the buckets' casts reuse the staging the last refresh's copies read
            self.uploader.begin()
        buckets, current, size = [], [], 0
        for unit in self.table.units:
            numel = unit.padded_numel(self.table.world_size)
            if current and size + numel > self.allgather_bucket_size:
                buckets.append(self._step_bucket(current))
                current, size = [], 0
            current.append(unit)
            size += numel
        if current:
            buckets.append(self._step_bucket(current))
        return buckets

    def _step_bucket(self, units: list[Unit]) -> StepBucket:
        ranges: list[list[int]] = []
        for unit in units:
            lo, hi = unit.partition_offset, unit.partition_offset + unit.slice_numel
            if ranges and ranges[-1][0] == unit.group and ranges[-1][2] == lo:
                ranges[-1][2] = hi
            else:
                ranges.append([unit.group, lo, hi])
        return StepBucket(tuple(tuple(r) for r in ranges), functools.partial(self._gather_units, tuple(units)))

    @torch.no_grad()
    def _gather_units(self, units: tuple[Unit, ...]) -> None:
        """Cast the units' updated master slices into their compute buffers and issue their all-gathers."""
        for unit in units:
            full, mine = self._cast_slice(unit)
            handle = comm.all_gather_(full, mine, async_op=True)
            self._gathers.push(handle, full.numel(), keep=(mine,), limit=self.allgather_bucket_size)
            self._gathered.add(unit.index)

    def _cast_slice(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy (cast) the unit's fp32 master slice into this rank's slice of its compute buffer."""
        full, r, s = self.full[unit.index], self.shard_rank, unit.slice_numel
        mine = full[r * s:(r + 1) * s]
        master = self.masters[unit.group]
        src = master[unit.partition_offset: unit.partition_offset + s]
        if self.uploader is not None:  # host cast into pinned staging, copied without waiting (offload.Uploader)
            self.uploader.copy(mine, src, unit.group, unit.partition_offset, master.numel())
        else:
            mine.copy_(src)
        return full, mine

    @torch.no_grad()
    def update_params(self) -> None:
        """Refresh the compute parameters from the fp32 masters: units the step already cast and all-gathered
        (:meth:`step_buckets`) are waited for; every other unit is cast and all-gathered now, one collective each."""
        if self.uploader is not None:
            self.uploader.begin()
        for unit in self.table.units:
            if unit.index not in self._gathered:
                full, mine = self._cast_slice(unit)
                if self.table.world_size > 1:
                    comm.all_gather_(full, mine)
        if self.uploader is not None:
            self.uploader.end()
        self._gathers.drain()
        self._gathered.clear()

    def full_param(self, index: int) -> torch.Tensor:
        """The full compute-dtype parameter (already materialised on every rank)."""
        return self.params[index].data

    def refresh_after_load(self) -> None:
        """After masters were loaded from a checkpoint: rebuild compute params from them."""
        self.update_params()
