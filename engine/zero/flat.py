"""Stages 0-2: full parameters on every rank, as views into one flat compute-dtype buffer per unit (bucket).

Memory layout (see :mod:`engine.partition`): unit ``u`` has a flat buffer ``full[u]`` of ``padded_numel`` elements on
the compute device; every trainable parameter's ``.data`` is a view into it. Rank ``r`` owns slice
``full[u][r*S:(r+1)*S]`` whose fp32 master copy sits at ``unit.partition_offset`` of the rank's flat master partition.

Communication phases per optimizer step
---------------------------------------
1. init: one broadcast per unit from rank 0 (all ranks start from rank 0's weights).
2. backward, gradient reduction, one collective per unit:
   * stage 0 (DDP): ``param.grad`` are views into a flat gradient buffer per unit; at the accumulation boundary each
     buffer is all-reduced and added to the (unsharded) fp32 gradient.
   * stage 1: same buffers; at the boundary each is reduce-scattered; the rank keeps only its slice.
   * stage 2: a post-accumulate-grad hook counts each unit's gradients; once all arrived (during backward) they are
     packed, reduce-scattered, added to the rank's fp32 gradient slice and the full gradients are freed. Units not
     completed by the end of backward (unused parameters) are flushed in unit order by :meth:`after_backward`.
3. after the optimizer step: the rank's updated fp32 slice is cast into its slice of ``full[u]`` and all-gathered
   (one all-gather per unit; none for stage 0, whose "partition" is the whole model).
Gradient sums are divided by the data-parallel world size later, once, by the optimizer.
"""

from __future__ import annotations

import torch

from engine import comm
from engine.partition import PartitionTable, Unit


def reduce_unit_grads(unit: Unit, grads: list, world_size: int, reduce_dtype: torch.dtype, device: torch.device,
                      out: torch.Tensor) -> None:
    """Pack one unit's gradients (``None`` = zero), reduce-scatter across ranks, add this rank's slice into ``out``.

    ``out`` is the rank's fp32 gradient slice for the unit (``unit.slice_numel`` elements, any device).
    """
    flat = torch.zeros(unit.padded_numel(world_size), dtype=reduce_dtype, device=device)
    for slot, grad in zip(unit.params, grads):
        if grad is not None:
            flat[slot.offset: slot.offset + slot.numel].copy_(grad.reshape(-1))
    if world_size == 1:
        piece = flat
    else:
        piece = torch.empty(unit.slice_numel, dtype=reduce_dtype, device=device)
        comm.reduce_scatter_(piece, flat)
    out.add_(piece.to(device=out.device, dtype=out.dtype))


class FlatParamManager:
    """Owns parameter storage, gradient reduction and the post-step all-gather for stages 0, 1 and 2."""

    def __init__(self, params: list[torch.nn.Parameter], table: PartitionTable, *, stage: int, device: torch.device,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, master_device: torch.device):
        if stage not in (0, 1, 2):
            raise ValueError(f"FlatParamManager handles stages 0-2, got {stage}")
        self.params, self.table, self.stage = params, table, stage
        self.device, self.compute_dtype, self.reduce_dtype = device, compute_dtype, reduce_dtype
        self.shard_rank = comm.rank() if table.world_size > 1 else 0
        self.masters = [torch.zeros(n, dtype=torch.float32, device=master_device)
                        for n in table.group_partition_numel]
        self.grad_parts = [torch.zeros_like(m) for m in self.masters]
        self.full: list[torch.Tensor] = [self._build_unit(u) for u in table.units]
        self.grad_bufs: list[torch.Tensor] = []
        self._hooks = []
        if stage in (0, 1):
            self.grad_bufs = [torch.zeros_like(f) for f in self.full]
            self._point_grads_at_buffers()
        else:
            self._pending = [set() for _ in table.units]
            self._reduced = [False] * len(table.units)
            for i, p in enumerate(params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

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

    def _point_grads_at_buffers(self) -> None:
        for unit, gbuf in zip(self.table.units, self.grad_bufs):
            for slot in unit.params:
                p = self.params[slot.index]
                p.grad = gbuf[slot.offset: slot.offset + slot.numel].view(p.shape)

    # -- stage 2 hooks ------------------------------------------------------------------------------------------
    def _make_hook(self, index: int):
        unit_id = self.table.param_unit[index]

        def hook(_param):
            pending = self._pending[unit_id]
            pending.add(index)
            if len(pending) == len(self.table.units[unit_id].params):
                self._reduce_stage2_unit(unit_id)
        return hook

    def _reduce_stage2_unit(self, unit_id: int) -> None:
        unit = self.table.units[unit_id]
        grads = [self.params[s.index].grad for s in unit.params]
        out = self.grad_parts[unit.group][unit.partition_offset: unit.partition_offset + unit.slice_numel]
        reduce_unit_grads(unit, grads, self.table.world_size, self.reduce_dtype, self.device, out)
        for s in unit.params:
            self.params[s.index].grad = None
        self._pending[unit_id].clear()
        self._reduced[unit_id] = True

    # -- engine-facing protocol ---------------------------------------------------------------------------------
    def after_backward(self) -> None:
        """Stage 2: flush units whose gradients did not all arrive (unused parameters), in unit order."""
        if self.stage == 2:
            for unit_id, done in enumerate(self._reduced):
                if not done:
                    self._reduce_stage2_unit(unit_id)
            self._reduced = [False] * len(self.table.units)

    @torch.no_grad()
    def reduce_at_boundary(self) -> None:
        """Stages 0/1: reduce the accumulated full gradients, one collective per unit, into the fp32 partition."""
        if self.stage == 2:
            return
        ws = comm.world_size()
        for unit, gbuf in zip(self.table.units, self.grad_bufs):
            for slot in unit.params:  # user code may have replaced .grad: fold it back into our buffer
                p, view = self.params[slot.index], gbuf[slot.offset: slot.offset + slot.numel]
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad.reshape(-1))
            send = gbuf if gbuf.dtype == self.reduce_dtype else gbuf.to(self.reduce_dtype)
            if self.stage == 0:
                piece = comm.all_reduce_(send)
            else:
                piece = torch.empty(unit.slice_numel, dtype=self.reduce_dtype, device=self.device)
                comm.reduce_scatter_(piece, send) if ws > 1 else piece.copy_(send)
            out = self.grad_parts[unit.group][unit.partition_offset: unit.partition_offset + unit.slice_numel]
            out.add_(piece.to(device=out.device, dtype=out.dtype))
            gbuf.zero_()
        self._point_grads_at_buffers()

    def zero_grads(self) -> None:
        for g in self.grad_parts:
            g.zero_()
        for gbuf in self.grad_bufs:
            gbuf.zero_()
        if self.stage == 2:
            for p in self.params:
                p.grad = None

    @torch.no_grad()
    def update_params(self) -> None:
        """Copy updated fp32 slices into the compute buffers and all-gather them (one collective per unit)."""
        r = self.shard_rank
        for unit, full in zip(self.table.units, self.full):
            s = unit.slice_numel
            mine = full[r * s:(r + 1) * s]
            mine.copy_(self.masters[unit.group][unit.partition_offset: unit.partition_offset + s])
            if self.table.world_size > 1:
                comm.all_gather_(full, mine)

    def full_param(self, index: int) -> torch.Tensor:
        """The full compute-dtype parameter (already materialised on every rank)."""
        return self.params[index].data

    def refresh_after_load(self) -> None:
        """After masters were loaded from a checkpoint: rebuild compute params from them."""
        self.update_params()
