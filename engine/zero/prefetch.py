"""Stage-3 fetch scheduling: the options, and the recorded module execution order that drives prefetch and reuse.

PURE bookkeeping (no collectives, no tensors): :class:`~engine.zero.stage3.PartitionedParamManager` asks it *what*
to gather next and *whether* to keep a unit gathered; the manager issues and waits the collectives itself.

The trace (as DeepSpeed's ``PartitionedParameterCoordinator``)
-------------------------------------------------------------
A **pass** starts at the root module's forward pre-hook and ends at the next pass start or at the end of backward.
Every stage-3 hook that needs parameters -- a module's pre-forward, and :class:`~engine.zero.stage3._PreBackward`
just before that module's backward -- is one **event**: the tuple of unit ids it needs. The first pass in a mode
(grad enabled or not) records its events; later passes in that mode *replay* them: each event is checked against the
recorded one (a mismatch -- data-dependent control flow -- drops the trace for that mode and prefetching stops until
the next pass records a fresh one), and the events still ahead say which units will be needed next (prefetch) and
how many parameter elements will be gathered before a unit is used again (reuse distance). Every rank runs the same
graph, so every rank makes the same decisions and issues the same collectives in the same order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

#: A recording longer than this (a model driven without ever calling the root module) is abandoned.
MAX_EVENTS = 1_000_000


@dataclass(kw_only=True)
class Stage3Options:
    """Communication knobs of stage 3 (DeepSpeed's ``zero_optimization`` names; defaults are DeepSpeed's)."""

    overlap_comm: bool = True
    """True: all-gathers and gradient reduce-scatters are issued asynchronously (prefetch, overlap with compute).
    False: every collective is synchronous and issued where its result is needed (no prefetch)."""
    prefetch_bucket_size: int = 50_000_000
    """Parameter elements whose all-gather may be in flight ahead of use (0 disables prefetch)."""
    max_live_parameters: int = 1_000_000_000
    """Gathered (non-persistent) parameter elements per rank above which nothing more is prefetched or kept."""
    max_reuse_distance: int = 1_000_000_000
    """A unit used again after at most this many gathered parameter elements stays gathered in between."""
    reduce_bucket_size: int = 500_000_000
    """Gradient elements whose reduce-scatter may be outstanding before the oldest is waited for."""

    @classmethod
    def from_zero_config(cls, zero_cfg) -> "Stage3Options":
        """From a :class:`engine.config.ZeroConfig` (typed names) or any object with DeepSpeed's JSON names."""
        def pick(name: str, default):
            for key in (name, f"stage3_{name}"):
                value = getattr(zero_cfg, key, None)
                if value is not None:
                    return value
            return default
        d = cls()
        return cls(overlap_comm=bool(pick("overlap_comm", d.overlap_comm)),
                   prefetch_bucket_size=int(pick("prefetch_bucket_size", d.prefetch_bucket_size)),
                   max_live_parameters=int(pick("max_live_parameters", d.max_live_parameters)),
                   max_reuse_distance=int(pick("max_reuse_distance", d.max_reuse_distance)),
                   reduce_bucket_size=int(pick("reduce_bucket_size", d.reduce_bucket_size)))


class _Recorded:
    """One mode's recorded events with the indexes replay needs: per unit, the sorted event indices that use it;
    per event index, the elements gathered by all earlier events (prefix sums for reuse distances)."""

    def __init__(self, events: list[tuple[int, ...]], unit_numel: list[int]):
        self.events = events
        self.uses: dict[int, list[int]] = {}
        self.before = [0]
        for i, units in enumerate(events):
            for u in units:
                self.uses.setdefault(u, []).append(i)
            self.before.append(self.before[-1] + sum(unit_numel[u] for u in units))

    def next_use(self, unit: int, pos: int) -> int | None:
        uses = self.uses.get(unit, ())
        k = bisect.bisect_left(uses, pos)
        return uses[k] if k < len(uses) else None


class FetchTrace:
    """Records the event order per mode and tracks the replay position (``pos`` = index of the next event)."""

    def __init__(self, unit_numel: list[int]):
        self.unit_numel = unit_numel
        self._traces: dict[bool, _Recorded] = {}
        self._recording: list | None = None
        self._mode: bool | None = None
        self.replay: _Recorded | None = None
        self.pos = 0
        self.invalidations = 0

    def start_pass(self, mode: bool) -> None:
        """A new pass in ``mode`` (grad enabled?): finish a recording in progress, then replay or record."""
        self.end_pass()
        self._mode, self.pos = mode, 0
        self.replay = self._traces.get(mode)
        if self.replay is None:
            self._recording = []

    def end_pass(self) -> None:
        if self._recording is not None and self._mode is not None and self._recording:
            self._traces[self._mode] = _Recorded(self._recording, self.unit_numel)
        self._recording, self.replay = None, None

    def event(self, units: tuple[int, ...]) -> bool:
        """Note that ``units`` are needed now. True when replaying and the event matched the recording."""
        if self._recording is not None:
            self._recording.append(units)
            if len(self._recording) > MAX_EVENTS:
                self._recording = None
            return False
        rec = self.replay
        if rec is None:
            return False
        if self.pos < len(rec.events) and rec.events[self.pos] == units:
            self.pos += 1
            return True
        self._traces.pop(self._mode, None)  # the graph changed: record it again next pass
        self.replay = None
        self.invalidations += 1
        return False

    def upcoming(self, start: int):
        """``(event index, units)`` of the replayed events from ``max(start, pos)`` on (nothing if not replaying)."""
        rec = self.replay
        if rec is None:
            return
        for i in range(max(start, self.pos), len(rec.events)):
            yield i, rec.events[i]

    def reuse(self, unit: int) -> tuple[int, int] | None:
        """``(event index, elements gathered before it)`` of ``unit``'s next use in this pass, or None."""
        rec = self.replay
        if rec is None:
            return None
        nxt = rec.next_use(unit, self.pos)
        if nxt is None:
            return None
        return nxt, rec.before[nxt] - rec.before[self.pos]
