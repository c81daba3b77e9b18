#!/usr/bin/env python
"""Scale proof (issue #11, run 2 and 3): train at world size N, reshard to M, resume, reshard back to N, resume.

Legs (engine unless named; every leg trains ``--steps`` global batches of the same data stream, global batch
``--global-batch`` split over the ranks; ZeRO ``--stage``, ``--dtype``):

* ``ref``: N ranks, 3 x steps, no checkpoint -- the uninterrupted loss curve;
* ``a``: N ranks, steps 1..K, saves ``ck_a`` (save time recorded);
* ``b``: ``zckpt reshard ck_a ck_b --world-size M``, M ranks resume steps K+1..2K, save ``ck_c``;
* ``b_load``: M ranks load ``ck_a`` directly (load-time resharding, no offline pass), steps K+1..2K;
* ``c``: ``zckpt reshard ck_c ck_d --world-size N``, N ranks resume steps 2K+1..3K;
* ``ds_b``: ``zckpt reshard ck_a --format deepspeed --world-size M``; real DeepSpeed resumes it on M ranks;
* ``ds_a``: DeepSpeed on N ranks, steps 1..K, saves (its save time), for ``zero_to_fp32`` against ``zckpt
  consolidate`` on its checkpoint and on ours.

Checks (exit 1 on any failure): ``consolidate(ck_a) == consolidate(ck_b)`` and ``consolidate(ck_c) ==
consolidate(ck_d)`` bit for bit (no training in between); ``b_load`` losses equal ``b``'s exactly (the same state
through another path); the resumed curves (b, c, ds_b) stay within ``--rtol`` of ``ref`` at the same steps (another
world size sums in another order; no jump). Writes ``<work>/scale.json`` (losses, times); ``--plot PNG`` draws the
curves (needs matplotlib).

    # GPU machine, 8 GPUs:  (DeepSpeed wheels on PYTHONPATH, see ../shared/gpu/README.md)
    python tests/gpu/scale_reshard.py --big 8 --small 2 --size 1b --dtype bf16 --seq 1024 --steps 20
    # 2 GPUs (the same script, smaller):
    python tests/gpu/scale_reshard.py --big 2 --small 1 --size 1b --dtype bf16 --seq 1024 --steps 10
    # CPU, 8 gloo processes (proves the script):
    python tests/gpu/scale_reshard.py --cpu --big 8 --small 2 --size tiny --steps 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from universal_resume_gpu import REPO, SCRIPT, free_port, run  # noqa: E402


def train(impl: str, world: int, a, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(SCRIPT), "--impl", impl, "--stage", str(a.stage), "--dtype", a.dtype, "--size",
           a.size, "--seq", str(a.seq), "--micro", str(a.global_batch // world), "--out", str(out), "--no-weights",
           *extra]
    run(cmd, a.cpu, out.with_suffix(".log"))
    ranks = [json.loads((out / f"losses.rank{r}.json").read_text()) for r in range(world)]
    return {"losses": [sum(step) / world for step in zip(*(r["losses"] for r in ranks))],
            "median_step_s": ranks[0]["median_step_s"], "save_s": ranks[0]["save_s"]}


def zckpt(a, work: Path, *args: str) -> float:
    started = time.perf_counter()
    run([sys.executable, "-m", "zckpt", *args, "--quiet"], a.cpu, work / f"zckpt-{args[0]}-{len(list(work.iterdir()))}.log")
    return time.perf_counter() - started


def digest(folder: Path) -> str:
    """sha256 over the consolidated safetensors files (names and bytes), so two outputs compare bit for bit."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def legs(a, work: Path) -> dict:
    k, big, small = a.steps, str(a.big), str(a.small)
    r: dict = {"ref": train("engine", a.big, a, work / "ref", "--steps", str(3 * k))}
    r["a"] = train("engine", a.big, a, work / "a", "--steps", str(k), "--save", str(work / "ck_a"))
    r["reshard_a_to_small_s"] = zckpt(a, work, "reshard", str(work / "ck_a"), str(work / "ck_b"), "--world-size", small)
    r["b"] = train("engine", a.small, a, work / "b", "--steps", str(k), "--start-step", str(k), "--load",
                   str(work / "ck_b"), "--save", str(work / "ck_c"))
    r["b_load"] = train("engine", a.small, a, work / "b_load", "--steps", str(k), "--start-step", str(k), "--load",
                        str(work / "ck_a"))
    zckpt(a, work, "reshard", str(work / "ck_c"), str(work / "ck_d"), "--world-size", big)
    r["c"] = train("engine", a.big, a, work / "c", "--steps", str(k), "--start-step", str(2 * k), "--load",
                   str(work / "ck_d"))
    for name in ("a", "b", "c", "d"):
        r[f"consolidate_{name}_s"] = zckpt(a, work, "consolidate", str(work / f"ck_{name}"), str(work / f"hf_{name}"))
        r[f"digest_{name}"] = digest(work / f"hf_{name}")
    if not a.no_deepspeed:
        zckpt(a, work, "reshard", str(work / "ck_a"), str(work / "ds_ck_b"), "--world-size", small,
              "--format", "deepspeed")
        r["ds_b"] = train("deepspeed", a.small, a, work / "ds_b", "--steps", str(k), "--start-step", str(k),
                          "--load", str(work / "ds_ck_b"))
        r["ds_a"] = train("deepspeed", a.big, a, work / "ds_a", "--steps", str(k), "--save", str(work / "ds_ck_a"))
        started = time.perf_counter()
        run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(work / "ds_ck_a"), str(work / "ds_fp32")], a.cpu, work / "zero_to_fp32.log")
        r["zero_to_fp32_s"] = time.perf_counter() - started  # .bin output: its safetensors mode fails on tied
        # embeddings (the crash the issue names)
        r["consolidate_ds_a_s"] = zckpt(a, work, "consolidate", str(work / "ds_ck_a"), str(work / "hf_ds_a"))
    return r


def check(a, r: dict) -> list[str]:
    k, fails = a.steps, []
    if r["digest_a"] != r["digest_b"]:
        fails.append("consolidate(ck_a) != consolidate(ck_b)")
    if r["digest_c"] != r["digest_d"]:
        fails.append("consolidate(ck_c) != consolidate(ck_d)")
    if r["b_load"]["losses"] != r["b"]["losses"]:
        fails.append(f"load-time reshard losses {r['b_load']['losses']} != offline {r['b']['losses']}")
    ref = r["ref"]["losses"]
    for leg, start in (("a", 0), ("b", k), ("c", 2 * k), ("ds_b", k)):
        if leg not in r:
            continue
        worst = max(abs(x - y) / abs(y) for x, y in zip(r[leg]["losses"], ref[start:start + k]))
        r[f"worst_rel_{leg}"] = worst
        if worst > a.rtol:
            fails.append(f"leg {leg}: losses differ from the uninterrupted run by {worst:.2e} (> {a.rtol:.0e})")
    return fails


def plot(a, r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = a.steps
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(1, 3 * k + 1), r["ref"]["losses"], color="0.6", lw=3, label=f"uninterrupted, {a.big} ranks")
    for leg, start, label in (("a", 0, f"engine, {a.big} ranks"), ("b", k, f"engine, resharded to {a.small}"),
                              ("c", 2 * k, f"engine, resharded back to {a.big}"),
                              ("ds_b", k, f"DeepSpeed, zckpt --format deepspeed, {a.small}")):
        if leg in r:
            ax.plot(range(start + 1, start + k + 1), r[leg]["losses"], marker="o", ms=3, lw=1,
                    ls="--" if leg == "ds_b" else "-", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"ZeRO-{a.stage} {a.dtype}, {a.size} Llama: {a.big} -> {a.small} -> {a.big} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes instead of NCCL on GPUs")
    ap.add_argument("--big", type=int, default=8)
    ap.add_argument("--small", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--size", choices=["tiny", "small", "1b"], default="small")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="steps per leg")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=2e-2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--plot-only", type=Path, default=None, help="plot an existing scale.json")
    a = ap.parse_args()
    if a.plot_only:
        plot(a, json.loads(a.plot_only.read_text()), a.plot)
        return 0
    work = a.work or Path(tempfile.mkdtemp(prefix="zckpt-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"scale proof: ZeRO-{a.stage} {a.dtype} {a.size}, {a.big} -> {a.small} -> {a.big} ranks "
          f"({'CPU gloo' if a.cpu else 'GPU NCCL'}), work {work}", flush=True)
    try:
        r = legs(a, work)
    except Exception as exc:  # a failed leg: say which, with its log's tail
        print(f"FAIL: {exc}")
        return 1
    fails = check(a, r)
    r["args"] = {k: str(v) for k, v in vars(a).items()}
    (work / "scale.json").write_text(json.dumps(r, indent=1))
    summary = {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in r.items()
               if k.endswith("_s") or k.startswith("worst")}
    summary.update({f"{leg}_median_step_s": float(f"{r[leg]['median_step_s']:.3g}") for leg in ("a", "b", "c", "ds_a")
                    if leg in r})
    summary.update({"engine_save_s": r["a"]["save_s"], "deepspeed_save_s": r.get("ds_a", {}).get("save_s")})
    print(json.dumps(summary))
    if a.plot:
        plot(a, r, a.plot)
    for f in fails:
        print(f"FAIL: {f}")
    print("PASS" if not fails else "FAIL")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
