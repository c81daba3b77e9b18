"""Reader for engine-native checkpoints (``engine/checkpoint.py``): manifest.json + per-rank safetensors -> plan.

No torch: the manifest says, for every parameter, which ``(file, tensor key, element offset)`` holds each fragment;
this module parses each safetensors header (8-byte little-endian length, then JSON with ``dtype``, ``shape`` and
``data_offsets`` relative to the end of the header) to turn those into absolute byte offsets.

Checks, each failing with a one-line :mod:`zckpt.errors` message naming the file and the fix:
``COMMITTED`` present, every listed file present with the recorded size (CheckpointIncompleteError); the manifest's
sha256 as ``COMMITTED`` records it, manifest format, header sanity (length, offsets inside the file, no overlaps),
keys/dtypes/extents as the manifest says, every rank's files and partition sizes, fragments tiling each tensor exactly
and sharing no byte (CheckpointCorruptError). The files' sha256 are checked when their bytes are read
(:mod:`zckpt.integrity`).
"""

from __future__ import annotations

import math
from pathlib import Path

from engine import checkpoint_format as spec
from zckpt.errors import CheckpointCorruptError, CheckpointIncompleteError, source_os_error
from zckpt.integrity import check_disjoint
from zckpt.safetensors_header import HeaderError, read_header
from zckpt.plan import (DTYPE_SIZES, CheckpointPlan, Checksum, Fragment, OptimizerGroup, SourceFile,
                        StatePlan, TensorPlan, TrainingState)

def is_engine_checkpoint(tag_dir: Path) -> bool:
    """True when ``tag_dir`` holds an engine manifest (committed or not)."""
    return spec.is_ours(Path(tag_dir))


def _header(path: Path) -> tuple[int, dict]:
    """(absolute byte offset where tensor data starts, {key: TensorSpan}), as zckpt.safetensors_header checks it."""
    try:
        return read_header(path)
    except HeaderError as exc:
        error = CheckpointIncompleteError if exc.truncated else CheckpointCorruptError
        raise error(f"{exc}; the file is damaged, use an earlier checkpoint") from None


def _read_manifest(tag_dir: Path) -> spec.Manifest:
    try:
        return spec.read_manifest(tag_dir)
    except spec.IncompleteError as exc:
        raise CheckpointIncompleteError(str(exc)) from None
    except spec.DigestError as exc:
        raise CheckpointCorruptError(str(exc)) from None
    except spec.FormatError as exc:
        raise CheckpointCorruptError(f"{exc}; upgrade zckpt or use an earlier tag") from None
    except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as exc:  # JSON of unexpected shape
        raise CheckpointCorruptError(f"{tag_dir / spec.MANIFEST}: malformed manifest ({type(exc).__name__}: "
                                     f"{str(exc)[:100]}); use an earlier tag") from None


class _Files:
    """Lazily checked files of one checkpoint: existence, recorded size, parsed header."""

    def __init__(self, tag_dir: Path, manifest: spec.Manifest):
        self.tag_dir, self.listed = tag_dir, manifest.files
        self.headers: dict[str, tuple[int, dict]] = {}

    def check(self, fname: str) -> tuple[int, dict]:
        if fname not in self.headers:
            path, meta = self.tag_dir / fname, self.listed.get(fname)
            if meta is None:
                raise CheckpointCorruptError(f"{self.tag_dir / 'manifest.json'} references {fname} but does not list "
                                             f"it under 'files'; the manifest is damaged, use an earlier tag")
            if path.is_dir():
                raise CheckpointCorruptError(f"{path} is a folder, the manifest lists a file; use an earlier tag")
            if not path.is_file():
                raise CheckpointIncompleteError(f"{path} is missing; copy it back or use an earlier tag")
            size = path.stat().st_size
            if size != meta.size:
                raise CheckpointIncompleteError(f"{path} is {size} bytes, the manifest says {meta.size}; the file "
                                                f"is truncated or replaced, use an earlier tag")
            self.headers[fname] = _header(path)
        return self.headers[fname]

    def byte_offset(self, fname: str, key: str, offset: int, numel: int, dtype: str) -> int:
        data_start, tensors = self.check(fname)
        if key not in tensors:
            raise CheckpointCorruptError(f"{self.tag_dir / fname} has no tensor {key!r}; use an earlier tag")
        span = tensors[key]
        t_dtype, begin, end = span.dtype, span.begin, span.end
        size = DTYPE_SIZES[t_dtype]
        if t_dtype != dtype or begin + (offset + numel) * size > end or offset < 0:
            raise CheckpointCorruptError(f"{self.tag_dir / fname}: {key!r} is {t_dtype} with {(end - begin) // size} "
                                         f"elements, the manifest wants {dtype} [{offset}, {offset + numel}); "
                                         f"use an earlier tag")
        return data_start + begin + offset * size


def _fragments(files: _Files, frags, dtype: str) -> tuple[Fragment, ...]:
    return tuple(Fragment(str(files.tag_dir / f.file), files.byte_offset(f.file, f.key, f.offset, f.numel, dtype),
                          f.numel, f.dest) for f in frags)


def _param(files: _Files, entry: spec.ParamEntry, manifest: spec.Manifest, with_state: bool) -> TensorPlan:
    """A trainable parameter: fp32 master fragments, and the same fragments in the optim files for each state key
    (``group{g}.<key>`` has the master partition's layout)."""
    state = ()
    if with_state:
        state = tuple(StatePlan(key, "float32", _state_fragments(files, entry, key)) for key in manifest.state_keys)
    return TensorPlan(entry.name, entry.shape, entry.dtype, _fragments(files, entry.fragments, entry.dtype), "param",
                      entry.group, state)


def _state_fragments(files: _Files, entry: spec.ParamEntry, key: str) -> tuple[Fragment, ...]:
    out = []
    for f in entry.fragments:
        fname = spec.optim_file(f.rank)
        out.append(Fragment(str(files.tag_dir / fname),
                            files.byte_offset(fname, spec.state_key(entry.group, key), f.offset, f.numel, "float32"),
                            f.numel, f.dest))
    return tuple(out)


def _whole(files: _Files, entry: spec.WholeEntry, kind: str) -> TensorPlan:
    if entry.dtype not in DTYPE_SIZES:
        raise CheckpointCorruptError(f"{files.tag_dir / spec.MANIFEST}: {entry.name} has unknown dtype "
                                     f"{entry.dtype!r}")
    numel = 1
    for d in entry.shape:
        numel *= d
    frag = Fragment(str(files.tag_dir / entry.file), files.byte_offset(entry.file, entry.key, 0, numel, entry.dtype),
                    numel, 0)
    return TensorPlan(entry.name, entry.shape, entry.dtype, (frag,), kind)


def _training(files: _Files, manifest: spec.Manifest, has_optim: bool) -> TrainingState:
    groups = []
    for g, group in enumerate(manifest.groups):
        scalars = ()
        fname = spec.optim_file(0)
        if has_optim:
            _, tensors = files.check(fname)
            key = spec.state_key(g, "step")
            if key in tensors:
                dtype = tensors[key].dtype
                scalars = (TensorPlan("step", (), dtype, (Fragment(str(files.tag_dir / fname),
                                                                   files.byte_offset(fname, key, 0, 1, dtype), 1, 0),)),)
        groups.append(OptimizerGroup(g, dict(group.hparams), scalars))
    counters = {"global_steps": manifest.global_steps, "global_samples": manifest.global_samples,
                "micro_steps": manifest.micro_steps, "skipped_steps": manifest.skipped_steps}
    return TrainingState(optimizer=manifest.optimizer, state_keys=manifest.state_keys if has_optim else (),
                         groups=tuple(groups), scheduler=manifest.scheduler, loss_scaler=manifest.loss_scaler,
                         counters=counters, client_state=dict(manifest.client_state), config=manifest.config,
                         units=manifest.layout.units if manifest.layout is not None else None)


def _check_ranks(files: _Files, manifest: spec.Manifest, has_optim: bool) -> None:
    """Cross-rank consistency: every rank below the partition world size has its files, each holding every group's
    partition with the manifest's ``partition_numel`` (and the optimizer state with the same numel); the
    ``COMMITTED`` marker names the manifest's tag."""
    where = files.tag_dir / spec.MANIFEST
    names = [spec.weights_file(r) for r in range(manifest.partition_world_size)]
    if has_optim:
        names += [spec.optim_file(r) for r in range(manifest.partition_world_size)]
    for name in names:
        if name not in files.listed:
            raise CheckpointCorruptError(f"{where}: stage {manifest.stage} at world size {manifest.world_size} needs "
                                         f"{name}, which the manifest does not list; the manifest is damaged or from "
                                         "another run, use an earlier tag")
    for g, group in enumerate(manifest.groups):
        for r in range(manifest.partition_world_size):
            keys = [(spec.weights_file(r), spec.master_key(g))]
            if has_optim:
                keys += [(spec.optim_file(r), spec.state_key(g, k)) for k in manifest.state_keys]
            for fname, key in keys:
                _, tensors = files.check(fname)
                span = tensors.get(key)
                numel = math.prod(span.shape) if span is not None else None
                if numel != group.partition_numel:
                    raise CheckpointCorruptError(
                        f"{files.tag_dir / fname}: {key!r} holds {numel if numel is not None else 'no'} elements, the "
                        f"manifest says rank {r} holds {group.partition_numel} of group {g}; the ranks' files are "
                        "from different saves, use an earlier tag")
    try:
        marker, _ = spec.parse_committed((files.tag_dir / spec.COMMITTED).read_bytes())
    except OSError as exc:
        raise source_os_error(exc) from None
    if marker and marker != manifest.tag:
        raise CheckpointCorruptError(f"{files.tag_dir / spec.COMMITTED} names tag {marker[:80]!r} but the manifest "
                                     f"is for {manifest.tag[:80]!r}; the folder mixes two saves, use an earlier tag")


def read_engine_plan(tag_dir: Path) -> CheckpointPlan:
    """The plan of a committed engine checkpoint tag directory (``save_dir/<tag>``): weights and training state."""
    tag_dir = Path(tag_dir)
    manifest = _read_manifest(tag_dir)  # also checks the manifest against the sha256 COMMITTED records
    files = _Files(tag_dir, manifest)
    for fname in files.listed:
        files.check(fname)
    has_optim = any(meta.role == "optim" for meta in files.listed.values())
    _check_ranks(files, manifest, has_optim)
    tensors = [_param(files, e, manifest, has_optim) for e in manifest.params]
    tensors += [_whole(files, e, "frozen") for e in manifest.frozen]
    tensors += [_whole(files, e, "buffer") for e in manifest.buffers if e.persistent]
    for plan in tensors:
        try:
            plan.validate()
        except ValueError as exc:
            raise CheckpointCorruptError(f"{tag_dir / spec.MANIFEST}: {exc}; use an earlier tag") from None
    check_disjoint(tensors, tag_dir / spec.MANIFEST)
    names = {t.name for t in tensors}
    for alias, canonical in manifest.aliases.items():
        if canonical not in names:
            raise CheckpointCorruptError(f"{tag_dir / spec.MANIFEST}: alias {alias} -> {canonical}, which is not "
                                         f"stored; the manifest is damaged")
    sources = tuple(SourceFile(str(tag_dir / f), meta.role, meta.rank, meta.size,
                               (Checksum(0, meta.size, "sha256", meta.sha256, "the file"),))
                    for f, meta in sorted(files.listed.items()))
    sources += (SourceFile(str(tag_dir / spec.MANIFEST), "manifest", None, (tag_dir / spec.MANIFEST).stat().st_size),)
    return CheckpointPlan(source=str(tag_dir), format="engine", stage=manifest.stage,
                          world_size=manifest.world_size, train_dtype=manifest.compute_dtype,
                          tag=manifest.tag or tag_dir.name, step=manifest.global_steps,
                          tensors=tuple(tensors), aliases=dict(manifest.aliases), files=sources,
                          version=f"engine-v{spec.FORMAT_VERSION}",
                          training=_training(files, manifest, has_optim))
