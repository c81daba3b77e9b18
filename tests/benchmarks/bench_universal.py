"""Benchmark: ``zckpt reshard --format universal`` against DeepSpeed's ``ds_to_universal`` and the disk floor.

The real DeepSpeed checkpoints of ``bench_consolidate.py`` (Llama ~340M, 2 CPU ranks, one AdamW step; ZeRO-2 fp32
and ZeRO-3 bf16) with ``universal_checkpoint_info`` saved (the ``-uc`` folders under ``--work``, built if missing),
which ``ds_to_universal`` needs at stage 2. On the tag folder of each, as separate processes, alternating tools,
page cache dropped before each run, medians of ``--repeats`` (the harness of ``bench_reshard.py``):

* ``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT/TAG_universal`` (its
  default worker counts; it does not sync its output);
* ``cp -r TAG OUT && sync``: the floor, reading and writing the source's bytes once;
* ``python -m zckpt reshard TAG OUT --world-size 4 --format universal --quiet`` (fsyncs every file it writes);
* ``python -m zckpt reshard TAG OUT --world-size 4 --format deepspeed --quiet``, when this checkout has that writer.

Wall time; peak RSS of the largest single process (``/usr/bin/time``) and the sampled peak PSS of the whole process
tree (``ds_to_universal`` forks workers). The machine's load average before each configuration is recorded, since
other work on a shared machine slows every tool alike.

    python tests/benchmarks/bench_universal.py --work /tmp/zckpt-bench --repeats 3

Targets (issue 7): universal <= 0.5x ds_to_universal wall and <= 0.5x its peak RSS; deepspeed-native <= 1.1x the
floor.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_consolidate as consolidate  # noqa: E402  (the checkpoint generator, shared)
import bench_reshard as harness  # noqa: E402  (measure_once, drop_page_cache)

DS = "ds_to_universal"
FLOOR = "cp -r + sync"
UNIVERSAL = "zckpt --format universal"
NATIVE = "zckpt --format deepspeed"


def commands(tag: Path, out: Path, world_size: int, native: bool) -> dict[str, list[str]]:
    zckpt = [sys.executable, "-m", "zckpt", "reshard", str(tag), str(out), "--world-size", str(world_size), "--quiet"]
    cmds = {
        DS: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
             "--output_folder", str(out / f"{tag.name}_universal")],
        FLOOR: ["sh", "-c", 'cp -r "$0" "$1" && sync', str(tag), str(out)],
        UNIVERSAL: zckpt + ["--format", "universal"],
    }
    if native:
        cmds[NATIVE] = zckpt + ["--format", "deepspeed"]
    return cmds


def has_native_writer() -> bool:
    proc = subprocess.run([sys.executable, "-c", "from zckpt.writers import WRITERS; print('deepspeed' in WRITERS)"],
                          capture_output=True, text=True)
    return proc.stdout.strip() == "True"


def measure(tag: Path, work: Path, world_size: int, repeats: int, native: bool) -> dict:
    out, log = work / "out-universal", work / "bench_universal.log"  # own folder: other benches use work/out
    files = [p for p in tag.rglob("*") if p.is_file()]
    runs: dict[str, list] = {}
    written: dict[str, int] = {}
    cache = ""
    for _ in range(repeats):
        for name, cmd in commands(tag, out, world_size, native).items():
            shutil.rmtree(out, ignore_errors=True)
            if name == DS:  # it writes latest_universal beside its output folder
                out.mkdir(parents=True)
            cache = harness.drop_page_cache(files)
            runs.setdefault(name, []).append(harness.measure_once(cmd, log))
            written.setdefault(name, sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
    shutil.rmtree(out, ignore_errors=True)
    result: dict = {"page_cache": cache, "load_average_before": os.getloadavg()}
    result.update(harness.summarize(runs, written))
    return result


def render(results: dict) -> str:
    lines = ["| checkpoint | tool | wall (s) | vs ds_to_universal | vs cp+sync | peak RSS, largest process (MiB) | "
             "vs ds_to_universal | peak PSS, all processes (MiB) | output (GB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, res in results["results"].items():
        ds, floor = res[DS], res[FLOOR]
        for tool in (DS, FLOOR, UNIVERSAL, NATIVE):
            if tool not in res:
                continue
            r = res[tool]
            lines.append(f"| {key} ({res['checkpoint_gb']:.1f} GB) | {tool} | {r['wall_s']:.1f} | "
                         f"{r['wall_s'] / ds['wall_s']:.2f}x | {r['wall_s'] / floor['wall_s']:.2f}x | "
                         f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / ds['peak_rss_mb']:.2f}x | "
                         f"{r['peak_tree_pss_mb']:.0f} | {r['output_gb']:.2f} |")
        load = ", ".join(f"{x:.1f}" for x in res["load_average_before"])
        lines.append(f"| {key} | load average before (1, 5, 15 min) | {load} | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4, help="zckpt reshard's target world size")
    parser.add_argument("--configs", nargs="+", default=list(consolidate.CONFIGS), choices=list(consolidate.CONFIGS))
    parser.add_argument("--model", default="340M", choices=list(consolidate.MODELS))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    native = has_native_writer()
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "deepspeed": importlib.metadata.version("deepspeed"), "world_size": args.world_size,
               "native_writer": native, "results": {}}
    for config in args.configs:
        save_dir = consolidate.build(args.work, args.model, config, universal_info=True)
        tag = save_dir / (save_dir / "latest").read_text().strip()
        key = f"{args.model} {config}"
        results["results"][key] = {"checkpoint_gb": sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
                                   / 1e9, **measure(tag, args.work, args.world_size, args.repeats, native)}
        print(json.dumps({key: results["results"][key]}, indent=1), flush=True)
    (args.work / "results-universal.json").write_text(json.dumps(results, indent=2))
    print(render(results))


if __name__ == "__main__":
    main()
