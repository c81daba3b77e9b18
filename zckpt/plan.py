"""The neutral middle: plain, frozen descriptions of a checkpoint. No I/O, no torch.

A reader turns a source (DeepSpeed ZeRO, engine-native, ...) into a :class:`CheckpointPlan`; a writer consumes it.
A plan says, for every output tensor, its name, shape and stored dtype, and which byte ranges of which files hold its
elements (:class:`Fragment`). Assembling a tensor is: allocate ``numel`` elements of ``dtype``, copy each fragment's
``numel`` elements from ``path`` at byte ``offset`` to element ``dest``, view as ``shape``. Fragments of one tensor
never overlap and together cover it exactly (:meth:`TensorPlan.validate`).

Beyond the weights, a plan describes the **training state** (:class:`TrainingState`), still as metadata only:

* per trainable parameter, its optimizer group and the fragments of every per-parameter optimizer state tensor
  (``TensorPlan.state``: ``exp_avg``, ``exp_avg_sq``, ... -- same shape as the parameter);
* per optimizer group, its hyper-parameters and its group-level state tensors (Adam's ``step``), as scalar
  :class:`TensorPlan` s read only by writers that need them;
* scheduler and loss-scaler state, step / sample counters and the client state, as JSON.

Weights-only consumers (consolidate) never look at any of it, so they read no more bytes than before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

#: The dtypes a plan may name (torch's names, without ``torch.``): element size and safetensors code. The one table.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "float16": (2, "F16"), "bfloat16": (2, "BF16"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"), "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}
DTYPE_SIZES: dict[str, int] = {name: size for name, (size, _) in DTYPES.items()}
SAFETENSORS_CODES: dict[str, str] = {name: code for name, (_, code) in DTYPES.items()}
DTYPES_BY_SAFETENSORS_CODE: dict[str, str] = {code: name for name, (_, code) in DTYPES.items()}
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
class StatePlan:
    """One per-parameter optimizer state tensor (e.g. ``exp_avg``): the parameter's shape, its own dtype and bytes."""

    key: str
    dtype: str
    fragments: tuple[Fragment, ...]


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor and where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[Fragment, ...]
    kind: TensorKind = "param"
    #: optimizer group of a trainable parameter (None: frozen, buffer, or the source keeps no optimizer state)
    group: int | None = None
    #: per-parameter optimizer state tensors, each shaped like the parameter
    state: tuple[StatePlan, ...] = ()

    def state_tensor(self, key: str) -> "TensorPlan":
        """State ``key`` of this parameter as a plan of its own (named ``<name>/<key>``), for the assemblers."""
        for st in self.state:
            if st.key == key:
                return TensorPlan(f"{self.name}/{key}", self.shape, st.dtype, st.fragments, self.kind, self.group)
        raise KeyError(f"{self.name} has no optimizer state {key!r}")

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
        """Raise ValueError unless the fragments (the weights' and each state tensor's) tile ``[0, numel)`` exactly."""
        if any(d < 0 for d in self.shape):
            raise ValueError(f"{self.name}: negative dimension in shape {self.shape}")
        for label, dtype, fragments in ((self.name, self.dtype, self.fragments),
                                        *((f"{self.name}/{s.key}", s.dtype, s.fragments) for s in self.state)):
            if dtype not in DTYPE_SIZES:
                raise ValueError(f"{label}: unknown dtype {dtype!r}")
            covered = 0
            for frag in sorted(fragments, key=lambda f: f.dest):
                if frag.dest != covered or frag.numel < 0 or frag.offset < 0:
                    raise ValueError(f"{label}: fragments leave a gap or overlap at element {covered}")
                covered += frag.numel
            if covered != self.numel:
                raise ValueError(f"{label}: fragments cover {covered} of {self.numel} elements")


@dataclass(frozen=True)
class Checksum:
    """A checksum the source records over bytes ``[offset, offset + length)`` of a file: ``sha256`` (hex digest of
    a whole engine file) or ``crc32`` (a zip entry's CRC-32, as an int). Checked by :mod:`zckpt.integrity`."""

    offset: int
    length: int
    algo: Literal["sha256", "crc32"]
    expected: str | int
    what: str = ""  # e.g. the zip entry's name, for messages


@dataclass(frozen=True)
class SourceFile:
    """A file the checkpoint consists of, for ``inspect`` and integrity checks."""

    path: str
    role: str  # e.g. "model_states", "optim_states", "weights", "manifest"
    rank: int | None
    size: int | None  # None when missing
    #: what the source records to check the file's bytes against (empty: nothing recorded)
    checks: tuple[Checksum, ...] = ()


@dataclass(frozen=True)
class OptimizerGroup:
    """One optimizer parameter group: hyper-parameters (JSON: lr, betas, eps, weight_decay, ...) and its group-level
    state tensors (Adam's ``step``: scalar :class:`TensorPlan` s named ``step``, read only when written out)."""

    index: int
    hparams: dict
    scalars: tuple[TensorPlan, ...] = ()


@dataclass(frozen=True)
class TrainingState:
    """What besides the weights a run needs to resume: optimizer state, scheduler, loss scaler, counters.

    ``state_keys`` are the per-parameter state tensors every trainable parameter carries (``TensorPlan.state``).
    ``scheduler`` and ``loss_scaler`` are JSON in the engine's schema (``engine.scheduler`` / ``engine.precision``
    ``state_dict()``), None when the source has none. ``counters``: ``global_steps``, ``global_samples``,
    ``micro_steps``, ``skipped_steps`` (those the source records).
    """

    optimizer: str  # "adamw" | "adam" | "unknown"
    state_keys: tuple[str, ...]
    groups: tuple[OptimizerGroup, ...]
    scheduler: dict | None = None
    loss_scaler: dict | None = None
    counters: dict = field(default_factory=dict)
    client_state: dict = field(default_factory=dict)
    #: the run's training config as JSON (DeepSpeed's ds_config / the engine's resolved config), if recorded
    config: dict | None = None
    #: the source's partition units (lists of trainable-parameter indices, in plan order), when it records them
    #: (engine-native); a reshard to the same kind of layout keeps them
    units: tuple[tuple[int, ...], ...] | None = None

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self.state_keys)

    @property
    def zero_config(self) -> dict:
        """The run's ``zero_optimization`` section ({} when the config is not recorded)."""
        zero = (self.config or {}).get("zero_optimization")
        return zero if isinstance(zero, dict) else {}


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
    #: the training state beyond the weights; None when the source holds weights only
    training: TrainingState | None = None

    def __iter__(self) -> Iterator[TensorPlan]:
        return iter(self.tensors)

    def without_frozen(self) -> "CheckpointPlan":
        from dataclasses import replace

        kept = tuple(t for t in self.tensors if t.kind != "frozen")
        names = {t.name for t in kept}
        return replace(self, tensors=kept, aliases={a: c for a, c in self.aliases.items() if c in names})

    def trainable(self) -> tuple[TensorPlan, ...]:
        return tuple(t for t in self.tensors if t.kind == "param")

    def count(self, kind: TensorKind) -> int:
        return sum(t.numel for t in self.tensors if t.kind == kind)
