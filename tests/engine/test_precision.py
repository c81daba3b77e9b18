"""Loss scaling: step-for-step equality with DeepSpeed's DynamicLossScaler, JSON state, overflow detection."""

import json
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import FP16Config
from engine.precision import (DynamicLossScaler, LossScaleUnderflowError, StaticLossScaler, has_inf_or_nan,
                              make_loss_scaler, state_from_deepspeed)


@pytest.fixture(scope="module")
def ds_loss_scaler():
    """DeepSpeed's loss_scaler module, its rank-0 logging made to work without a process group."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16 import loss_scaler

    saved = loss_scaler.dist
    loss_scaler.dist = types.SimpleNamespace(get_rank=lambda: 0)
    yield loss_scaler
    loss_scaler.dist = saved


def _state(ds):
    return (float(ds.cur_scale), ds.cur_iter, ds.last_overflow_iter, ds.cur_hysteresis)


def _ours(s):
    return (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.cur_hysteresis)


scaler_settings = st.fixed_dictionaries({
    "power": st.integers(0, 24),
    "scale_window": st.integers(1, 6),
    "hysteresis": st.integers(1, 4),
    "consecutive_hysteresis": st.booleans(),
    "min_scale": st.sampled_from([1, 0.25, 2.0, 16]),
})


@settings(max_examples=150, deadline=None, database=None)
@given(cfg=scaler_settings, overflows=st.lists(st.booleans(), max_size=120))
def test_dynamic_matches_deepspeed_step_by_step(ds_loss_scaler, cfg, overflows):
    ds = ds_loss_scaler.DynamicLossScaler(init_scale=2 ** cfg["power"], scale_window=cfg["scale_window"],
                                          min_scale=cfg["min_scale"], delayed_shift=cfg["hysteresis"],
                                          consecutive_hysteresis=cfg["consecutive_hysteresis"])
    ours = DynamicLossScaler(init_scale=2.0 ** cfg["power"], scale_window=cfg["scale_window"],
                             hysteresis=cfg["hysteresis"], consecutive_hysteresis=cfg["consecutive_hysteresis"],
                             min_scale=cfg["min_scale"])
    for step, overflow in enumerate(overflows):
        try:
            ds.update_scale(overflow)
        except Exception as exc:  # DeepSpeed raises a bare Exception at the minimum scale
            assert "minimum" in str(exc)
            with pytest.raises(LossScaleUnderflowError):
                ours.update_scale(overflow)
            return
        ours.update_scale(overflow)
        assert _ours(ours) == _state(ds), f"diverged at step {step}"
        assert ours.loss_scale == ds.loss_scale


@settings(max_examples=60, deadline=None, database=None)
@given(cfg=scaler_settings, before=st.lists(st.booleans(), max_size=40), after=st.lists(st.booleans(), max_size=40))
def test_state_dict_roundtrip_through_json_resumes_identically(cfg, before, after):
    def fresh():
        return DynamicLossScaler(init_scale=2.0 ** (cfg["power"] + 30), scale_window=cfg["scale_window"],
                                 hysteresis=cfg["hysteresis"], consecutive_hysteresis=cfg["consecutive_hysteresis"],
                                 min_scale=cfg["min_scale"])
    straight = fresh()
    try:
        for overflow in before:
            straight.update_scale(overflow)
    except LossScaleUnderflowError:  # 30+ overflows can reach min_scale: nothing left to resume
        return
    resumed = DynamicLossScaler()  # different settings: the state carries them
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for overflow in after:
        try:
            straight.update_scale(overflow)
        except LossScaleUnderflowError:  # the resumed scaler must underflow at the same step
            with pytest.raises(LossScaleUnderflowError):
                resumed.update_scale(overflow)
            return
        resumed.update_scale(overflow)
        assert resumed.state_dict() == straight.state_dict()


def test_hysteresis_delays_the_first_reduction():
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=1000, hysteresis=2)
    scaler.update_scale(True)
    assert (scaler.loss_scale, scaler.cur_hysteresis) == (1024.0, 1)
    scaler.update_scale(True)
    assert scaler.loss_scale == 512.0
    for _ in range(1000):
        scaler.update_scale(False)
    assert scaler.loss_scale == 512.0  # DeepSpeed counts the window from the step after the overflow's successor
    scaler.update_scale(False)
    assert scaler.loss_scale == 1024.0 and scaler.cur_hysteresis == 2


def test_overflow_at_min_scale_raises_unless_told_not_to():
    strict = DynamicLossScaler(init_scale=2.0, hysteresis=1, min_scale=1.0)
    strict.update_scale(True)
    assert strict.loss_scale == 1.0
    with pytest.raises(LossScaleUnderflowError, match="minimum loss scale"):
        strict.update_scale(True)
    lenient = DynamicLossScaler(init_scale=2.0, hysteresis=1, min_scale=1.0, raise_error_at_min_scale=False)
    lenient.update_scale(True)
    lenient.update_scale(True)
    assert lenient.loss_scale == 1.0


def test_static_scaler_never_changes_and_roundtrips():
    scaler = StaticLossScaler(128.0)
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.loss_scale == 128.0
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    other = StaticLossScaler()
    other.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert other.loss_scale == 128.0
    with pytest.raises(ValueError, match="expected 'dynamic'"):
        DynamicLossScaler().load_state_dict(scaler.state_dict())


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_has_inf_or_nan(dtype):
    finite = torch.tensor([1.0, -2.0, 3.5], dtype=dtype)
    assert has_inf_or_nan(finite) is False
    for bad in (float("inf"), float("-inf"), float("nan")):
        tensor = finite.clone()
        tensor[1] = bad
        assert has_inf_or_nan(tensor) is True
    assert has_inf_or_nan(torch.empty(0, dtype=dtype)) is False


def test_has_inf_or_nan_other_layouts():
    assert has_inf_or_nan(torch.tensor([1, 2, 3])) is False
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, float("nan")], (4,), check_invariants=True)
    assert has_inf_or_nan(sparse) is True
    assert has_inf_or_nan(torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True)) is False
    assert has_inf_or_nan(torch.tensor([1 + 1j, complex("inf")])) is True
    assert has_inf_or_nan(torch.full((3, 3), 65504.0, dtype=torch.float16)) is False


def test_has_inf_or_nan_agrees_with_deepspeed():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.utils import has_inf_or_nan as ds_has_inf_or_nan

    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        tensor = torch.randn(17, generator=gen)
        if trial % 3 == 0:
            tensor[trial % 17] = [float("inf"), float("-inf"), float("nan")][trial % 3 and trial % 2]
        assert has_inf_or_nan(tensor) == bool(ds_has_inf_or_nan(tensor))


def test_make_loss_scaler_mirrors_deepspeed_choice():
    assert make_loss_scaler(None).loss_scale == 1.0
    assert make_loss_scaler(FP16Config(enabled=False, loss_scale=0)).dynamic is False
    static = make_loss_scaler({"enabled": True, "loss_scale": 512})
    assert static.dynamic is False and static.loss_scale == 512.0
    dynamic = make_loss_scaler(FP16Config(enabled=True, initial_scale_power=12, loss_scale_window=50,
                                          hysteresis=3, consecutive_hysteresis=True, min_loss_scale=4))
    assert dynamic.dynamic is True
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.delayed_shift, dynamic.consecutive_hysteresis,
            dynamic.min_scale) == (4096.0, 50, 3, True, 4.0)


def test_make_loss_scaler_matches_deepspeed_create_loss_scaler(ds_loss_scaler):
    fp16 = FP16Config(enabled=True, initial_scale_power=10, loss_scale_window=7, hysteresis=3, min_loss_scale=2)
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    ds_cfg = DeepSpeedFP16Config(enabled=True, initial_scale_power=10, loss_scale_window=7, hysteresis=3,
                                 min_loss_scale=2)
    ds = ds_loss_scaler.CreateLossScaler(torch.half, 0, True, ds_cfg.dynamic_loss_scale_args())
    ours = make_loss_scaler(fp16)
    pattern = [True, False, True, True] + [False] * 20 + [True] * 4
    for overflow in pattern:
        ds.update_scale(overflow)
        ours.update_scale(overflow)
        assert _ours(ours) == _state(ds)
    assert state_from_deepspeed(ds) == ours.state_dict()
    assert state_from_deepspeed(ds_loss_scaler.LossScaler(scale=8)) == StaticLossScaler(8).state_dict()
