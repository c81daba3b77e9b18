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
