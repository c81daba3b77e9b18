"""Real DeepSpeed resumes from ``zckpt reshard --format universal`` at another world size and ZeRO stage.

DeepSpeed (CPU, gloo, ``torch_adam``) trains a tiny tied Llama 3 steps at world size 2 and saves -- without
``universal_checkpoint_info``, which ``ds_to_universal`` would need at stages 1/2; zckpt writes the universal
checkpoint; DeepSpeed with ``"checkpoint": {"load_universal": true}`` resumes it at world size 3 or 1 and another
ZeRO stage and trains 3 more steps on the same global batches (6 samples). Its losses equal DeepSpeed's own
continuation at world size 2 (one 6-step run) to fp32 reduction-order noise: rel 1e-5 (fp32; observed 2-4e-8) /
2e-4 (bf16, whose gradients are summed in bf16 over a different number of ranks; observed 1.7e-5). Also: ``ds_to_universal`` run live on more
committed fixtures is bit-identical to our writer, consolidate of our output equals consolidate of the source, and
our engine resumes from the universal output (fp32 cases) with the same losses.

    python -m pytest -m deepspeed tests/test_universal_deepspeed.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zckpt
from conftest import ROOT
from test_universal import assert_same_universal_tensors
from zckpt.reshard import reshard

pytestmark = pytest.mark.deepspeed
SCRIPT = ROOT / "tests" / "engine" / "llama_train_script.py"
UNIVERSAL = json.dumps({"checkpoint": {"load_universal": True}})
#: losses of the resumed run vs the continued run: fp32 reduction-order noise; bf16 sums gradients in bf16
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-4}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(impl: str, world: int, stage: int, dtype: str, out: Path, *extra: str) -> list[float]:
    """Run the training script under torchrun; each step's loss over the global batch (mean over ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(_free_port()), str(SCRIPT), "--impl", impl, "--stage", str(stage), "--dtype", dtype,
           "--micro", str(6 // world), "--out", str(out), "--no-weights", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    per_rank = [json.loads((out / f"losses.rank{r}.json").read_text())["losses"] for r in range(world)]
    return [sum(step) / world for step in zip(*per_rank)]


@pytest.mark.parametrize("impl,stage,dtype,new_world,new_stage", [
    ("deepspeed", 1, "fp32", 3, 3),
    ("deepspeed", 2, "bf16", 3, 1),
    ("deepspeed", 3, "bf16", 1, 2),
    ("deepspeed", 3, "fp32", 3, 2),
    ("engine", 2, "fp32", 3, 3),  # an engine-native source
])
def test_deepspeed_resumes_from_our_universal_checkpoint(tmp_path, impl, stage, dtype, new_world, new_stage):
    ckpt = tmp_path / "ckpt"
    train(impl, 2, stage, dtype, tmp_path / "first", "--steps", "3", "--save", str(ckpt))
    continued = train("deepspeed", 2, stage, dtype, tmp_path / "continued", "--steps", "6")[3:]
    if impl == "deepspeed":  # what ds_to_universal would refuse at stages 1/2
        tag = ckpt / (ckpt / "latest").read_text().strip()
        states = torch.load(next(tag.glob("*model_states.pt")), map_location="cpu", weights_only=False)
        assert "universal_checkpoint_info" not in states
    result = reshard(ckpt, tmp_path / "universal", world_size=new_world, format="universal")
    assert result.format == "universal"
    resumed = train("deepspeed", new_world, new_stage, dtype, tmp_path / "resumed", "--steps", "3", "--start-step",
                    "3", "--load", str(tmp_path / "universal"), "--ds-json", UNIVERSAL)
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, continued))
    print(f"\n{impl} ZeRO-{stage} x2 -> universal -> DeepSpeed ZeRO-{new_stage} x{new_world} ({dtype}): max relative "
          f"loss difference {worst:.1e}")
    assert resumed == pytest.approx(continued, rel=TOLERANCE[dtype], abs=1e-6)
    if dtype == "fp32":  # our engine resumes from the universal folder too (load-time resharding through the reader)
        engine = train("engine", new_world, new_stage, dtype, tmp_path / "engine", "--steps", "3", "--start-step", "3",
                       "--load", str(tmp_path / "universal"))
        assert engine == pytest.approx(continued, rel=1e-5, abs=1e-6)
    ours, source = zckpt.load_state_dict(tmp_path / "universal", "fp32"), zckpt.load_state_dict(ckpt, "fp32")
    assert ours.keys() == source.keys() and all(torch.equal(ours[k], source[k]) for k in ours)


@pytest.mark.parametrize("name", ["z1_fp32_ws3_tied_g2", "z2_fp32_ws2_frozen", "z2_bf16_ws2_buffers",
                                  "z3_fp32_ws2_untied_g2", "z3_bf16_ws2_frozen", "z3_fp32_ws3_buffers"])
def test_writer_matches_live_ds_to_universal(tmp_path, name):
    sys.path.insert(0, str(ROOT / "fixtures"))
    from make_universal_fixtures import ds_to_universal

    save_dir = tmp_path / "ckpt"
    shutil.copytree(ROOT / "fixtures" / "deepspeed" / name / "ckpt", save_dir)
    tag = (save_dir / "latest").read_text().strip()
    theirs = ds_to_universal(save_dir, tag)
    reshard(save_dir, tmp_path / "ours", world_size=2, format="universal", tag=tag)
    assert assert_same_universal_tensors(theirs, tmp_path / "ours" / tag) >= 30
    a, b = zckpt.load_state_dict(theirs, "fp32"), zckpt.load_state_dict(tmp_path / "ours", "fp32")
    c = zckpt.load_state_dict(save_dir / tag, "fp32")
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
