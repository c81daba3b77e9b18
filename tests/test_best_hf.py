"""`zckpt best / list / prune / consolidate --best` on a real HF Trainer + DeepSpeed run
(fixtures/deepspeed/hf_best_run, made by fixtures/make_hf_best_run.py: ZeRO-3, 2 ranks, eval every 2 steps, save_total_limit=2,
load_best_model_at_end=True; the eval loss falls, then rises).

The answers are the Trainer's own: its recorded best_model_checkpoint, the checkpoints its rotation left, the weights it
held after load_best_model_at_end, and DeepSpeed's zero_to_fp32 of the best checkpoint. The fixture was made in
another folder, so every test here also runs on a moved run (best_model_checkpoint names a path that is not this one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from conftest import FIXTURES, cli
from zckpt import registry

RUN = FIXTURES / "hf_best_run"
META = json.loads((RUN / "meta.json").read_text())
BEST = Path(META["best_model_checkpoint"]).name


@pytest.fixture
def run(tmp_path) -> Path:
    dst = tmp_path / "moved" / "output"
    shutil.copytree(RUN, dst)
    return dst


def test_the_fixture_is_what_it_claims():
    evals = {int(k): v for k, v in META["eval_loss"].items()}
    steps = sorted(evals)
    best_step = int(BEST.split("-")[1])
    assert steps[0] < best_step < steps[-1]  # improves, then worsens
    assert evals[best_step] == min(evals.values()) == META["best_metric"]
    reference = load_file(str(RUN / "reference.safetensors"))
    loaded = load_file(str(RUN / "trainer_loaded.safetensors"))
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_best_and_list_agree_with_the_trainer(run, capsys):
    assert not META["best_model_checkpoint"].startswith(str(run))  # recorded where the run was made
    code, out, _ = cli(capsys, "best", run)
    assert code == 0 and out == f"{run / BEST}\n"
    code, out, _ = cli(capsys, "list", run, "--json")
    listed = json.loads(out)
    assert [c["name"] for c in listed["checkpoints"]] == META["checkpoints_left"]
    assert all(c["status"] == "complete" and c["kind"] == "deepspeed" for c in listed["checkpoints"])
    assert listed["best"] == listed["recorded_best"] == str(run / BEST)
    assert listed["latest"] == str(run / META["checkpoints_left"][-1])
    assert listed["metric"] == "eval_loss" and listed["greater_is_better"] is False
    assert listed["recorded_best_raw"] == META["best_model_checkpoint"]
    for c in listed["checkpoints"]:
        assert c["metrics"]["eval_loss"] == META["eval_loss"][str(c["step"])]
    code, out, _ = cli(capsys, "list", run)
    best_row = next(line for line in out.splitlines() if line.split()[1:2] == [BEST])
    assert best_row.split()[-1] == "best"


def test_prune_matches_transformers(run, tmp_path, capsys):
    from transformers.trainer_utils import rotate_checkpoints

    theirs = tmp_path / "theirs"
    shutil.copytree(run, theirs)
    rotate_checkpoints(str(theirs), save_total_limit=1, best_model_checkpoint=str(theirs / BEST))
    code, out, _ = cli(capsys, "prune", run, "--keep", "1", "--yes")
    assert code == 0 and "nothing to delete" in out  # limit 1 keeps the best and the newest, as Transformers does
    assert sorted(p.name for p in run.glob("checkpoint-*")) == sorted(p.name for p in theirs.glob("checkpoint-*"))
    # under another direction the newest is best; the Trainer's recorded best stays protected all the same
    code, out, _ = cli(capsys, "prune", run, "--keep", "1", "--higher-is-better", "--dry-run")
    assert code == 0 and f"keep    {BEST} (recorded best)" in out and "nothing to delete" in out


def test_reshard_best(run, tmp_path, capsys):
    code, out, err = cli(capsys, "reshard", run, tmp_path / "ws1", "--best", "--world-size", "1", "-q", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["source"] == str(run / BEST) and result["to_world_size"] == 1 and result["from_world_size"] == 2
    reference = load_file(str(RUN / "reference.safetensors"))
    got = zckpt.load_state_dict(tmp_path / "ws1", "fp32")  # the resharded engine checkpoint's weights
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_consolidate_best_equals_zero_to_fp32(run, tmp_path, capsys):
    code, out, err = cli(capsys, "consolidate", run, tmp_path / "best", "--best", "--dtype", "fp32", "-q", "--json")
    assert code == 0, err
    assert json.loads(out)["source"] == str(run / BEST)
    got, reference = load_file(str(tmp_path / "best" / "model.safetensors")), load_file(
        str(RUN / "reference.safetensors"))
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in reference)
    assert registry.best_path(run) == run / BEST
