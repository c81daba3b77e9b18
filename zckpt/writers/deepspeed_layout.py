"""PURE: where DeepSpeed 0.19.8 puts each trainable parameter's fp32 elements for N ranks. No torch, no I/O.

The rules, as DeepSpeed's own code applies them (``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``partition_parameters.py``; ``utils/zero_to_fp32.py`` undoes them):

* **Stages 1/2** (``DeepSpeedZeroOptimizer``, ``round_robin_gradients`` and ``parameter_alignment`` off, their
  defaults): one flat group per optimizer param group, the group's parameters back to back in the group's order,
  padded at the end to a multiple of ``nccl_start_alignment_factor * N = 2 * N`` elements. Rank ``r`` owns the
  equal slice ``[r * P, (r + 1) * P)`` with ``P = aligned / N``; the padding that falls in its slice is its
  ``groups_padding[r]``. The fp32 master partition is saved *without* that padding, the Adam moments *with* it
  (they are the base optimizer's full partition).
* **Stage 3** (``DeepSpeedZeroOptimizer_Stage3``): every parameter is split on its own into ``ceil(numel / N)``
  elements per rank (``_aligned_size // N``; the last ranks zero-padded). Each param group's parameters form
  sub-groups closed once their per-rank partition sizes sum to ``sub_group_size`` or more (or at the group's last
  parameter; one sub-group when the whole group fits). Rank ``r``'s flat fp32 group of a sub-group is its pieces of
  the sub-group's parameters back to back; the moments have the same length.

A :class:`FlatGroup` says, for one flat group and every rank, which element ranges of which parameters land where
in that rank's partition (:class:`Piece`); the rest of the partition is zero padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: DeepSpeedZeroOptimizer.nccl_start_alignment_factor (4-byte alignment / sizeof(fp16))
NCCL_START_ALIGNMENT_FACTOR = 2
#: zero_optimization.sub_group_size default (DeepSpeedZeroConfig)
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of trainable parameter ``param`` at element ``dest`` of a partition."""

    param: int
    start: int
    count: int
    dest: int


@dataclass(frozen=True)
class FlatGroup:
    """One flat fp32 group (stages 1/2: a param group; stage 3: a sub-group), laid out for every rank."""

    #: the optimizer param group it belongs to
    group: int
    #: trainable-parameter indices, in flat order
    params: tuple[int, ...]
    #: elements of each rank's partition (the moments' length; padding included)
    partition_numel: int
    #: per rank: the parameter pieces of its partition, by ``dest``
    pieces: tuple[tuple[Piece, ...], ...]
    #: per rank: trailing zero padding of its partition (stages 1/2: ``groups_padding``; stage 3: 0)
    padding: tuple[int, ...]

    def saved_numel(self, rank: int) -> int:
        """Elements of the fp32 partition as DeepSpeed saves it (stages 1/2 drop the padding)."""
        return self.partition_numel - self.padding[rank]


@dataclass(frozen=True)
class DeepSpeedLayout:
    stage: int
    world_size: int
    flat_groups: tuple[FlatGroup, ...]


def _group_members(groups: list[int]) -> list[list[int]]:
    """Trainable-parameter indices of each param group ``0..G-1``, in plan order; ValueError on an empty group."""
    count = max(groups, default=-1) + 1
    members: list[list[int]] = [[] for _ in range(count)]
    for i, g in enumerate(groups):
        members[g].append(i)
    empty = [g for g, m in enumerate(members) if not m]
    if empty:
        raise ValueError(f"optimizer param group(s) {empty} hold no trainable parameter")
    return members


def zero12_layout(world: int, numels: list[int], groups: list[int]) -> DeepSpeedLayout:
    """Stages 1/2: one flat group per param group, aligned to ``2 * world`` and cut into ``world`` equal slices."""
    flats = []
    align = NCCL_START_ALIGNMENT_FACTOR * world
    for g, members in enumerate(_group_members(groups)):
        total = sum(numels[i] for i in members)
        part = math.ceil(total / align) * align // world
        offsets = [0]
        for i in members:
            offsets.append(offsets[-1] + numels[i])
        per_rank, paddings = [], []
        for r in range(world):
            lo, hi = r * part, (r + 1) * part
            pieces = []
            for i, off in zip(members, offsets):
                a, b = max(off, lo), min(off + numels[i], hi)
                if a < b:
                    pieces.append(Piece(param=i, start=a - off, count=b - a, dest=a - lo))
            per_rank.append(tuple(pieces))
            # stage_1_and_2.py: padding = whole slice past the data, the data's tail inside it, else 0
            paddings.append(part if total <= lo else hi - total if total < hi else 0)
        flats.append(FlatGroup(g, tuple(members), part, tuple(per_rank), tuple(paddings)))
    return DeepSpeedLayout(stage=2, world_size=world, flat_groups=tuple(flats))


def zero3_partition_numel(numel: int, world: int) -> int:
    """``partition_parameters.py``: ``(numel + padding to a multiple of world) // world``."""
    return math.ceil(numel / world)


def _sub_groups(members: list[int], parts: dict[int, int], sub_group_size: int) -> list[list[int]]:
    """``stage3.py _create_fp16_sub_groups``."""
    if sub_group_size is None or sub_group_size >= sum(parts[i] for i in members):
        return [list(members)]
    out, current, size = [], [], 0
    for i in members:
        current.append(i)
        size += parts[i]
        if size >= sub_group_size or i == members[-1]:
            out.append(current)
            current, size = [], 0
    return out


def zero3_layout(world: int, numels: list[int], groups: list[int],
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> DeepSpeedLayout:
    """Stage 3: per-parameter ``ceil(numel / world)`` pieces, gathered into sub-groups per param group."""
    parts = {i: zero3_partition_numel(n, world) for i, n in enumerate(numels)}
    flats = []
    for g, members in enumerate(_group_members(groups)):
        for sub in _sub_groups(members, parts, sub_group_size):
            per_rank = []
            for r in range(world):
                pieces, dest = [], 0
                for i in sub:
                    start = r * parts[i]
                    count = max(0, min(parts[i], numels[i] - start))
                    if count:
                        pieces.append(Piece(param=i, start=start, count=count, dest=dest))
                    dest += parts[i]
                per_rank.append(tuple(pieces))
            flats.append(FlatGroup(g, tuple(sub), sum(parts[i] for i in sub), tuple(per_rank), (0,) * world))
    return DeepSpeedLayout(stage=3, world_size=world, flat_groups=tuple(flats))


def deepspeed_layout(stage: int, world: int, numels: list[int], groups: list[int],
                     sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> DeepSpeedLayout:
    if stage in (1, 2):
        return DeepSpeedLayout(stage, world, zero12_layout(world, numels, groups).flat_groups)
    if stage == 3:
        return zero3_layout(world, numels, groups, sub_group_size)
    raise ValueError(f"DeepSpeed ZeRO stage must be 1, 2 or 3, got {stage}")
