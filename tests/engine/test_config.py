"""engine.config: the HF guide's "auto" configs verbatim, the TrainingArguments mapping, DeepSpeed's batch rule and
defaults, refusals of what DeepSpeed would silently get wrong, to_dict round trips, and the docs table."""

import dataclasses
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import (ConfigError, EngineConfig, FP16Config, describe_keys, load_config, model_hidden_size)

from _engine_harness import dataclass_without_post_init

# ---- Test data: verbatim from the transformers DeepSpeed guide ----------------------------------------------------

# docs/source/en/main_classes/deepspeed.md, "ZeRO-2 Example": ds_config_zero2.json
ZERO2_AUTO = """
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""

# docs/source/en/main_classes/deepspeed.md, "ZeRO-3 Example": ds_config_zero3.json (CPU offload of both)
ZERO3_AUTO = """
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""

# docs/source/en/deepspeed.md, "NVMe configuration": the ZeRO-3/Infinity example (offload to NVMe; note the "aio"
# block nested in zero_optimization, which DeepSpeed itself rejects)
ZERO3_NVME_AUTO = """
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 4,
            "fast_init": false
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": false,
            "overlap_events": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""

# docs/source/en/main_classes/deepspeed.md, "Configuration": the ZeRO-2 setup above without steps_per_print and
# wall_clock_breakdown, ending in a trailing comma (not JSON; DeepSpeed reads it with hjson)
ZERO2_TRAILING_COMMA = ZERO2_AUTO.replace('    "steps_per_print": 2000,\n', "").replace(
    '"train_micro_batch_size_per_gpu": "auto",\n    "wall_clock_breakdown": false\n',
    '"train_micro_batch_size_per_gpu": "auto",\n')

HF_EXAMPLES = {"zero2": ZERO2_AUTO, "zero3": ZERO3_AUTO, "zero3_nvme": ZERO3_NVME_AUTO,
               "zero2_trailing_comma": ZERO2_TRAILING_COMMA}

ARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-5, adam_beta1=0.8,
            adam_beta2=0.99, adam_epsilon=1e-7, weight_decay=0.01, max_grad_norm=0.5, fp16=True, bf16=False,
            warmup_steps=0.1, max_steps=200)


@dataclasses.dataclass
class MyArgs:
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 2
    learning_rate: float = 3e-5
    adam_beta1: float = 0.8
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-7
    weight_decay: float = 0.01
    max_grad_norm: float = 0.5
    fp16: bool = True
    bf16: bool = False
    warmup_steps: float = 0.1
    max_steps: int = 200


def real_training_arguments(**values):
    """A genuine transformers.TrainingArguments (its own attributes and get_warmup_steps) built without its
    __post_init__, which needs accelerate and a device; only the fields matter here."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.TrainingArguments
    return dataclass_without_post_init(cls, **values)


def write(tmp_path, text, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- The HF guide's configs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HF_EXAMPLES))
@pytest.mark.parametrize("args_kind", ["namespace", "dict", "dataclass", "TrainingArguments"])
def test_hf_guide_configs_load_verbatim(tmp_path, name, args_kind):
    args = {"namespace": lambda: SimpleNamespace(**ARGS), "dict": lambda: dict(ARGS), "dataclass": MyArgs,
            "TrainingArguments": lambda: real_training_arguments(**ARGS)}[args_kind]()
    cfg = load_config(write(tmp_path, HF_EXAMPLES[name]), training_args=args, world_size=2, model_hidden_size=64)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 16)
    assert cfg.gradient_clipping == 0.5
    opt = cfg.optimizer
    assert (opt.type, opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.adam_w_mode) == \
        ("AdamW", 3e-5, (0.8, 0.99), 1e-7, 0.01, True)
    params = cfg.scheduler.params
    assert (cfg.scheduler.type, params.warmup_min_lr, params.warmup_max_lr) == ("WarmupLR", 0.0, 3e-5)
    assert params.warmup_num_steps == 20  # ceil(0.1 * max_steps 200)
    assert cfg.fp16.enabled and not cfg.bf16.enabled and cfg.compute_dtype == torch.float16
    assert cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_dynamic_scale == 2.0 ** 16
    zero = cfg.zero
    if name.startswith("zero2"):
        assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (2, 200_000_000, 200_000_000)
        assert zero.offload_optimizer.device == "cpu" and not zero.offload_param.enabled
    else:
        assert (zero.stage, zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) \
            == (3, 64 * 64, int(0.9 * 64 * 64), 640)
        assert zero.sub_group_size == zero.max_live_parameters == zero.max_reuse_distance == 1_000_000_000
        assert isinstance(zero.max_live_parameters, int) and zero.gather_16bit_weights_on_model_save
        device = "nvme" if name == "zero3_nvme" else "cpu"
        assert zero.offload_optimizer.device == zero.offload_param.device == device
    assert load_config(cfg.to_dict(), world_size=2) == cfg


def test_every_auto_pick_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="engine.config")
    load_config(json.loads(ZERO3_AUTO), training_args=dict(ARGS), world_size=1, model_hidden_size=8)
    picked = {m.split(" = ")[0] for m in caplog.messages if " = " in m}
    auto_keys = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                 "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
                 "scheduler.params.warmup_num_steps", "fp16.enabled", "zero_optimization.reduce_bucket_size",
                 "zero_optimization.stage3_prefetch_bucket_size",
                 "zero_optimization.stage3_param_persistence_threshold"}
    assert auto_keys <= picked
    assert "optimizer.params.lr = 3e-05 (auto -> training_args.learning_rate)" in caplog.messages
    assert all(r.name == "engine.config" for r in caplog.records)


def test_input_dict_is_not_modified():
    raw = json.loads(ZERO2_AUTO)
    snapshot = json.dumps(raw, sort_keys=True)
    load_config(raw, training_args=dict(ARGS))
    assert json.dumps(raw, sort_keys=True) == snapshot


def test_auto_without_training_args_is_refused():
    with pytest.raises(ConfigError, match=r"^optimizer.params.lr is \"auto\" but no training_args were given") as e:
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="is \"auto\" but no training_args were given to resolve it; pass "
                                          "training_args=... or write a value"):
        load_config(json.loads(ZERO2_AUTO))


def test_hidden_size_auto_needs_model_hidden_size():
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size is \"auto\" but no model_hidden_size"):
        load_config(json.loads(ZERO3_AUTO), training_args=dict(ARGS))


def test_stage3_hidden_keys_fall_back_to_deepspeed_defaults_below_stage3():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "stage": 2, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})
    assert (cfg.zero.prefetch_bucket_size, cfg.zero.param_persistence_threshold) == (50_000_000, 100_000)


def test_auto_on_a_key_without_an_auto_rule_is_refused():
    with pytest.raises(ConfigError, match="zero_optimization.stage is \"auto\""):
        load_config({"train_batch_size": 4, "zero_optimization": {"stage": "auto"}}, training_args=dict(ARGS))


# ---- Explicit values against training_args --------------------------------------------------------------------------

@pytest.mark.parametrize("config,message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     "optimizer.params.lr=0.001 in the config contradicts training_args.learning_rate=5e-05"),
    ({"train_micro_batch_size_per_gpu": 8},
     "train_micro_batch_size_per_gpu=8 in the config contradicts training_args.per_device_train_batch_size=4"),
    ({"gradient_clipping": 1.0}, "gradient_clipping=1.0 in the config contradicts training_args.max_grad_norm=0.5"),
    ({"train_batch_size": 64}, "train_batch_size=64 in the config contradicts world_size * per_device"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.999]}}}, "optimizer.params.betas=[0.9, 0.999]"),
    ({"bf16": {"enabled": True}}, "bf16.enabled=True in the config contradicts training_args.bf16=False"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}},
     "scheduler.params.total_num_steps=100 in the config contradicts num_training_steps or training_args.max_steps"),
])
def test_explicit_value_contradicting_training_args_is_refused(config, message):
    args = dict(ARGS, learning_rate=5e-5)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config, training_args=args, world_size=2)


def test_explicit_values_equal_to_training_args_are_accepted():
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2.0, "gradient_clipping": 0.5,
              "optimizer": {"type": "adamw", "params": {"lr": 3e-5, "betas": [0.8, 0.99]}}}
    cfg = load_config(config, training_args=dict(ARGS))
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.betas == (0.8, 0.99)
    assert cfg.train_batch_size == 8


def test_keys_absent_from_config_follow_training_args():
    # HF would leave these at DeepSpeed's defaults (clipping 1.0, fp32), silently ignoring the arguments.
    cfg = load_config({}, training_args=dict(ARGS, max_grad_norm=0.25, fp16=False, bf16=True))
    assert (cfg.train_batch_size, cfg.gradient_clipping, cfg.compute_dtype) == (8, 0.25, torch.bfloat16)
    assert cfg.optimizer is None and cfg.scheduler is None  # the caller's own, as HF Trainer does


def test_total_steps_from_num_training_steps_and_unresolvable():
    config = {"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    cfg = load_config(config, training_args=dict(ARGS, max_steps=-1, warmup_steps=0), num_training_steps=500)
    assert (cfg.scheduler.params.total_num_steps, cfg.scheduler.params.warmup_num_steps) == (500, 1)
    cfg = load_config(config, training_args=real_training_arguments(max_steps=-1, warmup_steps=0.05),
                      num_training_steps=500)
    assert cfg.scheduler.params.warmup_num_steps == 25
    with pytest.raises(ConfigError, match="total_num_steps is \"auto\" but the total step count is unknown"):
        load_config(config, training_args=dict(ARGS, max_steps=-1))
    with pytest.raises(ConfigError, match="total_num_steps is required for WarmupDecayLR"):
        load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}})
    assert load_config(config, training_args=dict(ARGS), num_training_steps=200).scheduler.params.total_num_steps \
        == 200  # equal to max_steps, as HF Trainer passes it
    with pytest.raises(ConfigError, match="^num_training_steps=500 contradicts training_args.max_steps=200; pass"):
        load_config(config, training_args=dict(ARGS), num_training_steps=500)


def test_unusable_training_argument_is_a_config_error():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is \"auto\" but training_args."
                                          "per_device_train_batch_size is None; set it or write a value"):
        load_config({"train_micro_batch_size_per_gpu": "auto"},
                    training_args=dict(ARGS, per_device_train_batch_size=None))
    with pytest.raises(ConfigError, match="training_args.gradient_accumulation_steps='2' must be an integer"):
        load_config({}, training_args=dict(ARGS, gradient_accumulation_steps="2"))
    with pytest.raises(ConfigError, match=re.escape("optimizer.params.lr=[1] must be a number")):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW"}},
                    training_args=dict(ARGS, learning_rate=[1]))
    with pytest.raises(ConfigError, match="training_args has no 'learning_rate'; add it or write a value"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                    training_args={"per_device_train_batch_size": 8})


def test_legacy_warmup_ratio_of_transformers_4():
    args = SimpleNamespace(**dict(ARGS, warmup_steps=0, warmup_ratio=0.25, max_steps=40))
    cfg = load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_num_steps": "auto"}}}, training_args=args)
    assert cfg.scheduler.params.warmup_num_steps == 10


# ---- Batch size ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (24, 3, 4)),
])
def test_batch_size_rule(given, world, expected):
    cfg = load_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("given,message", [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
     "train_batch_size=24 != train_micro_batch_size_per_gpu=3 * gradient_accumulation_steps=2 * world_size=2"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, "train_batch_size=10 is not a multiple"),
    ({"gradient_accumulation_steps": 4}, "train_batch_size and train_micro_batch_size_per_gpu are both missing"),
    ({"train_batch_size": 0}, "train_batch_size=0 must be >= 1"),
    ({"train_batch_size": 2.5}, "train_batch_size=2.5 must be an integer"),
])
def test_batch_size_inconsistency_is_refused(given, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(given, world_size=2)


def test_batch_rule_agrees_with_deepspeed():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for given in ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, {"train_batch_size": 12},
                  {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3},
                  {"train_batch_size": 12, "gradient_accumulation_steps": 6}):
        ds, ours = DeepSpeedConfig(dict(given)), load_config(given)
        assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == \
            (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps)


# ---- Keys: unknown, ignored, default-only, refused, aliases --------------------------------------------------------

def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as exc:
        load_config({"train_batch_size": 8, "zero_optimisation": {"stage": 2}})
    assert str(exc.value) == "unknown key 'zero_optimisation' in config; did you mean 'zero_optimization'?"
    with pytest.raises(ConfigError, match=r"unknown key 'stage3_max_live_params' in zero_optimization; did you mean "
                                          r"'stage3_max_live_parameters'\?"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_params": 10}})
    with pytest.raises(ConfigError, match="unknown key 'warmup_max_lr' in scheduler.params"):
        load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 10, "warmup_max_lr": 0.1}}})
    with pytest.raises(ConfigError, match="unknown key 'xyzzy' in config; see docs/engine-config.md"):
        load_config({"train_batch_size": 8, "xyzzy": 1})


def test_ignored_keys_are_accepted_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="engine.config")
    cfg = load_config({"train_batch_size": 8, "tensorboard": {"enabled": True}, "zero_optimization": {
        "stage": 1, "memory_efficient_linear": False}, "checkpoint": {"tag_validation": "Fail"}})
    assert cfg.zero.stage == 1
    assert any("ignoring tensorboard" in m for m in caplog.messages)
    assert any("ignoring zero_optimization.memory_efficient_linear" in m for m in caplog.messages)


@pytest.mark.parametrize("config,message", [
    ({"zero_optimization": {"zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights=True is not supported (not implemented: ZeRO++ quantized weights)"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     "optimizer.params.amsgrad=True is not supported (not implemented: AMSGrad); remove it or set it to False"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast={'enabled': True} is not supported"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal=True is not supported"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio=0.5 is not supported"),
])
def test_default_only_keys_refuse_other_values(config, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_batch_size": 8, **config})


def test_default_only_keys_accept_their_noop_value():
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "zero_quantized_weights": False,
                                                                  "zero_hpz_partition_size": 1},
                       "torch_autocast": {"enabled": False}, "gradient_allreduce_op": "mean",
                       "data_types": {"keep_in_fp32_modules": "auto"}})
    assert cfg.zero.stage == 2


@pytest.mark.parametrize("config,message", [
    ({"amp": {"enabled": True}}, "amp is not supported (removed from DeepSpeed"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type='Lamb' is not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm is not"),
    ({"optimizer": {"params": {"lr": 0.1}}}, "optimizer.type is missing"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type='OneCycle' is not supported"),
    ({"scheduler": {"type": "warmuplr", "params": {}}}, "did you mean 'WarmupLR'?"),
    ({"scheduler": {"type": ["WarmupLR"], "params": {}}}, "scheduler.type=['WarmupLR'] is not supported"),
    ({"zero_optimization": True}, "zero_optimization=True is DeepSpeed's deprecated boolean form"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled=true and bf16.enabled=true"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, "bfloat16={'enabled': False} and its alias bf16"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not a ZeRO stage"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=True must be an integer"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device='cpu' needs ZeRO stage >= 1"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device='cpu' needs ZeRO stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "must be one of ['none', 'cpu', 'nvme']"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size=0 must be >= 1"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "adam_w_mode=false contradicts"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis=0 must be >= 1"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale=-1.0 must be a finite number >= 0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, "must be one of ['log', 'linear']"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "warmup_num_steps=0 must be a positive"),
    ({"communication_data_type": "int8"}, "communication_data_type='int8' must be"),
    ({"gradient_clipping": -1}, "gradient_clipping=-1.0 must be >= 0"),
    ({"wall_clock_breakdown": "yes"}, "wall_clock_breakdown='yes' must be true or false"),
])
def test_refusals(config, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_batch_size": 8, **config})


def test_legacy_aliases():
    cfg = load_config({"train_batch_size": 8, "bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True, "prefetch_bucket_size": 1000}})
    assert cfg.bf16.enabled and cfg.compute_dtype == torch.bfloat16
    assert cfg.zero.gather_16bit_weights_on_model_save and cfg.zero.prefetch_bucket_size == 1000
    with pytest.raises(ConfigError, match="disagree"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage3_gather_fp16_weights_on_model_save": True, "stage3_gather_16bit_weights_on_model_save": False}})


# ---- DeepSpeed's defaults and semantics ----------------------------------------------------------------------------

def test_defaults_follow_deepspeed():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2})
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None
    assert cfg.compute_dtype == torch.float32 and cfg.optimizer is None and cfg.scheduler is None
    assert (cfg.zero.stage, cfg.zero.overlap_comm) == (0, False)
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}}).zero.overlap_comm is True


def test_adam_semantics_follow_deepspeed():
    def opt(params, kind="Adam"):
        return load_config({"train_batch_size": 2, "optimizer": {"type": kind, "params": params}}).optimizer
    assert opt({}).adam_w_mode is True  # DeepSpeed's "Adam" is AdamW unless told otherwise
    assert opt({"adam_w_mode": False}).adam_w_mode is False
    assert opt({}).weight_decay == 0.0  # FusedAdam / CPU Adam default
    assert opt({"torch_adam": True}, "ADAMW").weight_decay == 0.01  # torch.optim.AdamW default
    assert opt({"torch_adam": True, "adam_w_mode": False}).weight_decay == 0.0  # torch.optim.Adam default


def test_values_agree_with_deepspeed_config():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(json.loads(ZERO3_AUTO), training_args=dict(ARGS), model_hidden_size=32)
    ds = DeepSpeedConfig(cfg.to_dict())  # DeepSpeed accepts our resolved output as is
    assert ds.zero_optimization_stage == cfg.zero.stage
    for name in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                 "max_reuse_distance", "gather_16bit_weights_on_model_save", "overlap_comm", "sub_group_size",
                 "contiguous_gradients", "round_robin_gradients"):
        assert getattr(ds.zero_config, name) == getattr(cfg.zero, name), name
    assert ds.zero_config.offload_param.device == cfg.zero.offload_param.device
    assert ds.float16_config.dynamic_loss_scale_args() == {
        "init_scale": cfg.fp16.initial_dynamic_scale, "scale_window": cfg.fp16.loss_scale_window,
        "delayed_shift": cfg.fp16.hysteresis, "consecutive_hysteresis": cfg.fp16.consecutive_hysteresis,
        "min_scale": cfg.fp16.min_loss_scale}
    assert (ds.gradient_clipping, ds.train_batch_size, ds.steps_per_print) == \
        (cfg.gradient_clipping, cfg.train_batch_size, cfg.steps_per_print)
    # ...and DeepSpeed's defaults for a bare config are ours
    bare_ds, bare = DeepSpeedConfig({"train_batch_size": 2}), load_config({"train_batch_size": 2})
    assert (bare_ds.gradient_clipping, bare_ds.steps_per_print, bare_ds.zero_config.overlap_comm) == \
        (bare.gradient_clipping, bare.steps_per_print, bare.zero.overlap_comm)
    for f in dataclasses.fields(FP16Config):
        assert getattr(bare_ds.float16_config, f.name) == getattr(bare.fp16, f.name), f.name


def test_to_dict_is_json_and_round_trips():
    cfg = load_config({"train_batch_size": 16, "gradient_accumulation_steps": 2, "communication_data_type": "FP32",
                       "optimizer": {"type": "adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
                       "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1e3,
                                                                        "warmup_min_lr": [0.0, 1e-6]}},
                       "fp16": {"enabled": True, "loss_scale": 128}}, world_size=4)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["communication_data_type"] == "fp32" and data["scheduler"]["params"]["total_num_steps"] == 1000
    assert '"auto"' not in json.dumps(data)
    again = load_config(data, world_size=4)
    assert again == cfg and isinstance(again, EngineConfig)


# ---- Files ---------------------------------------------------------------------------------------------------------

def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(write(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}'))
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(write(tmp_path, '{"train_batch_size": [8'))
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(write(tmp_path, "[1, 2]"))
    assert load_config(str(write(tmp_path, '{"train_batch_size": 8}'))).train_batch_size == 8


def test_model_hidden_size_lookup_like_hf():
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_size=768))) == 768
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[64, 256, 128]))) == 256
    assert model_hidden_size(SimpleNamespace(text_config=SimpleNamespace(hidden_size=32))) == 32
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace())) is None


# ---- The docs table mirrors the code -------------------------------------------------------------------------------

def test_docs_list_every_key_with_its_kind():
    doc = Path(__file__).resolve().parents[2] / "docs" / "engine-config.md"
    kinds = {"supported", "accepted-and-ignored", "default-only", "refused"}
    rows = {}
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[1] in kinds:
            rows[cells[0].strip("`")] = cells[1]
    code = {key: kind for key, kind, _ in describe_keys()}
    assert rows == code, {k: (rows.get(k), code.get(k)) for k in rows.keys() ^ code.keys() | {
        k for k in rows.keys() & code.keys() if rows[k] != code[k]}}


# ---- engine.initialize plumbing ------------------------------------------------------------------------------------

@pytest.fixture
def world_of_one(monkeypatch):
    """engine.initialize in this process: no launcher variables, so the engine forms a gloo world of one; a process
    group it created is destroyed afterwards."""
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    existed = dist.is_initialized()
    yield
    if dist.is_initialized() and not existed:
        dist.destroy_process_group()


def test_initialize_resolves_the_hf_zero3_auto_config_and_trains(world_of_one):
    """The guide's ZeRO-3 config as is: batch/optimizer/scheduler from training_args, the hidden-size buckets from
    the model, the warmup ratio from num_training_steps (max_steps=-1, as with an epoch-based HF run)."""
    transformers = pytest.importorskip("transformers")
    import engine

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=True))
    args = dict(ARGS, fp16=False, max_steps=-1, learning_rate=1e-3)
    config = json.loads(ZERO3_AUTO)
    with pytest.raises(ConfigError, match="warmup_num_steps is \"auto\" but the total step count is unknown"):
        engine.initialize(model=model, model_parameters=model.parameters(), config=config, training_args=args)
    eng, _, _, scheduler = engine.initialize(model=model, model_parameters=model.parameters(), config=config,
                                             training_args=args, num_training_steps=30)
    cfg = eng.config
    assert (eng.world_size, eng.zero_optimization_stage(), eng.train_batch_size(), cfg.compute_dtype) == \
        (1, 3, 8, torch.float32)
    zero = cfg.zero
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == \
        (64 * 64, int(0.9 * 64 * 64), 640)
    assert zero.offload_optimizer.device == zero.offload_param.device == "cpu"
    assert (cfg.scheduler.type, cfg.scheduler.params.warmup_num_steps) == ("WarmupLR", 3)  # ceil(0.1 * 30)
    before = eng.fp32_state_dict()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3 * eng.gradient_accumulation_steps()):  # WarmupLR (as DeepSpeed's) runs two steps at lr 0
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
    assert eng.global_steps == 3 and scheduler is eng.lr_scheduler and eng.get_lr() == [1e-3]  # warmed up
    after = eng.fp32_state_dict()
    assert sorted(after) == sorted(before) and any(not torch.equal(before[n], after[n]) for n in before)
