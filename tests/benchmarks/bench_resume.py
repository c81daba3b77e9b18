"""Benchmark: an engine resume at a new world size (load-time reshard) against a same-world-size resume (fast path).

Phase 1 (untimed): a world-size-2 engine run (torchrun + gloo on CPU) takes one step of a Llama and saves
checkpoint A; ``zckpt reshard A B --world-size 1`` lays the same state out for one rank. Phase 2: fresh engine
processes resume, page cache dropped before each (where permitted), alternating, medians of ``--repeats``:

    world size 1 <- B (ws 1: fast path)      world size 1 <- A (ws 2 -> 1: load-time reshard)
    world size 2 <- A (ws 2: fast path)      world size 2 <- B (ws 1 -> 2: load-time reshard)

Timed: ``load_checkpoint`` alone (barrier before and after, max over ranks) and the whole ``torchrun`` wall (less the
verification below). RSS per rank from /proc/self/status: the peak up to the end of the load, and the load's own peak
above the RSS just before it (VmHWM reset through /proc/self/clear_refs). Each run asserts which path it took (a
wrapper around ``engine.reshard_load.load_resharded``) and, after the timed part, that the sha256 of the gathered fp32
masters and Adam moments equals the one taken right after saving A.

    python tests/benchmarks/bench_resume.py --work /tmp/zckpt-resume                  # ~220M Llama, fp32, ZeRO-2 and 3
    python tests/benchmarks/bench_resume.py --hidden 256 --layers 2 --repeats 1      # a quick try
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
CASES = [(1, "ws1", False), (1, "ws2", True), (2, "ws2", False), (2, "ws1", True)]  # (resume ws, ckpt, reshard?)


def _llama(args):
    from transformers import LlamaConfig

    inter = -(-8 * args.hidden // 3 // 256) * 256
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=inter, num_hidden_layers=args.layers,
                       num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                       vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=64)


def _engine(args):
    import engine
    import torch
    from transformers import LlamaForCausalLM

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": args.stage}}
    if args.dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    with engine.zero.Init(config=ds, enabled=args.stage == 3):
        model = LlamaForCausalLM(_llama(args))
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return eng


def _digest(eng) -> tuple[str, int]:
    """Collective. sha256 of the gathered fp32 masters (+ frozen, buffers) and optimizer state, by name; the number
    of fp32 weights."""
    import torch
    import torch.distributed as dist
    from engine.checkpoint import gather_optimizer_state

    full = {f"w/{k}": v for k, v in eng.fp32_state_dict().items()}
    state = gather_optimizer_state(eng._checkpoint_view())
    full.update({f"{key}/{k}": v for key, d in state.items() if key != "step" for k, v in d.items()})
    h = hashlib.sha256(json.dumps(state["step"]).encode())
    if dist.get_rank() == 0:
        for name in sorted(full):
            h.update(name.encode())
            h.update(full[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest(), sum(v.numel() for k, v in full.items() if k.startswith("w/"))


def _mem() -> dict[str, int]:
    """VmRSS / VmHWM of this process, bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(line.split()[1]) * 1024 for line in lines for k in ("VmRSS", "VmHWM") if line.startswith(k + ":")}


def save_worker(args) -> None:
    import torch
    import torch.distributed as dist

    import engine

    engine.init_distributed()
    eng = _engine(args)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    eng.save_checkpoint(args.ckpt)
    digest, n = _digest(eng)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"digest": digest, "params": n}))


def load_worker(args) -> None:
    import logging

    import torch.distributed as dist

    import engine
    from engine import reshard_load

    engine.init_distributed()
    real, calls, lines = reshard_load.load_resharded, [], []
    # engine.checkpoint looks load_resharded up on the module at each load: the wrapper sees every reshard
    reshard_load.load_resharded = lambda *a, **k: calls.append(1) or real(*a, **k)
    handler, log = logging.Handler(logging.INFO), logging.getLogger("engine.checkpoint")
    handler.emit = lambda record: lines.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    eng = _engine(args)
    before = _mem()
    Path("/proc/self/clear_refs").write_text("5\n")  # reset VmHWM: what follows is the load's own peak
    dist.barrier()
    t0 = time.perf_counter()
    eng.load_checkpoint(args.ckpt)
    dist.barrier()
    load_s = time.perf_counter() - t0
    after = _mem()
    t1 = time.perf_counter()
    assert eng.global_steps == 1, eng.global_steps
    digest, _ = _digest(eng)
    verify_s = time.perf_counter() - t1
    mine = {"load_s": load_s, "verify_s": verify_s, "resharded": bool(calls),
            "peak_rss": max(before["VmHWM"], after["VmHWM"]), "load_extra_rss": after["VmHWM"] - before["VmRSS"]}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"digest": digest, "ranks": ranks, "log": [l for l in lines if
                                                 l.startswith("resharded")]}))
    dist.barrier()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, nproc: int, role: str, ckpt: Path, result: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_port()), str(HERE), "--role", role, "--ckpt", str(ckpt), "--result", str(result),
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--dtype", args.dtype, "--stage", str(args.stage)]
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{role} {ckpt} at world size {nproc} failed:\n{proc.stderr[-4000:]}")
    return wall


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False  # not permitted: every case then reads from a warm cache alike


def build(args) -> tuple[dict[str, Path], dict]:
    """Checkpoints A (ws 2, trained) and B (A resharded for ws 1), built unless already there; A's digest."""
    base = args.work / f"llama-h{args.hidden}-l{args.layers}-zero{args.stage}-{args.dtype}"
    ckpts, info = {"ws2": base / "ws2", "ws1": base / "ws1"}, base / "saved.json"
    if not info.is_file():
        base.mkdir(parents=True, exist_ok=True)
        _torchrun(args, 2, "save", ckpts["ws2"], info)
        subprocess.run([sys.executable, "-m", "zckpt", "reshard", str(ckpts["ws2"]), str(ckpts["ws1"]),
                        "--world-size", "1", "--quiet", "--overwrite"], check=True)
    return ckpts, json.loads(info.read_text())


def measure(args) -> dict:
    ckpts, saved = build(args)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        order = CASES if rep % 2 == 0 else [c for pair in (CASES[1::-1], CASES[:1:-1]) for c in pair]
        for ws, src, reshard in order:
            dropped = args.drop_caches and _drop_caches()
            result = args.work / "result.json"
            wall = _torchrun(args, ws, "load", ckpts[src], result)
            r = json.loads(result.read_text())
            assert all(x["resharded"] == reshard for x in r["ranks"]), (ws, src, r)
            assert r["digest"] == saved["digest"], f"ws {ws} <- {src}: loaded state differs from the saved one"
            runs.setdefault(f"{ws} {src}", []).append({
                "load_s": max(x["load_s"] for x in r["ranks"]),
                "wall_s": wall - max(x["verify_s"] for x in r["ranks"]), "dropped_caches": dropped,
                "peak_rss_mb": max(x["peak_rss"] for x in r["ranks"]) / 2**20,
                "load_extra_rss_mb": max(x["load_extra_rss"] for x in r["ranks"]) / 2**20, "log": r["log"]})
            print(json.dumps({f"zero{args.stage} ws {ws} <- {src}": runs[f'{ws} {src}'][-1]}), flush=True)
    size = {k: sum(p.stat().st_size for p in c.rglob("*") if p.is_file()) / 1e9 for k, c in ckpts.items()}
    out = {"params": saved["params"], "checkpoint_gb": size}
    for ws, src, reshard in CASES:
        r = runs[f"{ws} {src}"]
        out[f"{ws} {src}"] = {"resume_ws": ws, "checkpoint": src, "resharded": reshard, "runs": r,
                              **{m: statistics.median(x[m] for x in r) for m in
                                 ("load_s", "wall_s", "peak_rss_mb", "load_extra_rss_mb")}}
    return out


def render(results: dict) -> str:
    lines = ["| config | resume at | checkpoint | path | load (s) | process wall (s) | peak RSS/rank (MiB) "
             "| load's extra RSS/rank (MiB) | load reshard/fast | wall reshard/fast |", "|---" * 10 + "|"]
    for config, res in results["results"].items():
        for ws, src, reshard in CASES:
            r, fast = res[f"{ws} {src}"], res[f"{ws} ws{ws}"]
            ratio = (f"{r['load_s'] / fast['load_s']:.2f}x | {r['wall_s'] / fast['wall_s']:.2f}x" if reshard
                     else "1.00x | 1.00x")
            lines.append(f"| {config} ({res['params'] / 1e6:.0f}M, {res['checkpoint_gb'][src]:.1f} GB) | ws {ws} | "
                         f"{src} | {'reshard' if reshard else 'fast'} | {r['load_s']:.2f} | {r['wall_s']:.1f} | "
                         f"{r['peak_rss_mb']:.0f} | {r['load_extra_rss_mb']:.0f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/zckpt-resume"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                    help="keep the page cache (e.g. while another benchmark runs)")
    ap.add_argument("--role", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        (save_worker if args.role == "save" else load_worker)(args)
        sys.stdout.flush()
        os._exit(0)  # skip finalization: a gloo worker thread can abort it (see tests/engine/_engine_harness.py)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
               "command": " ".join(sys.argv), "results": {}}
    for stage in args.stages:
        args.stage = stage
        results["results"][f"zero{stage} {args.dtype}"] = measure(args)
    (args.work / "results.json").write_text(json.dumps(results, indent=2))
    print(render(results))


if __name__ == "__main__":
    main()
