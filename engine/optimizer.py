"""The sharded optimizer step: Adam/AdamW on flat fp32 partitions (stages 0-3).

Each optimizer group ``g`` owns one flat fp32 **master** tensor (this rank's partition; the whole model for stage 0).
:meth:`ShardedOptimizer.step` receives the step's flat fp32 **gradient partitions** (one per group, from the ZeRO
manager: transient for stages 0-2, see :mod:`engine.zero.flat`), sets them as the masters' ``.grad`` only for the
duration of the inner step and drops them after, so the optimizer never keeps a gradient alive between steps. The
update is one ``torch.optim.AdamW`` / ``Adam`` over those few flat tensors (``foreach`` on CPU, ``fused`` on CUDA):
no Python loop over parameters, and padding elements stay exactly zero (zero grad, zero weight).

Communication phases of :meth:`ShardedOptimizer.step` (at most two tiny all-reduces):

1. fp16 only: overflow flag -- each rank checks its gradient partition for inf/nan; one all-reduce(MAX) of a scalar
   makes the decision identical everywhere. On overflow the step is skipped, the loss scale reduced, grads zeroed.
2. clipping only: global gradient norm -- each rank sums the squares of its partition (padding is zero, tied
   parameters are stored once, frozen ones not at all); one all-reduce(SUM) of a scalar (none for stage 0, whose
   partition is already complete); ``norm = sqrt(total) / (world_size * loss_scale)``.
3. local: gradients are multiplied once by ``1 / (world_size * loss_scale) * min(1, clip / (norm + 1e-6))`` --
   averaging over data-parallel ranks, unscaling and clipping in one pass -- then the Adam step runs on the
   partition. Parameters are refreshed afterwards by the ZeRO manager (all-gather for stages 1/2).

Bucketed step (stages 1/2, :meth:`engine.zero.flat.FlatParamManager.step_buckets`): phase 3's Adam update may be run
bucket by bucket -- each :class:`StepBucket` names ranges of the master partitions; once they are updated its
``done()`` casts them into the compute-dtype parameters and issues their all-gathers asynchronously, so bucket k's
all-gather is in flight while bucket k+1 is stepped. Adam is elementwise: the same kernels on slices give the same
bits as on the whole partition (the inner optimizer steps views of the masters and of its state); the ``step``
counter is advanced once, after the last bucket.

16-bit gradient partitions (stage 3, :meth:`engine.zero.stage3.PartitionedParamManager.grad_partitions`, when the
window's reduced gradients are still the reduce dtype on the device): the overflow check and the norm read them as
they are (``vector_norm(..., dtype=float32)``: the same values as their fp32 widening), and phase 3 runs chunk by chunk
(``widen_chunk`` elements, DeepSpeed's ``sub_group_size``): each chunk is widened to fp32 (``0 + x``, exactly what the
whole partition's widening gives), scaled, stepped and dropped, so the step holds one fp32 chunk rather than an fp32
copy of the whole partition beside the 16-bit one.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine import comm
from engine.offload import NvmeStateSwapper
from engine.precision import has_inf_or_nan

HPARAM_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class StepBucket:
    """A piece of the Adam step: ``ranges`` = ``(group, start, stop)`` element ranges of the master partitions,
    updated together; then ``done()`` is called (the ZeRO manager casts and all-gathers them)."""

    ranges: tuple[tuple[int, int, int], ...]
    done: Callable[[], None]


def _opt_field(cfg, name, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(name, cfg.get("params", {}).get(name, default))
    value = getattr(cfg, name, None)
    if value is None and hasattr(cfg, "params"):
        params = cfg.params if isinstance(cfg.params, dict) else vars(cfg.params)
        value = params.get(name)
    return default if value is None else value


def resolve_adam(opt_cfg) -> tuple[type, dict]:
    """(optimizer class, default hyper-parameters) from the config's optimizer section.

    DeepSpeed semantics: type ``AdamW`` is decoupled weight decay; type ``Adam`` is too unless ``adam_w_mode`` is
    false (DeepSpeed's default ``adam_w_mode=True``).
    """
    kind = str(_opt_field(opt_cfg, "type", "AdamW")).lower()
    if kind not in ("adam", "adamw"):
        raise ValueError(f"optimizer.type {kind!r} is not supported by the engine (Adam/AdamW only)")
    adam_w = True if kind == "adamw" else bool(_opt_field(opt_cfg, "adam_w_mode", True))
    betas = tuple(float(b) for b in _opt_field(opt_cfg, "betas", (0.9, 0.999)))
    defaults = {"lr": float(_opt_field(opt_cfg, "lr", 1e-3)), "betas": betas,
                "eps": float(_opt_field(opt_cfg, "eps", 1e-8)),
                "weight_decay": float(_opt_field(opt_cfg, "weight_decay", 0.01 if adam_w else 0.0))}
    return (torch.optim.AdamW if adam_w else torch.optim.Adam), defaults


def host_step_threads() -> int:
    """Threads for an offloaded (CPU) optimizer step: the cores this process may run on, shared among the ranks of
    this node (torchrun sets OMP_NUM_THREADS=1 for every rank, which would leave the step on one core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, local_ranks))


@contextlib.contextmanager
def _threads(n: int | None):
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _nothing() -> None:
    pass


def _widen(low: torch.Tensor, coef: float) -> torch.Tensor:
    """fp32 ``0 + low`` (exact; -0 becomes +0, as the stores' fp32 widening gives), times ``coef``."""
    out = torch.zeros(low.shape, dtype=torch.float32, device=low.device).add_(low)
    if coef != 1.0:
        out.mul_(coef)
    return out


class ShardedOptimizer:
    """Adam(W) over flat fp32 partitions; exposes ``param_groups`` so schedulers and user code can read/set lr."""

    def __init__(self, masters: list[torch.Tensor], group_hparams: list[dict], opt_cfg, *, sharded: bool,
                 dp_world_size: int, comm_device: torch.device, loss_scaler=None, nvme_path: str | None = None,
                 files=None, on_master_chunk=None, widen_chunk: int = 1_000_000_000):
        cls, defaults = resolve_adam(opt_cfg)
        self.masters = masters
        self.widen_chunk = max(1, int(widen_chunk))  # elements widened to fp32 at a time from 16-bit gradients
        self.sharded, self.dp_world_size, self.comm_device = sharded, dp_world_size, comm_device
        self.loss_scaler = loss_scaler
        for m in masters:
            m.requires_grad_(True)
        groups = []
        for m, hp in zip(masters, group_hparams):
            group = {"params": [m]}
            group.update({k: hp[k] for k in HPARAM_KEYS if k in hp})
            groups.append(group)
        on_cuda = bool(masters) and masters[0].is_cuda
        offloaded = bool(masters) and not on_cuda and torch.device(comm_device).type != "cpu"
        # fused: one vectorised pass over master, grad and moments (CUDA; and the host kernel when offloaded, about
        # 5x torch's foreach there). A CPU-only run keeps foreach, which is bit-identical to DeepSpeed's torch_adam.
        self.fused = on_cuda or offloaded
        self.inner = cls(groups, **defaults, **({"fused": True} if self.fused else {"foreach": True}))
        self.param_groups = self.inner.param_groups
        self.swapper = NvmeStateSwapper(nvme_path, comm.rank()) if nvme_path and files is None else None
        # offload_optimizer nvme (stage 3): masters and moments live in engine.nvme.OptimizerFiles
        self.files, self.on_master_chunk = files, on_master_chunk
        self.steps: list[torch.Tensor | None] = [None] * len(masters)  # per-group Adam step while streamed
        if files is not None:
            for g, m in enumerate(masters):
                files.write(g, "fp32_partition", m)
                m.data = torch.empty(0, dtype=torch.float32)  # the masters now live in the file only
        self.step_threads = host_step_threads() if offloaded else None  # None: leave the thread count alone
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0

    # -- the step -----------------------------------------------------------------------------------------------
    def host_threads(self):
        """Context for the step phase: an offloaded optimizer gets :func:`host_step_threads` threads for the host
        work (fp32 gradient partitions, unscale/clip, Adam, the masters' casts); otherwise nothing changes."""
        return _threads(self.step_threads)

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        local = any(has_inf_or_nan(g) for g in grads)
        return comm.any_true(local, self.comm_device)

    def _global_norm(self, grads: list[torch.Tensor], inv: float) -> float:
        sq = torch.zeros((), dtype=torch.float32, device=self.comm_device)
        for g in grads:  # a 16-bit partition: the norm of its exact fp32 values, with no fp32 copy
            norm = torch.linalg.vector_norm(g) if g.dtype == torch.float32 else torch.linalg.vector_norm(
                g, dtype=torch.float32)
            sq += norm.to(self.comm_device) ** 2
        if self.sharded:
            comm.all_reduce_(sq)
        return math.sqrt(float(sq)) * inv

    def step(self, grads: list[torch.Tensor], clip: float = 0.0,
             buckets: Sequence[StepBucket] | None = None) -> bool:
        """Average, unscale, clip and apply one Adam step. Returns True when the step was skipped (fp16 overflow).

        ``grads``: the step's flat gradient partitions, one per group (same layout as the masters): fp32 ones are
        scaled in place and are the masters' ``.grad`` only while the inner optimizer runs; 16-bit ones are widened
        chunk by chunk inside the update (module doc) and left unchanged. ``buckets``: run the
        update bucket by bucket, calling each one's ``done()`` after it (see module doc); ignored (one whole step,
        no ``done()`` call) when they do not tile the masters or state is swapped to NVMe -- the caller then
        refreshes what was not done. The engine runs it inside :meth:`host_threads`."""
        scale = float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0
        if self.loss_scaler is not None:
            overflow = self._overflow(grads)
            self.loss_scaler.update_scale(overflow)
            if overflow:
                self.skipped_steps += 1
                return True
        inv = 1.0 / (self.dp_world_size * scale)
        coef = inv
        if clip and clip > 0:
            self.last_grad_norm = self._global_norm(grads, inv)
            coef = inv * min(1.0, clip / (self.last_grad_norm + 1e-6))
        if any(g.dtype != torch.float32 for g in grads):
            if self.files is None and self.swapper is None:
                self._widening_step(grads, coef)
                return False
            grads = [_widen(g, coef) for g in grads]  # NVMe: the streamed step takes whole fp32 partitions
        elif coef != 1.0:
            torch._foreach_mul_(grads, coef)
        if self.files is not None:
            self._streamed_step(grads)
            return False
        if self.swapper is not None:
            self.swapper.swap_in(self.inner)
        for m, g in zip(self.masters, grads):
            m.grad = g
        try:
            if buckets and self.swapper is None and self._tiles(buckets):
                self._bucketed_step(buckets)
            else:
                self.inner.step()
        finally:
            for m in self.masters:
                m.grad = None
        if self.swapper is not None:
            self.swapper.swap_out(self.inner)
        return False

    def _tiles(self, buckets: Sequence[StepBucket]) -> bool:
        """Each master partition is covered exactly once by the buckets' ranges."""
        covered = [[] for _ in self.masters]
        for bucket in buckets:
            for g, lo, hi in bucket.ranges:
                covered[g].append((lo, hi))
        for m, spans in zip(self.masters, covered):
            end = 0
            for lo, hi in sorted(spans):
                if lo != end or hi <= lo:
                    return False
                end = hi
            if end != m.numel():
                return False
        return True

    def _widening_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """Phase 3 over 16-bit gradient partitions: the update in ``widen_chunk``-element pieces, each piece's fp32
        gradient made (``0 + x``, scaled by ``coef``) just before its update and dropped after."""
        chunk = self.widen_chunk
        buckets = [StepBucket(((g, lo, min(lo + chunk, m.numel())),), _nothing)
                   for g, m in enumerate(self.masters) for lo in range(0, m.numel(), chunk)]
        for m in self.masters:  # state initialisation needs a grad: a zero-stride stand-in, no memory
            m.grad = torch.zeros((), dtype=m.dtype, device=m.device).expand(m.shape)
        try:
            self._bucketed_step(buckets, grad_of=lambda g, lo, hi: _widen(grads[g][lo:hi], coef))
        finally:
            for m in self.masters:
                m.grad = None

    @torch.no_grad()
    def _bucketed_step(self, buckets: Sequence[StepBucket],
                       grad_of: Callable[[int, int, int], torch.Tensor] | None = None) -> None:
        """``inner.step()`` once per bucket, on slices: the masters' state is initialised as torch does
        (``_init_group``); then each bucket's groups hold detached views of its master ranges, with the matching
        slices of the gradients and moments as their ``.grad`` and state and a copy of the ``step`` counter, which is
        advanced once at the end. The update runs through ``inner.step()`` with the group's options, as always."""
        inner, groups = self.inner, self.inner.param_groups
        for group in groups:
            inner._init_group(group, [], [], [], [], [], [])
        states = [inner.state[m] for m in self.masters]
        whole = [group["params"] for group in groups]
        views: list[torch.Tensor] = []
        try:
            for bucket in buckets:
                for group in groups:
                    group["params"] = []
                for g, lo, hi in bucket.ranges:
                    view = self.masters[g].detach()[lo:hi]
                    view.grad = self.masters[g].grad[lo:hi] if grad_of is None else grad_of(g, lo, hi)
                    inner.state[view] = {k: t.clone() if k == "step" else t[lo:hi] for k, t in states[g].items()}
                    groups[g]["params"].append(view)
                    views.append(view)
                inner.step()
                while views:
                    del inner.state[views.pop()]
                bucket.done()
        finally:
            for view in views:
                inner.state.pop(view, None)
            for group, params in zip(groups, whole):
                group["params"] = params
        for state in states:
            state["step"] += 1

    def _streamed_step(self, grads: list[torch.Tensor]) -> None:
        """The Adam step chunk by chunk through the files: the same torch functional kernel and arguments as
        ``self.inner.step()`` (elementwise, so chunking changes no bit); each updated master chunk is handed to
        ``on_master_chunk(group, offset, chunk)`` (stage 3 casts it into the parameter partition)."""
        from torch.optim.adam import adam

        for g, group in enumerate(self.param_groups):
            if self.steps[g] is None:
                self.steps[g] = torch.tensor(0.0, dtype=torch.float32)
            step_before = self.steps[g].clone()
            grad = grads[g]
            beta1, beta2 = group["betas"]

            def one(off, views, group=group, grad=grad, beta1=beta1, beta2=beta2, g=g):
                n = views["fp32_partition"].numel()
                adam([views["fp32_partition"]], [grad[off: off + n]], [views["exp_avg"]], [views["exp_avg_sq"]], [],
                     [step_before.clone()], foreach=group.get("foreach"), capturable=False, differentiable=False,
                     fused=None, has_complex=False, decoupled_weight_decay=group.get("decoupled_weight_decay", self.kind == "adamw"),
                     amsgrad=group.get("amsgrad", False), beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False))
                if self.on_master_chunk is not None:
                    self.on_master_chunk(g, off, views["fp32_partition"])

            self.files.stream(g, one)
            self.steps[g] += 1

    def close(self) -> None:
        """Remove the optimizer files (offload_optimizer nvme)."""
        if self.files is not None:
            self.files.close()
        if self.swapper is not None:
            self.swapper.cleanup()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Gradients are owned by the engine (zeroed after every step); kept for API compatibility."""

    # -- state for checkpoints ----------------------------------------------------------------------------------
    def master_tensors(self) -> dict[str, torch.Tensor]:
        """``group{g}.fp32_partition`` per group (read back from the files with offload_optimizer nvme)."""
        if self.files is not None:
            return {f"group{g}.fp32_partition": self.files.read(g, "fp32_partition") for g in range(len(self.masters))}
        return {f"group{g}.fp32_partition": m.detach() for g, m in enumerate(self.masters)}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Adam moments and step per group, keyed ``group{g}.{state key}``."""
        if self.files is not None:
            return {f"group{g}.{key}": (self.steps[g].clone() if key == "step" else self.files.read(g, key))
                    for g in range(len(self.masters)) if self.steps[g] is not None
                    for key in ("step", "exp_avg", "exp_avg_sq")}
        if self.swapper is not None:
            self.swapper.swap_in(self.inner)
        out = {}
        for g, m in enumerate(self.masters):
            for key, value in self.inner.state.get(m, {}).items():
                out[f"group{g}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
        if self.swapper is not None:
            out = {k: v.clone() for k, v in out.items()}
            self.swapper.swap_out(self.inner)
        return out

    @property
    def kind(self) -> str:
        """The inner optimizer's class, as checkpoints record it: "adamw" (decoupled weight decay) or "adam"."""
        return type(self.inner).__name__.lower()

    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter state tensors held now (Adam: exp_avg, exp_avg_sq; none before the first step), each
        shaped like the master partition; ``step`` is per group and not listed."""
        if self.files is not None:
            return ("exp_avg", "exp_avg_sq") if any(s is not None for s in self.steps) else ()
        keys: dict[str, None] = {}
        for m in self.masters:
            keys.update((k, None) for k in self.inner.state.get(m, {}) if k != "step")
        return tuple(keys)

    def hparams(self) -> list[dict]:
        return [{k: (list(g[k]) if k == "betas" else g[k]) for k in HPARAM_KEYS} for g in self.param_groups]

    def load_masters(self, tensors: dict[str, torch.Tensor]) -> None:
        for g, m in enumerate(self.masters):
            src = tensors[f"group{g}.fp32_partition"]
            numel = self.files.numel[g] if self.files is not None else m.numel()
            if src.numel() != numel:
                raise ValueError(f"group {g}: checkpoint partition has {src.numel()} elements, engine {numel}")
            if self.files is not None:
                self.files.write(g, "fp32_partition", src)
                continue
            with torch.no_grad():
                m.copy_(src)

    def load_state(self, tensors: dict[str, torch.Tensor], hparams: list[dict] | None) -> None:
        if self.files is not None:
            self._load_state_files(tensors)
        for g, m in enumerate(self.masters if self.files is None else ()):
            prefix = f"group{g}."
            state = {}
            for key, value in tensors.items():
                if key.startswith(prefix):
                    name = key[len(prefix):]
                    on_device = name != "step" or self.fused
                    state[name] = value.to(m.device if on_device else "cpu", copy=True)
            self.inner.state[m] = state
        for group, hp in zip(self.param_groups, hparams or []):
            for k in HPARAM_KEYS:
                if k in hp:
                    group[k] = tuple(hp[k]) if k == "betas" else hp[k]
        if self.swapper is not None:
            self.swapper.swapped = False
            self.swapper.swap_out(self.inner)

    def _load_state_files(self, tensors: dict[str, torch.Tensor]) -> None:
        for g in range(len(self.masters)):
            step = tensors.get(f"group{g}.step")
            self.steps[g] = None if step is None else step.to("cpu", torch.float32, copy=True).reshape(())
            for key in ("exp_avg", "exp_avg_sq"):
                value = tensors.get(f"group{g}.{key}")
                self.files.write(g, key, value if value is not None else torch.zeros(self.files.numel[g]))

    def state_dict(self) -> dict:
        """Torch-style state dict of the inner optimizer (for callers that expect one; checkpoints use safetensors)."""
        return self.inner.state_dict()
