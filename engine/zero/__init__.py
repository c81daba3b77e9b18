"""ZeRO parameter/gradient management, and DeepSpeed's ``zero`` namespace (``Init``, ``GatheredParameters``).

* :mod:`engine.zero.flat` -- stages 0-2: full parameters as views into flat per-unit buffers.
* :mod:`engine.zero.stage3` -- stage 3: partitioned parameters gathered per module by hooks.
* :mod:`engine.zero.init` -- ``Init`` (partition while constructing, cast to DeepSpeed's dtype) and
  ``GatheredParameters``.
* :mod:`engine.zero.pretrained` -- transformers ``from_pretrained`` inside ``Init``: the checkpoint streamed into
  partitions one module at a time (imported only when such a load happens).
"""

from engine.zero.init import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters"]
