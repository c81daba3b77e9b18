#!/usr/bin/env python
"""Median training-step time of our engine vs DeepSpeed, ZeRO stages 0-3, 2 ranks (gloo on CPU, NCCL on GPUs).

    python tests/benchmarks/bench_engine_step.py                      # small Llama, fp32, 12 steps
    python tests/benchmarks/bench_engine_step.py --size tiny --steps 20 --impls engine

Each (impl, stage) is one ``torchrun --nproc_per_node 2`` of tests/engine/llama_train_script.py; a step is
forward + backward + step; the first step (warm-up) is dropped; the median over rank 0's steps is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "engine" / "llama_train_script.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(impl: str, stage: int, args, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
           str(_port()), str(SCRIPT), "--impl", impl, "--stage", str(stage), "--out", str(out), "--steps",
           str(args.steps), "--size", args.size, "--dtype", args.dtype, "--micro", str(args.micro), "--seq",
           str(args.seq), "--no-weights"] + (["--zero-json", args.zero_json] if args.zero_json else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} stage {stage} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "losses.rank0.json").read_text())["median_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="+", default=["engine", "deepspeed"])
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--zero-json", default=None,
                    help='extra zero_optimization keys for both, e.g. \'{"overlap_comm": true, "reduce_bucket_size": 500000}\'')
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            row = {"stage": stage}
            for impl in args.impls:
                row[impl] = run(impl, stage, args, Path(tmp) / f"{impl}{stage}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nmedian step time, {args.size} Llama, {args.dtype}, {args.nproc} ranks, micro {args.micro} x seq "
          f"{args.seq}, {args.steps} steps")
    print("| stage | " + " | ".join(f"{i} (ms)" for i in args.impls) + " |")
    print("|---" * (len(args.impls) + 1) + "|")
    for row in rows:
        print(f"| {row['stage']} | " + " | ".join(f"{1000 * row[i]:.1f}" for i in args.impls) + " |")


if __name__ == "__main__":
    main()
