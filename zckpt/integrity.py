"""Integrity of what a command reads: the checksums the source itself records, checked before output is published.

What is checked (the checksums come from the reader, :class:`~zckpt.plan.Checksum` on each
:class:`~zckpt.plan.SourceFile`):

* engine-native checkpoints: the sha256 and size of every file, from ``manifest.json`` (size always, when the plan
  is read; sha256 of each file whose bytes the command reads);
* DeepSpeed checkpoints: the CRC-32 the zip directory records for every storage entry whose bytes the command reads
  (``data.pkl`` itself is CRC-checked by :mod:`zipfile` when it is unpickled).

A command checks the regions holding any byte it reads (:func:`regions_read`) -- for ``consolidate`` the weights
files / fp32 partition entries, for ``reshard`` also the optimizer state -- and ``zckpt verify --deep`` checks every
region of every file. The check runs in one background thread beside the command (:class:`checked`): it reads each
region sequentially from the page cache the command fills anyway, and the command's output is published only after
every region matched; a mismatch raises :class:`~zckpt.errors.CheckpointCorruptError` naming the file, the region and
both values, and the staged output is removed.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import zlib
from collections import defaultdict
from typing import Iterable

from .errors import CheckpointCorruptError, CheckpointIncompleteError, ZckptError, source_os_error
from .plan import DTYPE_SIZES, CheckpointPlan, Checksum, SourceFile, TensorPlan

CHUNK = 8 * 2**20


def _intervals(tensors: Iterable[TensorPlan], with_state: bool) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges read, per file, by assembling ``tensors`` (and their optimizer state with ``with_state``)."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for tensor in tensors:
        pairs = [(tensor.dtype, tensor.fragments)]
        if with_state:
            pairs += [(st.dtype, st.fragments) for st in tensor.state]
        for dtype, frags in pairs:
            size = DTYPE_SIZES[dtype]
            for frag in frags:
                if frag.numel:
                    out[frag.path].append((frag.offset, frag.offset + frag.numel * size))
    return out


def check_disjoint(tensors: Iterable[TensorPlan], where: object) -> None:
    """No byte of a file belongs to two fragments (of one tensor or two, weights or optimizer state): a fragment
    pointing into another parameter's bytes would silently duplicate it. ``where`` names the source in messages."""
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for t in tensors:
        for label, dtype, frags in ((t.name, t.dtype, t.fragments),
                                    *((f"{t.name}/{s.key}", s.dtype, s.fragments) for s in t.state)):
            size = DTYPE_SIZES[dtype]
            for f in frags:
                if f.numel:
                    spans[f.path].append((f.offset, f.offset + f.numel * size, label))
    for path, items in spans.items():
        items.sort()
        for (_, end, first), (start, _, second) in zip(items, items[1:]):
            if start < end:
                raise CheckpointCorruptError(f"{where}: {second} and {first} claim the same bytes of {path}; the "
                                             "checkpoint is damaged, use an earlier one")


def tensors_read(plan: CheckpointPlan, with_state: bool) -> list[TensorPlan]:
    """The tensors a command reads: the plan's, plus the optimizer groups' scalars with ``with_state``."""
    tensors = list(plan.tensors)
    if with_state and plan.training is not None:
        tensors += [s for group in plan.training.groups for s in group.scalars]
    return tensors


def regions_read(plan: CheckpointPlan, *, with_state: bool = False, deep: bool = False
                 ) -> list[tuple[SourceFile, Checksum]]:
    """The checksummed regions holding any byte the command reads (every region with ``deep``), in file order."""
    if deep:
        return [(f, c) for f in plan.files for c in f.checks]
    intervals = _intervals(tensors_read(plan, with_state), with_state)
    chosen = []
    for source in plan.files:
        spans = sorted(intervals.get(source.path, ()))
        if not spans or not source.checks:
            continue
        starts = [s for s, _ in spans]
        ends_prefix_max = []
        best = -1
        for _, e in spans:
            best = max(best, e)
            ends_prefix_max.append(best)
        for check in source.checks:
            lo, hi = check.offset, check.offset + check.length
            # any span with start < hi and end > lo: the spans starting before hi, the furthest end among them
            i = bisect.bisect_left(starts, hi)
            if i and ends_prefix_max[i - 1] > lo:
                chosen.append((source, check))
    return chosen


def compute(path: str, check: Checksum, cancel: threading.Event | None = None) -> str | int | None:
    """The checksum of the region as it is on disk now (None when cancelled)."""
    digest = hashlib.sha256() if check.algo == "sha256" else None
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(min(CHUNK, max(check.length, 1)))
        view = memoryview(buf)
        done = 0
        while done < check.length:
            if cancel is not None and cancel.is_set():
                return None
            n = os.preadv(fd, [view[:min(len(buf), check.length - done)]], check.offset + done)
            if n == 0:
                raise CheckpointIncompleteError(f"{path} is truncated: {check.what or 'its bytes'} end at byte "
                                                f"{check.offset + check.length}, the file at {check.offset + done}; "
                                                "use an earlier checkpoint")
            if digest is not None:
                digest.update(view[:n])
            else:
                crc = zlib.crc32(view[:n], crc)
            done += n
    finally:
        os.close(fd)
    return digest.hexdigest() if digest is not None else crc


def _mismatch(source: SourceFile, check: Checksum, got: str | int) -> CheckpointCorruptError:
    what = f"{check.what} (bytes {check.offset}-{check.offset + check.length})" if check.what else "the file"
    if check.algo == "crc32":
        values = f"CRC-32 {got:08x}, the zip directory records {check.expected:08x}"
    else:
        values = f"sha256 {str(got)[:16]}..., the manifest records {str(check.expected)[:16]}..."
    return CheckpointCorruptError(f"{source.path}: {what} does not match its checksum ({values}): the bytes changed "
                                  "after the save (disk or copy damage); use an earlier checkpoint or a good copy")


def verify_regions(regions: list[tuple[SourceFile, Checksum]], cancel: threading.Event | None = None) -> int:
    """Check every region; raise :class:`CheckpointCorruptError` at the first mismatch. Returns bytes checked."""
    checked = 0
    for source, check in regions:
        try:
            got = compute(source.path, check, cancel)
        except OSError as exc:
            raise source_os_error(exc) from None
        if got is None:
            return checked
        if got != check.expected:
            raise _mismatch(source, check, got)
        checked += check.length
    return checked


class checked:  # noqa: N801 - used as a context manager, like contextlib's
    """Verify ``regions`` in a background thread while the body runs; on a clean exit, wait and raise any mismatch
    (so the caller's output is not published). On an exception in the body, stop the check and let it propagate."""

    def __init__(self, regions: list[tuple[SourceFile, Checksum]]) -> None:
        self.regions = regions
        self.bytes_checked = 0
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zckpt-integrity", daemon=True)

    def _run(self) -> None:
        try:
            self.bytes_checked = verify_regions(self.regions, self._cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread in __exit__
            self._error = exc

    def __enter__(self) -> "checked":
        if self.regions:
            self._thread.start()
        return self

    def finish(self) -> None:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, ZckptError):
                raise error
            raise CheckpointCorruptError(f"integrity check failed: {type(error).__name__}: {error}") from error

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._cancel.set()
            if self._thread.ident is not None:
                self._thread.join()
            return False
        self.finish()
        return False
