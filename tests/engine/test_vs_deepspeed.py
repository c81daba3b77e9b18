"""Our engine vs real DeepSpeed 0.19 on CPU (gloo, torch_adam), 2 ranks, a small tied-embedding Llama, stages 0-3.

Both run ``llama_train_script.py`` under torchrun with the same config dict, init and data; losses and final fp32
weights must agree to ~1e-5. Slow (DeepSpeed import + 8 torchrun launches): marked ``deepspeed``; run with
``pytest -m deepspeed tests/engine/test_vs_deepspeed.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _engine_harness import free_port

SCRIPT = Path(__file__).with_name("llama_train_script.py")
pytestmark = pytest.mark.deepspeed


def _torchrun(impl: str, stage: int, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(SCRIPT), "--impl", impl, "--stage", str(stage), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "losses.rank0.json").read_text())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_matches_deepspeed(tmp_path, stage):
    ours = _torchrun("engine", stage, tmp_path / "engine")
    theirs = _torchrun("deepspeed", stage, tmp_path / "deepspeed")
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6)
    w_ours = load_file(str(tmp_path / "engine" / "weights.safetensors"))
    w_ds = load_file(str(tmp_path / "deepspeed" / "weights.safetensors"))
    assert set(w_ds) <= set(w_ours)  # ours also carries the buffers (rotary inv_freq)
    for name, ref in w_ds.items():
        torch.testing.assert_close(w_ours[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _mean_losses(out: Path, world: int) -> list[float]:
    """Each step's loss over the global batch: the mean of the ranks' (equal-sized) micro-batch losses."""
    per_rank = [json.loads((out / f"losses.rank{r}.json").read_text())["losses"] for r in range(world)]
    return [sum(step) / world for step in zip(*per_rank)]


@pytest.mark.parametrize("stage,new_stage", [(2, 2), (3, 3), (1, 3)])
def test_engine_resumes_deepspeed_at_another_world_size(tmp_path, stage, new_stage):
    """Real DeepSpeed trains 3 steps at world size 2 and saves; the engine resumes at world size 3 -- loading the
    DeepSpeed checkpoint directly (load-time resharding) and from `zckpt reshard --world-size 3` (offline) -- and
    trains 3 more steps on the same global batches (6 samples: 2 ranks x 3 = 3 ranks x 2): its losses equal
    DeepSpeed's own continuation at world size 2, to fp32 reduction-order noise."""
    from zckpt.reshard import reshard

    def run(impl, world, out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), str(SCRIPT), "--impl", impl, "--out", str(out), "--no-weights", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return _mean_losses(out, world)

    run("deepspeed", 2, tmp_path / "ds3", "--stage", str(stage), "--micro", "3", "--steps", "3",
        "--save", str(tmp_path / "ckpt"))
    continued = run("deepspeed", 2, tmp_path / "ds6", "--stage", str(stage), "--micro", "3", "--steps", "6")[3:]
    at_load = run("engine", 3, tmp_path / "load", "--stage", str(new_stage), "--micro", "2", "--steps", "3",
                  "--start-step", "3", "--load", str(tmp_path / "ckpt"))
    reshard(tmp_path / "ckpt", tmp_path / "ws3", world_size=3, stage=new_stage,
            config=None, reduce_bucket_size=None)
    offline = run("engine", 3, tmp_path / "offline", "--stage", str(new_stage), "--micro", "2", "--steps", "3",
                  "--start-step", "3", "--load", str(tmp_path / "ws3"))
    assert at_load == pytest.approx(continued, rel=1e-5, abs=1e-6)
    assert offline == pytest.approx(continued, rel=1e-5, abs=1e-6)
