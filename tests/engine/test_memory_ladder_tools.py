"""The memory-ladder benchmark's pure parts (``tests/gpu/memory_ladder.py``, ``tests/gpu/ladder_plot.py``): the ZeRO
formula per rung, the run plan, and the built-in PNG renderer (used when matplotlib is absent), checked by decoding
the PNG it writes."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))

import ladder_plot  # noqa: E402
import memory_ladder  # noqa: E402

GIB = 2**30


@pytest.mark.parametrize("rung,per_psi", [("0", 16), ("1", 2 + 2 + 12 / 4), ("2", 2 + 14 / 4), ("3", 16 / 4),
                                          ("3+opt", 2 / 4), ("3+opt+param", 0), ("3+opt+param_nvme", 0)])
def test_formula_is_the_zero_papers(rung, per_psi):
    psi = 10**9
    assert memory_ladder.formula_gib(rung, psi, 4) == pytest.approx(per_psi * psi / GIB)


def test_plan_alternates_implementations_and_adds_ab_rows():
    args = type("A", (), {"impls": "engine,deepspeed", "rungs": "1,3", "bucket": 5e8, "ab": True,
                          "ab_bucket": 5e7})()
    runs = memory_ladder.plan(args)
    assert [(r["rung"], r["impl"], r.get("ab", False)) for r in runs][:2] == [("1", "engine", False),
                                                                             ("1", "deepspeed", False)]
    ab = [(r["bucket"], r["step_overlap"]) for r in runs if r.get("ab")]
    assert ab == [(5e8, False), (5e8, True), (5e7, False), (5e7, True)]  # stage 3 gets none
    assert runs[-2:] == [{"rung": "3", "impl": "engine", "bucket": 5e8, "step_overlap": True},
                         {"rung": "3", "impl": "deepspeed", "bucket": 5e8, "step_overlap": True}]


def _decode_png(path: Path) -> tuple[int, int, bytes]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    w, h = size
    raw = zlib.decompress(idat)
    rows = [raw[y * (3 * w + 1) + 1:(y + 1) * (3 * w + 1)] for y in range(h)]
    return w, h, b"".join(rows)


def test_builtin_renderer_draws_the_bars(tmp_path):
    rows = [{"rung": "1", "impl": "engine", "bucket": 5e8, "formula_GiB": 8.9, "peak_alloc_GiB": 14.4,
             "peak_reserved_GiB": 16.5, "after_step_GiB": 7.1},
            {"rung": "1", "impl": "deepspeed", "bucket": 5e8, "formula_GiB": 8.9, "peak_alloc_GiB": 14.9,
             "peak_reserved_GiB": 19.3, "after_step_GiB": 7.1},
            {"rung": "3+opt+param_nvme", "impl": "deepspeed", "bucket": 5e8, "formula_GiB": 0.0, "skipped": "x"}]
    meta = {"params_M": 953.2, "dtype": "bf16", "world": 2, "device": "H200", "mbs": 4, "seq": 1024, "bucket": 5e8}
    png = tmp_path / "ladder.png"
    assert "built-in" in ladder_plot.plot({"meta": meta, "rows": rows}, png, backend="builtin")
    w, h, pixels = _decode_png(png)
    assert (w, h) == (1400, 720)
    colors = {pixels[i:i + 3] for i in range(0, len(pixels), 3)}
    for rgb in (*ladder_plot.COLORS.values(), *ladder_plot.PALE.values(), (0, 0, 0), (255, 255, 255)):
        assert bytes(rgb) in colors
    table = ladder_plot.markdown_table({"meta": meta, "rows": rows})
    assert "| 1 | engine |" in table and "| x |" in table
