"""Loss scaling for fp16 training, step for step as DeepSpeed's ``runtime/fp16/loss_scaler.py``.

Protocol per optimizer step (the engine drives it)::

    (loss * scaler.loss_scale).backward()        # scaled so small fp16 gradients do not flush to zero
    overflow = any(has_inf_or_nan(g) for g in grads)   # all-reduced (MAX) across ranks by the engine
    if not overflow: unscale grads by 1/loss_scale, clip, optimizer step
    scaler.update_scale(overflow)                # overflow steps are skipped, never applied

Dynamic scaling (DeepSpeed's ``DynamicLossScaler``): on overflow, the hysteresis budget
(``hysteresis``, DeepSpeed's ``delayed_shift``) is spent first; once it is down to 1, the scale is
divided by ``scale_factor`` (not below ``min_scale``; at ``min_scale`` already, an overflow raises
``LossScaleUnderflowError`` when ``raise_error_at_min_scale``). After ``scale_window`` overflow-free steps
since the last overflow the scale is multiplied by ``scale_factor`` and the budget refilled;
``consecutive_hysteresis`` refills it on every overflow-free step instead.

State dicts are plain JSON-able dicts; DeepSpeed pickles the scaler object itself, and
``state_from_deepspeed`` turns such an object (or its ``__dict__``) into our state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from engine.config import FP16Config

logger = logging.getLogger("engine.precision")

__all__ = ["DynamicLossScaler", "StaticLossScaler", "LossScaleUnderflowError", "has_inf_or_nan",
           "make_loss_scaler", "state_from_deepspeed"]


class LossScaleUnderflowError(RuntimeError):
    """An overflow happened with the dynamic loss scale already at its minimum."""


def has_inf_or_nan(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds any inf or NaN.

    Reduces to two scalars (``amax`` propagates NaN and exposes +inf, ``amin`` exposes -inf) instead of an
    elementwise mask, as DeepSpeed does, so no tensor-sized temporary is allocated. Empty tensors and
    integer/bool tensors hold no non-finite value; for sparse tensors only the stored values count.
    """
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    if tensor.is_complex():
        return not bool(torch.isfinite(tensor).all())
    return not bool(torch.isfinite(tensor.amax()) & torch.isfinite(tensor.amin()))


class _ScalerBase:
    """What both scalers share: the current scale (``cur_scale``, DeepSpeed's name) and applying it."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale


class StaticLossScaler(_ScalerBase):
    """A fixed loss scale (DeepSpeed's ``LossScaler``); also the 1.0 no-op scaler of fp32/bf16 training."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"static loss scale must be > 0, got {scale!r}")
        self.cur_scale = float(scale)

    def update_scale(self, overflow: bool) -> None:
        """The scale never changes; an overflow step is only reported (the engine skips it)."""
        if overflow:
            logger.warning("OVERFLOW! Skipping step: gradients are non-finite at static loss scale %s", self.cur_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "cur_scale": self.cur_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _expect_type(state, "static")
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(_ScalerBase):
    """DeepSpeed's ``DynamicLossScaler``; see the module docstring for the rule.

    Arguments map to the fp16 config: ``init_scale=2**initial_scale_power``, ``scale_window=loss_scale_window``,
    ``hysteresis``, ``consecutive_hysteresis``, ``min_scale=min_loss_scale``.
    """

    dynamic = True

    def __init__(self, *, init_scale: float = 2.0 ** 16, scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, scale_factor: float = 2.0,
                 raise_error_at_min_scale: bool = True) -> None:
        self._configure(scale_window=scale_window, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
                        min_scale=min_scale, scale_factor=scale_factor,
                        raise_error_at_min_scale=raise_error_at_min_scale)
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def _configure(self, *, scale_window: int, hysteresis: int, consecutive_hysteresis: bool, min_scale: float,
                   scale_factor: float, raise_error_at_min_scale: bool) -> None:
        if not (min_scale > 0 and scale_factor > 1 and scale_window >= 1 and hysteresis >= 1):
            raise ValueError(f"need min_scale > 0, scale_factor > 1, scale_window >= 1, hysteresis >= 1; got "
                             f"{min_scale!r}, {scale_factor!r}, {scale_window!r}, {hysteresis!r}")
        self.scale_window = int(scale_window)
        self.delayed_shift = int(hysteresis)  # DeepSpeed's name for the hysteresis budget
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)

    def update_scale(self, overflow: bool) -> None:
        """Account for one optimizer step; ``overflow``: its gradients held inf/NaN (and it was skipped)."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"gradients overflowed at the minimum loss scale {self.cur_scale}; the loss or data has "
                        "inf/NaN, or fp16.min_loss_scale is too high (try bf16)")
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s", self.cur_scale,
                            next_scale)
                self.cur_scale = next_scale
            else:
                logger.info("OVERFLOW! Skipping step. Attempted loss scale: %s, but hysteresis is %s; reducing "
                            "hysteresis to %s", self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything, settings included: like DeepSpeed's pickled scaler, a resume restores both."""
        return {"type": "dynamic", "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis,
                "scale_factor": self.scale_factor, "scale_window": self.scale_window, "min_scale": self.min_scale,
                "hysteresis": self.delayed_shift, "consecutive_hysteresis": self.consecutive_hysteresis,
                "raise_error_at_min_scale": self.raise_error_at_min_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _expect_type(state, "dynamic")
        self._configure(scale_window=state["scale_window"], hysteresis=state["hysteresis"],
                        consecutive_hysteresis=state["consecutive_hysteresis"], min_scale=state["min_scale"],
                        scale_factor=state["scale_factor"],
                        raise_error_at_min_scale=state.get("raise_error_at_min_scale", True))
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


def _expect_type(state: Mapping[str, Any], kind: str) -> None:
    if state.get("type") != kind:
        raise ValueError(f"loss-scaler state is of type {state.get('type')!r}, expected {kind!r}")


def state_from_deepspeed(scaler: Any) -> dict[str, Any]:
    """Our state dict from a DeepSpeed ``LossScaler``/``DynamicLossScaler`` (object or its ``__dict__``), as found
    under ``optimizer_state_dict["loss_scaler"]`` in DeepSpeed ZeRO checkpoints (the format module's converter,
    which zckpt's DeepSpeed reader uses too)."""
    from engine.checkpoint_format import loss_scaler_from_deepspeed

    return loss_scaler_from_deepspeed(dict(scaler) if isinstance(scaler, Mapping) else scaler)


def make_loss_scaler(fp16_cfg: Any) -> DynamicLossScaler | StaticLossScaler:
    """The scaler DeepSpeed's ``CreateLossScaler`` would build for an fp16 section.

    ``fp16_cfg``: ``engine.config.FP16Config``, a DeepSpeed-style ``fp16`` dict, or None. fp16 off (fp32/bf16
    training) -> ``StaticLossScaler(1.0)``; ``loss_scale`` 0 -> dynamic; else static at ``loss_scale``.
    """
    if fp16_cfg is None:
        return StaticLossScaler(1.0)
    cfg = FP16Config(**fp16_cfg) if isinstance(fp16_cfg, Mapping) else fp16_cfg
    if not cfg.enabled:
        return StaticLossScaler(1.0)
    if cfg.loss_scale != 0:
        return StaticLossScaler(cfg.loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** cfg.initial_scale_power, scale_window=cfg.loss_scale_window,
                             hysteresis=cfg.hysteresis, consecutive_hysteresis=cfg.consecutive_hysteresis,
                             min_scale=cfg.min_loss_scale)
