"""``zero.GatheredParameters``: gather partitioned parameters to read or edit them (DeepSpeed's name and signature).

Works for any owner of partitioned parameters -- a ``zero.Init`` unit (:class:`engine.zero.init.InitUnit`) or the
stage-3 manager (:class:`engine.zero.stage3.PartitionedParamManager`): a partitioned parameter carries its owner in
``param._zero_mgr`` and its index there in ``param._zero_index``; the owner's ``gathered(indices, modifier_rank)``
context does the work (one all-gather per unit; on exit with ``modifier_rank``, that rank's values broadcast and
re-partitioned). Plain tensors pass through untouched, as in DeepSpeed. Kept apart from :mod:`engine.zero.init` so that
:mod:`engine.zero.pretrained` can use it while ``init`` imports ``pretrained``: imports go one way.
"""

from __future__ import annotations

import contextlib

import torch


class GatheredParameters:
    """Gather partitioned parameters for reading or editing (DeepSpeed ``zero.GatheredParameters``)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if not self.enabled:
            return self
        by_mgr: dict = {}
        for p in self.params:
            mgr = p.__dict__.get("_zero_mgr")
            if mgr is not None:
                by_mgr.setdefault(id(mgr), (mgr, []))[1].append(p._zero_index)
        for mgr, indices in by_mgr.values():
            self._stack.enter_context(mgr.gathered(indices, self.modifier_rank))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
