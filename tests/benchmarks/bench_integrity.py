"""Consolidate wall time with and without read-time integrity checks: two source trees run alternately.

    python tests/benchmarks/bench_integrity.py --base /tmp/zckpt10-base --new . --runs 3 \
        /tmp/zckpt-bench/340M-zero2-fp32-uc /tmp/zckpt-bench/340M-zero3-bf16-uc /tmp/zckpt10-eng340M

Each run is ``python -m zckpt consolidate SRC OUT --dtype bf16 --quiet --overwrite`` in a fresh process with
PYTHONPATH set to the tree; the page cache is warm (the sources are read once before timing). Prints the median
wall time per (source, tree), the ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(tree: str, src: str, out: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+sys) of one consolidate in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zckpt", "consolidate", src, out, "--dtype", "bf16", "--quiet",
                    "--overwrite"], check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("sources", nargs="+")
    args = ap.parse_args()
    results = {"load_before": os.getloadavg(), "rows": []}
    work = tempfile.mkdtemp(prefix="bench-integrity-")
    try:
        for src in args.sources:
            times = {"base": [], "new": []}
            cpu = {"base": [], "new": []}
            run_once(args.base, src, os.path.join(work, "warm"))  # warm the page cache
            for _ in range(args.runs):
                for label, tree in (("base", args.base), ("new", args.new)):
                    wall, used = run_once(tree, src, os.path.join(work, label))
                    times[label].append(round(wall, 3))
                    cpu[label].append(round(used, 3))
            row = {"source": src, "base_s": statistics.median(times["base"]), "new_s": statistics.median(times["new"]),
                   "base_cpu_s": statistics.median(cpu["base"]), "new_cpu_s": statistics.median(cpu["new"]),
                   "wall": times, "cpu": cpu, "load": os.getloadavg()}
            row["ratio"] = row["new_s"] / row["base_s"]
            results["rows"].append(row)
            print(f"{os.path.basename(src)}: wall base {row['base_s']:.2f}s new {row['new_s']:.2f}s ratio "
                  f"{row['ratio']:.3f}; cpu base {row['base_cpu_s']:.2f}s new {row['new_cpu_s']:.2f}s; "
                  f"load {row['load'][0]:.1f}  {times}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
