"""Writer: a plan with training state -> DeepSpeed's universal checkpoint, which DeepSpeed resumes from at any world
size and ZeRO stage with ``"checkpoint": {"load_universal": true}``.

The layout is what DeepSpeed 0.19.8's ``deepspeed/checkpoint/ds_to_universal.py`` writes and what its loaders read
(``runtime/engine.py`` ``load_checkpoint``, ``checkpoint/universal_checkpoint.py`` ``load_hp_checkpoint_state`` for
stages 1/2 and the bf16 optimizer, ``runtime/zero/stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)::

    OUT/latest, OUT/latest_universal                 the tag (DeepSpeed reads latest_universal when load_universal)
    OUT/<tag>/mp_rank_00_model_states.pt             model states: param_shapes, counters, scheduler, ds_config,
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   ... universal_checkpoint_info (the stage-3 loader's name)
    OUT/<tag>/zero/optimizer_state.pt                param groups (hyper-parameters) and the step, both loaders' keys
    OUT/<tag>/zero/<param>/fp32.pt                   {"cat_dim": 0, "param": fp32 master, the parameter's shape}
    OUT/<tag>/zero/<param>/exp_avg.pt, exp_avg_sq.pt  the same for every per-parameter optimizer state
    OUT/<tag>/zero/<param>/step.pt                   the group's step, the bare tensor (the loader assigns it as is)
    OUT/<tag>/zero/<name>/fp32.pt                    {"param": value as fp32} for tied aliases, buffers and frozen
                                                     parameters, as ds_to_universal's module fallback writes them

Each per-parameter tensor is assembled from the plan's fragments with positioned reads into its own memory and saved
by ``torch.save`` (bit-identical to ds_to_universal's, which concatenates the same bytes), then fsynced. Jobs run in
a thread pool; memory is one tensor per worker.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..assemble import FileCache
from ..errors import CheckpointCorruptError, UnsupportedCheckpointError
from ..plan import CheckpointPlan, TensorPlan
from ..tensors import DTYPES, read_tensor
from ..universal_spec import CAT_DIM, FP32, LATEST, MODEL_STATES, OPTIMIZER_STATE, PARAM, STEP, ZERO_DIR, is_folder_name
from .deepspeed_common import ds_version, fsync_path, model_states, save_pickle, torch_hparams



@dataclass
class UniversalResult:
    tag: str
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0


def check_universal(plan: CheckpointPlan) -> None:
    """Everything the output needs, checked before the first byte: optimizer state, a step per group, and names
    that are safe as folder names."""
    from .engine_native import require_training_state

    require_training_state(plan)
    for t in plan.tensors:
        if not is_folder_name(t.name):
            raise CheckpointCorruptError(f"{plan.source}: tensor name {t.name!r} cannot be a folder name under "
                                         f"zero/; the checkpoint's metadata is corrupt")
    for g in {t.group for t in plan.trainable()}:
        if _step_plan(plan, g) is None and not isinstance(plan.training.groups[g].hparams.get("step"), (int, float)):
            raise UnsupportedCheckpointError(
                f"{plan.source}: optimizer group {g} records no step, which DeepSpeed's universal loader needs "
                f"(step.pt); only optimizers with a per-group step (Adam, AdamW) can be written as universal")


def _step_plan(plan: CheckpointPlan, group: int) -> TensorPlan | None:
    groups = plan.training.groups
    if group >= len(groups):
        return None
    return next((s for s in groups[group].scalars if s.name == "step"), None)


def _steps(plan: CheckpointPlan, files: FileCache) -> dict[int, torch.Tensor]:
    """Each optimizer group's step as DeepSpeed's torch Adam keeps it: a 0-dim tensor (fp32 on CPU)."""
    out = {}
    for g in sorted({t.group for t in plan.trainable()}):
        scalar = _step_plan(plan, g)
        out[g] = (read_tensor(scalar, files) if scalar is not None
                  else torch.tensor(float(plan.training.groups[g].hparams["step"])))
    return out


def _lp_value(plan: CheckpointPlan, t: TensorPlan, files: FileCache) -> torch.Tensor:
    """What DeepSpeed's ``module`` holds for ``t``: trainable parameters at the training dtype (the fp32 master
    rounded as the optimizer copies it back), others as stored."""
    value = read_tensor(t, files)
    if t.kind == "param" and plan.train_dtype != "float32":
        value = value.to(DTYPES[plan.train_dtype])
    return value


class _Jobs:
    """The write jobs of one output, run by a thread pool (each job writes one parameter's folder)."""

    def __init__(self, plan: CheckpointPlan, zero: Path, progress: Callable[[int], None]):
        self.plan, self.zero, self.progress = plan, zero, progress
        self.files = FileCache()
        self.steps = _steps(plan, self.files)

    def param(self, t: TensorPlan) -> list[tuple[Path, int]]:
        folder = self.zero / t.name
        folder.mkdir()
        written = []
        for key, sub in ((FP32, t), *((s.key, t.state_tensor(s.key)) for s in t.state)):
            tensor = read_tensor(sub, self.files)
            path = folder / f"{key}.pt"
            written.append((path, save_pickle({CAT_DIM: 0, PARAM: tensor}, path)))
            self.progress(sub.nbytes)
            del tensor
        path = folder / f"{STEP}.pt"
        written.append((path, save_pickle(self.steps[t.group].clone(), path)))
        fsync_path(folder)
        return written

    def fallback(self, name: str, t: TensorPlan) -> list[tuple[Path, int]]:
        """ds_to_universal's module fallback: ``{"param": module[name].float()}`` for names without a folder."""
        folder = self.zero / name
        folder.mkdir()
        path = folder / f"{FP32}.pt"
        size = save_pickle({PARAM: _lp_value(self.plan, t, self.files).float()}, path)
        fsync_path(folder)
        return [(path, size)]


def _fallback_names(plan: CheckpointPlan) -> list[tuple[str, TensorPlan]]:
    """(folder name, tensor) of the names DeepSpeed's ``module`` holds beside the trainable parameters: buffers,
    frozen parameters, and tied aliases (valued as their stored parameter)."""
    by_name = {t.name: t for t in plan.tensors}
    out = [(t.name, t) for t in plan.tensors if t.kind != "param"]
    out += [(alias, by_name[canonical]) for alias, canonical in plan.aliases.items() if canonical in by_name]
    return out


def _module(plan: CheckpointPlan, files: FileCache) -> dict[str, torch.Tensor]:
    """The model-states ``module``: buffers and frozen parameters as stored. Trainable weights are left out: a
    universal load restores them from zero/ and never reads ``module``; keeping it small keeps the output fast."""
    return OrderedDict((t.name, read_tensor(t, files)) for t in plan.tensors if t.kind != "param")


def _optimizer_state(plan: CheckpointPlan, steps: dict[int, torch.Tensor]) -> dict:
    """``zero/optimizer_state.pt``: the keys both universal loaders read -- ``param_groups`` (stages 1/2, bf16) and
    ``optimizer_state_dict`` with ``state[0]["step"]`` and ``param_groups`` (stage 3) -- plus ``ds_version`` and
    ``zero_stage``. Loss-scaler and clipping state are left to the resuming run's config."""
    groups = []
    for g in plan.training.groups:
        groups.append({**torch_hparams(g.hparams), "params": [g.index]})
    state = {g: {"step": step.clone()} for g, step in steps.items()}
    return {"zero_stage": plan.stage, "ds_version": ds_version(plan),
            "param_groups": groups, "optimizer_state_dict": {"state": state, "param_groups": groups}}


def written_bytes(plan: CheckpointPlan) -> int:
    """Bytes the writer reads from the source (for progress bars): every trainable tensor and its states."""
    return sum(t.nbytes + sum(t.state_tensor(s.key).nbytes for s in t.state) for t in plan.trainable())


def write_universal_checkpoint(plan: CheckpointPlan, folder: Path, *, world_size: int, workers: int = 8,
                               progress: Callable[[int], None] = lambda n: None) -> UniversalResult:
    """Write the universal checkpoint of ``plan`` into the existing, empty ``folder`` (a staging save dir)."""
    check_universal(plan)
    tag_dir = folder / plan.tag
    zero = tag_dir / ZERO_DIR
    zero.mkdir(parents=True)
    jobs = _Jobs(plan, zero, progress)
    params = set(t.name for t in plan.trainable())
    fallback = [(n, t) for n, t in _fallback_names(plan) if n not in params]
    written: list[tuple[Path, int]] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="zckpt-universal") as pool:
            futures = [pool.submit(jobs.param, t) for t in plan.trainable()]
            futures += [pool.submit(jobs.fallback, n, t) for n, t in fallback]
            for fut in futures:
                written.extend(fut.result())
        path = zero / OPTIMIZER_STATE
        written.append((path, save_pickle(_optimizer_state(plan, jobs.steps), path)))
        frozen = {t.name: t.shape for t in plan.tensors if t.kind == "frozen"}
        states = model_states(plan, _module(plan, jobs.files), dp_world_size=world_size, frozen_shapes=frozen)
        for name in MODEL_STATES:
            written.append((tag_dir / name, save_pickle(states, tag_dir / name)))
    finally:
        jobs.files.close()
    fsync_path(zero)
    fsync_path(tag_dir)
    for name in LATEST:  # DeepSpeed writes the bare tag, no newline
        (folder / name).write_text(plan.tag)
        written.append((folder / name, len(plan.tag)))
    return UniversalResult(plan.tag, sorted(str(p.relative_to(folder)) for p, _ in written),
                           sum(size for _, size in written))
