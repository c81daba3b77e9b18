"""What DeepSpeed-format writers share: pickles written with ``torch.save``, and the model-states file.

DeepSpeed's model-states file (``mp_rank_00_model_states.pt``, or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` at
stage 3) is the dict ``DeepSpeedEngine._common_checkpoint_state`` builds (DeepSpeed 0.19.8, ``runtime/engine.py``)
plus the run's client state. :func:`model_states` builds it from a plan: ``param_shapes`` (per optimizer group, name
-> ``torch.Size``, the order the fp32 flat groups hold them), ``shared_params`` (tied alias -> stored name),
counters, scheduler, ``ds_config``, ``ds_version`` and ``universal_checkpoint_info``.

Writing pickles with ``torch.save`` is allowed (reading them never is: :mod:`zckpt.readers.torch_pickle`). Nothing
here imports DeepSpeed: the files hold torch tensors, ``torch.Size``, dicts, lists and numbers only.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint_format import fsync_path

from ..plan import CheckpointPlan
from ..universal_spec import UNIVERSAL_VERSION, UNIVERSAL_VERSION_KEY

#: the DeepSpeed release whose layout these writers follow; recorded as ``ds_version`` when the source is not a
#: DeepSpeed checkpoint (DeepSpeed's ZeRO-1 loader refuses versions before 0.3.17, and an empty one)
DS_VERSION = "0.19.8"


def save_pickle(obj: Any, path: Path, *, fsync: bool = True) -> int:
    """``torch.save(obj, path)``, then fsync; the file's size."""
    torch.save(obj, str(path))
    if fsync:
        fsync_path(path)
    return path.stat().st_size


def ds_version(plan: CheckpointPlan) -> str:
    """The source's ``ds_version`` when it is a DeepSpeed checkpoint, else :data:`DS_VERSION`."""
    if plan.format.startswith("deepspeed") and plan.version:
        return plan.version
    return DS_VERSION


def param_shapes(plan: CheckpointPlan) -> list[OrderedDict]:
    """Per optimizer group, the trainable parameters' names and shapes in plan order (DeepSpeed's ``param_shapes``
    of stages 1/2; a reader takes the group of each parameter from it)."""
    groups = [g.index for g in plan.training.groups] if plan.training else []
    count = max([*groups, *(t.group for t in plan.trainable() if t.group is not None)], default=-1) + 1
    shapes: list[OrderedDict] = [OrderedDict() for _ in range(count)]
    for t in plan.trainable():
        shapes[t.group or 0][t.name] = torch.Size(t.shape)
    return shapes


def universal_info(plan: CheckpointPlan) -> dict:
    """The source's ``universal_checkpoint_info`` when it recorded one, else a data-parallel run's (the version)."""
    info = (plan.training.client_state if plan.training else {}).get("universal_checkpoint_info")
    if isinstance(info, dict) and info:
        return dict(info)
    return {UNIVERSAL_VERSION_KEY: UNIVERSAL_VERSION}


def model_states(plan: CheckpointPlan, module: dict[str, torch.Tensor], *, dp_world_size: int,
                 frozen_shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """The model-states dict, keys in DeepSpeed's order, then the client state (as DeepSpeed appends it)."""
    training = plan.training
    counters = training.counters if training else {}
    steps = counters.get("global_steps", plan.step or 0)
    state: dict[str, Any] = {
        "module": OrderedDict(module),
        "buffer_names": [t.name for t in plan.tensors if t.kind == "buffer"],
        "optimizer": None,
        "param_shapes": param_shapes(plan),
        "frozen_param_shapes": (OrderedDict((n, torch.Size(s)) for n, s in frozen_shapes.items())
                                if frozen_shapes else None),
        "shared_params": dict(plan.aliases),
        "frozen_param_fragments": None,
        "lr_scheduler": training.scheduler if training else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters.get("skipped_steps", 0),
        "global_steps": steps,
        "global_samples": counters.get("global_samples", steps),
        "dp_world_size": dp_world_size,
        "mp_world_size": 1,
        "ds_config": training.config if training and training.config is not None else {},
        "ds_version": ds_version(plan),
    }
    client = dict(training.client_state) if training else {}
    client.pop("universal_checkpoint_info", None)
    state.update({k: v for k, v in client.items() if k not in state})
    state["universal_checkpoint_info"] = universal_info(plan)
    return state


def torch_hparams(hparams: dict) -> dict:
    """A group's JSON hyper-parameters as torch keeps them (``betas`` a tuple)."""
    out = dict(hparams)
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out
