"""The neutral middle: plain, frozen descriptions of a checkpoint. No I/O, no torch.

A reader turns a source (DeepSpeed ZeRO, engine-native, ...) into a :class:`CheckpointPlan`; a writer consumes it.
A plan says, for every output tensor, its name, shape and stored dtype, and which byte ranges of which files hold its
elements (:class:`Fragment`). Assembling a tensor is: allocate ``numel`` elements of ``dtype``, copy each fragment's
``numel`` elements from ``path`` at byte ``offset`` to element ``dest``, view as ``shape``. Fragments of one tensor
never overlap and together cover it exactly (:meth:`TensorPlan.validate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

#: Element sizes of the dtypes a plan may name (torch's names, without the ``torch.`` prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})

TensorKind = Literal["param", "frozen", "buffer"]


@dataclass(frozen=True)
class Fragment:
    """``numel`` contiguous elements stored at byte ``offset`` of ``path``, landing at element ``dest`` of the tensor."""

    path: str
    offset: int
    numel: int
    dest: int


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor and where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[Fragment, ...]
    kind: TensorKind = "param"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def validate(self) -> None:
        """Raise ValueError unless the fragments tile ``[0, numel)`` exactly."""
        covered = 0
        for frag in sorted(self.fragments, key=lambda f: f.dest):
            if frag.dest != covered or frag.numel < 0:
                raise ValueError(f"{self.name}: fragments leave a gap or overlap at element {covered}")
            covered += frag.numel
        if covered != self.numel:
            raise ValueError(f"{self.name}: fragments cover {covered} of {self.numel} elements")


@dataclass(frozen=True)
class SourceFile:
    """A file the checkpoint consists of, for ``inspect`` and integrity checks."""

    path: str
    role: str  # e.g. "model_states", "optim_states", "weights", "manifest"
    rank: int | None
    size: int | None  # None when missing


@dataclass(frozen=True)
class CheckpointPlan:
    """Everything a writer needs, and everything ``inspect`` prints."""

    source: str
    format: str  # "deepspeed" | "engine"
    stage: int
    world_size: int
    train_dtype: str  # "float32" | "bfloat16" | "float16"
    tag: str
    step: int | None
    tensors: tuple[TensorPlan, ...]
    #: tied parameters not stored separately: alias name -> canonical name (e.g. lm_head.weight -> embed_tokens.weight)
    aliases: dict[str, str] = field(default_factory=dict)
    files: tuple[SourceFile, ...] = ()
    #: folder holding config.json / tokenizer files to copy beside the weights, if any
    model_dir: str | None = None
    version: str | None = None  # writer version (e.g. DeepSpeed's ds_version)

    def __iter__(self) -> Iterator[TensorPlan]:
        return iter(self.tensors)

    def without_frozen(self) -> "CheckpointPlan":
        from dataclasses import replace

        kept = tuple(t for t in self.tensors if t.kind != "frozen")
        names = {t.name for t in kept}
        return replace(self, tensors=kept, aliases={a: c for a, c in self.aliases.items() if c in names})

    def count(self, kind: TensorKind) -> int:
        return sum(t.numel for t in self.tensors if t.kind == kind)
