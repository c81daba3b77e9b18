"""Read a planned tensor and cast it to the output dtype as raw bytes, for the writers.

The cast must equal torch's ``Tensor.to(dtype)`` bit for bit (the tests check it on every fixture and on special
values). With numpy available — it nearly always is: transformers, DeepSpeed and safetensors' numpy API need it —
the cast is done in numpy, so ``zckpt consolidate`` never imports torch: on the 2-core dev box ``import torch``
alone takes 2.4-4.3 s and 224 MB of RSS, numpy 0.35 s and 27 MB. Without numpy, torch does the cast.

numpy path, per source -> target:

* fp32 -> bf16: round to nearest even on the bit pattern, ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` — what torch's
  ``c10::BFloat16`` does; NaN becomes the canonical quiet NaN ``0x7FC0`` (torch's scalar path gives the same, its
  SIMD path a different NaN payload, so NaN payloads are the one thing not pinned).
* fp32 -> fp16: numpy's ``astype(float16)``: IEEE round to nearest even with subnormals, as torch's conversion.
* bf16 -> fp32: exact (``u << 16``); fp16 -> fp32 exact; fp64 goes through fp32 first, as torch's 16-bit
  constructors do.
"""

from __future__ import annotations

import threading
from typing import Callable

from .assemble import FileCache, read_range
from .plan import DTYPE_SIZES, FLOAT_DTYPES, TensorPlan

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised by tests with numpy hidden
    np = None

_NP = {"float32": np.float32, "float16": np.float16} if np is not None else {}


CHUNK_ELEMENTS = 4 * 2**20  # 16 MiB of fp32 per step: big enough for few syscalls, small enough to stay cached
_scratch = threading.local()


def output_dtype(plan: TensorPlan, dtype: str | None) -> str:
    """Floating tensors take ``dtype``; integer and bool tensors keep theirs."""
    return dtype if dtype is not None and plan.dtype in FLOAT_DTYPES else plan.dtype


def write_cast(plan: TensorPlan, files: FileCache, dtype: str | None, write: Callable[[memoryview, int], None]
               ) -> int:
    """Read ``plan``, cast it to :func:`output_dtype` and hand the bytes to ``write(data, byte_offset)`` in chunks.

    With numpy, the work goes through per-thread scratch buffers of :data:`CHUNK_ELEMENTS`, so memory stays the same
    whatever the tensor or model size and no page is faulted in twice. Returns the bytes written.
    """
    target = output_dtype(plan, dtype)
    if np is None:
        data, _owner = _read_cast_torch(plan, files, target)
        write(data, 0)
        return len(data)
    src_size, dst_size = DTYPE_SIZES[plan.dtype], DTYPE_SIZES[target]
    for start in range(0, plan.numel, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, plan.numel - start)
        raw = _buffer("raw", count * src_size)
        read_range(plan, files, start, count, memoryview(raw))
        out = raw if target == plan.dtype else _convert_into(raw, plan.dtype, target, count)
        write(memoryview(out), start * dst_size)
    return plan.numel * dst_size


def _buffer(name: str, nbytes: int):
    """This thread's reusable scratch array ``name`` with at least ``nbytes`` bytes (a uint8 view of them)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_scratch, name, buf)
    return buf[:nbytes]


def _convert_into(raw, src: str, dst: str, count: int):
    """Cast ``count`` elements of raw ``src`` bytes into this thread's ``dst`` scratch buffer (no allocation)."""
    out = _buffer("out", count * DTYPE_SIZES[dst])
    with np.errstate(over="ignore"):
        if dst == "bfloat16" and src == "float32":
            _bf16_into(raw.view(np.float32), out.view(np.uint16))
        elif dst in ("float16", "float32") and src in ("float32", "float16"):
            np.copyto(out.view(_NP[dst]), raw.view(_NP[src]), casting="unsafe")
        else:
            out[:] = convert(raw, src, dst)
    return out


def _bf16_into(f32, out16) -> None:
    """Round-to-nearest-even fp32 -> bf16 bits into ``out16``, through one reused uint32 scratch array."""
    bits = f32.view(np.uint32)
    tmp = _buffer("tmp", bits.nbytes).view(np.uint32)
    np.right_shift(bits, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, bits, out=tmp)  # wraps only for NaN bit patterns, fixed below
    np.right_shift(tmp, 16, out=tmp)
    np.copyto(out16, tmp, casting="unsafe")
    nan = _buffer("nan", bits.size).view(np.bool_)
    np.isnan(f32, out=nan)
    if nan.any():
        out16[nan] = 0x7FC0


def convert(raw, src: str, dst: str):
    """numpy: raw little-endian bytes of dtype ``src`` -> new raw bytes of dtype ``dst`` (a uint8 array)."""
    with np.errstate(over="ignore"):  # overflow to inf is the IEEE (and torch) result, not an error
        return _convert(raw, src, dst)


def _convert(raw, src: str, dst: str):
    if dst == "float64":
        return _to_float64(raw, src).view(np.uint8)
    f32 = _to_float32(raw, src)
    if dst == "float32":
        out = f32
    elif dst == "float16":
        out = f32.astype(np.float16)
    elif dst == "bfloat16":
        out = np.empty(f32.size, dtype=np.uint16)
        _bf16_into(f32, out)
    else:
        raise ValueError(f"cannot cast {src} to {dst}")
    return out.view(np.uint8)


def _to_float32(raw, src: str):
    if src == "float32":
        return raw.view(np.float32)
    if src == "float16":
        return raw.view(np.float16).astype(np.float32)
    if src == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if src == "float64":
        return raw.view(np.float64).astype(np.float32)
    raise ValueError(f"not a float dtype: {src}")


def _to_float64(raw, src: str):
    return raw.view(np.float64) if src == "float64" else _to_float32(raw, src).astype(np.float64)


def _read_cast_torch(plan: TensorPlan, files: FileCache, target: str) -> tuple[memoryview, object]:
    from .tensors import byte_view, cast, read_tensor

    tensor = cast(read_tensor(plan, files), target).contiguous()
    return byte_view(tensor), tensor
