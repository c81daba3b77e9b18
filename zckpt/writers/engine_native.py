"""Writer: a plan with training state -> an engine-native checkpoint for N ranks (``engine.checkpoint_format``).

No live engine and no torch: the target partition table comes from :func:`engine.partition.engine_layout`, the same
function the engine calls, so the output is exactly what a fresh engine at N ranks builds (its load takes the fast
path). Rank ``r``'s files are produced by walking its flat partitions in order::

    for each group g, for each element range of rank r's partition: padding -> zeros,
                                                                     fragment of param i -> read its source range

The bytes of each file are produced sequentially in bounded chunks (``CHUNK_BYTES``), hashed (sha256) as they are
written -- one pass, no re-read -- and files are written by a small thread pool. Memory: workers x one chunk.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from engine import checkpoint_format as spec
from engine.partition import ALIGN, PartitionTable, engine_layout, engine_units

from ..assemble import FileCache, read_range
from ..errors import InvalidArgumentError, UnsupportedCheckpointError
from ..plan import DTYPE_SIZES, CheckpointPlan, TensorPlan
from .safetensors_stream import Entry, build_header

#: bytes per read/write chunk: each writer thread holds one
CHUNK_BYTES = 16 * 2**20
_ZEROS = bytes(CHUNK_BYTES)


@dataclass(frozen=True, kw_only=True)
class Target:
    """The layout to write: ZeRO stage, world size and the stage 0-2 bucket size (units are derived from them)."""

    world_size: int
    stage: int
    reduce_bucket_size: int = 500_000_000

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidArgumentError(f"--world-size must be at least 1, got {self.world_size}")
        if self.stage not in (0, 1, 2, 3):
            raise InvalidArgumentError(f"--stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.reduce_bucket_size < 1:
            raise InvalidArgumentError(f"--reduce-bucket-size must be positive, got {self.reduce_bucket_size}")


def require_training_state(plan: CheckpointPlan) -> None:
    """Resharding needs the optimizer state; say so clearly when the source has weights only."""
    training = plan.training
    if training is None or not training.has_optimizer_state:
        raise UnsupportedCheckpointError(
            f"{plan.source} holds weights only (no optimizer state), so it cannot be resharded for resuming; "
            f"use `zckpt consolidate` for the weights, or re-save the run with its optimizer state")
    missing = [t.name for t in plan.trainable() if t.group is None or not t.state]
    if missing:
        raise UnsupportedCheckpointError(f"{plan.source}: parameter {missing[0]} has no optimizer state; "
                                         f"cannot reshard a partially saved optimizer")


def layout_for(plan: CheckpointPlan, target: Target) -> PartitionTable:
    """The engine's partition table for ``target`` over the plan's trainable parameters (plan order).

    Units: the source's own when it records them and the kind of layout is unchanged (stage 3 -> 3: per-module units;
    0-2 -> 0-2 with the same bucket size); else derived as the engine derives them (buckets / module name prefixes).
    """
    params = plan.trainable()
    numels = [t.numel for t in params]
    groups = [t.group for t in params]
    names = [t.name for t in params]
    units = engine_units(target.stage, numels, groups, names, reduce_bucket_size=target.reduce_bucket_size)
    recorded = plan.training.units if plan.training is not None else None
    same_kind = (plan.stage == 3) == (target.stage == 3)
    if recorded and same_kind and plan.format == "engine" and (target.stage == 3 or _bucket_of(plan) ==
                                                                target.reduce_bucket_size):
        units = [list(u) for u in recorded]
    if sorted(i for u in units for i in u) != list(range(len(params))):
        raise InvalidArgumentError(f"{plan.source}: its recorded units do not cover the parameters; reshard with "
                                   f"--stage to derive them")
    return engine_layout(target.stage, target.world_size, numels, groups, units)


def _bucket_of(plan: CheckpointPlan) -> int | None:
    value = plan.training.zero_config.get("reduce_bucket_size") if plan.training else None
    return int(value) if isinstance(value, (int, float)) else None


# -- byte producers --------------------------------------------------------------------------------------------
Piece = tuple[int, "TensorPlan | None", int]  # (element count, source tensor or None for zeros, source start)


def partition_pieces(table: PartitionTable, rank: int, group: int, sources: list[TensorPlan]) -> Iterator[Piece]:
    """Rank ``rank``'s flat partition of ``group`` as consecutive pieces: source ranges and zero padding."""
    frags = sorted((f.partition_offset, i, f) for i, f in table.rank_fragments(rank) if f.group == group)
    pos = 0
    for offset, i, f in frags:
        if offset > pos:
            yield offset - pos, None, 0
        yield f.numel, sources[i], f.dest
        pos = offset + f.numel
    total = table.group_partition_numel[group]
    if total > pos:
        yield total - pos, None, 0


def _write_pieces(out: spec.HashingWriter, pieces, itemsize: int, files: FileCache, progress: Callable[[int], None],
                  scratch: bytearray) -> None:
    """Write ``pieces`` in chunks: zeros for padding, source bytes read through ``scratch`` (reused) otherwise."""
    per_chunk = len(scratch) // itemsize
    for count, src, start in pieces:
        done = 0
        while done < count:
            n = min(per_chunk, count - done)
            if src is None:
                out.write(memoryview(_ZEROS)[: n * itemsize])
            else:
                chunk = memoryview(scratch)[: n * itemsize]
                read_range(src, files, start + done, n, chunk)
                out.write(chunk)
                progress(n * itemsize)
            done += n


# -- the files of one rank -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FileJob:
    name: str
    rank: int
    role: str
    #: (safetensors key, dtype, shape, pieces factory)
    tensors: tuple


def _rank_jobs(plan: CheckpointPlan, table: PartitionTable, rank: int) -> list[_FileJob]:
    params = list(plan.trainable())
    weights, optim = [], []
    for g in range(table.num_groups):
        numel = table.group_partition_numel[g]
        weights.append((spec.master_key(g), "float32", (numel,),
                        lambda g=g: partition_pieces(table, rank, g, params)))
        for key in plan.training.state_keys:
            sources = [t.state_tensor(key) for t in params]
            optim.append((spec.state_key(g, key), "float32", (numel,),
                          lambda g=g, sources=sources: partition_pieces(table, rank, g, sources)))
        for scalar in plan.training.groups[g].scalars:
            optim.append((spec.state_key(g, scalar.name), scalar.dtype, (), lambda s=scalar: iter([(1, s, 0)])))
    if rank == 0:
        for t in plan.tensors:
            if t.kind in ("frozen", "buffer"):
                key = spec.frozen_key(t.name) if t.kind == "frozen" else spec.buffer_key(t.name)
                weights.append((key, t.dtype, t.shape, lambda t=t: iter([(t.numel, t, 0)])))
    return [_FileJob(spec.weights_file(rank), rank, "weights", tuple(weights)),
            _FileJob(spec.optim_file(rank), rank, "optim", tuple(optim))]


def _write_file(job: _FileJob, folder: Path, files: FileCache, progress) -> spec.FileEntry:
    entries = [Entry(key, dtype, shape) for key, dtype, shape, _ in job.tensors]
    out = spec.HashingWriter(folder / job.name, exclusive=True)
    scratch = bytearray(CHUNK_BYTES)
    try:
        out.write(build_header(entries, {"format": spec.FORMAT, "rank": str(job.rank), "role": job.role}))
        for key, dtype, _shape, pieces in job.tensors:
            _write_pieces(out, pieces(), DTYPE_SIZES[dtype], files, progress, scratch)
    finally:
        digest = out.close()
    return spec.FileEntry(rank=job.rank, role=job.role, size=out.size, sha256=digest)


# -- the manifest ----------------------------------------------------------------------------------------------
def _manifest(plan: CheckpointPlan, table: PartitionTable, target: Target, tag: str, files: dict) -> spec.Manifest:
    training = plan.training
    params = []
    for i, t in enumerate(plan.trainable()):
        frags = tuple(spec.FragmentEntry(rank=f.rank, file=spec.weights_file(f.rank), key=spec.master_key(f.group),
                                         offset=f.partition_offset, numel=f.numel, dest=f.dest)
                      for f in table.fragments(i))
        params.append(spec.ParamEntry(name=t.name, shape=t.shape, dtype="float32", model_dtype=plan.train_dtype,
                                      group=t.group, fragments=frags))
    whole = {kind: tuple(spec.WholeEntry(name=t.name, shape=t.shape, dtype=t.dtype, file=spec.weights_file(0),
                                         key=(spec.frozen_key if kind == "frozen" else spec.buffer_key)(t.name))
                         for t in plan.tensors if t.kind == kind) for kind in ("frozen", "buffer")}
    counters = {k: int(training.counters.get(k, 0) or 0)
                for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}
    units = tuple(tuple(s.index for s in u.params) for u in table.units)
    origin = {"resharded_from": {"source": plan.source, "format": plan.format, "tag": plan.tag,
                                 "stage": plan.stage, "world_size": plan.world_size, "version": plan.version}}
    return spec.Manifest(
        tag=tag, stage=target.stage, world_size=target.world_size,
        partition_world_size=target.world_size if target.stage > 0 else 1, compute_dtype=plan.train_dtype,
        optimizer=training.optimizer, state_keys=tuple(training.state_keys),
        groups=tuple(spec.GroupEntry(partition_numel=n, hparams=dict(training.groups[g].hparams))
                     for g, n in enumerate(table.group_partition_numel)),
        params=tuple(params), aliases=dict(plan.aliases), frozen=whole["frozen"], buffers=whole["buffer"],
        layout=spec.Layout(units=units, align=ALIGN, reduce_bucket_size=target.reduce_bucket_size),
        scheduler=training.scheduler, loss_scaler=training.loss_scaler, config=training.config,
        client_state=dict(training.client_state), files=files, origin=origin, **counters)


def written_bytes(plan: CheckpointPlan, table: PartitionTable) -> int:
    """Bytes read from the source (for progress bars): every parameter's master and state once, frozen, buffers."""
    per_param = sum(t.numel * 4 for t in plan.trainable()) * (1 + len(plan.training.state_keys))
    return per_param + sum(t.nbytes for t in plan.tensors if t.kind != "param") + \
        sum(s.nbytes for g in plan.training.groups for s in g.scalars) * (table.world_size if plan.stage else 1)


def write_engine_checkpoint(plan: CheckpointPlan, save_dir: Path, target: Target, *, tag: str | None = None,
                            workers: int = 4, progress: Callable[[int], None] = lambda n: None) -> spec.Manifest:
    """Write ``save_dir/<tag>/`` (committed) and ``save_dir/latest`` for ``target``. ``save_dir`` should be a fresh
    (staging) folder; the tag folder is committed last, after every rank file is fsynced."""
    require_training_state(plan)
    tag = tag or plan.tag
    spec.check_tag(tag)
    table = layout_for(plan, target)
    tag_dir = Path(save_dir) / tag
    tag_dir.mkdir(parents=True)
    ranks = range(target.world_size if target.stage > 0 else 1)
    jobs = [job for r in ranks for job in _rank_jobs(plan, table, r)]
    files = FileCache()
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="zckpt-reshard") as pool:
            entries = list(pool.map(lambda j: _write_file(j, tag_dir, files, progress), jobs))
    finally:
        files.close()
    listing = {job.name: entry for job, entry in zip(jobs, entries)}
    manifest = _manifest(plan, table, target, tag, listing)
    spec.commit(tag_dir, manifest)
    spec.write_latest(Path(save_dir), tag)
    return manifest
