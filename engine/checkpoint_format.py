"""The engine-native checkpoint format, defined once. PURE: no torch. Imported by the engine's saver/loader
(:mod:`engine.checkpoint`), by zckpt's reader (``zckpt.readers.engine_native``) and writer
(``zckpt.writers.engine_native``).

Layout of ``save_dir/<tag>/`` (default tag ``global_step{N}``)::

    rank00000-weights.safetensors   group{g}.fp32_partition: rank r's flat fp32 master partition of group g;
                                    rank 0 also: frozen.<name> (frozen params, whole) and buffer.<name> (buffers)
    rank00000-optim.safetensors     group{g}.<state key> (Adam: exp_avg, exp_avg_sq -- flat, the partition's layout;
                                    step -- a scalar)
    rank00001-...                   (stages 1-3: one pair per rank; stage 0: rank 0 writes everything)
    manifest.json                   :class:`Manifest`: stage, world size, dtypes, the partition layout (units), every
                                    param's name, shape and fragments, aliases (tied), frozen, buffers, counters,
                                    scheduler / loss-scaler state, client_state, config, size + sha256 of every file
    COMMITTED                       written last (after the manifest, both fsynced); a tag without it is incomplete;
                                    holds the tag and the sha256 of manifest.json (:func:`committed_text`)

``save_dir/latest`` holds the newest committed tag; it is replaced atomically (temp file, fsync, rename) and only
after the tag folder is committed. A tag folder is "ours" only when its manifest says ``format: zckpt-engine``:
nothing else is ever replaced or deleted.

Fragments: ``numel`` elements at element ``offset`` of tensor ``key`` in ``file`` are elements ``[dest, dest+numel)``
of the flattened parameter; a parameter's fragments tile it exactly. The same offsets address every per-parameter
optimizer state tensor (``group{g}.<state key>`` has the master partition's layout).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT, FORMAT_VERSION = "zckpt-engine", 1
MANIFEST, COMMITTED, LATEST = "manifest.json", "COMMITTED", "latest"
#: the longest ``latest`` we read: a tag name, not a file's worth of text
_MAX_LATEST = 4096


class FormatError(ValueError):
    """The folder is not a valid engine checkpoint; the message names the file and what is wrong."""


class IncompleteError(FormatError):
    """The checkpoint is missing a part (COMMITTED marker, a rank file): an interrupted save."""


# -- names ------------------------------------------------------------------------------------------------------
def weights_file(rank: int) -> str:
    return f"rank{rank:05d}-weights.safetensors"


def optim_file(rank: int) -> str:
    return f"rank{rank:05d}-optim.safetensors"


def master_key(group: int) -> str:
    return f"group{group}.fp32_partition"


def state_key(group: int, key: str) -> str:
    return f"group{group}.{key}"


def frozen_key(name: str) -> str:
    return f"frozen.{name}"


def buffer_key(name: str) -> str:
    return f"buffer.{name}"


def check_tag(tag: str) -> None:
    """A tag is a plain folder name."""
    if not tag or "/" in tag or "\\" in tag or "\0" in tag or tag.startswith(".") or tag == LATEST \
            or len(tag) > 255:
        raise FormatError(f"invalid checkpoint tag {tag!r}: use a plain name such as 'global_step100'")


# -- the manifest -----------------------------------------------------------------------------------------------
def _req(obj: dict, key: str, kind, where: str):
    if key not in obj:
        raise FormatError(f"{where}: missing {key!r}")
    value = obj[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise FormatError(f"{where}: {key!r} should be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _nonneg(value: int, what: str, where: str) -> int:
    if value < 0:
        raise FormatError(f"{where}: {what} is negative ({value})")
    return value


def _shape(obj: dict, where: str) -> tuple[int, ...]:
    shape = _req(obj, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape {shape} is not a list of non-negative integers")
    return tuple(shape)


def _file_name(obj: dict, where: str) -> str:
    name = _req(obj, "file", str, where)
    if not name or "/" in name or "\\" in name or name in {".", ".."} or "\0" in name:
        raise FormatError(f"{where}: file {name!r} is not a plain name inside the tag folder")
    return name


@dataclass(frozen=True, kw_only=True)
class FragmentEntry:
    """``numel`` elements at element ``offset`` of ``key`` in ``file`` are param elements ``[dest, dest+numel)``."""

    rank: int
    file: str
    key: str
    offset: int
    numel: int
    dest: int

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "FragmentEntry":
        return cls(rank=_nonneg(_req(obj, "rank", int, where), "rank", where), file=_file_name(obj, where),
                   key=_req(obj, "key", str, where), offset=_nonneg(_req(obj, "offset", int, where), "offset", where),
                   numel=_nonneg(_req(obj, "numel", int, where), "numel", where),
                   dest=_nonneg(_req(obj, "dest", int, where), "dest", where))


@dataclass(frozen=True, kw_only=True)
class ParamEntry:
    """A trainable parameter: its fp32 master lives in fragments of the ranks' flat partitions of ``group``."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # of the stored master: "float32"
    model_dtype: str  # the dtype the model computes in
    group: int
    fragments: tuple[FragmentEntry, ...]

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "ParamEntry":
        name = _req(obj, "name", str, where)
        where = f"{where} ({name})"
        frags = _req(obj, "fragments", list, where)
        return cls(name=name, shape=_shape(obj, where), dtype=_req(obj, "dtype", str, where),
                   model_dtype=obj.get("model_dtype", obj.get("dtype")),
                   group=_nonneg(_req(obj, "group", int, where), "group", where),
                   fragments=tuple(FragmentEntry.from_json(f, where) for f in frags))


@dataclass(frozen=True, kw_only=True)
class WholeEntry:
    """A tensor stored whole in one file: a frozen parameter or a buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    key: str
    persistent: bool = True  # buffers only: False for non-persistent buffers (not in state_dict)

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "WholeEntry":
        name = _req(obj, "name", str, where)
        where = f"{where} ({name})"
        return cls(name=name, shape=_shape(obj, where), dtype=_req(obj, "dtype", str, where),
                   file=_file_name(obj, where), key=_req(obj, "key", str, where),
                   persistent=bool(obj.get("persistent", True)))


@dataclass(frozen=True, kw_only=True)
class GroupEntry:
    """An optimizer group: elements in each rank's flat partition, and its hyper-parameters."""

    partition_numel: int
    hparams: dict

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "GroupEntry":
        return cls(partition_numel=_nonneg(_req(obj, "partition_numel", int, where), "partition_numel", where),
                   hparams=_req(obj, "hparams", dict, where))


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    rank: int | None
    role: str  # "weights" | "optim"
    size: int
    sha256: str

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "FileEntry":
        sha = _req(obj, "sha256", str, where)
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise FormatError(f"{where}: sha256 {sha[:80]!r} is not a hex digest")
        rank = obj.get("rank")
        return cls(rank=rank if isinstance(rank, int) else None, role=str(obj.get("role", "unknown")),
                   size=_nonneg(_req(obj, "size", int, where), "size", where), sha256=sha)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the partitions were laid out (:mod:`engine.partition`): units as lists of trainable parameter indices,
    in unit order, and the slice alignment. Enough to rebuild the table for another world size."""

    units: tuple[tuple[int, ...], ...]
    align: int
    reduce_bucket_size: int | None = None

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "Layout":
        units = _req(obj, "units", list, where)
        if not all(isinstance(u, list) and u and all(isinstance(i, int) and i >= 0 for i in u) for u in units):
            raise FormatError(f"{where}: units must be non-empty lists of parameter indices")
        bucket = obj.get("reduce_bucket_size")
        return cls(units=tuple(tuple(u) for u in units), align=_req(obj, "align", int, where),
                   reduce_bucket_size=bucket if isinstance(bucket, int) else None)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json``: the self-description of one engine checkpoint."""

    tag: str
    stage: int
    world_size: int
    partition_world_size: int  # 1 for stage 0 (unsharded), else world_size
    compute_dtype: str
    master_dtype: str = "float32"
    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    optimizer: str = "adamw"
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    groups: tuple[GroupEntry, ...] = ()
    params: tuple[ParamEntry, ...] = ()
    aliases: dict = field(default_factory=dict)
    frozen: tuple[WholeEntry, ...] = ()
    buffers: tuple[WholeEntry, ...] = ()
    layout: Layout | None = None
    scheduler: dict | None = None
    loss_scaler: dict | None = None
    config: dict | None = None
    client_state: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # file name -> FileEntry
    #: free-form provenance, e.g. {"resharded_from": {...}} written by ``zckpt reshard``
    origin: dict | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "files":
                value = {k: asdict(v) for k, v in value.items()}
            elif f.name == "layout":
                value = None if value is None else {"units": [list(u) for u in value.units], "align": value.align,
                                                    "reduce_bucket_size": value.reduce_bucket_size}
            elif isinstance(value, tuple):
                value = [asdict(v) if hasattr(v, "__dataclass_fields__") else v for v in value]
            out[f.name] = value
        return json.loads(json.dumps(out))  # tuples -> lists; fails loudly on anything not JSON

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def from_json(cls, obj: Any, where: str = MANIFEST) -> "Manifest":
        """Parse and validate; raises :class:`FormatError` naming ``where`` and the problem."""
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: not a JSON object")
        if obj.get("format") != FORMAT or obj.get("format_version") != FORMAT_VERSION:
            raise FormatError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} manifest (format "
                              f"{obj.get('format')!r} v{obj.get('format_version')!r})")
        stage = _req(obj, "stage", int, where)
        world = _req(obj, "world_size", int, where)
        if stage not in (0, 1, 2, 3) or world < 1:
            raise FormatError(f"{where}: stage {stage} / world_size {world} out of range")
        pws = obj.get("partition_world_size", 1 if stage == 0 else world)
        if pws != (1 if stage == 0 else world):
            raise FormatError(f"{where}: partition_world_size {pws} does not fit stage {stage} at world size {world}")
        files = _req(obj, "files", dict, where)
        groups = tuple(GroupEntry.from_json(g, f"{where} group {i}")
                       for i, g in enumerate(_req(obj, "groups", list, where)))
        params = tuple(ParamEntry.from_json(p, f"{where} param {i}")
                       for i, p in enumerate(_req(obj, "params", list, where)))
        aliases = obj.get("aliases") or {}
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in aliases.items()):
            raise FormatError(f"{where}: aliases must map names to names")
        counters = {}
        for key in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            value = obj.get(key, 0) or 0
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FormatError(f"{where}: {key} should be a non-negative integer, got {value!r}")
            counters[key] = value
        for p in params:
            if p.group >= len(groups):
                raise FormatError(f"{where}: {p.name} is in group {p.group}, the manifest has {len(groups)}")
            for f in p.fragments:
                if f.rank >= pws or f.file not in files:
                    raise FormatError(f"{where}: {p.name} has a fragment in {f.file} (rank {f.rank}), which is not "
                                      f"a listed file of a rank below {pws}")
        layout = obj.get("layout")
        client_state = obj.get("client_state") or {}
        if not isinstance(client_state, dict):
            raise FormatError(f"{where}: client_state should be a JSON object")
        return cls(
            tag=_req(obj, "tag", str, where), stage=stage, world_size=world, partition_world_size=pws,
            compute_dtype=_req(obj, "compute_dtype", str, where), master_dtype=obj.get("master_dtype", "float32"),
            optimizer=str(obj.get("optimizer", "adamw")),
            state_keys=tuple(obj.get("state_keys", ("exp_avg", "exp_avg_sq"))),
            groups=groups, params=params, aliases=dict(aliases),
            frozen=tuple(WholeEntry.from_json(e, f"{where} frozen {i}") for i, e in enumerate(obj.get("frozen", []))),
            buffers=tuple(WholeEntry.from_json(e, f"{where} buffer {i}")
                          for i, e in enumerate(obj.get("buffers", []))),
            layout=Layout.from_json(layout, f"{where} layout") if layout is not None else None,
            scheduler=obj.get("scheduler"), loss_scaler=obj.get("loss_scaler"), config=obj.get("config"),
            client_state=client_state, origin=obj.get("origin"),
            files={name: FileEntry.from_json(meta, f"{where} files[{name!r}]") for name, meta in files.items()
                   if _file_name({"file": name}, where)},
            **counters,
        )


def is_ours(tag_dir: Path) -> bool:
    """True when ``tag_dir`` holds an engine manifest (committed or not): the only folders we replace or delete."""
    try:
        with open(Path(tag_dir) / MANIFEST, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return b'"format": "zckpt-engine"' in head or b'"format":"zckpt-engine"' in head


def read_manifest(tag_dir: Path, *, require_commit: bool = True) -> Manifest:
    """The validated manifest of a committed checkpoint. Raises :class:`IncompleteError` without ``COMMITTED``,
    :class:`FormatError` when the manifest is unreadable or invalid."""
    tag_dir = Path(tag_dir)
    if require_commit and not (tag_dir / COMMITTED).is_file():
        raise IncompleteError(f"{tag_dir}: no {COMMITTED} marker, the save did not finish; use an earlier tag "
                              f"(see {tag_dir.parent / LATEST})")
    path = tag_dir / MANIFEST
    try:
        data = path.read_bytes()
        digest_error = _manifest_digest_error(tag_dir, data) if require_commit else None
        if digest_error is None:  # a damaged manifest is reported as such, not as the JSON error it causes
            obj = json.loads(data)
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:120]}); use an earlier tag") \
            from None
    if digest_error:
        raise DigestError(digest_error)
    return Manifest.from_json(obj, str(path))


class DigestError(FormatError):
    """``manifest.json`` does not match the sha256 that ``COMMITTED`` records."""


def _manifest_digest_error(tag_dir: Path, manifest_bytes: bytes) -> str | None:
    """Why the manifest's bytes do not match the sha256 ``COMMITTED`` records, or None when they do (markers
    written before the digest existed hold only the tag: such a manifest is checked for structure only)."""
    _, digest = parse_committed((tag_dir / COMMITTED).read_bytes())
    got = hashlib.sha256(manifest_bytes).hexdigest()
    if digest is None or got == digest:
        return None
    return (f"{tag_dir / MANIFEST} does not match the sha256 recorded in {COMMITTED} (sha256 "
            f"{got[:16]}..., recorded {digest[:16]}...): it was edited or damaged after the save; "
            "use an earlier tag")


def read_latest(save_dir: Path) -> str | None:
    """The tag named by ``save_dir/latest`` (None when there is no such file), validated as a plain name."""
    path = Path(save_dir) / LATEST
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        raw = f.read(_MAX_LATEST + 1)
    if len(raw) > _MAX_LATEST:
        raise FormatError(f"{path} is {len(raw)}+ bytes, not a tag name; pass the tag explicitly")
    tag = raw.decode("utf-8", errors="replace").strip()
    if not tag:
        raise IncompleteError(f"{path} is empty (an interrupted save?); pass the tag explicitly")
    try:
        check_tag(tag)
    except FormatError:
        raise FormatError(f"{path} names an invalid tag {tag[:80]!r}; pass the tag explicitly") from None
    return tag


# -- the loss-scaler state, as the manifest stores it ------------------------------------------------------------
def loss_scaler_from_deepspeed(scaler: Any) -> dict[str, Any]:
    """The manifest's ``loss_scaler`` (``engine.precision`` scalers' ``state_dict()``) from a DeepSpeed
    ``LossScaler``/``DynamicLossScaler`` (object or its ``__dict__``), as found under
    ``optimizer_state_dict["loss_scaler"]`` in DeepSpeed ZeRO checkpoints. KeyError/TypeError/ValueError when the
    object lacks a field."""
    attrs = scaler if isinstance(scaler, dict) else vars(scaler)
    if not attrs.get("dynamic", False):
        return {"type": "static", "cur_scale": float(attrs["cur_scale"])}
    return {"type": "dynamic", "cur_scale": float(attrs["cur_scale"]), "cur_iter": int(attrs["cur_iter"]),
            "last_overflow_iter": int(attrs["last_overflow_iter"]), "cur_hysteresis": int(attrs["cur_hysteresis"]),
            "scale_factor": float(attrs["scale_factor"]), "scale_window": int(attrs["scale_window"]),
            "min_scale": float(attrs["min_scale"]), "hysteresis": int(attrs["delayed_shift"]),
            "consecutive_hysteresis": bool(attrs["consecutive_hysteresis"]),
            "raise_error_at_min_scale": bool(attrs.get("raise_error_at_min_scale", True))}


# -- durable writes ---------------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class HashingWriter:
    """A new file written sequentially, hashed in the same pass: each chunk's sha256 update runs on a worker thread
    while the caller's thread writes that chunk (both release the GIL), and both are done when ``write`` returns,
    so the caller may reuse its buffer. ``close`` fsyncs and returns the hex digest; nothing is read back."""

    def __init__(self, path: Path, *, exclusive: bool = False):
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        self.path, self.size, self._sha = path, 0, hashlib.sha256()
        self._fd = os.open(path, flags, 0o644)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._pending: Future | None = None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        self._settle()
        self._pending = self._hasher.submit(self._sha.update, view)
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        if hasattr(os, "posix_fadvise") and len(view) >= 1 << 20:
            os.posix_fadvise(self._fd, self.size, len(view), os.POSIX_FADV_DONTNEED)
        self.size += len(view)
        self._settle()  # the caller may overwrite ``data`` once we return

    def _settle(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> str:
        """fsync, close; the sha256 hex digest of everything written."""
        try:
            self._settle()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._hasher.shutdown()
        return self._sha.hexdigest()

    def abort(self) -> None:
        """Close without syncing (the caller removes the file's folder)."""
        self._hasher.shutdown(wait=True)
        os.close(self._fd)


def write_latest(save_dir: Path, tag: str) -> None:
    """Replace ``save_dir/latest`` atomically: temp file, fsync, rename, fsync the directory."""
    save_dir = Path(save_dir)
    tmp = save_dir / f".{LATEST}.tmp-{os.getpid()}"
    write_durable(tmp, tag.encode())
    os.replace(tmp, save_dir / LATEST)
    fsync_path(save_dir)


def committed_text(tag: str, manifest_bytes: bytes) -> bytes:
    """``COMMITTED``'s content: the tag, then the sha256 of ``manifest.json``'s bytes (which lists every other file's
    sha256, so the marker covers the whole checkpoint)."""
    import hashlib

    return f"{tag}\nmanifest-sha256 {hashlib.sha256(manifest_bytes).hexdigest()}\n".encode()


def parse_committed(raw: bytes) -> tuple[str, str | None]:
    """``(tag, manifest sha256 or None)`` from ``COMMITTED``'s bytes (checkpoints before the hash hold the tag)."""
    lines = raw[:4096].decode("utf-8", "replace").splitlines()
    tag = lines[0].strip() if lines else ""
    digest = next((line.split()[1] for line in lines[1:] if line.startswith("manifest-sha256 ")
                   and len(line.split()) == 2), None)
    return tag, digest


def commit(tag_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` then ``COMMITTED`` into the (temporary) tag folder, each fsynced, then the folder."""
    data = manifest.dumps()
    write_durable(tag_dir / MANIFEST, data)
    write_durable(tag_dir / COMMITTED, committed_text(manifest.tag, data))
    fsync_path(tag_dir)
