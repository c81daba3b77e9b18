"""torchrun worker for tests/test_best_deepspeed.py: CheckpointManager beside a real DeepSpeed engine.

    torchrun --nproc_per_node 2 tests/best_deepspeed_worker.py OUT STAGE

Trains a tiny Llama with DeepSpeed (fp32, ZeRO-STAGE, torch_adam, gloo) for 5 steps, saving through CheckpointManager
after each with a scripted eval metric (best: step 2, a tie at step 4); rank 0 writes the gathered fp32 weights of
every step, then calls load_best and writes the gathered weights again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METRIC = [3.0, 1.0, 2.0, 1.0, 4.0]


def gathered(eng) -> dict:
    import deepspeed

    params = dict(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().clone().float().contiguous() for n, p in params.items()}


def main(out: Path, stage: int) -> None:
    import deepspeed
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from zckpt import CheckpointManager

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                         max_position_embeddings=16, tie_word_embeddings=False))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    manager = CheckpointManager(run_dir=out / "run", metric_for_best_model="eval_loss", save_total_limit=2)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(1, len(METRIC) + 1):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
        weights = gathered(eng)
        if rank == 0:
            save_file(weights, str(out / f"weights-{step}.safetensors"))
        manager.save(eng, step, {"loss": METRIC[step - 1]})
    path = manager.load_best(eng)
    weights = gathered(eng)
    if rank == 0:
        save_file(weights, str(out / "after.safetensors"))
        (out / "result.json").write_text(json.dumps({"best": str(path), "global_steps": eng.global_steps}))
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(Path(sys.argv[1]), int(sys.argv[2]))
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)
