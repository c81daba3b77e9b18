"""Warmup schedules: identical lr sequences to DeepSpeed's lr_schedules, JSON state, build_scheduler."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import load_config
from engine.scheduler import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def _optimizer(lrs=(0.1, 0.02)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _lrs(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


@pytest.fixture(scope="module")
def ds_schedules():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import lr_schedules

    return lr_schedules


CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=50, warmup_type="log")),
    ("WarmupLR", dict(warmup_min_lr=[1e-5, 2e-5], warmup_max_lr=[1e-3, 5e-4], warmup_num_steps=37,
                      warmup_type="linear")),
    ("WarmupLR", dict(warmup_num_steps=1)),  # max lr from the optimizer; warmup raised to 2 steps
    ("WarmupDecayLR", dict(total_num_steps=200, warmup_min_lr=1e-6, warmup_max_lr=3e-4, warmup_num_steps=40)),
    ("WarmupDecayLR", dict(total_num_steps=120, warmup_max_lr=3e-4, warmup_num_steps=30, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=10, warmup_num_steps=25)),  # total < warmup
    ("WarmupCosineLR", dict(total_num_steps=150, warmup_min_ratio=0.1, warmup_num_steps=20, cos_min_ratio=0.05)),
    ("WarmupCosineLR", dict(total_num_steps=90, warmup_num_steps=15, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=5, warmup_num_steps=8)),  # total < warmup
]
OURS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


@pytest.mark.parametrize("name,params", CASES)
def test_lr_sequence_equals_deepspeed(ds_schedules, name, params):
    ds_opt, our_opt = _optimizer(), _optimizer()
    ds = getattr(ds_schedules, name)(ds_opt, **params)
    ours = OURS[name](our_opt, **params)
    assert _lrs(our_opt) == _lrs(ds_opt)  # the lr written at construction
    total = params.get("total_num_steps", params.get("warmup_num_steps", 10)) + 60
    for step in range(total):
        ds.step()
        ours.step()
        assert _lrs(our_opt) == _lrs(ds_opt), f"{name} diverged at step {step}"
        assert ours.get_last_lr() == ds.get_last_lr()


@settings(max_examples=40, deadline=None, database=None)
@given(name=st.sampled_from(sorted(OURS)), warmup=st.integers(1, 60), extra=st.integers(0, 80),
       warmup_type=st.sampled_from(["log", "linear"]), min_lr=st.floats(0, 1e-3), max_lr=st.floats(1e-4, 1.0),
       ratio=st.floats(0, 0.5), steps=st.integers(0, 150))
def test_random_schedules_equal_deepspeed(ds_schedules, name, warmup, extra, warmup_type, min_lr, max_lr, ratio,
                                          steps):
    params = dict(warmup_num_steps=warmup, warmup_type=warmup_type)
    if name != "WarmupLR":
        params["total_num_steps"] = warmup + extra
    if name == "WarmupCosineLR":
        params.update(warmup_min_ratio=ratio, cos_min_ratio=ratio / 3)
    else:
        params.update(warmup_min_lr=min_lr, warmup_max_lr=max_lr)
    ds_opt, our_opt = _optimizer(), _optimizer()
    ds, ours = getattr(ds_schedules, name)(ds_opt, **params), OURS[name](our_opt, **params)
    for _ in range(steps):
        ds.step()
        ours.step()
    assert _lrs(our_opt) == _lrs(ds_opt)
    assert ours.state_dict()["last_batch_iteration"] == ds.state_dict()["last_batch_iteration"]


@pytest.mark.parametrize("name,params", [CASES[0], CASES[3], CASES[6]])
def test_resume_from_json_state_continues_the_sequence(name, params):
    straight_opt, resumed_opt = _optimizer(), _optimizer()
    straight = OURS[name](straight_opt, **params)
    for _ in range(33):
        straight.step()
    state = json.loads(json.dumps(straight.state_dict()))
    assert state == {"type": name, "last_batch_iteration": 32}
    resumed = OURS[name](resumed_opt, **params)
    resumed.load_state_dict(state)
    assert _lrs(resumed_opt) == _lrs(straight_opt)  # written on load, before any step
    for _ in range(40):
        straight.step()
        resumed.step()
        assert _lrs(resumed_opt) == _lrs(straight_opt)


def test_loads_deepspeed_state_dict(ds_schedules):
    ds_opt, our_opt = _optimizer(), _optimizer()
    params = dict(total_num_steps=100, warmup_max_lr=1e-3, warmup_num_steps=10)
    ds = ds_schedules.WarmupDecayLR(ds_opt, **params)
    for _ in range(42):
        ds.step()
    ours = WarmupDecayLR(our_opt, **params)
    ours.load_state_dict(ds.state_dict())
    ds.step()
    ours.step()
    assert _lrs(our_opt) == _lrs(ds_opt)
    with pytest.raises(ValueError, match="for WarmupLR"):
        ours.load_state_dict({"type": "WarmupLR", "last_batch_iteration": 3})


def test_tensor_lrs_are_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    for _ in range(3):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.5 * 2 / 4)


def test_refuses_what_deepspeed_would_silently_change():
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_optimizer(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupCosineLR(_optimizer(), total_num_steps=10, warmup_num_steps=0)
    with pytest.raises(ValueError, match="expected 2 values"):
        WarmupLR(_optimizer(), warmup_min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())
    fresh = WarmupLR(_optimizer(), last_batch_iteration=5)
    with pytest.raises(RuntimeError, match="step"):
        fresh.get_last_lr()


def test_build_scheduler_from_config_and_from_dict():
    cfg = load_config({"train_batch_size": 4, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 50, "warmup_max_lr": 2e-3, "warmup_num_steps": 5, "warmup_type": "linear"}}})
    opt_a, opt_b, opt_c = _optimizer(), _optimizer(), _optimizer()
    from_cfg = build_scheduler(cfg.scheduler, opt_a)
    from_dict = build_scheduler(cfg.to_dict()["scheduler"], opt_b)
    direct = WarmupDecayLR(opt_c, total_num_steps=50, warmup_max_lr=2e-3, warmup_num_steps=5, warmup_type="linear")
    assert isinstance(from_cfg, WarmupDecayLR) and isinstance(from_dict, WarmupDecayLR)
    for _ in range(60):
        for sched in (from_cfg, from_dict, direct):
            sched.step()
        assert _lrs(opt_a) == _lrs(opt_b) == _lrs(opt_c)
    assert build_scheduler(None, _optimizer()) is None
    with pytest.raises(ValueError, match="OneCycle"):
        build_scheduler({"type": "OneCycle", "params": {}}, _optimizer())
