#!/usr/bin/env python
"""Where is the memory peak? Per-phase peak memory of a bf16 Llama trained with the engine (or DeepSpeed), ZeRO 0-2.

    torchrun --nproc_per_node 2 tests/gpu/memory_probe.py --stage 2                       # the 953M bench model
    torchrun --nproc_per_node 2 tests/gpu/memory_probe.py --stage 1 --impl deepspeed       # same, DeepSpeed
    torchrun --nproc_per_node 2 tests/gpu/memory_probe.py --stage 2 --layers 2 --hidden 64  # CPU/gloo smoke check

The model and config are those of ``.gpu/llama_bench.py`` (LlamaForCausalLM, intermediate = 2.75 * hidden, 16 heads,
vocab 32000, micro-batch 4 x 1024, gas 1, clip 1.0, AdamW, reduce/allgather buckets 5e8). Runs ``--steps`` steps and
prints ONE JSON line (rank 0; every number is the max over ranks, in GiB):

* ``init``: ``max_memory_allocated`` up to the end of ``initialize`` and ``memory_allocated`` after it;
* ``forward`` / ``backward`` / ``step``: the peak inside each phase, max over the steps after the first (the first step
  allocates Adam's moments; ``first_step`` reports its phase peaks separately), and what is allocated at the end of it;
* ``buffers``: the engine's own buffers at three points (after init, after backward, after step): compute-dtype
  parameters, fp32 masters, Adam moments, gradient buffers (``FlatParamManager.buffer_bytes()``);
* ``peak_phase``: which phase holds the overall peak.

On a machine without CUDA it runs on gloo/CPU (smaller default ``--seq``/``--mbs`` so it finishes quickly) and the
allocator figures are ``null``: the buffer sizes are still reported, which is what the smoke check is for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GIB = 2**30
CUDA = torch.cuda.is_available()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    p.add_argument("--impl", default="engine", choices=("engine", "deepspeed"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024 if CUDA else 64)
    p.add_argument("--mbs", type=int, default=4 if CUDA else 2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bucket", type=float, default=5e8)
    p.add_argument("--comm", default=None, choices=(None, "fp32", "bf16"),
                   help="communication_data_type (default: unset = the engine's choice, bf16 on NCCL, fp32 on gloo)")
    p.add_argument("--offload", action="store_true", help="offload_optimizer.device = cpu")
    return p.parse_args()


def ds_config(a) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": a.gas, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": a.stage, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": a.bucket, "allgather_bucket_size": a.bucket}}
    if a.comm:
        cfg["communication_data_type"] = a.comm
    if a.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# -- memory readings --------------------------------------------------------------------------------------------
def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak() -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if CUDA else None


def allocated() -> float | None:
    return torch.cuda.memory_allocated() / GIB if CUDA else None


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 1:
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def engine_buffers(eng) -> dict[str, float]:
    """The engine's own buffers on this rank, GiB (storages counted once)."""
    mgr, opt = eng.mgr, eng.optimizer
    inner = opt.inner
    out = {"params": _bytes(getattr(mgr, "full", [])), "masters": _bytes(opt.masters),
           "adam_state": _bytes(v for s in inner.state.values() for v in s.values())}
    if hasattr(mgr, "buffer_bytes"):
        out.update(mgr.buffer_bytes())
    else:  # engines before transient gradient partitions
        out["grad_parts_fp32"] = _bytes(getattr(mgr, "grad_parts", []))
        out["grad_bufs"] = _bytes(getattr(mgr, "grad_bufs", []))
    return {k: round(v / GIB, 4) for k, v in out.items()}


def deepspeed_buffers(eng) -> dict[str, float]:
    """DeepSpeed's ZeRO-1/2 optimizer buffers (attributes its other optimizers lack are left out)."""
    opt = eng.optimizer
    out = {"adam_state": _bytes(v for s in getattr(opt, "optimizer", opt).state.values() for v in s.values())}
    for key, attr in (("params", "bit16_groups_flat"), ("masters", "single_partition_of_fp32_groups")):
        if hasattr(opt, attr):
            out[key] = _bytes(getattr(opt, attr))
    return {k: round(v / GIB, 4) for k, v in out.items()}


def max_over_ranks(values: dict) -> dict:
    """Element-wise max across ranks of the numeric leaves (None stays None)."""
    keys = [k for k, v in values.items() if isinstance(v, (int, float))]
    if not keys or dist.get_world_size() == 1:
        return values
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {**values, **{k: round(float(v), 4) for k, v in zip(keys, t.tolist())}}


# -- the run ----------------------------------------------------------------------------------------------------
def build_model(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                      num_attention_heads=16, vocab_size=a.vocab, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def main() -> None:
    a = parse_args()
    if a.impl == "deepspeed":
        import deepspeed as lib
    else:
        import engine as lib
    backend = "nccl" if CUDA else "gloo"
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    model = build_model(a)
    nparams = sum(p.numel() for p in model.parameters())
    reset_peak()
    eng, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=ds_config(a))
    sync()
    buffers = engine_buffers if a.impl == "engine" else deepspeed_buffers
    report = {"init_peak": peak(), "init_allocated": allocated()}
    snap = {"after_init": buffers(eng)}
    device = torch.device("cuda") if CUDA else torch.device("cpu")
    phases: list[dict] = []
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    for step in range(a.steps):
        row = {}
        for _ in range(a.gas):
            ids = torch.randint(0, a.vocab, (a.mbs, a.seq), generator=g).to(device)
            sync(); reset_peak()
            loss = eng(input_ids=ids, labels=ids).loss
            sync(); row["forward"] = max(row.get("forward") or 0.0, peak() or 0.0) if CUDA else None
            row["forward_end"] = allocated()
            reset_peak()
            eng.backward(loss)
            sync(); row["backward"] = max(row.get("backward") or 0.0, peak() or 0.0) if CUDA else None
            row["backward_end"] = allocated()
            if step == a.steps - 1:
                snap["after_backward"] = buffers(eng)
            reset_peak()
            eng.step()
            sync(); row["step"] = max(row.get("step") or 0.0, peak() or 0.0) if CUDA else None
            row["step_end"] = allocated()
        row["loss"] = loss.detach().float().item()
        phases.append(row)
    snap["after_step"] = buffers(eng)

    def worst(rows, key):
        vals = [r[key] for r in rows if r[key] is not None]
        return round(max(vals), 4) if vals else None

    later = phases[1:] or phases
    for key in ("forward", "backward", "step", "forward_end", "backward_end", "step_end"):
        report[key] = worst(later, key)
        report[f"first_step_{key}"] = worst(phases[:1], key)
    report = max_over_ranks(report)
    snaps = {k: max_over_ranks(v) for k, v in snap.items()}
    if rank == 0:
        peaks = {k: report[k] for k in ("init_peak", "forward", "backward", "step", "first_step_forward",
                                        "first_step_backward", "first_step_step")}
        known = {k: v for k, v in peaks.items() if v is not None}
        out = {"impl": a.impl, "stage": a.stage, "device": "cuda" if CUDA else "cpu", "world": dist.get_world_size(),
               "params_M": round(nparams / 1e6, 1), "gas": a.gas, "offload": a.offload, "comm": a.comm,
               "seq": a.seq, "mbs": a.mbs, "layers": a.layers, "hidden": a.hidden, "unit": "GiB",
               "peak_phase": max(known, key=known.get) if known else None,
               "peak_GiB": max(known.values()) if known else None,
               **report, "buffers": snaps, "losses": [round(r["loss"], 4) for r in phases]}
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
