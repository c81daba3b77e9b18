"""Compare two DeepSpeed checkpoint tag folders object-for-object and tensor-for-tensor (bit-for-bit), reading both
through zckpt's restricted unpickler (no ``torch.load(weights_only=False)``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from zckpt.readers.torch_pickle import TensorRef, load_lazy
from zckpt.writers.deepspeed_layout import DeepSpeedLayout


def materialize(ref: TensorRef) -> torch.Tensor:
    """The tensor's bytes, read from its file (contiguous tensors only)."""
    assert ref.is_contiguous(), ref
    itemsize = torch.empty((), dtype=getattr(torch, ref.dtype)).element_size()
    fd = os.open(ref.path, os.O_RDONLY)
    try:
        data = os.pread(fd, ref.numel * itemsize, ref.byte_offset)
    finally:
        os.close(fd)
    flat = torch.frombuffer(bytearray(data), dtype=getattr(torch, ref.dtype)) if data else \
        torch.empty(0, dtype=getattr(torch, ref.dtype))
    return flat.reshape(ref.shape)


def _walk(a, b, where: str, diffs: list[str], masks: dict[str, torch.Tensor]) -> None:
    if isinstance(a, TensorRef) or isinstance(b, TensorRef):
        if not (isinstance(a, TensorRef) and isinstance(b, TensorRef)):
            diffs.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
        else:
            x, y = materialize(a), materialize(b)
            if where in masks:
                x, y = x[masks[where]], y[masks[where]]
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                diffs.append(f"{where}: values differ")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            diffs.append(f"{where}: keys {list(a)} vs {list(b)}")
        elif list(a) != list(b):
            diffs.append(f"{where}: key order {list(a)} vs {list(b)}")
        for key in a:
            if key in b:
                _walk(a[key], b[key], f"{where}.{key}", diffs, masks)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            diffs.append(f"{where}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{where}[{i}]", diffs, masks)
        return
    same = type(a) is type(b) and (vars(a) == vars(b) if hasattr(a, "__dict__") else a == b)
    if not same and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        diffs.append(f"{where}: {a!r:.100} vs {b!r:.100}")


def stage3_padding_masks(layout: DeepSpeedLayout, optim_name) -> dict[str, torch.Tensor]:
    """Stage 3: DeepSpeed leaves the padding of each parameter's last piece uninitialized (``torch.empty``); compare
    only the elements that hold parameter data."""
    masks = {}
    for r in range(layout.world_size):
        for s, flat in enumerate(layout.flat_groups):
            mask = torch.zeros(flat.partition_numel, dtype=torch.bool)
            for p in flat.pieces[r]:
                mask[p.dest:p.dest + p.count] = True
            masks[f"{optim_name(r)}.optimizer_state_dict.fp32_flat_groups[{s}]"] = mask
    return masks


def compare_tag_dirs(ours: Path, theirs: Path, masks: dict[str, torch.Tensor] | None = None,
                     ignore: tuple[str, ...] = ()) -> list[str]:
    """Differences between two tag folders' ``*.pt`` files (same names, same objects, same tensor bytes)."""
    names = sorted(p.name for p in Path(theirs).glob("*.pt"))
    mine = sorted(p.name for p in Path(ours).glob("*.pt"))
    diffs = [] if names == mine else [f"files {mine} vs {names}"]
    for name in set(names) & set(mine):
        _walk(load_lazy(Path(ours) / name), load_lazy(Path(theirs) / name), name, diffs, masks or {})
    return [d for d in diffs if not any(part in d for part in ignore)]
