"""The writers' casts equal torch's ``Tensor.to(dtype)`` bit for bit, numpy path and torch fallback alike."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import zckpt
from zckpt import cast as zcast
from zckpt.tensors import byte_view
from conftest import FIXTURES

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def special_values() -> torch.Tensor:
    bits = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
            0xFF800000, 0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x477FF000, 0x477FEFFF, 0x38800000,
            0x33800000, 0x33000001, 0x7F7F8000, 0x7F7FFFFF]
    values = torch.tensor([struct.unpack("<f", struct.pack("<I", b))[0] for b in bits], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(4096, generator=g) * scale for scale in (1e-8, 1e-4, 1.0, 1e3, 6e4, 1e38)]
    random_bits = torch.randint(0, 2**31 - 1, (8192,), generator=g, dtype=torch.int64).to(torch.int32)
    finite = random_bits.view(torch.float32)
    finite = finite[torch.isfinite(finite)]
    return torch.cat([values, *noise, finite, -finite])


def raw(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(bytes(byte_view(t.contiguous())), dtype=np.uint8).copy()


@pytest.mark.parametrize("src", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("dst", ["bfloat16", "float16", "float32"])
def test_numpy_cast_equals_torch_to(src, dst):
    values = special_values().to(TORCH[src])
    expected = raw(values.to(TORCH[dst]))
    got = zcast.convert(raw(values), src, dst)
    assert got.dtype == np.uint8 and got.shape == expected.shape
    mismatch = np.flatnonzero(got != expected)
    assert mismatch.size == 0, f"first mismatching byte {mismatch[:4]}"


def test_nan_becomes_a_nan():
    values = torch.tensor([float("nan"), -float("nan"), 1.0])
    out = zcast.convert(raw(values), "float32", "bfloat16").view(np.uint16)
    assert list(out) == [0x7FC0, 0x7FC0, 0x3F80]
    assert torch.isnan(torch.frombuffer(bytearray(out.tobytes()), dtype=torch.bfloat16)[:2]).all()


@pytest.mark.parametrize("hide_numpy", [False, True])
def test_consolidate_same_bytes_with_and_without_numpy(tmp_path, monkeypatch, hide_numpy):
    if hide_numpy:
        monkeypatch.setattr(zcast, "np", None)
    name = "z2_fp32_ws2_frozen"
    zckpt.consolidate(FIXTURES / name / "ckpt", tmp_path / "out", dtype="bf16")
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    assert all(torch.equal(written[k], reference[k].to(torch.bfloat16)) for k in written)


def test_consolidate_does_not_import_torch(tmp_path):
    code = ("import sys, zckpt; zckpt.consolidate(sys.argv[1], sys.argv[2]); "
            "assert 'torch' not in sys.modules, 'consolidate imported torch'")
    subprocess.run([sys.executable, "-c", code, str(FIXTURES / "hf_run"), str(tmp_path / "o")], check=True)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("name,dtype", [("z3_bf16_ws3_untied_g2", "bf16"), ("z2_fp16_ws2_untied", "fp16"),
                                        ("z1_fp32_ws3_tied_g2", "fp32"), ("z3_bf16_ws2_frozen", "bf16")])
def test_chunks_straddling_fragments_give_the_same_bytes(tmp_path, monkeypatch, chunk, name, dtype):
    """Chunks cut tensors at arbitrary elements, across rank fragments; the result must not change."""
    from safetensors.torch import load_file

    monkeypatch.setattr(zcast, "CHUNK_ELEMENTS", chunk)
    zckpt.consolidate(FIXTURES / name / "ckpt", tmp_path / "out", dtype=dtype)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    assert written.keys() <= reference.keys() and len(written) >= len(reference) - 1
    assert all(torch.equal(written[k], reference[k].to(torch_dtype)) for k in written)
