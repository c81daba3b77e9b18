"""Partition math, for many shapes and world sizes, without processes (engine.partition is pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.partition import bucket_params, build_partition


def _check(table, numels, world_size):
    # fragments of each param tile it exactly, in dest order
    for i, n in enumerate(numels):
        covered = 0
        for f in table.fragments(i):
            assert f.dest == covered and f.numel > 0
            assert 0 <= f.rank < world_size
            covered += f.numel
        assert covered == n
    # per rank and group, fragments never overlap and stay inside the partition
    for rank in range(world_size):
        spans = sorted((f.group, f.partition_offset, f.partition_offset + f.numel) for _, f in table.rank_fragments(rank))
        for (g1, _, e1), (g2, s2, _) in zip(spans, spans[1:]):
            assert g1 != g2 or e1 <= s2
        for g, s, e in spans:
            assert 0 <= s < e <= table.group_partition_numel[g]
    for u in table.units:
        assert u.padded_numel(world_size) >= u.numel
        assert u.padded_numel(world_size) - u.numel < world_size * 8 or u.numel == 0
    assert sum(u.slice_numel for u in table.units if u.group == 0) == table.group_partition_numel[0]


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=70), min_size=1, max_size=12),
    world_size=st.integers(min_value=1, max_value=9),
    bucket=st.integers(min_value=1, max_value=100),
    align=st.sampled_from([1, 2, 8]),
    data=st.data(),
)
def test_fragments_tile_params(numels, world_size, bucket, align, data):
    groups = sorted(data.draw(st.lists(st.integers(0, 2), min_size=len(numels), max_size=len(numels))))
    groups = [g - groups[0] for g in groups]
    # make group ids dense
    dense = {g: i for i, g in enumerate(sorted(set(groups)))}
    groups = [dense[g] for g in groups]
    units = bucket_params(numels, groups, bucket)
    table = build_partition(numels, groups, units, world_size, align=align)
    _check(table, numels, world_size)
    for u in table.units:
        assert u.slice_numel % align == 0
        assert len({groups[s.index] for s in u.params}) == 1


@given(numels=st.lists(st.integers(1, 50), min_size=1, max_size=20), bucket=st.integers(1, 120))
def test_buckets_respect_size(numels, bucket):
    units = bucket_params(numels, [0] * len(numels), bucket)
    assert [i for u in units for i in u] == list(range(len(numels)))
    for u in units:
        assert len(u) == 1 or sum(numels[i] for i in u) <= bucket


def test_known_layout():
    # two params (5 and 3 elements) in one unit over 3 ranks: 8 -> slices of 3, padded to 9
    table = build_partition([5, 3], [0, 0], [[0, 1]], 3)
    (unit,) = table.units
    assert unit.slice_numel == 3 and unit.padded_numel(3) == 9
    assert [(f.rank, f.partition_offset, f.numel, f.dest) for f in table.fragments(0)] == [(0, 0, 3, 0), (1, 0, 2, 3)]
    assert [(f.rank, f.partition_offset, f.numel, f.dest) for f in table.fragments(1)] == [(1, 2, 1, 0), (2, 0, 2, 1)]
    assert table.padding() == 1


def test_unit_offsets_accumulate_per_group():
    table = build_partition([4, 4, 6], [0, 1, 0], [[0], [1], [2]], 2, align=4)
    assert [u.partition_offset for u in table.units] == [0, 0, 4]
    assert table.group_partition_numel == (8, 4)


@pytest.mark.parametrize("bad", [
    dict(numels=[1, 2], groups=[0, 0], units=[[0]], world_size=2),            # param 1 missing
    dict(numels=[1, 2], groups=[0, 0], units=[[0, 1], [1]], world_size=2),   # duplicated
    dict(numels=[1, 2], groups=[0, 1], units=[[0, 1]], world_size=2),        # mixed groups
    dict(numels=[1], groups=[0], units=[[0]], world_size=0),                 # bad world size
])
def test_rejects_bad_layouts(bad):
    with pytest.raises(ValueError):
        build_partition(**bad)
