"""Readers: one module per source format, each turning a located tag folder into a CheckpointPlan.

A reader is a small object with a ``name``, a one-line ``marker`` (what its tag folders hold, for error messages),
``claims(tag_dir)`` -- "is this folder mine?", cheap, no tensor I/O -- and ``read(located)`` returning the plan.
:data:`READERS` is the registry: finding a folder's format is a loop over it, and adding a format is adding a module
and one line here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointCorruptError, SourceNotFoundError, source_os_error
from ..plan import CheckpointPlan
from .locate import Located, locate


class Reader(Protocol):
    name: str
    marker: str

    def claims(self, tag_dir: Path) -> bool: ...

    def read(self, located: Located) -> CheckpointPlan: ...


class EngineNativeReader:
    name, marker = "engine", "manifest.json"

    def claims(self, tag_dir: Path) -> bool:
        return (tag_dir / "manifest.json").is_file()

    def read(self, located: Located) -> CheckpointPlan:
        from .engine_native import read_engine_plan

        plan = read_engine_plan(located.tag_dir)
        model_dir = str(located.model_dir) if located.model_dir else plan.model_dir
        return replace(plan, source=str(located.src), tag=located.tag, model_dir=model_dir)


class DeepSpeedReader:
    name, marker = "deepspeed", "*_model_states.pt"

    def claims(self, tag_dir: Path) -> bool:
        return any(tag_dir.glob("*_model_states.pt")) or any(tag_dir.glob("*_optim_states.pt"))

    def read(self, located: Located) -> CheckpointPlan:
        from .deepspeed import read_deepspeed_plan

        return read_deepspeed_plan(located)


class DeepSpeedUniversalReader:
    """Before :class:`DeepSpeedReader`: a universal tag folder also holds ``*_model_states.pt``."""

    name, marker = "deepspeed-universal", "zero/optimizer_state.pt"

    def claims(self, tag_dir: Path) -> bool:
        from .deepspeed_universal import is_universal_tag_dir

        return is_universal_tag_dir(tag_dir)

    def read(self, located: Located) -> CheckpointPlan:
        from .deepspeed_universal import read_universal_plan

        return read_universal_plan(located)


READERS: tuple[Reader, ...] = (EngineNativeReader(), DeepSpeedUniversalReader(), DeepSpeedReader())


def reader_for(tag_dir: Path) -> Reader | None:
    """The first reader that claims ``tag_dir`` (None when no format does)."""
    if not tag_dir.is_dir():
        return None
    return next((r for r in READERS if r.claims(tag_dir)), None)


def markers() -> str:
    return " or ".join(r.marker for r in READERS)


def read_plan(located: Located) -> CheckpointPlan:
    """The plan of a located tag folder, by whichever reader claims it."""
    reader = reader_for(located.tag_dir)
    if reader is None:
        raise SourceNotFoundError(f"{located.tag_dir} holds no checkpoint format zckpt knows (no {markers()})")
    return reader.read(located)


def open_plan(src: str | Path, tag: str | None = None, *, exclude_frozen: bool = False) -> CheckpointPlan:
    """Locate SRC, read its metadata, and validate every tensor's coverage. Reads no tensor bytes.

    Raises only :mod:`zckpt.errors` types: an OS error reading the source becomes
    :class:`~zckpt.errors.SourceUnreadableError` naming the file."""
    try:
        plan = read_plan(locate(src, tag))
    except OSError as exc:
        raise source_os_error(exc) from None
    for tensor in plan.tensors:
        try:
            tensor.validate()
        except ValueError as exc:
            raise CheckpointCorruptError(f"{plan.source}: {exc}") from None
    return plan.without_frozen() if exclude_frozen else plan


__all__ = ["READERS", "Located", "Reader", "locate", "open_plan", "read_plan", "reader_for"]
