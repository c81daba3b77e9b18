"""The torch side: plan tensors as ``torch.Tensor`` s, for the Python API (``load_state_dict``, ``iter_state_dict``).

Casts are torch's own ``Tensor.to(dtype)``.
"""

from __future__ import annotations

import ctypes

import torch

from .assemble import FileCache, read_into
from .plan import DTYPES as PLAN_DTYPES
from .plan import TensorPlan

#: torch dtype objects by plan dtype name; plan names are torch's, so :data:`zckpt.plan.DTYPES` stays the one table.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in PLAN_DTYPES}


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy, no numpy). Keep ``tensor`` alive while used."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_tensor(plan: TensorPlan, files: FileCache) -> torch.Tensor:
    """The tensor at its stored dtype, read straight into its own (uninitialised) memory."""
    tensor = torch.empty(plan.shape, dtype=DTYPES[plan.dtype])
    read_into(plan, files, byte_view(tensor))
    return tensor


def cast(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """Floating tensors to ``dtype`` exactly as ``tensor.to(dtype)``; other tensors unchanged."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == DTYPES[dtype]:
        return tensor
    return tensor.to(DTYPES[dtype])
