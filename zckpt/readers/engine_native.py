"""Reader for engine-native checkpoints (``engine/checkpoint.py``): manifest.json + per-rank safetensors -> plan.

No torch: the manifest says, for every parameter, which ``(file, tensor key, element offset)`` holds each fragment;
this module parses each safetensors header (8-byte little-endian length, then JSON with ``dtype``, ``shape`` and
``data_offsets`` relative to the end of the header) to turn those into absolute byte offsets.

Checks, each failing with a one-line :mod:`zckpt.errors` message naming the file and the fix:
``COMMITTED`` present, every listed file present with the recorded size (CheckpointIncompleteError); manifest format,
header sanity (length, offsets inside the file, no overlaps), keys/dtypes/extents as the manifest says, fragments
tiling each tensor exactly (CheckpointCorruptError).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from zckpt.errors import CheckpointCorruptError, CheckpointIncompleteError
from zckpt.plan import DTYPE_SIZES, CheckpointPlan, Fragment, SourceFile, TensorPlan

FORMAT, FORMAT_VERSION = "zckpt-engine", 1
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MAX_HEADER = 100 * 1024 * 1024


def is_engine_checkpoint(tag_dir: Path) -> bool:
    """True when ``tag_dir`` holds an engine manifest (committed or not)."""
    path = Path(tag_dir) / "manifest.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _header(path: Path, size: int) -> tuple[int, dict]:
    """(absolute byte offset where tensor data starts, {key: (dtype, shape, begin, end)})."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointIncompleteError(f"{path}: truncated safetensors file (no header); re-save the checkpoint")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER or 8 + length > size:
            raise CheckpointCorruptError(f"{path}: safetensors header length {length} exceeds the file; "
                                         f"the file is damaged, use an earlier checkpoint")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise CheckpointCorruptError(f"{path}: safetensors header is not JSON; use an earlier checkpoint") from None
    data_start = 8 + length
    tensors, spans = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        numel = 1
        for d in info["shape"]:
            numel *= d
        if dtype is None or end - begin != numel * DTYPE_SIZES[dtype] or begin < 0 or data_start + end > size:
            raise CheckpointCorruptError(f"{path}: tensor {key!r} has inconsistent dtype/shape/offsets; "
                                         f"use an earlier checkpoint")
        tensors[key] = (dtype, tuple(info["shape"]), begin, end)
        spans.append((begin, end))
    spans.sort()
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        if s2 < e1:
            raise CheckpointCorruptError(f"{path}: tensors overlap in the safetensors header; use an earlier checkpoint")
    return data_start, tensors


def _read_manifest(tag_dir: Path) -> dict:
    if not (tag_dir / "COMMITTED").is_file():
        raise CheckpointIncompleteError(f"{tag_dir}: no COMMITTED marker, the save did not finish; "
                                        f"use an earlier tag (see {tag_dir.parent / 'latest'})")
    try:
        manifest = json.loads((tag_dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{tag_dir / 'manifest.json'} is unreadable ({exc}); use an earlier tag") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(f"{tag_dir / 'manifest.json'}: not a {FORMAT} v{FORMAT_VERSION} manifest; "
                                     f"upgrade zckpt or check the path")
    return manifest


class _Files:
    """Lazily checked files of one checkpoint: existence, recorded size, parsed header."""

    def __init__(self, tag_dir: Path, manifest: dict):
        self.tag_dir, self.listed = tag_dir, manifest.get("files", {})
        self.headers: dict[str, tuple[int, dict]] = {}

    def check(self, fname: str) -> tuple[int, dict]:
        if fname not in self.headers:
            path, meta = self.tag_dir / fname, self.listed.get(fname)
            if meta is None:
                raise CheckpointCorruptError(f"{self.tag_dir / 'manifest.json'} references {fname} but does not list "
                                             f"it under 'files'; the manifest is damaged, use an earlier tag")
            if not path.is_file():
                raise CheckpointIncompleteError(f"{path} is missing; copy it back or use an earlier tag")
            size = path.stat().st_size
            if size != meta["size"]:
                raise CheckpointIncompleteError(f"{path} is {size} bytes, the manifest says {meta['size']}; the file "
                                                f"is truncated or replaced, use an earlier tag")
            self.headers[fname] = _header(path, size)
        return self.headers[fname]

    def byte_offset(self, fname: str, key: str, offset: int, numel: int, dtype: str) -> int:
        data_start, tensors = self.check(fname)
        if key not in tensors:
            raise CheckpointCorruptError(f"{self.tag_dir / fname} has no tensor {key!r}; use an earlier tag")
        t_dtype, _shape, begin, end = tensors[key]
        size = DTYPE_SIZES[t_dtype]
        if t_dtype != dtype or begin + (offset + numel) * size > end or offset < 0:
            raise CheckpointCorruptError(f"{self.tag_dir / fname}: {key!r} is {t_dtype} with {(end - begin) // size} "
                                         f"elements, the manifest wants {dtype} [{offset}, {offset + numel}); "
                                         f"use an earlier tag")
        return data_start + begin + offset * size


def _tensor(files: _Files, entry: dict, kind: str) -> TensorPlan:
    name, dtype = entry["name"], entry["dtype"]
    if dtype not in DTYPE_SIZES:
        raise CheckpointCorruptError(f"{files.tag_dir / 'manifest.json'}: {name} has unknown dtype {dtype!r}")
    shape = tuple(entry["shape"])
    if kind == "param":
        frags = tuple(Fragment(str(files.tag_dir / f["file"]),
                               files.byte_offset(f["file"], f["key"], f["offset"], f["numel"], dtype),
                               f["numel"], f["dest"]) for f in entry["fragments"])
    else:
        numel = 1
        for d in shape:
            numel *= d
        frags = (Fragment(str(files.tag_dir / entry["file"]),
                          files.byte_offset(entry["file"], entry["key"], 0, numel, dtype), numel, 0),)
    plan = TensorPlan(name, shape, dtype, frags, kind)
    try:
        plan.validate()
    except ValueError as exc:
        raise CheckpointCorruptError(f"{files.tag_dir / 'manifest.json'}: {exc}; use an earlier tag") from None
    return plan


def read_engine_plan(tag_dir: Path) -> CheckpointPlan:
    """The plan of a committed engine checkpoint tag directory (``save_dir/<tag>``)."""
    tag_dir = Path(tag_dir)
    manifest = _read_manifest(tag_dir)
    files = _Files(tag_dir, manifest)
    for fname in files.listed:
        files.check(fname)
    tensors = [_tensor(files, e, "param") for e in manifest["params"]]
    tensors += [_tensor(files, e, "frozen") for e in manifest.get("frozen", [])]
    tensors += [_tensor(files, e, "buffer") for e in manifest.get("buffers", []) if e.get("persistent", True)]
    names = {t.name for t in tensors}
    aliases = dict(manifest.get("aliases", {}))
    for alias, canonical in aliases.items():
        if canonical not in names:
            raise CheckpointCorruptError(f"{tag_dir / 'manifest.json'}: alias {alias} -> {canonical}, which is not "
                                         f"stored; the manifest is damaged")
    sources = tuple(SourceFile(str(tag_dir / f), meta.get("role", "unknown"), meta.get("rank"),
                               (tag_dir / f).stat().st_size) for f, meta in sorted(files.listed.items()))
    sources += (SourceFile(str(tag_dir / "manifest.json"), "manifest", None, (tag_dir / "manifest.json").stat().st_size),)
    return CheckpointPlan(source=str(tag_dir), format="engine", stage=int(manifest["stage"]),
                          world_size=int(manifest["world_size"]), train_dtype=manifest["compute_dtype"],
                          tag=manifest.get("tag", tag_dir.name), step=manifest.get("global_steps"),
                          tensors=tuple(tensors), aliases=aliases, files=sources, version=f"engine-v{FORMAT_VERSION}")
