"""CheckpointManager on the engine: saves with evaluation, rotation under save_total_limit, load_best into the running
engine at the same and at another world size (and stage), with and without save_only_model.

The evaluation is a scripted metric per step (improves, then worsens, with a tie), so the test knows which step is
best by Transformers' rule; what is checked is real: the folders left on disk after every save (against Transformers'
own rotate_checkpoints on a mirror of the run), trainer_state.json (read back by Transformers' TrainerState), and the
weights after load_best (equal, bit for bit, to the gathered fp32 masters the engine had at the best step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _engine_harness import build_model, ds_config, engine_train, launch

STEPS = 6
METRIC = [3.0, 2.0, 1.0, 1.5, 1.0, 2.5]  # best: step 3 (step 5 ties, the earlier wins)
BEST_STEP = 3
INTERRUPTED = "checkpoint-99"
GLOBAL_BATCH = 6


def _engine(stage: int, world_size: int, seed: int = 0):
    import engine

    model = build_model(seed)
    cfg = ds_config(stage, micro=GLOBAL_BATCH // world_size, clip=1.0)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng, cfg


def _folders(run: Path) -> list[str]:
    return sorted((p.name for p in run.iterdir() if p.name.startswith("checkpoint-") and p.name != INTERRUPTED),
                  key=lambda n: int(n.split("-")[1]))


def train_worker(rank: int, world_size: int, out: Path, stage: int, limit: int, only_model: bool) -> None:
    from zckpt import CheckpointManager

    eng, cfg = _engine(stage, world_size)
    run = out / "run"
    if rank == 0:  # a save interrupted in an earlier run, at a later step, claiming a better metric
        (run / INTERRUPTED / ".global_step99.tmp-x").mkdir(parents=True)
        (run / INTERRUPTED / ".global_step99.tmp-x" / "rank00000-weights.safetensors").write_bytes(b"\0" * 10)
        (run / INTERRUPTED / "trainer_state.json").write_text(json.dumps(
            {"global_step": 99, "log_history": [{"eval_loss": 0.0, "step": 99}]}))
    torch.distributed.barrier()
    mgr = CheckpointManager(run_dir=run, metric_for_best_model="loss", save_total_limit=limit,
                            save_only_model=only_model)
    seen = []
    for step in range(1, STEPS + 1):
        engine_train(eng, cfg, 1, world_size, rank, start_step=step - 1)
        weights = eng.fp32_state_dict()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"weights-{step}.safetensors"))
        mgr.save(eng, step, {"eval_loss": METRIC[step - 1]}, epoch=step / STEPS)
        seen.append(_folders(run))
        assert (run / INTERRUPTED / "trainer_state.json").is_file()  # never counted, never deleted
    steps_before = eng.global_steps
    path = mgr.load_best(eng)
    after = eng.fp32_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in after.items()}, str(out / "after_load_best.safetensors"))
        (out / "result.json").write_text(json.dumps({"seen": seen, "best": str(path), "steps_before": steps_before,
                                                     "steps_after": eng.global_steps}))


def load_worker(rank: int, world_size: int, out: Path, stage: int) -> None:
    from zckpt import CheckpointManager

    eng, _ = _engine(stage, world_size, seed=7)  # another init: every weight must come from the checkpoint
    path = CheckpointManager(run_dir=out / "run", metric_for_best_model="eval_loss").load_best(eng)
    after = eng.fp32_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in after.items()}, str(out / f"loaded_ws{world_size}.safetensors"))
        (out / f"loaded_ws{world_size}.json").write_text(json.dumps({"best": str(path)}))


def _expected_folders(tmp: Path, limit: int) -> list[list[str]]:
    """Transformers' rotate_checkpoints run after every save on a mirror of the run (empty folders, same names),
    with the best_model_checkpoint Transformers' Trainer would record."""
    from transformers.trainer_utils import rotate_checkpoints

    mirror, best, best_value, out = tmp / "mirror", None, float("inf"), []
    for step in range(1, STEPS + 1):
        (mirror / f"checkpoint-{step}").mkdir(parents=True)
        if METRIC[step - 1] < best_value:
            best, best_value = str(mirror / f"checkpoint-{step}"), METRIC[step - 1]
        rotate_checkpoints(str(mirror), save_total_limit=limit, best_model_checkpoint=best, use_mtime=False)
        out.append(_folders(mirror))
    return out


def _check_run(out: Path, limit: int, only_model: bool) -> None:
    from transformers import TrainerState

    result = json.loads((out / "result.json").read_text())
    assert result["seen"] == _expected_folders(out, limit)
    assert Path(result["best"]).name == f"checkpoint-{BEST_STEP}"
    assert result["steps_after"] == result["steps_before"] == STEPS  # load_best keeps the counters
    best_weights = load_file(str(out / f"weights-{BEST_STEP}.safetensors"))
    after = load_file(str(out / "after_load_best.safetensors"))
    assert after.keys() == best_weights.keys()
    assert all(torch.equal(after[k], best_weights[k]) for k in best_weights)
    last = load_file(str(out / f"weights-{STEPS}.safetensors"))
    assert not all(torch.equal(last[k], best_weights[k]) for k in best_weights)
    state = TrainerState.load_from_json(str(out / "run" / f"checkpoint-{STEPS}" / "trainer_state.json"))
    assert state.best_model_checkpoint == str(out / "run" / f"checkpoint-{BEST_STEP}")
    assert state.best_metric == 1.0 and state.best_global_step == BEST_STEP and state.global_step == STEPS
    assert [e["eval_loss"] for e in state.log_history] == METRIC
    tag = out / "run" / f"checkpoint-{BEST_STEP}" / f"global_step{BEST_STEP}"
    optim_files = sorted(p.name for p in tag.iterdir() if p.name.endswith("-optim.safetensors"))
    assert (optim_files == []) == only_model, optim_files


def _check_loaded(out: Path, world_size: int) -> None:
    best_weights = load_file(str(out / f"weights-{BEST_STEP}.safetensors"))
    loaded = load_file(str(out / f"loaded_ws{world_size}.safetensors"))
    assert all(torch.equal(loaded[k], best_weights[k]) for k in best_weights)


def test_best_ws2_then_ws1(tmp_path, capsys):
    """ZeRO-3 at 2 ranks, save_total_limit=2; load_best at 2 ranks, then into a fresh ZeRO-2 engine at 1 rank;
    `zckpt best/list` agree with the manager."""
    from conftest import cli

    launch(train_worker, 2, tmp_path, 3, 2, False)
    _check_run(tmp_path, 2, False)
    launch(load_worker, 1, tmp_path, 2)
    _check_loaded(tmp_path, 1)
    code, out, _ = cli(capsys, "best", tmp_path / "run")
    assert code == 0 and out.strip() == str(tmp_path / "run" / f"checkpoint-{BEST_STEP}")
    code, out, _ = cli(capsys, "list", tmp_path / "run", "--json")
    listed = json.loads(out)
    assert [(c["name"], c["status"]) for c in listed["checkpoints"]] == [
        ("checkpoint-3", "complete"), ("checkpoint-6", "complete"), (INTERRUPTED, "incomplete")]
    assert listed["latest"] == str(tmp_path / "run" / "checkpoint-6")
    assert listed["recorded_best"] == listed["best"] and listed["policy_origin"].endswith("zckpt_best.json")


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("only_model", [False, True])
def test_best_limits_and_save_only_model(tmp_path, limit, only_model):
    """Every save_total_limit 1..3, with and without save_only_model (weights-only engine checkpoints); ZeRO-2 at 2
    ranks, load_best at 2 and (fresh ZeRO-3 engine) at 3 ranks."""
    launch(train_worker, 2, tmp_path, 2, limit, only_model)
    _check_run(tmp_path, limit, only_model)
    launch(load_worker, 3, tmp_path, 3)
    _check_loaded(tmp_path, 3)


def weights_only_resume_worker(rank: int, world_size: int, out: Path) -> None:
    from engine.checkpoint import CheckpointError

    eng, _ = _engine(2, world_size)
    try:
        eng.load_checkpoint(str(out / "run" / f"checkpoint-{BEST_STEP}"))
    except CheckpointError as exc:
        (out / f"refused.rank{rank}.txt").write_text(str(exc))


@pytest.mark.slow
def test_weights_only_checkpoint_refuses_a_full_resume(tmp_path):
    launch(train_worker, 2, tmp_path, 2, 3, True)
    launch(weights_only_resume_worker, 2, tmp_path)
    assert "load_module_only=True" in (tmp_path / "refused.rank0.txt").read_text()


HF_RUN = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed" / "hf_best_run"


def hf_load_worker(rank: int, world_size: int, out: Path, stage: int) -> None:
    """load_best from the real HF Trainer + DeepSpeed run (ZeRO-3, 2 ranks) into a fresh engine built from the same
    Llama config (another init), at this world size and stage."""
    import engine
    from transformers import LlamaConfig, LlamaForCausalLM

    from zckpt import CheckpointManager

    torch.manual_seed(123)
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(out / "run" / "checkpoint-6" / "config.json")))
    cfg = ds_config(stage, micro=1)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path = CheckpointManager.from_training_args(_Args(out / "run")).load_best(eng)
    after = eng.fp32_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in after.items()}, str(out / f"hf_loaded_ws{world_size}.safetensors"))
        (out / "hf_best.txt").write_text(str(path))


class _Args:
    """What CheckpointManager reads of a TrainingArguments (the fixture run's values)."""

    def __init__(self, output_dir: Path):
        self.output_dir, self.load_best_model_at_end, self.metric_for_best_model = str(output_dir), True, None
        self.greater_is_better, self.save_total_limit, self.save_only_model = None, 2, False


@pytest.mark.parametrize("world_size,stage", [(1, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_load_best_from_hf_trainer_run(tmp_path, world_size, stage):
    meta = json.loads((HF_RUN / "meta.json").read_text())
    shutil.copytree(HF_RUN, tmp_path / "run")
    launch(hf_load_worker, world_size, tmp_path, stage)
    assert (tmp_path / "hf_best.txt").read_text() == str(tmp_path / "run" / Path(meta["best_model_checkpoint"]).name)
    trainer = load_file(str(HF_RUN / "trainer_loaded.safetensors"))  # what the Trainer held after its own load
    loaded = load_file(str(tmp_path / f"hf_loaded_ws{world_size}.safetensors"))
    assert trainer.keys() <= loaded.keys() and all(torch.equal(loaded[k], trainer[k]) for k in trainer)
