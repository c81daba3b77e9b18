"""transformers models built under ``engine.zero.Init`` get HF's weight init, bit for bit.

``Init`` has two build paths; both are tested here on two gloo ranks. ``match_cpu_build=True`` (CPU build, rank 0's
values broadcast) is the reference the tests below compare bit for bit; the default *local* path (each rank builds
on its device from rank 0's generator states and keeps its own slice: no broadcast) is tested at the end of the module
-- on the CPU its device is the CPU, so it too must equal the plain CPU build bit for bit.

Without help, ``post_init`` -> ``_init_weights`` would run on empty (already partitioned) parameters and the model
would keep PyTorch's default init (a tied Llama then starts at loss ~61 instead of ~ln(vocab)). One spawned pair of
gloo ranks builds the models under ``Init`` with seed 0; the parent builds the same models in one process without
``Init`` and compares: every gathered parameter bit-identical, the global RNG advanced identically, the patch undone
on exit, and a stage-3 engine built from the partitions starting from the same loss.

The same workers then build under a bf16 config (parameters cast to bf16 after their init: ``plain.to(bf16)``
values; integer parameters and buffers untouched) and with an explicit ``dtype=`` (which wins over the config), and
train a bf16 stage-3 engine from the bf16 partitions (fp32 masters = the bf16 values, first loss = a plain bf16
forward). The dtype rule itself (DeepSpeed's ``_set_dtype``) is tested without processes.

This module must not import transformers at import time: the workers import it first *inside* the ``Init`` context
(as ``engine/demo.py`` does), which is the harder case (the classes are created while the context is active).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from _engine_harness import launch

VOCAB = 128
STAGE3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6}
BF16 = {**STAGE3, "bf16": {"enabled": True}}


class WithInts(nn.Module):
    """Float and integer parameters in one module, float and integer buffers."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 3))
        self.offsets = nn.Parameter(torch.arange(300, 305), requires_grad=False)  # > 256: not exact in bf16
        self.register_buffer("scale", torch.full((3,), 1.1))
        self.register_buffer("count", torch.tensor(3))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def child_writing_model():
    """A model whose ``_init_weights(block)`` writes a *child's* parameter (``block.proj.weight``), as ~80 HF models
    do (``_init_weights(attention)`` setting ``attention.q_proj.weight``)."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.zeros(8))

    class Net(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.block = Block()
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, Block):
                nn.init.constant_(module.proj.weight, 0.5)
                nn.init.normal_(module.scale)

    return Net(PretrainedConfig())


BUILDERS = {"llama": tiny_llama, "child_writing": child_writing_model}


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _full_state(engine, model) -> dict[str, torch.Tensor]:
    with engine.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def build_under_init(rank: int, world_size: int, out: Path) -> None:
    import engine

    first_import_inside = "transformers" not in sys.modules
    report = {"first_import_inside": first_import_inside}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        with engine.zero.Init(config=STAGE3, match_cpu_build=True):
            model = build()
        report[f"{name}.rng_after"] = torch.rand(4).tolist()
        report[f"{name}.partitioned"] = all(p.numel() == 0 for p in model.parameters())
        save_file(_full_state(engine, model), str(out / f"{name}.rank{rank}.safetensors"))
        if name == "llama":
            llama = model
    from transformers.modeling_utils import PreTrainedModel

    report["patch_undone"] = not getattr(PreTrainedModel._initialize_weights, "_zero_wrapped", False)
    with engine.zero.GatheredParameters(list(llama.parameters())):
        report["llama.loss"] = llama(input_ids=batch(), labels=batch()).loss.item()
    eng, *_ = engine.initialize(model=llama, model_parameters=llama.parameters(), config=STAGE3)
    loss = eng(input_ids=batch(), labels=batch()).loss
    eng.backward(loss)
    eng.step()
    report["engine.first_loss"] = loss.item()
    report.update(build_with_dtypes(engine, rank, out))
    (out / f"report.rank{rank}.json").write_text(json.dumps(report))


def build_with_dtypes(engine, rank: int, out: Path) -> dict:
    """Init's dtype: a bf16 config, an explicit dtype over it, integer tensors; a bf16 stage-3 engine on top."""
    report = {}
    for name, build, init_kw in (("llama_bf16", tiny_llama, {"config": BF16}),
                                 ("llama_fp16_explicit", tiny_llama, {"config": BF16, "dtype": torch.float16}),
                                 ("ints_bf16", WithInts, {"config": BF16})):
        torch.manual_seed(0)
        with engine.zero.Init(**init_kw, match_cpu_build=True):
            model = build()
        state = _full_state(engine, model)
        state.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
        save_file(state, str(out / f"{name}.rank{rank}.safetensors"))
        if name == "llama_bf16":
            llama = model
    torch.manual_seed(0)
    plain = tiny_llama().to(torch.bfloat16)
    with torch.no_grad():
        report["bf16.plain_loss"] = plain(input_ids=batch(), labels=batch()).loss.item()
    eng, *_ = engine.initialize(model=llama, model_parameters=llama.parameters(), config=BF16)
    masters = eng.fp32_state_dict()
    save_file({n: masters[n] for n, _ in llama.named_parameters()}, str(out / f"bf16_masters.rank{rank}.safetensors"))
    loss = eng(input_ids=batch(), labels=batch()).loss
    eng.backward(loss)
    eng.step()
    report["bf16.engine_first_loss"] = loss.item()
    return report


DTYPE_BUILDS = ("llama_bf16", "llama_fp16_explicit", "ints_bf16", "bf16_masters")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("zero_init")
    launch(build_under_init, 2, out)
    reports = [json.loads((out / f"report.rank{r}.json").read_text()) for r in range(2)]
    states = {(name, r): load_file(str(out / f"{name}.rank{r}.safetensors"))
              for name in (*BUILDERS, *DTYPE_BUILDS) for r in range(2)}
    return reports, states


def reference(name: str):
    """The plain build (no ``Init``, one process) and the next draw of the global RNG after it."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = BUILDERS[name]()
    return model, torch.rand(4).tolist()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_init_weights_are_bit_identical_to_a_plain_build(built, name):
    reports, states = built
    model, rng_after = reference(name)
    want = {n: p.detach() for n, p in model.named_parameters()}
    for rank in range(2):
        got = states[(name, rank)]
        assert sorted(got) == sorted(want)
        for n, w in want.items():
            assert torch.equal(got[n], w), f"rank {rank}: {n} differs from the build without zero.Init"
        assert reports[rank][f"{name}.partitioned"]
        assert reports[rank][f"{name}.rng_after"] == rng_after  # same RNG consumption, on every rank


def test_reference_is_hf_init_not_torch_default():
    """Guards the comparison above: the plain build really carries HF's init (else both could be PyTorch's)."""
    model, _ = reference("llama")
    std = model.config.initializer_range
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert p.std().item() == pytest.approx(std, rel=0.1), n
    net, _ = reference("child_writing")
    assert torch.equal(net.block.proj.weight, torch.full((8, 8), 0.5))


def test_initial_loss_is_ln_vocab_and_the_engine_starts_there(built):
    reports, _ = built
    model, _ = reference("llama")
    with torch.no_grad():
        want = model(input_ids=batch(), labels=batch()).loss.item()
    assert want == pytest.approx(math.log(VOCAB), abs=0.05)
    for report in reports:
        assert report["llama.loss"] == pytest.approx(want, rel=1e-5)
        assert report["engine.first_loss"] == pytest.approx(want, rel=1e-5)


def test_transformers_imported_inside_the_context_and_patch_undone(built):
    reports, _ = built
    assert all(r["first_import_inside"] and r["patch_undone"] for r in reports)


# -- Init's dtype ------------------------------------------------------------------------------------------------
def _cast(state: dict, dtype: torch.dtype) -> dict:
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}


@pytest.mark.parametrize("name,dtype", [("llama_bf16", torch.bfloat16), ("llama_fp16_explicit", torch.float16)])
def test_config_dtype_casts_partitions_to_plain_values(built, name, dtype):
    """bf16 config: partitions hold ``plain.to(bf16)``; an explicit ``dtype=float16`` wins over the bf16 config.
    The init ran in fp32 (rounded once afterwards), so the values are the plain build's, not a bf16 init's."""
    _, states = built
    model, _ = reference("llama")
    want = _cast({n: p.detach() for n, p in model.named_parameters()}, dtype)
    want.update({f"buffer:{n}": b for n, b in model.named_buffers()})  # buffers keep their dtype
    for rank in range(2):
        got = states[(name, rank)]
        assert sorted(got) == sorted(want)
        for n, w in want.items():
            assert got[n].dtype == w.dtype and torch.equal(got[n], w), (rank, n)


def test_integer_parameters_and_buffers_are_untouched(built):
    _, states = built
    torch.manual_seed(0)
    plain = WithInts()
    for rank in range(2):
        got = states[("ints_bf16", rank)]
        assert got["weight"].dtype == torch.bfloat16 and torch.equal(got["weight"], plain.weight.detach().bfloat16())
        assert got["offsets"].dtype == torch.int64 and got["offsets"].tolist() == [300, 301, 302, 303, 304]
        assert got["buffer:scale"].dtype == torch.float32 and torch.equal(got["buffer:scale"], plain.scale)
        assert got["buffer:count"].dtype == torch.int64 and got["buffer:count"].item() == 3


def test_bf16_engine_masters_are_the_bf16_values_and_first_loss_is_plain(built):
    """As DeepSpeed's stage 3 builds its fp32 partitions from the 16-bit ones: masters = fp32(bf16 values)."""
    reports, states = built
    model, _ = reference("llama")
    for rank in range(2):
        for n, p in model.named_parameters():
            assert torch.equal(states[("bf16_masters", rank)][n], p.detach().bfloat16().float()), (rank, n)
        assert reports[rank]["bf16.engine_first_loss"] == reports[rank]["bf16.plain_loss"]


CONFIG_DTYPES = [  # (config, dtype=) -> what DeepSpeed's _set_dtype picks
    ({}, None, torch.float32),
    ({"bf16": {"enabled": True}}, None, torch.bfloat16),
    ({"fp16": {"enabled": True}}, None, torch.float16),
    ({"bfloat16": {"enabled": True}}, None, torch.bfloat16),  # legacy key
    ({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, None, torch.float32),  # "bf16" read first
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, None, torch.float32),
    ({"bf16": {"enabled": True}}, torch.float16, torch.float16),  # explicit dtype wins
    ({"fp16": {"enabled": True}}, torch.float32, torch.float32),
]


@pytest.mark.parametrize("config,dtype,want", CONFIG_DTYPES)
def test_init_dtype_rule(config, dtype, want):
    from engine.zero.init import init_dtype

    assert init_dtype({**STAGE3, **config}, dtype) == want


def test_init_dtype_sources_and_errors(tmp_path):
    from engine.config import ConfigError, load_config
    from engine.zero import Init
    from engine.zero.init import init_dtype

    assert init_dtype(None, None) is None  # no config, no dtype: the model's own dtype is kept
    assert init_dtype(None, torch.bfloat16) == torch.bfloat16
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BF16))
    assert init_dtype(str(path)) == init_dtype(path) == torch.bfloat16
    assert init_dtype(load_config(BF16)) == torch.bfloat16  # a typed EngineConfig
    # DeepSpeed: ``config`` replaces ``config_dict_or_path``
    assert Init(config_dict_or_path={"fp16": {"enabled": True}}, config=BF16).dtype == torch.bfloat16
    assert Init(config_dict_or_path={"fp16": {"enabled": True}}).dtype == torch.float16
    with pytest.raises(ConfigError, match="at most one"):
        init_dtype({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="auto"):
        init_dtype({"bf16": {"enabled": "auto"}})
    with pytest.raises(ValueError, match="float64"):
        init_dtype(BF16, torch.float64)
    with pytest.raises(ConfigError, match="dict, a path"):
        init_dtype(42)


@pytest.mark.deepspeed
@pytest.mark.parametrize("config,dtype,want", CONFIG_DTYPES)
def test_init_dtype_rule_is_deepspeeds(config, dtype, want):
    """Against the installed DeepSpeed's own InsertPostInitMethodToModuleSubClasses._set_dtype."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    from conftest import skip_unless_deepspeed_fp16
    from engine.zero.init import init_dtype

    if (config.get("fp16") or {}).get("enabled") is True or torch.float16 in (dtype, want):
        skip_unless_deepspeed_fp16()
    probe = object.__new__(InsertPostInitMethodToModuleSubClasses)
    InsertPostInitMethodToModuleSubClasses._set_dtype(probe, DeepSpeedConfig({**STAGE3, **config}), dtype)
    assert probe.dtype == want == init_dtype({**STAGE3, **config}, dtype)


# -- the default (local) build path --------------------------------------------------------------------------------
class RankValued(nn.Module):
    """A module whose init depends on the rank: the local path's ranks would keep slices of different models."""

    def __init__(self):
        super().__init__()
        import torch.distributed as dist

        self.weight = nn.Parameter(torch.full((6,), float(dist.get_rank())))


def build_locally(rank: int, world_size: int, out: Path) -> None:
    """The local path: broadcasts counted (only the generator states may go), seeds equal and unequal across ranks,
    a rank-dependent init refused; the exact path alongside for the broadcast count."""
    import engine
    from engine import comm
    from engine.zero.init import InitDivergedError

    report, counted = {}, []
    orig = comm.broadcast_

    def counting(tensor, src=0):
        counted.append(tensor.numel())
        return orig(tensor, src)
    comm.broadcast_ = counting
    try:
        for label, seed, kw in (("local", 0, {}), ("local_bf16", 0, {"config": BF16}),
                                ("local_seed_by_rank", rank, {}), ("exact", 0, {"match_cpu_build": True})):
            counted.clear()
            torch.manual_seed(seed)
            with engine.zero.Init(**{"config": STAGE3, **kw}):
                model = tiny_llama()
            report[f"{label}.broadcasts"] = list(counted)
            report[f"{label}.rng_after"] = torch.rand(4).tolist()
            report[f"{label}.partitioned"] = all(p.numel() == 0 for p in model.parameters())
            save_file(_full_state(engine, model), str(out / f"{label}.rank{rank}.safetensors"))
    finally:
        comm.broadcast_ = orig
    report["rng_state_numel"] = torch.get_rng_state().numel()
    try:
        with engine.zero.Init(config=STAGE3):
            RankValued()
        report["diverged"] = None
    except InitDivergedError as exc:
        report["diverged"] = str(exc)
    (out / f"local.rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def built_locally(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("zero_init_local")
    launch(build_locally, 2, out)
    reports = [json.loads((out / f"local.rank{r}.json").read_text()) for r in range(2)]
    states = {(label, r): load_file(str(out / f"{label}.rank{r}.safetensors"))
              for label in ("local", "local_bf16", "local_seed_by_rank", "exact") for r in range(2)}
    return reports, states


@pytest.mark.parametrize("label,dtype", [("local", None), ("local_bf16", torch.bfloat16),
                                         ("local_seed_by_rank", None)])
def test_local_path_slices_form_the_plain_build(built_locally, label, dtype):
    """Every rank's slices together (gathered on each rank) are the plain build with rank 0's seed on the build
    device (the CPU here), bit for bit -- also when rank 1 was seeded differently."""
    _, states = built_locally
    model, _ = reference("llama")
    want = {n: p.detach() for n, p in model.named_parameters()}
    want = _cast(want, dtype) if dtype is not None else want
    for rank in range(2):
        got = states[(label, rank)]
        assert sorted(got) == sorted(want)
        for n, w in want.items():
            assert got[n].dtype == w.dtype and torch.equal(got[n], w), (label, rank, n)


def test_local_path_broadcasts_no_module(built_locally):
    """Only the generator state goes over the wire (once, at entry); the exact path broadcasts every module."""
    reports, _ = built_locally
    for r in reports:
        assert r["local.broadcasts"] == [r["rng_state_numel"]]
        assert r["local_bf16.broadcasts"] == [r["rng_state_numel"]]
        assert len(r["exact.broadcasts"]) > 10 and r["rng_state_numel"] not in r["exact.broadcasts"]
        assert r["local.partitioned"] and r["local_seed_by_rank.partitioned"]


def test_local_path_generators_advance_as_a_plain_build(built_locally):
    """Rank 0 (and any rank seeded like it) continues after the build as a plain build leaves the generator; a
    rank seeded differently gets its own generator back, unadvanced."""
    reports, _ = built_locally
    _, rng_after = reference("llama")
    for r in reports:
        assert r["local.rng_after"] == r["exact.rng_after"] == rng_after
    assert reports[0]["local_seed_by_rank.rng_after"] == rng_after
    torch.manual_seed(1)
    assert reports[1]["local_seed_by_rank.rng_after"] == torch.rand(4).tolist()


def test_local_path_refuses_ranks_that_computed_different_values(built_locally):
    reports, _ = built_locally
    for r in reports:
        assert r["diverged"] and "match_cpu_build=True" in r["diverged"]
