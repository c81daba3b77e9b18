"""The streaming safetensors writer: bytes the safetensors library reads back exactly."""

from __future__ import annotations

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zckpt.tensors import byte_view
from zckpt.writers.safetensors_stream import Entry, PositionalWriter, build_header


def write(path, tensors: dict[str, torch.Tensor], order: list[str]) -> None:
    entries = [Entry(n, str(tensors[n].dtype).removeprefix("torch."), tuple(tensors[n].shape)) for n in order]
    with open(path, "wb") as fh:
        writer = PositionalWriter(fh.fileno(), entries, {"format": "pt"})
        for name in reversed(order):  # any order: offsets are fixed by the header
            writer.write(name, byte_view(tensors[name].contiguous()))
        writer.close()


def test_round_trip_all_dtypes_and_odd_shapes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g).to(torch.float16),
        "c": torch.randn(2, 3, 4, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
    }
    path = tmp_path / "x.safetensors"
    write(path, tensors, list(tensors))
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape and torch.equal(loaded[name], t)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_header_layout_is_pinned():
    header = build_header([Entry("w", "bfloat16", (2, 3)), Entry("b", "float32", (3,))], {"format": "pt"})
    (length,) = struct.unpack("<Q", header[:8])
    assert length == len(header) - 8 and length % 8 == 0
    body = json.loads(header[8:])
    assert body == {"__metadata__": {"format": "pt"},
                    "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                    "b": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]}}
    assert header.endswith(b" " * (len(header) - 8 - len(json.dumps(body, separators=(",", ":")))))
