"""DeepSpeed's warmup learning-rate schedules, formula for formula.

Reproduces ``deepspeed/runtime/lr_schedules.py`` (WarmupLR, WarmupDecayLR, WarmupCosineLR) so a run
moved from DeepSpeed sees the identical lr sequence, and a DeepSpeed scheduler state
(``{"last_batch_iteration": n}``) resumes here. Protocol, as DeepSpeed's engine drives it::

    sched = build_scheduler(cfg.scheduler, optimizer)   # writes the step-0 lr into param_groups
    for batch in data:                                   # once per optimizer step (not per micro batch)
        ...; optimizer.step(); sched.step()              # step() writes the next lr into param_groups

``last_batch_iteration`` is the index of the last step taken (-1 = none). Warmup covers indices
``[0, warmup_num_steps)``; ``warmup_num_steps`` is raised to at least 2 (the log curve divides by
``log(warmup_num_steps)``). Per step the multiplier ``gamma`` is::

    log warmup:     log(i + 1) / log(warmup_num_steps)
    linear warmup:  i / warmup_num_steps
    after warmup:   WarmupLR 1.0
                    WarmupDecayLR max(0, (total - i) / max(1, total - warmup))
                    WarmupCosineLR cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(1, p))) / 2,
                                   p = (i - warmup + 1) / max(1, total - warmup)

WarmupLR/WarmupDecayLR set ``lr = min_lr + (max_lr - min_lr) * gamma``; WarmupCosineLR scales the
optimizer's lr at construction: during warmup by ``warmup_min_ratio + gamma * (1 - warmup_min_ratio)``.

Differences from DeepSpeed, all refusals of silently wrong input or additions: an unknown
``warmup_type`` raises (DeepSpeed logs and falls back to "log"); any object with ``param_groups``
works (the ZeRO optimizer need not subclass torch's); ``state_dict()`` also carries the class name;
``load_state_dict()`` writes the lr of the loaded step into the optimizer, so the lr is right even
before the optimizer's own state is restored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler", "SCHEDULERS", "HFSchedule", "HF_SCHEDULES"]

WARMUP_TYPES = ("log", "linear")


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """param_groups of a torch optimizer, of a wrapper exposing ``.optimizer`` (as DeepSpeed accepts), or of
    any object with a ``param_groups`` list."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        groups = getattr(candidate, "param_groups", None)
        if isinstance(groups, list) and groups and all(isinstance(g, dict) and "lr" in g for g in groups):
            return groups
    raise TypeError(f"{type(optimizer).__name__} has no param_groups with an 'lr'; pass a torch.optim.Optimizer")


def _per_group(groups: list[dict[str, Any]], value: float | Sequence[float], name: str) -> list[float]:
    """DeepSpeed's _format_param: one value broadcast to every group, or exactly one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(groups)


def _write_lrs(groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[Any]:
    """DeepSpeed's update_lr: tensor lrs (capturable optimizers) are filled in place."""
    for group, lr in zip(groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in groups]


def _check_common(warmup_num_steps: int, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={warmup_type!r} is not one of {WARMUP_TYPES} (DeepSpeed would silently use "
                         "'log')")


class _WarmupSchedule:
    """Shared stepping, lr writing and state of the three schedules; subclasses define ``get_lr``."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int) -> None:
        _check_common(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        self._groups = _param_groups(optimizer)
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None

    def _start(self) -> None:
        # As DeepSpeed: a fresh schedule writes its step "-1" lr into the optimizer at construction.
        if self.last_batch_iteration == -1:
            self._last_lr = _write_lrs(self._groups, self.get_lr())

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next step) and write its lr into the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self._groups, self.get_lr())

    def get_last_lr(self) -> list[Any]:
        """The lrs last written into the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """JSON-able; DeepSpeed's own ``{"last_batch_iteration": n}`` plus the class name."""
        return {"type": type(self).__name__, "last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accepts our state or DeepSpeed's; writes the loaded step's lr into the optimizer."""
        kind = state.get("type", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"scheduler state is for {kind}, not {type(self).__name__}")
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = _write_lrs(self._groups, self.get_lr())


class WarmupLR(_WarmupSchedule):
    """Warm the lr of each param group from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    steps, then hold it. ``warmup_max_lr=None`` takes each group's lr at construction (DeepSpeed 0.19)."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self._groups]
        self.min_lrs = _per_group(self._groups, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(self._groups, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay reaching 0 at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_WarmupSchedule):
    """Scale each group's lr (taken at construction) by a ratio warming from ``warmup_min_ratio`` to 1, then
    decaying along a cosine to ``cos_min_ratio`` at ``total_num_steps`` and staying there."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self._groups]
        self._start()

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_gamma() * (1. - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


SCHEDULERS: dict[str, type[_WarmupSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(sched_cfg: Any, optimizer: Any) -> WarmupLR | WarmupDecayLR | WarmupCosineLR | None:
    """Scheduler for ``engine.config.SchedulerConfig`` (or a DeepSpeed-style ``{"type", "params"}`` dict);
    None for None. Writes the step-0 lr into ``optimizer`` as DeepSpeed does."""
    if sched_cfg is None:
        return None
    if isinstance(sched_cfg, Mapping):
        kind, params = sched_cfg["type"], dict(sched_cfg.get("params", {}))
    else:
        kind, params = sched_cfg.type, dataclasses.asdict(sched_cfg.params)
    if kind not in SCHEDULERS:
        raise ValueError(f"scheduler type {kind!r} is not one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[kind](optimizer, **params)


# ---- HF Trainer's schedules (transformers.optimization.get_scheduler), formula for formula -------------------------
#
# What HF Trainer builds from ``lr_scheduler_type`` when the DeepSpeed config has no "scheduler" section: a torch
# ``LambdaLR`` whose multiplier of step ``s`` (``last_epoch``) is below, ``w`` = warmup steps, ``T`` = total steps,
# ``warm(s) = s / max(1, w)`` for ``s < w``. ``lr = base_lr * multiplier(s)``; construction takes step 0.

def _warm(s: int, w: int) -> float:
    return float(s) / float(max(1, w))


def _progress(s: int, w: int, total: int) -> float:
    return float(s - w) / float(max(1, total - w))


def _constant(s: int, **_: Any) -> float:
    return 1


def _constant_with_warmup(s: int, *, w: int, **_: Any) -> float:
    return float(s) / float(max(1.0, w)) if s < w else 1.0


def _linear(s: int, *, w: int, total: int, **_: Any) -> float:
    if s < w:
        return _warm(s, w)
    return max(0.0, float(total - s) / float(max(1, total - w)))


def _cosine(s: int, *, w: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0, **_: Any) -> float:
    if s < w:
        return _warm(s, w)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * _progress(s, w, total)))
    if min_lr_rate:
        return max(0, factor * (1 - min_lr_rate) + min_lr_rate)
    return max(0.0, factor)


def _cosine_with_restarts(s: int, *, w: int, total: int, num_cycles: int = 1, **_: Any) -> float:
    if s < w:
        return _warm(s, w)
    progress = _progress(s, w, total)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(s: int, *, w: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0,
                **_: Any) -> float:
    if s < w:
        return _warm(s, w)
    if s > total:
        return lr_end / lr_init
    pct_remaining = 1 - (s - w) / (total - w)
    return ((lr_init - lr_end) * pct_remaining ** power + lr_end) / lr_init


def _inverse_sqrt(s: int, *, w: int, timescale: int | None = None, **_: Any) -> float:
    if s < w:
        return _warm(s, w)
    timescale = timescale or w or 10_000  # HF: None -> num_warmup_steps or 10_000
    return 1.0 / math.sqrt((s + timescale - w) / timescale)


def _cosine_warmup_with_min_lr(s: int, *, w: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0,
                               warmup_lr_rate: float | None = None, **_: Any) -> float:
    s_f, w_f, t_f = float(s), float(w), float(total)
    if s_f < w_f:
        if warmup_lr_rate is None:
            return (s_f + 1.0) / max(1.0, w_f)
        return float(warmup_lr_rate) + (1.0 - float(warmup_lr_rate)) * s_f / (max(1, w_f - 1))
    progress = (s_f - w_f + 1.0) / (max(1.0, t_f - w_f))
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


# name -> (multiplier, needs warmup steps, needs total steps, accepted lr_scheduler_kwargs)
HF_SCHEDULES: dict[str, tuple[Any, bool, bool, tuple[str, ...]]] = {
    "constant": (_constant, False, False, ()),
    "constant_with_warmup": (_constant_with_warmup, True, False, ()),
    "linear": (_linear, True, True, ()),
    "cosine": (_cosine, True, True, ("num_cycles",)),
    "cosine_with_restarts": (_cosine_with_restarts, True, True, ("num_cycles",)),
    "polynomial": (_polynomial, True, True, ("lr_end", "power")),
    "inverse_sqrt": (_inverse_sqrt, True, False, ("timescale",)),
    "cosine_with_min_lr": (_cosine, True, True, ("num_cycles", "min_lr", "min_lr_rate")),
    "cosine_warmup_with_min_lr": (_cosine_warmup_with_min_lr, True, True,
                                  ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate")),
}


class HFSchedule:
    """HF Trainer's ``get_scheduler(name, ...)`` LambdaLR: ``lr = base_lr * multiplier(last_epoch)`` per group.

    Stepped once per optimizer step like DeepSpeed's schedules (the engine skips it on an fp16 overflow, as
    Trainer skips it when DeepSpeed reports a skipped step). ``state_dict()`` is JSON: the name, ``last_epoch`` and
    ``base_lrs``; ``load_state_dict`` also takes a torch ``LambdaLR`` state (``last_epoch``, ``base_lrs``), and, as
    LambdaLR, restores the position and base lrs but keeps the multiplier of the current arguments.
    """

    def __init__(self, optimizer: Any, name: str, *, num_warmup_steps: int = 0, num_training_steps: int | None = None,
                 lr_init: float | None = None, **kwargs: Any) -> None:
        if name not in HF_SCHEDULES:
            raise ValueError(f"lr_scheduler_type={name!r} is not supported by the engine; use one of "
                             f"{sorted(HF_SCHEDULES)} or a DeepSpeed \"scheduler\" section")
        fn, _, needs_total, allowed = HF_SCHEDULES[name]
        stray = sorted(set(kwargs) - set(allowed))
        if stray:
            raise ValueError(f"lr_scheduler_kwargs {stray} are not taken by lr_scheduler_type={name!r} "
                             f"(it takes {list(allowed) or 'none'})")
        if needs_total and num_training_steps is None:
            raise ValueError(f"lr_scheduler_type={name!r} needs the total step count")
        self.optimizer, self.name = optimizer, name
        self._groups = _param_groups(optimizer)
        self.base_lrs = [g["lr"] for g in self._groups]
        self.params = {"w": int(num_warmup_steps), "total": num_training_steps,
                       **_hf_kwargs(name, kwargs, self.base_lrs[0] if lr_init is None else lr_init)}
        self._fn = fn
        self.last_epoch = -1
        self.step()  # LambdaLR's construction step: writes the step-0 lr

    def multiplier(self, step: int) -> float:
        return self._fn(step, **self.params)

    def get_lr(self) -> list[float]:
        factor = self.multiplier(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_epoch = self.last_epoch + 1 if last_batch_iteration is None else int(last_batch_iteration)
        self._last_lr = _write_lrs(self._groups, self.get_lr())

    def get_last_lr(self) -> list[Any]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "name": self.name, "last_epoch": int(self.last_epoch),
                "base_lrs": [float(lr) for lr in self.base_lrs]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        kind = state.get("type", type(self).__name__ if "last_epoch" in state else None)
        if kind != type(self).__name__:
            raise ValueError(f"scheduler state is for {kind or 'a DeepSpeed schedule'}, not an HF Trainer schedule "
                             f"({self.name!r}); load with load_lr_scheduler_states=False or use the same scheduler")
        self.last_epoch = int(state["last_epoch"])
        if state.get("base_lrs") is not None:
            self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        self._last_lr = _write_lrs(self._groups, self.get_lr())


def _hf_kwargs(name: str, kwargs: dict[str, Any], lr_init: float) -> dict[str, Any]:
    """get_scheduler's scheduler-specific arguments, with its checks (min_lr -> min_lr_rate; polynomial's lr_end)."""
    out = dict(kwargs)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        min_lr, rate = out.pop("min_lr", None), out.pop("min_lr_rate", None)
        if min_lr is not None and rate is not None:
            raise ValueError("lr_scheduler_kwargs: only one of min_lr or min_lr_rate may be set")
        if min_lr is None and rate is None:
            raise ValueError(f"lr_scheduler_type={name!r} needs min_lr or min_lr_rate in lr_scheduler_kwargs")
        out["min_lr_rate"] = min_lr / lr_init if min_lr is not None else rate
    if name == "polynomial":
        out["lr_init"] = lr_init
        if not lr_init > out.get("lr_end", 1e-7):
            raise ValueError(f"lr_scheduler_kwargs lr_end ({out.get('lr_end', 1e-7)}) must be smaller than the "
                             f"initial lr ({lr_init})")
    return out
