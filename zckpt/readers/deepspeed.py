"""DeepSpeed ZeRO-1/2/3 checkpoints → :class:`~zckpt.plan.CheckpointPlan`. Reads pickles' metadata only.

Where the fp32 weights live (the same rules as DeepSpeed's ``utils/zero_to_fp32.py``, which is the reference):

* Stages 1/2: each rank's optimizer file holds ``single_partition_of_fp32_groups[g]``, an equal slice of param
  group ``g`` flattened. Concatenating the ranks' slices gives the group's flat vector; parameters sit in it back to
  back in ``param_shapes[g]`` order (plus ``param_alignment_paddings`` when recorded); the tail is padding.
* Stage 3: every parameter is split on its own into ``ceil(numel / world)`` elements per rank (the last ranks
  padded). Rank ``r``'s ``fp32_flat_groups`` concatenated hold its piece of every parameter, in ``param_shapes``
  order across groups.
* Frozen parameters have no fp32 master: ``frozen_param_fragments`` in the model-states file(s) hold them at the
  training dtype (whole in stages 1/2, one piece per rank in stage 3). Buffers are in ``module``.
* ``shared_params`` maps a tied alias (e.g. ``lm_head.weight``) to the stored parameter.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsupportedCheckpointError
from ..plan import DTYPE_SIZES, CheckpointPlan, Fragment, SourceFile, TensorPlan
from .locate import Located
from .torch_pickle import TensorRef, load_lazy

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def is_deepspeed_tag_dir(tag_dir: Path) -> bool:
    return any(tag_dir.glob("*_model_states.pt")) or any(tag_dir.glob("*_optim_states.pt"))


# --- file discovery and validation ---------------------------------------------------------------------------


def _optim_files(tag_dir: Path) -> tuple[str, dict[int, Path]]:
    prefixes, files = set(), {}
    for path in tag_dir.iterdir():
        match = _OPTIM_RE.match(path.name)
        if not match:
            continue
        if match.group(3) != "00":
            raise UnsupportedCheckpointError(f"{path}: model-parallel checkpoints (mp_rank_{match.group(3)}) are "
                                             "not supported; only data-parallel ZeRO")
        prefixes.add(match.group(1) or "")
        files[int(match.group(2))] = path
    if not files:
        _refuse_zero0(tag_dir)
        raise CheckpointIncompleteError(
            f"{tag_dir} has no *_optim_states.pt files: the fp32 weights of a ZeRO checkpoint live in them — was it "
            "saved with the optimizer state excluded? Re-save with the optimizer, or pick another tag with --tag")
    if len(prefixes) > 1:
        raise CheckpointCorruptError(f"{tag_dir} mixes bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files "
                                     "from different runs; delete the stale ones or re-save")
    return prefixes.pop(), files


def _refuse_zero0(tag_dir: Path) -> None:
    """A DeepSpeed run without ZeRO (stage 0) keeps weights and optimizer in ``mp_rank_00_model_states.pt`` alone;
    say so instead of suspecting a save without optimizer state."""
    path = tag_dir / "mp_rank_00_model_states.pt"
    try:
        state = load_lazy(path) if path.is_file() else None
    except Exception:  # noqa: BLE001 -- unreadable: the caller's generic message applies
        return
    zero = (state.get("ds_config") or {}).get("zero_optimization") if isinstance(state, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(state, dict) and state.get("optimizer") is not None and state.get("param_shapes") is None \
            and stage == 0:
        raise UnsupportedCheckpointError(
            f"{tag_dir} is a DeepSpeed checkpoint without ZeRO (zero_optimization.stage 0): its weights are whole "
            f"in {path.name} (key 'module', in the training dtype), which zckpt does not convert yet (DeepSpeed's "
            "zero_to_fp32 cannot read it either)")


def _partition_count(osd: dict[str, Any], path: Path) -> int:
    count = osd.get("partition_count")
    if isinstance(count, (list, tuple)):
        if len(set(count)) > 1:
            raise UnsupportedCheckpointError(f"{path}: param groups partitioned over different world sizes {count}")
        count = max(count)
    if not isinstance(count, int) or count < 1:
        raise CheckpointCorruptError(f"{path}: optimizer_state_dict has no valid partition_count ({count!r})")
    return count


def _load_optim_states(files: dict[int, Path]) -> dict[int, dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        loaded = dict(zip(files, pool.map(load_lazy, files.values())))
    states = {}
    for rank, obj in loaded.items():
        osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise CheckpointCorruptError(f"{files[rank]} is not a ZeRO optimizer shard (no optimizer_state_dict."
                                         "zero_stage)")
        states[rank] = osd
    return states


def _check_world(files: dict[int, Path], states: dict[int, dict[str, Any]], tag_dir: Path) -> tuple[int, int]:
    rank0 = min(files)
    stage = int(states[rank0]["zero_stage"])
    world = _partition_count(states[rank0], files[rank0])
    for rank, osd in states.items():
        if int(osd["zero_stage"]) != stage or _partition_count(osd, files[rank]) != world:
            raise CheckpointCorruptError(
                f"{files[rank]} is from another run (stage {int(osd['zero_stage'])}, world size "
                f"{_partition_count(osd, files[rank])}; the others: stage {stage}, world size {world}); "
                "delete the stale file or re-save")
    extra = sorted(r for r in files if r >= world)
    if extra:
        raise CheckpointCorruptError(
            f"{files[extra[0]]} is an optimizer shard from another world size: this checkpoint was written by "
            f"{world} ranks (partition_count) — delete the stale rank files {extra} or re-save")
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise CheckpointIncompleteError(
            f"{tag_dir} is missing the optimizer shard of rank(s) {missing} (expected {world} ranks, e.g. "
            f"{_optim_name(files, missing[0])}); the save was interrupted — re-save or pick another tag with --tag")
    if stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(f"{files[rank0]}: ZeRO stage {stage} is not supported (1, 2 or 3)")
    return stage, world


def _optim_name(files: dict[int, Path], rank: int) -> str:
    sample = next(iter(files.values())).name
    return re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{rank}_", sample)


def _model_state_paths(tag_dir: Path, stage: int, world: int) -> list[Path]:
    if stage <= 2:
        paths = [tag_dir / "mp_rank_00_model_states.pt"]
    else:
        paths = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise CheckpointIncompleteError(f"{tag_dir} is missing {', '.join(missing)}; the save was interrupted — "
                                        "re-save or pick another tag with --tag")
    return paths


# --- plan construction ---------------------------------------------------------------------------------------


def _flat_ref(ref: Any, what: str) -> TensorRef:
    if not isinstance(ref, TensorRef):
        raise CheckpointCorruptError(f"{what} is not a tensor")
    if not ref.is_contiguous():
        raise UnsupportedCheckpointError(f"{ref.path}: {what} is not contiguous")
    if ref.storage_offset + ref.numel > ref.storage.numel:
        raise CheckpointCorruptError(f"{ref.path}: {what} extends past its storage; the file is corrupt")
    return ref


def _pieces(refs: list[TensorRef], start: int, count: int) -> list[tuple[TensorRef, int, int]]:
    """Split element range [start, start+count) of the concatenation of ``refs`` into (ref, local_start, n)."""
    out, base = [], 0
    for ref in refs:
        lo, hi = max(start, base), min(start + count, base + ref.numel)
        if lo < hi:
            out.append((ref, lo - base, hi - lo))
        base += ref.numel
        if base >= start + count:
            break
    if sum(n for _, _, n in out) != count:
        raise CheckpointCorruptError(f"{refs[0].path}: flat fp32 partition is shorter than the parameters need; "
                                     "the checkpoint is corrupt or from another world size")
    return out


def _fragments(refs: list[TensorRef], start: int, count: int, dest: int) -> list[Fragment]:
    frags = []
    for ref, local, n in _pieces(refs, start, count):
        size = DTYPE_SIZES[ref.dtype]
        frags.append(Fragment(ref.path, ref.byte_offset + local * size, n, dest))
        dest += n
    return frags


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _zero12_params(param_shapes: list[dict], states: dict[int, dict], world: int) -> list[TensorPlan]:
    groups_per_rank = [states[r]["single_partition_of_fp32_groups"] for r in range(world)]
    paddings = states[0].get("param_alignment_paddings")
    plans = []
    for g, shapes in enumerate(param_shapes):
        refs = [_flat_ref(groups_per_rank[r][g], f"single_partition_of_fp32_groups[{g}] of rank {r}")
                for r in range(world)]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = _numel(shape)
            plans.append(TensorPlan(name, tuple(int(s) for s in shape), "float32", tuple(_fragments(refs, offset, n, 0))))
            offset += n + (int(paddings[g][i]) if paddings is not None else 0)
        avail = sum(r.numel for r in refs)
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CheckpointCorruptError(f"{refs[0].path}: param group {g} has {avail} fp32 elements but its "
                                         f"parameters need {offset}; the checkpoint is corrupt")
    return plans


def _zero3_params(param_shapes: list[dict], states: dict[int, dict], world: int) -> list[TensorPlan]:
    flat = [[_flat_ref(t, f"fp32_flat_groups of rank {r}") for t in states[r]["fp32_flat_groups"]]
            for r in range(world)]
    merged = {name: shape for shapes in param_shapes for name, shape in shapes.items()}
    plans, offset = [], 0
    for name, shape in merged.items():
        n = _numel(shape)
        part = math.ceil(n / world)
        frags = []
        for r in range(world):
            dest = r * part
            if dest < n:
                frags.extend(_fragments(flat[r], offset, min(part, n - dest), dest))
        plans.append(TensorPlan(name, tuple(int(s) for s in shape), "float32", tuple(frags)))
        offset += part
    avail = sum(t.numel for t in flat[0])
    if offset != avail:
        raise CheckpointCorruptError(f"{flat[0][0].path}: rank 0 holds {avail} fp32 elements but the parameters "
                                     f"need {offset}; the checkpoint is corrupt or from another world size")
    return plans


def _frozen_params(model_states: list[dict], stage: int, world: int) -> list[TensorPlan]:
    shapes = model_states[0].get("frozen_param_shapes") or {}
    plans = []
    for name, shape in shapes.items():
        n = _numel(shape)
        if stage <= 2:
            refs = [_flat_ref(model_states[0]["frozen_param_fragments"][name], f"frozen parameter {name}")]
        else:
            refs = [_flat_ref(ms["frozen_param_fragments"][name], f"frozen parameter {name} of rank {r}")
                    for r, ms in enumerate(model_states)]
        dtypes = {r.dtype for r in refs}
        if len(dtypes) != 1:
            raise CheckpointCorruptError(f"{refs[0].path}: frozen parameter {name} stored with mixed dtypes {dtypes}")
        plans.append(TensorPlan(name, tuple(int(s) for s in shape), dtypes.pop(), tuple(_fragments(refs, 0, n, 0)),
                                kind="frozen"))
    return plans


def _buffers(model_state: dict) -> list[TensorPlan]:
    names = set(model_state.get("buffer_names") or [])
    plans = []
    for name, ref in (model_state.get("module") or {}).items():
        if name in names and isinstance(ref, TensorRef):
            ref = _flat_ref(ref, f"buffer {name}")
            plans.append(TensorPlan(name, ref.shape, ref.dtype, tuple(_fragments([ref], 0, ref.numel, 0)),
                                    kind="buffer"))
    return plans


def _refuse_expert_parallel(model_state: dict, path: Path) -> None:
    """AutoEP (expert-parallel) experts are not partitioned over the data-parallel world; refuse, as DeepSpeed's
    own zero_to_fp32 does, rather than produce incomplete expert tensors."""
    layers = model_state.get("ds_autoep_layers", model_state.get("autoep_layers"))
    if isinstance(layers, list) and layers:
        raise UnsupportedCheckpointError(f"{path}: expert-parallel (AutoEP) checkpoints are not supported yet; "
                                         "use DeepSpeed's ds_to_universal for them")


def _train_dtype(ds_config: Any) -> str:
    if isinstance(ds_config, dict):
        for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
            section = ds_config.get(key)
            if isinstance(section, dict) and section.get("enabled") is True:
                return dtype
    return "float32"


def _order_like_module(plans: list[TensorPlan], module: dict) -> list[TensorPlan]:
    """Order tensors as the model's state_dict lists them (what save_pretrained writes)."""
    rank = {name: i for i, name in enumerate(module or {})}
    return sorted(plans, key=lambda t: rank.get(t.name, len(rank)))


def read_deepspeed_plan(located: Located) -> CheckpointPlan:
    tag_dir = located.tag_dir
    _prefix, files = _optim_files(tag_dir)
    states = _load_optim_states(files)
    stage, world = _check_world(files, states, tag_dir)
    ms_paths = _model_state_paths(tag_dir, stage, world)
    with ThreadPoolExecutor(max_workers=min(8, len(ms_paths))) as pool:
        model_states = list(pool.map(load_lazy, ms_paths))
    ms0 = model_states[0]
    if not isinstance(ms0, dict) or "param_shapes" not in ms0 or "buffer_names" not in ms0:
        raise CheckpointCorruptError(f"{ms_paths[0]} is not a DeepSpeed model-states file (no param_shapes)")
    _refuse_expert_parallel(ms0, ms_paths[0])
    param_shapes = ms0["param_shapes"]
    if stage <= 2:
        params = _zero12_params(param_shapes, states, world)
    else:
        params = _zero3_params(param_shapes, states, world)
    tensors = _buffers(ms0) + _frozen_params(model_states, stage, world) + params
    tensors = _order_like_module(tensors, ms0.get("module"))
    names = {t.name for t in tensors}
    aliases = {a: c for a, c in (ms0.get("shared_params") or {}).items() if c in names and a not in names}
    source_files = [SourceFile(str(p), "model_states", r if stage == 3 else None, p.stat().st_size)
                    for r, p in enumerate(ms_paths)]
    source_files += [SourceFile(str(files[r]), "optim_states", r, files[r].stat().st_size) for r in range(world)]
    step = ms0.get("global_steps")
    return CheckpointPlan(
        source=str(located.src), format="deepspeed", stage=stage, world_size=world,
        train_dtype=_train_dtype(ms0.get("ds_config")), tag=located.tag,
        step=int(step) if isinstance(step, int) else None, tensors=tuple(tensors), aliases=aliases,
        files=tuple(source_files), model_dir=str(located.model_dir) if located.model_dir else None,
        version=str(ms0.get("ds_version")) if ms0.get("ds_version") is not None else None,
    )
