"""``zero.Init`` (partition parameters as modules are built) and ``zero.GatheredParameters`` (gather to read/edit).

``Init`` protocol
-----------------
Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped. When the *outermost* ``__init__`` of an
instance returns (its own ``reset_parameters`` has run), the module's direct parameters that are not partitioned yet
are flattened into one buffer, broadcast from rank 0 (one collective per module: all ranks agree on the initial
values), and each rank keeps only its slice (:class:`InitUnit`); ``param.data`` becomes an empty tensor. Children
finish their ``__init__`` before their parent, so at most one module's parameters are ever materialised in full.
``engine.initialize`` with stage 3 later re-lays these slices out into its own units, one unit at a time.

transformers models: a ``PreTrainedModel``'s ``post_init`` re-initialises weights after its children were partitioned
(``initialize_weights`` -> ``smart_apply`` -> ``_initialize_weights(module)`` -> ``_init_weights(module)``, children
first). While the context is active every ``PreTrainedModel`` class defining ``_initialize_weights`` is wrapped (the
class is recognised by its MRO, so transformers is never imported here and classes created inside the context are
caught too): each call for a module not yet ``_is_hf_initialized`` gathers that module's direct parameters and its
direct non-``PreTrainedModel`` children's (``_init_weights(attn)`` may write ``attn.q_proj.weight``; the same set as
transformers' own ``initialize_weights_zero3``), runs the original on every rank with the values on the device the
module built them on (CPU, also next to a GPU: :func:`on_build_device`), then broadcasts rank 0's values and
re-partitions them (``modifier_rank=0``). Peak memory: one module and its direct children, never the whole model.
Every rank runs the same init calls on the same shapes and devices, so the RNGs advance exactly as without ``Init``:
with equal seeds the partitions hold bit-for-bit the values of a model built without ``Init``. An
``_init_weights`` that writes parameters deeper than the direct children (a few detection models) writes into
empty tensors there, as in transformers' own ZeRO-3 path; gather those yourself. Other code that re-initialises
weights *after* construction sees empty tensors too: wrap it in ``GatheredParameters(params, modifier_rank=0)``, or
load weights afterwards.

``GatheredParameters(params, modifier_rank=None)``: all-gathers the units holding ``params`` (one all-gather per
unit); on exit, when ``modifier_rank`` is given, that rank's values are broadcast and re-partitioned (also into the
fp32 master once an engine owns the parameters); then the units are released. Plain (non-partitioned) tensors pass
through untouched, as in DeepSpeed.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from engine import comm
from engine.partition import build_partition

_ACTIVE: list["Init"] = []


class InitUnit:
    """The direct parameters of one module, partitioned at construction time (one slice per rank)."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, store_device: torch.device):
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.built_on = [p.device for p in params]  # where the module made them (CPU unless built under a device)
        self.dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
        self.ws, self.rank, self.device = comm.world_size(), comm.rank(), device
        table = build_partition([p.numel() for p in params], [0] * len(params), [list(range(len(params)))], self.ws)
        self.unit = table.units[0]
        buf = torch.zeros(self.unit.padded_numel(self.ws), dtype=self.dtype, device=device)
        for slot, p in zip(self.unit.params, params):
            buf[slot.offset: slot.offset + slot.numel].copy_(p.data.reshape(-1))
        comm.broadcast_(buf, 0)
        s = self.unit.slice_numel
        self.slice = buf[self.rank * s:(self.rank + 1) * s].to(store_device, copy=True)
        self.full: torch.Tensor | None = None
        self.users = 0
        for i, (slot, p) in enumerate(zip(self.unit.params, params)):
            p.data = torch.empty(0, dtype=p.dtype, device=device)
            p.ds_shape, p.ds_numel = self.shapes[i], slot.numel
            p._zero_mgr, p._zero_index = self, i
            p._zero_init_store, p._zero_init_slot = self, i

    def gather_full(self) -> torch.Tensor:
        """One all-gather: the unit's full flat buffer (not attached to the parameters)."""
        full = torch.empty(self.unit.padded_numel(self.ws), dtype=self.dtype, device=self.device)
        comm.all_gather_(full, self.slice.to(self.device))
        return full

    def param_view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        slot = self.unit.params[i]
        return full[slot.offset: slot.offset + slot.numel].view(self.shapes[i])

    @contextlib.contextmanager
    def gathered(self, indices, modifier_rank: int | None = None):
        if self.full is None:
            self.full = self.gather_full()
            for i, p in enumerate(self.params):
                p.data = self.param_view(self.full, i).to(p.dtype)
        self.users += 1
        try:
            yield
        finally:
            self.users -= 1
            if modifier_rank is not None:
                for i, p in enumerate(self.params):
                    slot = self.unit.params[i]
                    self.full[slot.offset: slot.offset + slot.numel].copy_(p.data.reshape(-1))
                comm.broadcast_(self.full, modifier_rank)
                s = self.unit.slice_numel
                self.slice.copy_(self.full[self.rank * s:(self.rank + 1) * s])
            if self.users == 0:
                for p in self.params:
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                self.full = None


@contextlib.contextmanager
def on_build_device(params):
    """While ``params`` are gathered: hold the ``zero.Init`` ones on the device their module built them on, so code
    run now (HF's init) computes -- and draws random numbers -- where a plain build would; moved back after, for the
    enclosing ``GatheredParameters(modifier_rank=...)`` to write into the unit. Others are left alone."""
    moved = []
    for p in params:
        store = p.__dict__.get("_zero_init_store")
        if store is not None and store.full is not None and p.device != store.built_on[p._zero_init_slot]:
            moved.append((p, p.device))
            p.data = p.data.to(store.built_on[p._zero_init_slot])
    try:
        yield
    finally:
        for p, device in moved:
            p.data = p.data.to(device)


def full_data_of(param: nn.Parameter, cache: dict) -> tuple[torch.Tensor, bool]:
    """The full value of ``param``: its ``.data``, or, for a ``zero.Init`` parameter, its view in the (cached)
    all-gathered :class:`InitUnit` buffer. Cache entries are dropped once all their parameters were read."""
    store = param.__dict__.get("_zero_init_store")
    if store is None or store.full is not None:
        return param.data, store is not None
    key = id(store)
    if key not in cache:
        cache[key] = [store.gather_full(), set()]
    full, seen = cache[key]
    i = param._zero_init_slot
    seen.add(i)
    view = store.param_view(full, i)
    if len(seen) == len(store.params):
        del cache[key]
    return view, True


def materialize(params) -> None:
    """Turn ``zero.Init`` parameters back into ordinary full tensors (for stages 0-2), one module unit at a time."""
    stores = {}
    for p in params:
        store = p.__dict__.get("_zero_init_store")
        if store is not None:
            stores.setdefault(id(store), store)
    for store in stores.values():
        full = store.gather_full()
        for i, p in enumerate(store.params):
            p.data = store.param_view(full, i).clone()
            for attr in ("_zero_mgr", "_zero_index", "_zero_init_store", "_zero_init_slot", "ds_shape", "ds_numel"):
                p.__dict__.pop(attr, None)


def _all_subclasses(cls):
    out, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _is_hf_pretrained_model(cls: type) -> bool:
    """``cls`` is transformers' ``PreTrainedModel`` or a subclass, judged by name so transformers is not imported."""
    return any(c.__module__ == "transformers.modeling_utils" and c.__qualname__ == "PreTrainedModel"
               for c in cls.__mro__)


def _hf_init_weights_params(module: nn.Module) -> list[nn.Parameter]:
    """What ``_init_weights(module)`` may write: ``module``'s direct parameters and those of its direct children that
    are not models of their own (``smart_apply`` hands those their own init), each once (tied ones included)."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not _is_hf_pretrained_model(type(child)):
            params.extend(child.parameters(recurse=False))
    return list({id(p): p for p in params}.values())


def _gathered_hf_initialize_weights(orig: Callable) -> Callable:
    """Wrap ``PreTrainedModel._initialize_weights(self, module, ...)`` to run on gathered full parameters."""

    @functools.wraps(orig)
    def wrapper(model, module, *args, **kwargs):
        if getattr(module, "_is_hf_initialized", False):  # already done (an outer model's post_init walks it again)
            return orig(model, module, *args, **kwargs)
        params = _hf_init_weights_params(module)
        with GatheredParameters(params, modifier_rank=0), on_build_device(params):
            return orig(model, module, *args, **kwargs)
    wrapper._zero_wrapped = True
    return wrapper


class Init:
    """Context manager: construct a model with its parameters partitioned across ranks (ZeRO-3).

    Accepts DeepSpeed's keyword arguments (``config_dict_or_path``, ``config``, ``remote_device``, ``enabled``,
    ``dtype``, ...); ``remote_device="cpu"`` keeps the slices on CPU.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **_ignored):
        self.enabled = enabled
        self.remote_device = remote_device
        self.dtype = dtype
        self._saved: list = []

    def __enter__(self):
        if not self.enabled:
            return self
        ctx = comm.init_distributed()
        self.device = ctx.device
        self.store_device = torch.device("cpu") if self.remote_device in ("cpu", "nvme") else ctx.device
        for cls in _all_subclasses(nn.Module):
            self._patch(cls)
        had = "__init_subclass__" in nn.Module.__dict__
        self._saved_init_subclass = (had, nn.Module.__dict__.get("__init_subclass__"))
        patcher = self._patch

        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patcher(cls)
        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        _ACTIVE.remove(self)
        for cls, name, orig in reversed(self._saved):
            setattr(cls, name, orig)
        self._saved = []
        had, orig = self._saved_init_subclass
        if had:
            nn.Module.__init_subclass__ = orig
        else:
            del nn.Module.__init_subclass__
        return False

    def _patch(self, cls) -> None:
        self._patch_init(cls)
        orig = cls.__dict__.get("_initialize_weights")
        if orig is not None and not getattr(orig, "_zero_wrapped", False) and _is_hf_pretrained_model(cls):
            cls._initialize_weights = _gathered_hf_initialize_weights(orig)
            self._saved.append((cls, "_initialize_weights", orig))

    def _patch_init(self, cls) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zero_wrapped", False):
            return
        init = self

        @functools.wraps(orig)
        def wrapper(module, *args, **kwargs):
            depth = module.__dict__.get("_zero_init_depth", 0)
            module.__dict__["_zero_init_depth"] = depth + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_zero_init_depth"] = depth
            if depth == 0:
                module.__dict__.pop("_zero_init_depth", None)
                if _ACTIVE and _ACTIVE[-1] is init:
                    init._partition_module(module)
        wrapper._zero_wrapped = True
        cls.__init__ = wrapper
        self._saved.append((cls, "__init__", orig))

    def _partition_module(self, module: nn.Module) -> None:
        params = [p for p in module._parameters.values()
                  if p is not None and p.__dict__.get("_zero_mgr") is None]
        if self.dtype is not None:
            for p in params:
                if p.is_floating_point():
                    p.data = p.data.to(self.dtype)
        if params:
            InitUnit(params, self.device, self.store_device)


class GatheredParameters:
    """Gather partitioned parameters for reading or editing (DeepSpeed ``zero.GatheredParameters``)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if not self.enabled:
            return self
        by_mgr: dict = {}
        for p in self.params:
            mgr = p.__dict__.get("_zero_mgr")
            if mgr is not None:
                by_mgr.setdefault(id(mgr), (mgr, []))[1].append(p._zero_index)
        for mgr, indices in by_mgr.values():
            self._stack.enter_context(mgr.gathered(indices, self.modifier_rank))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
