"""Train a small Llama with DeepSpeed or with our engine; launched by torchrun (gloo on CPU, NCCL on GPUs).

    torchrun --nproc_per_node 2 tests/engine/llama_train_script.py --impl engine --stage 3 --out /tmp/o

Writes ``<out>/losses.rank<r>.json`` (per-step loss, per-step wall time) and, from rank 0,
``<out>/weights.safetensors`` (final full fp32 weights). Used by tests/engine/test_vs_deepspeed.py (equivalence)
and tests/benchmarks/bench_engine_step.py (median step time). Same model init (seed 0), same data (seed 1234),
same config dict for both implementations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, max_position_embeddings=64),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4000, max_position_embeddings=256),
    # the GPU benchmarks' model (tests/gpu/save_bench.py defaults, tied embeddings here): about 0.95B parameters
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024),
}


def config(stage: int, dtype: str, micro: int, clip: float, zero_extra: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True, **(zero_extra or {})},
        "steps_per_print": 10**6, "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(tie_word_embeddings=True, **SIZES[args.size])
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg), cfg.vocab_size


def full_weights(impl, eng, model):
    """Final fp32 weights, full, on rank 0 (None elsewhere)."""
    import torch

    if impl == "engine":
        return eng.fp32_state_dict()
    import deepspeed

    out = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[name] = p.detach().float().cpu().clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["engine", "deepspeed"], required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--no-weights", action="store_true")
    ap.add_argument("--zero-json", default=None, help="extra zero_optimization keys, as JSON")
    ap.add_argument("--ds-json", default=None, help="extra top-level config keys, as JSON (e.g. "
                    '\'{"checkpoint": {"load_universal": true}}\')')
    ap.add_argument("--load", default=None, help="load_checkpoint(DIR) before training (resume)")
    ap.add_argument("--start-step", type=int, default=0, help="skip this many global batches of the data stream")
    ap.add_argument("--save", default=None, help="save_checkpoint(DIR) after training")
    args = ap.parse_args()

    import torch
    if args.impl == "deepspeed":
        import deepspeed as lib
        lib.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    else:
        import engine as lib
        lib.init_distributed()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model, vocab = build(args)
    cfg = config(args.stage, args.dtype, args.micro, args.clip, json.loads(args.zero_json) if args.zero_json else None)
    cfg.update(json.loads(args.ds_json) if args.ds_json else {})
    eng, _, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if args.load:
        eng.load_checkpoint(args.load)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1234)
    for _ in range(args.start_step):  # the global batches an earlier run trained on (same global batch size)
        torch.randint(0, vocab, (args.micro * world, args.seq), generator=g)
    losses, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.micro * world, args.seq), generator=g)
        mine = ids[rank * args.micro:(rank + 1) * args.micro].to(device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = eng(input_ids=mine, labels=mine).loss
        eng.backward(loss)
        eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    save_s = None
    if args.save:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        eng.save_checkpoint(args.save)
        dist.barrier()
        save_s = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses.rank{rank}.json").write_text(json.dumps({
        "losses": losses, "times": times, "median_step_s": statistics.median(times[1:] or times),
        "save_s": save_s}))
    if not args.no_weights:
        weights = full_weights(args.impl, eng, model)
        if rank == 0:
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)  # both implementations: the gloo teardown race at interpreter exit
