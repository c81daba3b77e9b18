"""Load-time resharding: restore an engine from a checkpoint written at another world size, ZeRO stage or partition
layout, engine-native or DeepSpeed, through zckpt's plan (:func:`zckpt.readers.open_plan`: names, shapes and the byte
ranges of every tensor's fragments, plus the training state; no tensor bytes are read to build it).

Protocol (every rank; the only collectives are the error agreements and what :mod:`engine.checkpoint` does after)::

    1. open   every rank opens the plan (metadata only); engine-native sources also get their files' sha256
              checked, each file by one rank; parameters, frozen parameters and buffers are matched BY NAME (tied
              aliases through the plan's and the engine's alias maps), shapes and optimizer groups checked.
    2. read   rank r walks ``table.rank_fragments(r)`` of this run's partition table: for each (param i, fragment
              f) it reads elements [f.dest, f.dest + f.numel) of param i's fp32 master and of every optimizer
              state tensor into its flat partitions at f.partition_offset (padding stays zero). Bytes read per
              rank: its own partition of the masters and moments, never the whole model.
    3. apply  masters and state into the optimizer (hyper-parameters and ``step`` from the source's groups),
              loss scaler, frozen parameters and buffers (by name), then the scheduler and counters.

Any rank's failure in 1 or 2 is all-gathered and raised on every rank (no rank is left waiting in a collective).
Exactly one line is logged (rank 0): what was resharded, e.g.
``resharded /ckpt/global_step3: world size 2 -> 3, stage 2 -> 3 (engine-native)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import checkpoint_format as spec
from engine import comm
from engine.checkpoint import (CheckpointError, CheckpointView, _persistent_buffer_names, _verify_file,
                               finish_load, restore_frozen_and_buffers)

logger = logging.getLogger("engine.checkpoint")

_FORMAT_NAMES = {"engine": "engine-native", "deepspeed": "DeepSpeed"}


@dataclass(frozen=True)
class _Matched:
    """The plan's tensors for this run's parameters, frozen parameters and buffers, in the engine's orders."""

    params: tuple  # TensorPlan per trainable param (table index order)
    frozen: tuple  # TensorPlan per frozen param
    buffers: dict  # buffer name -> TensorPlan
    group_map: tuple  # engine optimizer group -> source group (an index into plan.training.groups)


def load_resharded(view: CheckpointView, load_dir: Path, tag: str, manifest: spec.Manifest | None,
                   load_optimizer_states: bool, load_lr_scheduler_states: bool) -> dict:
    """Collective. Load ``load_dir/tag`` (engine-native with its ``manifest``, or any format zckpt reads when
    ``manifest`` is None) into ``view`` through this run's partition table; returns the client state."""
    tag_dir = Path(load_dir) / tag
    plan, matched = _agreed(lambda: _open(view, load_dir, tag, manifest, load_optimizer_states))
    training = plan.training
    with_state = load_optimizer_states and training is not None and bool(training.state_keys)
    (masters, states, steps), (frozen, buffers) = _agreed(
        lambda: (_read_partitions(view, plan, matched, with_state), _read_whole(view, matched)))

    view.optimizer.load_masters({spec.master_key(g): m for g, m in enumerate(masters)})
    if load_optimizer_states:
        tensors = {spec.state_key(g, key): flats[g] for key, flats in states.items() for g in range(len(masters))}
        tensors.update({spec.state_key(g, "step"): step for g, step in enumerate(steps) if step is not None})
        view.optimizer.load_state(tensors, [dict(training.groups[s].hparams) for s in matched.group_map])
        if view.loss_scaler is not None and training.loss_scaler is not None:
            view.loss_scaler.load_state_dict(training.loss_scaler)
    restore_frozen_and_buffers(view, frozen, buffers)
    counters = dict(training.counters) if training is not None else {}
    counters.setdefault("global_steps", plan.step or 0)
    finish_load(view, scheduler=training.scheduler if training is not None else None, counters=counters,
                load_lr_scheduler_states=load_lr_scheduler_states,
                skipped_steps=counters.get("skipped_steps", 0) if load_optimizer_states else None)
    if view.rank == 0:
        logger.info("resharded %s: %s (%s)", tag_dir, _describe(view, plan, manifest),
                    _FORMAT_NAMES.get(plan.format, plan.format))
    return dict(training.client_state) if training is not None else {}


# -- 1. open and match ------------------------------------------------------------------------------------------
def _agreed(fn):
    """Run ``fn`` on every rank; if it failed anywhere, every rank raises (none is left in a collective): the first
    failing rank's message as a CheckpointError, or a failing rank's own unexpected exception with its traceback."""
    from zckpt.errors import ZckptError

    result, problem, unexpected = None, None, None
    try:
        result = fn()
    except (CheckpointError, ZckptError, spec.FormatError, OSError) as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 -- a bug: re-raised below, after telling the other ranks
        problem, unexpected = f"rank {comm.rank()} failed: {type(exc).__name__}: {exc}", exc
    problems = [p for p in comm.all_gather_json(problem) if p]
    if unexpected is not None:
        raise unexpected
    if problems:
        raise CheckpointError(problems[0])
    return result



def _open(view: CheckpointView, load_dir: Path, tag: str, manifest: spec.Manifest | None,
          load_optimizer_states: bool):
    from zckpt.readers import open_plan

    if manifest is not None:
        _verify_my_share(view, Path(load_dir) / tag, manifest)
    plan = open_plan(Path(load_dir) / tag)
    training = plan.training
    if load_optimizer_states and not _has_usable_state(plan):
        raise CheckpointError(
            f"{plan.source} holds only the weights (no optimizer state{'' if training is None else ' for its steps'})"
            f": pass load_module_only=True to load just the weights, or load a checkpoint saved with its optimizer")
    return plan, _match(view, plan, load_optimizer_states)


def _has_usable_state(plan) -> bool:
    """Optimizer state to resume from: per-parameter state tensors, or none because the run never stepped."""
    training = plan.training
    if training is None:
        return False
    if training.state_keys:
        return True
    steps = training.counters.get("global_steps", plan.step or 0) - training.counters.get("skipped_steps", 0)
    return steps <= 0


def _verify_my_share(view: CheckpointView, tag_dir: Path, manifest: spec.Manifest) -> None:
    """Check size and sha256 of the engine checkpoint's files, file k on rank k % world size."""
    for k, fname in enumerate(sorted(manifest.files)):
        if k % view.world_size == view.rank:
            _verify_file(tag_dir, fname, manifest)


def _match(view: CheckpointView, plan, load_optimizer_states: bool) -> _Matched:
    """Pair this run's parameters and buffers with the plan's tensors by name; check shapes and groups."""
    by_name = {t.name: t for t in plan.tensors if t.kind in ("param", "frozen")}
    engine_aliases: dict[str, list[str]] = {}
    for alias, canonical in view.aliases.items():
        engine_aliases.setdefault(canonical, []).append(alias)

    def find(name: str):
        for candidate in (name, *engine_aliases.get(name, ())):
            t = by_name.get(candidate) or by_name.get(plan.aliases.get(candidate, ""))
            if t is not None:
                return t
        return None

    wanted = list(view.param_names) + list(view.frozen_names)
    found = [find(n) for n in wanted]
    plan_buffers = {t.name: t for t in plan.tensors if t.kind == "buffer"}
    persistent = _persistent_buffer_names(view.module)
    missing = [n for n, t in zip(wanted, found) if t is None]
    missing += sorted(persistent - set(plan_buffers))
    used = {t.name for t in found if t is not None}
    unexpected = [n for n in by_name if n not in used] + sorted(set(plan_buffers) - persistent)
    if missing or unexpected:
        raise CheckpointError(
            f"{plan.source} does not hold this model's tensors: missing {len(missing)} {missing[:5]}, unexpected "
            f"{len(unexpected)} {unexpected[:5]} (matched by name, tied weights through their aliases); load a "
            f"checkpoint of the same model")
    shapes = list(view.param_shapes) + [tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
                                        for p in view.frozen]
    for name, t, shape in zip(wanted, found, shapes):
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{plan.source}: {t.name} has shape {list(t.shape)}, this model's {name} "
                                  f"{list(shape)}; load a checkpoint of the same model configuration")
    params = tuple(found[: view.n_trainable])
    if load_optimizer_states:
        frozen_there = [n for n, t in zip(view.param_names, params) if t.kind != "param"]
        if frozen_there:
            raise CheckpointError(f"{plan.source}: {frozen_there[:5]} are frozen in the checkpoint but trainable in "
                                  f"this run, so they have no optimizer state: pass load_module_only=True")
    group_map = _group_map(view, plan, params) if load_optimizer_states else ()
    return _Matched(params, tuple(found[view.n_trainable:]), plan_buffers, group_map)


def _group_map(view: CheckpointView, plan, params) -> tuple[int, ...]:
    """For each of this run's optimizer groups, the source group its parameters came from."""
    groups = plan.training.groups
    index_of = {g.index: k for k, g in enumerate(groups)}
    n_groups = len(view.optimizer.masters)
    sources: list[set] = [set() for _ in range(n_groups)]
    for i, t in enumerate(params):
        sources[view.table.units[view.table.param_unit[i]].group].add(t.group)
    out = []
    for g, src in enumerate(sources):
        if None in src:  # the source does not say: groups are taken to correspond by position
            if len(groups) != n_groups:
                raise CheckpointError(f"{plan.source} has {len(groups)} optimizer groups, this run {n_groups}; use "
                                      f"the parameter groups the checkpoint was saved with")
            out.append(g)
            continue
        ks = sorted(index_of[s] for s in src if s in index_of)
        if len(ks) != len(src):
            raise CheckpointError(f"{plan.source}: parameters name optimizer groups {sorted(src)} it does not record")
        first = groups[ks[0]]
        if any(groups[k].hparams != first.hparams for k in ks[1:]):
            raise CheckpointError(
                f"{plan.source}: this run's optimizer group {g} holds parameters of the checkpoint's groups "
                f"{[groups[k].index for k in ks]}, which have different hyper-parameters; use the parameter groups "
                f"the checkpoint was saved with")
        out.append(ks[0])
    return tuple(out)


# -- 2. read ----------------------------------------------------------------------------------------------------
def _read_partitions(view: CheckpointView, plan, matched: _Matched, with_state: bool):
    """This rank's flat fp32 master partitions, state partitions (``{key: [per group]}``) and per-group ``step``
    (CPU tensors; the optimizer moves them), read from exactly the byte ranges of its fragments."""
    from zckpt.assemble import FileCache

    table = view.table
    sizes = [table.group_partition_numel[g] for g in range(len(view.optimizer.masters))]
    keys = plan.training.state_keys if with_state else ()
    masters = [torch.empty(n, dtype=torch.float32) for n in sizes]  # every element is read or zeroed below
    states = {key: [torch.empty(n, dtype=torch.float32) for n in sizes] for key in keys}
    covered: list[list[tuple[int, int]]] = [[] for _ in sizes]
    files = FileCache()
    try:
        for i, f in table.rank_fragments(view.table_rank):
            if i >= view.n_trainable:  # stage 3's partitioned frozen parameters: restored whole, by name
                continue
            src, lo, hi = matched.params[i], f.partition_offset, f.partition_offset + f.numel
            covered[f.group].append((lo, hi))
            _read_range(src, files, f.dest, f.numel, masters[f.group][lo:hi])
            for key in keys:
                _read_range(src.state_tensor(key), files, f.dest, f.numel, states[key][f.group][lo:hi])
        for g, spans in enumerate(covered):  # padding: exactly zero, as the engine keeps it
            for lo, hi in _gaps(sorted(spans), sizes[g]):
                for flat in [masters[g], *(states[key][g] for key in keys)]:
                    flat[lo:hi].zero_()
        steps = [_step(plan, s, files) for s in matched.group_map] if with_state else []
    finally:
        files.close()
    return masters, states, steps


def _gaps(spans: list[tuple[int, int]], size: int):
    """The element ranges of ``[0, size)`` that no span covers (spans sorted, non-overlapping)."""
    pos = 0
    for lo, hi in spans:
        if lo > pos:
            yield pos, lo
        pos = max(pos, hi)
    if pos < size:
        yield pos, size


def _read_range(tplan, files, start: int, count: int, out: torch.Tensor) -> None:
    """Elements ``[start, start + count)`` of ``tplan`` into the contiguous CPU fp32 tensor ``out``."""
    from zckpt.assemble import read_range
    from zckpt.tensors import DTYPES, byte_view

    if tplan.dtype == "float32":
        read_range(tplan, files, start, count, byte_view(out))
        return
    tmp = torch.empty(count, dtype=DTYPES[tplan.dtype])
    read_range(tplan, files, start, count, byte_view(tmp))
    out.copy_(tmp)


def _step(plan, source_group: int, files) -> torch.Tensor | None:
    from zckpt.tensors import read_tensor

    group = plan.training.groups[source_group]
    scalar = next((s for s in group.scalars if s.name == "step"), None)
    if scalar is None:
        if plan.training.state_keys:
            raise CheckpointError(f"{plan.source}: optimizer group {group.index} has state but no step count; the "
                                  f"checkpoint is incomplete")
        return None
    return torch.tensor(float(read_tensor(scalar, files).reshape(())), dtype=torch.float32)


def _read_whole(view: CheckpointView, matched: _Matched) -> tuple[dict, dict]:
    """Frozen parameters and buffers (CPU, as stored). Stage 3's partitioned frozen ones are read on rank 0 only:
    they are re-partitioned from it."""
    from zckpt.assemble import FileCache
    from zckpt.tensors import read_tensor

    files = FileCache()
    try:
        frozen = {}
        for k, (name, t) in enumerate(zip(view.frozen_names, matched.frozen)):
            if k >= view.frozen_partitioned or view.rank == 0:
                frozen[name] = read_tensor(t, files).reshape(t.shape)
        buffers = {name: read_tensor(t, files) for name, t in matched.buffers.items()}
    finally:
        files.close()
    return frozen, buffers


# -- the log line -----------------------------------------------------------------------------------------------
def _describe(view: CheckpointView, plan, manifest: spec.Manifest | None) -> str:
    changes = []
    if plan.world_size != view.world_size:
        changes.append(f"world size {plan.world_size} -> {view.world_size}")
    if plan.stage != view.stage:
        changes.append(f"stage {plan.stage} -> {view.stage}")
    if not changes:
        bucket = manifest.layout.reduce_bucket_size if manifest is not None and manifest.layout else None
        if bucket is not None and bucket != view.reduce_bucket_size:
            changes.append(f"reduce_bucket_size {bucket} -> {view.reduce_bucket_size}")
        else:
            changes.append("partition layout (parameter groups or order)")
    return ", ".join(changes)
