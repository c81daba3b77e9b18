"""Native checkpoints: per-rank safetensors + a self-describing ``manifest.json``, committed atomically.

Layout of ``save_dir/<tag>/`` (default tag ``global_step{N}``)::

    rank00000-weights.safetensors   group{g}.fp32_partition (this rank's flat fp32 master partition of group g);
                                    rank 0 also: frozen.<name> (frozen params, full) and buffer.<name> (buffers)
    rank00000-optim.safetensors     group{g}.exp_avg / group{g}.exp_avg_sq / group{g}.step (Adam state)
    rank00001-...                   (stages 1-3: one pair per rank; stage 0: rank 0 writes everything)
    manifest.json                   format "zckpt-engine" v1: stage, world size, dtypes, every param's name, shape and
                                    fragments (rank, file, key, element offset, numel, dest), aliases (tied), frozen,
                                    buffers, step counters, scheduler / loss-scaler state, client_state, config,
                                    sha256 + size of every file
    COMMITTED                       written last; a tag without it is incomplete

Save protocol (no pickle anywhere):

1. validate on every rank before writing a byte: tag, JSON-serialisable client_state; ranks agree on the tag
   (all-gather), rank 0 checks the destination (an existing tag is replaced only if it is one of ours);
2. rank 0 creates ``save_dir/.<tag>.tmp-XXXX`` and broadcasts its name;
3. every rank writes and fsyncs its files, hashes them; hashes are all-gathered to rank 0;
4. rank 0 writes ``manifest.json`` then ``COMMITTED`` (both fsynced), renames the temp dir to ``<tag>`` (moving an
   older copy of the same tag aside first and deleting it after), fsyncs ``save_dir``, then replaces ``latest``
   atomically (temp file, fsync, rename);
5. barrier: every rank returns only once the checkpoint is committed.

Load: the same world size and stage only (resharding is a later issue); own files are size- and sha256-checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import comm

FORMAT, FORMAT_VERSION = "zckpt-engine", 1
MANIFEST, COMMITTED, LATEST = "manifest.json", "COMMITTED", "latest"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded as asked; the message says why and what to do."""


def weights_file(rank: int) -> str:
    return f"rank{rank:05d}-weights.safetensors"


def optim_file(rank: int) -> str:
    return f"rank{rank:05d}-optim.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- filesystem helpers -----------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_latest(save_dir: Path, tag: str) -> None:
    """Replace ``save_dir/latest`` atomically: temp file, fsync, rename, fsync the directory."""
    tmp = save_dir / f".{LATEST}.tmp-{os.getpid()}"
    _write_durable(tmp, tag.encode())
    os.replace(tmp, save_dir / LATEST)
    _fsync_path(save_dir)


def read_latest(load_dir: Path) -> str | None:
    path = load_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; pass tag= explicitly or rewrite it with a committed tag name")
    return tag


def _is_ours(tag_dir: Path) -> bool:
    try:
        return json.loads((tag_dir / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


# -- save -------------------------------------------------------------------------------------------------------
def _validate_save(engine, save_dir: Path, tag: str, client_state) -> None:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain name such as 'global_step100'")
    try:
        json.dumps(client_state if client_state is not None else {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"client_state must be JSON-serialisable (engine checkpoints contain no pickle): "
                              f"{exc}; convert tensors with .tolist() and objects to dicts") from None
    _state_extras(engine)
    tags = comm.all_gather_json(tag)
    if len(set(tags)) != 1:
        raise CheckpointError(f"ranks disagree on the checkpoint tag: {tags}; pass the same tag= on every rank")
    problem = None
    if comm.rank() == 0 and (save_dir / tag).exists() and not _is_ours(save_dir / tag):
        problem = (f"{save_dir / tag} exists and is not an engine checkpoint; refusing to replace it: choose another "
                   f"tag or move it away")
    problem = comm.broadcast_json(problem)
    if problem:
        raise CheckpointError(problem)


def frozen_value(engine, k: int) -> torch.Tensor:
    """Frozen parameter ``k``'s full value. Collective for the ones stage 3 partitions (one all-gather)."""
    if k < engine.frozen_partitioned:
        return engine.mgr.full_param(len(engine.trainable) + k)
    return engine.frozen[k].data


def _rank_tensors(engine) -> tuple[dict, dict]:
    """This rank's (weights, optimizer) tensors. Collective: stage 3 gathers frozen params (all ranks)."""
    rank, write_partition = comm.rank(), engine.stage > 0 or comm.rank() == 0
    weights, optim = {}, {}
    if write_partition:
        weights.update(engine.optimizer.master_tensors())
        optim.update(engine.optimizer.state_tensors())
    for k, name in enumerate(engine.frozen_names):
        value = frozen_value(engine, k)
        if rank == 0:
            weights[f"frozen.{name}"] = value
    if rank == 0:
        for name, buf in _named_buffers(engine.module):
            weights[f"buffer.{name}"] = buf
    to_cpu = lambda d: {k: v.detach().to("cpu").contiguous() for k, v in d.items()}  # noqa: E731
    return to_cpu(weights), to_cpu(optim)


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


def _write_rank_files(engine, tmp: Path) -> dict:
    weights, optim = _rank_tensors(engine)
    info = {}
    rank = comm.rank()
    for fname, tensors, role in ((weights_file(rank), weights, "weights"), (optim_file(rank), optim, "optim")):
        if not tensors:
            continue
        path = tmp / fname
        save_file(tensors, str(path), metadata={"format": FORMAT, "rank": str(rank), "role": role})
        _fsync_path(path)
        info[fname] = {"rank": rank, "role": role, "size": path.stat().st_size, "sha256": _sha256(path)}
    return info


def build_manifest(engine, tag: str, files: dict, client_state) -> dict:
    """The self-description of a checkpoint; computed from the partition table alone (no communication)."""
    table, stage = engine.table, engine.stage
    params = []
    for i, (name, p) in enumerate(zip(engine.param_names, engine.trainable)):
        frags = [{"rank": f.rank, "file": weights_file(f.rank), "key": f"group{f.group}.fp32_partition",
                  "offset": f.partition_offset, "numel": f.numel, "dest": f.dest} for f in table.fragments(i)]
        params.append({"name": name, "shape": list(_shape(p)), "dtype": "float32",
                       "model_dtype": _dtype_name(engine.compute_dtype), "group": engine.table.units[
                           table.param_unit[i]].group, "fragments": frags})
    frozen = [{"name": n, "shape": list(_shape(p)), "dtype": _dtype_name(engine.compute_dtype if
              p.is_floating_point() else p.dtype), "file": weights_file(0), "key": f"frozen.{n}"}
              for n, p in zip(engine.frozen_names, engine.frozen)]
    persistent = _persistent_buffer_names(engine.module)
    buffers = [{"name": n, "shape": list(b.shape), "dtype": _dtype_name(b.dtype), "file": weights_file(0),
                "key": f"buffer.{n}", "persistent": n in persistent} for n, b in _named_buffers(engine.module)]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag, "stage": stage,
        "world_size": comm.world_size(), "partition_world_size": table.world_size,
        "compute_dtype": _dtype_name(engine.compute_dtype), "master_dtype": "float32",
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "groups": [{"partition_numel": n, "hparams": hp} for n, hp in
                   zip(table.group_partition_numel, engine.optimizer.hparams())],
        "params": params, "aliases": dict(engine.aliases), "frozen": frozen, "buffers": buffers,
        **_state_extras(engine), "client_state": client_state if client_state is not None else {}, "files": files,
    }


def _state_extras(engine) -> dict:
    """Scheduler / loss-scaler state and the resolved config, as JSON (checked before any byte is written)."""
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    config = engine.config.to_dict()
    return {"scheduler": _jsonable(sched, "lr_scheduler.state_dict()"),
            "loss_scaler": _jsonable(scaler, "loss scaler state_dict()"),
            "config": _jsonable(config, "config.to_dict()")}


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


def _commit(save_dir: Path, tmp: Path, tag: str, manifest: dict, save_latest: bool) -> None:
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _write_durable(tmp / COMMITTED, f"{tag}\n".encode())
    _fsync_path(tmp)
    final = save_dir / tag
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{tag}.old-", dir=save_dir))
        os.rmdir(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(save_dir)
    if old is not None and _is_ours(old):
        shutil.rmtree(old)
    if save_latest:
        write_latest(save_dir, tag)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
    """Collective. Write a committed checkpoint of ``engine`` under ``save_dir/<tag>``; see the module docstring."""
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _validate_save(engine, save_dir, tag, client_state)
    tmp_name = None
    if comm.rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        tmp_name = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir)
    tmp = Path(comm.broadcast_json(tmp_name))
    files = {}
    for part in comm.all_gather_json(_write_rank_files(engine, tmp)):
        files.update(part)
    if comm.rank() == 0:
        _commit(save_dir, tmp, tag, build_manifest(engine, tag, files, client_state), save_latest)
    comm.barrier()
    return True


# -- load -------------------------------------------------------------------------------------------------------
def read_manifest(tag_dir: Path) -> dict:
    """The manifest of a committed engine checkpoint (raises :class:`CheckpointError` otherwise)."""
    if not (tag_dir / COMMITTED).is_file():
        raise CheckpointError(f"{tag_dir} has no {COMMITTED} marker: the save was interrupted; load an earlier tag")
    try:
        manifest = json.loads((tag_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{tag_dir / MANIFEST} is unreadable ({exc}); load an earlier tag") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{tag_dir / MANIFEST} is not a {FORMAT} v{FORMAT_VERSION} manifest")
    return manifest


def _check_compatible(engine, manifest: dict, tag_dir: Path) -> None:
    ws, stage = comm.world_size(), engine.stage
    if manifest["world_size"] != ws or manifest["stage"] != stage:
        raise CheckpointError(
            f"{tag_dir} was saved with world size {manifest['world_size']} and ZeRO stage {manifest['stage']}, "
            f"this run has world size {ws} and stage {stage}; resharding is not supported yet: resume with the "
            f"same number of processes and stage, or consolidate it to safetensors (zckpt consolidate)")
    want = [p["name"] for p in manifest["params"]]
    if want != engine.param_names:
        raise CheckpointError(f"{tag_dir}: parameter names/order differ from this model (first difference: "
                              f"{next((a, b) for a, b in zip(want + [None], engine.param_names + [None]) if a != b)})")
    sizes = [g["partition_numel"] for g in manifest["groups"]]
    if sizes != list(engine.table.group_partition_numel[: len(sizes)]) or len(sizes) != len(engine.optimizer.masters):
        raise CheckpointError(f"{tag_dir}: partition layout differs (bucket sizes or parameter groups changed); "
                              f"use the same zero_optimization bucket sizes and parameter groups as when saving")


def _verify_file(tag_dir: Path, fname: str, manifest: dict) -> Path:
    path, meta = tag_dir / fname, manifest["files"].get(fname)
    if meta is None or not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: load an earlier tag")
    if path.stat().st_size != meta["size"] or _sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{path} does not match the sha256/size in {MANIFEST}: the file is corrupt; "
                              f"load an earlier tag")
    return path


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _restore_frozen_and_buffers(engine, rank0_weights: dict) -> None:
    n_train = len(engine.trainable)
    for k, (name, p) in enumerate(zip(engine.frozen_names, engine.frozen)):
        value = rank0_weights[f"frozen.{name}"]
        if k < engine.frozen_partitioned:
            with engine.mgr.gathered([n_train + k], modifier_rank=0):
                p.data.copy_(value.reshape(p.data.shape))
        else:
            p.data.copy_(value)
    for name, buf in _named_buffers(engine.module):
        key = f"buffer.{name}"
        if key in rank0_weights:
            buf.data.copy_(rank0_weights[key])


@torch.no_grad()
def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
    """Collective. Restore params, optimizer, scheduler, loss scaler and counters; returns ``(path, client_state)``
    (``(None, None)`` when ``load_dir`` has no ``latest`` and no tag was given, as DeepSpeed does)."""
    load_dir = Path(load_dir)
    tag = str(tag) if tag is not None else read_latest(load_dir)
    if tag is None:
        return None, None
    tag_dir = load_dir / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} does not exist; check {load_dir / LATEST} or pass an existing tag=")
    manifest = read_manifest(tag_dir)
    _check_compatible(engine, manifest, tag_dir)
    rank = comm.rank()
    src = rank if engine.stage > 0 else 0
    weights = _read_all(_verify_file(tag_dir, weights_file(src), manifest))
    rank0_weights = weights if src == 0 else _read_all(tag_dir / weights_file(0))
    engine.optimizer.load_masters(weights)
    if load_optimizer_states:
        optim = _read_all(_verify_file(tag_dir, optim_file(src), manifest))
        engine.optimizer.load_state(optim, [g["hparams"] for g in manifest["groups"]])
        engine.optimizer.skipped_steps = manifest.get("skipped_steps", 0)
        if engine.loss_scaler is not None and manifest.get("loss_scaler") is not None:
            engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    _restore_frozen_and_buffers(engine, rank0_weights)
    engine.mgr.zero_grads()
    engine.mgr.refresh_after_load()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and manifest.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(manifest["scheduler"])
    engine.global_steps = manifest["global_steps"]
    engine.global_samples = manifest.get("global_samples", 0)
    engine.micro_steps = manifest.get("micro_steps", 0)
    comm.barrier()
    return str(tag_dir), manifest.get("client_state", {})


# -- exports ----------------------------------------------------------------------------------------------------
def _export_entries(engine) -> list[tuple[str, object]]:
    """``(name, tensor-or-param)`` in ``state_dict`` order, each object once (tied weights keep their first name)."""
    seen, out = set(), []
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors", max_shard_size="5GB") -> bool:
    """Collective. Write the compute-dtype model as HF safetensors (sharded with an index when large).

    Shards are planned from shapes alone (``split_torch_state_dict_into_shards`` on meta tensors); then, shard by
    shard, stage 3 gathers just the units holding that shard's parameters, rank 0 writes the shard and frees it.
    Stage 3 requires ``stage3_gather_16bit_weights_on_model_save`` (else returns False, as DeepSpeed does).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    if engine.stage == 3 and not engine.config.zero.gather_16bit_weights_on_model_save:
        return False
    save_dir = Path(save_dir)
    entries = _export_entries(engine)
    meta = {n: torch.empty(_shape(t), dtype=t.dtype, device="meta") for n, t in entries}
    stem, dot, ext = save_filename.rpartition(".")
    pattern = f"{stem}{{suffix}}.{ext}" if dot else f"{save_filename}{{suffix}}"
    split = split_torch_state_dict_into_shards(meta, filename_pattern=pattern, max_shard_size=max_shard_size)
    by_name = dict(entries)
    if comm.rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
    for fname, names in split.filename_to_tensors.items():
        indices = [t._zero_index for t in (by_name[n] for n in names) if t.__dict__.get("_zero_mgr") is engine.mgr]
        ctx = engine.mgr.gathered(indices) if engine.stage == 3 and indices else _null()
        with ctx:
            if comm.rank() == 0:
                shard = {n: by_name[n].detach().to("cpu").contiguous().clone() for n in names}
                save_file(shard, str(save_dir / fname), metadata={"format": "pt"})
    if comm.rank() == 0 and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        _write_durable(save_dir / f"{save_filename}.index.json", json.dumps(index, indent=2).encode())
    comm.barrier()
    return True


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def gather_fp32_state_dict(engine) -> dict[str, torch.Tensor]:
    """Collective. Full fp32 masters (one all-gather per group), frozen params and buffers, on every rank (CPU)."""
    table, ws = engine.table, comm.world_size()
    fulls = []
    for master in engine.optimizer.masters:
        if engine.stage == 0:
            fulls.append(master.detach().cpu())
            continue
        dev = master.to(engine.device)
        full = torch.empty(dev.numel() * ws, dtype=torch.float32, device=engine.device)
        comm.all_gather_(full, dev)
        fulls.append(full.cpu().view(ws, -1))
    out = {}
    for i, (name, p) in enumerate(zip(engine.param_names, engine.trainable)):
        flat = torch.empty(table.numels[i], dtype=torch.float32)
        for f in table.fragments(i):
            src = fulls[f.group] if engine.stage == 0 else fulls[f.group][f.rank]
            flat[f.dest: f.dest + f.numel] = src[f.partition_offset: f.partition_offset + f.numel]
        out[name] = flat.view(_shape(p))
    for k, name in enumerate(engine.frozen_names):
        out[name] = frozen_value(engine, k).detach().cpu().clone()
    for name, buf in _named_buffers(engine.module):
        out[name] = buf.detach().cpu().clone()
    return out
