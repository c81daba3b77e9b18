"""The HF guide's ZeRO-1/2/3 configs (no "optimizer", no "scheduler" section) as HF Trainer runs them.

Trainer hands DeepSpeed its own AdamW (decay / no-decay groups from TrainingArguments) and its own
``lr_scheduler_type`` schedule; ``engine.initialize(..., training_args=args)`` must build the same. Compared here with
the real thing: ``transformers.Trainer.create_optimizer`` / ``create_scheduler`` / ``get_decay_parameter_names``,
``transformers.get_scheduler``, and a plain torch training loop with Trainer's optimizer and scheduler. The configs
are committed verbatim in ``fixtures/hf_guide`` (source: its README).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import engine
from engine.config import ConfigError
from engine.hf_optim import decay_parameter_names, trainer_param_groups
from engine.scheduler import HF_SCHEDULES, HFSchedule

from _engine_harness import dataclass_without_post_init

transformers = pytest.importorskip("transformers")

GUIDE = Path(__file__).resolve().parents[2] / "fixtures" / "hf_guide"
CONFIGS = ("zero1", "zero2", "zero3")
VOCAB, SEQ = 64, 8


def training_arguments(**values):
    """A genuine TrainingArguments: constructed normally when accelerate is installed (its __post_init__ needs it),
    else with its dataclass defaults set field by field (its methods, e.g. get_warmup_steps, are the real ones)."""
    cls = transformers.TrainingArguments
    if importlib.util.find_spec("accelerate") is not None:
        return cls(output_dir="unused", report_to=[], use_cpu=True, **values)
    return dataclass_without_post_init(cls, **values)


def hf_trainer(model, args):
    """A real transformers.Trainer (without accelerate: its create_optimizer/create_scheduler on a bare instance)."""
    if importlib.util.find_spec("accelerate") is not None:
        return transformers.Trainer(model=model, args=args)
    trainer = object.__new__(transformers.Trainer)
    trainer.model, trainer.args, trainer.optimizer, trainer.lr_scheduler = model, args, None, None
    trainer.optimizer_cls_and_kwargs = None
    return trainer


def tiny_llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    cfg.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


class Corners(nn.Module):
    """Names and classes at the edges of the no-decay rule."""

    def __init__(self):
        super().__init__()
        self.ln_f = nn.LayerNorm(4)                     # class rule only ("ln_f" matches no pattern)
        self.normalizer = nn.Linear(4, 4, bias=False)   # "norm" not as a whole word: decays
        self.q_norm = nn.Linear(4, 4)                   # "_norm."
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))])
        self.post_attention_LayerNorm = nn.Linear(4, 4)  # lower-cased before matching
        self.scale = nn.Parameter(torch.ones(4))        # a root parameter
        self.Bias_table = nn.Parameter(torch.zeros(4))  # "bias" anywhere, any case
        self.head = nn.Linear(4, 4)
        self.head.weight = self.normalizer.weight       # tied: two names, one parameter


ARGS = dict(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.85, adam_beta2=0.99, adam_epsilon=1e-7,
            max_steps=4, warmup_steps=0.25, lr_scheduler_type="cosine", per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_grad_norm=0.5)


# ---- the no-decay rule and the groups ------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [tiny_llama, lambda: tiny_llama(tie_word_embeddings=True), Corners])
def test_decay_names_equal_trainers(build):
    model = build()
    assert decay_parameter_names(model) == transformers.Trainer.get_decay_parameter_names(None, model)


@pytest.mark.parametrize("build", [tiny_llama, Corners])
def test_param_groups_equal_create_optimizer(build):
    model = build()
    list(model.parameters())[1].requires_grad_(False)  # a frozen parameter is in neither group
    hf = hf_trainer(model, training_arguments(**ARGS)).create_optimizer()
    ours = trainer_param_groups(model, ARGS["weight_decay"])
    assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in hf.param_groups]
    assert [g["weight_decay"] for g in ours] == [g["weight_decay"] for g in hf.param_groups] == [0.1, 0.0]


# ---- the schedules -------------------------------------------------------------------------------------------------

SCHEDULES = [("constant", {}), ("constant_with_warmup", {}), ("linear", {}), ("cosine", {}),
             ("cosine", {"num_cycles": 1.5}), ("cosine_with_restarts", {"num_cycles": 3}),
             ("polynomial", {"lr_end": 1e-4, "power": 2.0}), ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 7}),
             ("cosine_with_min_lr", {"min_lr": 1e-3}), ("cosine_with_min_lr", {"min_lr_rate": 0.2}),
             ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
             ("cosine_warmup_with_min_lr", {"min_lr": 1e-3, "warmup_lr_rate": 0.3})]


@pytest.mark.parametrize("name,kwargs", SCHEDULES, ids=[f"{n}-{'-'.join(k)}" for n, k in SCHEDULES])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedule_equals_get_scheduler(name, kwargs, warmup):
    assert name in HF_SCHEDULES
    total = 12

    def optimizer():
        return torch.optim.AdamW([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "weight_decay": 0.0}],
                                 lr=1e-2)
    ref_opt, our_opt = optimizer(), optimizer()
    ref = transformers.get_scheduler(name, ref_opt, num_warmup_steps=warmup, num_training_steps=total,
                                     scheduler_specific_kwargs=dict(kwargs))
    ours = HFSchedule(our_opt, name, num_warmup_steps=warmup, num_training_steps=total, **kwargs)
    for _ in range(total + 3):  # past the end too
        assert [g["lr"] for g in our_opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        assert ours.get_last_lr() == ref.get_last_lr()
        ref_opt.step(), ref.step(), ours.step()


def test_schedule_state_round_trips_and_takes_lambdalr_state():
    opt = torch.optim.AdamW([torch.zeros(1)], lr=1e-2)
    ref = transformers.get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
    for _ in range(5):
        opt.step(), ref.step()
    fresh = torch.optim.AdamW([torch.zeros(1)], lr=1e-2)
    ours = HFSchedule(fresh, "linear", num_warmup_steps=2, num_training_steps=10)
    ours.load_state_dict(ref.state_dict())  # torch LambdaLR state, as Trainer's scheduler.pt holds
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    state = json.loads(json.dumps(ours.state_dict()))
    again = HFSchedule(torch.optim.AdamW([torch.zeros(1)], lr=1e-2), "linear", num_warmup_steps=2,
                       num_training_steps=10)
    again.load_state_dict(state)
    assert again.get_last_lr() == ours.get_last_lr() and again.last_epoch == 5
    with pytest.raises(ValueError, match="not an HF Trainer schedule"):
        again.load_state_dict({"last_batch_iteration": 3})


# ---- the guide's configs through initialize() ----------------------------------------------------------------------

def batches(steps: int, size: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (size, SEQ), generator=g) for _ in range(steps)]


def reference_run(args, steps: int, dtype=torch.float32):
    """Plain torch with Trainer's own optimizer and scheduler: the micro losses and the final weights."""
    model = tiny_llama()
    trainer = hf_trainer(model, args)
    opt = trainer.create_optimizer()
    sched = trainer.create_scheduler(num_training_steps=args.max_steps)
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    losses, lrs = [], []
    for batch in batches(steps, micro * gas):
        lrs.append([g["lr"] for g in opt.param_groups])
        for k in range(gas):
            ids = batch[k * micro:(k + 1) * micro]
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / gas).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad()
    return losses, lrs, {n: p.detach().float() for n, p in model.named_parameters()}


def engine_run(config, args, steps: int, **init_kw):
    model = tiny_llama()
    eng, opt, _, sched = engine.initialize(model=model, config=config, training_args=args, **init_kw)
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    losses, lrs = [], []
    for batch in batches(steps, micro * gas):
        lrs.append(eng.get_lr())
        for k in range(gas):
            ids = batch[k * micro:(k + 1) * micro]
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
    return eng, losses, lrs


def engine_groups(eng) -> list[tuple[list[str], float]]:
    """(parameter names, weight_decay) of each engine optimizer group."""
    group_of = {slot.index: unit.group for unit in eng.table.units for slot in unit.params}
    names = [[n for i, n in enumerate(eng.param_names) if group_of[i] == g] for g in range(len(eng.group_hparams))]
    return [(ns, g["weight_decay"]) for ns, g in zip(names, eng.optimizer.param_groups)]


@pytest.mark.parametrize("name", CONFIGS)
def test_guide_config_trains_as_hf_trainer(name, caplog):
    caplog.set_level(logging.INFO, logger="engine.config")
    args = training_arguments(**ARGS)
    eng, losses, lrs = engine_run(GUIDE / f"{name}.json", args, ARGS["max_steps"])
    assert eng.zero_optimization_stage() == int(name[-1])
    # the groups: what Trainer.create_optimizer builds, by name, with the same hyper-parameters
    model = tiny_llama()
    hf_opt = hf_trainer(model, args).create_optimizer()
    name_of = {id(p): n for n, p in model.named_parameters()}
    assert engine_groups(eng) == [([name_of[id(p)] for p in g["params"]], g["weight_decay"])
                                  for g in hf_opt.param_groups]
    for ours, theirs in zip(eng.optimizer.param_groups, hf_opt.param_groups):
        assert (ours["betas"], ours["eps"]) == (theirs["betas"], theirs["eps"]) == ((0.85, 0.99), 1e-7)
    # the run: same lrs (exactly), same losses and weights as plain torch with Trainer's optimizer and scheduler
    ref_losses, ref_lrs, ref_weights = reference_run(args, ARGS["max_steps"])
    assert lrs == ref_lrs and lrs[0] == [0.0, 0.0] and max(lr[0] for lr in lrs) == ARGS["learning_rate"]
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    got = eng.fp32_state_dict()
    for n, w in ref_weights.items():
        torch.testing.assert_close(got[n], w, rtol=1e-4, atol=1e-6)
    if name != "zero1":  # the guide's ZeRO-2/3 offload the optimizer: DeepSpeed would refuse Trainer's AdamW
        assert any("zero_force_ds_cpu_optimizer = true" in m for m in caplog.messages)


def test_guide_zero2_bf16_within_bf16_tolerance():
    args = training_arguments(**ARGS, bf16=True)
    eng, losses, _ = engine_run(GUIDE / "zero2.json", args, ARGS["max_steps"])
    assert eng.compute_dtype == torch.bfloat16
    ref_losses, _, _ = reference_run(args, ARGS["max_steps"], dtype=torch.bfloat16)
    assert losses == pytest.approx(ref_losses, rel=2e-2)


def test_zero2_before_the_comma_fix_reads_the_same():
    from engine.config import load_config
    kw = dict(training_args=training_arguments(**ARGS))
    assert load_config(GUIDE / "zero2_before_pr42406.json", **kw) == load_config(GUIDE / "zero2.json", **kw)


# ---- mixing: a config section on one side, training_args on the other ---------------------------------------------

def test_optimizer_section_without_scheduler_gets_trainers_schedule():
    """DummyOptim + DummyScheduler(lr_scheduler_callable=trainer.create_scheduler) in transformers' integration."""
    args = training_arguments(**ARGS)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "zero_optimization": {"stage": 1}}
    eng, _, lrs = engine_run(cfg, args, 3)
    assert isinstance(eng.lr_scheduler, HFSchedule) and len(eng.optimizer.param_groups) == 1
    assert [lr for lr, in lrs] == [ref[0] for ref in reference_run(args, 3)[1]] and lrs[0] == [0.0]


def test_scheduler_section_without_optimizer_gets_trainers_adamw():
    args = training_arguments(**{**ARGS, "warmup_steps": 3})
    cfg = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "warmup_type": "linear"}},
           "zero_optimization": {"stage": 2}}
    eng, _, lrs = engine_run(cfg, args, 3)
    assert type(eng.lr_scheduler).__name__ == "WarmupLR"
    assert [g["weight_decay"] for g in eng.optimizer.param_groups] == [0.1, 0.0]
    # DeepSpeed's WarmupLR: min_lr at construction and at index 0, then i / warmup_num_steps of warmup_max_lr
    assert lrs == [[0.0, 0.0], [0.0, 0.0], [pytest.approx(1e-2 / 3)] * 2]


def test_training_args_dict_without_scheduler_type_builds_no_scheduler():
    args = dict(per_device_train_batch_size=2, learning_rate=1e-3)
    eng, _, _, sched = engine.initialize(model=tiny_llama(), config=GUIDE / "zero1.json", training_args=args)
    assert sched is None and eng.get_lr() == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in eng.optimizer.param_groups] == [0.0, 0.0]  # TrainingArguments' default


@pytest.mark.parametrize("change,message", [
    ({"lr_scheduler_type": "warmup_stable_decay"},
     r"^training_args.lr_scheduler_type='warmup_stable_decay' is not supported by the engine; use one of"),
    ({"optim": "adafactor"}, r"^training_args.optim='adafactor' is not AdamW and the config has no \"optimizer\""),
    ({"max_steps": -1}, r"^training_args.lr_scheduler_type='cosine' needs the total step count; pass "
                        r"num_training_steps=\.\.\. to initialize\(\) or set training_args.max_steps > 0$"),
    ({"lr_scheduler_type": "cosine_with_min_lr"},
     r"^training_args: lr_scheduler_type='cosine_with_min_lr' needs min_lr or min_lr_rate in lr_scheduler_kwargs$"),
])
def test_refusals_are_one_line(change, message):
    args = training_arguments(**{**ARGS, **change})
    with pytest.raises(ConfigError, match=message) as err:
        engine.initialize(model=tiny_llama(), config=GUIDE / "zero1.json", training_args=args)
    assert "\n" not in str(err.value)


def test_num_training_steps_when_max_steps_is_unset():
    args = training_arguments(**{**ARGS, "max_steps": -1})
    _, _, lrs = engine_run(GUIDE / "zero1.json", args, 3, num_training_steps=4)
    assert lrs == reference_run(training_arguments(**ARGS), 3)[1]


def test_no_optimizer_anywhere_names_training_args():
    with pytest.raises(ValueError, match="or pass training_args= to build HF Trainer's AdamW"):
        engine.initialize(model=tiny_llama(), config={"train_micro_batch_size_per_gpu": 1})


def test_schedule_resumes_from_a_checkpoint(tmp_path):
    args = training_arguments(**ARGS)
    eng, _, _ = engine_run(GUIDE / "zero2.json", args, 2)
    eng.save_checkpoint(tmp_path)
    fresh, _, _, sched = engine.initialize(model=tiny_llama(1), config=GUIDE / "zero2.json", training_args=args)
    assert fresh.get_lr() == [0.0, 0.0]
    fresh.load_checkpoint(tmp_path)
    assert sched.last_epoch == 2 and fresh.get_lr() == eng.get_lr()
    assert math.isclose(fresh.get_lr()[0], reference_run(args, 3)[1][2][0])


# ---- two ranks: the two groups partitioned across data-parallel ranks ---------------------------------------------

DICT_ARGS = dict(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8,
                 optim="adamw_torch", max_steps=3, warmup_steps=1, lr_scheduler_type="linear",
                 lr_scheduler_kwargs={}, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 max_grad_norm=0.5, fp16=False, bf16=False)


def _two_rank_worker(rank, world_size, out, configs):
    """Each guide config on the harness' toy model (tied, frozen, LayerNorm, biases); training_args as a plain dict
    with TrainingArguments' field names (no transformers in the workers)."""
    from types import SimpleNamespace

    from _engine_harness import batches, build_model, micro_batch
    from safetensors.torch import save_file

    for name in configs:
        model = build_model(0)
        model.config = SimpleNamespace(hidden_size=6)  # what the ZeRO-3 "auto" bucket sizes read
        eng, _, _, _ = engine.initialize(model=model, config=GUIDE / f"{name}.json", training_args=DICT_ARGS)
        micro, gas = DICT_ARGS["per_device_train_batch_size"], DICT_ARGS["gradient_accumulation_steps"]
        losses = []
        for batch in batches(DICT_ARGS["max_steps"], micro * gas * world_size):
            for k in range(gas):
                loss = eng(*micro_batch(batch, k, rank, world_size, micro))
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
        state = eng.fp32_state_dict()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(losses))


def _toy_reference(world_size: int):
    """Plain torch: Trainer's decay rule on the toy model, torch AdamW, get_scheduler("linear"), clipping."""
    from _engine_harness import batches, build_model, micro_batch

    model = build_model(0)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=3)
    micro, gas = DICT_ARGS["per_device_train_batch_size"], DICT_ARGS["gradient_accumulation_steps"]
    losses = {r: [] for r in range(world_size)}
    for batch in batches(3, micro * gas * world_size):
        for k in range(gas):
            for r in range(world_size):
                loss = model(*micro_batch(batch, k, r, world_size, micro))
                (loss / (gas * world_size)).backward()
                losses[r].append(loss.item())
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 0.5)
        opt.step(), sched.step(), opt.zero_grad()
    return losses, {n: t.detach() for n, t in model.state_dict().items()}


def test_guide_configs_on_two_ranks(tmp_path):
    from _engine_harness import launch
    from safetensors.torch import load_file

    launch(_two_rank_worker, 2, tmp_path, CONFIGS)
    ref_losses, ref_state = _toy_reference(2)
    for name in CONFIGS:
        for rank in range(2):
            got = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            assert got == pytest.approx(ref_losses[rank], rel=1e-5, abs=1e-6), (name, rank)
        state = load_file(str(tmp_path / f"{name}.safetensors"))
        assert set(ref_state) - set(state) == {"head.weight"}  # the tied alias of embed.weight
        for n, t in state.items():
            torch.testing.assert_close(t, ref_state[n].float(), rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")


# ---- a real Trainer driving the engine ----------------------------------------------------------------------------

def test_real_trainer_drives_the_engine(tmp_path):
    """transformers.Trainer with ``deepspeed=`` each guide config (plus the batch keys as "auto"), its
    ``deepspeed.initialize`` call answered by ``engine.initialize``: Trainer's own AdamW (accelerate maps it to
    DeepSpeedCPUAdam for the offloading ZeRO-2/3 configs) and its own scheduler, on two gloo ranks, give the losses
    and lrs of the same Trainer without DeepSpeed (DDP)."""
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    pytest.importorskip("deepspeed")
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "runs.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1", "--master_port", str(port), str(Path(__file__).with_name("hf_trainer_engine_script.py")),
           "--out", str(out), "--config", *[str(GUIDE / f"{name}.json") for name in CONFIGS]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runs = json.loads(out.read_text())
    plain = runs.pop("plain")
    assert plain["wrapped"].endswith("DistributedDataParallel") and len(plain["loss"]) == 6
    assert sorted(runs) == sorted(CONFIGS)
    for name, got in runs.items():
        assert got["wrapped"] == "engine.api.Engine", name
        assert got["lr"] == plain["lr"], name
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-6), name


# ---- client optimizers as accelerate hands them over ---------------------------------------------------------------

def _one_step(opt_factory, cfg_extra=None):
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    model = nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(5, 4)
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
           **(cfg_extra or {})}
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt_factory(model.parameters()), config=cfg)
    eng.backward(eng(x).square().mean())
    eng.step()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1, weight_decay=0.5)  # L2, not decoupled
    ref(x).square().mean().backward()
    ref_opt.step()
    return eng.fp32_state_dict(), ref.state_dict()


def test_client_torch_adam_stays_l2_adam():
    got, ref = _one_step(lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5))
    for n, t in ref.items():
        torch.testing.assert_close(got[n], t)


def test_client_deepspeed_cpu_adam_is_adopted():
    """accelerate's map_pytorch_optim_to_deepspeed turns Trainer's AdamW into DeepSpeedCPUAdam when offloading;
    the engine reads its mode and hyper-parameters (a stand-in with the same name and attributes: building the
    real one compiles DeepSpeed's CPU kernel)."""
    class DeepSpeedCPUAdam(torch.optim.Adam):
        def __init__(self, params, adamw_mode=True, **kw):
            super().__init__(params, **kw)
            self.defaults["bias_correction"] = True
            self.adam_w_mode = adamw_mode

    got, ref = _one_step(lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=False, lr=0.1, weight_decay=0.5),
                         {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    for n, t in ref.items():
        torch.testing.assert_close(got[n], t)


def test_steps_per_print_inf_from_accelerate_means_never():
    from engine.config import load_config
    assert load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf")}).steps_per_print is None


def test_model_parameters_flat_or_grouped():
    args = training_arguments(**ARGS)
    model = tiny_llama()
    named = dict(model.named_parameters())
    some = [named["model.norm.weight"], named["lm_head.weight"], named["model.layers.0.self_attn.q_proj.bias"]]
    eng, _, _, _ = engine.initialize(model=model, model_parameters=(p for p in some), config=GUIDE / "zero1.json",
                                     training_args=args)
    assert engine_groups(eng) == [(["lm_head.weight"], 0.1),
                                  (["model.layers.0.self_attn.q_proj.bias", "model.norm.weight"], 0.0)]
    model = tiny_llama()
    groups = ({"params": (p for n, p in model.named_parameters() if "mlp" in n)},
              {"params": [p for n, p in model.named_parameters() if "mlp" not in n], "weight_decay": 0.3})
    eng, _, _, _ = engine.initialize(model=model, model_parameters=groups, config=GUIDE / "zero1.json",
                                     training_args=args)
    assert [wd for _, wd in engine_groups(eng)] == [0.1, 0.3]  # a group without weight_decay takes the argument
