"""Benchmark: ``zckpt reshard --world-size 4`` against DeepSpeed's ``ds_to_universal`` and the disk floor.

Uses the real DeepSpeed checkpoints of ``bench_consolidate.py`` (Llama, 2 CPU ranks, one AdamW step; ZeRO-2 fp32
and ZeRO-3 bf16), built by its generator with ``universal_checkpoint_info`` saved, which ``ds_to_universal`` needs
at stages 1-2 (in separate ``-uc`` folders under ``--work``). On the tag folder of each, times as separate processes,
alternating tools, page cache dropped before each run, medians of ``--repeats``:

* ``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT/TAG`` (its default
  worker counts; it does not sync its output);
* ``cp -r TAG OUT && sync``: the floor, reading and writing the source's bytes once;
* ``python -m zckpt reshard TAG OUT --world-size 4 --quiet`` (which fsyncs what it writes), skipped with a note
  when this checkout has no ``zckpt reshard``.

Memory is measured two ways: the peak RSS of the largest single process (from ``/usr/bin/time``, as
``bench_consolidate.py`` reports it) and the peak sum of PSS over the whole process tree, sampled every 0.1 s,
which counts ``ds_to_universal``'s worker processes together.

    python tests/benchmarks/bench_reshard.py --work /tmp/zckpt-bench              # 340M
    python tests/benchmarks/bench_reshard.py --work /tmp/zckpt-bench --double     # also ~690M

Targets (issue "Benchmark zckpt reshard"): wall <= 0.5x ds_to_universal and <= 1.1x cp+sync, peak memory <= 0.5x
ds_to_universal's and flat in model size.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_consolidate as consolidate  # noqa: E402  (the checkpoint generator, shared)

DS = "ds_to_universal"
FLOOR = "cp -r + sync"
ZCKPT = "zckpt reshard"
SAMPLE_S = 0.1


@dataclass(frozen=True)
class Run:
    wall_s: float
    max_rss_mb: float  # largest single process of the tree
    tree_pss_mb: float  # all processes of the tree together, sampled


def commands(tag: Path, out: Path, world_size: int) -> dict[str, list[str]]:
    return {
        DS: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
             "--output_folder", str(out / tag.name)],
        FLOOR: ["sh", "-c", 'cp -r "$0" "$1" && sync', str(tag), str(out)],
        ZCKPT: [sys.executable, "-m", "zckpt", "reshard", str(tag), str(out), "--world-size", str(world_size),
                "--quiet"],
    }


def zckpt_reshard_missing() -> str | None:
    """Why ``zckpt reshard`` cannot be timed here, or None if it can."""
    proc = subprocess.run([sys.executable, "-m", "zckpt", "reshard", "--help"], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return f"`zckpt reshard --help` failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-300:]}"


def drop_page_cache(files: list[Path]) -> str:
    """Flush dirty pages, then evict the source from the page cache: all of it where permitted, else its files."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in files:  # clean pages of files we can open can be dropped without privileges
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise(DONTNEED) on the source files"


def measure_once(cmd: list[str], log: Path) -> Run:
    """Run ``cmd`` to completion; wall time, largest-process peak RSS, sampled peak PSS of the process tree.

    The largest-process figure comes from ``/usr/bin/time``, not from our own ``wait4``: a child forked from this
    Python process keeps its ~18 MiB high-water mark across ``exec``, which would swamp small tools (``cp``)."""
    rss_file = log.with_suffix(".maxrss")
    with open(log, "wb") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd], stdout=sink,
                                stderr=subprocess.STDOUT)
        sampler = _TreeSampler(proc.pid)
        sampler.start()
        proc.wait()
        wall = time.perf_counter() - start
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    max_rss_kib = int(rss_file.read_text().split()[-1])
    # A run shorter than one sampling interval has no sample: its largest process stands in for the tree.
    return Run(wall, max_rss_kib / 1024, (sampler.peak_kib or max_rss_kib) / 1024)


class _TreeSampler(threading.Thread):
    """Samples the summed PSS (RSS where PSS is unreadable) of the descendants of ``pid`` (``/usr/bin/time``, itself
    not counted) until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak_kib = max(self.peak_kib, sum(_pss_kib(p) for p in _tree(self.pid)[1:]))

    def stop(self) -> None:
        self._done.set()
        self.join()


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, ()))
    return found


def _pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        key = "Pss:"
    except OSError:
        try:
            text, key = Path(f"/proc/{pid}/status").read_text(), "VmRSS:"
        except OSError:
            return 0  # exited between listing and reading
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def measure(tag: Path, work: Path, world_size: int, repeats: int, skip: dict[str, str]) -> dict:
    out, log = work / "out", work / "bench_reshard.log"
    files = [p for p in tag.rglob("*") if p.is_file()]
    runs: dict[str, list[Run]] = {}
    written: dict[str, int] = {}
    cache = ""
    for _ in range(repeats):
        for name, cmd in commands(tag, out, world_size).items():
            if name in skip:
                continue
            shutil.rmtree(out, ignore_errors=True)
            cache = drop_page_cache(files)
            runs.setdefault(name, []).append(measure_once(cmd, log))
            if name not in written:
                written[name] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    result: dict = {"page_cache": cache, "skipped": skip}
    result.update(summarize(runs, written))
    return result



def summarize(runs: dict, written: dict) -> dict:
    """Per tool: medians of wall time, peak RSS and tree PSS over its runs, output size, and every run."""
    return {name: {"wall_s": statistics.median(x.wall_s for x in r),
                   "peak_rss_mb": statistics.median(x.max_rss_mb for x in r),
                   "peak_tree_pss_mb": statistics.median(x.tree_pss_mb for x in r),
                   "output_gb": written[name] / 1e9,
                   "runs": [[x.wall_s, x.max_rss_mb, x.tree_pss_mb] for x in r]} for name, r in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4, help="zckpt reshard's target world size")
    parser.add_argument("--double", action="store_true", help="also measure a model twice the size")
    parser.add_argument("--configs", nargs="+", default=list(consolidate.CONFIGS), choices=list(consolidate.CONFIGS))
    parser.add_argument("--plot", type=Path, help="write a PNG chart of the results here (needs matplotlib)")
    parser.add_argument("--plot-only", type=Path, help="only plot an existing results JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot)
        return
    if args.plot:
        import matplotlib  # noqa: F401  (fail now, not after the measurements)
    args.work.mkdir(parents=True, exist_ok=True)
    missing = zckpt_reshard_missing()
    skip = {ZCKPT: missing} if missing else {}
    if missing:
        print(f"note: skipping {ZCKPT}: {missing}", file=sys.stderr)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "deepspeed": importlib.metadata.version("deepspeed"), "world_size": args.world_size, "results": {}}
    for model in ["340M", "690M"] if args.double else ["340M"]:
        for config in args.configs:
            save_dir = consolidate.build(args.work, model, config, universal_info=True)
            tag = save_dir / (save_dir / "latest").read_text().strip()
            size = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
            key = f"{model} {config}"
            results["results"][key] = {"checkpoint_gb": size / 1e9,
                                       **measure(tag, args.work, args.world_size, args.repeats, skip)}
            print(json.dumps({key: results["results"][key]}, indent=1), flush=True)
    (args.work / "results-reshard.json").write_text(json.dumps(results, indent=2))
    print(render(results))
    if args.plot:
        plot(results, args.plot)


def _tools(res: dict) -> list[str]:
    return [t for t in (DS, FLOOR, ZCKPT) if t in res]


def render(results: dict) -> str:
    lines = ["| checkpoint | tool | wall (s) | wall vs ds_to_universal | wall vs cp+sync | peak RSS, largest process "
             "(MiB) | peak PSS, all processes (MiB) | PSS vs ds_to_universal | output (GB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, res in results["results"].items():
        ds, floor = res.get(DS), res.get(FLOOR)
        for tool in _tools(res):
            r = res[tool]
            vs_ds = f"{r['wall_s'] / ds['wall_s']:.2f}x" if ds else "-"
            vs_floor = f"{r['wall_s'] / floor['wall_s']:.2f}x" if floor else "-"
            mem_ds = f"{r['peak_tree_pss_mb'] / ds['peak_tree_pss_mb']:.2f}x" if ds else "-"
            lines.append(f"| {key} ({res['checkpoint_gb']:.1f} GB) | {tool} | {r['wall_s']:.1f} | {vs_ds} | "
                         f"{vs_floor} | {r['peak_rss_mb']:.0f} | {r['peak_tree_pss_mb']:.0f} | {mem_ds} | "
                         f"{r['output_gb']:.1f} |")
        for tool, why in res.get("skipped", {}).items():
            lines.append(f"| {key} ({res['checkpoint_gb']:.1f} GB) | {tool} | skipped: {why} | | | | | | |")
    return "\n".join(lines + _flatness(results))


def _flatness(results: dict) -> list[str]:
    """Peak memory of the larger model over the smaller, per config and tool (flat: ~1.0x)."""
    notes = []
    by_config: dict[str, dict[str, dict]] = {}
    for key, res in results["results"].items():
        model, config = key.split(" ", 1)
        by_config.setdefault(config, {})[model] = res
    for config, models in by_config.items():
        if {"340M", "690M"} <= models.keys():
            small, large = models["340M"], models["690M"]
            ratios = ", ".join(f"{t} {large[t]['peak_tree_pss_mb'] / small[t]['peak_tree_pss_mb']:.2f}x"
                               for t in _tools(small) if t in large)
            notes.append(f"\npeak PSS 690M / 340M, {config}: {ratios}")
    return notes


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["results"])
    tools = [t for t in (DS, FLOOR, ZCKPT) if any(t in results["results"][k] for k in keys)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(tools)
    for ax, metric, label in ((axes[0], "wall_s", "wall time (s)"),
                              (axes[1], "peak_tree_pss_mb", "peak PSS, all processes (MiB)")):
        for i, tool in enumerate(tools):
            values = [results["results"][k].get(tool, {}).get(metric, 0) for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=tool)
        ax.set_xticks([x + width * (len(tools) - 1) / 2 for x in range(len(keys))], keys, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"zckpt reshard --world-size {results['world_size']} vs ds_to_universal vs cp+sync (medians; "
                 + results["machine"] + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
