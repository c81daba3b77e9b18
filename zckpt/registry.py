"""Best-checkpoint tracking and rotation over a run folder: pure policy, no engine, no tensors.

A *run folder* holds ``checkpoint-N/`` folders, as Transformers' Trainer writes them (``output_dir``) and as
:class:`zckpt.manager.CheckpointManager` writes them. Each checkpoint folder holds a checkpoint (a save dir with
``latest`` and a DeepSpeed or engine tag, or weights only: ``model.safetensors``) and usually ``trainer_state.json``
(Transformers' ``TrainerState``: ``global_step``, ``best_metric``, ``best_model_checkpoint``, ``log_history``).

Rules (each one a function below):

* **Complete** (:func:`checkpoint_status`): a folder counts only when its save dir resolves to a tag through
  ``latest`` that some reader claims (an engine tag must also be committed), or when it holds complete weights
  (``model.safetensors`` with a readable header, or every shard its index names). Anything else named
  ``checkpoint-N`` is *incomplete* (an interrupted save: ``trainer_state.json``, ``latest`` or a temp tag folder, but
  no committed checkpoint) or *unknown* (nothing recognisable): neither is counted, neither is ever deleted.
* **Metric per checkpoint**: the ``eval_*`` entries of ``log_history`` logged at the checkpoint's step, merged over
  every readable ``trainer_state.json`` of the run (the newest file wins a step logged twice). A checkpoint saved at
  a step without an evaluation (``save_steps`` != ``eval_steps``) has no metric and cannot be best.
* **Best** (:func:`pick_best`): Transformers' ``Trainer._determine_best_metric`` (transformers 5.24,
  ``trainer.py``): ``np.greater`` / ``np.less`` against the best so far, in step order, starting from -inf / +inf. So
  the earlier checkpoint wins a tie and a NaN is never best. Only complete checkpoints with the metric compete.
  Transformers compares *every* evaluation, and records ``best_model_checkpoint`` only when the best evaluation's step
  was also saved: when the best evaluation fell between saves it keeps the previous one. zckpt picks the best *saved*
  checkpoint; :attr:`Run.recorded_best` keeps what the Trainer recorded, and rotation protects both.
* **Metric name and direction** (:func:`resolve_policy`): the caller's; else ``zckpt_best.json`` (written by
  CheckpointManager); else inferred from ``trainer_state.json`` (the ``eval_*`` value at ``best_global_step`` equal to
  ``best_metric``, ``eval_loss`` first); else ``eval_loss``. A name gets the ``eval_`` prefix as Transformers adds it;
  the direction defaults as ``TrainingArguments`` does: lower is better for names ending in ``loss``.
* **Moved runs**: ``best_model_checkpoint`` is the path the run had when it was written; it is matched by its folder
  name (``checkpoint-N``) inside the run folder as it is now.
* **Rotation** (:func:`plan_rotation`): Transformers' ``rotate_checkpoints`` (``trainer_utils.py``): keep the newest
  and the best, then delete the oldest others until ``max(save_total_limit, len(protected))`` remain -- so
  ``save_total_limit=1`` with a best that is not the newest keeps both. Ordered by step (Transformers prefers mtime,
  which a copy or a move rewrites). Only complete checkpoints are counted or deleted.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError, SourceNotFoundError

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
POLICY_FILE = "zckpt_best.json"
DELETING_PREFIX = ".zckpt-deleting-"
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Checkpoint:
    """One ``checkpoint-N/`` folder as found on disk."""

    name: str
    path: Path
    step: int
    status: str  # "complete" | "incomplete" | "unknown"
    kind: str | None  # "engine" | "engine-weights" | "deepspeed" | "weights" (complete ones)
    reason: str  # why it is not complete ("" when complete)
    metrics: dict[str, float] = field(default_factory=dict)  # eval_* logged at this step
    size: int = 0

    @property
    def complete(self) -> bool:
        return self.status == "complete"


@dataclass(frozen=True)
class Policy:
    """Which metric decides "best" and in which direction; ``origin`` says where that came from."""

    metric: str
    greater_is_better: bool
    origin: str


@dataclass(frozen=True)
class Run:
    run_dir: Path
    checkpoints: tuple[Checkpoint, ...]  # ascending step
    policy: Policy
    best: Checkpoint | None
    latest: Checkpoint | None  # newest complete checkpoint
    recorded_best: Checkpoint | None  # trainer_state.json's best_model_checkpoint, resolved in this folder
    recorded_best_raw: str | None

    @property
    def complete(self) -> tuple[Checkpoint, ...]:
        return tuple(c for c in self.checkpoints if c.complete)

    def metric_names(self) -> list[str]:
        return sorted({k for c in self.checkpoints for k in c.metrics})

    def to_dict(self) -> dict[str, Any]:
        def row(c: Checkpoint) -> dict[str, Any]:
            return {"name": c.name, "path": str(c.path), "step": c.step, "status": c.status, "kind": c.kind,
                    "reason": c.reason or None, "size": c.size, "metrics": {k: _json_float(v) for k, v in
                                                                            c.metrics.items()},
                    "best": c is self.best, "latest": c is self.latest}

        return {"run_dir": str(self.run_dir), "metric": self.policy.metric,
                "greater_is_better": self.policy.greater_is_better, "policy_origin": self.policy.origin,
                "best": str(self.best.path) if self.best else None,
                "latest": str(self.latest.path) if self.latest else None,
                "recorded_best": str(self.recorded_best.path) if self.recorded_best else None,
                "recorded_best_raw": self.recorded_best_raw, "checkpoints": [row(c) for c in self.checkpoints]}


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


# -- completeness -------------------------------------------------------------------------------------------------
def checkpoint_status(folder: Path) -> tuple[str, str | None, str]:
    """``(status, kind, reason)`` of one checkpoint folder; see the module docstring. Reads no tensor data."""
    from engine import checkpoint_format as spec

    from .errors import CheckpointIncompleteError
    from .readers.locate import _locate_in_save_dir

    if (folder / "latest").is_file():
        try:
            tag_dir = _locate_in_save_dir(folder, None, "hf-checkpoint").tag_dir
        except (SourceNotFoundError, CheckpointIncompleteError) as exc:
            return "incomplete", None, str(exc)
        if not spec.is_ours(tag_dir):
            return "complete", "deepspeed", ""
        try:
            manifest = spec.read_manifest(tag_dir)
        except spec.FormatError as exc:
            return "incomplete", None, str(exc)
        has_optim = any(meta.role == "optim" for meta in manifest.files.values())
        return "complete", "engine" if has_optim or not manifest.state_keys else "engine-weights", ""
    weights = _weights_status(folder)
    if weights is not None:
        return weights
    if any((folder / name).exists() for name in (TRAINER_STATE, "config.json")) or \
            any(p.name.startswith(".") and ".tmp-" in p.name for p in folder.iterdir()) or \
            any(p.is_dir() and p.name.startswith("global_step") for p in folder.iterdir()):
        return "incomplete", None, f"{folder} has no 'latest' file and no model weights (an interrupted save?)"
    return "unknown", None, f"{folder} holds nothing zckpt recognises as a checkpoint"


def _weights_status(folder: Path) -> tuple[str, str | None, str] | None:
    """Weights-only saves (Transformers' ``save_only_model``): None when the folder has no weights file at all."""
    from .safetensors_header import HeaderError, read_header

    for index_name in _WEIGHT_INDEXES:
        index = folder / index_name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return "incomplete", None, f"{index} is unreadable"
            missing = sorted(s for s in shards if not (folder / s).is_file())
            if missing:
                return "incomplete", None, f"{index} names missing shard(s): {', '.join(missing[:3])}"
            return "complete", "weights", ""
    for name in _WEIGHTS:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                try:
                    read_header(path)
                except (HeaderError, OSError) as exc:
                    return "incomplete", None, f"{path}: {exc}"
            elif path.stat().st_size == 0:
                return "incomplete", None, f"{path} is empty"
            return "complete", "weights", ""
    return None


def _folder_size(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


# -- trainer_state.json -------------------------------------------------------------------------------------------
def read_trainer_state(folder: Path) -> dict[str, Any] | None:
    """``folder/trainer_state.json`` as a dict, or None when absent or unreadable (an interrupted write)."""
    try:
        state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def eval_metrics(log_history: list) -> dict[int, dict[str, float]]:
    """``step -> {eval_name: value}`` from a ``log_history`` (later entries of a step override earlier ones)."""
    out: dict[int, dict[str, float]] = {}
    for entry in log_history if isinstance(log_history, list) else ():
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            continue
        for key, value in entry.items():
            if key.startswith("eval_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(entry["step"], {})[key] = float(value)
    return out


def metric_key(name: str) -> str:
    """Transformers' rule: ``metric_for_best_model`` gets an ``eval_`` prefix when it lacks one."""
    return name if name.startswith("eval_") else f"eval_{name}"


def default_greater_is_better(metric: str) -> bool:
    """``TrainingArguments.__post_init__``: ``greater_is_better = not metric_for_best_model.endswith("loss")``."""
    return not metric.endswith("loss")


# -- the run ------------------------------------------------------------------------------------------------------
def checkpoint_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` for every ``checkpoint-N`` folder (not links), ascending step."""
    found = []
    for child in run_dir.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append((int(match.group(1)), child))
    return sorted(found)


def scan(run_dir: str | Path, metric: str | None = None, greater_is_better: bool | None = None) -> Run:
    """Read a run folder: its checkpoints, their metrics, the policy, the best and the newest. No tensor I/O."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SourceNotFoundError(f"{run_dir} is not a folder; pass a run folder holding checkpoint-N/ folders")
    folders = checkpoint_folders(run_dir)
    if not folders:
        hint = " (it is one checkpoint; pass its parent)" if CHECKPOINT_RE.match(run_dir.name) else ""
        raise SourceNotFoundError(f"{run_dir} holds no checkpoint-N/ folders{hint}; pass the run's output folder")
    statuses = [checkpoint_status(folder) for _, folder in folders]
    history, newest_state = merged_history([f for (_, f), st in zip(folders, statuses) if st[0] == "complete"])
    checkpoints = []
    for (step, folder), (status, kind, reason) in zip(folders, statuses):
        checkpoints.append(Checkpoint(folder.name, folder, step, status, kind, reason, dict(history.get(step, {})),
                                      _folder_size(folder)))
    policy = resolve_policy(run_dir, folders, newest_state, history, metric, greater_is_better)
    best = pick_best(checkpoints, policy)
    complete = [c for c in checkpoints if c.complete]
    raw = newest_state.get("best_model_checkpoint")
    recorded = resolve_recorded(run_dir, raw, checkpoints)
    return Run(run_dir, tuple(checkpoints), policy, best, complete[-1] if complete else None, recorded,
               raw if isinstance(raw, str) else None)


def merged_history(folders: list[Path]) -> tuple[dict[int, dict[str, float]], dict[str, Any]]:
    """``(step -> eval metrics, newest trainer_state)`` over the ``trainer_state.json`` of ``folders`` (complete
    checkpoints only: an interrupted save's file may belong to an abandoned run); a newer file wins a step."""
    states = [st for st in (read_trainer_state(f) for f in folders) if st is not None]
    states.sort(key=lambda st: st.get("global_step") if isinstance(st.get("global_step"), int) else -1)
    history: dict[int, dict[str, float]] = {}
    for state in states:
        for step, values in eval_metrics(state.get("log_history", [])).items():
            history.setdefault(step, {}).update(values)
    return history, states[-1] if states else {}


def resolve_recorded(run_dir: Path, raw: Any, checkpoints: list[Checkpoint]) -> Checkpoint | None:
    """The checkpoint ``best_model_checkpoint`` names, matched by its folder name inside ``run_dir`` as it is now
    (the run may have been moved or copied since; the recorded path may be relative to another working dir)."""
    if not isinstance(raw, str) or not raw:
        return None
    name = Path(raw.rstrip("/\\").replace("\\", "/")).name
    return next((c for c in checkpoints if c.name == name and c.path.parent == run_dir), None)


def resolve_policy(run_dir: Path, folders: list[tuple[int, Path]], newest_state: dict,
                   history: dict[int, dict[str, float]], metric: str | None,
                   greater_is_better: bool | None) -> Policy:
    """The metric and direction: the caller's, else ``zckpt_best.json``, else inferred from trainer_state.json,
    else ``eval_loss`` (the module docstring has the order)."""
    saved = _read_policy_file(run_dir, folders)
    if metric is not None:
        name, origin = metric_key(metric), "--metric"
    elif saved is not None:
        name, origin = saved[0], str(saved[2])
    else:
        inferred = _infer_metric(newest_state, history)
        name, origin = (inferred, "inferred from trainer_state.json best_metric") if inferred else \
            ("eval_loss", "default (Transformers' metric_for_best_model)")
    if greater_is_better is not None:
        return Policy(name, greater_is_better, origin)
    if saved is not None and saved[0] == name and saved[1] is not None:
        return Policy(name, saved[1], origin)
    return Policy(name, default_greater_is_better(name), origin)


def _read_policy_file(run_dir: Path, folders: list[tuple[int, Path]]) -> tuple[str, bool | None, Path] | None:
    for path in [run_dir / POLICY_FILE] + [f / POLICY_FILE for _, f in reversed(folders)]:
        try:
            obj = json.loads(path.read_text())
            name = obj["metric_for_best_model"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(name, str) and name:
            gib = obj.get("greater_is_better")
            return metric_key(name), gib if isinstance(gib, bool) else None, path
    return None


def _infer_metric(state: dict, history: dict[int, dict[str, float]]) -> str | None:
    best_metric, best_step = state.get("best_metric"), state.get("best_global_step")
    if not isinstance(best_metric, (int, float)) or not isinstance(best_step, int):
        return None
    values = history.get(best_step, {})
    names = sorted(values, key=lambda k: (k != "eval_loss", k))
    return next((k for k in names if values[k] == best_metric), None)


def pick_best(checkpoints: list[Checkpoint] | tuple[Checkpoint, ...], policy: Policy) -> Checkpoint | None:
    """Transformers' ``_determine_best_metric`` over the complete checkpoints holding the metric, in step order:
    strictly greater (or less) than the best so far, from -inf (+inf); ties keep the earlier one, NaN never wins."""
    best, best_value = None, -math.inf if policy.greater_is_better else math.inf
    for ckpt in sorted(checkpoints, key=lambda c: c.step):
        value = ckpt.metrics.get(policy.metric)
        if not ckpt.complete or value is None:
            continue
        if (value > best_value) if policy.greater_is_better else (value < best_value):
            best, best_value = ckpt, value
    return best


def require_best(run: Run) -> Checkpoint:
    """The best checkpoint, or a one-line error saying why there is none and what to pass."""
    if run.best is not None:
        return run.best
    complete = run.complete
    if not complete:
        raise SourceNotFoundError(f"{run.run_dir} has no complete checkpoint (found: "
                                  f"{', '.join(c.name for c in run.checkpoints)})")
    names = run.metric_names()
    if run.policy.metric not in names:
        avail = ", ".join(names) if names else "none: no eval_* entries in any trainer_state.json log_history"
        raise InvalidArgumentError(f"no checkpoint in {run.run_dir} has metric {run.policy.metric!r} "
                                   f"({run.policy.origin}); pass --metric with one of: {avail}")
    raise InvalidArgumentError(f"no complete checkpoint in {run.run_dir} has a usable {run.policy.metric} value "
                               f"(missing at their steps, or NaN); pass another --metric")


def best_path(run_dir: str | Path, metric: str | None = None, greater_is_better: bool | None = None) -> Path:
    """Path of the best checkpoint folder of a run (raises when there is none)."""
    return require_best(scan(run_dir, metric, greater_is_better)).path


# -- rotation -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RotationPlan:
    run_dir: Path
    keep_limit: int
    keep: tuple[Checkpoint, ...]
    delete: tuple[Checkpoint, ...]
    protected: dict[str, str]  # name -> why ("newest", "best", "recorded best")
    untouched: tuple[Checkpoint, ...]  # incomplete / unknown: never counted, never deleted

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "keep_limit": self.keep_limit,
                "keep": [c.name for c in self.keep], "delete": [c.name for c in self.delete],
                "protected": dict(self.protected),
                "untouched": [{"name": c.name, "status": c.status, "reason": c.reason} for c in self.untouched]}


def plan_rotation(run: Run, save_total_limit: int) -> RotationPlan:
    """Which complete checkpoints ``rotate_checkpoints(save_total_limit=...)`` deletes; see the module docstring."""
    if save_total_limit < 1:
        raise InvalidArgumentError(f"--keep must be at least 1 (got {save_total_limit}): the newest checkpoint is "
                                   f"always kept")
    complete = list(run.complete)
    protected: dict[str, str] = {}
    if run.latest is not None:
        protected[run.latest.name] = "newest"
    for ckpt, why in ((run.best, "best"), (run.recorded_best, "recorded best")):
        if ckpt is not None and ckpt.complete:
            protected.setdefault(ckpt.name, why)
    num_to_keep = max(save_total_limit, len(protected))
    remaining, delete = len(complete), []
    for ckpt in complete:
        if remaining <= num_to_keep:
            break
        if ckpt.name not in protected:
            delete.append(ckpt)
            remaining -= 1
    keep = tuple(c for c in complete if c not in delete)
    untouched = tuple(c for c in run.checkpoints if not c.complete)
    return RotationPlan(run.run_dir, save_total_limit, keep, tuple(delete), protected, untouched)


def apply_rotation(plan: RotationPlan) -> list[Path]:
    """Delete the plan's checkpoints: each is re-checked (still complete), renamed out of the ``checkpoint-N``
    namespace first (a crash mid-delete leaves a ``.zckpt-deleting-*`` folder, never a half checkpoint-N), then
    removed. Leftovers of an earlier interrupted delete are removed too. Returns the deleted folders."""
    deleted = []
    for ckpt in plan.delete:
        if not ckpt.path.is_dir() or checkpoint_status(ckpt.path)[0] != "complete":
            continue
        trash = Path(tempfile.mkdtemp(prefix=f"{DELETING_PREFIX}{ckpt.name}-", dir=plan.run_dir))
        os.rename(ckpt.path, trash / ckpt.name)
        shutil.rmtree(trash)
        deleted.append(ckpt.path)
    for leftover in plan.run_dir.glob(f"{DELETING_PREFIX}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
    return deleted


# -- text for the CLI ---------------------------------------------------------------------------------------------
def _fmt_metric(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def render_run(run: Run) -> str:
    """The ``zckpt list`` table: one row per checkpoint folder, best and latest marked."""
    from .report import human_bytes

    others = [m for m in run.metric_names() if m != run.policy.metric
              and not m.endswith(("_runtime", "_per_second"))][:3]
    head = ["step", "checkpoint", "status", "size", run.policy.metric] + others + ["marks"]
    rows = []
    for c in run.checkpoints:
        marks = [m for m, on in (("best", c is run.best), ("latest", c is run.latest),
                                 ("recorded-best", c is run.recorded_best and c is not run.best)) if on]
        kind = f" ({c.kind})" if c.kind else ""
        rows.append([str(c.step), c.name, f"{c.status}{kind}", human_bytes(c.size),
                     _fmt_metric(c.metrics.get(run.policy.metric))]
                    + [_fmt_metric(c.metrics.get(m)) for m in others] + [",".join(marks)])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines += [f"{c.name} is {c.status}: {c.reason}" for c in run.checkpoints if not c.complete]
    direction = "higher" if run.policy.greater_is_better else "lower"
    lines.append(f"best by {run.policy.metric} ({direction} is better; {run.policy.origin}): "
                 f"{run.best.name if run.best else 'none'}")
    if run.recorded_best_raw is not None and run.recorded_best is not run.best:
        found = run.recorded_best.name if run.recorded_best else "not found in this folder"
        lines.append(f"trainer_state.json records best_model_checkpoint={run.recorded_best_raw} ({found})")
    return "\n".join(lines)


def render_plan(plan: RotationPlan) -> str:
    """The ``zckpt prune`` plan, printed before anything is deleted."""
    lines = [f"keep at most {plan.keep_limit} complete checkpoint(s) in {plan.run_dir}:"]
    for c in plan.keep:
        why = plan.protected.get(c.name)
        lines.append(f"  keep    {c.name}" + (f" ({why})" if why else ""))
    for c in plan.delete:
        lines.append(f"  delete  {c.name}")
    for c in plan.untouched:
        lines.append(f"  leave   {c.name} ({c.status}, not counted)")
    if not plan.delete:
        lines.append("nothing to delete")
    return "\n".join(lines)
