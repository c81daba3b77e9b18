"""What HF Trainer builds when the DeepSpeed config has no ``optimizer`` (or no ``scheduler``) section.

transformers' DeepSpeed integration (``integrations/deepspeed.py``, ``deepspeed_optim_sched``) hands DeepSpeed:

* no "optimizer" section: ``Trainer.create_optimizer()`` -- ``torch.optim.AdamW`` (``optim="adamw_torch"`` /
  ``"adamw_torch_fused"``) with ``lr=learning_rate``, ``betas=(adam_beta1, adam_beta2)``, ``eps=adam_epsilon`` and
  two parameter groups: ``weight_decay=args.weight_decay`` for the names ``Trainer.get_decay_parameter_names``
  returns, ``0.0`` for the other trainable parameters (biases and norm weights);
* no "scheduler" section: ``Trainer.create_scheduler()`` -- ``get_scheduler(lr_scheduler_type,
  num_warmup_steps=args.get_warmup_steps(T), num_training_steps=T, **lr_scheduler_kwargs)`` on that optimizer,
  stepped once per optimizer step (:class:`engine.scheduler.HFSchedule`).

The engine builds the same from ``training_args`` without importing transformers. The no-decay rule is transformers
5's (``trainer.py`` ``get_decay_parameter_names`` + ``trainer_pt_utils.get_parameter_names``): a parameter decays
unless an *enclosing* module (not the root) is an ``nn.LayerNorm``, or its lower-cased name matches one of
:data:`NO_DECAY_PATTERNS`. ``tests/engine/test_hf_optim.py`` compares both with a real Trainer.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from engine.config import ConfigError
from engine.scheduler import HF_SCHEDULES, HFSchedule

logger = logging.getLogger("engine.config")

__all__ = ["NO_DECAY_PATTERNS", "decay_parameter_names", "trainer_param_groups", "trainer_optimizer",
           "trainer_scheduler", "ADAMW_OPTIMS"]

NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""transformers 5's ``forbidden_name_patterns``, searched in the lower-cased parameter name."""

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_torch_npu_fused", "adamw_torch_xla")
"""``TrainingArguments.optim`` values that are plain AdamW (decoupled weight decay, bias correction, no amsgrad)."""

# TrainingArguments' defaults, for dicts / namespaces that leave a field out (transformers 5.24)
_DEFAULTS = {"learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
             "weight_decay": 0.0, "optim": "adamw_torch", "lr_scheduler_kwargs": None}


def decay_parameter_names(model: nn.Module) -> list[str]:
    """``Trainer.get_decay_parameter_names(model)``: names (as found by walking children, tied aliases included) of
    the parameters that take weight decay."""
    patterns = [re.compile(p) for p in NO_DECAY_PATTERNS]
    return _parameter_names(model, (nn.LayerNorm,), patterns)


def _parameter_names(module: nn.Module, forbidden_types: tuple, patterns: list) -> list[str]:
    """``trainer_pt_utils.get_parameter_names``, step for step: the check runs at every level on the name relative
    to that level, so a pattern anchored with ``^`` also matches after any dot of the full name."""
    result = []
    for name, child in module.named_children():
        result += [f"{name}.{n}" for n in _parameter_names(child, forbidden_types, patterns)
                   if not isinstance(child, forbidden_types)
                   and not any(p.search(f"{name}.{n}".lower()) for p in patterns)]
    result += [k for k in module._parameters if not any(p.search(k.lower()) for p in patterns)]
    return result


def trainer_param_groups(model: nn.Module, weight_decay: float, model_parameters=None) -> list[dict]:
    """``Trainer.create_optimizer``'s two groups ``[{params, weight_decay}, {params, weight_decay: 0.0}]`` in
    ``model.named_parameters()`` order, trainable parameters only; ``model_parameters`` (a flat iterable) restricts
    them to those given."""
    decay = set(decay_parameter_names(model))
    allowed = None if model_parameters is None else {id(p) for p in model_parameters}
    groups = ([], [])
    for name, p in model.named_parameters():
        if p.requires_grad and (allowed is None or id(p) in allowed):
            groups[0 if name in decay else 1].append(p)
    return [{"params": groups[0], "weight_decay": weight_decay}, {"params": groups[1], "weight_decay": 0.0}]


def args_has(args: Any, name: str) -> bool:
    return name in args if isinstance(args, Mapping) else hasattr(args, name)


def _arg(args: Any, name: str) -> Any:
    """A training argument; a field the dict / namespace leaves out takes TrainingArguments' default (logged)."""
    if not args_has(args, name):
        logger.info("training_args.%s = %r (absent -> TrainingArguments' default)", name, _DEFAULTS[name])
        return _DEFAULTS[name]
    value = args[name] if isinstance(args, Mapping) else getattr(args, name)
    return getattr(value, "value", value)  # transformers' str enums (OptimizerNames, SchedulerType)


def trainer_optimizer(model: nn.Module, model_parameters, training_args: Any) -> tuple[list[dict], dict]:
    """``(parameter groups, optimizer section)`` for the AdamW that Trainer would create from ``training_args``.

    ``model_parameters``: None (all trainable parameters, as Trainer), a flat iterable of parameters (split into the
    decay / no-decay groups), or group dicts (kept; a group without ``weight_decay`` takes the training argument).
    """
    optim = str(_arg(training_args, "optim"))
    if optim not in ADAMW_OPTIMS:
        raise ConfigError(f"training_args.optim={optim!r} is not AdamW and the config has no \"optimizer\" section; "
                          f"the engine runs AdamW only: set optim to one of {list(ADAMW_OPTIMS)} or pass optimizer=")
    hp = {"lr": float(_arg(training_args, "learning_rate")),
          "betas": (float(_arg(training_args, "adam_beta1")), float(_arg(training_args, "adam_beta2"))),
          "eps": float(_arg(training_args, "adam_epsilon")),
          "weight_decay": float(_arg(training_args, "weight_decay"))}
    items = None if model_parameters is None else list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = trainer_param_groups(model, hp["weight_decay"], items)
    logger.info("optimizer = AdamW(lr=%r, betas=%r, eps=%r), weight_decay %r on %d tensors and 0.0 on %d (no "
                "\"optimizer\" section -> HF Trainer's create_optimizer from training_args)", hp["lr"], hp["betas"],
                hp["eps"], hp["weight_decay"], len(groups[0]["params"]), sum(len(g["params"]) for g in groups[1:]))
    return groups, {"type": "AdamW", **hp}


def _scheduler_kwargs(training_args: Any) -> dict:
    raw = _arg(training_args, "lr_scheduler_kwargs")
    if isinstance(raw, str):
        raw = json.loads(raw) if raw.strip() else None
    return dict(raw or {})


def trainer_scheduler(training_args: Any, optimizer: Any, num_training_steps: int | None) -> HFSchedule | None:
    """``Trainer.create_scheduler(T)``: the ``lr_scheduler_type`` schedule over ``optimizer``; None when
    ``training_args`` has no ``lr_scheduler_type`` (a dict meant only for the config's "auto" values)."""
    if not args_has(training_args, "lr_scheduler_type"):
        return None
    name = str(_arg(training_args, "lr_scheduler_type"))
    if name not in HF_SCHEDULES:
        raise ConfigError(f"training_args.lr_scheduler_type={name!r} is not supported by the engine; use one of "
                          f"{sorted(HF_SCHEDULES)} or add a DeepSpeed \"scheduler\" section to the config")
    _, needs_warmup, needs_total, _ = HF_SCHEDULES[name]
    total, warmup = _step_counts(training_args, num_training_steps, name, needs_total, needs_warmup)
    kwargs = _scheduler_kwargs(training_args)
    lr_init = getattr(getattr(optimizer, "inner", None), "defaults", {}).get("lr")
    try:
        sched = HFSchedule(optimizer, name, num_warmup_steps=warmup, num_training_steps=total, lr_init=lr_init,
                           **kwargs)
    except ValueError as exc:
        raise ConfigError(f"training_args: {exc}") from None
    logger.info("scheduler = %s(num_warmup_steps=%d, num_training_steps=%s, %s) (no \"scheduler\" section -> HF "
                "Trainer's create_scheduler from training_args)", name, warmup, total, kwargs)
    return sched


def _step_counts(args: Any, num_training_steps: int | None, name: str, needs_total: bool,
                 needs_warmup: bool) -> tuple[int | None, int]:
    """(total steps, warmup steps) with the config's rules (``engine.config``: num_training_steps or max_steps > 0;
    TrainingArguments.get_warmup_steps)."""
    from engine.config import _Resolver, _total_steps, _Unresolvable, _warmup_steps

    r = _Resolver({}, args, 1, None, num_training_steps)
    try:
        total = _total_steps(r)
    except _Unresolvable:
        total = None
    if needs_total and total is None:
        raise ConfigError(f"training_args.lr_scheduler_type={name!r} needs the total step count; pass "
                          "num_training_steps=... to initialize() or set training_args.max_steps > 0")
    if not needs_warmup:
        return total, 0
    if not (args_has(args, "warmup_steps") or args_has(args, "warmup_ratio")):
        logger.info("training_args.warmup_steps = 0 (absent -> TrainingArguments' default)")
        return total, 0
    try:
        return total, max(0, _warmup_steps(r))
    except _Unresolvable as exc:
        raise ConfigError(f"training_args: cannot compute the warmup steps for lr_scheduler_type={name!r}: {exc}; "
                          "pass num_training_steps=... to initialize() or give warmup_steps >= 1") from None
