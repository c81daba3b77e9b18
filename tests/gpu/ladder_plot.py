"""Draw the memory ladder (``memory_ladder.py``'s JSON) as a PNG: per rung, the engine's and DeepSpeed's peak
allocated memory (reserved as a pale bar behind), and the ZeRO formula's model states as a black line.

Uses matplotlib when it is installed; otherwise a small built-in renderer (rectangles, lines, a 5x7 bitmap font) and
a PNG writer (zlib + crc32 from the standard library), so the benchmark adds no dependency. ``markdown_table`` gives
the same numbers as a table for docs/.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

IMPLS = ("engine", "deepspeed")
COLORS = {"engine": (31, 119, 180), "deepspeed": (255, 127, 14)}
PALE = {"engine": (174, 199, 232), "deepspeed": (255, 187, 120)}


def ladder(result: dict) -> tuple[list[str], dict]:
    """Rungs in order and ``{(rung, impl): row}`` of the main rows (the step overlap on, the default bucket)."""
    rungs, rows = [], {}
    for row in result["rows"]:
        if row.get("ab") or row.get("bitcheck"):
            continue
        if row["rung"] not in rungs:
            rungs.append(row["rung"])
        rows[(row["rung"], row["impl"])] = row
    return rungs, rows


def rung_label(rung: str) -> tuple[str, str]:
    """Two lines for the x axis: "ZeRO 3" and what is offloaded (cumulative: the nvme rung offloads the optimizer to
    the CPU too)."""
    stage, _, rest = rung.partition("+")
    offload = {"": "", "opt": "+opt cpu", "opt+param": "+opt+param cpu", "opt+param_nvme": "+param nvme"}
    return f"ZeRO {stage}", offload.get(rest, "+" + rest)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def _cell(column: str, v) -> str:
    if v is None:
        return ""
    if column == "bucket":
        return f"{v:.0e}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if column.endswith("_s") and column != "tokens_per_s":
        return f"{v:.4f}"
    return _fmt(v)


def markdown_table(result: dict) -> str:
    """Every row of the result as a markdown table (the A/B rows included; the bit checks: ``bitcheck_table``)."""
    cols = ["rung", "impl", "ab", "bucket", "step_overlap", "formula_GiB", "peak_alloc_GiB", "peak_reserved_GiB",
            "after_step_GiB", "step_s", "opt_step_s", "tokens_per_s"]
    lines = ["| " + " | ".join(cols) + " | note |", "|" + "---|" * (len(cols) + 1)]
    for row in result["rows"]:
        if row.get("bitcheck"):
            continue
        note = row.get("skipped") or row.get("error") or row.get("note") or ""
        cells = [_cell(c, row.get(c)) for c in cols]
        lines.append("| " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


def bitcheck_table(result: dict) -> str:
    """The ``--bitcheck`` rows: per stage and rank, the digests of the runs overlap off / on / off."""
    lines = ["| stage | bucket | rank | overlap off | on | off again | on == off |", "|---|---|---|---|---|---|---|"]
    runs: dict = {}
    for row in result["rows"]:
        if row.get("bitcheck"):
            runs.setdefault((row["rung"], row["bucket"], row["rank"]), []).append(row)
    for (stage, bucket, rank), rs in sorted(runs.items()):
        cells = [f"{r['masters_sha256']} / {r['params_sha256']}" for r in rs]
        same = [(r["masters_sha256"], r["params_sha256"]) for r in rs]
        verdict = "yes" if same[1] == same[0] else "no (control differs too)" if same[0] != same[2] else "NO"
        lines.append(f"| {stage} | {bucket:.0e} | {rank} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def _title(meta: dict) -> str:
    return (f"ZeRO memory ladder: Llama {meta['params_M']:.0f}M params, {meta['dtype']}, {meta['world']} x "
            f"{meta['device']}, {meta['mbs']} x {meta['seq']} tokens per rank")


def plot(result: dict, png: Path, backend: str = "auto") -> str:
    """Write ``png``; returns a line saying which renderer drew it."""
    png.parent.mkdir(parents=True, exist_ok=True)
    if backend in ("auto", "matplotlib"):
        try:
            import matplotlib
        except ImportError:
            if backend == "matplotlib":
                raise
        else:
            matplotlib.use("Agg")
            _plot_matplotlib(result, png)
            return f"wrote {png} (matplotlib)"
    _plot_builtin(result, png)
    return f"wrote {png} (built-in renderer: matplotlib is not installed)"


def _plot_matplotlib(result: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    rungs, rows = ladder(result)
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    width = 0.38
    for k, impl in enumerate(IMPLS):
        xs = [i + (k - 0.5) * width for i in range(len(rungs))]
        rs = [rows.get((r, impl), {}) for r in rungs]
        ax.bar(xs, [r.get("peak_reserved_GiB") or 0 for r in rs], width, color=[c / 255 for c in PALE[impl]])
        bars = ax.bar(xs, [r.get("peak_alloc_GiB") or 0 for r in rs], width, label=f"{impl} peak allocated",
                      color=[c / 255 for c in COLORS[impl]])
        ax.hlines([r.get("after_step_GiB") or 0 for r in rs], [x - width / 2 for x in xs],
                  [x + width / 2 for x in xs], colors="white", linestyles="dashed", linewidth=1.2)
        for bar, r in zip(bars, rs):
            text = "skipped" if "skipped" in r else "error" if "error" in r else _fmt(r.get("peak_alloc_GiB"))
            ax.annotate(text, (bar.get_x() + width / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    for i, r in enumerate(rungs):
        f = next((rows[(r, m)]["formula_GiB"] for m in IMPLS if (r, m) in rows), None)
        if f is not None:
            ax.hlines(f, i - 0.45, i + 0.45, colors="black", linewidth=2)
            ax.annotate(f"formula {f:.1f}", (i + 0.45, f), ha="right", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(rungs)), ["\n".join(rung_label(r)) for r in rungs])
    ax.set_ylabel("GiB per GPU (pale: peak reserved; white dashes: allocated after a step)")
    ax.set_title(_title(result["meta"]), fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


# -- built-in renderer -------------------------------------------------------------------------------------------------
_GLYPHS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    " ": "..... ..... ..... ..... ..... ..... .....", ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. .##.. .#...", "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "-": "..... ..... ..... ##### ..... ..... .....", "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.", ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....", "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "=": "..... ..... ##### ..... ##### ..... .....", "_": "..... ..... ..... ..... ..... ..... #####",
}


class Canvas:
    """An RGB raster with rectangles, lines and 5x7 text; ``save`` writes a PNG."""

    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def rect(self, x0: float, y0: float, x1: float, y1: float, color) -> None:
        x0, x1 = (min(max(0, int(round(v))), self.w) for v in sorted((x0, x1)))
        y0, y1 = (min(max(0, int(round(v))), self.h) for v in sorted((y0, y1)))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.w + x0) * 3
            self.px[start:start + len(row)] = row

    def text(self, x: float, y: float, s: str, color=(0, 0, 0), scale: int = 2, anchor: str = "left") -> None:
        s = s.upper()
        width = len(s) * 6 * scale - scale
        x = x - width / 2 if anchor == "center" else x - width if anchor == "right" else x
        for i, ch in enumerate(s):
            rows = _GLYPHS.get(ch, _GLYPHS[" "]).split()
            for r, bits in enumerate(rows):
                for c, bit in enumerate(bits):
                    if bit == "#":
                        gx, gy = x + (i * 6 + c) * scale, y + r * scale
                        self.rect(gx, gy, gx + scale, gy + scale, color)

    def save(self, path: Path) -> None:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
                         + chunk(b"IEND", b""))


def _nice_step(top: float) -> float:
    raw = top / 6
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _plot_builtin(result: dict, png: Path) -> None:
    rungs, rows = ladder(result)
    W, H, left, right, top, bottom = 1400, 720, 100, 30, 110, 90
    c = Canvas(W, H)
    values = [v for r in rows.values() for v in (r.get("peak_alloc_GiB"), r.get("peak_reserved_GiB"),
                                                 r.get("formula_GiB")) if isinstance(v, (int, float))]
    ymax = max(values + [1e-9]) * 1.15
    step = _nice_step(ymax)
    ymax = math.ceil(ymax / step) * step
    plot_h, plot_w = H - top - bottom, W - left - right

    def y_of(v: float) -> float:
        return H - bottom - plot_h * v / ymax
    c.text(W / 2, 20, _title(result["meta"]), scale=2, anchor="center")
    for k, impl in enumerate(IMPLS):  # legend
        lx = left + 10 + k * 330
        c.rect(lx, 60, lx + 18, 78, COLORS[impl])
        c.text(lx + 26, 62, f"{impl} peak allocated", scale=2)
    c.rect(left + 700, 68, left + 730, 71, (0, 0, 0))
    c.text(left + 738, 62, "ZeRO formula (pale: reserved, white: after step)", scale=2)
    tick = 0.0
    while tick <= ymax + 1e-9:  # y axis and grid
        y = y_of(tick)
        c.rect(left, y, W - right, y + 1, (225, 225, 225))
        c.text(left - 8, y - 7, f"{tick:g}", scale=2, anchor="right")
        tick += step
    c.text(10, top - 30, "GIB PER GPU", scale=2)
    c.rect(left, top, left + 2, H - bottom, (0, 0, 0))
    c.rect(left, H - bottom, W - right, H - bottom + 2, (0, 0, 0))
    group = plot_w / max(len(rungs), 1)
    bar = group * 0.3
    for i, rung in enumerate(rungs):
        cx = left + group * (i + 0.5)
        for k, impl in enumerate(IMPLS):
            row = rows.get((rung, impl), {})
            x0 = cx + (k - 1) * bar - (bar * 0.05 if k == 0 else -bar * 0.05)
            if "skipped" in row or "error" in row or row.get("peak_alloc_GiB") is None:
                label = "skip" if "skipped" in row else "error" if "error" in row else "n/a"
                c.text(x0 + bar / 2, H - bottom - 20, label, scale=1, anchor="center")
                continue
            c.rect(x0, y_of(row.get("peak_reserved_GiB") or 0), x0 + bar, H - bottom, PALE[impl])
            c.rect(x0, y_of(row["peak_alloc_GiB"]), x0 + bar, H - bottom, COLORS[impl])
            if row.get("after_step_GiB") is not None:  # resident after a step: the model states
                c.rect(x0 + 2, y_of(row["after_step_GiB"]), x0 + bar - 2, y_of(row["after_step_GiB"]) + 2,
                       (255, 255, 255))
            c.text(x0 + bar / 2, y_of(row["peak_alloc_GiB"]) - 14, f"{row['peak_alloc_GiB']:.1f}", scale=1,
                   anchor="center")
        formula = next((rows[(rung, m)]["formula_GiB"] for m in IMPLS if (rung, m) in rows), None)
        if formula is not None:
            y = y_of(formula)
            c.rect(cx - group * 0.42, y - 1, cx + group * 0.42, y + 2, (0, 0, 0))
            c.text(cx + group * 0.42, y - 12, f"{formula:.1f}", scale=1, anchor="right")
        for line, text in enumerate(rung_label(rung)):
            c.text(cx, H - bottom + 14 + 20 * line, text, scale=2, anchor="center")
    c.save(png)
