#!/usr/bin/env python
"""ZeRO-3 model build under ``zero.Init`` (engine local path, engine ``match_cpu_build``, DeepSpeed) and the peak
memory of a few stage-3 steps after it; optionally ``from_pretrained`` under ``Init`` against a plain load. bf16 Llama
on NCCL GPUs (gloo, fp32, on CPU with --cpu). One implementation per launch; prints one JSON line (rank 0) last.

    torchrun --nproc_per_node 2 tests/gpu/init_bench.py --impl engine --layers 32 --hidden 4096
    torchrun --nproc_per_node 2 tests/gpu/init_bench.py --impl deepspeed --layers 32 --hidden 4096
    torchrun --nproc_per_node 2 tests/gpu/init_bench.py --impl engine-exact --layers 4 --hidden 4096 --steps 0
    torchrun --nproc_per_node 2 tests/gpu/init_bench.py --impl engine --pretrained /tmp/llama --steps 0

Times are barrier to barrier on every rank (``torch.cuda.synchronize`` first). ``build_s``: ``with Init(...):
LlamaForCausalLM(config)``; ``initialize_s``: ``initialize(...)`` after it (the stage-3 manager's re-layout, the
masters); ``build_s_per_Bparam``: ``build_s`` per billion parameters (flat as the model grows = no per-model pass).
``peak_build_GiB``: the most memory allocated during build + initialize; ``peak_step_GiB``: during ``--steps`` steps
(reset after initialize, as ``../shared/gpu/llama_bench.py``), max over ranks. ``--pretrained DIR``: rank 0 first
saves the (plain, bf16) model there unless ``DIR/config.json`` exists; then ``plain_load_s`` is
``LlamaForCausalLM.from_pretrained(DIR)`` on every rank (no ``Init``, what each rank of a stage 0-2 run does) and
``pretrained_s`` the same call under the engine's ``Init`` (not timed for DeepSpeed: transformers' route to its
``zero.Init``, ``HfDeepSpeedConfig``, needs accelerate, which neither machine has).
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

IMPLS = ("engine", "engine-exact", "deepspeed")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="engine", choices=IMPLS,
                   help="engine: the default (local) build; engine-exact: zero.Init(match_cpu_build=True)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="stage-3 steps after the build (0: build only)")
    p.add_argument("--pretrained", default="", help="also time from_pretrained under Init against a plain load")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32, for trying the script small")
    return p.parse_args()


def _config(a) -> dict:
    ds = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}
    if not a.cpu:
        ds["bf16"] = {"enabled": True}
    if a.impl == "deepspeed":
        ds["optimizer"]["params"]["torch_adam"] = True
    return ds


def _llama_config(a):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                       num_attention_heads=16 if a.hidden >= 256 else 4, vocab_size=32000,
                       max_position_embeddings=a.seq)


def _sync(a) -> None:
    if not a.cpu:
        torch.cuda.synchronize()
    dist.barrier()


def _timed(a, fn):
    _sync(a)
    t = time.perf_counter()
    out = fn()
    _sync(a)
    return out, round(time.perf_counter() - t, 3)


def _peak(a) -> float | None:
    if a.cpu:
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(peak.item(), 2)


def _init_context(a, lib, ds):
    if a.impl == "deepspeed":
        return lib.zero.Init(config_dict_or_path=ds)
    return lib.zero.Init(config=ds, match_cpu_build=a.impl == "engine-exact")


def _steps(a, eng, device) -> list[float]:
    times = []
    for i in range(a.steps):
        ids = torch.randint(0, 32000, (a.mbs, a.seq), device=device)
        times.append(_timed(a, lambda: (lambda loss: (eng.backward(loss), eng.step()))(
            eng(input_ids=ids, labels=ids).loss))[1])
        if dist.get_rank() == 0:
            print(f"step {i} {times[-1]:.3f} s", flush=True)
    return times


def _pretrained(a, lib, ds) -> dict:
    """Save once (rank 0, plain bf16 model), then a plain load on every rank and a load under Init, timed."""
    from transformers import LlamaForCausalLM

    folder = Path(a.pretrained)
    if dist.get_rank() == 0 and not (folder / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cpu"):
            LlamaForCausalLM(_llama_config(a)).to(torch.float32 if a.cpu else torch.bfloat16).save_pretrained(folder)
    dist.barrier()
    dtype = torch.float32 if a.cpu else torch.bfloat16
    plain, plain_s = _timed(a, lambda: LlamaForCausalLM.from_pretrained(folder, dtype=dtype))
    del plain
    if a.impl == "deepspeed":  # transformers' HfDeepSpeedConfig path needs accelerate, absent on both machines
        return {"plain_load_s": plain_s, "pretrained_s": None}

    def load():
        with _init_context(a, lib, ds):
            return LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    model, loaded_s = _timed(a, load)
    partitioned = all(p.numel() == 0 for p in model.parameters())
    return {"plain_load_s": plain_s, "pretrained_s": loaded_s, "pretrained_partitioned": partitioned,
            "pretrained_vs_plain": round(loaded_s / plain_s, 2) if plain_s else None}


def main() -> None:
    a = _args()
    from transformers import LlamaForCausalLM

    rank, world = init_process_group(a.cpu)
    if a.impl == "deepspeed":
        import deepspeed as lib
    else:
        import engine as lib
    ds, device = _config(a), ("cpu" if a.cpu else "cuda")
    result = {"impl": a.impl, "world": world, "layers": a.layers, "hidden": a.hidden}
    if a.pretrained:
        result.update(_pretrained(a, lib, ds))
    torch.manual_seed(0)
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()

    def build():
        with _init_context(a, lib, ds):
            return LlamaForCausalLM(_llama_config(a))
    model, build_s = _timed(a, build)
    nparams = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    (eng, *_), init_s = _timed(a, lambda: lib.initialize(model=model, model_parameters=model.parameters(),
                                                          config=ds))
    result.update({"params_M": round(nparams / 1e6, 1), "build_s": build_s, "initialize_s": init_s,
                   "build_s_per_Bparam": round(build_s / (nparams / 1e9), 2), "peak_build_GiB": _peak(a)})
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()
    times = _steps(a, eng, device)
    if times:
        step_s = statistics.median(times[2:] if len(times) > 3 else times)
        result.update({"step_s": round(step_s, 4), "tokens_per_s": round(world * a.mbs * a.seq / step_s),
                       "peak_step_GiB": _peak(a)})
    report_and_exit(rank, result)


if __name__ == "__main__":
    main()
