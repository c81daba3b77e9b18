"""``zckpt reshard``: the full training state, laid out for N ranks, exactly.

* reshard math as a pure function (hypothesis): rank partitions built from :func:`partition_pieces` hold every
  parameter element exactly once, where the engine's table says, padding zero;
* every DeepSpeed fixture resharded to N in {1, 2, 3, 4, 8}: weights (consolidate) bit-identical, every optimizer
  state tensor of every parameter bit-identical, step / hyper-parameters / counters carried, layout = the engine's;
* bad input: N < 1, OUT inside SRC, a source without optimizer state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zckpt
from conftest import FIXTURES, fixture_ids
from engine.partition import engine_layout, engine_units
from zckpt.assemble import FileCache
from zckpt.cli.main import main
from zckpt.errors import InvalidArgumentError, UnsupportedCheckpointError
from zckpt.plan import CheckpointPlan
from zckpt.readers import open_plan
from zckpt.reshard import reshard
from zckpt.tensors import read_tensor
from zckpt.writers.engine_native import partition_pieces, require_training_state

WORLD_SIZES = [1, 2, 3, 4, 8]


# -- the math, without files -----------------------------------------------------------------------------------
@st.composite
def layouts(draw):
    n = draw(st.integers(1, 12))
    numels = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    n_groups = draw(st.integers(1, 3))
    groups = sorted(draw(st.lists(st.integers(0, n_groups - 1), min_size=n, max_size=n)))
    groups = [sorted(set(groups)).index(g) for g in groups]  # dense group ids
    names = [f"m{draw(st.integers(0, 4))}.p{i}" for i in range(n)]
    stage = draw(st.integers(0, 3))
    world = draw(st.integers(1, 9))
    bucket = draw(st.integers(1, 100))
    return numels, groups, names, stage, world, bucket


class _Marker:
    """A stand-in source tensor: element k of parameter i has value ``1000 * (i + 1) + k``."""

    def __init__(self, i: int):
        self.i = i


@given(layouts())
def test_partition_pieces_place_every_element_once(layout):
    numels, groups, names, stage, world, bucket = layout
    units = engine_units(stage, numels, groups, names, reduce_bucket_size=bucket)
    table = engine_layout(stage, world, numels, groups, units)
    sources = [_Marker(i) for i in range(len(numels))]
    seen = {i: np.zeros(n, dtype=np.int64) for i, n in enumerate(numels)}
    for rank in range(table.world_size):
        for g in range(table.num_groups):
            flat = []
            for count, src, start in partition_pieces(table, rank, g, sources):
                if src is None:
                    flat.extend([0] * count)
                else:
                    flat.extend(1000 * (src.i + 1) + start + k for k in range(count))
                    seen[src.i][start:start + count] += 1
            assert len(flat) == table.group_partition_numel[g]
            for i, f in table.rank_fragments(rank):
                if f.group == g:
                    got = flat[f.partition_offset:f.partition_offset + f.numel]
                    assert got == [1000 * (i + 1) + f.dest + k for k in range(f.numel)]
    for i, counts in seen.items():
        assert (counts == 1).all(), f"param {i} elements placed {counts.tolist()} times"


# -- real checkpoints ------------------------------------------------------------------------------------------
def _assert_same_state(src: CheckpointPlan, out: CheckpointPlan) -> None:
    files = FileCache()
    try:
        a, b = {t.name: t for t in src.tensors}, {t.name: t for t in out.tensors}
        assert a.keys() == b.keys() and src.aliases == out.aliases
        for name, t in a.items():
            u = b[name]
            assert (t.kind, t.shape, t.group) == (u.kind, u.shape, u.group), name
            assert torch.equal(read_tensor(t, files), read_tensor(u, files)), name
            assert [s.key for s in t.state] == [s.key for s in u.state], name
            for s in t.state:
                assert torch.equal(read_tensor(t.state_tensor(s.key), files),
                                   read_tensor(u.state_tensor(s.key), files)), (name, s.key)
        ta, tb = src.training, out.training
        assert ta.state_keys == tb.state_keys and ta.optimizer == tb.optimizer
        assert [g.hparams for g in ta.groups] == [g.hparams for g in tb.groups]
        for ga, gb in zip(ta.groups, tb.groups):
            assert [float(read_tensor(s, files)) for s in ga.scalars] == \
                   [float(read_tensor(s, files)) for s in gb.scalars]
        for key, value in ta.counters.items():
            assert tb.counters[key] == value, key
        assert (ta.scheduler, ta.loss_scaler, ta.client_state) == (tb.scheduler, tb.loss_scaler, tb.client_state)
    finally:
        files.close()


def _assert_engine_layout(out: Path, world: int, stage: int) -> None:
    manifest = json.loads((out / (out / "latest").read_text() / "manifest.json").read_text())
    assert manifest["world_size"] == world and manifest["stage"] == stage
    params = manifest["params"]
    numels = [math.prod(p["shape"]) for p in params]
    groups = [p["group"] for p in params]
    table = engine_layout(stage, world, numels, groups, manifest["layout"]["units"])
    for i, p in enumerate(params):
        want = [(f.rank, f.partition_offset, f.numel, f.dest) for f in table.fragments(i)]
        assert [(f["rank"], f["offset"], f["numel"], f["dest"]) for f in p["fragments"]] == want, p["name"]
    assert [g["partition_numel"] for g in manifest["groups"]] == list(table.group_partition_numel)


@pytest.mark.parametrize("name", fixture_ids())
def test_deepspeed_fixtures_reshard_exactly(name, tmp_path):
    src = FIXTURES / name / ("ckpt" if (FIXTURES / name / "ckpt").is_dir() else "")
    plan = open_plan(src)
    for world in WORLD_SIZES:
        out = tmp_path / f"ws{world}"
        result = reshard(src, out, world_size=world)
        assert result.to_world_size == world and result.from_world_size == plan.world_size
        _assert_engine_layout(out, world, plan.stage)
        _assert_same_state(plan, open_plan(out))


@pytest.mark.parametrize("name", ["z2_bf16_ws2_tied_g2", "z3_bf16_ws3_untied_g2", "z2_fp32_ws2_frozen"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_stage_change_keeps_state(name, stage, tmp_path):
    src = FIXTURES / name / "ckpt"
    out = tmp_path / "out"
    reshard(src, out, world_size=3, stage=stage)
    _assert_engine_layout(out, 3, stage)
    _assert_same_state(open_plan(src), open_plan(out))


def test_reshard_of_reshard_is_identity(tmp_path):
    src = FIXTURES / "z3_bf16_ws2_tied" / "ckpt"
    reshard(src, tmp_path / "a", world_size=5)
    reshard(tmp_path / "a", tmp_path / "b", world_size=2, stage=2)
    reshard(tmp_path / "b", tmp_path / "c", world_size=5, stage=3)
    for f in (tmp_path / "a" / "global_step3").glob("rank*.safetensors"):
        assert f.read_bytes() == (tmp_path / "c" / "global_step3" / f.name).read_bytes(), f.name


def test_cli_json_and_config(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}))
    src = FIXTURES / "z3_fp32_ws2_untied_g2" / "ckpt"
    with pytest.raises(SystemExit) as exc:
        main(["reshard", str(src), str(tmp_path / "out"), "--world-size", "4", "--config", str(cfg), "--json"])
    assert exc.value.code in (0, None)
    result = json.loads(capsys.readouterr().out)
    assert (result["to_world_size"], result["to_stage"], result["reduce_bucket_size"]) == (4, 1, 1000)
    assert result["from_stage"] == 3 and result["state_keys"] == ["exp_avg", "exp_avg_sq"]
    _assert_engine_layout(tmp_path / "out", 4, 1)
    report = zckpt.inspect(tmp_path / "out")
    assert report["training_state"]["state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert report["training_state"]["counters"]["global_steps"] == 3


# -- bad input -------------------------------------------------------------------------------------------------
def _cli(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().err


def test_bad_world_size_and_out_inside_src(tmp_path, capsys, copy_fixture):
    src = copy_fixture("z2_bf16_ws2_tied_g2")
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    code, err = _cli(["reshard", str(src), str(tmp_path / "o"), "--world-size", "0"], capsys)
    assert code == 2 and err.startswith("error: --world-size must be at least 1")
    code, err = _cli(["reshard", str(src), str(src / "inside"), "--world-size", "2"], capsys)
    assert code == 2 and "overlaps the source" in err
    code, err = _cli(["reshard", str(src), str(tmp_path / "o"), "-n", "2", "--stage", "4"], capsys)
    assert code == 2 and "--stage" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".zckpt-staging-*"))
    assert before == {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}


def test_weights_only_source_is_refused(tmp_path):
    from dataclasses import replace

    plan = open_plan(FIXTURES / "z2_fp32_ws1_untied" / "ckpt")
    with pytest.raises(UnsupportedCheckpointError, match="weights only.*consolidate"):
        require_training_state(replace(plan, training=None))
    with pytest.raises(InvalidArgumentError, match="world-size"):
        reshard(FIXTURES / "z2_fp32_ws1_untied" / "ckpt", tmp_path / "o", world_size=-1)
