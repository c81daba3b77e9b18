"""Pickling that names DeepSpeed's and torch's classes without importing either.

DeepSpeed's checkpoint files reference three of its classes: ``ZeroStageEnum`` (an ``IntEnum``), ``LossScaler`` /
``DynamicLossScaler`` (plain objects) and ``fragment_address`` (a dataclass). DeepSpeed's loader unpickles them as
live objects and uses them (``optimizer.loss_scaler`` is *replaced* by the pickled one). torch's pickles reference
``torch._utils._rebuild_tensor_v2``, ``torch.Size``, ``torch.<Type>Storage`` and dtypes. We write the very opcodes
pickle writes for them -- a ``GLOBAL`` naming the class, then ``REDUCE`` of its arguments or ``NEWOBJ`` + ``BUILD`` of
its ``__dict__`` -- from stand-ins, through the pure-Python pickler with ``save_global`` taught the stand-ins' names.
"""

from __future__ import annotations

import pickle
from typing import Any

ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DYNAMIC_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
FRAGMENT_ADDRESS = ("deepspeed.utils.tensor_fragment", "fragment_address")

_CLASSES: dict[tuple[str, str], type] = {}


def global_ref(module: str, name: str) -> type:
    """A stand-in that pickles as ``GLOBAL module name`` (a class, a function, ``torch.float16``...)."""
    ref = (module, name)
    if ref not in _CLASSES:
        _CLASSES[ref] = type(name, (), {"_pickle_global": ref, "__module__": __name__})
    return _CLASSES[ref]


class Reduce:
    """Pickles as ``GLOBAL ref`` called with ``args`` (``REDUCE``), like an ``IntEnum`` member or a ``torch.Size``."""

    def __init__(self, ref: tuple[str, str], args: tuple):
        self.cls, self.args = global_ref(*ref), args

    def __reduce_ex__(self, protocol):
        return self.cls, self.args


def deepspeed_object(ref: tuple[str, str], state: dict[str, Any]) -> Any:
    """An instance pickled as DeepSpeed's class ``ref`` with ``__dict__`` ``state`` (in that order)."""
    obj = object.__new__(global_ref(*ref))
    obj.__dict__.update(state)
    return obj


def zero_stage_enum(stage: int) -> Any:
    return Reduce(ZERO_STAGE_ENUM, (stage,))


def torch_size(shape) -> Any:
    """``torch.Size(shape)`` as torch pickles it."""
    return Reduce(("torch", "Size"), (tuple(int(d) for d in shape),))


class Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be taught names
    def save_global(self, obj, name=None):
        ref = getattr(obj, "_pickle_global", None) if isinstance(obj, type) else None
        if ref is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{ref[0]}\n{ref[1]}\n".encode())
        self.memoize(obj)
