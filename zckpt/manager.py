"""``CheckpointManager``: Transformers' checkpoint policy (``save_total_limit``, ``metric_for_best_model``,
``load_best_model_at_end``) for training scripts on the engine, or beside a real DeepSpeed engine.

Layout (what Transformers' Trainer writes, so that ``zckpt list/best/prune`` and Transformers read it alike)::

    run_dir/checkpoint-{step}/latest                 # the engine's own save dir: `latest` + tag folder
    run_dir/checkpoint-{step}/global_step{step}/     # model_engine.save_checkpoint(checkpoint-{step}, tag=...)
    run_dir/checkpoint-{step}/trainer_state.json     # TrainerState.save_to_json's schema (global_step, best_*,
                                                     # log_history with the eval_* entries)
    run_dir/checkpoint-{step}/zckpt_best.json        # the metric and direction (TrainerState has no field for them)

Save protocol (:meth:`CheckpointManager.save`, collective):

1. every rank: ``model_engine.save_checkpoint`` -- committed (manifest + ``COMMITTED``, ``latest`` last) when it
   returns on any rank; ``save_only_model`` writes no optimizer files (engine) or a 16-bit ``model.safetensors``
   (another engine, e.g. DeepSpeed's ``save_16bit_model``);
2. rank 0: appends the evaluation to ``log_history``, picks the best with :func:`zckpt.registry.pick_best`
   (Transformers' comparison) among the run's *complete* checkpoints, writes ``trainer_state.json`` (temp file, fsync, rename);
3. rank 0: rotation (:func:`zckpt.registry.plan_rotation`) -- only now, after the new checkpoint is committed; it
   keeps the newest and the best, counts and deletes complete checkpoints only;
4. barrier.

An interrupted save leaves a ``checkpoint-{step}`` that is not complete: it is never counted, never best, never
deleted; the next save of that step replaces its tag.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import registry
from .errors import InvalidArgumentError, UnsupportedCheckpointError

# TrainerState's fields and defaults (transformers 5.24 trainer_callback.TrainerState), in save_to_json's order
_TRAINER_STATE_DEFAULTS: dict[str, Any] = {
    "best_global_step": None, "best_metric": None, "best_model_checkpoint": None, "epoch": None,
    "eval_steps": 500, "global_step": 0, "is_hyper_param_search": False, "is_local_process_zero": True,
    "is_world_process_zero": True, "log_history": [], "logging_steps": 500, "max_steps": 0,
    "num_input_tokens_seen": 0, "num_train_epochs": 0, "save_steps": 500, "stateful_callbacks": {},
    "total_flos": 0, "train_batch_size": None, "trial_name": None, "trial_params": None}


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _barrier() -> None:
    dist = _dist()
    if dist and dist.get_world_size() > 1:
        dist.barrier()


def _from_rank0(fn):
    """Run ``fn`` on rank 0 and hand its result (or its ZckptError, re-raised) to every rank."""
    dist = _dist()
    result: list[Any] = [None]
    if _rank() == 0:
        try:
            result = [("ok", fn())]
        except Exception as exc:  # noqa: BLE001 - every rank must leave the collective; re-raised below
            result = [("error", exc)]
    if dist and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "error":
        raise value
    return value


@dataclass(kw_only=True)
class CheckpointManager:
    """Checkpoints of one run, with TrainingArguments' names for the policy."""

    run_dir: str | Path
    """The run folder (TrainingArguments.output_dir): checkpoints go to ``run_dir/checkpoint-{step}``."""
    metric_for_best_model: str | None = None
    """Metric deciding the best checkpoint (``eval_`` is prefixed when missing, as Transformers does); None: no best
    tracking (rotation then keeps the newest only)."""
    greater_is_better: bool | None = None
    """Direction; default as TrainingArguments: lower is better for names ending in ``loss``."""
    save_total_limit: int | None = None
    """Complete checkpoints to keep (None or <= 0: keep all). The newest and the best are always kept."""
    save_only_model: bool = False
    """Weights only: no optimizer state (cannot resume training, can load_best)."""
    log_history: list[dict] = field(default_factory=list)
    """Transformers' ``log_history``; restored from the run's newest trainer_state.json when the run resumes."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.metric_for_best_model is not None:
            self.metric_for_best_model = registry.metric_key(self.metric_for_best_model)
            if self.greater_is_better is None:
                self.greater_is_better = registry.default_greater_is_better(self.metric_for_best_model)
        if not self.log_history and self.run_dir.is_dir():  # resuming: the newest complete checkpoint's history
            complete = [f for _, f in registry.checkpoint_folders(self.run_dir)
                        if registry.checkpoint_status(f)[0] == "complete"]
            self.log_history = list(registry.merged_history(complete)[1].get("log_history") or [])

    @classmethod
    def from_training_args(cls, args: Any, run_dir: str | Path | None = None) -> "CheckpointManager":
        """From a ``transformers.TrainingArguments`` (or anything with its attribute names)."""
        metric = getattr(args, "metric_for_best_model", None)
        if metric is None and getattr(args, "load_best_model_at_end", False):
            metric = "loss"  # TrainingArguments.__post_init__ does the same
        return cls(run_dir=run_dir if run_dir is not None else args.output_dir, metric_for_best_model=metric,
                   greater_is_better=getattr(args, "greater_is_better", None),
                   save_total_limit=getattr(args, "save_total_limit", None),
                   save_only_model=bool(getattr(args, "save_only_model", False)))

    # -- policy ---------------------------------------------------------------------------------------------------
    def _policy(self) -> registry.Policy | None:
        if self.metric_for_best_model is None:
            return None
        return registry.Policy(self.metric_for_best_model, bool(self.greater_is_better), "CheckpointManager")

    def _scan(self) -> registry.Run:
        return registry.scan(self.run_dir, self.metric_for_best_model, self.greater_is_better)

    def best(self) -> Path | None:
        """The best complete checkpoint folder so far (None without a metric or before any evaluation)."""
        if self.metric_for_best_model is None or not self.run_dir.is_dir() or \
                not registry.checkpoint_folders(self.run_dir):
            return None
        best = self._scan().best
        return best.path if best else None

    # -- save -----------------------------------------------------------------------------------------------------
    def save(self, model_engine: Any, step: int, metrics: dict[str, float] | None = None,
             epoch: float | None = None) -> Path:
        """Collective. Save ``run_dir/checkpoint-{step}`` (see the module docstring); ``metrics`` are this step's
        evaluation (``{"loss": 1.2}`` or ``{"eval_loss": 1.2}``). Returns the checkpoint folder."""
        if not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        entry = {registry.metric_key(k): float(v) for k, v in (metrics or {}).items()}
        if entry and self.metric_for_best_model is not None and self.metric_for_best_model not in entry:
            # Trainer._determine_best_metric raises the same way (KeyError) before saving
            raise InvalidArgumentError(f"metric_for_best_model {self.metric_for_best_model!r} is not in the metrics "
                                       f"passed to save() ({', '.join(entry)}); pass it, or change "
                                       f"metric_for_best_model")
        folder = self.run_dir / f"checkpoint-{step}"
        tag = f"global_step{step}"
        if self.save_only_model and _is_zckpt_engine(model_engine):
            model_engine.save_checkpoint(str(folder), tag=tag, exclude_optimizer_states=True)
        elif self.save_only_model:
            if model_engine.save_16bit_model(str(folder)) is False:  # DeepSpeed ZeRO-3 without the gather option
                raise UnsupportedCheckpointError(
                    f"{folder}: the engine wrote no 16-bit weights (DeepSpeed ZeRO-3 needs "
                    f"zero_optimization.stage3_gather_16bit_weights_on_model_save=true for save_only_model)")
        else:
            model_engine.save_checkpoint(str(folder), tag=tag)
        if entry:
            self.log_history.append({**entry, **({"epoch": epoch} if epoch is not None else {}), "step": step})
        if _rank() == 0:
            self._write_state(folder, step, epoch)
            self._rotate()
        _barrier()
        return folder

    def _write_state(self, folder: Path, step: int, epoch: float | None) -> None:
        best, best_value, best_step = None, None, None
        folder.mkdir(parents=True, exist_ok=True)  # present unless the engine wrote nothing (then: incomplete)
        policy = self._policy()
        if policy is not None:
            history = registry.eval_metrics(self.log_history)
            ckpts = [replace(c, metrics=history.get(c.step, {})) for c in self._scan().checkpoints]
            found = registry.pick_best(ckpts, policy)
            if found is not None:
                best, best_value, best_step = str(self.run_dir / found.name), found.metrics[policy.metric], found.step
            _write_json(folder / registry.POLICY_FILE, {"metric_for_best_model": policy.metric,
                                                        "greater_is_better": policy.greater_is_better})
        state = dict(_TRAINER_STATE_DEFAULTS, global_step=step, epoch=epoch, log_history=self.log_history,
                     best_metric=best_value, best_global_step=best_step, best_model_checkpoint=best,
                     save_steps=0, eval_steps=0)
        _write_json(folder / registry.TRAINER_STATE, state)

    def _rotate(self) -> list[Path]:
        if self.save_total_limit is None or self.save_total_limit <= 0:
            return []
        run = self._scan()
        if self.metric_for_best_model is None:  # no best tracking: Transformers protects the newest only
            run = replace(run, best=None, recorded_best=None)
        return registry.apply_rotation(registry.plan_rotation(run, self.save_total_limit))

    # -- load best ------------------------------------------------------------------------------------------------
    def load_best(self, model_engine: Any) -> Path:
        """Collective. Load the best checkpoint's weights into the running ``model_engine`` -- at its world size and
        ZeRO stage, whatever they were at save time (the engine reshards while loading) -- without rebuilding it.
        On the zckpt engine the optimizer state stays as it is (``load_module_only``); works from weights-only
        (``save_only_model``) checkpoints. On a DeepSpeed engine everything is loaded, as Transformers'
        ``load_best_model_at_end`` does there (``deepspeed_load_checkpoint``). The step counters are kept.
        Returns the folder."""
        if self.metric_for_best_model is None:
            raise InvalidArgumentError("load_best needs metric_for_best_model (CheckpointManager("
                                       "metric_for_best_model='loss') or TrainingArguments.load_best_model_at_end)")

        def pick():
            run = self._scan()
            best = registry.require_best(run)
            if best.kind == "weights":
                raise UnsupportedCheckpointError(
                    f"{best.path} holds a 16-bit model.safetensors only (save_only_model on a non-zckpt engine); "
                    f"load it with from_pretrained, or save with the zckpt engine")
            return str(best.path)

        path = _from_rank0(pick)
        counters = {k: getattr(model_engine, k) for k in ("global_steps", "global_samples", "micro_steps")
                    if hasattr(model_engine, k)}
        if _is_zckpt_engine(model_engine):
            model_engine.load_checkpoint(path, load_module_only=True)  # fp32 masters exactly, any size and stage
        else:
            # DeepSpeed's load_module_only rebuilds the fp32 masters from the 16-bit module weights (and at ZeRO-3
            # finds no module weights); Transformers' deepspeed_load_checkpoint loads everything: do the same
            model_engine.load_checkpoint(path, load_optimizer_states=True, load_lr_scheduler_states=True)
        for k, v in counters.items():
            setattr(model_engine, k, v)
        return Path(path)


def _is_zckpt_engine(model_engine: Any) -> bool:
    return type(model_engine).__module__.startswith("engine.")


def _write_json(path: Path, obj: dict) -> None:
    """Transformers' ``save_to_json`` text (indent 2, sorted keys), written durably: temp file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, default=_plain) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _plain(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")

