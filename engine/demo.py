"""Train a tiny causal LM with the engine (ZeRO-3, built under ``engine.zero.Init``) on synthetic data; the Quick
start's main job.

    torchrun --nproc_per_node 2 -m engine.demo --out /tmp/run

The data is made here: sequences that count upwards modulo the vocabulary from a random start, so the model can
learn "next token = this token + 1" and the loss visibly falls. Each rank trains on its own slice of every global
batch. Every 10 steps it evaluates on a fixed batch of the same task never trained on and saves through
:class:`zckpt.CheckpointManager` (``metric_for_best_model="loss"``, ``save_total_limit=2``) to
``<out>/run/checkpoint-N/`` (engine-native tag, ``trainer_state.json``, the model's ``config.json``) as HF Trainer
lays them out; at the end it loads the best checkpoint's weights into the running engine (``load_best_model_at_end``)
and evaluates again. Rank 0 then writes the gathered fp32 weights (``<out>/final_fp32.safetensors``: the best's), the
losses and the eval batch (``<out>/train.json``: ``losses``, ``eval_ids``, ``best``) for ``zckpt demo`` to check
against; it reads these files and never imports the engine.
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


def evaluate(model_engine, eval_ids) -> float:
    """Collective (ZeRO-3 gathers in forward). Loss on the held-out batch; every rank runs the same batch."""
    import torch

    with torch.no_grad():
        ids = eval_ids.to(model_engine.device)
        return model_engine(input_ids=ids, labels=ids).loss.item()


def _step(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


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
    # (post_init) runs on them gathered, one module at a time; same values as a plain build with this seed on the
    # engine's device (zero.Init builds there; match_cpu_build=True for the plain CPU build's values).
    with engine.zero.Init(config=ds_config, enabled=args.stage == 3):
        config, model = build_model()
    model_engine, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    from zckpt import CheckpointManager

    run_dir = args.out / "run"
    # TrainingArguments' names: eval every 10 steps, keep 2 checkpoints, load the best (lowest eval_loss) at the end
    manager = CheckpointManager(run_dir=run_dir, metric_for_best_model="loss", save_total_limit=2)
    eval_ids = synthetic_batch(torch.Generator().manual_seed(99), 8)  # one fixed held-out batch
    data = torch.Generator().manual_seed(1234)
    losses, evals = [], {}
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
        if step % 10 == 0 or step == args.steps:
            eval_loss = evals[step] = evaluate(model_engine, eval_ids)
            folder = manager.save(model_engine, step, {"eval_loss": eval_loss})
            if rank == 0:
                config.to_json_file(str(folder / "config.json"))  # as HF Trainer's checkpoints: loadable folders
                print(f"[engine] step {step:3d}  eval_loss {eval_loss:.4f}  saved {folder.name}; kept: "
                      f"{', '.join(sorted((p.name for p in run_dir.glob('checkpoint-*')), key=_step))}", flush=True)
    best = manager.load_best(model_engine)  # load_best_model_at_end: into this engine, no rebuild
    again = evaluate(model_engine, eval_ids)
    if rank == 0:
        print(f"[engine] load_best_model_at_end: {best.name} (eval_loss {evals[_step(best.name)]:.4f}); eval_loss "
              f"of the weights now in the engine: {again:.4f}", flush=True)
    with engine.zero.GatheredParameters(list(model.parameters())):
        full = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    if rank == 0:
        save_file(full, str(args.out / "final_fp32.safetensors"))
        (args.out / "train.json").write_text(json.dumps({"losses": losses, "eval_ids": eval_ids.tolist(),
                                                         "world_size": world, "stage": args.stage,
                                                         "best": str(best)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)
