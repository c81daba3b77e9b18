"""Load-time resharding decisions without processes: when a checkpoint takes the fast path (its layout is this run's),
what the manifest records about the layout, and how the plan's tensors are matched to the model by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine import checkpoint_format as spec
from engine.checkpoint import CheckpointError, CheckpointView, Counters, build_manifest, same_layout
from engine.partition import ALIGN, engine_layout, engine_units
from engine.reshard_load import _match
from zckpt.plan import CheckpointPlan, Fragment, OptimizerGroup, StatePlan, TensorPlan, TrainingState

NAMES = ["embed.weight", "blocks.0.up.weight", "blocks.0.up.bias", "blocks.1.up.weight", "blocks.1.up.bias",
         "norm.weight"]
SHAPES = [(13, 6), (7, 6), (7,), (7, 6), (7,), (6,)]
GROUPS = [0, 0, 1, 0, 1, 1]
FROZEN = [("frozen.weight", (6, 6))]


def _view(stage: int, world_size: int, bucket: int = 40, names=NAMES, shapes=SHAPES, groups=GROUPS) -> CheckpointView:
    numels = [int(torch.Size(s).numel()) for s in shapes]
    managed_names, managed_groups, managed_numels = list(names), list(groups), list(numels)
    frozen_partitioned = 0
    if stage == 3:  # the engine partitions floating frozen params too, in a group of their own
        frozen_partitioned = len(FROZEN)
        managed_names += [n for n, _ in FROZEN]
        managed_groups += [max(groups) + 1] * len(FROZEN)
        managed_numels += [int(torch.Size(s).numel()) for _, s in FROZEN]
    units = engine_units(stage, managed_numels, managed_groups, managed_names, reduce_bucket_size=bucket)
    table = engine_layout(stage, world_size, managed_numels, managed_groups, units)
    n_groups = max(groups) + 1
    masters = [torch.zeros(table.group_partition_numel[g]) for g in range(n_groups)]
    optimizer = SimpleNamespace(masters=masters, kind="adamw", state_keys=lambda: ("exp_avg", "exp_avg_sq"),
                                hparams=lambda: [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}] * n_groups)
    frozen = tuple(torch.nn.Parameter(torch.zeros(s), requires_grad=False) for _, s in FROZEN)
    return CheckpointView(
        stage=stage, rank=0, world_size=world_size, device=torch.device("cpu"), compute_dtype=torch.float32,
        table=table, param_names=tuple(names), param_shapes=tuple(shapes), frozen_names=tuple(n for n, _ in FROZEN),
        frozen=frozen, frozen_partitioned=frozen_partitioned, aliases={"head.weight": "embed.weight"},
        module=torch.nn.Module(), mgr=None, optimizer=optimizer, loss_scaler=None, lr_scheduler=None,
        counters=Counters(global_steps=3, global_samples=18, micro_steps=3, skipped_steps=0), config={},
        reduce_bucket_size=bucket, gather_16bit_weights_on_model_save=False, set_counters=None)


def _manifest(view: CheckpointView) -> spec.Manifest:
    """What the engine would write for ``view``, through JSON and the spec's validation."""
    files = {spec.weights_file(r): {"rank": r, "role": "weights", "size": 1, "sha256": "0" * 64}
             for r in range(view.table.world_size)}
    manifest = build_manifest(view, "global_step3", files, None)
    return spec.Manifest.from_json(json.loads(manifest.dumps()))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_own_layout_is_the_fast_path(stage, world_size):
    view = _view(stage, world_size)
    assert same_layout(view, _manifest(view))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_another_world_size_stage_or_bucket_is_resharded(stage):
    manifest = _manifest(_view(stage, 2))
    assert not same_layout(_view(stage, 3), manifest)
    assert not same_layout(_view(3 if stage < 3 else 2, 2), manifest)
    if stage in (1, 2):  # the same units at another stage still count as a change of stage
        assert not same_layout(_view(1 if stage == 2 else 2, 2), manifest)
        assert not same_layout(_view(stage, 2, bucket=10), manifest)
    reordered = _view(stage, 2, names=NAMES[::-1], shapes=SHAPES[::-1], groups=GROUPS[::-1])
    assert not same_layout(reordered, manifest)


def test_manifest_records_the_layout_optimizer_and_state_keys():
    for stage in (1, 3):
        view = _view(stage, 2)
        manifest = _manifest(view)
        assert manifest.optimizer == "adamw" and manifest.state_keys == ("exp_avg", "exp_avg_sq")
        assert manifest.layout.align == ALIGN and manifest.layout.reduce_bucket_size == 40
        units = manifest.layout.units
        assert sorted(i for u in units for i in u) == list(range(len(NAMES)))  # trainable only (stage 3: no frozen)
        assert list(units) == [tuple(s.index for s in u.params) for u in view.table.units
                               if u.group < len(view.optimizer.masters)]
        assert [f.name for f in manifest.frozen] == ["frozen.weight"]


# -- matching a plan to the model -------------------------------------------------------------------------------
def _tensor(name, shape, kind="param", group=0, state=True) -> TensorPlan:
    n = int(torch.Size(shape).numel())
    frag = (Fragment("/nonexistent", 0, n, 0),)
    states = tuple(StatePlan(k, "float32", frag) for k in ("exp_avg", "exp_avg_sq")) if state else ()
    return TensorPlan(name, tuple(shape), "float32", frag, kind, group if kind == "param" else None, states)


def _plan(tensors, aliases=None, groups=2, hparams=None) -> CheckpointPlan:
    hparams = hparams or [{"lr": 1e-3}] * groups
    training = TrainingState("adamw", ("exp_avg", "exp_avg_sq"), tuple(
        OptimizerGroup(g, hparams[g]) for g in range(groups)))
    return CheckpointPlan("src", "deepspeed", 2, 2, "float32", "global_step3", 3, tuple(tensors), aliases or {},
                          training=training)


def _source(**renames) -> list[TensorPlan]:
    out = [_tensor(renames.get(n, n), s, group=g) for n, s, g in zip(NAMES, SHAPES, GROUPS)]
    return out + [_tensor(n, s, kind="frozen") for n, s in FROZEN]


def test_match_by_name_in_any_order_and_through_aliases():
    view = _view(2, 3)
    # the checkpoint stores the tied weight under the other name, and in another order
    plan = _plan(_source(**{"embed.weight": "head.weight"})[::-1], aliases={"embed.weight": "head.weight"})
    matched = _match(view, plan, load_optimizer_states=True)
    assert [t.name for t in matched.params] == ["head.weight"] + NAMES[1:]
    assert [t.name for t in matched.frozen] == ["frozen.weight"]
    assert matched.group_map == (0, 1)


def test_match_reports_missing_unexpected_and_shapes():
    view = _view(2, 3)
    with pytest.raises(CheckpointError, match=r"missing 1 \['norm.weight'\], unexpected 1 \['final_norm.weight'\]"):
        _match(view, _plan(_source(**{"norm.weight": "final_norm.weight"})), True)
    wrong = _source()
    wrong[1] = _tensor("blocks.0.up.weight", (6, 7))
    with pytest.raises(CheckpointError, match=r"blocks.0.up.weight has shape \[6, 7\]"):
        _match(view, _plan(wrong), True)


def test_match_groups_and_frozen_in_the_checkpoint():
    view = _view(2, 3)
    merged = _source()
    merged = [TensorPlan(t.name, t.shape, t.dtype, t.fragments, t.kind, 0 if t.kind == "param" else None, t.state)
              for t in merged]  # one source group, two here: both take it
    assert _match(view, _plan(merged, groups=1), True).group_map == (0, 0)
    split = [TensorPlan(t.name, t.shape, t.dtype, t.fragments, t.kind, i % 2 if t.kind == "param" else None, t.state)
             for i, t in enumerate(_source())]  # this run's groups mix source groups with other hyper-parameters
    with pytest.raises(CheckpointError, match="different hyper-parameters"):
        _match(view, _plan(split, hparams=[{"lr": 1e-3}, {"lr": 2e-3}]), True)
    frozen_there = _source()
    frozen_there[0] = _tensor("embed.weight", (13, 6), kind="frozen")
    with pytest.raises(CheckpointError, match="frozen in the checkpoint but trainable"):
        _match(view, _plan(frozen_there), True)
    assert _match(view, _plan(frozen_there), False).params[0].kind == "frozen"  # weights only: fine


def test_gaps_are_the_padding():
    from engine.reshard_load import _gaps

    assert list(_gaps([(0, 3), (5, 8)], 10)) == [(3, 5), (8, 10)]
    assert list(_gaps([(2, 4)], 4)) == [(0, 2)]
    assert list(_gaps([], 3)) == [(0, 3)]
    assert list(_gaps([(0, 3)], 3)) == []
