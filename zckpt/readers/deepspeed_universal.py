"""DeepSpeed universal checkpoints (from ``ds_to_universal`` or ``zckpt reshard --format universal``) ->
:class:`~zckpt.plan.CheckpointPlan`, with the full training state. Reads pickles' metadata only (restricted
unpickler, :mod:`zckpt.readers.torch_pickle`); tensors are byte ranges of the per-parameter files.

A universal tag folder holds::

    *_model_states.pt          param_shapes (names, shapes, one dict per flat group), buffer_names, module (buffers;
                               ds_to_universal's copies also hold the 16-bit weights), shared_params, counters,
                               lr_scheduler, ds_config, ds_version (ZeRO-3 sources: one per source rank)
    zero/optimizer_state.pt    param_groups (hyper-parameters; stages 1/2 and ours), optimizer_state_dict (stage-3
                               sources: torch's state_dict, whose state[s]["step"] is the step and whose param_groups
                               map flat groups to optimizer groups)
    zero/<name>/fp32.pt        the fp32 master: {"param": tensor, ...} (stages 1/2, ours) or a bare flat tensor
                               (ds_to_universal of a stage-3 source); the same for exp_avg.pt, exp_avg_sq.pt, ...
    zero/<name>/step.pt        the step (a 0-dim tensor or a number); absent in stage-3 conversions

Trainable parameters are the names of ``param_shapes``; every other ``*.pt`` beside ``fp32.pt`` (but ``step``) is a
per-parameter optimizer state. Buffers come from ``module``, frozen parameters from ``module`` (whole), the per-rank
``frozen_param_fragments`` (stage 3), or ``zero/<name>/fp32.pt``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointIncompleteError
from ..plan import CheckpointPlan, Fragment, OptimizerGroup, SourceFile, StatePlan, TensorPlan, TrainingState
from .deepspeed import (_DEEPSPEED_OWN_KEYS, _NOT_JSON, _as_json, _buffers, _flat_ref, _frozen_params, _json_items,
                        _optimizer_name, _order_like_module, _train_dtype)
from ..universal_spec import FP32, MODEL_STATES, OPTIMIZER_STATE, PARAM, STEP, ZERO_DIR, is_folder_name
from .locate import Located
from .torch_pickle import TensorRef, load_lazy

ZERO = ZERO_DIR
_STATE_ORDER = ("exp_avg", "exp_avg_sq")


def is_universal_tag_dir(tag_dir: Path) -> bool:
    return (tag_dir / ZERO / OPTIMIZER_STATE).is_file() and any(tag_dir.glob("*_model_states.pt"))


@dataclass(frozen=True)
class _Param:
    """One trainable parameter's folder: the fp32 master, its optimizer states and its step, as references."""

    name: str
    fp32: TensorRef
    states: dict[str, TensorRef]
    step: Any  # TensorRef (0-dim), a number, or None
    files: tuple[Path, ...]


def _model_states_paths(tag_dir: Path) -> list[Path]:
    """Rank 0's model states first (the stage 1/2 name, else the stage-3 one), then the other ranks' (stage 3)."""
    names = sorted(p.name for p in tag_dir.glob("*_model_states.pt")
                   if not (p.name.startswith("layer_") or p.name.startswith("expert_")))
    first = next((n for n in MODEL_STATES if n in names), None)
    if first is None:
        raise CheckpointIncompleteError(f"{tag_dir} has no mp_rank_00_model_states.pt nor "
                                        "zero_pp_rank_0_mp_rank_00_model_states.pt; copy it from the source checkpoint")
    return [tag_dir / first] + [tag_dir / n for n in names if n != first]


def _tensor(value: Any, path: Path) -> TensorRef:
    """The tensor of a universal state file: ``{"param": tensor, ...}`` or a bare tensor."""
    ref = value.get(PARAM) if isinstance(value, dict) else value
    if not isinstance(ref, TensorRef):
        raise CheckpointCorruptError(f"{path} holds no tensor (expected a dict with 'param' or a tensor); the file "
                                     "is corrupt — re-run the conversion")
    return _flat_ref(ref, path.name)


def _read_param(zero: Path, name: str, shape: Any) -> _Param:
    if not is_folder_name(name):
        raise CheckpointCorruptError(f"{zero.parent}: param_shapes names {name!r}, which is not a parameter folder "
                                     "name under zero/; the model-states file is corrupt")
    folder = zero / name
    if not (folder / f"{FP32}.pt").is_file():
        raise CheckpointIncompleteError(f"{folder / 'fp32.pt'} is missing: parameter {name} has no fp32 master; the "
                                        "conversion was interrupted — re-run it")
    numel = math.prod(int(d) for d in shape)
    files = tuple(sorted(folder.glob("*.pt")))
    refs: dict[str, TensorRef] = {}
    step = None
    for path in files:
        value = load_lazy(path)
        if path.stem == STEP:
            step = value.get(PARAM) if isinstance(value, dict) else value
            continue
        ref = _tensor(value, path)
        if ref.numel != numel:
            raise CheckpointCorruptError(f"{path} has {ref.numel} elements but param_shapes gives {name} the shape "
                                         f"{tuple(shape)}; the files are from different runs")
        refs[path.stem] = ref
    fp32 = refs.pop(FP32)
    order = [k for k in _STATE_ORDER if k in refs] + sorted(k for k in refs if k not in _STATE_ORDER)
    return _Param(name, fp32, {k: refs[k] for k in order}, step, files)


def _group_of(osd: dict, param_shapes: list, path: Path) -> list[int]:
    """Flat group (``param_shapes`` entry) -> optimizer group: torch's ``param_groups[g]["params"]`` of a stage-3
    source's ``optimizer_state_dict``, else one flat group per optimizer group (stages 1/2, ours)."""
    inner = osd.get("optimizer_state_dict")
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        owner = {pid: g for g, group in enumerate(groups) for pid in group.get("params", [])}
        if sorted(owner) == list(range(len(param_shapes))):
            return [owner[s] for s in range(len(param_shapes))]
    count = len(_param_groups(osd, path))
    if count == len(param_shapes):
        return list(range(count))
    if count == 1:
        return [0] * len(param_shapes)
    raise CheckpointCorruptError(f"{path}: {count} optimizer param groups but param_shapes lists "
                                 f"{len(param_shapes)} groups; the files are from different runs")


def _param_groups(osd: dict, path: Path) -> list[dict]:
    groups = osd.get("param_groups")
    if not isinstance(groups, list):
        inner = osd.get("optimizer_state_dict")
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise CheckpointCorruptError(f"{path} has no optimizer param_groups; the file is corrupt — re-run the "
                                     "conversion")
    return groups


def _scalar(step: Any) -> TensorPlan | None:
    if isinstance(step, TensorRef) and step.numel == 1:
        return TensorPlan("step", (), step.dtype, (Fragment(step.path, step.byte_offset, 1, 0),))
    return None


def _groups(osd: dict, params: list[tuple[_Param, int]], group_of: list[int], path: Path) -> tuple:
    """Per optimizer group: JSON hyper-parameters and the step (the first parameter's step.pt, else the stage-3
    ``optimizer_state_dict.state[s]["step"]`` of its first flat group)."""
    inner = osd.get("optimizer_state_dict")
    inner_state = inner.get("state") if isinstance(inner, dict) else None
    out = []
    for g, group in enumerate(_param_groups(osd, path)):
        hp = _json_items(group, frozenset({"params"}))
        step = next((p.step for p, owner in params if owner == g and p.step is not None), None)
        if step is None and isinstance(inner_state, dict):
            flat = next((s for s, owner in enumerate(group_of) if owner == g), None)
            step = (inner_state.get(flat) or {}).get("step") if flat is not None else None
        scalar = _scalar(step)
        if scalar is None and step is not None and _as_json(step) is not _NOT_JSON:
            hp.setdefault("step", _as_json(step))
        out.append(OptimizerGroup(g, hp, (scalar,) if scalar else ()))
    return tuple(out)


def _frozen(model_states: list[dict], zero: Path, stage: int) -> list[TensorPlan]:
    """Frozen parameters: whole in ``module``, else the per-rank fragments (stage 3), else ``zero/<name>/fp32.pt``."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    module = model_states[0].get("module") or {}
    plans = []
    for name, shape in shapes.items():
        numel = math.prod(int(d) for d in shape)
        ref = module.get(name)
        if isinstance(ref, TensorRef) and ref.numel == numel:
            ref = _flat_ref(ref, f"frozen parameter {name}")
        elif (zero / name / f"{FP32}.pt").is_file():
            ref = _tensor(load_lazy(zero / name / f"{FP32}.pt"), zero / name / f"{FP32}.pt")
        elif stage == 3 and all(name in (ms.get("frozen_param_fragments") or {}) for ms in model_states):
            plans.extend(p for p in _frozen_params(model_states, 3, len(model_states)) if p.name == name)
            continue
        else:
            raise CheckpointIncompleteError(f"{zero.parent}: frozen parameter {name} is stored nowhere (not in "
                                            "module, zero/ or the ranks' frozen_param_fragments)")
        plans.append(TensorPlan(name, tuple(int(d) for d in shape), ref.dtype,
                                (Fragment(ref.path, ref.byte_offset, numel, 0),), kind="frozen"))
    return plans


def _stage(osd: dict, ds_config: Any, model_files: int) -> int:
    stage = osd.get("zero_stage")
    if isinstance(stage, int):
        return int(stage)
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    if isinstance(zero, dict) and isinstance(zero.get("stage"), int):
        return int(zero["stage"])
    return 3 if model_files > 1 else 2


def _training(ms0: dict, osd: dict, params: list[tuple[_Param, int]], group_of: list[int], path: Path):
    ds_config = ms0.get("ds_config")
    keys = tuple(params[0][0].states) if params else ()
    for p, _ in params:
        if tuple(p.states) != keys:
            raise CheckpointCorruptError(f"{path.parent / ZERO / p.name} holds optimizer states {list(p.states)} but "
                                         f"the others hold {list(keys)}; the conversion was interrupted — re-run it")
    scheduler = _as_json(ms0.get("lr_scheduler")) if isinstance(ms0.get("lr_scheduler"), dict) else None
    counters = {k: int(ms0[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                if isinstance(ms0.get(k), int) and not isinstance(ms0.get(k), bool)}
    client = {k: v for k, v in ((k, _as_json(v)) for k, v in ms0.items() if k not in _DEEPSPEED_OWN_KEYS)
              if v is not _NOT_JSON and isinstance(k, str)}
    param_groups = _param_groups(osd, path)
    return TrainingState(
        optimizer=_optimizer_name(param_groups, ds_config, keys), state_keys=keys,
        groups=_groups(osd, params, group_of, path), scheduler=None if scheduler is _NOT_JSON else scheduler,
        counters=counters, client_state=client,
        config=_as_json(ds_config, lenient=True) if isinstance(ds_config, dict) else None)


def read_universal_plan(located: Located) -> CheckpointPlan:
    tag_dir = located.tag_dir
    zero = tag_dir / ZERO
    ms_paths = _model_states_paths(tag_dir)
    with ThreadPoolExecutor(max_workers=8) as pool:
        model_states = list(pool.map(load_lazy, ms_paths))
        osd = load_lazy(zero / OPTIMIZER_STATE)
        ms0 = model_states[0]
        if not isinstance(ms0, dict) or not isinstance(ms0.get("param_shapes"), list):
            raise CheckpointCorruptError(f"{ms_paths[0]} is not a DeepSpeed model-states file (no param_shapes)")
        if not isinstance(osd, dict):
            raise CheckpointCorruptError(f"{zero / OPTIMIZER_STATE} is not a dict; the file is corrupt")
        shapes = ms0["param_shapes"]
        group_of = _group_of(osd, shapes, zero / OPTIMIZER_STATE)
        owners = [(name, shape, group_of[s]) for s, group in enumerate(shapes) for name, shape in group.items()]
        read = list(pool.map(lambda item: _read_param(zero, item[0], item[1]), owners))
    params = [(p, owner) for p, (_, _, owner) in zip(read, owners)]
    stage = _stage(osd, ms0.get("ds_config"), len(ms_paths))
    tensors = [TensorPlan(p.name, tuple(int(d) for d in shape), p.fp32.dtype,
                          (Fragment(p.fp32.path, p.fp32.byte_offset, p.fp32.numel, 0),), group=owner,
                          state=tuple(StatePlan(k, r.dtype, (Fragment(r.path, r.byte_offset, r.numel, 0),))
                                      for k, r in p.states.items()))
               for p, (_, shape, owner) in zip(read, owners)]
    tensors = _order_like_module(_buffers(ms0) + _frozen(model_states, zero, stage) + tensors, ms0.get("module"))
    names = {t.name for t in tensors}
    aliases = {a: c for a, c in (ms0.get("shared_params") or {}).items() if c in names and a not in names}
    files = [SourceFile(str(p), "model_states", None, p.stat().st_size) for p in ms_paths]
    files.append(SourceFile(str(zero / OPTIMIZER_STATE), "optim_states", None, (zero / OPTIMIZER_STATE).stat().st_size))
    files += [SourceFile(str(f), "universal_state", None, f.stat().st_size) for p in read for f in p.files]
    world = ms0.get("dp_world_size")
    step = ms0.get("global_steps")
    return CheckpointPlan(
        source=str(located.src), format="deepspeed-universal", stage=stage,
        world_size=int(world) if isinstance(world, int) else 1, train_dtype=_train_dtype(ms0.get("ds_config")),
        tag=located.tag, step=int(step) if isinstance(step, int) else None, tensors=tuple(tensors), aliases=aliases,
        files=tuple(files), model_dir=str(located.model_dir) if located.model_dir else None,
        version=str(ms0.get("ds_version")) if ms0.get("ds_version") is not None else None,
        training=_training(ms0, osd, params, group_of, tag_dir / ZERO / OPTIMIZER_STATE))
