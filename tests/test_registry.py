"""zckpt.registry: best tracking and rotation over run folders, checked against Transformers' own functions
(``Trainer._determine_best_metric``, ``trainer_utils.rotate_checkpoints``). Fast: weights-only checkpoints of a few
bytes and one copied DeepSpeed tag; no processes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import FIXTURES, cli
from zckpt import registry
from zckpt.errors import InvalidArgumentError, SourceNotFoundError


def _state(step: int, history: list[dict], best_metric=None, best_step=None, best_ckpt=None) -> dict:
    return {"best_global_step": best_step, "best_metric": best_metric, "best_model_checkpoint": best_ckpt,
            "global_step": step, "log_history": history}


def make_run(root: Path, evals: dict[int, float | None], saves: list[int] | None = None, metric="eval_loss",
             record_best: bool = False, greater: bool = False) -> Path:
    """A run folder with a weights-only checkpoint at each save step; ``evals`` step -> metric (None: no eval).
    Each checkpoint's trainer_state.json holds the history up to its step. With ``record_best`` the best is recorded
    exactly as Transformers' Trainer does (its own _determine_best_metric on every eval)."""
    saves = sorted(evals) if saves is None else saves
    history, tracker = [], _TransformersBest(metric, greater)
    for step in sorted(set(evals) | set(saves)):
        if evals.get(step) is not None:
            history.append({metric: evals[step], "epoch": step / 10, "step": step})
            tracker.evaluate(step, {metric: evals[step]})
        if step in saves:
            folder = root / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            save_file({"w": torch.full((2,), float(step))}, str(folder / "model.safetensors"))
            best = tracker.best_ckpt(root) if record_best else None
            (folder / "trainer_state.json").write_text(json.dumps(_state(
                step, list(history), tracker.state.best_metric if record_best else None,
                tracker.state.best_global_step if record_best else None, best), indent=2))
    return root


class _TransformersBest:
    """Transformers' Trainer._determine_best_metric, called on a stand-in ``self`` (args + state only)."""

    def __init__(self, metric: str, greater: bool):
        from transformers.trainer_utils import SaveStrategy

        self.args = SimpleNamespace(metric_for_best_model=metric, greater_is_better=greater,
                                    save_strategy=SaveStrategy.STEPS)
        self.state = SimpleNamespace(best_metric=None, best_global_step=None, global_step=0,
                                     best_model_checkpoint=None)

    def evaluate(self, step: int, metrics: dict) -> None:
        from transformers import Trainer

        self.state.global_step = step
        Trainer._determine_best_metric(self, metrics, None)

    def best_ckpt(self, root: Path) -> str | None:
        # Trainer._save_checkpoint: best_model_checkpoint = checkpoint-{best_global_step} if that folder exists
        # (kept as it was when that folder does not exist)
        if self.state.best_global_step and (root / f"checkpoint-{self.state.best_global_step}").exists():
            self.state.best_model_checkpoint = str(root / f"checkpoint-{self.state.best_global_step}")
        return self.state.best_model_checkpoint


def _best_name(run_dir: Path, **kw) -> str | None:
    best = registry.scan(run_dir, **kw).best
    return best.name if best else None


def test_improves_then_worsens(tmp_path):
    run = make_run(tmp_path / "run", {2: 3.0, 4: 2.0, 6: 1.5, 8: 1.7, 10: 2.5}, record_best=True)
    assert _best_name(run) == "checkpoint-6"
    state = json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == "checkpoint-6"  # what Transformers' rule recorded
    assert registry.scan(run).policy.origin.startswith("inferred")


def test_higher_is_better_and_explicit_direction(tmp_path):
    run = make_run(tmp_path / "run", {1: 0.5, 2: 0.9, 3: 0.7}, metric="eval_accuracy", record_best=True,
                   greater=True)
    assert _best_name(run) == "checkpoint-2"  # inferred name; direction: not ending in "loss" -> higher
    assert _best_name(run, metric="accuracy", greater_is_better=False) == "checkpoint-1"


@pytest.mark.parametrize("greater", [False, True])
def test_ties_keep_the_earlier_as_transformers(tmp_path, greater):
    evals = {1: 2.0, 2: 1.0, 3: 1.0, 4: 1.0} if not greater else {1: 1.0, 2: 2.0, 3: 2.0, 4: 1.0}
    name = "eval_loss" if not greater else "eval_acc"
    run = make_run(tmp_path / "run", evals, metric=name, record_best=True, greater=greater)
    assert _best_name(run, metric=name, greater_is_better=greater) == "checkpoint-2"
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == "checkpoint-2"


def test_nan_is_never_best(tmp_path):
    run = make_run(tmp_path / "run", {1: math.nan, 2: 3.0, 3: math.nan, 4: 2.0, 5: math.nan}, record_best=True)
    assert _best_name(run) == "checkpoint-4"
    state = json.loads((run / "checkpoint-5" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == "checkpoint-4"
    all_nan = make_run(tmp_path / "nan", {1: math.nan, 2: math.nan})
    assert registry.scan(all_nan).best is None
    with pytest.raises(InvalidArgumentError, match="usable eval_loss"):
        registry.best_path(all_nan)
    assert json.loads(json.dumps(registry.scan(all_nan).to_dict()))["checkpoints"][0]["metrics"]["eval_loss"] == "nan"


def test_missing_metric(tmp_path, capsys):
    run = make_run(tmp_path / "run", {1: 2.0, 2: 1.0})
    with pytest.raises(InvalidArgumentError, match=r"'eval_bleu'.*--metric with one of: eval_loss"):
        registry.best_path(run, metric="bleu")
    code, out, err = cli(capsys, "best", run, "--metric", "bleu")
    assert code == 2 and err.startswith("error: no checkpoint") and "\n" == err[-1] and err.count("\n") == 1
    no_evals = make_run(tmp_path / "noeval", {1: None, 2: None})
    code, _, err = cli(capsys, "best", no_evals)
    assert code == 2 and "no eval_* entries" in err


def test_save_steps_differ_from_eval_steps(tmp_path):
    # eval every 2 steps, save every 4 (Transformers requires save_steps to be a multiple of eval_steps): the best
    # evaluation (step 6) was never saved. Transformers keeps its earlier record (checkpoint-4); zckpt picks the best
    # saved checkpoint (checkpoint-8: 1.8 < 2.0) and protects both when rotating.
    run = make_run(tmp_path / "run", {2: 3.0, 4: 2.0, 6: 1.0, 8: 1.8, 10: 2.5, 12: 2.2}, saves=[4, 8, 12],
                   record_best=True)
    scanned = registry.scan(run, metric="eval_loss")
    assert scanned.best.name == "checkpoint-8"
    assert scanned.recorded_best.name == "checkpoint-4"
    assert [c.name for c in registry.plan_rotation(scanned, 1).keep] == ["checkpoint-4", "checkpoint-8",
                                                                        "checkpoint-12"]
    # saves at steps without an evaluation have no metric: they are never best
    run2 = make_run(tmp_path / "run2", {3: 1.0, 6: 2.0}, saves=[2, 4, 6])
    assert [c.metrics for c in registry.scan(run2).checkpoints] == [{}, {}, {"eval_loss": 2.0}]
    assert _best_name(run2) == "checkpoint-6"


def test_moved_run_folder(tmp_path, capsys):
    run = make_run(tmp_path / "old" / "out", {1: 2.0, 2: 1.0, 3: 1.5}, record_best=True)
    moved = tmp_path / "new-place"
    shutil.move(str(run), str(moved))
    recorded = json.loads((moved / "checkpoint-3" / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert recorded == str(tmp_path / "old" / "out" / "checkpoint-2") and not Path(recorded).exists()
    scanned = registry.scan(moved)
    assert scanned.recorded_best.path == moved / "checkpoint-2" == scanned.best.path
    assert cli(capsys, "best", moved)[1].strip() == str(moved / "checkpoint-2")
    # a relative path written from another working dir resolves the same way
    state = json.loads((moved / "checkpoint-3" / "trainer_state.json").read_text())
    state["best_model_checkpoint"] = "out/checkpoint-2"
    (moved / "checkpoint-3" / "trainer_state.json").write_text(json.dumps(state))
    assert registry.scan(moved).recorded_best.name == "checkpoint-2"


def test_interrupted_save_is_not_counted_nor_deleted(tmp_path, capsys):
    run = make_run(tmp_path / "run", {1: 1.0, 2: 2.0, 3: 3.0})
    # an interrupted save at step 4: trainer_state.json and a temp tag folder, no 'latest', no weights
    broken = run / "checkpoint-4"
    (broken / ".global_step4.tmp-abc").mkdir(parents=True)
    (broken / "trainer_state.json").write_text(json.dumps(_state(4, [{"eval_loss": 0.1, "step": 4}])))
    # a truncated weights file, a folder with unrelated content, and a 'latest' naming a missing tag
    (run / "checkpoint-5").mkdir()
    (run / "checkpoint-5" / "model.safetensors").write_bytes(b"\x10\x00")
    (run / "checkpoint-6").mkdir()
    (run / "checkpoint-6" / "notes.txt").write_text("mine")
    (run / "checkpoint-7").mkdir()
    (run / "checkpoint-7" / "latest").write_text("global_step7")
    scanned = registry.scan(run)
    statuses = {c.name: c.status for c in scanned.checkpoints}
    assert statuses == {"checkpoint-1": "complete", "checkpoint-2": "complete", "checkpoint-3": "complete",
                        "checkpoint-4": "incomplete", "checkpoint-5": "incomplete", "checkpoint-6": "unknown",
                        "checkpoint-7": "incomplete"}
    assert scanned.latest.name == "checkpoint-3"
    assert scanned.best.name == "checkpoint-1"  # checkpoint-4's 0.1 does not count: it is not complete
    plan = registry.plan_rotation(scanned, 1)
    assert [c.name for c in plan.delete] == ["checkpoint-2"]
    code, out, _ = cli(capsys, "prune", run, "--keep", "1", "--yes")
    assert code == 0 and "leave   checkpoint-6 (unknown" in out
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-3", "checkpoint-4",
                                                     "checkpoint-5", "checkpoint-6", "checkpoint-7"]
    assert (run / "checkpoint-6" / "notes.txt").read_text() == "mine"


def _transformers_rotation(run: Path, limit: int, best: str | None) -> list[str]:
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(str(run), save_total_limit=limit, best_model_checkpoint=best, use_mtime=False)
    return sorted((p.name for p in run.iterdir()), key=lambda n: int(n.split("-")[1]))


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("best_at", [None, 1, 3, 5])
def test_rotation_matches_transformers(tmp_path, limit, best_at):
    """Every save_total_limit 1..3, with no best, the oldest, a middle one and the newest as best."""
    evals = {s: (0.5 if s == best_at else 1.0 + s) for s in range(1, 6)} if best_at else {s: None for s in
                                                                                          range(1, 6)}
    ours = make_run(tmp_path / "ours", evals, saves=list(range(1, 6)), record_best=True)
    theirs = tmp_path / "theirs"
    shutil.copytree(ours, theirs)
    best = str(theirs / f"checkpoint-{best_at}") if best_at else None
    expected = _transformers_rotation(theirs, limit, best)
    plan = registry.plan_rotation(registry.scan(ours), limit)
    assert [c.name for c in plan.keep] == expected
    registry.apply_rotation(plan)
    assert sorted((p.name for p in ours.iterdir()), key=lambda n: int(n.split("-")[1])) == expected
    if best_at:
        assert f"checkpoint-{best_at}" in expected and "checkpoint-5" in expected


def test_prune_cli_dry_run_and_confirmation(tmp_path, capsys):
    run = make_run(tmp_path / "run", {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0})
    code, out, _ = cli(capsys, "prune", run, "--keep", "2", "--dry-run")
    assert code == 0 and "delete  checkpoint-2" in out and "keep    checkpoint-1 (best)" in out
    assert len(list(run.iterdir())) == 4
    code, _, err = cli(capsys, "prune", run, "--keep", "2")  # stdin is not a terminal: refuses without --yes
    assert code == 2 and "--yes" in err and len(list(run.iterdir())) == 4
    code, out, _ = cli(capsys, "prune", run, "--keep", "2", "--yes", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [str(run / "checkpoint-2"), str(run / "checkpoint-3")]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-4"]
    code, _, err = cli(capsys, "prune", run, "--keep", "0", "--yes")
    assert code == 2 and "at least 1" in err


def test_best_weights_only_checkpoint_is_not_consolidated(tmp_path, capsys):
    run = make_run(tmp_path / "run", {1: 2.0, 2: 1.0})
    code, _, err = cli(capsys, "consolidate", run, tmp_path / "out", "--best")
    assert code == 2 and "checkpoint-2 holds model weights only" in err and not (tmp_path / "out").exists()


def test_list_cli(tmp_path, capsys):
    run = make_run(tmp_path / "run", {1: 2.0, 2: 1.0, 3: 1.5})
    code, out, _ = cli(capsys, "list", run)
    rows = out.splitlines()
    assert code == 0 and rows[0].split()[:5] == ["step", "checkpoint", "status", "size", "eval_loss"]
    assert rows[2].split()[-1] == "best" and rows[3].split()[-1] == "latest"
    code, out, _ = cli(capsys, "list", run, "--json")
    data = json.loads(out)
    assert data["best"] == str(run / "checkpoint-2") and data["latest"] == str(run / "checkpoint-3")
    assert [c["metrics"]["eval_loss"] for c in data["checkpoints"]] == [2.0, 1.0, 1.5]
    code, out, _ = cli(capsys, "list", run, "--metric", "loss", "--higher-is-better", "--json")
    assert json.loads(out)["best"] == str(run / "checkpoint-1")


def test_not_a_run(tmp_path, capsys):
    with pytest.raises(SourceNotFoundError, match="no checkpoint-N/ folders"):
        registry.scan(tmp_path)
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(SourceNotFoundError, match="pass its parent"):
        registry.scan(tmp_path / "checkpoint-3")
    code, _, err = cli(capsys, "best", tmp_path / "missing")
    assert code == 2 and "is not a folder" in err


def test_deepspeed_tags_and_consolidate_best(tmp_path, capsys):
    """Checkpoints holding real DeepSpeed tags (copied fixture): `consolidate --best` reads the best one."""
    from safetensors.torch import load_file

    src = FIXTURES / "z2_fp32_ws1_untied"
    run = tmp_path / "run"
    for step, loss in ((1, 2.0), (2, 1.0), (3, 1.5)):
        folder = run / f"checkpoint-{step}"
        shutil.copytree(src / "ckpt", folder)
        shutil.copy2(src / "config.json", folder / "config.json")
        (folder / "trainer_state.json").write_text(json.dumps(_state(step, [{"eval_loss": loss, "step": step}])))
    (run / "checkpoint-2" / "marker").write_text("best")
    scanned = registry.scan(run)
    assert [c.kind for c in scanned.checkpoints] == ["deepspeed"] * 3 and scanned.best.name == "checkpoint-2"
    code, out, err = cli(capsys, "consolidate", run, tmp_path / "out", "--best", "--dtype", "fp32", "--json", "-q")
    assert code == 0, err
    assert json.loads(out)["source"].endswith("checkpoint-2")
    ref = load_file(str(src / "reference.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    code, _, err = cli(capsys, "consolidate", run, tmp_path / "out2", "--best", "--tag", "global_step3")
    assert code == 2 and "drop --tag" in err
