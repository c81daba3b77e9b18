"""CheckpointManager's bookkeeping without processes: a stand-in engine with DeepSpeed's method names writes tiny
checkpoint folders (a `latest` + a tag holding a `*_model_states.pt` name, or save_16bit_model's model.safetensors).
Engine behaviour (real saves, load_best at other world sizes) is in tests/engine/test_best.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from zckpt import CheckpointManager, registry
from zckpt.errors import InvalidArgumentError, UnsupportedCheckpointError


class FakeDeepSpeedEngine:
    def __init__(self):
        self.global_steps, self.global_samples, self.micro_steps = 0, 0, 0
        self.loads: list[tuple[str, dict]] = []

    def save_checkpoint(self, save_dir, tag=None, **_):
        tag_dir = Path(save_dir) / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"stand-in")
        (Path(save_dir) / "latest").write_text(tag)

    def save_16bit_model(self, save_dir):
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.zeros(2)}, str(Path(save_dir) / "model.safetensors"))

    def load_checkpoint(self, path, **kwargs):
        self.loads.append((path, kwargs))
        self.global_steps = -1  # a load resets counters; load_best must put them back


def _train(mgr: CheckpointManager, eng, metrics: dict[int, float | None]) -> list[list[str]]:
    seen = []
    for step, value in metrics.items():
        eng.global_steps = step
        mgr.save(eng, step, None if value is None else {"loss": value})
        seen.append(sorted((p.name for p in Path(mgr.run_dir).glob("checkpoint-*")),
                           key=lambda n: int(n.split("-")[1])))
    return seen


def test_save_rotate_and_load_best(tmp_path):
    from transformers import TrainerState

    eng, run = FakeDeepSpeedEngine(), tmp_path / "run"
    mgr = CheckpointManager(run_dir=run, metric_for_best_model="loss", save_total_limit=1)
    seen = _train(mgr, eng, {1: 3.0, 2: 1.0, 3: 2.0, 4: 1.0, 5: math.nan, 6: None})
    assert seen == [["checkpoint-1"], ["checkpoint-2"], ["checkpoint-2", "checkpoint-3"],
                    ["checkpoint-2", "checkpoint-4"], ["checkpoint-2", "checkpoint-5"],
                    ["checkpoint-2", "checkpoint-6"]]
    state = TrainerState.load_from_json(str(run / "checkpoint-6" / "trainer_state.json"))
    assert state.best_model_checkpoint == str(run / "checkpoint-2") and state.best_global_step == 2
    assert state.global_step == 6 and len(state.log_history) == 5 and math.isnan(state.log_history[4]["eval_loss"])
    assert mgr.best() == run / "checkpoint-2"
    assert mgr.load_best(eng) == run / "checkpoint-2"
    assert eng.loads == [(str(run / "checkpoint-2"), {"load_optimizer_states": True,
                                                      "load_lr_scheduler_states": True})]
    assert eng.global_steps == 6  # counters kept


def test_resume_keeps_history_and_best(tmp_path):
    eng, run = FakeDeepSpeedEngine(), tmp_path / "run"
    _train(CheckpointManager(run_dir=run, metric_for_best_model="eval_loss", save_total_limit=2), eng,
           {1: 2.0, 2: 1.0, 3: 1.5})
    (run / "checkpoint-4").mkdir()  # the crash: an interrupted save at step 4
    (run / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(
        {"global_step": 4, "log_history": [{"eval_loss": 0.5, "step": 4}]}))
    resumed = CheckpointManager(run_dir=run, metric_for_best_model="eval_loss", save_total_limit=2)
    assert [e["step"] for e in resumed.log_history] == [1, 2, 3]  # from checkpoint-3, not the interrupted one
    seen = _train(resumed, eng, {4: 1.2, 5: 3.0})
    assert seen == [["checkpoint-2", "checkpoint-4"], ["checkpoint-2", "checkpoint-5"]]
    state = json.loads((run / "checkpoint-5" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"]] == [1, 2, 3, 4, 5] and state["best_global_step"] == 2


def test_metric_missing_from_save_is_refused_before_writing(tmp_path):
    eng = FakeDeepSpeedEngine()
    mgr = CheckpointManager(run_dir=tmp_path / "run", metric_for_best_model="accuracy")
    with pytest.raises(InvalidArgumentError, match="'eval_accuracy' is not in the metrics"):
        mgr.save(eng, 1, {"loss": 1.0})
    assert not (tmp_path / "run").exists()
    with pytest.raises(InvalidArgumentError, match="load_best needs metric_for_best_model"):
        CheckpointManager(run_dir=tmp_path / "run").load_best(eng)


def test_from_training_args_and_save_only_model_on_another_engine(tmp_path):
    # TrainingArguments' attribute names (constructing one needs accelerate): metric unset, load_best_model_at_end
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), load_best_model_at_end=True, metric_for_best_model=None,
                           greater_is_better=None, save_total_limit=3, save_only_model=True)
    mgr = CheckpointManager.from_training_args(args)
    assert (mgr.run_dir, mgr.metric_for_best_model, mgr.greater_is_better, mgr.save_total_limit,
            mgr.save_only_model) == (tmp_path / "out", "eval_loss", False, 3, True)
    eng = FakeDeepSpeedEngine()
    _train(mgr, eng, {1: 2.0, 2: 1.0})
    assert [c.kind for c in registry.scan(tmp_path / "out").checkpoints] == ["weights", "weights"]
    with pytest.raises(UnsupportedCheckpointError, match="from_pretrained"):
        mgr.load_best(eng)
    higher = CheckpointManager.from_training_args(SimpleNamespace(
        output_dir=str(tmp_path / "x"), metric_for_best_model="accuracy", greater_is_better=None,
        load_best_model_at_end=True, save_total_limit=None, save_only_model=False))
    assert (higher.metric_for_best_model, higher.greater_is_better) == ("eval_accuracy", True)


def test_without_best_tracking_rotation_keeps_the_newest_only(tmp_path):
    eng, run = FakeDeepSpeedEngine(), tmp_path / "run"
    seen = _train(CheckpointManager(run_dir=run, save_total_limit=1), eng, {1: None, 2: None})
    assert seen == [["checkpoint-1"], ["checkpoint-2"]]
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] is None and not (run / "checkpoint-2" / registry.POLICY_FILE).exists()
    # metrics logged without a metric_for_best_model: recorded, and still no best protected (as Transformers)
    seen = _train(CheckpointManager(run_dir=tmp_path / "r2", save_total_limit=1), eng, {1: 1.0, 2: 2.0})
    assert seen == [["checkpoint-1"], ["checkpoint-2"]]


def test_deepspeed_zero3_without_gather_is_refused_for_save_only_model(tmp_path):
    class NoGather(FakeDeepSpeedEngine):
        def save_16bit_model(self, save_dir):
            return False

    mgr = CheckpointManager(run_dir=tmp_path / "run", save_only_model=True)
    with pytest.raises(UnsupportedCheckpointError, match="stage3_gather_16bit_weights_on_model_save"):
        mgr.save(NoGather(), 1)
