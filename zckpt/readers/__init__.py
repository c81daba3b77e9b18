"""Readers: one module per source format, each turning a located tag folder into a CheckpointPlan."""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceNotFoundError
from ..plan import CheckpointPlan
from .locate import Located, locate


def read_plan(located: Located) -> CheckpointPlan:
    """Dispatch on the tag folder's contents."""
    tag_dir = located.tag_dir
    if (tag_dir / "manifest.json").is_file():
        from .engine_native import read_engine_plan

        from dataclasses import replace

        plan = read_engine_plan(tag_dir)
        model_dir = str(located.model_dir) if located.model_dir else plan.model_dir
        return replace(plan, source=str(located.src), tag=located.tag, model_dir=model_dir)
    from .deepspeed import is_deepspeed_tag_dir, read_deepspeed_plan

    if is_deepspeed_tag_dir(tag_dir):
        return read_deepspeed_plan(located)
    raise SourceNotFoundError(f"{tag_dir} holds no checkpoint format zckpt knows")


def open_plan(src: str | Path, tag: str | None = None, *, exclude_frozen: bool = False) -> CheckpointPlan:
    """Locate SRC, read its metadata, and validate every tensor's coverage. Reads no tensor bytes."""
    plan = read_plan(locate(src, tag))
    for tensor in plan.tensors:
        try:
            tensor.validate()
        except ValueError as exc:
            from ..errors import CheckpointCorruptError

            raise CheckpointCorruptError(f"{plan.source}: {exc}") from None
    return plan.without_frozen() if exclude_frozen else plan


__all__ = ["Located", "locate", "open_plan", "read_plan"]
