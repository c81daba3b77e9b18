"""Best tracking with the installed DeepSpeed and Transformers (``-m deepspeed``): CheckpointManager beside a real
DeepSpeed engine, and a fresh HF Trainer + DeepSpeed run (fixtures/make_hf_best_run.py) checked like the committed one.
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

from conftest import ROOT, cli

pytestmark = pytest.mark.deepspeed


@pytest.mark.parametrize("stage", [2, 3])
def test_manager_beside_deepspeed(tmp_path, stage, capsys):
    pytest.importorskip("deepspeed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(ROOT / "tests" / "best_deepspeed_worker.py"), str(tmp_path), str(stage)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["best"] == str(tmp_path / "run" / "checkpoint-2") and result["global_steps"] == 5
    best, after = load_file(str(tmp_path / "weights-2.safetensors")), load_file(str(tmp_path / "after.safetensors"))
    assert all(torch.equal(after[k], best[k]) for k in best)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]
    capsys.readouterr()  # DeepSpeed's import-time accelerator warning
    code, out, _ = cli(capsys, "best", tmp_path / "run")
    assert code == 0 and out.strip() == result["best"]
    code, out, err = cli(capsys, "consolidate", tmp_path / "run", tmp_path / "hf", "--best", "--dtype", "fp32", "-q")
    assert code == 0, err
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(got[k], best[k]) for k in best)


def test_fresh_hf_trainer_run(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    sys.path.insert(0, str(ROOT / "fixtures"))
    from make_hf_best_run import make

    run = make(tmp_path / "run")
    capsys.readouterr()
    meta = json.loads((run / "meta.json").read_text())
    best = Path(meta["best_model_checkpoint"])
    assert best.parent == run
    code, out, _ = cli(capsys, "best", run)
    assert code == 0 and out.strip() == str(best)
    code, out, _ = cli(capsys, "list", run, "--json")
    listed = json.loads(out)
    assert [c["name"] for c in listed["checkpoints"]] == meta["checkpoints_left"]
    code, out, err = cli(capsys, "consolidate", run, tmp_path / "hf", "--best", "--dtype", "fp32", "-q")
    assert code == 0, err
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for ref_name in ("reference.safetensors", "trainer_loaded.safetensors"):
        ref = load_file(str(run / ref_name))
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), ref_name
