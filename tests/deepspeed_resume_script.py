"""Worker for tests/test_deepspeed_native.py, launched by torchrun: real DeepSpeed (gloo, torch_adam) trains a tiny
Llama, optionally after a plain ``engine.load_checkpoint`` and optionally saving on the way.

Every step uses the same global batch whatever the world size: ``GLOBAL_BATCH`` sequences drawn from a generator
seeded by the step number, rank ``r`` taking the ``r``-th equal slice. The logged loss of a step is the mean over
ranks of their micro-batch losses, i.e. the global batch's mean loss, so runs at different world sizes are
comparable step by step.

    torchrun --nproc_per_node 2 deepspeed_resume_script.py --stage 2 --dtype fp32 --steps 5 --save-at 3 \
        --save DIR --out losses.json
    torchrun --nproc_per_node 3 deepspeed_resume_script.py --stage 2 --dtype fp32 --steps 2 --load DIR --out x.json
"""

from __future__ import annotations

import argparse
import json
import os

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4
SEQ_LEN = 16
MODEL_KWARGS = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, tie_word_embeddings=True)


def ds_config(stage: int, dtype: str, world: int, grad_accum_fp32: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if grad_accum_fp32:  # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed picks its BF16_Optimizer
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, required=True, help="steps to run in this process")
    parser.add_argument("--save", help="save dir")
    parser.add_argument("--save-at", type=int, help="save after this many steps of this process")
    parser.add_argument("--load", help="resume from this save dir (plain load_checkpoint)")
    parser.add_argument("--out", required=True, help="JSON with the global losses (rank 0)")
    parser.add_argument("--grad-accum-fp32", action="store_true", help="data_types.grad_accum_dtype fp32")
    args = parser.parse_args()

    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.comm import exit_without_finalizing

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_KWARGS))
    params = [(n, p) for n, p in model.named_parameters()]
    # HF Trainer's split: decay for matrices, none for 1-D parameters (two optimizer groups)
    groups = [{"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                           config=ds_config(args.stage, args.dtype, world, args.grad_accum_fp32))
    first = 0
    if args.load:
        path, _ = engine.load_checkpoint(args.load)
        assert path is not None, f"load_checkpoint found nothing in {args.load}"
        first = engine.global_steps
    micro = GLOBAL_BATCH // world
    losses = []
    for step in range(first, first + args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        batch = torch.randint(0, MODEL_KWARGS["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=gen)
        x = batch[rank * micro:(rank + 1) * micro]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total.item()) / world)
        if args.save and args.save_at == step - first + 1:
            engine.save_checkpoint(args.save)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "first_step": first, "global_steps": engine.global_steps,
                       "lr": [g["lr"] for g in engine.optimizer.param_groups],
                       "optimizer": type(engine.optimizer).__name__}, f)
    torch.distributed.barrier()
    exit_without_finalizing()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
