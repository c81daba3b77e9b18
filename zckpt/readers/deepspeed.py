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

The training state (:class:`~zckpt.plan.TrainingState`), also from metadata alone:

* The base optimizer sees each fp32 flat group as one parameter. Its torch ``state_dict`` sits in
  ``base_optimizer_state`` (stages 1/2) or ``optimizer_state_dict`` (stage 3) of every shard: per flat group, the
  moments (``exp_avg``, ``exp_avg_sq``: 1-D, one element per element of the rank's fp32 partition, so a parameter's
  moments have exactly its fp32 fragments' layout) and scalars (``step``); ``param_groups`` carry the
  hyper-parameters. A rigid stage-1/2 save keeps the last rank's alignment padding (``group_paddings``) at the
  moments' tail; the fp32 partition is saved without it. DeepSpeed's elastic form (``elastic_checkpoint``) is a list
  of per-group states without padding and without ``param_groups``.
* Loss scaler (pickled ``LossScaler``/``DynamicLossScaler``), ``lr_scheduler``, counters, client state and
  ``ds_config`` are in the model states (rank 0's) and the shards.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine import checkpoint_format as spec

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsupportedCheckpointError
from ..plan import (DTYPE_SIZES, CheckpointPlan, Fragment, OptimizerGroup, SourceFile, StatePlan, TensorPlan,
                    TrainingState)
from .locate import Located
from .torch_pickle import TensorRef, load_lazy, zip_checks

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


def _fp32_flat(states: dict[int, dict], stage: int, world: int, files: dict[int, Path]) -> list[list[TensorRef]]:
    """The fp32 master partitions, flat group ``s`` by rank ``r``: ``[s][r]``."""
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    per_rank = [states[r].get(key) for r in range(world)]
    for r, groups in enumerate(per_rank):
        if not isinstance(groups, (list, tuple)) or len(groups) != len(per_rank[0]):
            raise CheckpointCorruptError(f"{files[r]}: optimizer_state_dict.{key} is missing or holds another number "
                                         "of groups than rank 0's; the checkpoint is corrupt")
    what = ("single_partition_of_fp32_groups[{s}] of rank {r}" if stage <= 2 else "fp32_flat_groups of rank {r}")
    flat = [[_flat_ref(per_rank[r][s], what.format(s=s, r=r)) for r in range(world)] for s in range(len(per_rank[0]))]
    for s, refs in enumerate(flat):  # equal partitions; the last rank's is saved without its alignment padding
        for r, ref in enumerate(refs):
            if stage <= 2 and (ref.numel != refs[0].numel if r < world - 1 else ref.numel > refs[0].numel):
                raise CheckpointCorruptError(f"{files[r]}: {what.format(s=s, r=r)} holds {ref.numel} elements, rank "
                                             f"0's {refs[0].numel}; the shards are from different saves — re-save")
    if stage == 3:
        totals = [sum(flat[s][r].numel for s in range(len(flat))) for r in range(world)]
        if len(set(totals)) > 1:
            r = next(r for r, t in enumerate(totals) if t != totals[0])
            raise CheckpointCorruptError(f"{files[r]}: fp32_flat_groups of rank {r} hold {totals[r]} elements, rank "
                                         f"0's {totals[0]}; the shards are from different saves — re-save")
    return flat


def _state_plans(state: dict[str, list[list[TensorRef]]], group: int, start: int, count: int) -> tuple[StatePlan, ...]:
    """Stages 1/2: each state tensor's fragments for elements ``[start, start+count)`` of flat group ``group``, laid
    out exactly like the fp32 partition."""
    return tuple(StatePlan(key, refs[group][0].dtype, tuple(_fragments(refs[group], start, count, 0)))
                 for key, refs in state.items())


def _zero12_params(param_shapes: list[dict], flat: _FlatGroups, world: int) -> list[TensorPlan]:
    """Stages 1/2: flat group ``g`` is param group ``g``; its ranks' partitions concatenated hold the parameters."""
    paddings = flat.paddings
    plans = []
    for g, shapes in enumerate(param_shapes):
        refs = flat.fp32[g]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = _numel(shape)
            plans.append(TensorPlan(name, tuple(int(d) for d in shape), "float32",
                                    tuple(_fragments(refs, offset, n, 0)), group=flat.group_of[g],
                                    state=_state_plans(flat.state, g, offset, n)))
            offset += n + (int(paddings[g][i]) if paddings is not None else 0)
        avail = sum(r.numel for r in refs)
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CheckpointCorruptError(f"{refs[0].path}: param group {g} has {avail} fp32 elements but its "
                                         f"parameters need {offset}; the checkpoint is corrupt")
    return plans


def _zero3_params(param_shapes: list[dict], flat: _FlatGroups, world: int) -> list[TensorPlan]:
    """Stage 3: rank ``r``'s flat groups concatenated hold ``ceil(numel / world)`` elements of every parameter."""
    by_rank = [[flat.fp32[s][r] for s in range(len(flat.fp32))] for r in range(world)]
    state = {key: [[refs[s][r] for s in range(len(refs))] for r in range(world)] for key, refs in flat.state.items()}
    plans, offset = [], 0
    for s, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            n = _numel(shape)
            part = math.ceil(n / world)
            frags, state_frags = [], {key: [] for key in state}
            for r in range(world):
                dest = r * part
                if dest < n:
                    frags.extend(_fragments(by_rank[r], offset, min(part, n - dest), dest))
                    for key, refs in state.items():
                        state_frags[key].extend(_fragments(refs[r], offset, min(part, n - dest), dest))
            plans.append(TensorPlan(name, tuple(int(d) for d in shape), "float32", tuple(frags),
                                    group=flat.group_of[s],
                                    state=tuple(StatePlan(key, state[key][0][0].dtype, tuple(frs))
                                                for key, frs in state_frags.items())))
            offset += part
    avail = sum(t.numel for t in by_rank[0])
    if offset != avail:
        raise CheckpointCorruptError(f"{by_rank[0][0].path}: rank 0 holds {avail} fp32 elements but the parameters "
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


# --- optimizer state: the base optimizer's state_dict, metadata only ---------------------------------------------

#: Top-level keys DeepSpeed itself writes into a model-states file; every other key came from ``client_state``.
_DEEPSPEED_OWN_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "num_experts", "ds_autoep_layers",
    "autoep_layers"})
#: ds_config optimizer params that switch DeepSpeed's implementation rather than set a hyper-parameter
_DS_OPTIMIZER_SWITCHES = frozenset({"torch_adam", "adam_w_mode", "fused", "cpu_offload"})


@dataclass(frozen=True)
class _FlatGroups:
    """The fp32 flat groups and the base optimizer's state of each, indexed ``[s][r]`` (flat group ``s``, rank ``r``).

    Stages 1/2 have one flat group per param group; stage 3 one per sub-group (``sub_group_size``), the sub-groups
    of param group 0 first. The base optimizer sees each flat group as one parameter, so torch's ``state_dict``
    numbers them ``0..S-1`` in that order and its ``state[s]`` holds flat group ``s``'s moments.
    """

    fp32: list[list[TensorRef]]
    #: per-parameter state key -> [s][r], each cut to the fp32 partition's numel (a rigid stage-1/2 save keeps the
    #: last rank's alignment padding, ``group_paddings``, at the moments' tail)
    state: dict[str, list[list[TensorRef]]]
    #: flat group -> optimizer param group
    group_of: list[int]
    #: stages 1/2: ``param_alignment_paddings`` (rank 0's), per param group per parameter
    paddings: list | None = None
    #: rank 0's state dict of each flat group (its scalars, e.g. ``step``, are the groups' scalars)
    rank0_state: list[dict] = field(default_factory=list)
    #: torch's ``param_groups`` (rank 0's); None in the elastic form
    param_groups: list[dict] | None = None
    #: the elastic form's ``base_optimizer_state_step``, if recorded
    elastic_step: Any = None


def _base_state(osd: dict, stage: int, path: Path) -> tuple[list[dict], list[dict] | None, Any]:
    """``(state per flat group, torch param_groups or None, base_optimizer_state_step)`` of one rank's shard.

    Torch's ``state_dict`` form ``{"state": {s: {...}}, "param_groups": [...]}``, or DeepSpeed's elastic form
    (``zero_optimization.elastic_checkpoint``, stages 1/2): a list of per-flat-group state dicts, moments stripped
    of alignment padding, and no param_groups.
    """
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    base = osd.get(key)
    if base is None:
        return [], None, None
    if isinstance(base, list) and all(isinstance(entry, dict) for entry in base):
        return base, None, osd.get("base_optimizer_state_step")
    if not (isinstance(base, dict) and isinstance(base.get("state"), dict)
            and isinstance(base.get("param_groups"), list)):
        raise UnsupportedCheckpointError(f"{path}: optimizer_state_dict.{key} is neither a torch optimizer "
                                         "state_dict nor DeepSpeed's elastic per-group list; zckpt cannot read "
                                         "its optimizer state")
    ids = [pid for group in base["param_groups"] for pid in group.get("params", [])]
    return [base["state"].get(pid, {}) for pid in ids], base["param_groups"], None


def _group_of(param_groups: list[dict] | None, flat_count: int, path: Path) -> list[int]:
    if param_groups is None:
        return list(range(flat_count))
    group_of = [g for g, group in enumerate(param_groups) for _ in group.get("params", [])]
    if len(group_of) != flat_count:
        raise CheckpointCorruptError(f"{path}: the optimizer's param_groups hold {len(group_of)} flat parameters "
                                     f"but there are {flat_count} fp32 flat groups; the checkpoint is corrupt")
    return group_of


def _moment_keys(per_flat: list[dict], path: Path) -> tuple[str, ...]:
    """Keys of the per-parameter state tensors (1-D, one element per fp32 partition element), rank 0's order."""
    keys: dict[str, None] = {}
    for entry in per_flat:
        keys.update((k, None) for k, v in entry.items() if isinstance(v, TensorRef) and v.shape != ())
    for s, entry in enumerate(per_flat):
        missing = [k for k in keys if k not in entry]
        if missing:
            raise CheckpointCorruptError(f"{path}: optimizer state of flat group {s} lacks {missing} that the other "
                                         "groups have; the checkpoint is corrupt")
    return tuple(keys)


def _moment_refs(per_rank: dict[int, list[dict]], keys: tuple[str, ...], fp32: list[list[TensorRef]],
                 states: dict[int, dict], files: dict[int, Path]) -> dict[str, list[list[TensorRef]]]:
    """Every rank's moment of every flat group, checked against its fp32 partition and cut to its numel."""
    out: dict[str, list[list[TensorRef]]] = {key: [] for key in keys}
    for key in keys:
        for s, fp32_refs in enumerate(fp32):
            row = []
            for r, master in enumerate(fp32_refs):
                entry = per_rank[r][s] if s < len(per_rank[r]) else {}
                pad = states[r].get("group_paddings")
                pad = int(pad[s]) if isinstance(pad, (list, tuple)) and s < len(pad) else 0
                ref = entry.get(key)
                if not isinstance(ref, TensorRef) or ref.numel not in (master.numel, master.numel + pad):
                    got = f"{ref.numel} elements" if isinstance(ref, TensorRef) else "none"
                    raise CheckpointCorruptError(
                        f"{files[r]}: optimizer state {key!r} of flat group {s} has {got} but the rank's fp32 "
                        f"partition has {master.numel}; the file is corrupt or from another run — re-save it")
                ref = _flat_ref(ref, f"optimizer state {key!r} of flat group {s} of rank {r}")
                row.append(replace(ref, shape=(master.numel,), stride=(1,)))
            out[key].append(row)
        dtypes = {ref.dtype for row in out[key] for ref in row}
        if len(dtypes) > 1:
            raise CheckpointCorruptError(f"{files[0]}: optimizer state {key!r} is stored with different dtypes "
                                         f"{sorted(dtypes)} across ranks or groups; the checkpoint is corrupt")
    return out


def _flat_groups(states: dict[int, dict], stage: int, world: int, files: dict[int, Path]) -> _FlatGroups:
    """The fp32 flat groups with their moments, every rank's checked against its fp32 partition."""
    fp32 = _fp32_flat(states, stage, world, files)
    bases = {r: _base_state(states[r], stage, files[r]) for r in range(world)}
    per_rank = {r: base[0] for r, base in bases.items()}
    per_flat0, param_groups, step = bases[0]
    if per_flat0 and len(per_flat0) != len(fp32):
        raise CheckpointCorruptError(f"{files[0]}: the optimizer state has {len(per_flat0)} flat groups but there "
                                     f"are {len(fp32)} fp32 flat groups; the checkpoint is corrupt")
    group_of = _group_of(param_groups, len(fp32), files[0])
    keys = _moment_keys(per_flat0, files[0]) if per_flat0 else ()
    moments = _moment_refs(per_rank, keys, fp32, states, files)
    paddings = states[0].get("param_alignment_paddings") if stage <= 2 else None
    return _FlatGroups(fp32, moments, group_of, paddings, per_flat0, param_groups, step)


_NOT_JSON = object()


def _as_json(value: Any, lenient: bool = False) -> Any:
    """``value`` as JSON data (tuples become lists). A leaf that is not JSON becomes ``str(value)`` when
    ``lenient``; otherwise the whole value is ``_NOT_JSON``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)  # also IntEnum (ZeroStageEnum)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (list, tuple)):
        items = [_as_json(v, lenient) for v in value]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(value, dict):
        if not lenient and not all(isinstance(k, str) for k in value):
            return _NOT_JSON
        items = {str(k): _as_json(v, lenient) for k, v in value.items()}
        return _NOT_JSON if any(v is _NOT_JSON for v in items.values()) else items
    return str(value) if lenient else _NOT_JSON


def _json_items(mapping: dict, skip: frozenset[str] = frozenset()) -> dict:
    """The items of ``mapping`` whose value is JSON (as JSON), except the keys in ``skip``."""
    out = {}
    for key, value in mapping.items():
        value = _as_json(value)
        if key not in skip and value is not _NOT_JSON:
            out[key] = value
    return out


def _optimizer_name(param_groups: list[dict] | None, ds_config: Any, keys: tuple[str, ...]) -> str:
    """``adamw`` / ``adam`` from torch's ``decoupled_weight_decay``, else from the ds_config optimizer section."""
    if keys and not {"exp_avg", "exp_avg_sq"} <= set(keys):
        return "unknown"
    flags = {group.get("decoupled_weight_decay") for group in param_groups or ()}
    if flags and flags <= {True, False} and len(flags) == 1:
        return "adamw" if flags.pop() else "adam"
    section = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(section, dict):
        return "unknown"
    kind = str(section.get("type", "")).lower()
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    if kind == "adamw":
        return "adamw"
    if kind == "adam":  # DeepSpeed's Adam is decoupled unless adam_w_mode is false
        return "adamw" if params.get("adam_w_mode", True) else "adam"
    return "unknown"


def _optimizer_groups(flat: _FlatGroups, ds_config: Any) -> tuple[OptimizerGroup, ...]:
    """Per param group: JSON hyper-parameters and rank 0's scalar state tensors (``step``) as TensorPlans.

    The elastic form records no param_groups: the hyper-parameters are then the ds_config optimizer params, the
    same for every group (per-group values set in code are not recorded by DeepSpeed there)."""
    if flat.param_groups is None:
        section = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
        params = section.get("params") if isinstance(section, dict) and isinstance(section.get("params"), dict) else {}
        common = _json_items(params, _DS_OPTIMIZER_SWITCHES)
        if flat.elastic_step is not None and _as_json(flat.elastic_step) is not _NOT_JSON:
            common["step"] = _as_json(flat.elastic_step)
        hparams = [dict(common) for _ in range(max(flat.group_of, default=-1) + 1)]
    else:
        hparams = [_json_items(group, frozenset({"params"})) for group in flat.param_groups]
    groups = []
    for g, hp in enumerate(hparams):
        first = next((flat.rank0_state[s] for s, owner in enumerate(flat.group_of)
                      if owner == g and s < len(flat.rank0_state)), {})
        scalars = []
        for key, value in first.items():
            if isinstance(value, TensorRef) and value.shape == ():
                ref = _flat_ref(value, f"optimizer state {key!r} of param group {g}")
                scalars.append(TensorPlan(key, (), ref.dtype, (Fragment(ref.path, ref.byte_offset, 1, 0),)))
            elif not isinstance(value, TensorRef) and _as_json(value) is not _NOT_JSON:
                hp.setdefault(key, _as_json(value))  # e.g. an int ``step`` (DeepSpeed's fused Adam keeps it here)
        groups.append(OptimizerGroup(g, hp, tuple(scalars)))
    return tuple(groups)


def _loss_scaler(osd: dict, train_dtype: str, path: Path) -> dict | None:
    """The engine's loss-scaler state (``engine.precision`` ``state_dict()``); None unless fp16, where the engine
    keeps no scaler (DeepSpeed's bf16/fp32 ``LossScaler(1.0)`` is a no-op)."""
    scaler = osd.get("loss_scaler")
    if train_dtype != "float16" or scaler is None:
        return None
    try:
        return spec.loss_scaler_from_deepspeed(scaler)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: the pickled loss scaler lacks or garbles {exc}; the file is "
                                     "corrupt") from None


def _training_state(flat: _FlatGroups, osd0: dict, ms0: dict, train_dtype: str, path: Path) -> TrainingState:
    """Everything beyond the weights: optimizer state plans, groups, scheduler, loss scaler, counters, client state."""
    ds_config = ms0.get("ds_config")
    keys = tuple(flat.state)
    scheduler = _as_json(ms0.get("lr_scheduler")) if isinstance(ms0.get("lr_scheduler"), dict) else None
    counters = {k: int(ms0[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                if isinstance(ms0.get(k), int) and not isinstance(ms0.get(k), bool)}
    client = {k: v for k, v in ((k, _as_json(v)) for k, v in ms0.items() if k not in _DEEPSPEED_OWN_KEYS)
              if v is not _NOT_JSON and isinstance(k, str)}
    return TrainingState(
        optimizer=_optimizer_name(flat.param_groups, ds_config, keys), state_keys=keys,
        groups=_optimizer_groups(flat, ds_config),
        scheduler=None if scheduler is _NOT_JSON else scheduler, loss_scaler=_loss_scaler(osd0, train_dtype, path),
        counters=counters, client_state=client,
        config=_as_json(ds_config, lenient=True) if isinstance(ds_config, dict) else None)


#: what pickled data of the wrong shape (a list where a dict belongs, a string for a number) raises in this module
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)


def read_deepspeed_plan(located: Located) -> CheckpointPlan:
    """The plan of a DeepSpeed ZeRO tag folder. Any structure the reader does not expect (a damaged or hand-edited
    pickle that unpickled fine) becomes :class:`CheckpointCorruptError` naming the folder."""
    try:
        return _read_plan(located)
    except _SHAPE_ERRORS as exc:
        raise CheckpointCorruptError(f"{located.tag_dir}: the DeepSpeed files do not have the expected structure "
                                     f"({type(exc).__name__}: {str(exc)[:100]}); the checkpoint is damaged or not "
                                     "a ZeRO checkpoint, re-save it or pick another tag with --tag") from None


def _check_model_states(model_states: list, ms_paths: list[Path], world: int) -> None:
    """Cross-rank consistency of the model-states files: each a dict, all from the same step and DeepSpeed
    version, recording the optimizer shards' world size."""
    for path, ms in zip(ms_paths, model_states):
        if not isinstance(ms, dict):
            raise CheckpointCorruptError(f"{path} is not a DeepSpeed model-states file (not a dict)")
    first = model_states[0]
    for key in ("global_steps", "ds_version", "dp_world_size"):
        for path, ms in zip(ms_paths[1:], model_states[1:]):
            if repr(ms.get(key)) != repr(first.get(key)):
                raise CheckpointCorruptError(f"{path}: {key} {ms.get(key)!r} differs from {ms_paths[0].name}'s "
                                             f"{first.get(key)!r}; the files are from different saves, re-save or "
                                             "pick another tag with --tag")
    dp = first.get("dp_world_size")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp != world:
        raise CheckpointCorruptError(f"{ms_paths[0]}: dp_world_size {dp} but the optimizer shards are partitioned "
                                     f"over {world} ranks; the files are from different runs")


def _read_plan(located: Located) -> CheckpointPlan:
    tag_dir = located.tag_dir
    _prefix, files = _optim_files(tag_dir)
    states = _load_optim_states(files)
    stage, world = _check_world(files, states, tag_dir)
    ms_paths = _model_state_paths(tag_dir, stage, world)
    with ThreadPoolExecutor(max_workers=min(8, len(ms_paths))) as pool:
        model_states = list(pool.map(load_lazy, ms_paths))
    _check_model_states(model_states, ms_paths, world)
    ms0 = model_states[0]
    if not isinstance(ms0, dict) or "param_shapes" not in ms0 or "buffer_names" not in ms0:
        raise CheckpointCorruptError(f"{ms_paths[0]} is not a DeepSpeed model-states file (no param_shapes)")
    _refuse_expert_parallel(ms0, ms_paths[0])
    param_shapes = ms0["param_shapes"]
    flat = _flat_groups(states, stage, world, files)
    if not isinstance(param_shapes, list) or len(param_shapes) != len(flat.fp32):
        raise CheckpointCorruptError(f"{ms_paths[0]}: param_shapes lists {len(param_shapes or ())} groups but the "
                                     f"optimizer shards hold {len(flat.fp32)} fp32 flat groups; the checkpoint is "
                                     "corrupt or its files are from different runs")
    params = (_zero12_params if stage <= 2 else _zero3_params)(param_shapes, flat, world)
    tensors = _buffers(ms0) + _frozen_params(model_states, stage, world) + params
    tensors = _order_like_module(tensors, ms0.get("module"))
    names = {t.name for t in tensors}
    aliases = {a: c for a, c in (ms0.get("shared_params") or {}).items() if c in names and a not in names}
    source_files = [SourceFile(str(p), "model_states", r if stage == 3 else None, p.stat().st_size, zip_checks(p))
                    for r, p in enumerate(ms_paths)]
    source_files += [SourceFile(str(files[r]), "optim_states", r, files[r].stat().st_size, zip_checks(files[r]))
                     for r in range(world)]
    step = ms0.get("global_steps")
    train_dtype = _train_dtype(ms0.get("ds_config"))
    training = _training_state(flat, states[0], ms0, train_dtype, files[0])
    return CheckpointPlan(
        source=str(located.src), format="deepspeed", stage=stage, world_size=world,
        train_dtype=train_dtype, tag=located.tag,
        step=int(step) if isinstance(step, int) else None, tensors=tuple(tensors), aliases=aliases,
        files=tuple(source_files), model_dir=str(located.model_dir) if located.model_dir else None,
        version=str(ms0.get("ds_version")) if ms0.get("ds_version") is not None else None, training=training,
    )
