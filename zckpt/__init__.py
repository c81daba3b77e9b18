"""zckpt: the ZeRO checkpoint lifecycle — read DeepSpeed and engine checkpoints, consolidate, reshard, push, inspect.

Importing ``zckpt`` is cheap: torch is imported only by the functions that do tensor work.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "consolidate": "zckpt.api",
    "load_state_dict": "zckpt.api",
    "iter_state_dict": "zckpt.api",
    "ConsolidateResult": "zckpt.api",
    "open_plan": "zckpt.readers",
    "inspect": "zckpt.report",
    "reshard": "zckpt.reshard",
    "ReshardResult": "zckpt.reshard",
    "push": "zckpt.hub",
    "CheckpointManager": "zckpt.manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zckpt' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
