"""Partition math: parameters -> units -> per-rank flat partitions. PURE: no torch, no torch.distributed.

Layout (one layout for every ZeRO stage)
----------------------------------------
Parameters are numbered ``0..P-1`` in engine order and grouped into **units**. A unit is the granule of communication:
its parameters are laid end to end in one flat buffer of ``numel`` elements, padded with zeros to
``padded_numel = slice_numel * world_size`` and cut into ``world_size`` equal, contiguous slices; rank ``r`` owns
elements ``[r * slice_numel, (r + 1) * slice_numel)`` of the unit.

* stages 0-2: units are buckets of consecutive parameters (``reduce_bucket_size``); the full unit buffer lives on every
  rank (model parameters are views into it), gradients are reduce-scattered unit by unit (one collective per unit)
  and updated slices all-gathered back (one collective per unit). Stage 0 uses ``world_size=1`` (no sharding).
* stage 3: units are "the direct parameters of one module" (one all-gather per module forward/backward); only the
  rank's slice is kept between uses.

Each unit belongs to one optimizer group. Rank ``r``'s **flat partition** of group ``g`` is the concatenation, in unit
order, of its slices of the group's units; ``Unit.partition_offset`` says where the unit's slice starts in it. fp32
master weights, gradients and Adam moments are all flat tensors with exactly this layout.

A parameter's **fragments** say where its elements live: ``(rank, group, partition_offset, numel, dest)`` -- ``numel``
elements at ``partition_offset`` of rank ``rank``'s flat partition of group ``group`` are elements
``[dest, dest + numel)`` of the flattened parameter. Fragments of one parameter tile it exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit: ``numel`` elements at element ``offset`` of the unit's flat buffer."""

    index: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Unit:
    """A communication granule: parameters of one group laid out flat, padded, split into equal per-rank slices."""

    index: int
    group: int
    params: tuple[ParamSlot, ...]
    numel: int  # sum of the parameters' numels (unpadded)
    slice_numel: int  # elements each rank owns (padded numel / world_size)
    partition_offset: int  # where this unit's slice starts inside each rank's flat partition of ``group``

    def padded_numel(self, world_size: int) -> int:
        return self.slice_numel * world_size


@dataclass(frozen=True)
class FragmentSpec:
    """``numel`` elements at ``partition_offset`` of rank ``rank``'s flat partition of ``group`` = param ``[dest, dest+numel)``."""

    rank: int
    group: int
    partition_offset: int
    numel: int
    dest: int


@dataclass(frozen=True)
class PartitionTable:
    """The full layout: units, per-group partition sizes, and where each parameter lives."""

    world_size: int
    numels: tuple[int, ...]  # per parameter
    units: tuple[Unit, ...]
    group_partition_numel: tuple[int, ...]  # per group: elements in each rank's flat partition (same on all ranks)
    param_unit: tuple[int, ...]  # per parameter: index of its unit

    @property
    def num_groups(self) -> int:
        return len(self.group_partition_numel)

    def slot(self, index: int) -> ParamSlot:
        unit = self.units[self.param_unit[index]]
        for slot in unit.params:
            if slot.index == index:
                return slot
        raise KeyError(index)  # pragma: no cover - construction guarantees membership

    def fragments(self, index: int) -> list[FragmentSpec]:
        """Where parameter ``index`` lives, one fragment per rank holding any of it, in ``dest`` order."""
        unit = self.units[self.param_unit[index]]
        slot = self.slot(index)
        out = []
        first = slot.offset // unit.slice_numel if unit.slice_numel else 0
        for rank in range(first, self.world_size):
            lo, hi = rank * unit.slice_numel, (rank + 1) * unit.slice_numel
            start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if start >= slot.offset + slot.numel:
                break
            if end > start:
                out.append(FragmentSpec(rank, unit.group, unit.partition_offset + start - lo, end - start,
                                        start - slot.offset))
        return out

    def rank_fragments(self, rank: int) -> list[tuple[int, FragmentSpec]]:
        """All ``(param index, fragment)`` pairs held by ``rank``, in parameter order."""
        return [(i, f) for i in range(len(self.numels)) for f in self.fragments(i) if f.rank == rank]

    def padding(self) -> int:
        """Total padding elements across all units (for reports and tests)."""
        return sum(u.padded_numel(self.world_size) - u.numel for u in self.units)


def bucket_params(numels: Sequence[int], groups: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Greedy buckets of consecutive parameter indices, never mixing groups, each at most ``bucket_numel`` elements
    unless a single parameter is larger (then it is alone in its bucket)."""
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (n, g) in enumerate(zip(numels, groups)):
        if current and (groups[current[0]] != g or size + n > bucket_numel):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def build_partition(
    numels: Sequence[int],
    groups: Sequence[int],
    units: Sequence[Sequence[int]],
    world_size: int,
    *,
    align: int = 1,
) -> PartitionTable:
    """Lay out ``units`` (lists of parameter indices, each list within one group) for ``world_size`` ranks.

    ``numels[i]`` and ``groups[i]`` describe parameter ``i``; every parameter must appear in exactly one unit.
    Each unit's slice size is ``ceil(numel / world_size)`` rounded up to a multiple of ``align`` (so every slice
    starts on an ``align``-element boundary when partitions are allocated aligned).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if len(numels) != len(groups):
        raise ValueError("numels and groups must have the same length")
    num_groups = max(groups, default=-1) + 1
    seen = [False] * len(numels)
    group_offset = [0] * num_groups
    param_unit = [-1] * len(numels)
    out_units = []
    for u_idx, members in enumerate(units):
        if not members:
            raise ValueError(f"unit {u_idx} is empty")
        group = groups[members[0]]
        slots, offset = [], 0
        for i in members:
            if seen[i]:
                raise ValueError(f"parameter {i} appears in more than one unit")
            if groups[i] != group:
                raise ValueError(f"unit {u_idx} mixes groups {group} and {groups[i]}")
            if numels[i] < 0:
                raise ValueError(f"parameter {i} has negative numel")
            seen[i] = True
            param_unit[i] = u_idx
            slots.append(ParamSlot(i, numels[i], offset))
            offset += numels[i]
        slice_numel = _round_up(max(-(-offset // world_size), 1), align)
        out_units.append(Unit(u_idx, group, tuple(slots), offset, slice_numel, group_offset[group]))
        group_offset[group] += slice_numel
    missing = [i for i, s in enumerate(seen) if not s]
    if missing:
        raise ValueError(f"parameters {missing[:5]} are in no unit")
    return PartitionTable(world_size, tuple(numels), tuple(out_units), tuple(group_offset), tuple(param_unit))


# -- the engine's layout, as a pure function of names, sizes and groups ---------------------------------------------
#: Slices are padded to a multiple of this many elements (32 bytes in fp32): aligned collectives on GPUs.
ALIGN = 8


def stage3_units(model_names: Sequence[str], managed: Sequence[str], groups: Sequence[int]) -> list[list[int]]:
    """Stage-3 units: one per (module, group), holding the module's direct parameters.

    ``managed[i]`` is the canonical name of partitioned parameter ``i`` and ``groups[i]`` its group; ``model_names``
    lists parameter names in the model's registration order (``named_parameters(remove_duplicate=False)``; pass
    ``managed`` itself when the model is not at hand). A parameter's module is its name up to the last dot; modules
    come in order of first appearance in ``model_names`` (= ``model.modules()`` order), a unit's parameters in
    registration order, a module's groups in ascending order. A tied parameter belongs to the module that
    registered it first (its canonical name).
    """
    index = {name: i for i, name in enumerate(managed)}
    per_module: dict[str, dict[int, list[int]]] = {}
    taken: set[int] = set()
    for name in list(model_names) + list(managed):
        i = index.get(name)
        if i is None or i in taken:
            continue
        taken.add(i)
        per_module.setdefault(name.rpartition(".")[0], {}).setdefault(groups[i], []).append(i)
    return [per_group[g] for per_group in per_module.values() for g in sorted(per_group)]


def engine_units(stage: int, numels: Sequence[int], groups: Sequence[int], names: Sequence[str], *,
                 reduce_bucket_size: int, model_names: Sequence[str] | None = None) -> list[list[int]]:
    """The units the engine forms at ``stage``: reduce buckets (stages 0-2) or per-module units (stage 3).
    Neither depends on the world size, so a checkpoint's units carry over to any other world size."""
    if stage < 3:
        return bucket_params(numels, groups, max(int(reduce_bucket_size), 1))
    return stage3_units(model_names if model_names is not None else names, names, groups)


def engine_layout(stage: int, world_size: int, numels: Sequence[int], groups: Sequence[int],
                  units: Sequence[Sequence[int]]) -> PartitionTable:
    """The partition table the engine uses at ``stage`` for ``world_size`` ranks (stage 0 keeps one whole copy)."""
    return build_partition(numels, groups, units, world_size if stage > 0 else 1, align=ALIGN)
