"""Benchmark: ``zckpt consolidate`` against DeepSpeed's ``zero_to_fp32`` on real DeepSpeed checkpoints.

Builds Llama checkpoints with real DeepSpeed on 2 CPU ranks (torchrun + gloo, one optimizer step so Adam moments
exist), then times each converter as a separate process — wall time and peak RSS of the whole process from
``/usr/bin/time -v`` — alternating tools, medians of ``--repeats`` runs, page cache dropped where permitted.

    python tests/benchmarks/bench_consolidate.py --work /tmp/zckpt-bench              # 340M, ZeRO-2 fp32 + ZeRO-3 bf16
    python tests/benchmarks/bench_consolidate.py --work /tmp/zckpt-bench --double     # also a ~690M model

DeepSpeed's converter writes fp32 only, so zckpt is timed both as users run it (bf16, the default) and at fp32.
Models are untied: DeepSpeed's ``--safe_serialization`` aborts on tied embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MODELS = {  # name: (hidden, intermediate, layers, heads, vocab) ~ parameter count
    "340M": (1024, 2816, 22, 16, 32000),
    "690M": (1024, 2816, 49, 16, 32000),
}
CONFIGS = {"zero2-fp32": (2, "fp32"), "zero3-bf16": (3, "bf16")}


def worker(out: str, model: str, stage: int, dtype: str, universal_info: bool = False) -> None:
    """torchrun entry: build the model, take one DeepSpeed step, save the checkpoint.

    ``universal_info``: also save ``universal_checkpoint_info`` (DeepSpeed reads it from the module attribute of
    that name and stores it in the model-states file), which ``ds_to_universal`` needs at stages 1-2."""
    import deepspeed
    import torch
    from deepspeed.checkpoint import constants
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    hidden, inter, layers, heads, vocab = MODELS[model]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model_ = LlamaForCausalLM(cfg)
    else:
        model_ = LlamaForCausalLM(cfg)
    if universal_info:  # no tensor/pipeline parallelism: the version alone is the whole info
        setattr(model_, constants.UNIVERSAL_CHECKPOINT_INFO,
                {constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE})
    engine, *_ = deepspeed.initialize(model=model_, model_parameters=model_.parameters(), config=ds)
    ids = torch.randint(0, vocab, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out)
    if engine.global_rank == 0:
        cfg.to_json_file(os.path.join(out, "config.json"))


def build(work: Path, model: str, config: str, universal_info: bool = False) -> Path:
    """The checkpoint's save dir, built unless already there (``universal_info``: a separate ``-uc`` dir)."""
    out = work / f"{model}-{config}{'-uc' if universal_info else ''}"
    if (out / "latest").is_file():
        return out
    stage, dtype = CONFIGS[config]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(["torchrun", "--nproc_per_node", "2", "--master_port", str(29600 + stage), str(HERE),
                    "--worker", str(out), model, str(stage), dtype, *(["universal"] if universal_info else [])],
                   check=True, env=env)
    return out


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one process, from /usr/bin/time -v."""
    _drop_caches()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    hours, minutes, seconds = (float(g) if g else 0.0 for g in wall.groups())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    return hours * 3600 + minutes * 60 + seconds, rss


def _drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not permitted: both tools then read from a warm cache alike


def commands(ckpt: Path, out: Path) -> dict[str, list[str]]:
    zckpt = [sys.executable, "-m", "zckpt", "consolidate", str(ckpt), str(out), "--quiet", "--overwrite"]
    return {
        "deepspeed zero_to_fp32 (fp32, safetensors)": [
            sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out), "--safe_serialization"],
        "zckpt consolidate --dtype bf16": zckpt + ["--dtype", "bf16"],
        "zckpt consolidate --dtype fp32": zckpt + ["--dtype", "fp32"],
    }


def measure(ckpt: Path, work: Path, repeats: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list[tuple[float, int]]] = {}
    for _ in range(repeats):
        for name, cmd in commands(ckpt, work / "out").items():
            shutil.rmtree(work / "out", ignore_errors=True)
            runs.setdefault(name, []).append(timed(cmd))
    shutil.rmtree(work / "out", ignore_errors=True)
    return {name: {"wall_s": statistics.median(w for w, _ in r), "peak_rss_mb": statistics.median(m for _, m in r)
                   / 2**20, "runs": [[w, m / 2**20] for w, m in r]} for name, r in runs.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], universal_info=sys.argv[6:] == ["universal"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--double", action="store_true", help="also measure a model twice the size")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--plot", type=Path, help="write a PNG chart of the results here (needs matplotlib)")
    parser.add_argument("--plot-only", type=Path, help="only plot an existing results.json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    models = ["340M", "690M"] if args.double else ["340M"]
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
               "command": " ".join(sys.argv), "results": {}}
    for model in models:
        for config in args.configs:
            ckpt = build(args.work, model, config)
            size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
            key = f"{model} {config}"
            results["results"][key] = {"checkpoint_gb": size / 1e9, **measure(ckpt, args.work, args.repeats)}
            print(json.dumps({key: results["results"][key]}, indent=1), flush=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=2))
    print(render(results))
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["results"])
    tools = [t for t, r in results["results"][keys[0]].items() if isinstance(r, dict)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(tools)
    for ax, metric, label in ((axes[0], "wall_s", "wall time (s)"), (axes[1], "peak_rss_mb", "peak RSS (MiB)")):
        for i, tool in enumerate(tools):
            values = [results["results"][k][tool][metric] for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=tool)
        ax.set_xticks([x + width * (len(tools) - 1) / 2 for x in range(len(keys))], keys, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("zckpt consolidate vs DeepSpeed zero_to_fp32 (medians; " + results["machine"] + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(results: dict) -> str:
    lines = ["| checkpoint | tool | wall (s) | peak RSS (MiB) | wall vs DeepSpeed | RSS vs DeepSpeed |",
             "|---|---|---|---|---|---|"]
    for key, res in results["results"].items():
        ds = res["deepspeed zero_to_fp32 (fp32, safetensors)"]
        for tool, r in res.items():
            if not isinstance(r, dict):
                continue
            lines.append(f"| {key} ({res['checkpoint_gb']:.1f} GB) | {tool} | {r['wall_s']:.1f} | "
                         f"{r['peak_rss_mb']:.0f} | {r['wall_s'] / ds['wall_s']:.2f}x | "
                         f"{r['peak_rss_mb'] / ds['peak_rss_mb']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
