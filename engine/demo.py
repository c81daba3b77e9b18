"""Train a tiny causal LM with the engine (ZeRO-3, built under ``engine.zero.Init``) on synthetic data; the Quick
start's main job.

    torchrun --nproc_per_node 2 -m engine.demo --out /tmp/run

The data is made here: sequences that count upwards modulo the vocabulary from a random start, so the model can
learn "next token = this token + 1" and the loss visibly falls. Each rank trains on its own slice of every global
batch. Checkpoints go to ``<out>/checkpoints`` (engine-native format, one set of files per rank), next to the
model's ``config.json`` as HF Trainer lays them out; rank 0 also writes the gathered fp32 weights
(``<out>/final_fp32.safetensors``), the losses and a fresh batch of the same task never trained on
(``<out>/train.json``: ``losses``, ``eval_ids``) for ``zckpt demo`` to check against; it reads these files and
never imports the engine.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

VOCAB = 128
SEQ = 32


def synthetic_batch(generator, batch: int):
    import torch

    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    return (start + torch.arange(SEQ)) % VOCAB


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    return config, LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    import engine

    engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9,
    }
    torch.manual_seed(0)
    # ZeRO-3 from construction: each module's parameters are partitioned as soon as it is built, and HF's weight init
    # (post_init) runs on them gathered, one module at a time; same values as a plain build with this seed.
    with engine.zero.Init(config=ds_config, enabled=args.stage == 3):
        config, model = build_model()
    model_engine, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    save_dir = args.out / "checkpoints"
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(save_dir / "config.json"))
    data = torch.Generator().manual_seed(1234)
    losses = []
    for step in range(1, args.steps + 1):
        batch = synthetic_batch(data, 8 * world)[rank * 8:(rank + 1) * 8].to(model_engine.device)
        loss = model_engine(input_ids=batch, labels=batch).loss
        model_engine.backward(loss)
        model_engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(round(mean.item() / world, 4))
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"[engine] step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        if step % 20 == 0 or step == args.steps:
            model_engine.save_checkpoint(str(save_dir))
    with engine.zero.GatheredParameters(list(model.parameters())):
        full = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    if rank == 0:
        save_file(full, str(args.out / "final_fp32.safetensors"))
        eval_ids = synthetic_batch(torch.Generator().manual_seed(99), 8).tolist()
        (args.out / "train.json").write_text(json.dumps({"losses": losses, "eval_ids": eval_ids,
                                                         "world_size": world, "stage": args.stage}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)
