"""The DeepSpeed-compatible face: ``initialize()`` and :class:`Engine`.

Training loop (as with DeepSpeed)::

    engine, optimizer, loader, scheduler = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)   # loss / gas * loss_scale, autograd; stage 2/3 reduce-scatter during backward
        engine.step()           # at the accumulation boundary: reduce (stages 0/1), optimizer step, all-gather

Phases of one optimizer step, by stage (collectives are per unit = flat bucket, see :mod:`engine.partition`):

=====  =========================================  ==================================  =========================
stage  forward/backward                           boundary                            after the Adam step
=====  =========================================  ==================================  =========================
0      full params; autograd .grad tensors        pack + all-reduce per unit          (every rank updated all)
1      full params; autograd .grad tensors        pack + reduce-scatter per unit      all-gather per unit (*)
2      full params; reduce-scatter per unit as    (done)                              all-gather per unit (*)
       its grads complete, full grads freed
3      all-gather per module before forward and   (done)                              cast master -> partition
       backward, released after; reduce-scatter
       per unit as its grads complete
=====  =========================================  ==================================  =========================

(*) with ``overlap_comm``, overlapped with the step: bucket k's all-gathers run while bucket k+1 is stepped
(:mod:`engine.zero.flat`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine import comm
from engine.config import EngineConfig, load_config, model_hidden_size
from engine.offload import resolve_placement
from engine.optimizer import HPARAM_KEYS, ShardedOptimizer
from engine.partition import engine_layout, engine_units
from engine.precision import make_loss_scaler
from engine.scheduler import build_scheduler
from engine.zero.flat import FlatParamManager
from engine.zero.init import materialize
from engine.zero.prefetch import Stage3Options
from engine.zero.stage3 import PartitionedParamManager

# -- config ------------------------------------------------------------------------------------------------------
def load_engine_config(config, training_args=None, world_size: int = 1, model: nn.Module | None = None,
                       num_training_steps: int | None = None) -> EngineConfig:
    """The typed, resolved config: ``engine.config.load_config`` with the hidden size HF's integration would take
    from ``model`` (for the ZeRO-3 "auto" bucket sizes) and the total step count, if the caller knows it."""
    return load_config(config, training_args=training_args, world_size=world_size,
                       model_hidden_size=model_hidden_size(model) if model is not None else None,
                       num_training_steps=num_training_steps)


def _make_loss_scaler(cfg: EngineConfig):
    return make_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None


def _make_scheduler(cfg: EngineConfig, optimizer, client_scheduler, training_args=None,
                    num_training_steps: int | None = None):
    """The caller's scheduler, else the config's "scheduler" section, else (with ``training_args``) the one HF
    Trainer creates from ``lr_scheduler_type`` (:func:`engine.hf_optim.trainer_scheduler`), else none."""
    if client_scheduler is not None:
        return client_scheduler(optimizer) if callable(client_scheduler) and not hasattr(
            client_scheduler, "step") else client_scheduler
    if cfg.scheduler is None and training_args is not None:
        from engine.hf_optim import trainer_scheduler
        return trainer_scheduler(training_args, optimizer, num_training_steps)
    return build_scheduler(cfg.scheduler, optimizer)


def _optimizer_source(cfg: EngineConfig, model: nn.Module, model_parameters, client_optimizer, training_args):
    """``(model_parameters, optimizer section)``: the client optimizer's, the config's, or -- neither given, as HF
    Trainer does -- AdamW from ``training_args`` with decay / no-decay groups (:mod:`engine.hf_optim`)."""
    if client_optimizer is None and cfg.optimizer is None and training_args is not None:
        from engine.hf_optim import trainer_optimizer
        model_parameters, opt_cfg = trainer_optimizer(model, model_parameters, training_args)
    else:
        opt_cfg = client_optimizer_cfg(client_optimizer, cfg.optimizer)
    if client_optimizer is not None or cfg.optimizer is None:
        _note_force_ds_cpu_optimizer(cfg)
    return model_parameters, opt_cfg


def _note_force_ds_cpu_optimizer(cfg: EngineConfig) -> None:
    """``zero_force_ds_cpu_optimizer`` (DeepSpeed default true) makes DeepSpeed refuse a client optimizer with
    ``offload_optimizer`` because the client's step would run slowly on the CPU. The engine never runs the client's
    optimizer object: it takes its hyper-parameters and runs its own flat AdamW over the offloaded partitions (what
    DeepSpeedCPUAdam is to DeepSpeed), so there is nothing to refuse; the flag is accepted, and logged."""
    if cfg.zero.offload_optimizer.enabled and cfg.zero_force_ds_cpu_optimizer:
        logging.getLogger("engine.config").info(
            "zero_force_ds_cpu_optimizer = true with offload_optimizer and a client/Trainer optimizer: accepted "
            "(DeepSpeed would refuse it); the engine runs its own offloaded AdamW with that optimizer's settings")


# -- parameter discovery ----------------------------------------------------------------------------------------
def _param_groups(model: nn.Module, model_parameters, client_optimizer) -> list[tuple[list, dict]]:
    """``[(params, hparam overrides)]`` from ``model_parameters`` (params or group dicts) or a client optimizer."""
    if client_optimizer is not None:
        source = client_optimizer.param_groups
    elif model_parameters is None:
        source = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            source = items
        else:
            source = [{"params": items}]
    seen, groups = set(), []
    for group in source:
        params = [p for p in group["params"] if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            groups.append((params, {k: group[k] for k in HPARAM_KEYS if k in group}))
    return groups


def _names(model: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """Canonical name per parameter object (first registration) and tied aliases ``alias -> canonical``."""
    canonical, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    return canonical, aliases


class Engine(nn.Module):
    """A ZeRO stage 0-3 data-parallel training engine with DeepSpeed's engine API."""

    def __init__(self, model: nn.Module, config, *, model_parameters=None, client_optimizer=None,
                 lr_scheduler=None, training_args=None, training_data=None, collate_fn=None,
                 num_training_steps: int | None = None):
        super().__init__()
        self.ctx = comm.init_distributed()
        self.config = load_engine_config(config, training_args=training_args, world_size=self.ctx.world_size,
                                         model=model, num_training_steps=num_training_steps)
        self.module = model
        self.stage = int(self.config.zero.stage)
        self.compute_dtype = self.config.compute_dtype
        self.device = self.ctx.device
        self.placement = resolve_placement(self.config.zero, self.device)
        self.global_steps = self.global_samples = self.micro_steps = 0
        self._step_applied = False
        model_parameters, opt_cfg = _optimizer_source(self.config, model, model_parameters, client_optimizer,
                                                      training_args)
        self._setup_params(model_parameters, client_optimizer)
        self._setup_buffers()
        self.loss_scaler = _make_loss_scaler(self.config)
        self.optimizer = ShardedOptimizer(
            self.mgr.masters, self.group_hparams, opt_cfg,
            sharded=self.stage > 0, dp_world_size=self.ctx.world_size, comm_device=self.device,
            loss_scaler=self.loss_scaler, nvme_path=self.placement.nvme_path, **self._optimizer_files(),
            widen_chunk=int(self.config.zero.sub_group_size))
        self.lr_scheduler = _make_scheduler(self.config, self.optimizer, lr_scheduler, training_args,
                                            num_training_steps)
        self.training_dataloader = self._dataloader(training_data, collate_fn) if training_data is not None else None

    # -- setup --------------------------------------------------------------------------------------------------
    def _setup_params(self, model_parameters, client_optimizer) -> None:
        model = self.module
        groups = _param_groups(model, model_parameters, client_optimizer)
        self.group_hparams = [hp for _, hp in groups]
        trainable = [p for ps, _ in groups for p in ps]
        group_of = [g for g, (ps, _) in enumerate(groups) for _ in ps]
        trainable_ids = {id(p) for p in trainable}
        unique = list(dict.fromkeys(model.parameters()))  # dedup tied, keep order
        self.frozen = [p for p in unique if id(p) not in trainable_ids]
        self.frozen_partitioned = 0  # how many of self.frozen (the first ones) the stage-3 manager partitions
        canonical, self.aliases = _names(model)
        self.trainable = trainable
        if self.stage < 3:
            materialize(unique)
            numels = [p.numel() for p in trainable]
            units = engine_units(self.stage, numels, group_of, [canonical[id(p)] for p in trainable],
                                 reduce_bucket_size=int(self.config.zero.reduce_bucket_size))
            self.table = engine_layout(self.stage, self.ctx.world_size, numels, group_of, units)
            self.mgr = FlatParamManager(
                trainable, self.table, stage=self.stage, device=self.device, compute_dtype=self.compute_dtype,
                reduce_dtype=self._reduce_dtype(), master_device=self.placement.master_device,
                overlap_comm=bool(self.config.zero.overlap_comm),
                reduce_bucket_size=int(self.config.zero.reduce_bucket_size),
                allgather_bucket_size=int(self.config.zero.allgather_bucket_size))
            for p in self.frozen:
                p.data = p.data.to(self.device, self.compute_dtype if p.is_floating_point() else p.dtype)
            _broadcast_flat(self.frozen)
            self.managed = trainable
        else:
            # floating frozen params are partitioned (compute dtype); integer ones stay whole on every rank, in
            # their dtype (a bf16 partition would round 301 to 300), after the partitioned ones in ``self.frozen``
            whole = [p for p in self.frozen if not p.is_floating_point()]
            self.frozen = [p for p in self.frozen if p.is_floating_point()] + whole
            self.frozen_partitioned = len(self.frozen) - len(whole)
            materialize(whole)
            for p in whole:
                p.data = p.data.to(self.device)
            _broadcast_flat(whole)
            managed = trainable + self.frozen[:self.frozen_partitioned]
            group_of = group_of + [len(groups)] * self.frozen_partitioned
            numels = [_numel(p) for p in managed]
            model_names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
            units = engine_units(3, numels, group_of, [canonical[id(p)] for p in managed],
                                 reduce_bucket_size=int(self.config.zero.reduce_bucket_size),
                                 model_names=model_names)
            self.table = engine_layout(3, self.ctx.world_size, numels, group_of, units)
            self.mgr = PartitionedParamManager(
                managed, self.table, num_trainable_groups=len(groups), device=self.device,
                param_device=self.placement.param_device, compute_dtype=self.compute_dtype,
                reduce_dtype=self._reduce_dtype(), master_device=self.placement.master_device,
                persistence_threshold=self.config.zero.param_persistence_threshold,
                options=Stage3Options.from_zero_config(self.config.zero), param_files=self._param_files())
            self.mgr.install_hooks(model)
            self.managed = managed
        self.param_names = [canonical[id(p)] for p in self.trainable]
        self.frozen_names = [canonical[id(p)] for p in self.frozen]

    def _param_files(self):
        """offload_param nvme (stage 3): a factory of :class:`engine.nvme.ParamFiles`, else None."""
        sub = self.config.zero.offload_param
        if sub.device != "nvme":
            return None
        from engine.nvme import ParamFiles

        pin = self.device.type == "cuda" and bool(sub.pin_memory)
        # a staging buffer holds at least the largest unit slice, and never more than this rank's largest partition
        largest_slice = max((u.slice_numel for u in self.table.units), default=1)
        numel = max(min(int(sub.buffer_size), max(self.table.group_partition_numel, default=1)), largest_slice)
        return lambda sizes, dtype: ParamFiles(sub.nvme_path, self.ctx.rank, sizes, dtype,
                                               buffer_count=int(sub.buffer_count), buffer_numel=numel, pin=pin)

    def _optimizer_files(self) -> dict:
        """offload_optimizer nvme with stage 3: masters and moments in :class:`engine.nvme.OptimizerFiles`,
        streamed through the step in ``min(sub_group_size, 16M)``-element chunks. (Stages 1/2 keep the simple
        moments swap of :class:`engine.offload.NvmeStateSwapper`.)"""
        sub = self.config.zero.offload_optimizer
        if sub.device != "nvme" or self.stage != 3:
            return {}
        from engine.nvme import DEFAULT_CHUNK, OptimizerFiles

        chunk = min(int(self.config.zero.sub_group_size), DEFAULT_CHUNK)
        files = OptimizerFiles(sub.nvme_path, self.ctx.rank, [m.numel() for m in self.mgr.masters], chunk)
        self.mgr.master_io = files
        return {"files": files, "on_master_chunk": self.mgr.take_master_chunk}

    def _reduce_dtype(self) -> torch.dtype:
        """``communication_data_type`` if set; else the compute dtype on NCCL, fp32 on gloo (CPU)."""
        name = self.config.communication_data_type
        if name:
            return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        return self.compute_dtype if self.ctx.backend == "nccl" else torch.float32

    def _setup_buffers(self) -> None:
        """Cast floating buffers to the compute dtype (as DeepSpeed's ``module.half()``/``bfloat16()``), move them
        to the device and broadcast them from rank 0 -- one broadcast per dtype, over a flat copy."""
        buffers = list(dict.fromkeys(self.module.buffers()))
        for b in buffers:
            b.data = b.data.to(self.device, self.compute_dtype if b.is_floating_point() else b.dtype)
        _broadcast_flat(buffers)

    def _dataloader(self, dataset, collate_fn):
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=self.ctx.world_size, rank=self.ctx.rank)
        return DataLoader(dataset, batch_size=self.train_micro_batch_size_per_gpu(), sampler=sampler,
                          collate_fn=collate_fn)

    # -- the training loop ----------------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """``(loss / gas * loss_scale).backward()``, then finish this micro-step's gradient reduction."""
        scaled = loss.float()
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            scaled = scaled / gas
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.loss_scale
        scaled.backward(retain_graph=retain_graph)
        # every stage widens its 16-bit gradient store to fp32 when more micro-steps follow
        self.mgr.after_backward(boundary=self.is_gradient_accumulation_boundary())
        return loss

    @torch.no_grad()
    def step(self, lr_kwargs=None) -> None:
        """At the accumulation boundary: reduce (stages 0/1), clip, Adam step, refresh params, scheduler."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            with self.optimizer.host_threads():
                self.mgr.reduce_at_boundary()
                grads = self._grad_partitions()
                # stages 1/2: stepped bucket by bucket, each bucket's all-gathers issued as soon as it is updated
                buckets = self.mgr.step_buckets() if self.stage < 3 else None
                overflow = self.optimizer.step(grads, float(self.config.gradient_clipping or 0.0), buckets=buckets)
                del grads  # the fp32 gradient partitions die with the manager's stores in zero_grads()
                if not overflow:
                    self.mgr.update_params()
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step(**(lr_kwargs or {}))
                self._step_applied = not overflow
                self.mgr.zero_grads()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def _grad_partitions(self) -> list[torch.Tensor]:
        """The step's flat fp32 gradient partitions, made at step time (every stage keeps its reduced gradients in the
        reduce dtype until now; see :class:`engine.zero.flat.GradStore`)."""
        return self.mgr.grad_partitions()

    # -- DeepSpeed-compatible accessors -----------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if getattr(self, "_boundary_override", None) is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: the caller says whether the next backward/step is the accumulation boundary (accelerate calls
        it before every backward and calls :meth:`step` only at the boundary) instead of counting micro-steps."""
        self._boundary_override = bool(is_boundary)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.last_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are zeroed by :meth:`step`; kept for API compatibility."""

    def destroy(self) -> None:
        """Detach the engine from the model (DeepSpeed's ``destroy``): wait for an asynchronous save, remove the
        ZeRO manager's hooks, remove NVMe offload files. A dropped engine is freed without it too (the gradient hooks,
        held by the parameters in C++, reference the manager weakly), but its NVMe files then wait for exit."""
        if getattr(self, "_saver", None) is not None:
            self._saver.wait()
        for handle in getattr(self.mgr, "_hooks", []):
            handle.remove()
        self.mgr._hooks = []
        if self.stage == 3:  # NVMe offload files are removed
            self.mgr.close()
        self.optimizer.close()

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def _checkpoint_view(self):
        """What the checkpoint code sees of this engine (:class:`engine.checkpoint.CheckpointView`)."""
        from engine.checkpoint import CheckpointView, Counters

        return CheckpointView(
            stage=self.stage, rank=self.ctx.rank, world_size=self.ctx.world_size, device=self.device,
            compute_dtype=self.compute_dtype, table=self.table, param_names=tuple(self.param_names),
            param_shapes=tuple(tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
                               for p in self.trainable),
            frozen_names=tuple(self.frozen_names), frozen=tuple(self.frozen),
            frozen_partitioned=self.frozen_partitioned, aliases=dict(self.aliases), module=self.module,
            mgr=self.mgr, optimizer=self.optimizer, loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler,
            counters=Counters(global_steps=self.global_steps, global_samples=self.global_samples,
                              micro_steps=self.micro_steps, skipped_steps=self.skipped_steps),
            config=self.config.to_dict(), reduce_bucket_size=int(self.config.zero.reduce_bucket_size),
            gather_16bit_weights_on_model_save=bool(self.config.zero.gather_16bit_weights_on_model_save),
            set_counters=self._set_counters, saver=self._async_saver())

    def _async_saver(self):
        from engine.checkpoint import AsyncSaver

        if getattr(self, "_saver", None) is None:
            self._saver = AsyncSaver()
        return self._saver

    def _set_counters(self, *, global_steps: int, global_samples: int, micro_steps: int,
                      skipped_steps: int | None = None) -> None:
        """Restore the step counters from a checkpoint (``skipped_steps=None`` keeps the optimizer's)."""
        self.global_steps, self.global_samples, self.micro_steps = global_steps, global_samples, micro_steps
        if skipped_steps is not None:
            self.optimizer.skipped_steps = skipped_steps

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        async_save: bool = False, exclude_optimizer_states: bool = False, **_ignored):
        """Collective. Save a committed checkpoint (DeepSpeed's signature). ``async_save=True`` returns once the
        state is copied to host memory and commits in the background; the next save or load, or process exit,
        waits for it, and a failure is raised there (:meth:`wait_for_checkpoint` waits explicitly).
        ``exclude_optimizer_states=True`` writes the weights only (fp32 masters, frozen params, buffers, counters,
        scheduler; no optimizer files): what ``save_only_model`` asks for; load it with ``load_module_only=True``."""
        from engine.checkpoint import save_checkpoint
        return save_checkpoint(self._checkpoint_view(), save_dir, tag=tag, client_state=client_state,
                               save_latest=save_latest, async_save=async_save,
                               exclude_optimizer_states=exclude_optimizer_states)

    def wait_for_checkpoint(self) -> None:
        """Collective. Block until an asynchronous save is committed; raise if it failed on any rank."""
        self._async_saver().wait()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, **_ignored):
        """Restore from an engine or DeepSpeed checkpoint dir; another world size, stage or layout is resharded
        while loading. Returns ``(path, client_state)``."""
        from engine.checkpoint import load_checkpoint
        return load_checkpoint(self._checkpoint_view(), load_dir, tag=tag,
                               load_optimizer_states=load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors", max_shard_size="5GB"):
        from engine.checkpoint import save_16bit_model
        return save_16bit_model(self._checkpoint_view(), save_dir, save_filename=save_filename,
                                max_shard_size=max_shard_size)

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights (plus frozen params and buffers) on every rank; for tests and small models."""
        from engine.checkpoint import gather_fp32_state_dict
        return gather_fp32_state_dict(self._checkpoint_view())


def _broadcast_flat(tensors) -> None:
    """Broadcast ``tensors`` from rank 0 in place: one flat copy and one broadcast per dtype."""
    by_dtype: dict[torch.dtype, list] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.data.reshape(-1) for t in group])
        if flat.numel() == 0:
            continue
        comm.broadcast_(flat, 0)
        offset = 0
        for t in group:
            t.data.copy_(flat[offset: offset + t.numel()].view(t.shape))
            offset += t.numel()


def _numel(p) -> int:
    return int(p.ds_numel) if hasattr(p, "ds_numel") and p.numel() == 0 else p.numel()


def client_optimizer_cfg(client_optimizer, config_optimizer):
    """The optimizer section to use: the config's, or one describing a client torch Adam/AdamW."""
    if client_optimizer is None:
        if config_optimizer is None:
            raise ValueError("no optimizer: add an \"optimizer\" section to the config (e.g. "
                             "{\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}), pass optimizer=, or pass "
                             "training_args= to build HF Trainer's AdamW from them")
        return config_optimizer
    name = type(client_optimizer).__name__
    d = client_optimizer.defaults
    if name in ("Adam", "AdamW"):  # torch's: Adam is L2-regularised, AdamW decoupled
        adam_w = name == "AdamW"
    elif name in ("DeepSpeedCPUAdam", "FusedAdam") and d.get("bias_correction", True):
        # DeepSpeed's Adam kernels, e.g. accelerate's map_pytorch_optim_to_deepspeed of Trainer's AdamW when the
        # optimizer is offloaded: AdamW unless adamw_mode=False
        adam_w = bool(getattr(client_optimizer, "adam_w_mode", True))
    else:
        raise ValueError(f"client optimizer {name} is not supported; pass torch.optim.Adam/AdamW (or DeepSpeed's "
                         "DeepSpeedCPUAdam/FusedAdam) or use the config")
    if d.get("amsgrad"):
        raise ValueError(f"client optimizer {name} has amsgrad=True, which the engine does not run; use amsgrad=False")
    return {"type": "AdamW" if adam_w else "Adam", "adam_w_mode": adam_w, "lr": d["lr"],
            "betas": d.get("betas", (0.9, 0.999)), "eps": d.get("eps", 1e-8), "weight_decay": d["weight_decay"]}


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None, training_args=None, num_training_steps: int | None = None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Beyond DeepSpeed's keywords: ``training_args`` (transformers.TrainingArguments, a dataclass, namespace or dict
    with its field names) fills the config's "auto" values as HF Trainer does; ``num_training_steps`` is the total
    optimizer step count, needed for step-count "auto" values (warmup ratios, ``total_num_steps``) when
    ``training_args.max_steps <= 0``. The hidden-size "auto" values (ZeRO-3 bucket sizes) come from ``model.config``.
    With ``training_args`` and no optimizer in the config nor ``optimizer=``, the optimizer is HF Trainer's AdamW
    (decay / no-decay groups), and with no scheduler anywhere the scheduler is its ``lr_scheduler_type`` schedule
    (:mod:`engine.hf_optim`), as transformers' DeepSpeed integration hands them to DeepSpeed.
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize() needs config= (a dict or a path to a DeepSpeed-style JSON config)")
    engine = Engine(model, config, model_parameters=model_parameters, client_optimizer=optimizer,
                    lr_scheduler=lr_scheduler, training_args=training_args, training_data=training_data,
                    collate_fn=collate_fn, num_training_steps=num_training_steps)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
