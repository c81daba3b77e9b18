"""Collectives in flight, finished oldest first: the one queue of asynchronous collectives for every ZeRO stage.

Who uses it
-----------
* stages 0-2 (:mod:`engine.zero.flat`): the per-unit gradient reductions (all-reduce / reduce-scatter) with
  ``overlap_comm``, and the post-step all-gathers of the updated parameter slices
  (:meth:`~engine.zero.flat.FlatParamManager.step_buckets`);
* stage 3 (:mod:`engine.zero.stage3`): the per-unit gradient reduce-scatters issued during backward.

Protocol
--------
:meth:`CollectiveQueue.push` records an issued collective: its :class:`engine.comm.Pending` handle (``None`` when it
was synchronous), its size in elements, what to do once it has landed (``finish``: e.g. add the reduced piece into
the fp32 gradient partition), and tensors to keep alive until then (gloo reads the input on a worker thread; freeing
it early would be a use-after-free). Entries are finished strictly in issue order -- wait, then ``finish()`` -- so
every floating-point addition happens in the same order as when each collective is waited at once: results are
bit-identical with and without overlap. A synchronous push drains the queue at once (the caller wanted no overlap);
an asynchronous one finishes the oldest entries while more than ``limit`` elements are in flight (at least the newest
stays in flight).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable, NamedTuple

from engine import comm

#: Environment switch for the stages 1-2 post-step all-gather overlap (on with ``overlap_comm``), for A/B measurements:
#: "0" turns it off -- one whole optimizer step, then synchronous all-gathers, as before. Results are the same bits.
STEP_OVERLAP_ENV = "ENGINE_STEP_ALLGATHER_OVERLAP"


def step_overlap_enabled() -> bool:
    """Whether stages 1-2 overlap their post-step all-gathers with the step (``ENGINE_STEP_ALLGATHER_OVERLAP``)."""
    return os.environ.get(STEP_OVERLAP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _Entry(NamedTuple):
    handle: comm.Pending | None
    numel: int
    finish: Callable[[], None] | None
    keep: tuple[Any, ...]


class CollectiveQueue:
    """Issued collectives, finished in issue order (see module doc). ``numel``: elements in flight."""

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque()
        self.numel = 0

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, handle: comm.Pending | None, numel: int, finish: Callable[[], None] | None = None, *,
             keep: tuple[Any, ...] = (), limit: int = 0) -> None:
        """Record an issued collective. ``handle`` ``None`` (synchronous): finish everything now, this one last.
        Else finish the oldest while more than one entry and more than ``limit`` elements are in flight."""
        self._entries.append(_Entry(handle, int(numel), finish, keep))
        self.numel += int(numel)
        if handle is None:
            self.drain()
            return
        while len(self._entries) > 1 and self.numel > limit:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Wait for the oldest collective, then run its ``finish``."""
        entry = self._entries.popleft()
        if entry.handle is not None:
            entry.handle.wait()
        self.numel -= entry.numel
        if entry.finish is not None:
            entry.finish()

    def drain(self) -> None:
        """Finish every collective in flight, oldest first."""
        while self._entries:
            self.finish_oldest()
