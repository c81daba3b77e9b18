"""Writer: a plan with training state -> a plain DeepSpeed ZeRO checkpoint laid out for N ranks.

What DeepSpeed 0.19.8's ordinary ``engine.load_checkpoint`` reads at world size N (no universal flag):

* ``OUT/latest`` (the tag) and ``OUT/<tag>/``;
* per rank ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (``bf16_`` when the run is bf16, as
  ``engine._get_rank_zero_ckpt_name`` names it): ``{"optimizer_state_dict": ..., "ds_config", "ds_version"}`` with
  the structure ``DeepSpeedZeroOptimizer.state_dict()`` (stages 1/2, rigid) or ``DeepSpeedZeroOptimizer_Stage3
  ._rigid_state_dict()`` (stage 3) produce: flat fp32 partitions (:mod:`.deepspeed_layout`), the base torch
  optimizer's ``state_dict`` over them (moments, ``step``, hyper-parameters), loss scaler, ``partition_count``;
* stages 1/2: ``mp_rank_00_model_states.pt`` with the whole ``module`` at the training dtype (the fp32 masters cast
  as DeepSpeed casts them, round-to-nearest-even), stage 3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank
  (parameters as empty tensors, buffers whole, frozen parameters as the rank's padded piece); both with
  ``param_shapes``, ``frozen_param_shapes``/``_fragments``, ``shared_params``, counters, ``lr_scheduler``,
  ``dp_world_size`` (DeepSpeed refuses a load whose value differs from its world size), ``ds_config``,
  ``ds_version`` and the client state.

Flat groups follow the plan's trainable parameters per optimizer group, in model order -- the order DeepSpeed
flattens them when the optimizer's param groups list the parameters as ``model.named_parameters()`` does (plain
``model.parameters()``, HF Trainer's decay/no-decay groups).

Files are streamed (:mod:`.torch_zip`: ``torch.save``'s format, tensors assembled chunk by chunk from the source
while written, CRC-32 as it goes) by a few threads, one file each; memory is two 4 MiB chunks per thread, whatever
the model size. Each file is fsynced. No torch import (it costs ~1 s), except to cast a bf16/fp16 stage-1/2 module.
"""

from __future__ import annotations

import bisect
import copy
import math
import os
import struct
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine import checkpoint_format as spec

from ..assemble import FileCache, read_range
from ..errors import InvalidArgumentError, UnsupportedCheckpointError
from ..plan import DTYPE_SIZES, CheckpointPlan, TensorPlan
from . import deepspeed_pickle as dsp
from .torch_zip import LazyStorage, LazyTensor, constant_storage, scratch
from .torch_zip import save as save_torch_file
from .deepspeed_layout import DEFAULT_SUB_GROUP_SIZE, DeepSpeedLayout, FlatGroup, deepspeed_layout
from .engine_native import require_training_state

#: what ``ds_version`` our files claim: the DeepSpeed release whose layout they follow
DS_VERSION = "0.19.8"
#: DeepSpeed's ``gradient_clipping`` default (``runtime/constants.py``); restored into the optimizer at load
GRADIENT_CLIPPING_DEFAULT = 1.0


@dataclass(frozen=True, kw_only=True)
class DeepSpeedTarget:
    world_size: int
    stage: int
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidArgumentError(f"--world-size must be at least 1, got {self.world_size}")
        if self.stage not in (1, 2, 3):
            raise InvalidArgumentError(f"--format deepspeed writes ZeRO stage 1, 2 or 3; got --stage {self.stage}")
        if self.sub_group_size < 1:
            raise InvalidArgumentError(f"zero_optimization.sub_group_size must be positive, got {self.sub_group_size}")


@dataclass
class DeepSpeedResult:
    tag: str
    files: dict[str, int] = field(default_factory=dict)  # file name in the tag folder -> size


def resolve_deepspeed_target(plan: CheckpointPlan, world_size: int, stage: int | None, zero: dict) -> DeepSpeedTarget:
    """``--stage`` first, then ``--config``'s zero_optimization (``zero``), then the source's own stage /
    ``sub_group_size``, then DeepSpeed's defaults."""
    source_zero = plan.training.zero_config if plan.training else {}
    if stage is None:
        stage = zero.get("stage", plan.stage)
    sub = zero.get("sub_group_size", source_zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    try:
        sub = int(float(sub))
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"zero_optimization.sub_group_size {sub!r} is not a number; fix --config") from None
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise InvalidArgumentError(f"zero_optimization.stage {stage!r} is not an integer; pass --stage")
    return DeepSpeedTarget(world_size=world_size, stage=stage, sub_group_size=sub)


def layout_of(plan: CheckpointPlan, target: DeepSpeedTarget) -> DeepSpeedLayout:
    params = plan.trainable()
    try:
        return deepspeed_layout(target.stage, target.world_size, [t.numel for t in params],
                                [t.group for t in params], target.sub_group_size)
    except ValueError as exc:
        raise UnsupportedCheckpointError(f"{plan.source}: cannot lay out for DeepSpeed ({exc})") from None


def check_plan(plan: CheckpointPlan) -> None:
    """Everything the writer needs, checked before any byte is written."""
    require_training_state(plan)
    training = plan.training
    groups = {t.group for t in plan.trainable()}
    if len(training.groups) != max(groups) + 1:
        raise UnsupportedCheckpointError(f"{plan.source}: parameters name {max(groups) + 1} optimizer groups but the "
                                         f"optimizer state has {len(training.groups)}; the checkpoint is inconsistent")
    odd = [f"{t.name}/{s.key}" for t in plan.trainable() for s in t.state if s.dtype not in ("float32", "float64")]
    if odd:
        raise UnsupportedCheckpointError(f"{plan.source}: optimizer state {odd[0]} is not stored in fp32; DeepSpeed's "
                                         "ZeRO optimizer keeps fp32 state, zckpt does not widen it")


def total_bytes(plan: CheckpointPlan, target: DeepSpeedTarget) -> int:
    """Bytes read from the source (for progress bars): masters and state once, masters again for the stage-1/2
    ``module``, frozen parameters and buffers (per rank at stage 3: buffers are in every rank's file)."""
    masters = sum(t.numel * 4 for t in plan.trainable())
    others = sum(t.nbytes for t in plan.tensors if t.kind == "frozen")
    buffers = sum(t.nbytes for t in plan.tensors if t.kind == "buffer")
    if target.stage == 3:
        return masters * (1 + len(plan.training.state_keys)) + others + buffers * target.world_size
    return masters * (2 + len(plan.training.state_keys)) + others + buffers


# -- tensors produced from the plan while the file is written ---------------------------------------------------
#: (dest element, count, source tensor, source start element): a range of a lazily built flat tensor
Segment = tuple[int, int, TensorPlan, int]


class _Sources:
    """Fills chunks of lazily built tensors from plan element ranges (positioned reads; shared by writer threads)."""

    def __init__(self, progress: Callable[[int], None]):
        self.files, self.progress = FileCache(), progress

    def close(self) -> None:
        self.files.close()

    def _read(self, src: TensorPlan, start: int, count: int, out: memoryview, dtype: str) -> None:
        """Elements ``[start, start + count)`` of ``src`` into ``out`` at ``dtype``."""
        if src.dtype == dtype:
            read_range(src, self.files, start, count, out)
        else:
            tmp = scratch(count * DTYPE_SIZES[src.dtype], "convert")
            read_range(src, self.files, start, count, tmp)
            _cast(tmp, src.dtype, out, dtype)
        self.progress(count * DTYPE_SIZES[src.dtype])

    def lazy(self, dtype: str, numel: int, segments: list[Segment]) -> LazyStorage:
        """A storage of ``numel`` elements: ``segments`` read from the source, zeros elsewhere."""
        segments = sorted(segments, key=lambda seg: seg[0])
        ends = [dest + count for dest, count, _, _ in segments]
        size = DTYPE_SIZES[dtype]

        def fill(start: int, out: memoryview) -> None:
            end, pos = start + len(out) // size, start
            for dest, count, src, src_start in segments[bisect.bisect_right(ends, start):]:
                if dest >= end:
                    break
                lo, hi = max(dest, start), min(dest + count, end)
                _zero(out[(pos - start) * size:(lo - start) * size])
                self._read(src, src_start + lo - dest, hi - lo, out[(lo - start) * size:(hi - start) * size], dtype)
                pos = hi
            _zero(out[(pos - start) * size:])

        return LazyStorage(dtype, numel, fill)

    def whole(self, t: TensorPlan) -> LazyTensor:
        return LazyTensor(self.lazy(t.dtype, t.numel, [(0, t.numel, t, 0)]), t.shape)

    def partition(self, flat: FlatGroup, rank: int, sources: list[TensorPlan]) -> LazyStorage:
        """Rank ``rank``'s fp32 partition of ``flat``, ``sources[i]`` holding trainable parameter ``i``'s elements."""
        return self.lazy("float32", flat.partition_numel,
                         [(p.dest, p.count, sources[p.param], p.start) for p in flat.pieces[rank]])


_STRUCT = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
           "int8": "<b", "uint8": "<B", "bool": "<?"}


def _unpack(dtype: str, raw: bytes) -> float | int | bool:
    if dtype == "bfloat16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack(_STRUCT[dtype], raw)[0]


def _scalar(dtype: str, value) -> LazyTensor:
    """A 0-dim tensor (e.g. Adam's ``step``)."""
    if dtype == "bfloat16":
        raw = _cast_bytes(struct.pack("<f", float(value)), "float32", "bfloat16")
    else:
        raw = struct.pack(_STRUCT[dtype], value)
    return LazyTensor(constant_storage(dtype, raw), ())


def _zero(view: memoryview) -> None:
    if len(view):
        view[:] = bytes(len(view))


def _cast(src: memoryview, src_dtype: str, out: memoryview, dtype: str) -> None:
    """``out[:] = src`` converted, e.g. the bf16 module from the fp32 masters. torch's cast (imported only for this)
    rounds to nearest even, as DeepSpeed's own ``copy_`` from the fp32 partition does."""
    if not len(src):
        return
    import torch

    converted = torch.frombuffer(src, dtype=getattr(torch, src_dtype)).to(getattr(torch, dtype))
    out[:] = _tensor_bytes(converted)


def _tensor_bytes(t) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _cast_bytes(raw: bytes, src_dtype: str, dtype: str) -> bytes:
    out = bytearray(len(raw) // DTYPE_SIZES[src_dtype] * DTYPE_SIZES[dtype])
    _cast(memoryview(bytearray(raw)), src_dtype, memoryview(out), dtype)
    return bytes(out)


# -- optimizer-state pieces --------------------------------------------------------------------------------------
def _loss_scaler(plan: CheckpointPlan) -> tuple[Any, bool]:
    """DeepSpeed's pickled loss scaler and ``dynamic_loss_scale``: the fp16 run's scaler, else ``LossScaler(1.0)``."""
    state = plan.training.loss_scaler if plan.train_dtype == "float16" else None
    if not state or state.get("type") != "dynamic":
        scale = float(state["cur_scale"]) if state else 1.0
        return dsp.deepspeed_object(dsp.LOSS_SCALER, {"cur_scale": scale, "dynamic": False}), False
    attrs = {"cur_scale": float(state["cur_scale"]), "dynamic": True, "cur_iter": int(state["cur_iter"]),
             "last_overflow_iter": int(state["last_overflow_iter"]), "scale_factor": float(state["scale_factor"]),
             "scale_window": int(state["scale_window"]), "min_scale": float(state["min_scale"]),
             "delayed_shift": int(state["hysteresis"]), "cur_hysteresis": int(state["cur_hysteresis"]),
             "consecutive_hysteresis": bool(state["consecutive_hysteresis"]),
             "raise_error_at_min_scale": bool(state.get("raise_error_at_min_scale", True)),
             "dtype": dsp.global_ref("torch", "float16")}
    return dsp.deepspeed_object(dsp.DYNAMIC_LOSS_SCALER, attrs), True


def _hparams(plan: CheckpointPlan, g: int) -> tuple[dict, dict]:
    """Torch ``param_groups[g]`` hyper-parameters (``params`` added by the caller) and group ``g``'s scalar state."""
    hp = dict(plan.training.groups[g].hparams)
    if isinstance(hp.get("betas"), list):
        hp["betas"] = tuple(hp["betas"])
    if plan.training.optimizer in ("adam", "adamw"):
        # torch's Adam.__setstate__ defaults a missing flag to False (coupled decay): say which one the run used
        hp.setdefault("decoupled_weight_decay", plan.training.optimizer == "adamw")
    scalars = {}
    if "step" in hp and not any(s.name == "step" for s in plan.training.groups[g].scalars):
        scalars["step"] = _scalar("float32", float(hp.pop("step")))
    return hp, scalars


def _scalar_values(reader: _Sources, plan: CheckpointPlan) -> list[dict[str, tuple[str, float]]]:
    """Each group's scalar state as ``(dtype, value)``; Adam's ``step`` as fp32, as torch keeps it."""
    out = []
    for g in range(len(plan.training.groups)):
        values = {}
        for s in plan.training.groups[g].scalars:
            raw = bytearray(DTYPE_SIZES[s.dtype])
            read_range(s, reader.files, 0, 1, memoryview(raw))
            value = _unpack(s.dtype, bytes(raw))
            values[s.name] = ("float32", float(value)) if s.name == "step" else (s.dtype, value)
        out.append(values)
    return out


def _base_optimizer_state(plan: CheckpointPlan, layout: DeepSpeedLayout, scalars: list[dict],
                          moments: list[dict[str, LazyTensor]]) -> dict:
    """Torch's ``optimizer.state_dict()`` over the flat groups (one torch parameter each, numbered in order)."""
    state, groups = {}, []
    for s, flat in enumerate(layout.flat_groups):
        hp, extra = _hparams(plan, flat.group)
        state[s] = {**extra, **{k: _scalar(*v) for k, v in scalars[flat.group].items()}, **moments[s]}
    for g in range(len(plan.training.groups)):
        hp, _ = _hparams(plan, g)
        groups.append({**hp, "params": [s for s, flat in enumerate(layout.flat_groups) if flat.group == g]})
    return {"state": state, "param_groups": groups}


def _ds_config(plan: CheckpointPlan, target: DeepSpeedTarget) -> dict:
    config = copy.deepcopy(plan.training.config) if isinstance(plan.training.config, dict) else {}
    zero = config.setdefault("zero_optimization", {})
    if isinstance(zero, dict):
        zero["stage"] = target.stage
    return config


def _clip_grad(plan: CheckpointPlan) -> float:
    value = (plan.training.config or {}).get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else \
        GRADIENT_CLIPPING_DEFAULT


def optim_file_name(plan: CheckpointPlan, rank: int) -> str:
    prefix = "bf16_" if plan.train_dtype == "bfloat16" else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file_name(stage: int, rank: int) -> str:
    return "mp_rank_00_model_states.pt" if stage <= 2 else f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


# -- model states ------------------------------------------------------------------------------------------------
def _model_states(plan: CheckpointPlan, target: DeepSpeedTarget, layout: DeepSpeedLayout, module: dict,
                  frozen_fragments: dict | None, rank: int = 0) -> dict:
    """``engine._common_checkpoint_state`` + client state, in DeepSpeed's key order (``shared_params`` is
    computed on rank 0 only: the other ranks' stage-3 files say ``{}``)."""
    params = plan.trainable()
    training = plan.training
    frozen = [t for t in plan.tensors if t.kind == "frozen"]
    save_frozen = target.stage >= 2  # zero_optimization_partition_gradients()
    scheduler = training.scheduler
    if isinstance(scheduler, dict) and plan.format == "engine":
        scheduler = {k: v for k, v in scheduler.items() if k != "type"}  # the engine's own tag, not DeepSpeed's
    state = dict(
        module=module,
        buffer_names=[t.name for t in plan.tensors if t.kind == "buffer"],
        optimizer=None,
        param_shapes=[OrderedDict((params[i].name, dsp.torch_size(params[i].shape)) for i in flat.params)
                      for flat in layout.flat_groups],
        frozen_param_shapes=OrderedDict((t.name, dsp.torch_size(t.shape)) for t in frozen) if save_frozen else None,
        shared_params=dict(plan.aliases) if rank == 0 else {},
        frozen_param_fragments=frozen_fragments if save_frozen else None,
        lr_scheduler=scheduler,
        data_sampler=None,
        random_ltd=None,
        skipped_steps=int(training.counters.get("skipped_steps", 0)),
        global_steps=int(training.counters.get("global_steps", plan.step or 0)),
        global_samples=int(training.counters.get("global_samples", 0)),
        dp_world_size=target.world_size,
        mp_world_size=1,
        checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
        ds_config=_ds_config(plan, target),
        ds_version=DS_VERSION,
    )
    state.update({k: v for k, v in training.client_state.items() if k not in state})
    return state


# -- stages 1/2 --------------------------------------------------------------------------------------------------
def _zero12_module(reader: _Sources, plan: CheckpointPlan, layout: DeepSpeedLayout) -> OrderedDict:
    """The ``module`` state dict at the training dtype: parameters as views of one flat buffer per group (as
    DeepSpeed's own are), cast from the fp32 masters while written; frozen parameters and buffers as stored."""
    params = plan.trainable()
    dtype = plan.train_dtype
    views = {}
    for flat in layout.flat_groups:
        segments, offset = [], 0
        for i in flat.params:
            segments.append((offset, params[i].numel, params[i], 0))
            offset += params[i].numel
        storage = reader.lazy(dtype, offset, segments)
        for dest, numel, t, _ in segments:
            views[t.name] = LazyTensor(storage, t.shape, dest)
    module = OrderedDict((t.name, views[t.name] if t.kind == "param" else reader.whole(t)) for t in plan.tensors)
    for alias, canonical in plan.aliases.items():
        module.setdefault(alias, module[canonical])
    return module


def _zero12_rank(reader: _Sources, plan: CheckpointPlan, layout: DeepSpeedLayout, rank: int,
                 scalars: list[dict]) -> dict:
    """``DeepSpeedZeroOptimizer.state_dict()`` of rank ``rank`` (rigid form, ``elastic_checkpoint`` off): the fp32
    partition without its padding (a view of the padded partition, as DeepSpeed saves it), moments with it."""
    params = list(plan.trainable())
    loss_scaler, dynamic = _loss_scaler(plan)
    fp32 = [LazyTensor(reader.partition(flat, rank, params), (flat.saved_numel(rank),))
            for flat in layout.flat_groups]
    moments = [{key: LazyTensor(reader.partition(flat, rank, [t.state_tensor(key) for t in params]),
                                (flat.partition_numel,)) for key in plan.training.state_keys}
               for flat in layout.flat_groups]
    mappings = [OrderedDict((params[p.param].name, dsp.deepspeed_object(dsp.FRAGMENT_ADDRESS,
                                                                          {"numel": p.count, "start": p.dest}))
                            for p in flat.pieces[rank]) for flat in layout.flat_groups]
    return {
        "loss_scaler": loss_scaler, "dynamic_loss_scale": dynamic, "overflow": False, "clip_grad": _clip_grad(plan),
        "base_optimizer_state": _base_optimizer_state(plan, layout, scalars, moments),
        "single_partition_of_fp32_groups": fp32,
        "zero_stage": dsp.zero_stage_enum(2 if layout.stage == 2 else 1),
        "group_paddings": [flat.padding[rank] for flat in layout.flat_groups],
        "param_alignment_paddings": [[0] * len(flat.params) for flat in layout.flat_groups],
        "partition_count": [layout.world_size] * len(layout.flat_groups),
        "ds_version": DS_VERSION,
        "param_slice_mappings": mappings,
    }


def _zero12_files(reader: _Sources, plan: CheckpointPlan, target: DeepSpeedTarget,
                  layout: DeepSpeedLayout) -> list[tuple[str, dict]]:
    module = _zero12_module(reader, plan, layout)
    frozen = OrderedDict((t.name, module[t.name]) for t in plan.tensors if t.kind == "frozen")
    files = [(model_file_name(target.stage, 0), _model_states(plan, target, layout, module, frozen))]
    scalars = _scalar_values(reader, plan)
    for r in range(target.world_size):
        osd = _zero12_rank(reader, plan, layout, r, scalars)
        files.append((optim_file_name(plan, r), {"optimizer_state_dict": osd, "ds_config": _ds_config(plan, target),
                                                 "ds_version": DS_VERSION}))
    return files


# -- stage 3 -----------------------------------------------------------------------------------------------------
def _zero3_module(reader: _Sources, plan: CheckpointPlan) -> OrderedDict:
    """Stage 3's ``module``: parameters (trainable and frozen) as empty tensors at their dtype, buffers whole."""
    dtype = plan.train_dtype
    module = OrderedDict()
    for t in plan.tensors:
        if t.kind == "buffer":
            module[t.name] = reader.whole(t)
        else:
            module[t.name] = LazyTensor(constant_storage(dtype if t.kind == "param" else t.dtype, b""), (0,))
    for alias, canonical in plan.aliases.items():
        module.setdefault(alias, module[canonical])
    return module


def _zero3_frozen(reader: _Sources, plan: CheckpointPlan, world: int, rank: int) -> OrderedDict:
    """Each frozen parameter's ``ds_tensor`` on rank ``rank``: its ``ceil(numel / world)`` piece, zero-padded."""
    out = OrderedDict()
    for t in plan.tensors:
        if t.kind == "frozen":
            part = math.ceil(t.numel / world)
            count = max(0, min(part, t.numel - rank * part))
            segments = [(0, count, t, rank * part)] if count else []
            out[t.name] = LazyTensor(reader.lazy(t.dtype, part, segments), (part,))
    return out


def _zero3_files(reader: _Sources, plan: CheckpointPlan, target: DeepSpeedTarget,
                 layout: DeepSpeedLayout) -> list[tuple[str, dict]]:
    params = list(plan.trainable())
    module = _zero3_module(reader, plan)
    scalars = _scalar_values(reader, plan)
    loss_scaler, dynamic = _loss_scaler(plan)
    files = []
    for r in range(target.world_size):
        frozen = _zero3_frozen(reader, plan, target.world_size, r)
        files.append((model_file_name(3, r), _model_states(plan, target, layout, module, frozen, r)))
        fp32 = [LazyTensor(reader.partition(flat, r, params), (flat.partition_numel,)) for flat in layout.flat_groups]
        moments = [{key: LazyTensor(reader.partition(flat, r, [t.state_tensor(key) for t in params]),
                                    (flat.partition_numel,)) for key in plan.training.state_keys}
                   for flat in layout.flat_groups]
        osd = {"zero_stage": dsp.zero_stage_enum(3), "loss_scaler": loss_scaler, "dynamic_loss_scale": dynamic,
               "overflow": False, "partition_count": target.world_size,
               "optimizer_state_dict": _base_optimizer_state(plan, layout, scalars, moments),
               "fp32_flat_groups": fp32}
        files.append((optim_file_name(plan, r), {"optimizer_state_dict": osd, "ds_config": _ds_config(plan, target),
                                                 "ds_version": DS_VERSION}))
    return files


def write_deepspeed_checkpoint(plan: CheckpointPlan, save_dir: Path, target: DeepSpeedTarget, *,
                               tag: str | None = None, workers: int = 4,
                               progress: Callable[[int], None] = lambda n: None) -> DeepSpeedResult:
    """Write ``save_dir/<tag>/`` and ``save_dir/latest`` for ``target``; ``save_dir`` should be a fresh (staging)
    folder. Files are written by ``workers`` threads, each streaming one file at a time in bounded chunks."""
    check_plan(plan)
    tag = tag or plan.tag
    spec.check_tag(tag)
    layout = layout_of(plan, target)
    save_dir = Path(save_dir)
    tag_dir = save_dir / tag
    tag_dir.mkdir(parents=True)
    result = DeepSpeedResult(tag=tag)
    reader = _Sources(progress)
    try:
        files = (_zero3_files if target.stage == 3 else _zero12_files)(reader, plan, target, layout)
        # the largest files first, so that the pool's threads finish together
        files.sort(key=lambda item: -_payload_bytes(item[1]))
        writers = max(1, min(workers, len(files)))
        with ThreadPoolExecutor(max_workers=writers, thread_name_prefix="zckpt-ds") as pool, \
                ThreadPoolExecutor(max_workers=writers, thread_name_prefix="zckpt-ds-fill") as fill_pool:
            sizes = list(pool.map(lambda item: save_torch_file(item[1], tag_dir / item[0], pool=fill_pool), files))
    finally:
        reader.close()
    result.files.update((name, size) for (name, _), size in zip(files, sizes))
    spec.fsync_path(tag_dir)
    (save_dir / "latest").write_text(tag)  # DeepSpeed's own: the tag, no newline (outdir fsyncs it)
    return result


def _payload_bytes(obj: Any) -> int:
    """Bytes of the lazily built tensors in ``obj`` (each storage once), to order the files."""
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, LazyTensor):
            seen[id(x.storage)] = x.storage.nbytes
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sum(seen.values())
