"""Stage 3: parameters partitioned across ranks, gathered per module for forward and backward, released after.

Storage: per group a flat compute-dtype **param partition** (on the compute device, or on CPU with
``offload_param.device = cpu``); unit ``u``'s slice is ``part[g][u.partition_offset : +S]``. Between uses a parameter's
``.data`` is an empty tensor; ``param.ds_shape`` / ``ds_numel`` keep its real size (DeepSpeed names).
Frozen parameters are partitioned too (an extra group with no fp32 master).

Communication phases
--------------------
* forward: a module's pre-forward hook all-gathers the units holding its direct parameters (one all-gather per unit;
  a tied parameter lives in one unit, owned by the first module that registered it); the post-forward hook releases
  them and wraps the module's outputs in :class:`_PreBackward`.
* backward: :class:`_PreBackward` fires when the gradient of the module's outputs arrives, i.e. just before the
  module's own backward, and re-gathers its units. A post-accumulate-grad hook on every trainable parameter counts a
  unit's gradients; once complete they are packed, reduce-scattered into the rank's fp32 gradient slice, freed, and
  the unit is released. :meth:`after_backward` flushes incomplete units in unit order and releases everything left.
* after the optimizer step: the fp32 master partition is cast into the param partition (no communication);
  persistent units (``numel < stage3_param_persistence_threshold``) are re-gathered, one all-gather each.

Every rank issues the same collectives in the same order because every rank runs the same graph.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine import comm
from engine.partition import PartitionTable, Unit
from engine.zero.flat import reduce_unit_grads

_EMPTY_CACHE: dict = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, str(device))
    if key not in _EMPTY_CACHE:
        _EMPTY_CACHE[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY_CACHE[key]


class _PreBackward(torch.autograd.Function):
    """Identity on the module's output tensors; its backward re-gathers the module's units first."""

    @staticmethod
    def forward(ctx, manager, units, *tensors):
        ctx.manager, ctx.units = manager, units
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)  # like DeepSpeed: a fresh output, so in-place edits stay legal

    @staticmethod
    def backward(ctx, *grads):
        ctx.manager.fetch(ctx.units)
        return (None, None) + grads


def _map_tensors(obj, fn):
    """Apply ``fn`` to the tensors of a (nested) tuple / list / dict / ModelOutput, in place for dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        for key in list(obj.keys()):
            obj[key] = _map_tensors(obj[key], fn)
        return obj
    return obj


class PartitionedParamManager:
    """Owns stage-3 parameter partitions, gather/release, hooks and gradient reduction."""

    def __init__(self, params: list[nn.Parameter], table: PartitionTable, *, num_trainable_groups: int,
                 device: torch.device, param_device: torch.device, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, master_device: torch.device, persistence_threshold: int = 0):
        self.params, self.table = params, table
        self.device, self.param_device = device, param_device
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.rank, self.ws = comm.rank(), table.world_size
        self.num_trainable_groups = num_trainable_groups
        self.shapes = [p.ds_shape if hasattr(p, "ds_shape") else tuple(p.shape) for p in params]
        self.masters = [torch.zeros(n, dtype=torch.float32, device=master_device)
                        for n in table.group_partition_numel[:num_trainable_groups]]
        self.grad_parts = [torch.zeros_like(m) for m in self.masters]
        self.part = [torch.zeros(n, dtype=compute_dtype, device=param_device) for n in table.group_partition_numel]
        self.full: list[torch.Tensor | None] = [None] * len(table.units)
        self.active = [0] * len(table.units)
        self.persistent = [u.numel < persistence_threshold for u in table.units]
        self._pending = [set() for _ in table.units]
        self._reduced = [False] * len(table.units)
        self._hooks: list = []
        self._partition_all()
        for u, keep in enumerate(self.persistent):
            if keep:
                self._gather(u)

    # -- init ---------------------------------------------------------------------------------------------------
    def _partition_all(self) -> None:
        """Unit by unit: materialise the unit's full fp32 values (all-gathering zero.Init partitions if needed, else
        broadcasting rank 0's copy), keep this rank's slice, drop the full data. Peak: one unit."""
        from engine.zero.init import full_data_of

        init_cache: dict = {}
        for unit in self.table.units:
            buf = torch.zeros(unit.padded_numel(self.ws), dtype=torch.float32, device=self.device)
            from_init = True
            for slot in unit.params:
                p = self.params[slot.index]
                src, was_init = full_data_of(p, init_cache)
                from_init &= was_init
                buf[slot.offset: slot.offset + slot.numel].copy_(src.reshape(-1))
            if not from_init:
                comm.broadcast_(buf, 0)
            s = unit.slice_numel
            mine = buf[self.rank * s:(self.rank + 1) * s]
            if unit.group < self.num_trainable_groups:
                self.masters[unit.group][unit.partition_offset: unit.partition_offset + s].copy_(mine)
            self.part[unit.group][unit.partition_offset: unit.partition_offset + s].copy_(mine)
            for slot in unit.params:
                p = self.params[slot.index]
                p.data = _empty(self.compute_dtype, self.device)
                p.ds_shape, p.ds_numel = self.shapes[slot.index], slot.numel
                p._zero_mgr, p._zero_index = self, slot.index
                for attr in ("_zero_init_store", "_zero_init_slot"):
                    p.__dict__.pop(attr, None)

    # -- gather / release ---------------------------------------------------------------------------------------
    def _slice(self, unit: Unit) -> torch.Tensor:
        return self.part[unit.group][unit.partition_offset: unit.partition_offset + unit.slice_numel]

    def _gather(self, unit_id: int) -> None:
        unit = self.table.units[unit_id]
        full = torch.empty(unit.padded_numel(self.ws), dtype=self.compute_dtype, device=self.device)
        s = unit.slice_numel
        full[self.rank * s:(self.rank + 1) * s].copy_(self._slice(unit))
        comm.all_gather_(full, full[self.rank * s:(self.rank + 1) * s])
        for slot in unit.params:
            self.params[slot.index].data = full[slot.offset: slot.offset + slot.numel].view(self.shapes[slot.index])
        self.full[unit_id] = full

    def _release(self, unit_id: int) -> None:
        if self.full[unit_id] is None or self.persistent[unit_id] or self.active[unit_id] > 0:
            return
        for slot in self.table.units[unit_id].params:
            self.params[slot.index].data = _empty(self.compute_dtype, self.device)
        self.full[unit_id] = None

    def fetch(self, unit_ids) -> None:
        for u in unit_ids:
            if self.full[u] is None:
                self._gather(u)

    # -- hooks --------------------------------------------------------------------------------------------------
    def install_hooks(self, model: nn.Module) -> None:
        for module in model.modules():
            units = sorted({p._zero_index for p in module.parameters(recurse=False)
                            if getattr(p, "_zero_mgr", None) is self})
            units = tuple(sorted({self.table.param_unit[i] for i in units}))
            if not units:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(module.register_forward_hook(self._post_forward(units)))
        for unit in self.table.units:
            if unit.group >= self.num_trainable_groups:
                continue
            for slot in unit.params:
                self._hooks.append(self.params[slot.index].register_post_accumulate_grad_hook(
                    self._grad_hook(slot.index)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pre_forward(self, units):
        def hook(_module, _inputs):
            self.fetch(units)
            for u in units:
                self.active[u] += 1
        return hook

    def _post_forward(self, units):
        def hook(_module, _inputs, output):
            for u in units:
                self.active[u] -= 1
                self._release(u)
            if not torch.is_grad_enabled():
                return output
            tensors = []
            _map_tensors(output, lambda t: tensors.append(t) or t)
            needs = [t for t in tensors if t.requires_grad]
            if not needs:
                return output
            wrapped = iter(_PreBackward.apply(self, units, *needs))
            return _map_tensors(output, lambda t: next(wrapped) if t.requires_grad else t)
        return hook

    def _grad_hook(self, index: int):
        unit_id = self.table.param_unit[index]

        def hook(_param):
            pending = self._pending[unit_id]
            pending.add(index)
            if len(pending) == len(self.table.units[unit_id].params):
                self._reduce_unit(unit_id)
        return hook

    def _reduce_unit(self, unit_id: int) -> None:
        unit = self.table.units[unit_id]
        grads = [self.params[s.index].grad for s in unit.params]
        out = self.grad_parts[unit.group][unit.partition_offset: unit.partition_offset + unit.slice_numel]
        reduce_unit_grads(unit, grads, self.ws, self.reduce_dtype, self.device, out)
        for s in unit.params:
            self.params[s.index].grad = None
        self._pending[unit_id].clear()
        self._reduced[unit_id] = True
        self._release(unit_id)

    # -- engine-facing protocol ---------------------------------------------------------------------------------
    def after_backward(self) -> None:
        for unit_id, unit in enumerate(self.table.units):
            if unit.group < self.num_trainable_groups and not self._reduced[unit_id]:
                self._reduce_unit(unit_id)
        self._reduced = [False] * len(self.table.units)
        for unit_id in range(len(self.table.units)):
            self.active[unit_id] = 0
            self._release(unit_id)

    def reduce_at_boundary(self) -> None:
        """Nothing to do: stage 3 reduces during backward."""

    def zero_grads(self) -> None:
        for g in self.grad_parts:
            g.zero_()

    @torch.no_grad()
    def update_params(self) -> None:
        for g, master in enumerate(self.masters):
            self.part[g].copy_(master)
        for u, keep in enumerate(self.persistent):
            if keep:
                self._gather(u)
            elif self.full[u] is not None:  # gathered by a user context: refresh its contents
                self._gather(u)

    def refresh_after_load(self) -> None:
        self.update_params()

    # -- user gathering (GatheredParameters, checkpoint export) --------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, indices, modifier_rank: int | None = None):
        """Gather the units holding ``indices``; on exit, if ``modifier_rank`` is set, broadcast that rank's
        (possibly edited) values and re-partition them (param partition and fp32 master), then release."""
        units = sorted({self.table.param_unit[i] for i in indices})
        self.fetch(units)
        for u in units:
            self.active[u] += 1
        try:
            yield
        finally:
            for u in units:
                self.active[u] -= 1
                if modifier_rank is not None:
                    self._repartition(u, modifier_rank)
                self._release(u)

    @torch.no_grad()
    def _repartition(self, unit_id: int, src: int) -> None:
        unit, full = self.table.units[unit_id], self.full[unit_id]
        for slot in unit.params:  # the user may have re-assigned .data instead of editing in place
            p, view = self.params[slot.index], full[slot.offset: slot.offset + slot.numel]
            if p.data.data_ptr() != view.data_ptr():
                view.copy_(p.data.reshape(-1))
                p.data = view.view(self.shapes[slot.index])
        comm.broadcast_(full, src)
        s = unit.slice_numel
        mine = full[self.rank * s:(self.rank + 1) * s]
        self._slice(unit).copy_(mine)
        if unit.group < self.num_trainable_groups:
            self.masters[unit.group][unit.partition_offset: unit.partition_offset + s].copy_(mine)

    def full_param(self, index: int) -> torch.Tensor:
        """A gathered copy of parameter ``index`` (compute dtype, compute device): one all-gather of its unit."""
        with self.gathered([index]):
            return self.params[index].data.clone()
