"""transformers ``from_pretrained`` inside ``engine.zero.Init``: the checkpoint streamed into partitions, one module
at a time.

transformers 5 builds the model on the meta device (``PreTrainedModel.get_init_context``), then
``_load_pretrained_model`` reads the checkpoint into it and ``_finalize_model_loading`` ties weights and initialises
the keys the checkpoint lacks. While ``Init`` is active (see :mod:`engine.zero.init`) the meta build is kept --
nothing is allocated and nothing communicated while the model is constructed -- and the two loading steps become:

1. :func:`load_into_partitions`, instead of ``_load_pretrained_model``.

   * Plan (every rank, file headers only): each checkpoint key is renamed as transformers renames it (the model's
     ``weight_mapping``: ``WeightRenaming`` / ``WeightConverter`` entries, then the ``base_model_prefix`` rule,
     via transformers' own ``rename_source_key``) to the model key it loads. Shapes are checked against the meta
     parameters: a mismatch is reported as transformers reports it and the key stays unloaded. A
     ``WeightConverter`` (e.g. per-expert MoE weights fused into one tensor) becomes a group with its predicted
     target keys.
   * Load, module by module in ``named_modules`` order: rank 0 reads the module's tensors (safetensors
     ``safe_open``, one tensor at a time; ``.bin`` files memory-mapped) and casts each to the dtype transformers
     would give it -- except floating-point *parameters* when ``Init`` has a dtype: those go from the checkpoint
     straight to it, as DeepSpeed copies the checkpoint into parameters its ``zero.Init`` already cast. The other
     ranks allocate empty tensors of the same shape and dtype. The loaded parameters become new ``nn.Parameter``
     objects (as transformers' ``set_param_for_module`` makes them), flagged ``_is_hf_initialized``, and the
     module's are partitioned at once (:meth:`Init.partition`: one broadcast from rank 0, this rank's slice kept).
     Checkpoint buffers are broadcast whole. A converter group is realised on rank 0 when the first of its targets
     is needed; rank 0 then broadcasts the produced names, shapes and dtypes (one small JSON message) so that every
     rank agrees on what is loaded, and the outputs wait in a cache until their module comes.

2. :func:`finalize_partitions`, around transformers' own ``_finalize_model_loading``: tied keys, missing keys moved
   off the meta device and initialised (the ``_initialize_weights`` wrapper of ``Init`` gathers only parameters not
   ``_is_hf_initialized``, i.e. not loaded), tying. A tied pair present in the checkpoint under both names is
   gathered meanwhile so transformers' equality check compares values. Then every parameter still whole (the
   initialised missing keys) is partitioned; one left on the meta device is an error.

Peak memory per rank: one module's parameters (twice: the loaded tensors and the flat unit buffer), plus converter
outputs waiting for their module; never the whole model. Every rank opens the checkpoint's headers; only rank 0
reads tensor bytes. Refused: ``device_map``, quantization (also GGUF), tensor/pipeline parallel plans. Legacy
(non-zip) ``.bin`` files are read whole on rank 0; a ``state_dict=`` argument is used as given.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from engine import comm
from engine.zero.gathered import GatheredParameters


def load_into_partitions(init, model: nn.Module, state_dict, checkpoint_files, load_config):
    """``PreTrainedModel._load_pretrained_model`` for a model built on the meta device under ``init``: returns
    transformers' ``LoadStateDictInfo`` (missing / unexpected / mismatched keys, conversion errors)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    _refuse_unsupported(model, load_config)
    info = LoadStateDictInfo(missing_keys=set(model.state_dict().keys()), unexpected_keys=set(),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    checkpoint = _Checkpoint(state_dict, checkpoint_files, reader=comm.rank() == 0)
    try:
        plan = _Plan(model, checkpoint, load_config, init.dtype, info)
        _Loader(init, model, checkpoint, plan, info).run()
    finally:
        checkpoint.close()
    _back_to_meta(model, info)
    # as convert_and_load_state_dict_in_model: save_pretrained reverts the conversions that were used
    model._weight_conversions = [c for c in load_config.weight_mapping or [] if c.was_used()]
    for module in model.modules():
        module.__dict__.pop("_zero_init_deferred", None)
    model.__dict__["_zero_init_loaded"] = True
    return info


def finalize_partitions(init, model: nn.Module, loading_info, finalize: Callable[[], Any]):
    """Run transformers' ``_finalize_model_loading`` (``finalize``), then partition what it materialised."""
    model.__dict__.pop("_zero_init_loaded", None)
    with GatheredParameters(_tied_pairs_in_checkpoint(model, loading_info)):
        result = finalize()
    stuck, seen = [], set()
    for name, module in model.named_modules():
        fresh = []
        for attr, p in module._parameters.items():
            if p is None or id(p) in seen or p.__dict__.get("_zero_mgr") is not None:
                continue
            seen.add(id(p))
            if p.is_meta:
                stuck.append(f"{name}.{attr}" if name else attr)
            else:
                fresh.append(p)
        init.partition(fresh)
    stuck += [name for name, b in model.named_buffers() if b.is_meta]
    if stuck:
        raise RuntimeError(f"from_pretrained under zero.Init left {stuck[:5]} on the meta device: neither the "
                           "checkpoint nor transformers' initialisation of missing keys gave them values")
    return result


def _refuse_unsupported(model: nn.Module, load_config) -> None:
    hooked = any(getattr(c.__dict__.get("_finalize_model_loading"), "_zero_wrapped", False)
                 for c in type(model).__mro__)
    if not hooked:  # missing keys would never be initialised nor partitioned: refuse rather than half-load
        raise NotImplementedError("from_pretrained under engine.zero.Init needs a transformers 5 release whose "
                                  "PreTrainedModel has _finalize_model_loading (written against 5.24); upgrade "
                                  "transformers, or load outside zero.Init")
    what = ("device_map" if load_config.device_map is not None else
            "quantization" if load_config.hf_quantizer is not None else
            "tensor parallelism (tp_plan / distributed_config)" if load_config.device_mesh is not None else
            "pipeline parallelism" if getattr(model, "_pp_stage", None) is not None else None)
    if what:
        raise NotImplementedError(f"from_pretrained with {what} is not supported under engine.zero.Init (ZeRO-3 "
                                  "partitions the parameters itself); drop it, or load outside zero.Init")


def _back_to_meta(model: nn.Module, info) -> None:
    """A missing key whose parameter was partitioned while built (made on a real device despite the meta build) gets
    a fresh meta parameter of its real shape: transformers materialises missing keys with ``empty_like``, which on an
    empty partitioned tensor would give a 0-element one; initialised, it is partitioned by finalize_partitions."""
    for key in info.missing_and_mismatched():
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner)
        p = module._parameters.get(attr)
        if p is not None and p.__dict__.get("_zero_mgr") is not None and not getattr(p, "_is_hf_initialized", False):
            module._parameters[attr] = nn.Parameter(torch.empty(p.ds_shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=p.requires_grad)


def _tied_pairs_in_checkpoint(model: nn.Module, loading_info) -> list[nn.Parameter]:
    """Both parameters of each tied pair the checkpoint holds under both names (``.bin`` files often do)."""
    params = []
    missing = loading_info.missing_and_mismatched()
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in missing or source in missing:
            continue
        try:
            params += [model.get_parameter(target), model.get_parameter(source)]
        except AttributeError:  # tied buffers: not partitioned
            continue
    return params


class _Checkpoint:
    """A checkpoint's keys and shapes on every rank (file headers only); tensor bytes on the reader (rank 0)."""

    def __init__(self, state_dict: dict | None, files, reader: bool):
        self.reader = reader
        self._tensors: dict[str, torch.Tensor] = dict(state_dict or {})  # state_dict= and .bin: maybe meta / mmap
        self._handles: dict[str, Any] = {}  # safetensors key -> its open file
        self._open: list = []
        for path in map(str, files or [] if state_dict is None else []):  # as transformers: state_dict= wins
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt")  # reads the header; tensors are read on demand
                self._open.append(handle)
                self._handles.update(dict.fromkeys(handle.keys(), handle))
            else:
                from transformers.modeling_utils import load_state_dict

                # zip .bin: memory-mapped on the reader (pages read when a tensor is used); meta elsewhere. Always
                # weights_only (house rule: no arbitrary unpickling), whatever from_pretrained was given
                self._tensors.update(load_state_dict(path, map_location="cpu" if reader else "meta",
                                                     weights_only=True))

    def keys(self) -> list[str]:
        return [*self._handles, *self._tensors]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._handles:
            return tuple(self._handles[key].get_slice(key).get_shape())
        return tuple(self._tensors[key].shape)

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        if key in self._handles:
            return self._handles[key].get_tensor(key).to(dtype=dtype)  # a fresh tensor already
        return self._tensors[key].to(dtype=dtype, copy=True)  # never alias the caller's state_dict or the mmap

    def close(self) -> None:
        for handle in self._open:
            handle.__exit__(None, None, None)
        self._open, self._handles, self._tensors = [], {}, {}


@dataclass(frozen=True)
class _Direct:
    """A model key loaded from one checkpoint tensor (possibly renamed)."""

    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Plan:
    """Which checkpoint keys load which model keys, in which dtype: the same on every rank, from headers only.

    ``direct``: model key -> :class:`_Direct`; ``groups``: first target key -> its ``WeightConverter`` (a copy per
    target, holding the lazy reads of its sources on the reader); ``produced_by``: predicted target -> group key.
    """

    def __init__(self, model: nn.Module, checkpoint: _Checkpoint, load_config, init_dtype, info):
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, build_glob_alternation,
                                                     dot_natural_key, rename_source_key)

        self.model_sd = model.state_dict(keep_vars=True)
        self.param_keys = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.init_dtype = init_dtype
        mapping = load_config.weight_mapping or []
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        self.dtype_plan = load_config.dtype_plan or {}
        if self.dtype_plan:
            self._plan_alt, self._plan_group, _ = build_glob_alternation(list(self.dtype_plan))
        self.direct: dict[str, _Direct] = {}
        self.groups: dict[str, Any] = {}
        self.produced_by: dict[str, str] = {}
        prefix = model.base_model_prefix
        for key in sorted(checkpoint.keys(), key=dot_natural_key):  # transformers' order (converter inputs too)
            target, pattern = rename_source_key(key, renamings, converters, prefix, self.model_sd)
            if target not in self.model_sd and key in self.model_sd:
                target, pattern = rename_source_key(key, [], [], base_model_prefix=prefix,
                                                    meta_state_dict=self.model_sd)
            if target not in self.model_sd:  # reported as transformers does: every target a converter would make
                targets = by_pattern[pattern].target_patterns if pattern is not None else []
                info.unexpected_keys.update([target.replace(targets[0], t) for t in targets] or [target])
                continue
            dtype = self.dtype_for(target)
            if pattern is None:
                self._add_direct(key, target, checkpoint.shape(key), dtype, info)
                continue
            group = self.groups.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            read = functools.partial(checkpoint.read, key, dtype) if checkpoint.reader else None
            group.add_tensor(target, key, pattern, read)
            for t in group.target_patterns:
                predicted = target.replace(group.target_patterns[0], t)
                if predicted in self.model_sd:
                    self.produced_by.setdefault(predicted, target)

    def expected_shape(self, key: str) -> tuple[int, ...]:
        t = self.model_sd[key]
        return tuple(getattr(t, "ds_shape", t.shape))

    def dtype_for(self, key: str) -> torch.dtype:
        """Floating parameters: ``Init``'s dtype if it has one. Else transformers' rule: the dtype plan
        (keep-in-fp32 modules) if it matches, else the dtype the model built the tensor in."""
        empty = self.model_sd[key]
        if self.init_dtype is not None and key in self.param_keys and empty.is_floating_point():
            return self.init_dtype
        if self.dtype_plan:
            match = self._plan_alt.search(key)
            if match is not None:
                return self.dtype_plan[self._plan_group[match.lastgroup]]
        return empty.dtype

    def _add_direct(self, source: str, target: str, shape: tuple[int, ...], dtype: torch.dtype, info) -> None:
        if target in self.direct:  # two checkpoint names for one model key: the first wins, as in transformers
            return
        expected = self.expected_shape(target)
        if shape != expected:
            info.missing_keys.discard(target)
            info.mismatched_keys.add((target, shape, expected))
            return
        self.direct[target] = _Direct(source, shape, dtype)

    def wanted(self, key: str) -> bool:
        return key in self.direct or key in self.produced_by


class _Loader:
    """Walks the modules, loading and partitioning each one's tensors (see the module docstring, step 1)."""

    def __init__(self, init, model: nn.Module, checkpoint: _Checkpoint, plan: _Plan, info):
        self.init, self.model, self.checkpoint, self.plan, self.info = init, model, checkpoint, plan, info
        self.reader = checkpoint.reader
        self.realized: set[str] = set()
        self.cache: dict[str, tuple[tuple[int, ...], torch.dtype, torch.Tensor | None]] = {}

    def run(self) -> None:
        for name, module in self.model.named_modules(remove_duplicate=False):
            self.load_module(name, module)
        # converter outputs the plan did not predict: load them now if the model has them, else they are unexpected
        for key in list(self.cache):
            owner, _, attr = key.rpartition(".")
            if key in self.plan.model_sd and key in self.info.missing_keys:
                self.plan.produced_by[key] = ""  # already realised: fetch takes it from the cache
                self.load_module(owner, self.model.get_submodule(owner), only={attr})
            else:
                self.info.unexpected_keys.add(key)
        self.cache.clear()

    def load_module(self, name: str, module: nn.Module, only: set[str] | None = None) -> None:
        prefix = f"{name}." if name else ""
        fresh = []
        for attr, p in list(module._parameters.items()):
            key = prefix + attr
            if p is None or (only is not None and attr not in only) or not self.plan.wanted(key):
                continue
            value = self.fetch(key)
            if value is None:
                continue
            if p.__dict__.get("_zero_mgr") is not None:  # partitioned while built (made on a real device)
                with torch.no_grad(), GatheredParameters([p], modifier_rank=0):
                    if self.reader:
                        p.data.copy_(value)
                p._is_hf_initialized = True
            else:
                p = nn.Parameter(value, requires_grad=value.is_floating_point())  # as set_param_for_module
                p._is_hf_initialized = True
                module._parameters[attr] = p
                fresh.append(p)
            self.info.missing_keys.discard(key)
        for attr, b in list(module._buffers.items()):
            key = prefix + attr
            if b is None or (only is not None and attr not in only) or not self.plan.wanted(key):
                continue
            value = self.fetch(key)
            if value is None:
                continue
            on_device = comm.broadcast_(value.to(self.init.device), 0)
            value = on_device.to(value.device) if on_device is not value else value
            value._is_hf_initialized = True
            module._buffers[attr] = value
            self.info.missing_keys.discard(key)
        self.init.partition(fresh)

    def fetch(self, key: str) -> torch.Tensor | None:
        """The value of model key ``key``: read on the reader, an empty tensor of its shape and dtype elsewhere
        (the partition broadcast fills it); ``None`` when it is not loaded after all (converter outcome)."""
        direct = self.plan.direct.get(key)
        if direct is not None:
            if self.reader:
                return self.checkpoint.read(direct.source, direct.dtype)
            return torch.empty(direct.shape, dtype=direct.dtype)
        group = self.plan.produced_by[key]
        if group and group not in self.realized:
            self.realize(group)
        if key not in self.cache:
            return None  # the converter did not produce it: stays missing (transformers initialises it)
        shape, dtype, tensor = self.cache.pop(key)
        expected = self.plan.expected_shape(key)
        if shape != expected:
            self.info.missing_keys.discard(key)
            self.info.mismatched_keys.add((key, shape, expected))
            return None
        return tensor if self.reader else torch.empty(shape, dtype=dtype)

    def realize(self, group_key: str) -> None:
        """Run one ``WeightConverter`` group on the reader; every rank learns its outputs' names/shapes/dtypes."""
        from transformers.core_model_loading import SkipParameters

        self.realized.add(group_key)
        outputs: dict[str, torch.Tensor] = {}
        message = None
        if self.reader:
            group = self.plan.groups[group_key]
            try:
                produced = group.convert(group_key, model=self.model, config=self.model.config, hf_quantizer=None,
                                         loading_info=self.info)
            except SkipParameters:  # the error is in info.conversion_errors; transformers raises it in its report
                produced = {}
            outputs = {k: (v[0] if isinstance(v, list) else v) for k, v in produced.items()}
            message = {"outputs": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                                   for k, v in outputs.items()},
                       "errors": {k: v for k, v in self.info.conversion_errors.items()}}
        message = comm.broadcast_json(message, 0)
        self.info.conversion_errors.update(message["errors"])  # every rank raises in the report, not rank 0 alone
        for k, (shape, dtype) in message["outputs"].items():
            self.cache[k] = (tuple(shape), getattr(torch, dtype), outputs.get(k))
