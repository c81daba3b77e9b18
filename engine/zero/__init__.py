"""ZeRO parameter/gradient management, and DeepSpeed's ``zero`` namespace (``Init``, ``GatheredParameters``).

* :mod:`engine.zero.flat` -- stages 0-2: full parameters as views into flat per-unit buffers.
* :mod:`engine.zero.stage3` -- stage 3: partitioned parameters gathered per module by hooks.
* :mod:`engine.zero.init` -- ``Init`` (partition while constructing, cast to DeepSpeed's dtype).
* :mod:`engine.zero.gathered` -- ``GatheredParameters`` (gather partitioned parameters to read or edit them).
* :mod:`engine.zero.pretrained` -- transformers ``from_pretrained`` inside ``Init``: the checkpoint streamed into
  partitions one module at a time (transformers itself is imported only when such a load happens).
* :mod:`engine.zero.collectives` -- the queue of asynchronous collectives shared by ``flat`` and ``stage3``.
"""

from engine.zero.gathered import GatheredParameters
from engine.zero.init import Init

__all__ = ["Init", "GatheredParameters"]
