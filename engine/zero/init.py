"""``zero.Init`` (partition parameters as modules are built) and ``zero.GatheredParameters`` (gather to read/edit).

``Init`` protocol
-----------------
Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped. When the *outermost* ``__init__`` of an
instance returns (its own ``reset_parameters`` has run), the module's direct parameters that are not partitioned yet
are flattened into one buffer (one per dtype, in practice one), all ranks are made to agree on it (below), and each
rank keeps only its slice (:class:`InitUnit`); ``param.data`` becomes an empty tensor. Children finish their
``__init__`` before their parent, so at most one module's parameters are ever materialised in full.
``engine.initialize`` with stage 3 later re-lays these slices out into its own units, one unit at a time. The wrappers
call whichever ``Init`` is innermost-active; on exit each is undone unless something wrapped it in turn (a class
decorator run on a class created inside the context), where it stays as a pass-through.

Build paths: how the ranks agree
--------------------------------
* **local** (the default). On entry rank 0's generator states (the CPU's and the engine device's) are broadcast
  once (a few KiB) and set on every rank, and factory calls without a device build on the engine's device
  (``torch.cuda.current_device()`` next to a GPU -- as DeepSpeed's ``zero.Init`` -- the CPU otherwise; ``torch.device``
  as a context). Every rank then runs the same init on the same shapes and device from the same generator state, so
  every rank computes the same full buffer and simply keeps its slice: **no collective per module**, no CPU pass. At
  7B on a GPU the init itself is a fraction of a second of kernels; what is left is Python per module. To catch a
  model seeded per rank *inside* the context, or a non-deterministic init, every rank adds each full buffer's fp32
  sum to a running fingerprint (on the device, no synchronisation) and ``__exit__`` compares the fingerprints (one
  all-reduce): a mismatch raises :class:`InitDivergedError`. Result: the gathered model is bit for bit a plain build
  on the engine's device with rank 0's seed (on a CPU-only machine: the plain CPU build). A rank whose own generator
  states differed from rank 0's gets them back, unadvanced, at exit; the others continue from the advanced state as
  after a plain build.
* **match_cpu_build=True**. Modules are built where a plain build puts them (the CPU), and rank 0's values are
  broadcast, one collective per buffer: bit-identical to a plain CPU build also next to a GPU, whatever the ranks'
  seeds. HF's init then runs single-threaded on the CPU of every rank (under torchrun's ``OMP_NUM_THREADS=1``):
  175 s at 7B on 2x H200 where DeepSpeed took 12 s. For tests and reproductions, not for training at scale.

Checkpoint tensors loaded by ``from_pretrained`` (below) are read by rank 0 only and always broadcast.

transformers models: a ``PreTrainedModel``'s ``post_init`` re-initialises weights after its children were partitioned
(``initialize_weights`` -> ``smart_apply`` -> ``_initialize_weights(module)`` -> ``_init_weights(module)``, children
first). While the context is active every ``PreTrainedModel`` class defining ``_initialize_weights`` is wrapped (the
class is recognised by its MRO, so transformers is never imported here and classes created inside the context are
caught too): each call for a module not yet ``_is_hf_initialized`` gathers that module's direct parameters and its
direct non-``PreTrainedModel`` children's (``_init_weights(attn)`` may write ``attn.q_proj.weight``; the same set as
transformers' own ``initialize_weights_zero3``) that are not ``_is_hf_initialized`` themselves (loaded by
``from_pretrained``: transformers' init functions skip them, and its own ZeRO-3 path does not gather them either),
runs the original on every rank with the values on the device, and in the dtype, the module built them in
(:func:`on_build_device`), then re-partitions them: on the local path each rank keeps its own result (the ranks drew
from the same generator state; added to the fingerprint), with ``match_cpu_build`` rank 0's values are broadcast
(``modifier_rank=0``). Peak memory: one module and its direct children, never the whole model.
Every rank runs the same init calls on the same shapes and devices, so the RNGs advance exactly as without ``Init``:
with equal seeds the partitions hold bit-for-bit the values of a model built without ``Init`` on the build device. An
``_init_weights`` that writes parameters deeper than the direct children (a few detection models) writes into
empty tensors there, as in transformers' own ZeRO-3 path; gather those yourself. Other code that re-initialises
weights *after* construction sees empty tensors too: wrap it in ``GatheredParameters(params, modifier_rank=0)``, or
load weights afterwards.

dtype: floating-point parameters are cast to the dtype DeepSpeed's ``zero.Init`` would pick (:func:`init_dtype`:
``dtype=`` if given, else the config's bf16/fp16 section, else float32; no config and no ``dtype``: kept) when their
module is partitioned, i.e. after its own init ran in the built dtype: the partitions hold ``plain.to(dtype)``
values. Buffers and integer parameters keep their dtype. ``engine.initialize`` then builds its fp32 masters from
these (already rounded) values, as DeepSpeed's stage 3 builds its fp32 partitions from the 16-bit ones.

transformers ``from_pretrained`` (``PreTrainedModel`` and the ``Auto`` classes) inside the context builds the model
on the meta device and then loads the checkpoint. While the context is active, ``get_init_context`` adds a marker
under which meta parameters are *deferred* (left unpartitioned; elsewhere a meta parameter is an error),
``_load_pretrained_model`` is replaced by :func:`engine.zero.pretrained.load_into_partitions` (one module at a time:
rank 0 reads that module's tensors from the checkpoint, the unit is broadcast and partitioned) and
``_finalize_model_loading`` partitions what transformers initialised or materialised afterwards (missing keys).

``GatheredParameters(params, modifier_rank=None)`` (:mod:`engine.zero.gathered`, re-exported here): all-gathers the
units holding ``params`` (one all-gather per unit); on exit, when ``modifier_rank`` is given, that rank's values are
broadcast and re-partitioned (also into the fp32 master once an engine owns the parameters); then the units are
released. Plain (non-partitioned) tensors pass through untouched, as in DeepSpeed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from engine import comm
from engine.config_keys import AUTO, ConfigError
from engine.partition import build_partition
from engine.zero.gathered import GatheredParameters  # noqa: F401  (re-exported: DeepSpeed's zero namespace)
from engine.zero.pretrained import finalize_partitions, load_into_partitions

_ACTIVE: list["Init"] = []


def _fingerprint_add(fingerprint: torch.Tensor, full: torch.Tensor) -> None:
    """Add a unit's values to the running fingerprint: their fp32 sum (deterministic for a given shape, device and
    thread count; a float64 sum would cost 30x more on the CPU), NaN/inf made finite so that equal values compare
    equal."""
    fingerprint.add_(torch.nan_to_num(full.sum(dtype=torch.float32), nan=0.0, posinf=1e30, neginf=-1e30))


class InitUnit:
    """The direct parameters of one module, partitioned at construction time (one slice per rank)."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, store_device: torch.device,
                 built_dtypes: list[torch.dtype] | None = None, fingerprint: torch.Tensor | None = None):
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.built_on = [p.device for p in params]  # where the module made them (CPU unless built under a device)
        # the dtype the module made them in, before Init's cast: HF's init re-runs in it (see on_build_device)
        self.built_dtypes = built_dtypes or [p.dtype for p in params]
        self.dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
        self.ws, self.rank, self.device = comm.world_size(), comm.rank(), device
        table = build_partition([p.numel() for p in params], [0] * len(params), [list(range(len(params)))], self.ws)
        self.unit = table.units[0]
        buf = torch.zeros(self.unit.padded_numel(self.ws), dtype=self.dtype, device=device)
        for slot, p in zip(self.unit.params, params):
            buf[slot.offset: slot.offset + slot.numel].copy_(p.data.reshape(-1))
        # fingerprint given: every rank computed these values itself (Init's local path), no broadcast
        self.fingerprint = fingerprint
        self._agree(buf)
        s = self.unit.slice_numel
        self.slice = buf[self.rank * s:(self.rank + 1) * s].to(store_device, copy=True)
        self.full: torch.Tensor | None = None
        self.users = 0
        for i, (slot, p) in enumerate(zip(self.unit.params, params)):
            p.data = torch.empty(0, dtype=p.dtype, device=device)
            p.ds_shape, p.ds_numel = self.shapes[i], slot.numel
            p._zero_mgr, p._zero_index = self, i
            p._zero_init_store, p._zero_init_slot = self, i

    def _agree(self, full: torch.Tensor) -> None:
        """Make all ranks hold the same full values: rank 0's (one broadcast), or, on the local path, each rank's own
        -- equal by construction, checked once at ``Init`` exit through the running fingerprint (no collective)."""
        if self.fingerprint is None:
            comm.broadcast_(full, 0)
        else:
            _fingerprint_add(self.fingerprint, full)

    def gather_full(self) -> torch.Tensor:
        """One all-gather: the unit's full flat buffer (not attached to the parameters)."""
        full = torch.empty(self.unit.padded_numel(self.ws), dtype=self.dtype, device=self.device)
        comm.all_gather_(full, self.slice.to(self.device))
        return full

    def param_view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        slot = self.unit.params[i]
        return full[slot.offset: slot.offset + slot.numel].view(self.shapes[i])

    @contextlib.contextmanager
    def gathered(self, indices, modifier_rank: int | None = None, keep_own: bool = False):
        """Gather the unit; on exit write the parameters back and re-slice: broadcast from ``modifier_rank``, or,
        with ``keep_own`` (every rank edited identically: Init's local path), each rank its own values."""
        if self.full is None:
            self.full = self.gather_full()
            for i, p in enumerate(self.params):
                p.data = self.param_view(self.full, i).to(p.dtype)
        self.users += 1
        try:
            yield
        finally:
            self.users -= 1
            if modifier_rank is not None or keep_own:
                for i, p in enumerate(self.params):
                    slot = self.unit.params[i]
                    self.full[slot.offset: slot.offset + slot.numel].copy_(p.data.reshape(-1))
                if keep_own and self.fingerprint is not None:
                    _fingerprint_add(self.fingerprint, self.full)
                elif keep_own:
                    comm.broadcast_(self.full, 0)
                else:
                    comm.broadcast_(self.full, modifier_rank)
                s = self.unit.slice_numel
                self.slice.copy_(self.full[self.rank * s:(self.rank + 1) * s])
            if self.users == 0:
                for p in self.params:
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                self.full = None


@contextlib.contextmanager
def on_build_device(params):
    """While ``params`` are gathered: hold the ``zero.Init`` ones on the device, and in the dtype, their module built
    them in, so code run now (HF's init) computes -- and draws random numbers -- as a plain build would (``normal_``
    on a CUDA bf16 tensor draws other values than on fp32 and casting); moved and cast back after (``.to`` rounding),
    for the enclosing ``GatheredParameters(modifier_rank=...)`` to write into the unit. Others are left alone."""
    moved = []
    for p in params:
        store = p.__dict__.get("_zero_init_store")
        if store is None or store.full is None:
            continue
        slot = p._zero_init_slot
        device, dtype = store.built_on[slot], store.built_dtypes[slot]
        if p.device != device or p.dtype != dtype:
            moved.append((p, p.device, p.dtype))
            p.data = p.data.to(device=device, dtype=dtype)
    try:
        yield
    finally:
        for p, device, dtype in moved:
            p.data = p.data.to(device=device, dtype=dtype)


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
        params = [p for p in _hf_init_weights_params(module) if not getattr(p, "_is_hf_initialized", False)]
        with _gathered_for_init(params), on_build_device(params):
            return orig(model, module, *args, **kwargs)
    wrapper._zero_wrapped = True
    return wrapper


@contextlib.contextmanager
def _gathered_for_init(params):
    """``GatheredParameters(params, modifier_rank=0)`` for init code run on every rank, except that on ``Init``'s
    local path each ``zero.Init`` unit keeps every rank's own result (the ranks computed the same values from the same
    generator states; the fingerprint checks it at exit) instead of receiving rank 0's: no broadcast."""
    init = _active()
    if init is None or not init.local:
        with GatheredParameters(params, modifier_rank=0):
            yield
        return
    by_mgr: dict = {}
    for p in params:
        mgr = p.__dict__.get("_zero_mgr")
        if mgr is not None:
            by_mgr.setdefault(id(mgr), (mgr, []))[1].append(p._zero_index)
    with contextlib.ExitStack() as stack:
        for mgr, indices in by_mgr.values():
            own = isinstance(mgr, InitUnit)
            stack.enter_context(mgr.gathered(indices, None if own else 0, **({"keep_own": True} if own else {})))
        yield


def _active() -> "Init | None":
    return _ACTIVE[-1] if _ACTIVE else None


def _deferred(model: nn.Module) -> bool:
    return any(m.__dict__.get("_zero_init_deferred") for m in model.modules())


def _hf_get_init_context(orig: classmethod) -> classmethod:
    """``PreTrainedModel.get_init_context`` (classmethod): transformers' contexts for from_pretrained's build (meta
    device, default dtype, no tying) plus :meth:`Init.deferring_meta`, so the meta parameters wait to be loaded."""
    func = orig.__func__

    @functools.wraps(func)
    def wrapper(cls, *args, **kwargs):
        contexts = list(func(cls, *args, **kwargs))
        init = _active()
        return contexts + [init.deferring_meta()] if init is not None else contexts
    return _marked(classmethod(wrapper))


def _hf_loading_step(hook: Callable) -> Callable:
    """Wrap a ``PreTrainedModel`` loading step, a static- or classmethod (transformers 5 releases differ), as
    ``hook(original, *args, **kwargs)``; ``original`` is the bound original."""

    def wrap(orig):
        func = orig.__func__
        if isinstance(orig, classmethod):
            @functools.wraps(func)
            def bound(cls, *args, **kwargs):
                return hook(functools.partial(func, cls), *args, **kwargs)
            return _marked(classmethod(bound))

        @functools.wraps(func)
        def static(*args, **kwargs):
            return hook(func, *args, **kwargs)
        return _marked(staticmethod(static))
    return wrap


@_hf_loading_step
def _hf_load_pretrained_model(original, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    """``_load_pretrained_model``: for a model built under ``Init`` with deferred meta parameters,
    :func:`engine.zero.pretrained.load_into_partitions` instead (same return: ``(loading_info, offload index)``)."""
    init = _active()
    if init is None or not _deferred(model):
        return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    with init.plain_placement():
        return load_into_partitions(init, model, state_dict, checkpoint_files, load_config), None


@_hf_loading_step
def _hf_finalize_model_loading(original, model, load_config, loading_info, *args, **kwargs):
    """``_finalize_model_loading`` (tie, initialise missing keys): then partition what it materialised."""
    init = _active()
    if init is None or not model.__dict__.get("_zero_init_loaded"):
        return original(model, load_config, loading_info, *args, **kwargs)
    with init.plain_placement():
        return finalize_partitions(init, model, loading_info,
                                   functools.partial(original, model, load_config, loading_info, *args, **kwargs))


def _marked(wrapper):
    wrapper._zero_wrapped = True
    return wrapper


#: ``PreTrainedModel`` members wrapped while an ``Init`` is active, on every class defining them as the expected
#: kind of attribute: name -> (kinds, wrapper).
_HF_WRAPPERS = {"_initialize_weights": (types.FunctionType, _gathered_hf_initialize_weights),
                "get_init_context": (classmethod, _hf_get_init_context),
                "_load_pretrained_model": ((staticmethod, classmethod), _hf_load_pretrained_model),
                "_finalize_model_loading": ((staticmethod, classmethod), _hf_finalize_model_loading)}

_INIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def init_dtype(config=None, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype ``Init`` gives floating-point parameters; DeepSpeed's rule, from
    ``InsertPostInitMethodToModuleSubClasses._set_dtype`` (deepspeed/runtime/zero/partition_parameters.py):

    * ``dtype`` given: that dtype (float16, bfloat16 or float32, which DeepSpeed asserts);
    * else a config given (dict, JSON path or :class:`engine.config.EngineConfig`): bfloat16 if ``bf16.enabled``
      (legacy key ``bfloat16``, read only when ``bf16`` is absent, as ``get_bfloat16_config``), else float16 if
      ``fp16.enabled``, else float32; both enabled is an error;
    * neither: ``None``, the parameters keep the dtype they were built in. Here DeepSpeed picks float16 if the
      accelerator supports it (bfloat16, float32 otherwise); we keep the model's dtype instead.

    One more deviation: DeepSpeed's ``dtype or torch.float16 if fp16_supported else ...`` drops an explicit ``dtype``
    on accelerators without fp16 (operator precedence); here an explicit ``dtype`` always wins.
    """
    if dtype is not None:
        if dtype not in _INIT_DTYPES:
            raise ValueError(f"zero.Init(dtype={dtype}) is not supported; use torch.float16, torch.bfloat16 or "
                             "torch.float32 (as DeepSpeed), or leave dtype=None to keep the model's dtype")
        return dtype
    if config is None:
        return None
    bf16, fp16 = _precision_flags(config)
    if bf16 and fp16:
        raise ConfigError("bf16.enabled=true and fp16.enabled=true; enable at most one of them (zero.Init picks the "
                          "parameter dtype from them)")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def _precision_flags(config) -> tuple[bool, bool]:
    """``(bf16.enabled, fp16.enabled)`` of a DeepSpeed-style config, without resolving the rest of it."""
    from engine.config import EngineConfig, _read

    if isinstance(config, EngineConfig):
        return config.bf16.enabled, config.fp16.enabled
    if not isinstance(config, (Mapping, str, os.PathLike)):
        raise ConfigError(f"zero.Init(config=...) must be a dict, a path to a DeepSpeed JSON file or an EngineConfig, "
                          f"got {type(config).__name__}")
    raw = _read(config)
    flags = []
    for key in ("bf16", "fp16"):
        section: Any = raw.get(key, {})
        if key == "bf16" and raw.get("bf16") is None:  # get_bfloat16_config: "bf16", else the legacy "bfloat16"
            section = raw.get("bfloat16", {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"{key} must be a JSON object such as {{\"enabled\": true}}, got {section!r}")
        enabled = section.get("enabled", False)
        if enabled == AUTO:
            raise ConfigError(f"{key}.enabled is \"auto\" but zero.Init has no training_args to resolve it; pass the "
                              "resolved config (engine.config.load_config(cfg, training_args=...).to_dict()) or "
                              "dtype=")
        if not isinstance(enabled, bool):
            raise ConfigError(f"{key}.enabled={enabled!r} must be true or false")
        flags.append(enabled)
    return flags[0], flags[1]


class InitDivergedError(RuntimeError):
    """Ranks computed different initial values on ``Init``'s local path (each rank keeps its own slice)."""


class _SharedRng:
    """Every rank draws from rank 0's generators while ``Init`` builds on the local path: the CPU generator and the
    build device's, their states broadcast once at entry (a few KiB). A rank whose own states differed (ranks seeded
    differently) gets them back, unadvanced, at exit; the others keep the advanced shared state, as after a plain
    build."""

    def __init__(self, device: torch.device):
        self.device = device
        self.own = self._get()
        on = _control_device(device)
        shared = [comm.broadcast_(state.to(on, copy=True), 0).cpu() for state in self.own]
        self.differed = any(not torch.equal(a, b) for a, b in zip(self.own, shared))
        if self.differed:
            self._set(shared)

    def _get(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    def _set(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(states[1], self.device)

    def restore(self) -> None:
        if self.differed:
            self._set(self.own)


def _control_device(device: torch.device) -> torch.device:
    """Where small collectives go: the NCCL device when the group is NCCL, else the CPU."""
    return device if device.type == "cuda" and comm.is_initialized() and comm.world_size() > 1 else torch.device("cpu")


class Init:
    """Context manager: construct a model with its parameters partitioned across ranks (ZeRO-3).

    Accepts DeepSpeed's keyword arguments (``config_dict_or_path``, ``config``, ``remote_device``, ``enabled``,
    ``dtype``, ...); ``remote_device="cpu"`` keeps the slices on CPU. Floating-point parameters are cast to
    :func:`init_dtype` (``config`` wins over ``config_dict_or_path``, as in DeepSpeed).

    Two build paths (see the module docstring):

    * default, *local*: modules are built on the engine's device (``torch.cuda.current_device()`` next to a GPU, the
      CPU otherwise), every rank drawing from rank 0's generator states, and each rank keeps its slice of the values
      it computed itself: no broadcast, no CPU pass. The gathered model equals a plain build on that device with
      rank 0's seed (bit for bit: on the CPU, the plain CPU build).
    * ``match_cpu_build=True``: modules are built on the CPU, where a plain build puts them, and rank 0's values are
      broadcast (one collective per module): bit-identical to a plain CPU build also next to a GPU, whatever the
      ranks' seeds. Slow at scale (HF's init single-threaded on the CPU on every rank); meant for tests.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 match_cpu_build: bool = False, **_ignored):
        self.enabled = enabled
        self.remote_device = remote_device
        self.dtype = init_dtype(config if config is not None else config_dict_or_path, dtype)
        self.local = not match_cpu_build
        self._saved: list = []
        self._meta_builds = 0  # > 0 while transformers' from_pretrained builds a model on the meta device

    def __enter__(self):
        if not self.enabled:
            return self
        ctx = comm.init_distributed()
        self.device = ctx.device
        self.store_device = torch.device("cpu") if self.remote_device in ("cpu", "nvme") else ctx.device
        self._fingerprint = self._rng = self._device_mode = None
        if self.local:
            self._fingerprint = torch.zeros((), dtype=torch.float64, device=self.device)
            self._rng = _SharedRng(self.device)
            if self.device.type != "cpu":  # factory calls without a device build on the accelerator (as DeepSpeed)
                self._device_mode = torch.device(self.device)
                self._device_mode.__enter__()
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
        for cls, name, orig, ours in reversed(self._saved):
            # Put the original back only where our wrapper is still in place: a class decorator that ran after the
            # class was created here (transformers' use_experts_implementation wraps __init__) wrapped *ours*,
            # and restoring the bare original would drop its code. Left behind, our wrapper is a pass-through.
            if cls.__dict__.get(name) is ours:
                setattr(cls, name, orig)
        self._saved = []
        had, orig = self._saved_init_subclass
        if had:
            nn.Module.__init_subclass__ = orig
        else:
            del nn.Module.__init_subclass__
        if self.local:
            if self._device_mode is not None:
                self._device_mode.__exit__(None, None, None)
            self._rng.restore()
            if exc[0] is None:
                self._check_fingerprint()
        return False

    def _check_fingerprint(self) -> None:
        """One all-reduce: the running sum of every full unit this rank kept a slice of (:func:`_fingerprint_add`)
        must be the same on every rank, else the slices come from different models."""
        if comm.world_size() == 1:
            return
        both = torch.stack([self._fingerprint, -self._fingerprint]).to(_control_device(self.device))
        comm.all_reduce_(both, "max")
        hi, lo = both.tolist()
        if hi != -lo:
            raise InitDivergedError(
                f"zero.Init: ranks computed different initial parameters (fingerprints {-lo!r} .. {hi!r}), although "
                "they started from rank 0's generator states: the model was seeded per rank inside the context, or "
                "its init is not deterministic. Seed every rank alike, or build with zero.Init(..., "
                "match_cpu_build=True) (rank 0's values broadcast)")

    def _patch(self, cls) -> None:
        self._patch_init(cls)
        if not _is_hf_pretrained_model(cls):
            return
        for name, (kind, wrap) in _HF_WRAPPERS.items():
            orig = cls.__dict__.get(name)
            if isinstance(orig, kind) and not getattr(orig, "_zero_wrapped", False):
                setattr(cls, name, wrap(orig))
                self._saved.append((cls, name, orig, cls.__dict__[name]))

    def _patch_init(self, cls) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or getattr(orig, "_zero_wrapped", False):
            return

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
                init = _active()  # the innermost active context (a wrapper left behind by __exit__ may outlive its own)
                if init is not None:
                    init._partition_module(module)
        wrapper._zero_wrapped = True
        cls.__init__ = wrapper
        self._saved.append((cls, "__init__", orig, wrapper))

    def _partition_module(self, module: nn.Module) -> None:
        params = [p for p in module._parameters.values()
                  if p is not None and p.__dict__.get("_zero_mgr") is None]
        if any(p.is_meta for p in params):
            if not self._meta_builds:
                names = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
                raise RuntimeError(f"zero.Init cannot partition {type(module).__name__}.{names[0]}: it is on the meta "
                                   "device (no data). Build the model on a real device inside zero.Init, or load it "
                                   "with transformers' from_pretrained, which zero.Init streams into partitions")
            module.__dict__["_zero_init_deferred"] = True  # loaded by engine.zero.pretrained, then partitioned
            params = [p for p in params if not p.is_meta]
        self._partition(params, from_rank0=not self.local)

    def partition(self, params: list[nn.Parameter]) -> None:
        """Cast ``params`` (one module's, full and not yet partitioned) to :attr:`dtype` if floating-point and
        partition them: one unit per dtype (an integer parameter never shares a flat buffer with floats), each
        broadcast from rank 0 (loaded checkpoints: only rank 0 read them), this rank's slice kept."""
        self._partition(params, from_rank0=True)

    def _partition(self, params: list[nn.Parameter], from_rank0: bool) -> None:
        """:meth:`partition`; with ``from_rank0`` false on the local path, each rank keeps its slice of the values it
        computed itself (no collective; added to the fingerprint checked at exit)."""
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.dtype]]] = {}
        for p in params:
            built = p.dtype
            if self.dtype is not None and p.is_floating_point():
                p.data = p.data.to(self.dtype)
            by_dtype.setdefault(p.dtype, []).append((p, built))
        fingerprint = None if from_rank0 or not self.local else self._fingerprint
        for group in by_dtype.values():
            InitUnit([p for p, _ in group], self.device, self.store_device, [b for _, b in group], fingerprint)

    def plain_placement(self):
        """Suspend the local path's default device while ``from_pretrained`` loads (tensors land where a plain load
        puts them; missing keys are initialised as a plain load does, on the CPU, then broadcast from rank 0)."""
        return torch.device("cpu") if self._device_mode is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def deferring_meta(self):
        """Entered by the patched ``get_init_context`` around transformers' meta-device build."""
        self._meta_builds += 1
        try:
            yield
        finally:
            self._meta_builds -= 1
