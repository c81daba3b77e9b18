"""ZeRO-1/2/3 sharded training on torch.distributed with a DeepSpeed-compatible API.

    import engine
    model_engine, optimizer, loader, scheduler = engine.initialize(model=model, model_parameters=params,
                                                                   config=ds_config)
    with engine.zero.Init(config_dict_or_path=ds_config):      # ZeRO-3: partition while constructing
        model = build_model()
    with engine.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        ...

See docs/engine.md for the design and the DeepSpeed compatibility table.

Importing ``engine`` is cheap: the API (torch, torch.distributed) loads on first use of ``initialize``, ``Engine``,
``zero`` or ``init_distributed``, so the pure modules -- :mod:`engine.partition` (the layout) and
:mod:`engine.checkpoint_format` (the checkpoint format) -- can be imported by zckpt without them.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"initialize": "engine.api", "Engine": "engine.api", "init_distributed": "engine.comm"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "zero":
        return importlib.import_module("engine.zero")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["initialize", "Engine", "zero", "init_distributed"]
