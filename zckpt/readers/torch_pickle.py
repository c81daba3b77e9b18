"""Read ``torch.save`` archives lazily and safely, without torch and without running pickled code.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the object graph) and ``<prefix>/data/<key>``
(one entry per storage, raw little-endian bytes). We unpickle ``data.pkl`` with an allow-list unpickler: tensors come
back as :class:`TensorRef` — dtype, shape, stride, storage key, and the absolute byte offset of the storage in the
file — so a reader can plan byte ranges and never touch bytes it does not need (e.g. Adam moments).

Allowed globals: torch's tensor/parameter rebuild functions and storage types, ``torch.Size``, dtypes and devices,
``collections.OrderedDict``, and local stand-ins for the few DeepSpeed classes its checkpoints contain
(``ZeroStageEnum``, ``LossScaler``/``DynamicLossScaler``, ``fragment_address``). Anything else raises
:class:`~zckpt.errors.UnsafePickleError` naming the global; nothing it names is imported or called.
"""

from __future__ import annotations

import enum
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsafePickleError, UnsupportedCheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
_DTYPE_NAMES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                "float", "double", "half", "long", "int"}
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a torch.save archive, described but not read."""

    path: str
    storage: StorageRef
    storage_offset: int  # elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int  # absolute byte offset of the storage within the file

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def byte_offset(self) -> int:
        """Absolute byte offset of element 0 of this tensor in the file."""
        return self.data_offset + self.storage_offset * _ITEMSIZE[self.dtype]

    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True


# --- stand-ins for DeepSpeed classes: plain data holders, never DeepSpeed code ---------------------------------


class ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # alias of weights, as in DeepSpeed


class _StateHolder:
    """Accepts any constructor args and pickled state; keeps the state as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict_state, slots_state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_StateHolder):
    pass


class DynamicLossScaler(_StateHolder):
    pass


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's name
    numel: int = 0
    start: int = 0


class _Size(tuple):
    """torch.Size stand-in: a tuple with ``numel()``."""

    def numel(self) -> int:
        return math.prod(self)


class _TensorType:
    """Marker returned for ``torch.Tensor`` / ``torch.nn.Parameter`` globals."""


# --- rebuild functions ---------------------------------------------------------------------------------------


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _PendingTensor(storage, int(storage_offset), tuple(int(s) for s in size),
                          tuple(int(s) for s in stride))


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


@dataclass(frozen=True)
class _PendingTensor:
    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "Size"): _Size,
    ("torch", "device"): str,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScaler,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): fragment_address,
}


class _RestrictedUnpickler(pickle._Unpickler):  # noqa: SLF001
    """The pure-Python unpickler: the C one sizes its memo by the largest index a pickle names, so 5 hostile bytes
    (``LONG_BINPUT`` 2**32-1) make it allocate gigabytes (found by tests/test_fuzz.py: 25 s on one input); the
    Python one keeps the memo in a dict. DeepSpeed's ``data.pkl`` holds metadata only (55 kB at 340M parameters):
    4-7 ms here against 1 ms for the C unpickler."""

    def __init__(self, data: bytes, path: str) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPE_NAMES:
            return f"torch.{name}"
        raise UnsafePickleError(
            f"{self._path}: refusing to unpickle global '{module}.{name}' (not on zckpt's allow-list); "
            "nothing was executed. If this file is trusted and the global is benign, please report it."
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{self._path}: unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid[:5]
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else "uint8"
        return StorageRef(key=str(key), dtype=dtype, numel=int(numel))


@dataclass(frozen=True)
class _StorageType:
    dtype: str


def _resolve(obj: Any, path: str, offsets: dict[str, int], sizes: dict[str, int]) -> Any:
    """Replace _PendingTensor leaves by TensorRefs carrying absolute byte offsets, each checked to lie inside its
    storage's zip entry (a tensor never reaches into another entry's bytes)."""
    if isinstance(obj, _PendingTensor):
        return _tensor_ref(obj, path, offsets, sizes)
    if isinstance(obj, dict):
        return type(obj)((k, _resolve(v, path, offsets, sizes)) for k, v in obj.items()) \
            if isinstance(obj, OrderedDict) else {k: _resolve(v, path, offsets, sizes) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, path, offsets, sizes) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, _Size):
        return tuple(_resolve(v, path, offsets, sizes) for v in obj)
    return obj


def _tensor_ref(obj: _PendingTensor, path: str, offsets: dict[str, int], sizes: dict[str, int]) -> TensorRef:
    key = obj.storage.key
    if key not in offsets:
        raise CheckpointCorruptError(f"{path}: storage '{key}' is missing from the archive; "
                                     "the file is truncated or corrupt — re-save it")
    itemsize = _ITEMSIZE[obj.storage.dtype]
    if obj.storage.numel < 0 or obj.storage.numel * itemsize > sizes[key]:
        raise CheckpointCorruptError(f"{path}: storage '{key}' claims {obj.storage.numel} {obj.storage.dtype} "
                                     f"elements but its zip entry holds {sizes[key]} bytes; the file is corrupt")
    if obj.storage_offset < 0 or any(d < 0 for d in obj.shape) or any(s < 0 for s in obj.stride) \
            or len(obj.shape) != len(obj.stride):
        raise CheckpointCorruptError(f"{path}: a tensor of storage '{key}' has a negative offset, shape or stride; "
                                     "the file is corrupt")
    ref = TensorRef(path, obj.storage, obj.storage_offset, obj.shape, obj.stride, offsets[key])
    extent = 1 + sum((d - 1) * s for d, s in zip(obj.shape, obj.stride)) if ref.numel else 0
    if obj.storage_offset + extent > obj.storage.numel:
        raise CheckpointCorruptError(f"{path}: a tensor of storage '{key}' reaches past its storage "
                                     f"({obj.storage_offset + extent} > {obj.storage.numel} elements); the file is "
                                     "corrupt")
    return ref


def _entry_data_offset(fh, info: zipfile.ZipInfo) -> int:
    """Absolute offset of an entry's data: after its local header (30 bytes + name + extra)."""
    fh.seek(info.header_offset)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def load_lazy(path: str | os.PathLike) -> Any:
    """Unpickle a ``torch.save`` archive into plain Python objects with :class:`TensorRef` leaves.

    Checks that every storage a tensor references lies fully inside the file, so a truncated file is reported
    here rather than as a short read later.
    """
    path = str(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointIncompleteError(f"{path} is missing; the checkpoint is incomplete — re-save it or pick "
                                        "another tag with --tag") from None
    if size == 0:
        raise CheckpointIncompleteError(f"{path} is empty (0 bytes): the save was interrupted — re-save it or "
                                        "pick another tag with --tag")
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            infos = zf.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if not pkl:
                raise CheckpointCorruptError(f"{path} is a zip file but not a torch.save archive (no data.pkl)")
            prefix = pkl[0].filename[: -len("data.pkl")]
            _check_byteorder(zf, prefix, path)
            data = zf.read(pkl[0])
            offsets: dict[str, int] = {}
            sizes: dict[str, int] = {}
            for info in infos:
                if info.filename.startswith(prefix + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise UnsupportedCheckpointError(f"{path}: compressed storage entries are not supported")
                    key = info.filename[len(prefix) + 5:]
                    offsets[key] = _entry_data_offset(fh, info)
                    sizes[key] = info.file_size
    except (zipfile.BadZipFile, ValueError, struct.error, NotImplementedError, RuntimeError, EOFError) as exc:
        raise CheckpointCorruptError(f"{path} is truncated or not a torch.save archive ({exc}); re-save it or "
                                     "pick another tag with --tag") from None
    except OSError as exc:
        from ..errors import source_os_error

        raise source_os_error(exc) from None
    obj = load_pickle_bytes_restricted(data, path)
    for key, offset in offsets.items():
        if offset + sizes[key] > size:
            raise CheckpointIncompleteError(f"{path} is truncated: storage {key} ends past the end of the file; "
                                            "re-save it or pick another tag with --tag")
    try:
        return _resolve(obj, path, offsets, sizes)
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: the pickled object is nested too deeply; the file is damaged") \
            from None


def _check_byteorder(zf: zipfile.ZipFile, prefix: str, path: str) -> None:
    try:
        order = zf.read(prefix + "byteorder").decode().strip()
    except KeyError:
        return  # older archives: little-endian
    if order != "little":
        raise UnsupportedCheckpointError(f"{path} was written on a {order}-endian machine; not supported")


#: what a damaged pickle (a valid CRC over wrong bytes, a hand-edited file) makes the unpickler raise
_PICKLE_DAMAGE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                  struct.error, UnicodeDecodeError, OverflowError, RecursionError, MemoryError, ImportError)


def load_pickle_bytes_restricted(data: bytes, path: str = "<bytes>") -> Any:
    """Unpickle raw bytes with the same allow-list (used by tests and for legacy files). Damaged bytes raise
    :class:`~zckpt.errors.CheckpointCorruptError`; a refused global :class:`~zckpt.errors.UnsafePickleError`."""
    try:
        return _RestrictedUnpickler(data, path).load()
    except _PICKLE_DAMAGE as exc:
        raise CheckpointCorruptError(f"{path}: the pickled data is damaged ({type(exc).__name__}: {str(exc)[:100]}); "
                                     "re-save it or pick another tag with --tag") from None


def zip_checks(path: str | os.PathLike) -> tuple:
    """The CRC-32 the zip directory records for each storage entry of a ``torch.save`` archive, as
    :class:`~zckpt.plan.Checksum` s over the entries' data (checked by :mod:`zckpt.integrity` when read)."""
    from ..plan import Checksum

    path = str(path)
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            return tuple(Checksum(_entry_data_offset(fh, info), info.file_size, "crc32", info.CRC, info.filename)
                         for info in zf.infolist() if "/data/" in info.filename or info.filename.startswith("data/"))
    except zipfile.BadZipFile as exc:
        raise CheckpointCorruptError(f"{path} is not a valid zip archive ({exc}); re-save it or pick another tag "
                                     "with --tag") from None

