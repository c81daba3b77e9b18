"""``torch.save`` of DeepSpeed-shaped pickles without importing DeepSpeed.

DeepSpeed's checkpoint files reference three of its classes: ``ZeroStageEnum`` (an ``IntEnum``), ``LossScaler`` /
``DynamicLossScaler`` (plain objects) and ``fragment_address`` (a dataclass). DeepSpeed's loader unpickles them as
live objects and uses them (``optimizer.loss_scaler`` is *replaced* by the pickled one). We write the very opcodes
pickle writes for them -- a ``GLOBAL`` naming DeepSpeed's class, then ``REDUCE`` of its value or ``NEWOBJ`` + ``BUILD``
of its ``__dict__`` -- from stand-ins, through pure-Python pickling with ``save_global`` taught the stand-ins' names.
Everything else (tensors, ``torch.Size``, ``OrderedDict``) pickles as torch pickles it.
"""

from __future__ import annotations

import pickle
import types
from typing import Any

import torch

ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DYNAMIC_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
FRAGMENT_ADDRESS = ("deepspeed.utils.tensor_fragment", "fragment_address")

_CLASSES: dict[tuple[str, str], type] = {}


def _stand_in(ref: tuple[str, str]) -> type:
    if ref not in _CLASSES:
        _CLASSES[ref] = type(ref[1], (), {"_deepspeed_global": ref, "__module__": __name__})
    return _CLASSES[ref]


class _Enum:
    """Pickles as ``<DeepSpeed enum>(value)``, like an ``IntEnum`` member."""

    def __init__(self, ref: tuple[str, str], value: int):
        self.cls, self.value = _stand_in(ref), value

    def __reduce_ex__(self, protocol):
        return self.cls, (self.value,)


def deepspeed_object(ref: tuple[str, str], state: dict[str, Any]) -> Any:
    """An instance pickled as DeepSpeed's class ``ref`` with ``__dict__`` ``state`` (in that order)."""
    obj = object.__new__(_stand_in(ref))
    obj.__dict__.update(state)
    return obj


def zero_stage_enum(stage: int) -> Any:
    return _Enum(ZERO_STAGE_ENUM, stage)


class Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be taught names
    def save_global(self, obj, name=None):
        ref = getattr(obj, "_deepspeed_global", None) if isinstance(obj, type) else None
        if ref is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{ref[0]}\n{ref[1]}\n".encode())
        self.memoize(obj)


_PICKLE_MODULE = types.SimpleNamespace(Pickler=Pickler, __name__="zckpt_deepspeed_pickle")


def save(obj: Any, path) -> None:
    """``torch.save`` (zip format, protocol 2, as DeepSpeed's ``TorchCheckpointEngine`` writes)."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
