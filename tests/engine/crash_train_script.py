"""Train the harness's toy model and save an engine checkpoint after every step; resume from ``latest`` first.

    torchrun --nproc_per_node 2 tests/engine/crash_train_script.py --save-dir S --out O --steps N

Used by tests/engine/test_crash_consistency.py, which SIGKILLs the whole process group (launcher and ranks) at a
random moment and then checks what is left. On start, when ``S/latest`` exists, every rank loads it; rank 0 writes
``O/resumed.json`` (the tag, the step and a sha256 of the loaded fp32 weights) so the test can compare the resume
with what zckpt reads from that tag (``O/resumed_state.pt``: the loaded fp32 state dict). ``O/training`` appears
when the first step starts; ``O/done.rank<r>`` when all ran.
``--die-rank R --die-at-step K``: rank R exits abruptly (os._exit) in the middle of save K (after its rank files,
before the commit), while the other rank carries on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_harness import build_model, ds_config, engine_train  # noqa: E402

CFG = ds_config(2, micro=2)


def weights_digest(state: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--die-rank", type=int, default=None)
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--no-dump", action="store_true", help="do not write resumed_state.pt (a file-size limit)")
    args = ap.parse_args()

    import torch

    import engine

    torch.set_num_threads(1)
    engine.init_distributed()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    save_dir, out = Path(args.save_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(0)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    start = 0
    if (save_dir / "latest").exists():
        path, _client = eng.load_checkpoint(save_dir)
        start = eng.global_steps
        state = eng.fp32_state_dict()  # collective
        if rank == 0 and not args.no_dump:
            torch.save(state, out / "resumed_state.pt")
            (out / "resumed.json").write_text(json.dumps({"tag": Path(path).name, "step": start,
                                                          "sha256": weights_digest(state)}))
    if rank == 0:
        (out / "training").write_text(str(start))
    for step in range(start, start + args.steps):
        engine_train(eng, CFG, 1, world, rank, start_step=step)
        if args.die_rank == rank and args.die_at_step == step + 1:
            import engine.checkpoint as ckpt

            ckpt._commit = lambda *a, **k: os._exit(9)  # dies after writing its rank files, before the commit
        eng.save_checkpoint(save_dir)
    (out / f"done.rank{rank}").write_text(str(start + args.steps))
    dist.barrier()


if __name__ == "__main__":
    main()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)
