"""DeepSpeed JSON config -> typed, fully resolved ``EngineConfig``.

The config travels one way through four stages::

    _read()        dict | path -> plain dict (JSON, else hjson as DeepSpeed reads it; duplicate keys refused)
    _check_keys()  every key classified by the tables in ``engine.config_keys``: supported (kept), accepted-and-
                   ignored (dropped, logged), default-only (refused unless set to its no-op value), refused, or
                   unknown (refused with a did-you-mean); legacy aliases folded
    resolve()      the ONE place values are picked: "auto", keys the config leaves out that training_args
                   define, DeepSpeed's derived batch size and value-dependent defaults. Every pick is logged on
                   the "engine.config" logger; an explicit value contradicting training_args is refused.
    _build()       typed ``@dataclass(kw_only=True)`` sections; cross-field rules in ``__post_init__``

Names and defaults follow DeepSpeed 0.19 (``runtime/config.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/precision_config.py``); the "auto" mapping follows transformers'
``HfTrainerDeepSpeedConfig``. docs/engine-config.md tabulates the same rules; ``describe_keys()`` lists them so a
test keeps the two in step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine import config_keys
from engine.config_keys import _ZERO_JSON_NAMES, AUTO, ConfigError, KeySections, _check_keys

logger = logging.getLogger("engine.config")

__all__ = ["AUTO", "ConfigError", "EngineConfig", "OptimizerConfig", "SchedulerConfig", "WarmupLRParams",
           "WarmupDecayLRParams", "WarmupCosineLRParams", "FP16Config", "BF16Config", "ZeroConfig",
           "OffloadOptimizerConfig", "OffloadParamConfig", "load_config", "resolve", "model_hidden_size",
           "describe_keys", "AUTO_KEYS"]


def _check_min(path: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ConfigError(f"{path}={value!r} must be >= {minimum}")


def _check_positive_int(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{path}={value!r} must be a positive integer")


# ---- Typed sections -------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class _Offload:
    device: Literal["none", "cpu", "nvme"] = "none"
    """Where the offloaded tensors live: "none" (the accelerator), "cpu" or "nvme"."""
    nvme_path: str | None = None
    """Directory on the NVMe drive; required when device is "nvme"."""
    pin_memory: bool = True
    """Keep offloaded tensors in page-locked CPU memory (faster host<->device copies)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    def _check(self, path: str) -> None:
        if self.device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{path}.device={self.device!r} must be one of ['none', 'cpu', 'nvme']")
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{path}.device=\"nvme\" needs {path}.nvme_path (a directory on the NVMe drive)")
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            if hasattr(self, name):
                _check_min(f"{path}.{name}", getattr(self, name), 0)


@dataclass(kw_only=True)
class OffloadOptimizerConfig(_Offload):
    """Optimizer states and the optimizer step on the CPU (states optionally swapped to NVMe); stages 1-3."""
    buffer_count: int = 4
    """NVMe swap buffers (at least the optimizer states per parameter)."""
    fast_init: bool = False
    """Fast optimizer-state initialisation when offloading to NVMe."""

    def __post_init__(self) -> None:
        self._check("zero_optimization.offload_optimizer")


@dataclass(kw_only=True)
class OffloadParamConfig(_Offload):
    """ZeRO-3 parameter partitions kept on the CPU (or NVMe) between uses; stage 3 only."""
    buffer_count: int = 5
    """NVMe swap buffers for parameters."""
    buffer_size: int = 100_000_000
    """Elements per NVMe swap buffer."""
    max_in_cpu: int = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe."""

    def __post_init__(self) -> None:
        self._check("zero_optimization.offload_param")


@dataclass(kw_only=True)
class ZeroConfig:
    stage: int = 0
    """0 = plain data parallel; 1 = optimizer states partitioned; 2 = + gradients; 3 = + parameters."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: int = 500_000_000
    """Elements reduced per bucket."""
    allgather_partitions: bool = True
    """All-gather updated partitions (True) or broadcast them one by one (False) after the step (stages 1-2)."""
    allgather_bucket_size: int = 500_000_000
    """Elements all-gathered per bucket (stages 1-2)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward. Absent from the JSON: true for stage 3 only (DeepSpeed's rule)."""
    round_robin_gradients: bool = False
    """Stage 1-2 CPU-offload optimisation: ranks copy gradients to the CPU in round-robin partitions."""
    sub_group_size: int = 1_000_000_000
    """Elements per optimizer-step tile (stage 3 / offload)."""
    prefetch_bucket_size: int = 50_000_000
    """JSON "stage3_prefetch_bucket_size": parameter elements fetched ahead of use (stage 3)."""
    param_persistence_threshold: int = 100_000
    """JSON "stage3_param_persistence_threshold": parameters smaller than this stay whole on every rank."""
    max_live_parameters: int = 1_000_000_000
    """JSON "stage3_max_live_parameters": gathered parameter elements resident per rank before release."""
    max_reuse_distance: int = 1_000_000_000
    """JSON "stage3_max_reuse_distance": keep a gathered parameter reused within this many elements."""
    gather_16bit_weights_on_model_save: bool = False
    """JSON "stage3_gather_16bit_weights_on_model_save" (legacy "..._fp16_..."): full 16-bit weights on save."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload (stages 1-3)."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        _check_min("zero_optimization.reduce_bucket_size", self.reduce_bucket_size, 1)
        for name in ("allgather_bucket_size", "sub_group_size", "prefetch_bucket_size", "param_persistence_threshold",
                     "max_live_parameters", "max_reuse_distance"):
            _check_min(f"zero_optimization.{_ZERO_JSON_NAMES.get(name, name)}", getattr(self, name), 0)
        # DeepSpeed accepts both of these and then silently does not offload.
        for sub, needs, ok in (("offload_optimizer", "stage >= 1", self.stage >= 1),
                               ("offload_param", "stage 3", self.stage == 3)):
            if getattr(self, sub).enabled and not ok:
                raise ConfigError(f"zero_optimization.{sub}.device={getattr(self, sub).device!r} needs ZeRO {needs} "
                                  f"but zero_optimization.stage={self.stage}; raise the stage or set device \"none\"")


@dataclass(kw_only=True)
class FP16Config:
    enabled: bool = False
    """Train in fp16 mixed precision (fp16 compute, fp32 master weights, loss scaling)."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""
    loss_scale: float = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale is raised."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is lowered (DeepSpeed's "delayed shift")."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step."""
    min_loss_scale: int = 1
    """Floor of the dynamic loss scale."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.loss_scale) and self.loss_scale >= 0):
            raise ConfigError(f"fp16.loss_scale={self.loss_scale!r} must be a finite number >= 0 (0 = dynamic)")
        if self.enabled and self.dynamic_loss_scale:
            # hysteresis 0: DeepSpeed never lowers the scale, so every step overflows and is skipped, forever.
            for name in ("loss_scale_window", "min_loss_scale", "hysteresis"):
                _check_min(f"fp16.{name}", getattr(self, name), 1)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.initial_scale_power)


@dataclass(kw_only=True)
class BF16Config:
    enabled: bool = False
    """Train in bf16 mixed precision (bf16 compute, fp32 master weights, no loss scaling). Legacy key "bfloat16"."""
    check_grad_overflow: bool = True
    """Skip the optimizer step when a gradient is inf/NaN (DeepSpeed 0.19 default)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    type: Literal["Adam", "AdamW"]
    """Optimizer name, case-insensitive in the JSON; stored as "Adam" or "AdamW"."""
    lr: float = 1e-3
    """Learning rate (a scheduler, if any, overrides it every step)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """Weight decay. Absent from the JSON: 0.01 for torch's AdamW (torch_adam in AdamW mode), else 0.0."""
    adam_w_mode: bool = True
    """Decoupled (AdamW) weight decay. DeepSpeed's default is true, so type "Adam" runs AdamW unless it is false."""
    torch_adam: bool = False
    """DeepSpeed's switch to torch.optim.Adam/AdamW instead of FusedAdam/CPU Adam (same update rule)."""

    def __post_init__(self) -> None:
        if self.type == "AdamW" and not self.adam_w_mode:
            raise ConfigError("optimizer.params.adam_w_mode=false contradicts optimizer.type='AdamW' (DeepSpeed "
                              "silently runs AdamW); use type 'Adam' for L2-style weight decay or drop adam_w_mode")
        for name, ok, rule in (("lr", self.lr >= 0, ">= 0"), ("eps", self.eps > 0, "> 0"),
                               ("weight_decay", self.weight_decay >= 0, ">= 0"),
                               ("betas", all(0.0 <= b < 1.0 for b in self.betas), "in [0, 1)")):
            if not ok:
                raise ConfigError(f"optimizer.params.{name}={getattr(self, name)!r} must be {rule}")


@dataclass(kw_only=True)
class WarmupLRParams:
    warmup_min_lr: float | list[float] = 0.0
    """Learning rate at step 0 (one value, or one per param group)."""
    warmup_max_lr: float | list[float] | None = None
    """Learning rate reached after warmup; None = the optimizer's lr (DeepSpeed 0.19's WarmupLR default)."""
    warmup_num_steps: int = 1000
    """Warmup length in optimizer steps (raised to at least 2, as DeepSpeed)."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: int = -1
    """Index of the last step taken; -1 starts fresh and writes the step-0 lr into the optimizer."""

    def __post_init__(self) -> None:
        for name in ("warmup_num_steps", "total_num_steps"):
            if hasattr(self, name):
                _check_positive_int(f"scheduler.params.{name}", getattr(self, name))


@dataclass(kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: int
    """Step at which the linear decay reaches 0."""
    warmup_max_lr: float | list[float] = 0.001
    """Learning rate reached after warmup (DeepSpeed's default 0.001)."""


@dataclass(kw_only=True)
class WarmupCosineLRParams:
    total_num_steps: int
    """Step at which the cosine decay reaches cos_min_ratio."""
    warmup_min_ratio: float = 0.0
    """Fraction of the optimizer's lr at step 0."""
    warmup_num_steps: int = 1000
    """Warmup length in optimizer steps (raised to at least 2, as DeepSpeed)."""
    cos_min_ratio: float = 0.0001
    """Fraction of the optimizer's lr at the end of the cosine decay."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: int = -1
    """Index of the last step taken; -1 starts fresh."""

    __post_init__ = WarmupLRParams.__post_init__


_SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams}

#: the sections whose fields are supported keys, for the key tables of :mod:`engine.config_keys`
_KEY_SECTIONS = KeySections(fp16=FP16Config, bf16=BF16Config, optimizer=OptimizerConfig,
                            scheduler_params=tuple(_SCHEDULER_PARAMS.items()))


def describe_keys() -> list[tuple[str, str, str]]:
    """(dotted key, kind, note) for every DeepSpeed key the engine knows (:func:`engine.config_keys.describe_keys`)."""
    return config_keys.describe_keys(_KEY_SECTIONS)


@dataclass(kw_only=True)
class SchedulerConfig:
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    """DeepSpeed scheduler class name (case-sensitive, as DeepSpeed)."""
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams
    """Constructor arguments of that class, with DeepSpeed's names."""

    def __post_init__(self) -> None:
        if type(self.params) is not _SCHEDULER_PARAMS.get(self.type):
            raise ConfigError(f"scheduler.type={self.type!r} does not take {type(self.params).__name__}")


@dataclass(kw_only=True)
class EngineConfig:
    train_batch_size: int
    """Samples per optimizer step over all ranks = micro batch * accumulation steps * world size."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro batches accumulated per optimizer step."""
    world_size: int = 1
    """Data-parallel world size the batch arithmetic was resolved for (not a DeepSpeed key)."""
    gradient_clipping: float = 1.0
    """Global gradient-norm clip; 0.0 = off. DeepSpeed 0.19's default is 1.0."""
    optimizer: OptimizerConfig | None = None
    """Optimizer the engine builds; None = the caller passes its own."""
    scheduler: SchedulerConfig | None = None
    """LR scheduler the engine builds; None = none, or the caller's own."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 mixed precision."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """JSON "zero_optimization": ZeRO stage, buckets, thresholds, offload."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer other than Adam/AdamW with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, insist on the engine's own CPU Adam rather than a client optimizer."""
    steps_per_print: int | None = None
    """Log progress every N optimizer steps; None = never (DeepSpeed 0.19's default)."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step and log the breakdown."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """dtype of gradient reductions (case-insensitive in the JSON); None = the compute dtype."""
    gradient_predivide_factor: float = 1.0
    """Divide gradients by this before the reduction and by world_size/factor after."""
    prescale_gradients: bool = False
    """Scale gradients by 1/world_size before (rather than after) the reduction."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "world_size"):
            _check_min(name, getattr(self, name), 1)
        micro, gas, world = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, self.world_size
        if self.train_batch_size != micro * gas * world:
            raise ConfigError(f"train_batch_size={self.train_batch_size} != train_micro_batch_size_per_gpu={micro} "
                              f"* gradient_accumulation_steps={gas} * world_size={world} (= {micro * gas * world}); "
                              "fix one of them or leave one out to derive it")
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled=true and bf16.enabled=true; enable at most one of them")
        if not (math.isfinite(self.gradient_clipping) and self.gradient_clipping >= 0):
            raise ConfigError(f"gradient_clipping={self.gradient_clipping!r} must be >= 0 (0 = off)")
        if not self.gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor={self.gradient_predivide_factor!r} must be > 0")
        if self.steps_per_print is not None:
            _check_min("steps_per_print", self.steps_per_print, 1)

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of forward/backward: bfloat16, float16 or float32."""
        return torch.bfloat16 if self.bf16.enabled else torch.float16 if self.fp16.enabled else torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config as DeepSpeed-shaped JSON data (no "auto" left), e.g. for checkpoints.

        ``load_config(cfg.to_dict(), world_size=cfg.world_size) == cfg``, and DeepSpeed accepts it too.
        """
        out = {k: v for k, v in _plain(self).items() if k not in ("world_size", "zero", "optimizer", "scheduler")}
        if self.optimizer is not None:
            params = _plain(self.optimizer)
            out["optimizer"] = {"type": params.pop("type"), "params": params}
        if self.scheduler is not None:
            out["scheduler"] = _plain(self.scheduler)
        out["zero_optimization"] = {_ZERO_JSON_NAMES.get(k, k): v for k, v in _plain(self.zero).items()}
        return out


def _plain(obj: Any) -> Any:
    """Dataclass -> JSON-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return [_plain(v) for v in obj] if isinstance(obj, (tuple, list)) else obj


# ---- Reading ------------------------------------------------------------------------------------------------------

def _read(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a dict or a path to a DeepSpeed JSON file, got {type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a dict or a path to a DeepSpeed JSON file")
    text = path.read_text(encoding="utf-8")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        for key in keys:
            if keys.count(key) > 1:
                raise ConfigError(f"duplicate key {key!r} in {path}; keep one of them")
        return dict(items)
    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        try:  # DeepSpeed reads configs with hjson, which also takes trailing commas and comments
            import hjson
            data = hjson.loads(text, object_pairs_hook=pairs)
        except ConfigError:
            raise
        except (ImportError, ValueError):
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


# ---- resolve(): the one place values are picked ---------------------------------------------------------------------

class _Unresolvable(Exception):
    """A value derived from training_args (or the step count) cannot be computed; the message says why and the fix."""


class _Resolver:
    """Picks values into a key-checked config dict, logging each pick; see ``resolve``."""

    def __init__(self, raw: dict[str, Any], training_args: Any, world_size: int, model_hidden_size: int | None,
                 num_training_steps: int | None) -> None:
        self.raw, self.args, self.world_size = raw, training_args, world_size
        self.hidden, self.total_steps = model_hidden_size, num_training_steps

    def has_arg(self, name: str) -> bool:
        args = self.args
        return args is not None and (name in args if isinstance(args, Mapping) else hasattr(args, name))

    def arg(self, name: str, *, none_ok: bool = False) -> Any:
        if self.args is None:
            raise _Unresolvable("no training_args were given to resolve it; pass training_args=... or write a value")
        if not self.has_arg(name):
            raise _Unresolvable(f"training_args has no {name!r}; add it or write a value")
        value = self.args[name] if isinstance(self.args, Mapping) else getattr(self.args, name)
        if value is None and not none_ok:
            raise _Unresolvable(f"training_args.{name} is None; set it or write a value")
        return value

    def get(self, path: str) -> tuple[bool, Any]:
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def pick(self, path: str, value: Any, why: str) -> None:
        *parents, last = path.split(".")
        node = self.raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        logger.info("%s = %r (%s)", path, value, why)

    def from_args(self, path: str, label: str, compute: Callable[[], Any]) -> None:
        """HF's fill_match: "auto" -> the computed value; an explicit value must equal it; absent -> filled."""
        present, current = self.get(path)
        try:
            expected = compute()
        except _Unresolvable as exc:
            if current == AUTO:
                raise ConfigError(f"{path} is \"auto\" but {exc}") from None
            return
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:  # a training argument of the wrong type
            raise ConfigError(f"{path}: cannot compute {label} from training_args: {exc}") from None
        if present and current != AUTO:
            if not _same(current, expected):
                raise ConfigError(f"{path}={current!r} in the config contradicts {label}={expected!r}; set {path} to "
                                  "\"auto\" or make them equal")
            return
        self.pick(path, expected, f"{'auto' if present else 'absent'} -> {label}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _auto_paths(raw: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key, value in raw.items():
        if isinstance(value, dict):
            found += _auto_paths(value, f"{prefix}{key}.")
        elif value == AUTO:
            found.append(prefix + key)
    return found


AUTO_KEYS = (  # the keys that take "auto"; docs/engine-config.md has the table of sources
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold")


def resolve(raw: dict[str, Any], *, training_args: Any = None, world_size: int = 1,
            model_hidden_size: int | None = None, num_training_steps: int | None = None) -> dict[str, Any]:
    """Pick every value the config leaves open, in place, logging each; the only function that picks values.

    ``raw`` is a key-checked config dict with DeepSpeed's names. In order: "auto" on a key without an "auto" rule is
    refused; HfTrainerDeepSpeedConfig's training_args mapping fills "auto" and keys the config leaves out (HF would
    leave those at DeepSpeed's defaults whatever the arguments say) and refuses contradicting explicit values;
    DeepSpeed derives the missing batch size; the hidden-size rules; DeepSpeed's value-dependent defaults.
    """
    stray = [p for p in _auto_paths(raw) if p not in AUTO_KEYS]
    if stray:
        raise ConfigError(f"{stray[0]} is \"auto\" but only the keys listed in docs/engine-config.md take \"auto\"; "
                          "write a value")
    r = _Resolver(raw, training_args, world_size, model_hidden_size, num_training_steps)
    _resolve_batch(r)
    r.from_args("gradient_clipping", "training_args.max_grad_norm",
                lambda: float(r.arg("max_grad_norm", none_ok=True) or 0.0))
    _resolve_optimizer(r)
    _resolve_scheduler(r)
    r.from_args("fp16.enabled", "training_args.fp16", lambda: bool(r.arg("fp16", none_ok=True)))
    r.from_args("bf16.enabled", "training_args.bf16", lambda: bool(r.arg("bf16", none_ok=True)))
    _resolve_zero(r)
    if raw.get("steps_per_print") == math.inf:  # accelerate's _prepare_deepspeed sets it to silence DeepSpeed
        r.pick("steps_per_print", None, "inf (accelerate's \"never\") -> null")
    return raw


def _resolve_batch(r: _Resolver) -> None:
    ws, names = r.world_size, ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

    def int_arg(name: str) -> int:
        return _as_int(f"training_args.{name}", r.arg(name))
    r.from_args(names[1], "training_args.per_device_train_batch_size", lambda: int_arg("per_device_train_batch_size"))
    r.from_args(names[2], "training_args.gradient_accumulation_steps", lambda: int_arg("gradient_accumulation_steps"))
    r.from_args(names[0], "world_size * per_device_train_batch_size * gradient_accumulation_steps",
                lambda: ws * int_arg("per_device_train_batch_size") * int_arg("gradient_accumulation_steps"))
    for name in names:
        if name in r.raw:
            _check_min(name, _as_int(name, r.raw[name]), 1)
    tbs, mbs, gas = (_as_int(n, r.raw[n]) if n in r.raw else None for n in names)
    # DeepSpeed's _set_batch_related_parameters, its floor divisions turned into divisibility checks
    if tbs is None and mbs is None:
        raise ConfigError("train_batch_size and train_micro_batch_size_per_gpu are both missing; set one of them "
                          "(or pass training_args)")
    if tbs is not None and mbs is not None:
        if gas is None:
            if tbs % (mbs * ws):
                raise ConfigError(f"train_batch_size={tbs} is not a multiple of train_micro_batch_size_per_gpu="
                                  f"{mbs} * world_size={ws}; fix one of them")
            r.pick(names[2], tbs // mbs // ws, "derived: train_batch_size / (micro * world_size)")
        return
    if gas is None:
        gas = 1
        r.pick(names[2], 1, "derived: DeepSpeed's default when only one batch size is given")
    if tbs is None:
        r.pick(names[0], mbs * gas * ws, "derived: micro * gas * world_size")
    elif tbs % (gas * ws):
        raise ConfigError(f"train_batch_size={tbs} is not a multiple of gradient_accumulation_steps={gas} * "
                          f"world_size={ws}; fix one of them")
    else:
        r.pick(names[1], tbs // ws // gas, "derived: train_batch_size / (gas * world_size)")


def _resolve_optimizer(r: _Resolver) -> None:
    if "optimizer" not in r.raw:  # the caller's own optimizer, as with HF Trainer
        return
    r.from_args("optimizer.params.lr", "training_args.learning_rate", lambda: r.arg("learning_rate"))
    r.from_args("optimizer.params.betas", "training_args.adam_beta1/adam_beta2",
                lambda: [r.arg("adam_beta1"), r.arg("adam_beta2")])
    r.from_args("optimizer.params.eps", "training_args.adam_epsilon", lambda: r.arg("adam_epsilon"))
    r.from_args("optimizer.params.weight_decay", "training_args.weight_decay", lambda: r.arg("weight_decay"))
    kind, params = r.raw["optimizer"]["type"], r.raw["optimizer"]["params"]
    if "adam_w_mode" not in params:
        r.pick("optimizer.params.adam_w_mode", True,
               "absent -> DeepSpeed's default" + (", so type 'Adam' runs AdamW" if kind == "Adam" else ""))
    if "weight_decay" not in params:
        torch_adamw = params.get("torch_adam") is True and params["adam_w_mode"] is not False
        r.pick("optimizer.params.weight_decay", 0.01 if torch_adamw else 0.0,
               "absent -> default of " + ("torch.optim.AdamW" if torch_adamw else "DeepSpeed's Adam"))


def _resolve_scheduler(r: _Resolver) -> None:
    if "scheduler" not in r.raw:
        return
    kind, params = r.raw["scheduler"]["type"], r.raw["scheduler"]["params"]
    if kind != "WarmupCosineLR":
        if params.get("warmup_min_lr") == AUTO:
            r.pick("scheduler.params.warmup_min_lr", 0, "auto -> 0 (not a training argument)")
        r.from_args("scheduler.params.warmup_max_lr", "training_args.learning_rate", lambda: r.arg("learning_rate"))
    if kind != "WarmupLR":
        r.from_args("scheduler.params.total_num_steps", "num_training_steps or training_args.max_steps",
                    lambda: _total_steps(r))
    r.from_args("scheduler.params.warmup_num_steps", "max(1, training_args' warmup steps)",
                lambda: max(1, _warmup_steps(r)))


def _total_steps(r: _Resolver) -> int:
    if r.total_steps is not None:
        max_steps = r.arg("max_steps", none_ok=True) if r.has_arg("max_steps") else None
        if isinstance(max_steps, int) and max_steps > 0 and max_steps != r.total_steps:  # HF passes max_steps
            raise ConfigError(f"num_training_steps={r.total_steps} contradicts training_args.max_steps={max_steps}; "
                              "pass one of them, or make them equal")
        return r.total_steps
    max_steps = r.arg("max_steps", none_ok=True) if r.args is not None else None
    if isinstance(max_steps, int) and max_steps > 0:
        return max_steps
    raise _Unresolvable("the total step count is unknown; pass num_training_steps=... (or training_args with "
                        "max_steps > 0) or write a value")


def _warmup_steps(r: _Resolver) -> int:
    """TrainingArguments.get_warmup_steps: warmup_steps >= 1 is a count, 0 < x < 1 a ratio of the total
    (transformers 5); else the legacy warmup_ratio (transformers 4)."""
    steps = r.arg("warmup_steps")
    if steps >= 1:
        return int(steps)
    legacy_ratio = r.arg("warmup_ratio", none_ok=True) if r.has_arg("warmup_ratio") else 0
    ratio = steps if steps > 0 else (legacy_ratio or 0)
    if ratio <= 0:
        return 0
    getter = getattr(r.args, "get_warmup_steps", None)
    return getter(_total_steps(r)) if callable(getter) else math.ceil(_total_steps(r) * ratio)


def _resolve_zero(r: _Resolver) -> None:
    zero = r.raw.setdefault("zero_optimization", {})
    stage, hidden = zero.get("stage", 0), r.hidden
    for key, formula, any_stage in (("reduce_bucket_size", lambda h: h * h, True),
                                    ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h), False),
                                    ("stage3_param_persistence_threshold", lambda h: 10 * h, False)):
        path = f"zero_optimization.{key}"
        if zero.get(key) != AUTO:
            continue
        if not any_stage and stage != 3:  # HF leaves these "auto" and DeepSpeed then drops them to its defaults
            field_name = next(f for f, k in _ZERO_JSON_NAMES.items() if k == key)
            r.pick(path, getattr(ZeroConfig(), field_name), f"auto at stage {stage} -> DeepSpeed's default (unused)")
        elif hidden is None:
            raise ConfigError(f"{path} is \"auto\" but no model_hidden_size was given; pass "
                              "model_hidden_size=model.config.hidden_size or write an integer")
        else:
            r.pick(path, formula(hidden), f"auto -> from model_hidden_size={hidden}")
    if "overlap_comm" not in zero:
        r.pick("zero_optimization.overlap_comm", stage == 3, "absent -> DeepSpeed's default: true for stage 3 only")


def model_hidden_size(model: Any) -> int | None:
    """The hidden size HF's integration would use: config.hidden_size, max(hidden_sizes), or text_config's."""
    config = getattr(model, "config", model)
    for holder in (config, getattr(config, "text_config", None)):
        if getattr(holder, "hidden_size", None) is not None:
            return int(holder.hidden_size)
        if getattr(holder, "hidden_sizes", None):
            return int(max(holder.hidden_sizes))
    return None


# ---- Building typed sections ----------------------------------------------------------------------------------------

def _as_int(path: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{path}={value!r} must be an integer")


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """A JSON value as the field's declared type (1e9 -> int, [a, b] -> tuple, ...), or ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(path, value, option)
            except ConfigError:
                continue
        names = [getattr(a, "__name__", None) or str(a).replace("typing.", "") for a in args]
        raise ConfigError(f"{path}={value!r} must be {' or '.join(names).replace('NoneType', 'null')}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}={value!r} must be one of {list(args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)) or (origin is tuple and len(value) != len(args)):
            raise ConfigError(f"{path}={value!r} must be a list" + (f" of {len(args)}" if origin is tuple else ""))
        items = [_coerce(f"{path}[{i}]", v, args[i] if origin is tuple else args[0]) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    checks = {bool: (lambda v: isinstance(v, bool), "true or false"), str: (lambda v: isinstance(v, str), "a string"),
              float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")}
    if hint is int:
        return _as_int(path, value)
    if hint not in checks:
        raise TypeError(f"no coercion for {hint!r}")  # a new field type: teach _coerce
    ok, what = checks[hint]
    if not ok(value):
        raise ConfigError(f"{path}={value!r} must be {what}")
    return float(value) if hint is float else value


def _fill(cls: type, data: Mapping[str, Any], where: str, names: Mapping[str, str] | None = None,
          **given: Any) -> Any:
    """One section dataclass from its JSON dict (``names``: field name -> JSON key); ``given`` fields as is."""
    hints, kwargs = typing.get_type_hints(cls), dict(given)
    for f in dataclasses.fields(cls):
        key = (names or {}).get(f.name, f.name)
        if f.name not in given and key in data:
            kwargs[f.name] = _coerce(where + key, data[key], hints[f.name])
        elif f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            hint = ("; write it, or pass num_training_steps=... or training_args with max_steps > 0"
                    if key == "total_num_steps" else "")
            raise ConfigError(f"{where}{key} is required for {cls.__name__.removesuffix('Params')}{hint}")
    return cls(**kwargs)


def _build(resolved: dict[str, Any], world_size: int) -> EngineConfig:
    zero = resolved.get("zero_optimization", {})
    where = "zero_optimization."
    optimizer = scheduler = None
    if "optimizer" in resolved:
        opt = resolved["optimizer"]
        optimizer = _fill(OptimizerConfig, {**opt["params"], "type": opt["type"]}, "optimizer.params.")
    if "scheduler" in resolved:
        kind = resolved["scheduler"]["type"]
        scheduler = SchedulerConfig(type=kind, params=_fill(_SCHEDULER_PARAMS[kind], resolved["scheduler"]["params"],
                                                            "scheduler.params."))
    top = dict(resolved)
    if isinstance(top.get("communication_data_type"), str):
        top["communication_data_type"] = top["communication_data_type"].lower()
    zero_cfg = _fill(ZeroConfig, zero, where, _ZERO_JSON_NAMES,
                     offload_optimizer=_fill(OffloadOptimizerConfig, zero.get("offload_optimizer", {}),
                                             where + "offload_optimizer."),
                     offload_param=_fill(OffloadParamConfig, zero.get("offload_param", {}), where + "offload_param."))
    return _fill(EngineConfig, top, "", world_size=world_size, optimizer=optimizer, scheduler=scheduler, zero=zero_cfg,
                 fp16=_fill(FP16Config, resolved.get("fp16", {}), "fp16."),
                 bf16=_fill(BF16Config, resolved.get("bf16", {}), "bf16."))


def load_config(config: Mapping[str, Any] | str | os.PathLike, *, training_args: Any = None, world_size: int = 1,
                model_hidden_size: int | None = None, num_training_steps: int | None = None) -> EngineConfig:
    """Read, check, resolve and type a DeepSpeed config; raises ConfigError with a one-line reason.

    config: a dict (left unmodified) or a path to a JSON (or hjson) file.
    training_args: transformers.TrainingArguments, any dataclass, SimpleNamespace or dict with TrainingArguments'
        field names; fills "auto" and keys the config leaves out, and must agree with explicit values.
    world_size: data-parallel world size, for the batch-size arithmetic.
    model_hidden_size: for the hidden-size "auto" keys (``model_hidden_size(model)`` finds it as HF does).
    num_training_steps: total optimizer steps, for scheduler.params.total_num_steps (else training_args.max_steps).
    """
    _check_positive_int("world_size", world_size)
    checked = _check_keys(_read(config), _KEY_SECTIONS)
    return _build(resolve(checked, training_args=training_args, world_size=world_size,
                          model_hidden_size=model_hidden_size, num_training_steps=num_training_steps), world_size)
