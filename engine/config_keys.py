"""What each DeepSpeed config key means to this engine, and the key check that applies it.

Every key of a DeepSpeed config is supported (kept for ``resolve()`` and the typed sections), accepted-and-ignored
(dropped, logged), default-only (refused unless set to its no-op value), refused, or unknown (refused with a
did-you-mean). The tables below say which; ``_check_keys()`` applies them and ``describe_keys()`` lists them so a
test keeps docs/engine-config.md in step.

Imports go one way: ``engine.config`` imports this module, never the reverse. The tables whose supported keys are
the fields of ``engine.config``'s dataclasses (fp16, bf16, optimizer.params, scheduler.params) are built from the
classes the caller passes in a :class:`KeySections` (``engine.config`` passes its own). ``ConfigError`` and ``AUTO``
live here; ``engine.config`` re-exports them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("engine.config")  # the config's one logger, shared with engine.config

AUTO = "auto"


class ConfigError(ValueError):
    """A config this engine refuses; the message is one line naming the key, the value(s) and the fix."""


_ZERO_JSON_NAMES = {  # ZeroConfig field -> DeepSpeed JSON key (DeepSpeed's own pydantic aliases)
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


# ---- Key tables: what each DeepSpeed key means here ----------------------------------------------------------------

SUPPORTED, IGNORED, DEFAULT_ONLY, REFUSED = "supported", "accepted-and-ignored", "default-only", "refused"


@dataclass(frozen=True)
class _Rule:
    kind: str
    note: str = ""
    noop: Any = None  # DEFAULT_ONLY: the value that makes the key a no-op, or a predicate over the value
    section: Mapping[str, _Rule] | None = None  # SUPPORTED: sub-table to descend into


_s = functools.partial(_Rule, SUPPORTED)  # _s(note="", section=None)
_i = functools.partial(_Rule, IGNORED)  # _i(note)
_d = functools.partial(_Rule, DEFAULT_ONLY)  # _d(note, noop)
_r = functools.partial(_Rule, REFUSED)  # _r(note)


def _disabled(value: Any) -> bool:
    return isinstance(value, dict) and not value.get("enabled", False)


def _missing(what: str) -> str:
    return f"not implemented: {what}"


def _fields(cls: type) -> dict[str, _Rule]:
    """Every field of a section dataclass, as a supported key."""
    return {f.name: _s() for f in dataclasses.fields(cls)}


_REMOVED = "removed from DeepSpeed (deepspeedai/DeepSpeed#8489), which refuses it too"
_PERF = "performance/debug knob with no effect on the numbers"

_OFFLOAD_OPTIMIZER_KEYS = {
    **{k: _s() for k in ("device", "nvme_path", "pin_memory", "buffer_count", "fast_init")},
    **{k: _i(_PERF) for k in ("pipeline_read", "pipeline_write", "cpuadam_cores_perc")},
    "ratio": _d(_missing("partial optimizer offload"), 1.0),
    "super_offload": _d(_missing("Superchip offload"), False),
}
_OFFLOAD_PARAM_KEYS = {k: _s() for k in
                       ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")}
_ZERO_KEYS = {
    **{k: _s() for k in ("stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                         "allgather_partitions", "allgather_bucket_size", "overlap_comm", "round_robin_gradients",
                         "sub_group_size", *_ZERO_JSON_NAMES.values())},
    "offload_optimizer": _s(section=_OFFLOAD_OPTIMIZER_KEYS), "offload_param": _s(section=_OFFLOAD_PARAM_KEYS),
    **{k: _i(_PERF) for k in (
        "use_multi_rank_bucket_allreduce", "memory_efficient_linear", "override_module_apply",
        "log_trace_cache_warnings", "enable_sanity_checks", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
        "stage3_model_persistence_threshold", "save_muon_momentum_buffer_in_memory")},
    "ignore_unused_parameters": _i("unused parameters are always tolerated"),
    "parameter_alignment": _i("flat-buffer padding; our checkpoints record their own layout"),
    "elastic_checkpoint": _i("legacy checkpoint-layout flag; our checkpoints record their own layout and load at "
                             "another world size or stage (resharded while loading, or offline by `zckpt reshard`)"),
    "cpu_offload_use_pin_memory": _i("deprecated; offload_*.pin_memory is what counts"),
    "aio": _i("libaio tuning (misplaced here in the HF ZeRO-Infinity example; DeepSpeed wants it top-level)"),
    "load_from_fp32_weights": _d(_missing("re-deriving fp32 master weights from the 16-bit ones"), True),
    "compute_grad_norm": _d("the gradient norm is always computed", True),
    "legacy_stage1": _d(_missing("DeepSpeed's legacy stage-1 code path"), False),
    "pipeline_loading_checkpoint": _d(_missing("pipeline-mode checkpoint loading"), False),
    "zero_hpz_partition_size": _d(_missing("ZeRO++ hierarchical partitioning"), 1),
    "zero_quantized_weights": _d(_missing("ZeRO++ quantized weights"), False),
    "zero_quantized_nontrainable_weights": _d(_missing("ZeRO++ quantized weights"), False),
    "zero_quantized_gradients": _d(_missing("ZeRO++ quantized gradients"), False),
    "zenflow": _d(_missing("ZenFlow"), None),
    "leaf_module": _d(_missing("ZeRO-3 leaf modules"), lambda v: isinstance(v, dict) and not any(v.values())),
    "cpu_offload": _d("deprecated; write offload_optimizer: {\"device\": \"cpu\"}", False),
    "cpu_offload_param": _d("deprecated; write offload_param: {\"device\": \"cpu\"}", False),
    **{k: _r(_REMOVED) for k in ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")},
}
_ZERO_ALIASES = {**_ZERO_JSON_NAMES,  # DeepSpeed takes its pydantic field names too, and one legacy name
                 "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
_OPTIMIZER_EXTRA_KEYS = {  # optimizer.params keys besides OptimizerConfig's fields
    **{k: _i("implementation choice of torch's Adam; same update rule") for k in (
        "foreach", "fused", "capturable", "differentiable", "set_grad_none")},
    "amsgrad": _d(_missing("AMSGrad"), False),
    "bias_correction": _d(_missing("Adam without bias correction"), True),
    "maximize": _d(_missing("maximising the loss"), False),
    "fp32_optimizer_states": _d("optimizer states are always fp32", lambda v: v in (None, True)),
    "max_grad_norm": _r("use the top-level gradient_clipping key (DeepSpeed refuses it here too)"),
}
_SCHEDULER_KEYS = {"type": _s("WarmupLR, WarmupDecayLR or WarmupCosineLR"), "params": _s("per type, below")}
_CHECKPOINT_KEYS = {
    "tag_validation": _i("our manifests verify tags themselves"),
    "parallel_write": _i(_PERF),
    "use_node_local_storage": _d(_missing("node-local checkpoint storage"), False),
    "load_universal": _d(_missing("loading DeepSpeed universal checkpoints (DeepSpeed ZeRO checkpoints load "
                                  "directly)"), False),
    "writer": _d(_missing("custom checkpoint writers"), None),
}
_DATA_TYPES_KEYS = {
    **{k: _d(_missing("dtype overrides (dtypes follow fp16/bf16)"), None)
       for k in ("grad_accum_dtype", "param_dtype", "buffer_dtype")},
    "keep_in_fp32_modules": _d(_missing("keep-in-fp32 module lists"), AUTO),
}
_TOP_SCALAR_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                    "steps_per_print", "wall_clock_breakdown", "communication_data_type",
                    "gradient_predivide_factor", "prescale_gradients")
_TOP_OTHER_KEYS: dict[str, _Rule] = {  # the top-level keys after optimizer, scheduler, fp16 and bf16
    "bfloat16": _s("legacy alias of bf16"),
    "zero_optimization": _s(section=_ZERO_KEYS),
    "checkpoint": _s("only its no-op settings", section=_CHECKPOINT_KEYS),
    "data_types": _s("only its no-op settings", section=_DATA_TYPES_KEYS),
    **{k: _i("monitoring/profiling output only") for k in (
        "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers",
        "memory_breakdown", "dump_state", "log_level", "autotuning")},
    **{k: _i(_PERF) for k in ("disable_python_gc", "aio")},
    "vocabulary_size": _i("DeepSpeed only prints an alignment warning from it"),
    "activation_checkpointing": _i("configures deepspeed.checkpointing, which this engine does not provide; "
                                   "torch.utils.checkpoint is unaffected"),
    "pipeline": _i("read only for PipelineModule models, which this engine does not run"),
    "use_data_before_expert_parallelism": _i("MoE process-group layout; there is no expert parallelism here"),
    "seq_parallel_communication_data_type": _i("sequence parallelism is not implemented (its size must be 1)"),
    "managed_gradient_accumulation": _d(_missing("client-owned accumulation boundaries"), True),
    "disable_allgather": _d(_missing("broadcast instead of all-gather"), False),
    "gradient_allreduce_op": _d(_missing("summing (not averaging) gradients"), "mean"),
    "sequence_parallel_size": _d(_missing("sequence parallelism"), 1),
    "dataloader_drop_last": _d("the engine does not build data loaders", False),
    "torch_autocast": _d(_missing("torch.autocast mode (use fp16 or bf16)"), _disabled),
    "hybrid_engine": _d(_missing("the RLHF hybrid engine"), _disabled),
    "data_efficiency": _d(_missing("data-efficiency sampling/routing"), _disabled),
    "expert_parallel": _d(_missing("expert parallelism"), _disabled),
    "datastates": _d(_missing("DataStates async checkpointing"), _disabled),
    "compile": _d(_missing("DeepCompile"), lambda v: isinstance(v, dict) and not v.get("deepcompile")),
    "tensor_parallel": _d(_missing("tensor parallelism"),
                          lambda v: isinstance(v, dict) and v.get("autotp_size", 1) in (0, 1)),
    "weight_quantization": _r(_missing("inference weight quantization")),
    **{k: _r(_REMOVED) for k in (
        "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
        "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop")},
}


@dataclass(frozen=True)
class KeySections:
    """The typed sections whose fields are the supported keys of fp16, bf16, optimizer.params and, per scheduler
    type, scheduler.params (``engine.config``'s dataclasses; passed in, so this module never imports them)."""

    fp16: type
    bf16: type
    optimizer: type
    scheduler_params: tuple[tuple[str, type], ...]  # (scheduler type, its params dataclass)


@functools.cache
def _tables(sections: KeySections) -> tuple[dict[str, _Rule], dict[str, dict[str, _Rule]]]:
    """(top-level table, scheduler.params table per scheduler type), built once per ``sections``."""
    fp16 = {**_fields(sections.fp16),
            "fp16_master_weights_and_grads": _d(_missing("fp16 master weights (they are fp32)"), False)}
    bf16 = {**_fields(sections.bf16),
            "immediate_grad_update": _i("when micro-batch gradients fold into fp32 is the engine's choice"),
            "bf16_master_weights_and_grads": _d(_missing("bf16 master weights (they are fp32)"), False),
            "bf16_optimizer_states": _d(_missing("bf16 optimizer states"), False)}
    optimizer_params = {k: r for k, r in _fields(sections.optimizer).items() if k != "type"}
    optimizer = {"type": _s("Adam or AdamW, case-insensitive"),
                 "params": _s(section={**optimizer_params, **_OPTIMIZER_EXTRA_KEYS}),
                 "legacy_fusion": _d(_missing("the legacy fused-optimizer mode"), False)}
    top = {**{k: _s() for k in _TOP_SCALAR_KEYS},
           "optimizer": _s(section=optimizer), "scheduler": _s(section=_SCHEDULER_KEYS),
           "fp16": _s(section=fp16), "bf16": _s(section=bf16), **_TOP_OTHER_KEYS}
    return top, {name: _fields(cls) for name, cls in sections.scheduler_params}


def describe_keys(sections: KeySections) -> list[tuple[str, str, str]]:
    """(dotted key, kind, note) for every DeepSpeed key this module knows; docs/engine-config.md lists the same."""
    rows: list[tuple[str, str, str]] = []

    def walk(table: Mapping[str, _Rule], prefix: str) -> None:
        for key, rule in table.items():
            rows.append((prefix + key, rule.kind, rule.note))
            if rule.section is not None:
                walk(rule.section, f"{prefix}{key}.")
    top, scheduler_params = _tables(sections)
    walk(top, "")
    for name, table in scheduler_params.items():
        walk(table, f"scheduler.params[{name}].")
    return rows + [(f"zero_optimization.{a}", SUPPORTED, f"alias of {t}") for a, t in _ZERO_ALIASES.items()]


# ---- Key checking ---------------------------------------------------------------------------------------------------

def _fold_alias(section: dict[str, Any], alias: str, target: str, where: str) -> None:
    if alias in section:
        value = section.pop(alias)
        if target in section and section[target] != value:
            raise ConfigError(f"{where}{alias}={value!r} and its alias {where}{target}={section[target]!r} "
                              "disagree; keep one")
        section.setdefault(target, value)


def _check_section(data: Any, table: Mapping[str, _Rule], where: str) -> dict[str, Any]:
    """The supported keys of one section; ignored ones dropped (logged); everything else refused."""
    label = where.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{label} must be a JSON object, got {data!r}")
    kept: dict[str, Any] = {}
    for key, value in data.items():
        rule, path = table.get(key), where + key
        if rule is None:
            close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "see docs/engine-config.md for the keys we take"
            raise ConfigError(f"unknown key {key!r} in {label}; {hint}")
        if rule.kind == IGNORED:
            logger.warning("ignoring %s (%s)", path, rule.note)
        elif rule.kind == REFUSED:
            raise ConfigError(f"{path} is not supported ({rule.note}); remove it")
        elif rule.kind == DEFAULT_ONLY:
            if not (rule.noop(value) if callable(rule.noop) else value in (rule.noop, AUTO)):
                fix = "remove it or disable it" if callable(rule.noop) else f"remove it or set it to {rule.noop!r}"
                raise ConfigError(f"{path}={value!r} is not supported ({rule.note}); {fix}")
        else:
            kept[key] = _check_section(value, rule.section, path + ".") if rule.section else value
    return kept


def _check_keys(raw: dict[str, Any], sections: KeySections) -> dict[str, Any]:
    """A read config with every key classified by the tables: aliases folded, the supported keys kept."""
    top, scheduler_params = _tables(sections)
    _fold_alias(raw, "bfloat16", "bf16", "")
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        raise ConfigError(f"zero_optimization={zero!r} is DeepSpeed's deprecated boolean form; write "
                          "zero_optimization: {\"stage\": N}")
    for alias, target in _ZERO_ALIASES.items() if isinstance(zero, dict) else ():
        _fold_alias(zero, alias, target, "zero_optimization.")
    checked = _check_section(raw, top, "")
    checked.pop("checkpoint", None)  # only no-op content passed the check: nothing to keep
    checked.pop("data_types", None)
    for name in ("optimizer", "scheduler"):
        if name in checked and "type" not in checked[name]:
            raise ConfigError(f"{name}.type is missing; DeepSpeed would silently run without the {name}")
    if "scheduler" in checked:
        sched = checked["scheduler"]
        kind = sched["type"]
        if not isinstance(kind, str) or kind not in scheduler_params:
            close = difflib.get_close_matches(str(kind), list(scheduler_params), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"use one of {sorted(scheduler_params)}"
            raise ConfigError(f"scheduler.type={kind!r} is not supported (LRRangeTest, OneCycle and torch "
                              f"schedulers are not implemented); {hint}")
        sched["params"] = _check_section(sched.get("params", {}), scheduler_params[kind], "scheduler.params.")
    if "optimizer" in checked:
        opt = checked["optimizer"]
        if str(opt["type"]).lower() not in ("adam", "adamw"):
            raise ConfigError(f"optimizer.type={opt['type']!r} is not supported; use \"Adam\" or \"AdamW\", or pass "
                              "your own torch optimizer to initialize() and drop the optimizer section")
        opt["type"] = "AdamW" if str(opt["type"]).lower() == "adamw" else "Adam"
        opt.setdefault("params", {})
    return checked
