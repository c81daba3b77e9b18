"""``zckpt demo``: the Quick start's main job.

1. Train a tiny causal LM with the engine on 2 CPU ranks (ZeRO-3, gloo, ``torchrun -m engine.demo`` in a
   subprocess) on synthetic data with evaluation, saving through CheckpointManager (rotation, best tracking) and
   ending with load_best_model_at_end; list the run; consolidate the best checkpoint to bf16 safetensors; load it
   with transformers' ``from_pretrained``; check the weights equal the engine's gathered fp32 weights after its
   load_best cast to bf16, bit for bit, and that the loaded model has learnt the synthetic task (loss on a fresh batch
   that
   ``engine.demo`` wrote). This module only reads the files the subprocess wrote: zckpt never imports the engine's
   training side.
3. List the bundled real HF Trainer + DeepSpeed run with evaluation (``fixtures/deepspeed/hf_best_run``: the eval loss
   falls then rises, ``load_best_model_at_end=True``), consolidate its best checkpoint and check it equals the weights
   the Trainer itself loaded at the end, bit for bit.
2. Do the same for the bundled real-DeepSpeed checkpoint ``fixtures/deepspeed/hf_run`` (an HF Trainer output dir of a
   ZeRO-3 bf16 run on 2 ranks, written by DeepSpeed 0.19), checking logits against DeepSpeed's own reconstruction.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import SourceNotFoundError, ZckptError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "hf_run"
BEST_FIXTURE = FIXTURE.with_name("hf_best_run")


def run(out: Path | None = None, *, engine_steps: int = 40) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ZckptError(f"the demo needs transformers ({exc}); pip install 'zckpt[hf]'") from None
    with tempfile.TemporaryDirectory() as tmp:
        run_engine(Path(tmp), engine_steps)
    print()
    run_deepspeed_fixture(out)
    print()
    run_best_fixture()


def run_engine(work: Path, steps: int) -> None:
    """Part 1: train with the engine on 2 ranks, consolidate, load, check."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    from . import consolidate
    from .registry import best_path, render_run, scan
    from .report import inspect, render

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "engine.demo", "--out", str(work), "--steps", str(steps)]
    print("$ torchrun --nproc_per_node 2 -m engine.demo   # ZeRO-3, 2 CPU ranks (gloo), synthetic data")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("[engine]")))
    if proc.returncode != 0:
        raise ZckptError(f"engine training failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    run_dir = work / "run"
    print(f"\n$ zckpt list {run_dir}")
    print(render_run(scan(run_dir)))
    ckpts = best_path(run_dir)
    train = json.loads((work / "train.json").read_text())
    if str(ckpts) != train["best"]:
        raise ZckptError(f"demo check failed: zckpt best says {ckpts}, the engine loaded {train['best']}")
    print(f"\n$ zckpt inspect $(zckpt best {run_dir})")
    print(render(inspect(ckpts)))
    target = work / "model-bf16"
    print(f"\n$ zckpt consolidate {run_dir} {target} --best")
    result = consolidate(ckpts, target, dtype="bf16", quiet=True)
    print(f"wrote {result.files} + {result.copied} ({result.parameters:,} parameters, {result.dtype}); "
          f"tied, written once: {result.tied}")
    model, info = _load_hf(target)
    gathered = load_file(str(work / "final_fp32.safetensors"))
    state = model.state_dict()
    exact = all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in gathered.items())
    print(f"weights vs the engine's gathered fp32 weights (after load_best) cast to bf16: "
          f"{'identical' if exact else 'DIFFERENT'}")
    batch = torch.tensor(train["eval_ids"])  # made by engine.demo from its own data generator, never trained on
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.item()
    first, last = train["losses"][0], train["losses"][-1]
    print(f"loaded bf16 model, loss on fresh synthetic data: {loss:.4f} (training: {first:.4f} -> {last:.4f})")
    if info or not exact or not loss < first / 2:
        raise ZckptError("demo check failed: see above")


def _load_hf(target: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    print(f"transformers loaded {type(model).__name__} in {model.dtype}; missing/unexpected keys: "
          f"{problems or 'none'}")
    return model, problems


def run_deepspeed_fixture(out: Path | None = None) -> None:
    """Part 2: the bundled real-DeepSpeed checkpoint."""
    if not FIXTURE.is_dir():
        raise SourceNotFoundError(f"{FIXTURE} is missing: the demo needs a source checkout (pip install -e .)")
    import torch
    from safetensors.torch import load_file
    from . import consolidate
    from .report import inspect, render

    print(f"$ zckpt inspect {FIXTURE}   # a real DeepSpeed 0.19 ZeRO-3 bf16 run (HF Trainer layout)")
    print(render(inspect(FIXTURE)))
    with tempfile.TemporaryDirectory() as tmp:
        target = out or Path(tmp) / "model-bf16"
        print(f"\n$ zckpt consolidate {FIXTURE} {target}")
        result = consolidate(FIXTURE, target, dtype="bf16", overwrite=out is not None, quiet=True)
        print(f"wrote {result.files} + {result.copied} ({result.parameters:,} parameters, {result.dtype}, "
              f"{result.seconds:.2f}s); tied, written once: {result.tied}")
        model, problems = _load_hf(target)
        reference = _reference_model(model, load_file(str(FIXTURE / "reference.safetensors")))
        ids = torch.arange(0, 32).reshape(2, 16) % model.config.vocab_size
        with torch.no_grad():
            ours, ref = model(input_ids=ids).logits, reference(input_ids=ids).logits
        same = torch.equal(ours, ref)
        print(f"logits vs DeepSpeed's zero_to_fp32 reference cast to bf16: "
              f"{'identical' if same else 'DIFFERENT (max abs diff %g)' % (ours - ref).abs().max().item()}")
        if problems or not same:
            raise ZckptError("demo check failed: see above")


def _reference_model(model, state_dict):
    import copy

    import torch

    reference = copy.deepcopy(model)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in state_dict.items()}, strict=False)
    return reference


def run_best_fixture() -> None:
    """Part 3: best tracking on a real HF Trainer + DeepSpeed run."""
    if not BEST_FIXTURE.is_dir():
        raise SourceNotFoundError(f"{BEST_FIXTURE} is missing: the demo needs a source checkout (pip install -e .)")
    import torch
    from safetensors.torch import load_file

    from . import consolidate
    from .registry import best_path, render_run, scan

    print(f"$ zckpt list {BEST_FIXTURE}   # a real HF Trainer + DeepSpeed ZeRO-3 run, load_best_model_at_end=True")
    print(render_run(scan(BEST_FIXTURE)))
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "best-fp32"
        print(f"\n$ zckpt consolidate {BEST_FIXTURE} {target} --best --dtype fp32")
        result = consolidate(best_path(BEST_FIXTURE), target, dtype="fp32", quiet=True)
        ours = load_file(str(target / "model.safetensors"))
    trainer = load_file(str(BEST_FIXTURE / "trainer_loaded.safetensors"))
    same = ours.keys() == trainer.keys() and all(torch.equal(ours[k], trainer[k]) for k in trainer)
    print(f"wrote {result.files} from {Path(result.source).name}; vs the weights the Trainer held after its "
          f"load_best_model_at_end: {'identical' if same else 'DIFFERENT'}")
    if not same:
        raise ZckptError("demo check failed: see above")
