#!/usr/bin/env python
"""Checkpoint save time of the engine (synchronous and asynchronous) and of DeepSpeed, beside the disk's own floor;
and the training step (e.g. stage 3 + optimizer offload). bf16 Llama on NCCL GPUs (gloo on CPU with --cpu).

    torchrun --nproc_per_node 2 tests/gpu/save_bench.py --impl engine --stage 2 --save /tmp/ck [--async] [--floor]
    torchrun --nproc_per_node 2 tests/gpu/save_bench.py --impl deepspeed --stage 2 --save /tmp/ck
    torchrun --nproc_per_node 2 tests/gpu/save_bench.py --impl engine --stage 3 --offload --steps 8

Times are barrier to barrier on every rank. ``save_s``: ``save_checkpoint`` (the engine's fsyncs every file and
commits; DeepSpeed's ``torch.save`` does not fsync). ``async_block_s``: how long ``save_checkpoint(async_save=True)``
blocks training (``async2_``: the second one, reusing the host snapshot); ``async_total_s``: until the background
commit is done. ``floor_s``: every rank writes as many bytes
as its share of the checkpoint with plain ``os.write`` in 64 MiB chunks and one fsync, in parallel: the disk's own
time for those bytes. Prints one JSON line (rank 0) last.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    p.add_argument("--impl", default="engine", choices=["engine", "deepspeed"])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", action="store_true", help="offload_optimizer to CPU (pin_memory)")
    p.add_argument("--ds-cpu-adam", action="store_true", help="DeepSpeed's compiled CPU Adam (not torch_adam)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save", default="", help="time save_checkpoint into this folder (removed afterwards)")
    p.add_argument("--async", dest="async_save", action="store_true", help="also time an asynchronous save")
    p.add_argument("--floor", action="store_true", help="also time the disk floor for the same bytes")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32, for trying the script small")
    p.add_argument("--phases", action="store_true",
                   help="also time the phases of each step (device-synchronised around each, rank 0's medians)")
    return p.parse_args()


def _config(a) -> dict:
    ds = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
          "zero_optimization": {"stage": a.stage, "overlap_comm": True, "contiguous_gradients": True,
                                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}
    if not a.cpu:
        ds["bf16"] = {"enabled": True}
    if a.offload:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": not a.cpu}
    if a.impl == "deepspeed" and not a.ds_cpu_adam:
        ds["optimizer"]["params"]["torch_adam"] = True
        if a.offload:
            ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _sync(a) -> None:
    if not a.cpu:
        torch.cuda.synchronize()
    dist.barrier()


def _timed(a, fn) -> float:
    _sync(a)
    t = time.perf_counter()
    fn()
    _sync(a)
    return round(time.perf_counter() - t, 3)


def _time_phases(a, eng) -> dict[str, list[float]]:
    """Wrap the step's phases with device-synchronised timers: backward and step for both implementations, and the
    engine's step phases (gradient reduction wait, fp32 gradient partitions, Adam, parameter refresh, zeroing)."""
    spent: dict[str, list[float]] = {}
    targets = [(eng, "backward"), (eng, "step")]
    if a.impl == "engine":
        targets += [(eng.mgr, "reduce_at_boundary"), (eng, "_grad_partitions"), (eng.optimizer, "step"),
                    (eng.mgr, "update_params"), (eng.mgr, "zero_grads")]
    for obj, name in targets:
        label = ("optimizer." if obj is getattr(eng, "optimizer", None) and a.impl == "engine" else "") + name
        fn = getattr(obj, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            if not a.cpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = _fn(*args, **kwargs)
            if not a.cpu:
                torch.cuda.synchronize()
            spent.setdefault(_label, []).append(time.perf_counter() - t)
            return out
        setattr(obj, name, timed)
    return spent


def _disk_floor(a, folder: Path, nbytes: int) -> float:
    """Every rank writes ``nbytes`` with os.write (64 MiB chunks) and fsyncs once; barrier to barrier."""
    chunk = os.urandom(1 << 20) * 64
    path = folder / f"floor.rank{dist.get_rank()}"

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[:min(left, len(chunk))])
        os.fsync(fd)
        os.close(fd)

    seconds = _timed(a, write)
    path.unlink()
    return seconds


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    a = _args()
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = init_process_group(a.cpu)
    if a.impl == "deepspeed":
        import deepspeed as lib
    else:
        import engine as lib
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                      num_attention_heads=16 if a.hidden >= 256 else 4, vocab_size=32000,
                      max_position_embeddings=a.seq)
    ds = _config(a)
    torch.manual_seed(0)
    t_init = time.perf_counter()
    if a.stage == 3:
        init = lib.zero.Init(config_dict_or_path=ds) if a.impl == "deepspeed" else lib.zero.Init(config=ds)
        with init:
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    nparams = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    eng, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=ds)
    init_s = round(time.perf_counter() - t_init, 1)
    device = "cpu" if a.cpu else "cuda"
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    spent = _time_phases(a, eng) if a.phases else None
    for i in range(a.steps):
        ids = torch.randint(0, 32000, (a.mbs, a.seq), device=device)
        times.append(_timed(a, lambda: (lambda loss: (eng.backward(loss), eng.step()))(
            eng(input_ids=ids, labels=ids).loss)))
        if rank == 0:
            print(f"step {i} {times[-1]:.3f} s", flush=True)
    step_s = statistics.median(times[2:] if len(times) > 3 else times)
    result = {"impl": a.impl, "stage": a.stage, "offload": a.offload, "params_M": round(nparams / 1e6, 1),
              "world": world, "step_s": round(step_s, 4), "tokens_per_s": round(world * a.mbs * a.seq / step_s),
              "init_s": init_s, "threads_at_step": torch.get_num_threads()}
    if spent:
        result["phases_s"] = {k: round(statistics.median(v[2:] if len(v) > 3 else v), 4) for k, v in spent.items()}
    if not a.cpu:
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_GiB"] = round(peak.item(), 2)
    if a.save:
        save = Path(a.save)
        result["save_s"] = _timed(a, lambda: eng.save_checkpoint(str(save / "sync")))
        result["checkpoint_GB"] = round(_dir_bytes(save / "sync") / 1e9, 2) if rank == 0 else None
        if a.async_save:  # twice: the first allocates the (pinned) host snapshot, the second reuses it
            for n, name in enumerate(("async", "async2")):
                _sync(a)
                t = time.perf_counter()
                eng.save_checkpoint(str(save / name), async_save=True)
                _sync(a)
                result[f"{name}_block_s"] = round(time.perf_counter() - t, 3)
                eng.wait_for_checkpoint()
                _sync(a)
                result[f"{name}_total_s"] = round(time.perf_counter() - t, 3)
                if n == 0 and rank == 0:
                    shutil.rmtree(save / name, ignore_errors=True)
            result["snapshot_GB_per_rank"] = round(eng._async_saver().snapshot.nbytes / 1e9, 2)
        if a.floor:
            share = torch.tensor([_dir_bytes(save / "sync") // world if rank == 0 else 0], device=device)
            dist.broadcast(share, 0)
            result["floor_s"] = _disk_floor(a, save, int(share.item()))
        _sync(a)
        if rank == 0:
            shutil.rmtree(save, ignore_errors=True)
        _sync(a)
    report_and_exit(rank, result)


if __name__ == "__main__":
    main()
