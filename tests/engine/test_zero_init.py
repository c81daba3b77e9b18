"""transformers models built under ``engine.zero.Init`` get HF's weight init, bit for bit.

Without help, ``post_init`` -> ``_init_weights`` would run on empty (already partitioned) parameters and the model
would keep PyTorch's default init (a tied Llama then starts at loss ~61 instead of ~ln(vocab)). One spawned pair of
gloo ranks builds the models under ``Init`` with seed 0; the parent builds the same models in one process without
``Init`` and compares: every gathered parameter bit-identical, the global RNG advanced identically, the patch undone
on exit, and a stage-3 engine built from the partitions starting from the same loss.

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
        with engine.zero.Init(config=STAGE3):
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
    (out / f"report.rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("zero_init")
    launch(build_under_init, 2, out)
    reports = [json.loads((out / f"report.rank{r}.json").read_text()) for r in range(2)]
    states = {(name, r): load_file(str(out / f"{name}.rank{r}.safetensors")) for name in BUILDERS for r in range(2)}
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
