"""Benchmark: ``zckpt reshard --format deepspeed`` against the disk floor (``cp -r`` + ``sync``).

On the real DeepSpeed 340M checkpoints of ``bench_consolidate.py`` / ``bench_reshard.py`` (Llama, 2 CPU ranks, one
AdamW step; ZeRO-2 fp32 and ZeRO-3 bf16, the ``-uc`` folders under ``--work``), times as separate processes,
alternating, page cache dropped before each run, medians of ``--repeats``:

* ``cp -r TAG OUT && sync``: the floor, reading and writing the source's bytes once;
* ``python -m zckpt reshard SAVE_DIR OUT --world-size N --format deepspeed --quiet`` (fsyncs every file it writes).

Memory: the peak RSS of the largest process (``/usr/bin/time``) and the sampled peak PSS of the process tree, as in
``bench_reshard.py`` (whose measuring functions this reuses).

    python tests/benchmarks/bench_deepspeed_native.py --work /tmp/zckpt-bench [--world-size 4] [--repeats 3]

Target (issue 7): wall <= 1.1x the floor.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_reshard as harness  # noqa: E402  (measure_once, drop_page_cache)

FLOOR = "cp -r + sync"
ZCKPT = "zckpt reshard --format deepspeed"
CHECKPOINTS = ("340M-zero2-fp32-uc", "340M-zero3-bf16-uc")


def commands(save_dir: Path, tag: Path, out: Path, world_size: int) -> dict[str, list[str]]:
    return {
        FLOOR: ["sh", "-c", 'cp -r "$0" "$1" && sync', str(tag), str(out)],
        ZCKPT: [sys.executable, "-m", "zckpt", "reshard", str(save_dir), str(out), "--world-size", str(world_size),
                "--format", "deepspeed", "--quiet"],
    }


def measure(save_dir: Path, work: Path, world_size: int, repeats: int) -> dict:
    tag = save_dir / (save_dir / "latest").read_text().strip()
    out, log = work / "out-dsn", work / "bench_deepspeed_native.log"
    files = [p for p in tag.rglob("*") if p.is_file()]
    runs: dict[str, list] = {}
    written: dict[str, int] = {}
    cache = ""
    for _ in range(repeats):
        for name, cmd in commands(save_dir, tag, out, world_size).items():
            shutil.rmtree(out, ignore_errors=True)
            cache = harness.drop_page_cache(files)
            runs.setdefault(name, []).append(harness.measure_once(cmd, log))
            written.setdefault(name, sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
    shutil.rmtree(out, ignore_errors=True)
    result: dict = {"checkpoint_gb": sum(p.stat().st_size for p in files) / 1e9, "page_cache": cache}
    for name, r in runs.items():
        result[name] = {"wall_s": statistics.median(x.wall_s for x in r),
                        "peak_rss_mb": statistics.median(x.max_rss_mb for x in r),
                        "peak_tree_pss_mb": statistics.median(x.tree_pss_mb for x in r),
                        "output_gb": written[name] / 1e9, "runs": [[x.wall_s, x.max_rss_mb] for x in r]}
    return result


def render(results: dict) -> str:
    lines = ["| checkpoint | tool | wall (s) | vs `cp -r` + `sync` | peak RSS, largest process (MiB) | output (GB) |",
             "|---|---|---|---|---|---|"]
    for key, res in results["results"].items():
        floor = res[FLOOR]
        for tool in (FLOOR, ZCKPT):
            r = res[tool]
            lines.append(f"| {key} ({res['checkpoint_gb']:.1f} GB) | {tool} | {r['wall_s']:.1f} | "
                         f"{r['wall_s'] / floor['wall_s']:.2f}x | {r['peak_rss_mb']:.0f} | {r['output_gb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS),
                        help="save dirs under --work (build them with bench_reshard.py)")
    args = parser.parse_args()
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "load_average_before": os.getloadavg(), "deepspeed": importlib.metadata.version("deepspeed"),
               "world_size": args.world_size, "results": {}}
    for name in args.checkpoints:
        save_dir = args.work / name
        if not (save_dir / "latest").is_file():
            sys.exit(f"{save_dir} is not a DeepSpeed save dir; build it with tests/benchmarks/bench_reshard.py")
        results["results"][name] = measure(save_dir, args.work, args.world_size, args.repeats)
        print(json.dumps({name: results["results"][name]}, indent=1), flush=True)
    results["load_average_after"] = os.getloadavg()
    (args.work / "results-deepspeed-native.json").write_text(json.dumps(results, indent=2))
    print(render(results))


if __name__ == "__main__":
    main()
