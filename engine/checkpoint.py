"""Native checkpoints: the engine's saver and loader of the format :mod:`engine.checkpoint_format` defines (file
names, the manifest, ``latest``, the commit); this module decides what goes into it and how it comes back.

The engine hands this module a :class:`CheckpointView` (``Engine._checkpoint_view()``): the layout, names, the objects
holding state (optimizer, loss scaler, scheduler, ZeRO manager) and the counters. Nothing here reads Engine attributes.

Save protocol (no pickle anywhere):

1. validate on every rank before writing a byte: tag, JSON-serialisable client_state / scheduler / loss scaler /
   config; ranks agree on the tag (all-gather), rank 0 checks the destination (an existing tag is replaced only if it
   is one of ours);
2. rank 0 creates ``save_dir/.<tag>.tmp-XXXX`` and broadcasts its name;
3. every rank writes and fsyncs its files, hashes them; hashes are all-gathered to rank 0;
4. rank 0 commits (:func:`engine.checkpoint_format.commit`: ``manifest.json`` then ``COMMITTED``, both fsynced),
   renames the temp dir to ``<tag>`` (moving an older copy of the same tag aside first and deleting it after), fsyncs
   ``save_dir``, then replaces ``latest`` atomically;
5. barrier: every rank returns only once the checkpoint is committed.

Load: a checkpoint of the same world size, stage and partition layout (every parameter's fragments and every group's
partition size equal this run's) is the fast path: each rank reads its own files, size- and sha256-checked. Anything
else -- another world size, stage, bucket size, parameter grouping, or a DeepSpeed checkpoint -- is resharded while
loading by :mod:`engine.reshard_load`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import checkpoint_format as spec
from engine import comm
from engine.checkpoint_io import write_safetensors
from engine.partition import ALIGN, PartitionTable


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded as asked; the message says why and what to do."""


# -- what the engine shows its checkpoint code ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Counters:
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int


@dataclass(frozen=True, kw_only=True)
class CheckpointView:
    """A typed snapshot of an Engine for save / load / export, built by ``Engine._checkpoint_view()``.

    Indices: trainable parameter ``i`` is ``param_names[i]`` and index ``i`` of ``table``; stage 3 also partitions the
    first ``frozen_partitioned`` frozen parameters, at table indices ``len(param_names) + k``. The state holders
    (``optimizer``, ``loss_scaler``, ``lr_scheduler``, ``mgr``) are the engine's own objects: loading fills them.
    """

    stage: int
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    table: PartitionTable
    param_names: tuple[str, ...]  # trainable parameters, canonical names, engine order
    param_shapes: tuple[tuple[int, ...], ...]
    frozen_names: tuple[str, ...]
    frozen: tuple  # the frozen nn.Parameters, same order
    frozen_partitioned: int  # stage 3: how many of ``frozen`` (the first ones) are partitioned
    aliases: dict  # tied: alias name -> canonical name
    module: torch.nn.Module  # for buffers and the 16-bit export's state_dict order
    mgr: Any  # the ZeRO manager: gathered(), full_param(), zero_grads(), refresh_after_load()
    optimizer: Any  # engine.optimizer.ShardedOptimizer
    loss_scaler: Any  # None unless fp16
    lr_scheduler: Any
    counters: Counters
    config: dict  # the resolved config, EngineConfig.to_dict()
    reduce_bucket_size: int
    gather_16bit_weights_on_model_save: bool
    set_counters: Callable[..., None]  # Engine._set_counters(global_steps=..., ..., skipped_steps=None keeps it)
    saver: Any = None  # the engine's AsyncSaver (asynchronous saves in flight)

    @property
    def n_trainable(self) -> int:
        return len(self.param_names)

    @property
    def table_rank(self) -> int:
        """This rank's rank in the partition table (stage 0 keeps one whole copy: every rank is rank 0)."""
        return self.rank if self.table.world_size > 1 else 0

    def trainable_units(self) -> tuple[tuple[int, ...], ...]:
        """Units of trainable parameters as index lists, in unit order (stage 3's frozen units left out)."""
        units = (tuple(s.index for s in u.params) for u in self.table.units)
        return tuple(u for u in units if all(i < self.n_trainable for i in u))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _spec_call(fn, *args, **kwargs):
    """Call a :mod:`engine.checkpoint_format` function, turning its FormatError into our CheckpointError."""
    try:
        return fn(*args, **kwargs)
    except spec.FormatError as exc:
        raise CheckpointError(str(exc)) from None


# -- save -------------------------------------------------------------------------------------------------------
def _validate_save(view: CheckpointView, save_dir: Path, tag: str, client_state) -> None:
    _spec_call(spec.check_tag, tag)
    try:
        json.dumps(client_state if client_state is not None else {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"client_state must be JSON-serialisable (engine checkpoints contain no pickle): "
                              f"{exc}; convert tensors with .tolist() and objects to dicts") from None
    _state_extras(view)
    tags = comm.all_gather_json(tag)
    if len(set(tags)) != 1:
        raise CheckpointError(f"ranks disagree on the checkpoint tag: {tags}; pass the same tag= on every rank")
    problem = None
    if comm.rank() == 0 and (save_dir / tag).exists() and not spec.is_ours(save_dir / tag):
        problem = (f"{save_dir / tag} exists and is not an engine checkpoint; refusing to replace it: choose another "
                   f"tag or move it away")
    problem = comm.broadcast_json(problem)
    if problem:
        raise CheckpointError(problem)


def frozen_value(view: CheckpointView, k: int) -> torch.Tensor:
    """Frozen parameter ``k``'s full value. Collective for the ones stage 3 partitions (one all-gather)."""
    if k < view.frozen_partitioned:
        return view.mgr.full_param(view.n_trainable + k)
    return view.frozen[k].data


def _rank_tensors(view: CheckpointView, with_optimizer: bool = True) -> dict[str, tuple[str, dict]]:
    """This rank's files: ``{file name: (role, {key: tensor})}``, tensors where they live (device or host).
    Collective: stage 3 gathers frozen params (all ranks)."""
    rank, write_partition = view.rank, view.stage > 0 or view.rank == 0
    weights, optim = {}, {}
    if write_partition:
        weights.update(view.optimizer.master_tensors())
        if with_optimizer:
            optim.update(view.optimizer.state_tensors())
    for k, name in enumerate(view.frozen_names):
        value = frozen_value(view, k)
        if rank == 0:
            weights[spec.frozen_key(name)] = value
    if rank == 0:
        for name, buf in _named_buffers(view.module):
            weights[spec.buffer_key(name)] = buf
    files = {spec.weights_file(rank): ("weights", weights), spec.optim_file(rank): ("optim", optim)}
    return {fname: (role, {k: v.detach() for k, v in tensors.items()})
            for fname, (role, tensors) in files.items() if tensors}


def _named_buffers(module) -> list:
    seen, out = set(), []
    for name, buf in module.named_buffers():
        if id(buf) not in seen:
            seen.add(id(buf))
            out.append((name, buf))
    return out


def _persistent_buffer_names(module) -> set[str]:
    keys = set(module.state_dict(keep_vars=True).keys())
    return {name for name, _ in _named_buffers(module) if name in keys}


def _write_rank_files(rank: int, files: dict[str, tuple[str, dict]], tmp: Path) -> dict:
    """Write this rank's files into ``tmp`` (one pass each: hashed while written, fsynced); their manifest entries."""
    info = {}
    for fname, (role, tensors) in files.items():
        size, sha = write_safetensors(tmp / fname, tensors, {"format": spec.FORMAT, "rank": str(rank), "role": role})
        info[fname] = {"rank": rank, "role": role, "size": size, "sha256": sha}
    return info


def build_manifest(view: CheckpointView, tag: str, files: dict, client_state) -> spec.Manifest:
    """The self-description of a checkpoint; computed from the partition table alone (no communication)."""
    table = view.table
    model_dtype = _dtype_name(view.compute_dtype)
    params = []
    for i, (name, shape) in enumerate(zip(view.param_names, view.param_shapes)):
        frags = tuple(spec.FragmentEntry(rank=f.rank, file=spec.weights_file(f.rank), key=spec.master_key(f.group),
                                         offset=f.partition_offset, numel=f.numel, dest=f.dest)
                      for f in table.fragments(i))
        params.append(spec.ParamEntry(name=name, shape=tuple(shape), dtype="float32", model_dtype=model_dtype,
                                      group=table.units[table.param_unit[i]].group, fragments=frags))
    frozen = tuple(spec.WholeEntry(name=n, shape=_shape(p), dtype=_dtype_name(
        view.compute_dtype if p.is_floating_point() else p.dtype), file=spec.weights_file(0), key=spec.frozen_key(n))
        for n, p in zip(view.frozen_names, view.frozen))
    persistent = _persistent_buffer_names(view.module)
    buffers = tuple(spec.WholeEntry(name=n, shape=tuple(b.shape), dtype=_dtype_name(b.dtype), file=spec.weights_file(0),
                                    key=spec.buffer_key(n), persistent=n in persistent)
                    for n, b in _named_buffers(view.module))
    c = view.counters
    return spec.Manifest(
        tag=tag, stage=view.stage, world_size=view.world_size, partition_world_size=table.world_size,
        compute_dtype=model_dtype, master_dtype="float32", global_steps=c.global_steps,
        global_samples=c.global_samples, micro_steps=c.micro_steps, skipped_steps=c.skipped_steps,
        optimizer=view.optimizer.kind, state_keys=view.optimizer.state_keys(),
        groups=tuple(spec.GroupEntry(partition_numel=n, hparams=hp)
                     for n, hp in zip(table.group_partition_numel, view.optimizer.hparams())),
        params=tuple(params), aliases=dict(view.aliases), frozen=frozen, buffers=buffers,
        layout=spec.Layout(units=view.trainable_units(), align=ALIGN, reduce_bucket_size=view.reduce_bucket_size),
        **_state_extras(view), client_state=client_state if client_state is not None else {},
        files={name: spec.FileEntry(**meta) for name, meta in files.items()})


def _state_extras(view: CheckpointView) -> dict:
    """Scheduler / loss-scaler state and the resolved config, as JSON (checked before any byte is written)."""
    scaler = view.loss_scaler.state_dict() if view.loss_scaler is not None else None
    sched = view.lr_scheduler.state_dict() if view.lr_scheduler is not None else None
    return {"scheduler": _jsonable(sched, "lr_scheduler.state_dict()"),
            "loss_scaler": _jsonable(scaler, "loss scaler state_dict()"),
            "config": _jsonable(view.config, "config.to_dict()")}


def _jsonable(obj, what: str):
    try:
        return json.loads(json.dumps(obj, allow_nan=True, default=_tensor_scalar))
    except TypeError as exc:
        raise CheckpointError(f"{what} is not JSON-serialisable: {exc}") from None


def _tensor_scalar(obj):
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _shape(p) -> tuple:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def _commit(save_dir: Path, tmp: Path, manifest: spec.Manifest, save_latest: bool) -> None:
    spec.commit(tmp, manifest)
    final = save_dir / manifest.tag
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{manifest.tag}.old-", dir=save_dir))
        os.rmdir(old)
        os.rename(final, old)
    os.rename(tmp, final)
    spec.fsync_path(save_dir)
    if old is not None and spec.is_ours(old):
        shutil.rmtree(old)
    if save_latest:
        spec.write_latest(save_dir, manifest.tag)


_STAGING_FILE = re.compile(r"rank\d{5}-(weights|optim)\.safetensors|manifest\.json|COMMITTED|\.done-rank\d+\.json")


def remove_stale_staging(save_dir: Path) -> list[str]:
    """Remove ``.<tag>.tmp-*`` / ``.<tag>.old-*`` folders a killed save left in ``save_dir`` (rank 0, before a new
    save; no save of this job is in flight then). Only folders holding nothing but checkpoint files are removed:
    anything else there is left alone. Returns the names removed."""
    removed = []
    for path in save_dir.glob(".*.*-*"):
        if not (path.is_dir() and not path.is_symlink() and re.fullmatch(r"\..+\.(tmp|old)-\w+", path.name)):
            continue
        try:
            names = [f.name for f in path.iterdir()]
            if all(_STAGING_FILE.fullmatch(n) and (path / n).is_file() for n in names):
                shutil.rmtree(path)
                removed.append(path.name)
        except OSError:
            continue  # unreadable or vanished: not ours to force
    return removed


def save_checkpoint(view: CheckpointView, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    async_save: bool = False, exclude_optimizer_states: bool = False) -> bool:
    """Collective. Write a committed checkpoint under ``save_dir/<tag>``; see the module docstring. With
    ``exclude_optimizer_states`` no optimizer file is written (a weights-only checkpoint: the manifest lists no file
    with role "optim").

    ``async_save``: return once this rank's tensors are copied to host memory (:class:`AsyncSaver`); the files are
    written, hashed and committed in the background, and ``latest`` moves only then."""
    saver = view.saver if view.saver is not None else AsyncSaver()
    saver.wait()  # the previous asynchronous save is committed (or its failure raised) before a new one starts
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{view.counters.global_steps}"
    _validate_save(view, save_dir, tag, client_state)
    tmp_name = None
    if view.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(save_dir)
        tmp_name = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir)
    tmp = Path(comm.broadcast_json(tmp_name))
    tensors = _rank_tensors(view, not exclude_optimizer_states)
    manifest = build_manifest(view, tag, {}, client_state) if view.rank == 0 else None  # the state as of now
    if async_save:
        saver.start(view.rank, view.world_size, tensors, tmp, save_dir, manifest, save_latest)
        return True
    files = {}
    for part in comm.all_gather_json(_write_rank_files(view.rank, tensors, tmp)):
        files.update(part)
    if view.rank == 0:
        _commit(save_dir, tmp, dataclasses.replace(
            manifest, files={name: spec.FileEntry(**meta) for name, meta in files.items()}), save_latest)
    comm.barrier()
    return True


class AsyncSaver:
    """One engine's asynchronous saves: at most one in flight, failures raised at the next collective call.

    ``start`` copies the rank's tensors into a reused host :class:`~engine.checkpoint_io.Snapshot` (one copy of
    the rank's checkpoint bytes, pinned for CUDA tensors) and returns; a thread then writes and hashes the files
    and drops ``.done-rank<r>.json`` (the files' sizes and hashes, or the error) into the temp folder. Rank 0's
    thread waits for every rank's note, then commits and moves ``latest``: no collective runs in the background,
    and a crash at any moment leaves the previous checkpoint as ``latest``. ``wait`` (collective: the next save,
    ``load_checkpoint``) joins the thread and raises on every rank if any rank failed; ``join`` (process exit) only
    joins."""

    #: how long rank 0 waits for the other ranks' notes before giving the save up
    commit_timeout_s = 1800.0

    def __init__(self) -> None:
        from engine.checkpoint_io import Snapshot

        self.snapshot = Snapshot()
        self._thread = None
        self._error: str | None = None
        self._tag = None

    def start(self, rank: int, world_size: int, tensors: dict, tmp: Path, save_dir: Path,
              manifest: spec.Manifest | None, save_latest: bool) -> None:
        import threading

        roles = {fname: role for fname, (role, _) in tensors.items()}
        host = self.snapshot.take({fname: ts for fname, (_, ts) in tensors.items()})
        files = {fname: (roles[fname], ts) for fname, ts in host.items()}
        self._tag, self._error = manifest.tag if manifest is not None else tmp.name, None
        self._thread = threading.Thread(target=self._run, name="engine-async-save", daemon=False,
                                        args=(rank, world_size, files, tmp, save_dir, manifest, save_latest))
        self._thread.start()
        _JOIN_AT_EXIT.add(self)

    def _run(self, rank, world_size, files, tmp, save_dir, manifest, save_latest) -> None:
        try:
            note = {"files": _write_rank_files(rank, files, tmp)}
        except BaseException as exc:  # reported through the note and at the next call, never swallowed
            note = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
            self._error = note["error"]
        try:
            part = tmp / f".done-rank{rank}.json.part"  # renamed whole: rank 0 never reads half a note
            spec.write_durable(part, json.dumps(note).encode())
            os.replace(part, tmp / f".done-rank{rank}.json")
            if rank == 0:
                self._commit(world_size, tmp, save_dir, manifest, save_latest)
        except BaseException as exc:
            self._error = self._error or f"rank {rank}: {type(exc).__name__}: {exc}"

    def _commit(self, world_size, tmp, save_dir, manifest, save_latest) -> None:
        import time

        notes, deadline = {}, time.monotonic() + self.commit_timeout_s
        while len(notes) < world_size:
            for r in range(world_size):
                path = tmp / f".done-rank{r}.json"
                if r not in notes and path.is_file():
                    notes[r] = json.loads(path.read_text())
            if len(notes) < world_size:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"ranks {sorted(set(range(world_size)) - set(notes))} did not finish "
                                          f"writing within {self.commit_timeout_s:.0f} s")
                time.sleep(0.02)
        errors = [n["error"] for n in notes.values() if "error" in n]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError("; ".join(errors))
        for r in range(world_size):
            (tmp / f".done-rank{r}.json").unlink()
        files = {name: spec.FileEntry(**meta) for n in notes.values() for name, meta in n["files"].items()}
        _commit(save_dir, tmp, dataclasses.replace(manifest, files=files), save_latest)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _JOIN_AT_EXIT.discard(self)

    def wait(self) -> None:
        """Collective: join this rank's save; raise on every rank if any rank's save failed."""
        if comm.world_size() > 1 or self._thread is not None or self._error:
            self.join()
            errors = [e for e in comm.all_gather_json(self._error) if e]
            tag, self._error = self._tag, None
            if errors:
                raise CheckpointError(f"the asynchronous save of {tag} failed ({'; '.join(errors)}); the previous "
                                      f"checkpoint is still 'latest'")
            comm.barrier()  # rank 0's commit is visible to every rank from here


_JOIN_AT_EXIT: set = set()


def join_pending_saves() -> None:
    """Wait for every asynchronous save of this process to finish writing (process exit; not collective)."""
    for saver in list(_JOIN_AT_EXIT):
        saver.join()


atexit.register(join_pending_saves)


# -- load -------------------------------------------------------------------------------------------------------
def same_layout(view: CheckpointView, manifest: spec.Manifest) -> bool:
    """True when each rank can read its own files as they are: same stage and world size, the same parameters in the
    same order, every parameter's fragments and every group's partition size as this run's table has them."""
    table = view.table
    if manifest.stage != view.stage or manifest.world_size != view.world_size:
        return False
    if [p.name for p in manifest.params] != list(view.param_names):
        return False
    sizes = [g.partition_numel for g in manifest.groups]
    if len(sizes) != len(view.optimizer.masters) or sizes != list(table.group_partition_numel[: len(sizes)]):
        return False
    for i, entry in enumerate(manifest.params):
        mine = [(f.rank, spec.weights_file(f.rank), spec.master_key(f.group), f.partition_offset, f.numel, f.dest)
                for f in table.fragments(i)]
        if mine != [(f.rank, f.file, f.key, f.offset, f.numel, f.dest) for f in entry.fragments]:
            return False
    return True


def _verify_file(tag_dir: Path, fname: str, manifest: spec.Manifest) -> Path:
    path, meta = tag_dir / fname, manifest.files.get(fname)
    if meta is None or not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: load an earlier tag")
    if path.stat().st_size != meta.size or _sha256(path) != meta.sha256:
        raise CheckpointError(f"{path} does not match the sha256/size in {spec.MANIFEST}: the file is corrupt; "
                              f"load an earlier tag")
    return path


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def restore_frozen_and_buffers(view: CheckpointView, frozen: dict, buffers: dict) -> None:
    """Collective (stage 3). Copy ``frozen`` (name -> full value) and ``buffers`` (name -> value) into the model.
    Stage 3's partitioned frozen parameters are gathered, written on rank 0 and re-partitioned from it: their values
    are needed on rank 0 only (others may map them to None)."""
    for k, (name, p) in enumerate(zip(view.frozen_names, view.frozen)):
        value = frozen.get(name)
        if k < view.frozen_partitioned:
            with view.mgr.gathered([view.n_trainable + k], modifier_rank=0):
                if value is not None:
                    p.data.copy_(value.reshape(p.data.shape))
        elif value is not None:
            p.data.copy_(value)
    for name, buf in _named_buffers(view.module):
        if name in buffers:
            buf.data.copy_(buffers[name])


def finish_load(view: CheckpointView, *, scheduler: dict | None, counters: dict, load_lr_scheduler_states: bool,
                skipped_steps: int | None) -> None:
    """After masters, optimizer state and frozen values are in place: drop gradients, rebuild the compute params
    from the masters, restore the scheduler and counters."""
    view.mgr.zero_grads()
    view.mgr.refresh_after_load()
    if load_lr_scheduler_states and view.lr_scheduler is not None and scheduler is not None:
        view.lr_scheduler.load_state_dict(scheduler)
    view.set_counters(global_steps=counters.get("global_steps", 0), global_samples=counters.get("global_samples", 0),
                      micro_steps=counters.get("micro_steps", 0), skipped_steps=skipped_steps)


def _load_same_layout(view: CheckpointView, tag_dir: Path, manifest: spec.Manifest, load_optimizer_states: bool,
                      load_lr_scheduler_states: bool) -> None:
    """The fast path: each rank reads its own files (stage 0: rank 0's), checked against the manifest."""
    src = view.rank if view.stage > 0 else 0
    weights = _read_all(_verify_file(tag_dir, spec.weights_file(src), manifest))
    rank0_weights = weights if src == 0 else _read_all(tag_dir / spec.weights_file(0))
    view.optimizer.load_masters(weights)
    if load_optimizer_states:
        # a run saved before its first optimizer step has no state and writes no optimizer file
        has_state = spec.optim_file(src) in manifest.files
        if not has_state and manifest.global_steps - manifest.skipped_steps > 0 and \
                not any(meta.role == "optim" for meta in manifest.files.values()):
            raise CheckpointError(f"{tag_dir} holds only the weights (saved without optimizer state): pass "
                                  f"load_module_only=True to load just the weights")
        optim = _read_all(_verify_file(tag_dir, spec.optim_file(src), manifest)) if has_state else {}
        view.optimizer.load_state(optim, [g.hparams for g in manifest.groups])
        if view.loss_scaler is not None and manifest.loss_scaler is not None:
            view.loss_scaler.load_state_dict(manifest.loss_scaler)
    frozen = {n: rank0_weights[spec.frozen_key(n)] for n in view.frozen_names}
    buffers = {n: rank0_weights[spec.buffer_key(n)] for n, _ in _named_buffers(view.module)
               if spec.buffer_key(n) in rank0_weights}
    restore_frozen_and_buffers(view, frozen, buffers)
    counters = {"global_steps": manifest.global_steps, "global_samples": manifest.global_samples,
                "micro_steps": manifest.micro_steps}
    finish_load(view, scheduler=manifest.scheduler, counters=counters,
                load_lr_scheduler_states=load_lr_scheduler_states,
                skipped_steps=manifest.skipped_steps if load_optimizer_states else None)


@torch.no_grad()
def load_checkpoint(view: CheckpointView, load_dir, tag=None, load_optimizer_states=True,
                    load_lr_scheduler_states=True):
    """Collective. Restore params, optimizer, scheduler, loss scaler and counters; returns ``(path, client_state)``
    (``(None, None)`` when ``load_dir`` has no ``latest`` and no tag was given, as DeepSpeed does).

    ``load_dir`` is an engine save dir or a DeepSpeed one; a checkpoint whose world size, stage or layout differs
    from this run's is resharded while loading (:mod:`engine.reshard_load`)."""
    if view.saver is not None:
        view.saver.wait()  # an asynchronous save in flight is committed first (or its failure raised)
    load_dir = Path(load_dir)
    tag = str(tag) if tag is not None else _spec_call(spec.read_latest, load_dir)
    if tag is None:
        return None, None
    tag_dir = load_dir / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} does not exist; check {load_dir / spec.LATEST} or pass an existing tag=")
    from engine import reshard_load

    manifest = _spec_call(spec.read_manifest, tag_dir) if spec.is_ours(tag_dir) else None  # else: DeepSpeed?
    if manifest is not None and same_layout(view, manifest):
        _load_same_layout(view, tag_dir, manifest, load_optimizer_states, load_lr_scheduler_states)
        client_state = manifest.client_state
    else:
        client_state = reshard_load.load_resharded(view, load_dir, tag, manifest, load_optimizer_states,
                                                   load_lr_scheduler_states)
    comm.barrier()
    return str(tag_dir), client_state


# -- exports ----------------------------------------------------------------------------------------------------
def _export_entries(view: CheckpointView) -> list[tuple[str, object]]:
    """``(name, tensor-or-param)`` in ``state_dict`` order, each object once (tied weights keep their first name)."""
    seen, out = set(), []
    for name, t in view.module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def save_16bit_model(view: CheckpointView, save_dir, save_filename: str = "model.safetensors",
                     max_shard_size="5GB") -> bool:
    """Collective. Write the compute-dtype model as HF safetensors (sharded with an index when large).

    Shards are planned from shapes alone (``split_torch_state_dict_into_shards`` on meta tensors); then, shard by
    shard, stage 3 gathers just the units holding that shard's parameters, rank 0 writes the shard and frees it.
    Stage 3 requires ``stage3_gather_16bit_weights_on_model_save`` (else returns False, as DeepSpeed does).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    if view.stage == 3 and not view.gather_16bit_weights_on_model_save:
        return False
    save_dir = Path(save_dir)
    entries = _export_entries(view)
    meta = {n: torch.empty(_shape(t), dtype=t.dtype, device="meta") for n, t in entries}
    stem, dot, ext = save_filename.rpartition(".")
    pattern = f"{stem}{{suffix}}.{ext}" if dot else f"{save_filename}{{suffix}}"
    split = split_torch_state_dict_into_shards(meta, filename_pattern=pattern, max_shard_size=max_shard_size)
    by_name = dict(entries)
    if view.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
    for fname, names in split.filename_to_tensors.items():
        indices = [t._zero_index for t in (by_name[n] for n in names) if t.__dict__.get("_zero_mgr") is view.mgr]
        ctx = view.mgr.gathered(indices) if view.stage == 3 and indices else contextlib.nullcontext()
        with ctx:
            if view.rank == 0:
                shard = {n: by_name[n].detach().to("cpu").contiguous().clone() for n in names}
                save_file(shard, str(save_dir / fname), metadata={"format": "pt"})
    if view.rank == 0 and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        spec.write_durable(save_dir / f"{save_filename}.index.json", json.dumps(index, indent=2).encode())
    comm.barrier()
    return True


def _gather_flat(view: CheckpointView, flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Collective. Every rank's flat fp32 partition of each group (one all-gather per group): ``[g][rank]`` views."""
    if view.stage == 0:
        return [f.detach().cpu().view(1, -1) for f in flats]
    out = []
    for flat in flats:
        dev = flat.detach().to(view.device, torch.float32)
        full = torch.empty(dev.numel() * view.world_size, dtype=torch.float32, device=view.device)
        comm.all_gather_(full, dev)
        out.append(full.cpu().view(view.world_size, -1))
    return out


def _unflatten(view: CheckpointView, fulls: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full trainable parameters (fp32, by name) from every rank's flat partitions (``_gather_flat``)."""
    table, out = view.table, {}
    for i, (name, shape) in enumerate(zip(view.param_names, view.param_shapes)):
        flat = torch.empty(table.numels[i], dtype=torch.float32)
        for f in table.fragments(i):
            flat[f.dest: f.dest + f.numel] = fulls[f.group][f.rank][f.partition_offset: f.partition_offset + f.numel]
        out[name] = flat.view(shape)
    return out


@torch.no_grad()
def gather_fp32_state_dict(view: CheckpointView) -> dict[str, torch.Tensor]:
    """Collective. Full fp32 masters (one all-gather per group), frozen params and buffers, on every rank (CPU)."""
    out = _unflatten(view, _gather_flat(view, list(view.optimizer.master_tensors().values())))
    for k, name in enumerate(view.frozen_names):
        out[name] = frozen_value(view, k).detach().cpu().clone()
    for name, buf in _named_buffers(view.module):
        out[name] = buf.detach().cpu().clone()
    return out


@torch.no_grad()
def gather_optimizer_state(view: CheckpointView) -> dict:
    """Collective. ``{"step": [per group], key: {param name: full fp32 tensor}}`` for every per-parameter state key
    (Adam: exp_avg, exp_avg_sq), on every rank (CPU); for tests and small models."""
    tensors = view.optimizer.state_tensors()
    groups = range(len(view.optimizer.masters))
    out: dict = {"step": [float(tensors[f"group{g}.step"]) if f"group{g}.step" in tensors else None for g in groups]}
    for key in view.optimizer.state_keys():
        flats = [tensors[spec.state_key(g, key)] for g in groups]
        out[key] = _unflatten(view, _gather_flat(view, flats))
    return out
