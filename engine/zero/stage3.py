"""Stage 3: parameters partitioned across ranks, gathered per module for forward and backward, released after.

Storage: per group a flat compute-dtype **param partition** (on the compute device, or on CPU with
``offload_param.device = cpu``, or in a file with ``nvme``: :class:`engine.nvme.ParamFiles`, read ahead of the trace
into a bounded staging pool); unit ``u``'s slice is ``part[g][u.partition_offset : +S]``. Between uses a parameter's
``.data`` is an empty tensor; ``param.ds_shape`` / ``ds_numel`` keep its real size (DeepSpeed names).
Frozen parameters are partitioned too (an extra group with no fp32 master).

Communication phases (``overlap_comm`` on, the default; see :class:`~engine.zero.prefetch.Stage3Options`)
--------------------------------------------------------------------------------------------------------
* forward: the root module's pre-hook starts a **pass** (:class:`~engine.zero.prefetch.FetchTrace`). A module's
  pre-forward hook needs the units holding its direct parameters (a tied parameter lives in one unit, owned by the
  first module that registered it): it issues the all-gather of each unit not yet gathered (``async_op=True``, one
  collective per unit, into a fresh flat buffer; the input is the partition slice itself), then **prefetches** --
  issues the all-gathers of the units of the next recorded events, up to ``prefetch_bucket_size`` elements ahead and
  ``max_live_parameters`` gathered -- and only then waits for its own units' handles (:meth:`comm.Pending.wait`: on
  NCCL the current stream waits for the NCCL stream, on gloo the host waits for the gloo thread). So unit k+1's
  all-gather is in flight while unit k computes. The post-forward hook releases the units unless the trace says
  they are used again within ``max_reuse_distance`` elements (with DeepSpeed's defaults: a unit gathered in forward
  stays gathered until its backward), and wraps the outputs in :class:`_PreBackward`.
* backward: :class:`_PreBackward` fires when the gradient of the module's outputs arrives, i.e. just before the
  module's own backward: the same fetch + prefetch (reverse module order, from the recorded trace). A
  post-accumulate-grad hook on every trainable parameter counts a unit's gradients; once complete they are packed
  into a flat buffer and its reduce-scatter is *issued* (``async_op=True``), the full gradients are freed and the
  unit released. The reduced slice goes into the group's :class:`~engine.zero.flat.GradStore` (the stages 0-2
  scheme: a 16-bit partition the collective writes directly when the reduce dtype is 16-bit, an fp32 accumulator
  otherwise, or once a unit is reduced a second time in the window; widened to fp32 at the end of every
  non-boundary backward, so micro-steps accumulate in fp32). The handles are waited in issue order (FIFO: pieces
  are stored in the same order as synchronously) when more than ``reduce_bucket_size`` elements are outstanding,
  and all of them by :meth:`reduce_at_boundary` (before the optimizer step) or :meth:`zero_grads`.
  :meth:`after_backward` flushes incomplete units in unit order, ends the pass and releases everything left
  (waiting any in-flight gather first).
* optimizer step: :meth:`grad_partitions` hands over the stores: a 16-bit device store as it is (the optimizer
  widens it ``sub_group_size`` elements at a time, DeepSpeed's sub-groups), else fp32 partitions (``0 + piece``,
  exactly what a persistent fp32 partition zeroed after each step would hold), dropped by :meth:`zero_grads`. No
  gradient-sized buffer lives between steps; during forward/backward at most the 16-bit store (2 bytes x partition)
  with gradient accumulation 1 and a 16-bit reduce dtype (NCCL's default), where a persistent fp32 partition took 4;
  during the step that store plus one fp32 chunk.
* after the optimizer step: the fp32 master partition is cast into the param partition (no communication);
  persistent units (``numel < stage3_param_persistence_threshold``) and units held by a user context are
  re-gathered: all their all-gathers issued, then all waited.

``overlap_comm`` off: every all-gather and reduce-scatter is synchronous and issued where it is needed (no
prefetch). Collectives move bytes and sum each element in the same order either way, so losses and weights are
bit-identical with and without overlap. Every rank issues the same collectives in the same order because every
rank runs the same graph and the schedule depends only on it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter

import torch
from torch import nn

from engine import comm
from engine.offload import host_staging
from engine.partition import PartitionTable, Unit
from engine.zero.collectives import CollectiveQueue
from engine.zero.flat import GradStore, gradient_buffer_bytes, pack_unit_grads
from engine.zero.prefetch import FetchTrace, Stage3Options

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
        ctx.manager.fetch_for_hook(ctx.units)
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
    """Owns stage-3 parameter partitions, gather/prefetch/release, hooks and gradient reduction."""

    def __init__(self, params: list[nn.Parameter], table: PartitionTable, *, num_trainable_groups: int,
                 device: torch.device, param_device: torch.device, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, master_device: torch.device, persistence_threshold: int = 0,
                 options: Stage3Options | None = None, param_files=None):
        self.params, self.table = params, table
        self.device, self.param_device = device, param_device
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.rank, self.ws = comm.rank(), table.world_size
        self.num_trainable_groups = num_trainable_groups
        self.opts = options or Stage3Options()
        self.shapes = [p.ds_shape if hasattr(p, "ds_shape") else tuple(p.shape) for p in params]
        self.masters = [torch.zeros(n, dtype=torch.float32, device=master_device)
                        for n in table.group_partition_numel[:num_trainable_groups]]
        self.master_device = master_device
        # offloaded next to a GPU: gradient stores and the upload staging are reused pinned host buffers
        self.host, self.uploader = host_staging(master_device, param_device)
        self.stores = self._new_stores()  # this window's reduced gradients (flat.GradStore), none between steps
        # offload_param nvme: ``param_files(group sizes, dtype)`` -> engine.nvme.ParamFiles; no partition in memory
        self.files = param_files(list(table.group_partition_numel), compute_dtype) if param_files else None
        self.part = [torch.zeros(0 if self.files else n, dtype=compute_dtype, device=param_device)
                     for n in table.group_partition_numel]
        self.master_io = None  # set by an optimizer that keeps the fp32 masters in files (offload_optimizer nvme)
        self._streamed_cast = False  # the step already cast the masters into the param partitions
        self._events = 0  # fetch events so far (tags NVMe read-aheads)
        n_units = len(table.units)
        self.full: list[torch.Tensor | None] = [None] * n_units  # gathered flat buffer (maybe still in flight)
        self.pending: list[comm.Pending | None] = [None] * n_units  # all-gather handle, until waited
        self.active = [0] * n_units
        self.persistent = [u.numel < persistence_threshold for u in table.units]
        self.padded = [u.padded_numel(self.ws) for u in table.units]
        self.live_numel = 0  # elements of gathered (or in-flight) non-persistent units
        self.trace = FetchTrace(self.padded)
        self._scan = 0  # first trace event not yet considered for prefetch in this pass
        self._ahead: dict[int, int] = {}  # prefetched units not used yet -> elements
        self._ahead_numel = 0
        self._reductions = CollectiveQueue()  # issued reduce-scatters, finished oldest first
        self.stats: Counter = Counter()  # all_gathers, prefetched, prefetch_hits, reduce_scatters
        self._pending = [set() for _ in table.units]
        self._reduced = [False] * n_units
        self._hooks: list = []
        self._partition_all()
        self.fetch([u for u, keep in enumerate(self.persistent) if keep])

    def set_options(self, options: Stage3Options) -> None:
        """Switch communication options (between steps): finishes whatever is in flight first."""
        self._settle()
        self.opts = options

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
            self._write_part(unit.group, unit.partition_offset, mine)
            for slot in unit.params:
                p = self.params[slot.index]
                p.data = _empty(self.compute_dtype, self.device)
                p.ds_shape, p.ds_numel = self.shapes[slot.index], slot.numel
                p._zero_mgr, p._zero_index = self, slot.index
                for attr in ("_zero_init_store", "_zero_init_slot"):
                    p.__dict__.pop(attr, None)

    # -- gather / wait / release ----------------------------------------------------------------------------------
    def _slice(self, unit: Unit) -> torch.Tensor:
        return self.part[unit.group][unit.partition_offset: unit.partition_offset + unit.slice_numel]

    def _write_part(self, group: int, offset: int, values: torch.Tensor) -> None:
        """Store ``values`` (cast to the compute dtype) into the param partition of ``group`` at ``offset``."""
        if self.files is not None:
            self.files.write(group, offset, values)
        else:
            self.part[group][offset: offset + values.numel()].copy_(values)

    def take_master_chunk(self, group: int, offset: int, chunk: torch.Tensor) -> None:
        """A streamed optimizer step hands over updated fp32 masters chunk by chunk: cast them into the params."""
        if self.files is not None and not self._streamed_cast:
            self.files.drop_staged()
        self._streamed_cast = True
        self._write_part(group, offset, chunk)

    def _read_ahead(self, events=None) -> None:
        """offload_param nvme: start file reads of the units the trace says come next (bounded by the pool), on
        the background thread; tagged with this event's number (see :meth:`_readable`). ``events``: a recorded
        pass to read the start of (after the step: the next training forward) instead of the replay position."""
        if self.files is None or (events is None and self.trace.replay is None):
            return
        upcoming = events if events is not None else (units for _i, units in self.trace.upcoming(self.trace.pos))
        for units in upcoming:
            for u in units:
                if self.full[u] is None:
                    unit = self.table.units[u]
                    if not self.files.read_ahead(u, unit.group, unit.partition_offset, unit.slice_numel,
                                                 self._events):
                        return

    def _readable(self, unit_id: int) -> bool:
        """May prefetch issue this unit's all-gather? Always without NVMe; with it, only once its file read was
        started at an earlier event (so the read overlapped compute). Depends only on the trace: same on all ranks."""
        if self.files is None:
            return True
        return unit_id in self.files.staged and self.files.tags[unit_id] < self._events

    def _issue(self, unit_id: int) -> None:
        """Start the all-gather of ``unit_id`` into a fresh flat buffer: asynchronous with ``overlap_comm`` (the
        handle is kept in ``pending``; parameters are pointed at the buffer by :meth:`_wait`), else synchronous."""
        unit = self.table.units[unit_id]
        full = torch.empty(self.padded[unit_id], dtype=self.compute_dtype, device=self.device)
        if self.files is not None:  # offload_param nvme: read the slice (read ahead if possible) into place
            s = unit.slice_numel
            mine = full[self.rank * s:(self.rank + 1) * s]
            self.files.read_into(unit_id, unit.group, unit.partition_offset, mine)
        else:
            mine = self._slice(unit)
        if mine.device != full.device:  # offload_param: copy the slice up, gather in place
            s = unit.slice_numel
            mine = full[self.rank * s:(self.rank + 1) * s].copy_(mine)
        self.pending[unit_id] = comm.all_gather_(full, mine, async_op=self.opts.overlap_comm)
        self.full[unit_id] = full
        if not self.persistent[unit_id]:
            self.live_numel += self.padded[unit_id]
        self.stats["all_gathers"] += 1
        if self.pending[unit_id] is None:
            self._attach(unit_id)

    def _attach(self, unit_id: int) -> None:
        full = self.full[unit_id]
        for slot in self.table.units[unit_id].params:
            self.params[slot.index].data = full[slot.offset: slot.offset + slot.numel].view(self.shapes[slot.index])

    def _wait(self, unit_id: int) -> None:
        handle = self.pending[unit_id]
        if handle is not None:
            handle.wait()
            self.pending[unit_id] = None
            self._attach(unit_id)

    def _release(self, unit_id: int) -> None:
        """Drop a gathered unit (waiting for its all-gather first if it is still in flight)."""
        if self.full[unit_id] is None or self.persistent[unit_id] or self.active[unit_id] > 0:
            return
        self._wait(unit_id)
        for slot in self.table.units[unit_id].params:
            self.params[slot.index].data = _empty(self.compute_dtype, self.device)
        self.full[unit_id] = None
        self.live_numel -= self.padded[unit_id]
        if unit_id in self._ahead:
            self._ahead_numel -= self._ahead.pop(unit_id)

    def _release_unless_reused(self, unit_id: int) -> None:
        """Release, unless the trace says the unit is needed again within ``max_reuse_distance`` elements (and the
        live budget allows keeping it). A released unit with a later use is rescanned for prefetch."""
        if self.full[unit_id] is None or self.persistent[unit_id] or self.active[unit_id] > 0:
            return
        nxt = self.trace.reuse(unit_id)
        if nxt is not None:
            index, distance = nxt
            if distance <= self.opts.max_reuse_distance and self.live_numel <= self.opts.max_live_parameters:
                return
            self._scan = min(self._scan, index)
        self._release(unit_id)

    def fetch(self, unit_ids) -> None:
        """Gather ``unit_ids`` now (outside the trace: user contexts, exports): issue all, then wait all."""
        for u in unit_ids:
            if self.full[u] is None:
                self._issue(u)
        for u in unit_ids:
            self._wait(u)

    def fetch_for_hook(self, units: tuple[int, ...]) -> None:
        """A pre-forward / pre-backward event: issue own gathers, prefetch what the trace says comes next, wait."""
        self.trace.event(units)
        self._events += 1
        for u in units:
            if self.full[u] is None:
                self._issue(u)
            elif u in self._ahead:
                self._ahead_numel -= self._ahead.pop(u)
                self.stats["prefetch_hits"] += 1
        self._prefetch()
        self._read_ahead()
        for u in units:
            self._wait(u)

    def _prefetch(self) -> None:
        """Issue all-gathers for the units of upcoming trace events, in event order, while fewer than
        ``prefetch_bucket_size`` prefetched elements are unused and ``max_live_parameters`` is not exceeded."""
        opts = self.opts
        if not opts.overlap_comm or opts.prefetch_bucket_size <= 0 or self.trace.replay is None:
            return
        index = max(self._scan, self.trace.pos)
        for index, units in self.trace.upcoming(index):
            if self._ahead_numel >= opts.prefetch_bucket_size:
                break
            for u in units:
                if self.full[u] is not None:
                    continue
                if self.live_numel + self.padded[u] > opts.max_live_parameters or not self._readable(u):
                    self._scan = index
                    return
                self._issue(u)
                self._ahead[u] = self.padded[u]
                self._ahead_numel += self.padded[u]
                self.stats["prefetched"] += 1
        else:
            index = len(self.trace.replay.events)
        self._scan = index

    def _settle(self) -> None:
        """Wait for every in-flight all-gather and reduce-scatter."""
        for u, handle in enumerate(self.pending):
            if handle is not None:
                self._wait(u)
        self._drain_reductions()

    # -- hooks --------------------------------------------------------------------------------------------------
    def install_hooks(self, model: nn.Module) -> None:
        """Pass start on the root; fetch/release on every module with non-persistent direct parameters; gradient
        counting on every trainable parameter."""
        self._hooks.append(model.register_forward_pre_hook(self._start_pass))
        for module in model.modules():
            indices = {p._zero_index for p in module.parameters(recurse=False)
                       if getattr(p, "_zero_mgr", None) is self}
            units = tuple(sorted({self.table.param_unit[i] for i in indices} - {
                u for u, keep in enumerate(self.persistent) if keep}))
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

    def _start_pass(self, _module, _inputs) -> None:
        """Root pre-forward: release leftovers of an unfinished pass (e.g. a forward without backward), then replay
        (or record) the trace of this mode (grad enabled or not)."""
        for u in range(len(self.full)):
            if self.full[u] is not None and self.active[u] == 0:
                self._release(u)
        self.trace.start_pass(torch.is_grad_enabled())
        self._scan = 0

    def _pre_forward(self, units):
        def hook(_module, _inputs):
            self.fetch_for_hook(units)
            for u in units:
                self.active[u] += 1
        return hook

    def _post_forward(self, units):
        def hook(_module, _inputs, output):
            for u in units:
                self.active[u] -= 1
                self._release_unless_reused(u)
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
        n_params = len(self.table.units[unit_id].params)
        ref = weakref.ref(self)  # the hook lives in C++ (autograd), out of the garbage collector's sight

        def hook(_param):
            mgr = ref()
            if mgr is None:
                return
            pending = mgr._pending[unit_id]
            pending.add(index)
            if len(pending) == n_params:
                mgr._reduce_unit(unit_id)
        return hook

    # -- gradient reduction ---------------------------------------------------------------------------------------
    def _new_stores(self) -> list[GradStore]:
        return [GradStore(n, self.master_device, self.reduce_dtype, host=self.host, key=g)
                for g, n in enumerate(self.table.group_partition_numel[:self.num_trainable_groups])]

    def _reduce_unit(self, unit_id: int) -> None:
        """Pack the unit's gradients (``None`` = zero) into a flat reduce-dtype buffer, free them, reduce-scatter
        (issued asynchronously with ``overlap_comm``) into the group's :class:`~engine.zero.flat.GradStore` -- the
        collective writes the 16-bit store's slice directly when it can, else the piece is stored when it lands --,
        release the unit."""
        unit = self.table.units[unit_id]
        store = self.stores[unit.group]
        if store.acc is None and unit.index in store.written:  # a second piece widens low -> fp32: land all first
            self._drain_reductions()
        flat = torch.empty(self.padded[unit_id], dtype=self.reduce_dtype, device=self.device)
        pack_unit_grads(unit, self.params, flat)
        self.stats["reduce_scatters"] += 1
        if self.ws == 1:
            store.add(unit, flat[:unit.slice_numel])
        else:
            direct = store.direct_slice(unit, self.device)
            piece = direct if direct is not None else torch.empty(unit.slice_numel, dtype=self.reduce_dtype,
                                                                  device=self.device)
            handle = comm.reduce_scatter_(piece, flat, async_op=self.opts.overlap_comm)
            finish = None if direct is not None else functools.partial(store.add, unit, piece)
            self._reductions.push(handle, flat.numel(), finish, keep=(piece, flat),
                                  limit=self.opts.reduce_bucket_size)
        self._pending[unit_id].clear()
        self._reduced[unit_id] = True
        self._release_unless_reused(unit_id)


    def _drain_reductions(self) -> None:
        self._reductions.drain()

    # -- engine-facing protocol ---------------------------------------------------------------------------------
    def after_backward(self, boundary: bool = True) -> None:
        """Flush units whose gradients did not all arrive (unused parameters), in unit order; end the pass; release
        every unit not held by a user context. At the boundary reduce-scatters may still be in flight (see
        reduce_at_boundary); when more micro-steps follow they are finished and the 16-bit stores widened to fp32,
        so micro-steps accumulate in fp32 (as stage 2)."""
        for unit_id, unit in enumerate(self.table.units):
            if unit.group < self.num_trainable_groups and not self._reduced[unit_id]:
                self._reduce_unit(unit_id)
        self._reduced = [False] * len(self.table.units)
        self.trace.end_pass()
        for unit_id in range(len(self.table.units)):
            self.active[unit_id] = 0
            self._release(unit_id)
        if not boundary:
            self._drain_reductions()
            for store in self.stores:
                store.widen()

    def reduce_at_boundary(self) -> None:
        """Before the optimizer step: wait for the outstanding reduce-scatters (the reductions were issued during
        backward) and store them, oldest first."""
        self._drain_reductions()

    def grad_partitions(self) -> list[torch.Tensor]:
        """This window's flat gradient partitions, one per trainable group: a device store still in the reduce
        dtype is handed over as it is (the optimizer widens it to fp32 one ``sub_group_size`` chunk at a time, so the
        step never holds a whole fp32 copy beside it), otherwise fp32 (made now from the 16-bit host stores); the
        optimizer may scale fp32 ones in place. Released by :meth:`zero_grads`."""
        self._drain_reductions()
        return [store.step_input() for store in self.stores]

    def zero_grads(self) -> None:
        """End the window: drop the gradient stores (their memory is freed)."""
        self._drain_reductions()
        self.stores = self._new_stores()

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of this rank's live gradient buffers (for memory reports and tests)."""
        return gradient_buffer_bytes(self.stores, self.params)

    @torch.no_grad()
    def update_params(self) -> None:
        """Cast masters into the param partitions; re-gather persistent units and units held by a user context
        (issue all, then wait all)."""
        self._settle()
        self._cast_masters()
        stale = [u for u in range(len(self.full)) if self.full[u] is not None]
        for u in stale:
            if not self.persistent[u]:
                self.live_numel -= self.padded[u]
            self.full[u] = None
            self._issue(u)
        for u in stale:
            self._wait(u)
        recorded = self.trace._traces.get(True)  # the training pass: read its first units during the step's tail
        if recorded is not None:
            self._read_ahead(recorded.events)

    def _cast_masters(self) -> None:
        """fp32 masters -> param partitions (skipped when a streamed step already did it chunk by chunk)."""
        if self._streamed_cast:
            self._streamed_cast = False
            return
        if self.files is not None:
            self.files.drop_staged()
        up = self.uploader if self.files is None and self.master_io is None else None
        if up is not None:
            up.begin()
        for g, master in enumerate(self.masters):
            if self.master_io is not None:
                for off, chunk in self.master_io.chunks(g):
                    self._write_part(g, off, chunk)
            elif up is not None:  # host cast into pinned staging, copied without waiting (engine.offload.Uploader)
                up.copy(self.part[g], master, g, 0, master.numel())
            else:
                self._write_part(g, 0, master)
        if up is not None:
            up.end()

    def refresh_after_load(self) -> None:
        self._streamed_cast = False
        self.update_params()

    def close(self) -> None:
        """Remove the parameter files (offload_param nvme)."""
        if self.files is not None:
            self.files.close()

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
        if self.files is not None:
            self.files.drop_staged()
        self._write_part(unit.group, unit.partition_offset, mine)
        if unit.group < self.num_trainable_groups:
            if self.master_io is not None:
                self.master_io.write(unit.group, "fp32_partition", mine, unit.partition_offset)
            else:
                self.masters[unit.group][unit.partition_offset: unit.partition_offset + s].copy_(mine)

    def full_param(self, index: int) -> torch.Tensor:
        """A gathered copy of parameter ``index`` (compute dtype, compute device): one all-gather of its unit."""
        with self.gathered([index]):
            return self.params[index].data.clone()
