"""transformers' from_pretrained is the judge of "HF-loadable": no missing/unexpected keys, reference logits."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from conftest import FIXTURES

transformers = pytest.importorskip("transformers")


def reference_logits(name: str, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(FIXTURES / name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)  # buffers as from_pretrained
    state = {k: v.to(dtype) for k, v in load_file(str(FIXTURES / name / "reference.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights() if config.tie_word_embeddings else None
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name,dtype,shard", [
    ("z3_bf16_ws2_tied", "bf16", None),
    ("z1_bf16_ws2_untied", "bf16", "20KB"),
    ("z2_fp16_ws2_untied", "fp16", None),
    ("z3_bf16_ws3_untied_g2", "fp32", None),
    ("z2_fp32_ws2_frozen", "bf16", "16KB"),
])
def test_from_pretrained_loads_cleanly_with_reference_logits(tmp_path, name, dtype, shard):
    src = tmp_path / "run"
    shutil.copytree(FIXTURES / name / "ckpt", src)
    shutil.copy(FIXTURES / name / "config.json", src / "config.json")  # as HF Trainer leaves it
    out = tmp_path / "hf"
    zckpt.consolidate(src, out, dtype=dtype, max_shard_size=shard or "5GB")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch_dtype
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert torch.equal(ours, reference_logits(name, torch_dtype, ids))
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_demo_runs(capsys):
    from zckpt.demo import run

    run(engine_steps=30)
    out = capsys.readouterr().out
    assert out.count("identical") == 3 and out.count("missing/unexpected keys: none") == 2
    assert "format       engine" in out and "format       deepspeed 0.19.8" in out
    assert "[engine] load_best_model_at_end: checkpoint-" in out and "complete (engine)" in out
    assert "from checkpoint-6; vs the weights the Trainer held" in out
