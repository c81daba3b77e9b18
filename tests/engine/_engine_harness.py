"""Shared pieces of the engine's multi-process tests: a toy model, data, a process launcher, a reference trainer.

The toy model has everything the engine must get right: parameter sizes that do not divide by the world size, a
tied parameter (embedding == output head), a frozen parameter, a buffer, nested modules, a module called twice.
Processes are started with the ``spawn`` method on a free port (gloo); each runs *several* scenarios in one process
group so the test suite pays the start-up cost once per world size.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import signal
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 13, 6, 7, 5


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ToyModel(nn.Module):
    """Tied embedding/head, odd sizes, a frozen projection, a buffer; ``shared`` block is applied twice."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(layers))
        self.shared = Block(DIM, HIDDEN)
        self.frozen_proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = self.shared(self.shared(x))
        x = x + 0.5 * self.frozen_proj(x)
        logits = self.head(x) / self.temperature
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def build_model(seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    model = ToyModel()
    model.frozen_proj.requires_grad_(False)
    return model


def batches(steps: int, global_batch: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
             torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)) for _ in range(steps)]


def micro_batch(batch, k: int, rank: int, world_size: int, micro: int):
    """Micro-step ``k`` of ``rank``: samples ``[(k * ws + rank) * micro, +micro)`` of the global batch."""
    start = (k * world_size + rank) * micro
    return batch[0][start:start + micro], batch[1][start:start + micro]


def ds_config(stage: int, *, micro=2, gas=1, clip=0.0, dtype="fp32", lr=1e-2, bucket=40, extra_zero=None, **kw):
    cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "stage3_param_persistence_threshold": 0, **(extra_zero or {})},
        "steps_per_print": 10**6,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    cfg.update(kw)
    return cfg


def reference_train(cfg: dict, steps: int, world_size: int, seed: int = 0):
    """Plain single-process PyTorch: same init, same global batches, torch.optim.AdamW, per-micro losses."""
    model = build_model(seed)
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    opt_params = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(params, lr=opt_params["lr"], weight_decay=opt_params["weight_decay"])
    losses = []
    for batch in batches(steps, micro * gas * world_size):
        step_losses = []
        for k in range(gas):
            for r in range(world_size):
                loss = model(*micro_batch(batch, k, r, world_size, micro))
                (loss / (gas * world_size)).backward()
                step_losses.append(loss.item())
        if cfg.get("gradient_clipping", 0.0):
            torch.nn.utils.clip_grad_norm_(params, cfg["gradient_clipping"])
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return losses, state


def engine_train(engine_obj, cfg: dict, steps: int, world_size: int, rank: int, start_step: int = 0):
    """Train ``steps`` steps on the global batches ``start_step..``; returns this rank's per-micro losses."""
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    losses = []
    for batch in batches(start_step + steps, micro * gas * world_size)[start_step:]:
        step_losses = []
        for k in range(gas):
            loss = engine_obj(*micro_batch(batch, k, rank, world_size, micro))
            engine_obj.backward(loss)
            engine_obj.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    return losses


# -- process launching ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(
        world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a C++ abort (SIGABRT) still shows where each thread was
    try:
        fn(rank, world_size, Path(out_dir), *args)
    except BaseException:
        Path(out_dir, f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)  # gloo teardown race at interpreter exit: see its docstring


@dataclass(frozen=True)
class Outcome:
    """How one worker process ended: its exit code (negative: killed by that signal) and its Python traceback."""

    rank: int
    exitcode: int
    error: str | None

    def priority(self) -> tuple[int, int]:
        if self.error is not None:
            kind = 1
        elif self.exitcode > 0:
            kind = 0
        else:
            kind = 3 if -self.exitcode in (signal.SIGTERM, signal.SIGKILL) else 2
        return kind, self.rank

    def describe(self) -> str:
        if self.exitcode == 0:
            return "exited normally"
        if self.error is not None:
            return f"raised (exit code {self.exitcode}):\n{self.error}"
        if self.exitcode > 0:
            return f"terminated with exit code {self.exitcode} (no Python error)"
        return f"terminated with signal {signal.Signals(-self.exitcode).name}"


class WorkerFailed(AssertionError):
    """Some worker of :func:`launch` failed. ``outcomes`` has one :class:`Outcome` per rank; ``primary`` is the cause.

    When one rank fails, the others usually fail *because* of it (a collective loses its peer; ``join`` sends
    SIGTERM to those still running), and which of them the parent notices first is a race. So the cause is picked
    by kind, not by arrival: a plain exit code (no Python error: ``os._exit``, a C++ ``exit``) first, then a Python
    error, then a signal other than the SIGTERM/SIGKILL that ``join`` uses on the survivors; lowest rank on ties.
    """

    def __init__(self, outcomes: list[Outcome]):
        self.outcomes = outcomes
        self.primary = min((o for o in outcomes if o.exitcode != 0), key=Outcome.priority)
        others = [f"-- also rank {o.rank}: {o.describe()}" for o in outcomes if o is not self.primary]
        super().__init__("\n".join([f"worker failed: rank {self.primary.rank} {self.primary.describe()}", *others]))


def launch(fn, world_size: int, out_dir: Path, *args, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, out_dir, *args)`` in ``world_size`` spawned processes; raise :class:`WorkerFailed`
    if any of them fails.

    A worker that dies from a signal without a Python error gets one retry from a clean ``out_dir``, with a warning;
    a Python error in a worker, or a second abort, fails the test. (The abort seen in CI, ``terminate called without
    an active exception``, came from interpreter finalization racing a gloo worker thread -- up to 1 launch in 4 on
    a loaded machine; :func:`_entry` now ends with ``os._exit(0)`` after a successful run: 0 in 30 since.)
    """
    import shutil
    import sys

    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.iterdir())
    for attempt in (1, 2):
        outcomes = _launch_once(fn, world_size, out_dir, args, timeout)
        if outcomes is None:
            return
        failure = WorkerFailed(outcomes)
        if attempt == 2 or failure.primary.error is not None or failure.primary.exitcode > 0:
            raise failure
        print(f"warning: {failure}; retrying {fn.__name__} once", file=sys.stderr)
        for path in set(out_dir.iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _launch_once(fn, world_size: int, out_dir: Path, args: tuple, timeout: float) -> list[Outcome] | None:
    """None if every worker succeeded, else every worker's :class:`Outcome` (``join`` has ended them all)."""
    import torch.multiprocessing as mp

    errors = [out_dir / f"error.rank{rank}.txt" for rank in range(world_size)]
    for stale in errors:  # from an earlier launch into the same folder
        stale.unlink(missing_ok=True)
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, str(out_dir)), nprocs=world_size,
                             join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=timeout):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        return [Outcome(rank, p.exitcode, errors[rank].read_text() if errors[rank].exists() else None)
                for rank, p in enumerate(ctx.processes)]
    return None


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def dataclass_without_post_init(cls, **values):
    """An instance of the dataclass ``cls`` (e.g. transformers.TrainingArguments, whose __post_init__ needs accelerate
    and a device) with its defaults set field by field, then ``values``; its methods are the real ones."""
    import dataclasses

    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            setattr(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(obj, f.name, f.default_factory())
    for name, value in values.items():
        setattr(obj, name, value)
    return obj
