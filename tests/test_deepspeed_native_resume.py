"""Real DeepSpeed resumes from ``zckpt reshard --format deepspeed`` at a new world size (and stage).

DeepSpeed (CPU, gloo, torch_adam, torchrun) trains a tiny Llama (tied embeddings, decay / no-decay groups, WarmupLR,
gradient clipping) at world size 2, saving after step 3 and running on to step 5: the *continued run*. zckpt writes
that step-3 checkpoint for N ranks; DeepSpeed at N ranks resumes with its plain ``load_checkpoint`` and runs steps 4
and 5 on the same global batches. Its losses equal the continued run's to fp32 reduction-order noise: the ranks'
gradients are summed in another order (and bf16 gradients rounded from other partial sums), nothing else differs.
Tolerance: 2e-5 absolute for fp32 runs, 1e-4 for bf16 (losses are ~4.6; measured on 2026-11-30: <= 4.8e-7 fp32,
<= 3.0e-5 bf16, the largest at ZeRO-3 -> ZeRO-2 bf16; ``-s`` prints them).

Also: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` on our output equals zckpt consolidate (fp32) on the
source bit for bit, and our output for the source's own world size equals DeepSpeed's own files tensor for tensor.

Run with ``python -m pytest -m deepspeed tests/test_deepspeed_native_resume.py`` (~3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from ds_native_compare import compare_tag_dirs, stage3_padding_masks

pytestmark = pytest.mark.deepspeed

SCRIPT = ROOT / "tests" / "deepspeed_resume_script.py"
TOLERANCE = {"fp32": 2e-5, "bf16": 1e-4}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(world: int, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", str(_port()), str(SCRIPT), "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def source_runs(tmp_path_factory):
    """(stage, dtype) -> (save dir with the step-3 checkpoint at world size 2, the continued run's losses)."""
    cache: dict = {}

    def get(stage: int, dtype: str):
        if (stage, dtype) not in cache:
            folder = tmp_path_factory.mktemp(f"src-z{stage}-{dtype}")
            run = _torchrun(2, folder / "losses.json", "--stage", str(stage), "--dtype", dtype, "--steps", "5",
                            "--save-at", "3", "--save", str(folder / "save"))
            cache[stage, dtype] = folder / "save", run["losses"]
        return cache[stage, dtype]

    return get


@pytest.mark.parametrize("stage,dtype,world,to_stage", [
    (2, "fp32", 3, 2), (2, "fp32", 4, 2), (1, "bf16", 3, 1), (3, "bf16", 3, 3), (3, "bf16", 4, 3),
    (3, "fp32", 4, 3), (2, "fp32", 4, 3), (3, "bf16", 3, 2)])
def test_deepspeed_resumes_at_new_world_size(tmp_path, source_runs, stage, dtype, world, to_stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import zckpt
    from zckpt.reshard import reshard

    src, continued = source_runs(stage, dtype)
    out = tmp_path / "resharded"
    result = reshard(src, out, world_size=world, stage=to_stage, format="deepspeed")
    assert (result.to_world_size, result.to_stage) == (world, to_stage)

    resumed = _torchrun(world, tmp_path / "resumed.json", "--stage", str(to_stage), "--dtype", dtype, "--steps", "2",
                        "--load", str(out))
    assert resumed["first_step"] == 3 and resumed["global_steps"] == 5
    diffs = [abs(a - b) for a, b in zip(resumed["losses"], continued[3:])]
    print(f"z{stage}->z{to_stage} {dtype} ws2->{world}: loss differences {diffs}")
    assert max(diffs) <= TOLERANCE[dtype], (resumed["losses"], continued[3:])

    reference = zckpt.load_state_dict(src, "fp32")
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(out))
    assert theirs.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(theirs[key], tensor), key


@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (2, "fp32"), (3, "bf16"), (3, "fp32")])
def test_same_world_size_equals_fresh_deepspeed_files(tmp_path, source_runs, stage, dtype):
    from zckpt.readers import open_plan
    from zckpt.reshard import reshard
    from zckpt.writers.deepspeed_native import DeepSpeedTarget, layout_of, optim_file_name

    src, _ = source_runs(stage, dtype)
    reshard(src, tmp_path / "out", world_size=2, format="deepspeed")
    masks = {}
    if stage == 3:
        plan = open_plan(src)
        masks = stage3_padding_masks(layout_of(plan, DeepSpeedTarget(world_size=2, stage=3)),
                                     lambda r: optim_file_name(plan, r))
    assert compare_tag_dirs(tmp_path / "out" / "global_step3", src / "global_step3", masks) == []


def test_bf16_optimizer_loads_our_zero1_files(tmp_path, source_runs):
    """bf16 + ZeRO-1 + fp32 gradient accumulation makes DeepSpeed use its BF16_Optimizer, whose load reads the same
    keys (base_optimizer_state, single_partition_of_fp32_groups, clip_grad) with the same partition math. The step-4
    loss only depends on the loaded weights: equal to the continued run's; step 5 also accumulates gradients in fp32
    where the source run accumulated in bf16, so it may differ by more than reduction noise (bound 1e-3)."""
    from zckpt.reshard import reshard

    src, continued = source_runs(2, "bf16")
    reshard(src, tmp_path / "out", world_size=3, stage=1, format="deepspeed")
    resumed = _torchrun(3, tmp_path / "resumed.json", "--stage", "1", "--dtype", "bf16", "--steps", "2",
                        "--load", str(tmp_path / "out"), "--grad-accum-fp32")
    print(f"BF16_Optimizer resume: {resumed['losses']} vs {continued[3:]}")
    assert resumed["optimizer"] == "BF16_Optimizer" and resumed["first_step"] == 3
    assert abs(resumed["losses"][0] - continued[3]) <= TOLERANCE["bf16"]
    assert abs(resumed["losses"][1] - continued[4]) <= 1e-3
