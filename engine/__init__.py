"""ZeRO-1/2/3 sharded training on torch.distributed with a DeepSpeed-compatible API.

    import engine
    model_engine, optimizer, loader, scheduler = engine.initialize(model=model, model_parameters=params,
                                                                   config=ds_config)
    with engine.zero.Init(config_dict_or_path=ds_config):      # ZeRO-3: partition while constructing
        model = build_model()
    with engine.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        ...

See docs/engine.md for the design and the DeepSpeed compatibility table.
"""

from engine import zero
from engine.api import Engine, initialize
from engine.comm import init_distributed

__all__ = ["initialize", "Engine", "zero", "init_distributed"]
