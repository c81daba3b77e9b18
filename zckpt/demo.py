"""``zckpt demo``: the Quick start's main job on the bundled real-DeepSpeed fixture.

Consolidates ``fixtures/deepspeed/hf_run`` (an HF Trainer output dir holding a ZeRO-3 bf16 run on 2 ranks, written
by DeepSpeed itself) into bf16 safetensors, loads the result with ``transformers``' ``from_pretrained``, and checks
its logits against DeepSpeed's own fp32 reconstruction cast to bf16.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import SourceNotFoundError, ZckptError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "hf_run"


def run(out: Path | None = None) -> None:
    if not FIXTURE.is_dir():
        raise SourceNotFoundError(f"{FIXTURE} is missing: the demo needs a source checkout (pip install -e .)")
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ZckptError(f"the demo needs transformers ({exc}); pip install 'zckpt[hf]'") from None
    from . import consolidate
    from .report import inspect, render

    print(f"$ zckpt inspect {FIXTURE}")
    print(render(inspect(FIXTURE)))
    with tempfile.TemporaryDirectory() as tmp:
        target = out or Path(tmp) / "model-bf16"
        print(f"\n$ zckpt consolidate {FIXTURE} {target}")
        result = consolidate(FIXTURE, target, dtype="bf16", overwrite=out is not None, quiet=True)
        print(f"wrote {result.files} + {result.copied} ({result.parameters:,} parameters, {result.dtype}, "
              f"{result.seconds:.2f}s); tied, written once: {result.tied}")
        model, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        print(f"\ntransformers loaded {type(model).__name__} in {model.dtype}; missing/unexpected keys: "
              f"{problems or 'none'}")
        reference = _reference_model(model, load_file(str(FIXTURE / "reference.safetensors")))
        ids = torch.arange(0, 32).reshape(2, 16) % model.config.vocab_size
        with torch.no_grad():
            ours, ref = model(input_ids=ids).logits, reference(input_ids=ids).logits
        same = torch.equal(ours, ref)
        print(f"logits vs DeepSpeed's zero_to_fp32 reference cast to bf16: "
              f"{'identical' if same else 'DIFFERENT (max abs diff %g)' % (ours - ref).abs().max().item()}")
        if problems or not same:
            raise ZckptError("demo check failed: see above")


def _reference_model(model, state_dict):
    import copy

    import torch

    reference = copy.deepcopy(model)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in state_dict.items()}, strict=False)
    return reference
