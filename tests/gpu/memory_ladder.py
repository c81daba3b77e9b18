#!/usr/bin/env python
"""The memory ladder: peak GPU memory and step time of ZeRO stages 0-3 and the offloads, engine and DeepSpeed side by
side in one launch, beside the ZeRO paper's model-state formula.

    # 2x H200, Llama 953M (the issue's model: 16 layers, hidden 2048, bf16, micro-batch 4 x 1024 tokens per GPU)
    torchrun --nproc_per_node 2 tests/gpu/memory_ladder.py --out memory_ladder.json --ab
    # CPU smoke run (gloo, fp32, a tiny Llama; memory figures are null without CUDA)
    torchrun --nproc_per_node 2 tests/gpu/memory_ladder.py --cpu --tiny --out /tmp/ladder.json --ab
    # the plot, from the JSON (matplotlib when installed, else a built-in PNG writer): docs/memory_ladder.png
    python tests/gpu/memory_ladder.py --plot memory_ladder.json

Rungs (cumulative offload): ``0``, ``1``, ``2``, ``3``, ``3+opt`` (``offload_optimizer: cpu``), ``3+opt+param``
(and ``offload_param: cpu``), ``3+opt+param_nvme`` (``offload_param: nvme``; DeepSpeed's row is skipped when its
async_io op cannot be built here; the engine's row says whether files really appeared under ``nvme_path``).
For each rung the engine and then DeepSpeed (0.19, ``torch_adam``) train the same model, from a deep copy of one
CPU-built model (stage 3 without ``zero.Init``, so every rung starts alike), on the same batches, in the same
processes: warm-up steps, then measured steps. Between runs everything is freed (``gc``, ``empty_cache``) and the
peak statistics reset. Per row (max over ranks): ``peak_alloc_GiB`` / ``peak_reserved_GiB`` (training steps only),
``init_peak_GiB`` (during ``initialize``), ``after_init_GiB`` and ``after_step_GiB`` (allocated: the resident model
states), ``step_s`` (median forward + backward + step), ``opt_step_s`` (median of ``engine.step()`` alone: where the
stages 1/2 all-gathers are), ``tokens_per_s``. Memory figures are this run's own: what was still allocated before
it started, ``baseline_GiB`` -- memory an earlier run failed to free (DeepSpeed's stage 3 engine keeps its model
states after ``destroy()``) -- is subtracted from each (also from reserved; ``baseline_reserved_GiB`` is recorded);
``raw_peak_alloc_GiB`` is the allocator's own figure.

``formula_GiB``: the ZeRO paper's model states per GPU for Psi parameters on N ranks, 16-bit parameters (2 Psi) and
gradients (2 Psi) and fp32 Adam state (K Psi, K = 12: master, momentum, variance), each whole, divided by N or
moved off the GPU by the rung: 0: 2+2+12; 1: 2+2+12/N; 2: 2+(2+12)/N; 3: (2+2+12)/N; 3+opt: 2/N (ZeRO-Offload keeps
gradients and optimizer on the CPU); 3+opt+param: 0. Activations, buffers and communication buckets come on top.

``--ab``: also runs the engine at stages 1 and 2 with the post-step all-gather overlap off
(``ENGINE_STEP_ALLGATHER_OVERLAP=0``), and both ways at ``--ab-bucket`` (smaller buckets: more units, more overlap);
the A/B rows measure ``--ab-steps`` steps. ``--bitcheck``: the engine at stages 1 and 2 (``--bucket`` and ``--ab-bucket``) trains ``--bitcheck-steps``
steps three times -- overlap off, on, off -- under ``torch.use_deterministic_algorithms`` with the math attention
kernel, and each row carries the
sha256 of this rank's fp32 masters and of its full compute-dtype parameters: on must equal off (the second off run is
the control for nondeterminism left in the kernels).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GIB = 2**30
RUNGS = {  # name -> (stage, offload_optimizer device, offload_param device)
    "0": (0, None, None), "1": (1, None, None), "2": (2, None, None), "3": (3, None, None),
    "3+opt": (3, "cpu", None), "3+opt+param": (3, "cpu", "cpu"), "3+opt+param_nvme": (3, "cpu", "nvme")}
# fractions of (2 Psi params, 2 Psi grads, 12 Psi optimizer) on each GPU; "N" = divided by the world size
FORMULA = {"0": (1, 1, 1), "1": (1, 1, "N"), "2": (1, "N", "N"), "3": ("N", "N", "N"), "3+opt": ("N", 0, 0),
           "3+opt+param": (0, 0, 0), "3+opt+param_nvme": (0, 0, 0)}
OVERLAP_ENV = "ENGINE_STEP_ALLGATHER_OVERLAP"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="memory_ladder.json", help="result JSON (rank 0 writes it)")
    p.add_argument("--plot", metavar="JSON", help="only draw --png from this result JSON, no training")
    p.add_argument("--png", default=str(Path(__file__).resolve().parents[2] / "docs" / "memory_ladder.png"))
    p.add_argument("--plot-backend", default="auto", choices=("auto", "matplotlib", "builtin"))
    p.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated subset of " + ",".join(RUNGS))
    p.add_argument("--impls", default="engine,deepspeed")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (2 layers, hidden 64, 2 x 32 tokens)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size = allgather_bucket_size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="measured steps (offload rungs: --offload-steps)")
    p.add_argument("--offload-steps", type=int, default=2)
    p.add_argument("--ab", action="store_true", help="also stages 1/2 without the step overlap, and at --ab-bucket")
    p.add_argument("--ab-bucket", type=float, default=5e7)
    p.add_argument("--ab-steps", type=int, default=20, help="measured steps of the A/B rows")
    p.add_argument("--bitcheck", action="store_true", help="stages 1/2: overlap on vs off, bitwise (deterministic)")
    p.add_argument("--bitcheck-steps", type=int, default=3)
    p.add_argument("--nvme-path", default="", help="folder for the nvme rung (default: a temp dir)")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.seq, a.mbs = 2, 64, 32, 2
    return a


# -- configuration -----------------------------------------------------------------------------------------------------
def ds_config(a, rung: str, impl: str, nvme: str, bucket: float) -> dict:
    stage, opt_dev, param_dev = RUNGS[rung]
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": int(bucket),
            "allgather_bucket_size": int(bucket)}
    pin = not a.cpu
    if opt_dev:
        zero["offload_optimizer"] = {"device": opt_dev, "pin_memory": pin}
    if param_dev:
        zero["offload_param"] = {"device": param_dev, "pin_memory": pin}
        if param_dev == "nvme":
            zero["offload_param"]["nvme_path"] = nvme
    cfg = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "zero_optimization": zero}
    if not a.cpu:
        cfg["bf16"] = {"enabled": True}
    if impl == "deepspeed":
        cfg["optimizer"]["params"]["torch_adam"] = True
        if opt_dev:
            cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def formula_gib(rung: str, psi: int, world: int) -> float:
    frac = [1 / world if f == "N" else f for f in FORMULA[rung]]
    return (2 * psi * frac[0] + 2 * psi * frac[1] + 12 * psi * frac[2]) / GIB


def plan(a) -> list[dict]:
    """The runs, in order: per rung the engine then DeepSpeed; the A/B rows right after rungs 1 and 2."""
    impls = [i for i in a.impls.split(",") if i]
    runs = []
    for rung in [r for r in a.rungs.split(",") if r]:
        if rung not in RUNGS:
            raise SystemExit(f"unknown rung {rung!r}; use some of {','.join(RUNGS)}")
        for impl in impls:
            runs.append({"rung": rung, "impl": impl, "bucket": a.bucket, "step_overlap": True})
        if a.ab and "engine" in impls and RUNGS[rung][0] in (1, 2):
            for bucket in (a.bucket, a.ab_bucket):
                for overlap in (False, True):
                    runs.append({"rung": rung, "impl": "engine", "bucket": bucket, "step_overlap": overlap,
                                 "ab": True})
    return runs


# -- one run -----------------------------------------------------------------------------------------------------------
def _sync(a) -> None:
    if not a.cpu:
        torch.cuda.synchronize()


def _allocated() -> float:
    return torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else float("nan")


def _reserved() -> float:
    return torch.cuda.memory_reserved() / GIB if torch.cuda.is_available() else float("nan")


def _free(a) -> None:
    gc.collect()
    if not a.cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _ds_nvme_unavailable() -> str | None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
        return "DeepSpeed's async_io op cannot be built here (libaio missing?)"
    except Exception as exc:  # an op builder that cannot even be imported
        return f"DeepSpeed's async_io op unavailable: {type(exc).__name__}: {exc}"[:200]


def _max_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor([float("-inf") if v != v else v for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if v == float("-inf") else v for v in t.tolist()]


def train(a, eng, steps: int, device) -> tuple[list[float], list[float], float]:
    """``steps`` iterations; per iteration (forward + backward + step) and ``step()`` seconds; last loss."""
    times, opt_times, loss = [], [], None
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ids = torch.randint(0, 32000, (a.mbs, a.seq), generator=g).to(device)
        _sync(a)
        t0 = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        _sync(a)
        t1 = time.perf_counter()
        eng.step()
        _sync(a)
        t2 = time.perf_counter()
        times.append(t2 - t0)
        opt_times.append(t2 - t1)
    return times, opt_times, float(loss.detach())


def run_one(a, run: dict, base_model, libs: dict, nvme_root: Path, psi: int) -> dict:
    rung, impl = run["rung"], run["impl"]
    world, device = dist.get_world_size(), torch.device("cpu") if a.cpu else torch.device("cuda")
    row = {**run, "stage": RUNGS[rung][0], "formula_GiB": round(formula_gib(rung, psi, world), 3)}
    nvme = nvme_root / f"{impl}-{rung}-rank{dist.get_rank()}"
    if RUNGS[rung][2] == "nvme":
        if impl == "deepspeed" and (reason := _ds_nvme_unavailable()):
            return {**row, "skipped": reason}
        nvme.mkdir(parents=True, exist_ok=True)
    os.environ[OVERLAP_ENV] = "1" if run["step_overlap"] else "0"
    _free(a)
    baseline, baseline_reserved = _allocated(), _reserved()
    cfg = ds_config(a, rung, impl, str(nvme), run["bucket"])
    model = copy.deepcopy(base_model)
    t = time.perf_counter()
    eng, *_ = libs[impl].initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t
    after_init = _allocated()
    init_peak = torch.cuda.max_memory_allocated() / GIB if not a.cpu else float("nan")
    if RUNGS[rung][2] == "nvme":
        row["nvme_files"] = sum(1 for p in nvme.rglob("*") if p.is_file())
        if impl == "engine" and not row["nvme_files"]:
            row["note"] = "no files under nvme_path: the engine kept the parameter partitions in CPU memory"
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()
    offload = RUNGS[rung][1] is not None
    steps = a.offload_steps if offload else a.ab_steps if run.get("ab") else a.steps
    warmup = min(a.warmup, 1) if offload else a.warmup
    times, opt_times, loss = train(a, eng, warmup + steps, device)
    peak = torch.cuda.max_memory_allocated() / GIB if not a.cpu else float("nan")
    reserved = torch.cuda.max_memory_reserved() / GIB if not a.cpu else float("nan")
    after_step = _allocated()
    # reserved: less what earlier runs left *allocated* (their cached free blocks are reusable by this run)
    figures = _max_over_ranks([peak - baseline, reserved - baseline, init_peak - baseline,
                               after_init - baseline, after_step - baseline, baseline, baseline_reserved, peak,
                               statistics.median(times[warmup:]), statistics.median(opt_times[warmup:]), init_s],
                              device)
    names = ["peak_alloc_GiB", "peak_reserved_GiB", "init_peak_GiB", "after_init_GiB", "after_step_GiB",
             "baseline_GiB", "baseline_reserved_GiB", "raw_peak_alloc_GiB", "step_s", "opt_step_s", "init_s"]
    row.update({k: (round(v, 4) if v is not None else None) for k, v in zip(names, figures)})
    row["tokens_per_s"] = round(world * a.mbs * a.seq / row["step_s"])
    row["loss"] = round(loss, 4)
    if hasattr(eng, "destroy"):  # both remove their hooks (which would keep the engine alive)
        eng.destroy()
    del eng, model
    _free(a)
    shutil.rmtree(nvme, ignore_errors=True)
    return row


def bitcheck(a, base_model, lib, stage: int, overlap: bool, bucket: float) -> dict:
    """Train ``--bitcheck-steps`` deterministic steps; sha256 of the fp32 masters and full parameters."""
    import hashlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ[OVERLAP_ENV] = "1" if overlap else "0"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _free(a)
        cfg = ds_config(a, str(stage), "engine", "", bucket)
        model = copy.deepcopy(base_model)
        eng, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        with sdpa_kernel([SDPBackend.MATH]):  # cuDNN / flash attention backward are not deterministic
            _, _, loss = train(a, eng, a.bitcheck_steps, torch.device("cpu") if a.cpu else torch.device("cuda"))
        digests = {}
        for name, tensors in (("masters", eng.optimizer.masters), ("params", eng.mgr.full)):
            h = hashlib.sha256()
            for t in tensors:
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digests[f"{name}_sha256"] = h.hexdigest()[:16]
        eng.destroy()
        del eng, model
        _free(a)
    finally:
        torch.use_deterministic_algorithms(False)
    return {"rung": str(stage), "impl": "engine", "bitcheck": True, "step_overlap": overlap, "bucket": bucket,
            "rank": dist.get_rank(), "loss": round(loss, 6), **digests}


# -- the launch --------------------------------------------------------------------------------------------------------
def _init_dist(a, impls: list[str]) -> dict:
    backend = "gloo" if a.cpu else "nccl"
    if not a.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    libs = {}
    if "deepspeed" in impls:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        libs["deepspeed"] = deepspeed
    elif not dist.is_initialized():
        dist.init_process_group(backend)
    if "engine" in impls:
        import engine

        libs["engine"] = engine
    return libs


def build_base_model(a):
    """One CPU-built bf16-bench Llama per process (all threads of this rank's share of the cores for HF's init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                      num_attention_heads=16 if a.hidden >= 256 else 4, vocab_size=32000,
                      max_position_embeddings=a.seq)
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    torch.set_num_threads(threads)
    return model


def _write(out: str, meta: dict, rows: list[dict], t_start: float) -> None:
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def main_train(a) -> None:
    impls = [i for i in a.impls.split(",") if i]
    libs = _init_dist(a, impls)
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    base = build_base_model(a)
    psi = sum(p.numel() for p in base.parameters())
    build_s = time.perf_counter() - t_start
    nvme_root = Path(a.nvme_path) if a.nvme_path else Path(tempfile.gettempdir()) / "memory_ladder_nvme"
    meta = {"params": psi, "params_M": round(psi / 1e6, 1), "world": world, "layers": a.layers, "hidden": a.hidden,
            "seq": a.seq, "mbs": a.mbs, "bucket": a.bucket, "dtype": "fp32" if a.cpu else "bf16",
            "device": "cpu (gloo)" if a.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
            "deepspeed": getattr(libs.get("deepspeed"), "__version__", None), "model_build_s": round(build_s, 1),
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = []
    if a.bitcheck and "engine" in libs:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        for stage, bucket in ((1, a.bucket), (2, a.bucket), (1, a.ab_bucket), (2, a.ab_bucket)):
            for overlap in (False, True, False):
                per_rank = [None] * world
                dist.all_gather_object(per_rank, bitcheck(a, base, libs["engine"], stage, overlap, bucket))
                rows += per_rank
                if rank == 0:
                    print(json.dumps(per_rank), flush=True)
    for run in plan(a):
        try:
            row = run_one(a, run, base, libs, nvme_root, psi)
        except Exception as exc:  # recorded, and the launch goes on (a failure on one rank only would hang)
            row = {**run, "error": f"{type(exc).__name__}: {exc}"[:400]}
            _free(a)
        rows.append(row)
        if rank == 0:  # rewritten after every run: a launch cut short still leaves its rows
            print(json.dumps(row), flush=True)
            _write(a.out, meta, rows, t_start)
        dist.barrier()
    if rank == 0:
        _write(a.out, meta, rows, t_start)
        print(f"wrote {a.out} ({meta['total_s']} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing()


def main() -> None:
    a = parse_args()
    if a.plot:
        from ladder_plot import plot

        print(plot(json.loads(Path(a.plot).read_text()), Path(a.png), a.plot_backend))
        return
    main_train(a)


if __name__ == "__main__":
    main()
