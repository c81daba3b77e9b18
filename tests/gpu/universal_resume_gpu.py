#!/usr/bin/env python
"""2-GPU proof: real DeepSpeed resumes at a new world size and ZeRO stage from ``zckpt reshard --format universal``.

1. DeepSpeed trains a small tied Llama 3 steps on 1 GPU (NCCL, ZeRO ``--stage``, ``--dtype``) and saves;
2. the same run continued: 6 steps on 1 GPU (the reference for steps 4-6);
3. ``python -m zckpt reshard CKPT UNI --world-size 2 --format universal``;
4. DeepSpeed resumes UNI on 2 GPUs (``torchrun --nproc_per_node 2``, ZeRO ``--new-stage``, ``"checkpoint":
   {"load_universal": true}``) and trains steps 4-6 on the same global batches;
5. its losses must equal the continued run's to ``--rtol`` (fp32 reduction-order noise: the global batch is split
   over 2 GPUs instead of one, so matmuls and the gradient all-reduce sum in another order).

Prints a PASS/FAIL summary; exits 1 on FAIL. ``--cpu`` runs the same on CPU processes (gloo) to check the script
itself without GPUs. Needs DeepSpeed and transformers importable, and this repository on PYTHONPATH (added if not).

    PYTHONPATH=/tmp/site:$PWD python tests/gpu/universal_resume_gpu.py            # GPU machine (2 GPUs)
    python tests/gpu/universal_resume_gpu.py --cpu                                  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "engine" / "llama_train_script.py"
GLOBAL_BATCH = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(cpu: bool) -> dict:
    path = os.environ.get("PYTHONPATH", "")
    out = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": path if str(REPO) in path.split(os.pathsep) else os.pathsep.join(p for p in (path, str(REPO))
                                                                                        if p)}
    if cpu:
        out.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return out


def run(cmd: list[str], cpu: bool, log: Path) -> None:
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env(cpu), cwd=REPO, timeout=900)
    print(f"  [{time.perf_counter() - started:5.1f}s] {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}", flush=True)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n--- {log} (tail) ---\n{tail}")


def train(world: int, stage: int, args, out: Path, *extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(SCRIPT), "--impl", "deepspeed", "--stage", str(stage), "--dtype", args.dtype,
           "--size", args.size, "--micro", str(GLOBAL_BATCH // world), "--out", str(out), "--no-weights", *extra]
    run(cmd, args.cpu, out.with_suffix(".log"))
    per_rank = [json.loads((out / f"losses.rank{r}.json").read_text())["losses"] for r in range(world)]
    return [sum(step) / world for step in zip(*per_rank)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes instead of NCCL on GPUs")
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a new temp folder)")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage of the 1-GPU run")
    ap.add_argument("--new-stage", type=int, default=3, help="ZeRO stage of the 2-GPU resume")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--rtol", type=float, default=None, help="default: 1e-4 (fp32), 2e-2 (bf16)")
    args = ap.parse_args()
    rtol = args.rtol if args.rtol is not None else (1e-4 if args.dtype == "fp32" else 2e-2)
    work = args.work or Path(tempfile.mkdtemp(prefix="zckpt-universal-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    where = "CPU (gloo)" if args.cpu else "GPU (NCCL)"
    print(f"universal resume proof on {where}: ZeRO-{args.stage} x1 -> zckpt --format universal -> ZeRO-"
          f"{args.new_stage} x2, {args.dtype}, model {args.size}; work {work}", flush=True)
    try:
        train(1, args.stage, args, work / "first", "--steps", "3", "--save", str(work / "ckpt"))
        continued = train(1, args.stage, args, work / "continued", "--steps", "6")[3:]
        run([sys.executable, "-m", "zckpt", "reshard", str(work / "ckpt"), str(work / "universal"), "--world-size",
             "2", "--format", "universal", "--quiet"], args.cpu, work / "reshard.log")
        resumed = train(2, args.new_stage, args, work / "resumed", "--steps", "3", "--start-step", "3", "--load",
                        str(work / "universal"), "--ds-json", json.dumps({"checkpoint": {"load_universal": True}}))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"FAIL: a step failed: {exc}")
        return 1
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(resumed, continued))
    ok = len(resumed) == len(continued) == 3 and worst <= rtol
    print(f"  continued on 1 {'rank' if args.cpu else 'GPU'}, steps 4-6: {continued}")
    print(f"  resumed on 2 {'ranks' if args.cpu else 'GPUs'}, steps 4-6:  {resumed}")
    print(f"{'PASS' if ok else 'FAIL'}: max relative loss difference {worst:.2e} (tolerance {rtol:.0e}) on {where}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
