#!/usr/bin/env python
"""GPU smoke test of the engine: a few steps of a small Llama with ZeRO stages 0-3 on NCCL, then a checkpoint
round trip.

    torchrun --nproc_per_node 2 tests/gpu/engine_smoke.py [--dtype bf16] [--steps 6] [--size small] [--out DIR]
                                                          [--no-zero-init]

Stage 3 builds the model under ``engine.zero.Init`` (HF's init runs on gathered weights, so the model is the same
as a plain build). Prints, per stage, the losses, the median step time, peak GPU memory, and whether a save/load
round trip restored the fp32 masters bit-exactly. Exits non-zero on any failure. Expects CUDA (the engine then picks
NCCL and cuda:LOCAL_RANK by itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024),
}


def config(stage: int, dtype: str, micro: int, offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10_000,
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "steps_per_print": 10**6}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def same_as_plain_build(model, mcfg) -> bool:
    """Gathered, ``model`` (built under zero.Init's default local path with seed 0) equals a plain build with seed 0
    on the rank's GPU (where that path builds) cast to the Init dtype (bf16 under a bf16 config), bit for bit."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda", torch.cuda.current_device()):
        plain = dict(LlamaForCausalLM(mcfg).named_parameters())
    with engine.zero.GatheredParameters(list(model.parameters())):
        return all(torch.equal(p.detach(), plain[n].to(p.dtype)) for n, p in model.named_parameters())


def run_stage(stage: int, args, ckpt_root: Path, offload: bool = False) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = LlamaConfig(tie_word_embeddings=True, **SIZES[args.size])
    cfg = config(stage, args.dtype, args.micro, offload)
    zero_init = stage == 3 and args.zero_init
    torch.manual_seed(0)
    # Stage 3 builds under zero.Init (HF's post_init still runs on gathered weights: same init as a plain build).
    with engine.zero.Init(config_dict_or_path=cfg, enabled=zero_init):
        model = LlamaForCausalLM(mcfg)
    if zero_init:
        if not same_as_plain_build(model, mcfg):
            raise SystemExit("stage 3: the model built under zero.Init differs from a plain build with the same seed")
        if rank == 0:
            print("stage 3: model built under zero.Init == plain build with the same seed, bit for bit", flush=True)
    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    device = eng.device
    torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(1234)
    losses, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, mcfg.vocab_size, (args.micro * world, args.seq), generator=g)
        mine = ids[rank * args.micro:(rank + 1) * args.micro].to(device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = eng(input_ids=mine, labels=mine).loss
        eng.backward(loss)
        eng.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    before = eng.fp32_state_dict()
    eng.save_checkpoint(ckpt_root / f"s{stage}")
    eng.load_checkpoint(ckpt_root / f"s{stage}")
    after = eng.fp32_state_dict()
    exact = all(torch.equal(before[k], after[k]) for k in before)
    if rank == 0:
        print(f"stage {stage}{' + optimizer offload' if offload else ''} [{eng.ctx.backend}, {device}, {args.dtype}]: losses "
              f"{' '.join(f'{x:.4f}' for x in losses)} | median step {1000 * statistics.median(times[1:]):.1f} ms | "
              f"peak mem {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB | ckpt round trip exact: {exact}",
              flush=True)
    if not exact or not all(l == l for l in losses):
        raise SystemExit(f"stage {stage} failed")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=True,
                    help="build the stage-3 model under engine.zero.Init (default; --no-zero-init builds it whole "
                         "on every rank and partitions it in initialize())")
    ap.add_argument("--offload", action="store_true",
                    help="also run each stage with offload_optimizer=cpu; its losses must match the device run's "
                         "(relative 2e-3: host fused AdamW vs CUDA fused AdamW round differently)")
    ap.add_argument("--out", default=None, help="checkpoint directory (default: a temp dir)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_smoke.py needs CUDA GPUs")
    ctx = engine.init_distributed()
    root = Path(args.out) if args.out else Path(engine.comm.broadcast_json(
        tempfile.mkdtemp(prefix="engine-smoke-") if ctx.rank == 0 else None))
    for stage in args.stages:
        losses = run_stage(stage, args, root)
        if args.offload:
            off = run_stage(stage, args, root, offload=True)
            worst = max(abs(a - b) / abs(a) for a, b in zip(losses, off))
            if ctx.rank == 0:
                print(f"stage {stage}: offload vs device losses, worst relative difference {worst:.2e}", flush=True)
            if worst > 2e-3:
                raise SystemExit(f"stage {stage}: offloaded losses differ from the device run's")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
