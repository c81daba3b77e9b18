#!/usr/bin/env python
"""Stage-3 offload, CPU against NVMe: step time, peak GPU memory, host memory, bytes in the NVMe files (engine).
bf16 Llama on NCCL GPUs (gloo on CPU, fp32, with --cpu to try it tiny).

    torchrun --nproc_per_node 2 tests/gpu/nvme_bench.py --param cpu --optim cpu
    torchrun --nproc_per_node 2 tests/gpu/nvme_bench.py --param nvme --optim nvme --nvme /local_nvme/zckpt
    torchrun --nproc_per_node 2 tests/gpu/nvme_bench.py --cpu --layers 2 --hidden 64 --seq 32 --mbs 2 \\
        --param nvme --optim nvme --nvme /tmp/nvme

Times are barrier to barrier on every rank; medians of the steps after the first two. ``rss_GiB``: the rank's resident
host memory after the last step (``VmRSS``); ``rss_peak_GiB``: its peak over the run (``VmHWM``, includes the model
build); ``nvme_GB``: the rank's offload files on disk. Prints one JSON line (rank 0, maxima over ranks) last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench_common import init_process_group, report_and_exit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--param", default="cpu", choices=["none", "cpu", "nvme"], help="offload_param.device")
    p.add_argument("--optim", default="cpu", choices=["none", "cpu", "nvme"], help="offload_optimizer.device")
    p.add_argument("--nvme", default="/tmp/zckpt-nvme", help="nvme_path (a folder on the NVMe drive)")
    p.add_argument("--buffer-count", type=int, default=5)
    p.add_argument("--buffer-size", type=float, default=1e8)
    p.add_argument("--sub-group-size", type=float, default=1e9)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32, for trying the script small")
    return p.parse_args()


def _config(a) -> dict:
    def sub(dev):
        return {"device": dev, "pin_memory": not a.cpu, **({"nvme_path": a.nvme} if dev == "nvme" else {})}
    zero = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e8, "sub_group_size": int(a.sub_group_size)}
    if a.param != "none":
        zero["offload_param"] = {**sub(a.param), "buffer_count": a.buffer_count, "buffer_size": int(a.buffer_size)}
    if a.optim != "none":
        zero["offload_optimizer"] = sub(a.optim)
    ds = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
          "zero_optimization": zero}
    if not a.cpu:
        ds["bf16"] = {"enabled": True}
    return ds


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _sync(a) -> None:
    if not a.cpu:
        torch.cuda.synchronize()
    dist.barrier()


def _max_over_ranks(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(t.item(), 3)


def main() -> None:
    a = _args()
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine

    rank, world = init_process_group(a.cpu)
    device = "cpu" if a.cpu else "cuda"
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                      num_attention_heads=16 if a.hidden >= 256 else 4, vocab_size=32000,
                      max_position_embeddings=a.seq)
    ds = _config(a)
    torch.manual_seed(0)
    with engine.zero.Init(config=ds):
        model = LlamaForCausalLM(cfg)
    nparams = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=ds)
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(a.steps):
        ids = torch.randint(0, 32000, (a.mbs, a.seq), device=device)
        _sync(a)
        t = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        _sync(a)
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
        if rank == 0:
            print(f"step {i} {times[-1]:.3f} s loss {losses[-1]}", flush=True)
    step_s = statistics.median(times[2:] if len(times) > 3 else times)
    root = Path(a.nvme) / f"zckpt-engine-rank{rank}"
    nvme_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    files = eng.mgr.files
    result = {"impl": "engine", "param": a.param, "optim": a.optim, "params_M": round(nparams / 1e6, 1),
              "world": world, "step_s": _max_over_ranks(step_s, device),
              "tokens_per_s": round(world * a.mbs * a.seq / step_s), "losses": losses,
              "rss_GiB": _max_over_ranks(_status_gib("VmRSS"), device),
              "rss_peak_GiB": _max_over_ranks(_status_gib("VmHWM"), device),
              "nvme_GB": _max_over_ranks(nvme_bytes / 1e9, device),
              "param_staging_GB": _max_over_ranks(files.staging_bytes() / 1e9 if files else 0.0, device),
              "param_read_ahead_hits": files.stats["read_ahead_hits"] if files else None,
              "param_reads": files.stats["reads"] if files else None,
              "optim_host_GB": _max_over_ranks(eng.optimizer.files.host_bytes() / 1e9
                                               if eng.optimizer.files is not None else 0.0, device)}
    if not a.cpu:
        result["peak_GiB"] = _max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, "cuda")
    eng.destroy()
    result["files_left"] = root.exists()
    report_and_exit(rank, result)


if __name__ == "__main__":
    main()
