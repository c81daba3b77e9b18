"""Writers: one module per target format, each consuming a :class:`~zckpt.plan.CheckpointPlan`.

A writer is a small object with a ``name``, ``needs`` ("weights" or "training": what of the plan it consumes), the
``total_bytes`` it will read (for progress bars) and ``write(plan, folder, progress, **options)``, which fills an
existing, empty (staging) folder. A writer never knows the source format; :data:`WRITERS` is the registry, by name.
Staging, fsync and the final rename are the caller's (:mod:`zckpt.outdir`), the same for every target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from ..plan import CheckpointPlan


class Writer(Protocol):
    name: str
    needs: str

    def total_bytes(self, plan: CheckpointPlan, **options: Any) -> int: ...

    def write(self, plan: CheckpointPlan, folder: Path, progress: Callable[[int], None], **options: Any) -> Any: ...


class HFSafetensorsWriter:
    """HF model folder: ``model*.safetensors`` (+ index) at ``dtype``, config and tokenizer files beside them.
    Options: ``dtype``, ``max_shard_size``, ``workers``."""

    name, needs = "hf", "weights"

    def total_bytes(self, plan: CheckpointPlan, **options: Any) -> int:
        return sum(t.nbytes for t in plan.tensors)

    def write(self, plan: CheckpointPlan, folder: Path, progress: Callable[[int], None], *, dtype: str | None,
              max_shard_size: int, workers: int | None = None):
        from .hf_safetensors import copy_model_files, write_weights

        result = write_weights(plan, folder, dtype, max_shard_size=max_shard_size, progress=progress, workers=workers)
        result.copied = copy_model_files(Path(plan.model_dir) if plan.model_dir else None, folder, dtype)
        return result


class EngineNativeWriter:
    """Engine save dir for N ranks: ``<tag>/`` (per-rank safetensors, manifest, COMMITTED) and ``latest``, with the
    source's config and tokenizer files. Options: ``target`` (:class:`~zckpt.writers.engine_native.Target`),
    ``workers``."""

    name, needs = "engine", "training"

    def total_bytes(self, plan: CheckpointPlan, *, target, **options: Any) -> int:
        from .engine_native import layout_for, written_bytes

        return written_bytes(plan, layout_for(plan, target))

    def write(self, plan: CheckpointPlan, folder: Path, progress: Callable[[int], None], *, target,
              workers: int = 4):
        from .engine_native import write_engine_checkpoint
        from .hf_safetensors import copy_model_files

        manifest = write_engine_checkpoint(plan, folder, target, workers=workers, progress=progress)
        copy_model_files(Path(plan.model_dir) if plan.model_dir else None, folder, None)
        return manifest


class DeepSpeedUniversalWriter:
    """DeepSpeed universal checkpoint (``<tag>/zero/<param>/fp32.pt, exp_avg.pt, ...``, model states,
    ``latest_universal``) that DeepSpeed resumes from at any world size with ``load_universal``. Options: ``target``
    (its ``world_size`` is recorded as ``dp_world_size``), ``workers``."""

    name, needs = "universal", "training"

    def total_bytes(self, plan: CheckpointPlan, **options: Any) -> int:
        from .deepspeed_universal import check_universal, written_bytes

        check_universal(plan)
        return written_bytes(plan)

    def write(self, plan: CheckpointPlan, folder: Path, progress: Callable[[int], None], *, target,
              workers: int = 8):
        from .deepspeed_universal import write_universal_checkpoint
        from .hf_safetensors import copy_model_files

        result = write_universal_checkpoint(plan, folder, world_size=target.world_size, workers=workers,
                                            progress=progress)
        copy_model_files(Path(plan.model_dir) if plan.model_dir else None, folder, None)
        return result


class DeepSpeedNativeWriter:
    """Plain DeepSpeed ZeRO save dir for N ranks (``<tag>/`` with DeepSpeed's model-states and optimizer files,
    ``latest``) that DeepSpeed's ordinary ``load_checkpoint`` resumes, with the source's config and tokenizer files.
    Options: ``target`` (:class:`~zckpt.writers.deepspeed_native.DeepSpeedTarget`), ``workers``."""

    name, needs = "deepspeed", "training"

    def total_bytes(self, plan: CheckpointPlan, *, target, **options: Any) -> int:
        from .deepspeed_native import check_plan, layout_of, total_bytes

        check_plan(plan)
        layout_of(plan, target)  # its errors come before any byte
        return total_bytes(plan, target)

    def write(self, plan: CheckpointPlan, folder: Path, progress: Callable[[int], None], *, target,
              workers: int = 4):
        from .deepspeed_native import write_deepspeed_checkpoint
        from .hf_safetensors import copy_model_files

        result = write_deepspeed_checkpoint(plan, folder, target, workers=workers, progress=progress)
        copy_model_files(Path(plan.model_dir) if plan.model_dir else None, folder, None)
        return result


WRITERS: dict[str, Writer] = {w.name: w for w in (HFSafetensorsWriter(), EngineNativeWriter(),
                                                  DeepSpeedUniversalWriter(), DeepSpeedNativeWriter())}

__all__ = ["WRITERS", "Writer", "HFSafetensorsWriter", "EngineNativeWriter", "DeepSpeedUniversalWriter",
           "DeepSpeedNativeWriter"]
