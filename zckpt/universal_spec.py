"""DeepSpeed's universal checkpoint layout (DeepSpeed 0.19.8, ``deepspeed/checkpoint/ds_to_universal.py``), defined
once for the writer (:mod:`zckpt.writers.deepspeed_universal`) and the reader
(:mod:`zckpt.readers.deepspeed_universal`). Torch-free.

    <save dir>/latest_universal                  the tag (DeepSpeed reads it when ``load_universal`` is on)
    <tag>/*_model_states.pt                      model states (``MODEL_STATES``: the stage-1/2 name, the stage-3 one)
    <tag>/zero/optimizer_state.pt                optimizer param groups and step
    <tag>/zero/<param name>/<key>.pt             ``fp32``, each optimizer state (``exp_avg``, ...), ``step``
"""

from __future__ import annotations

ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
#: the names DeepSpeed's universal load looks for: stage 1/2 (``mp_rank_*``), stage 3 (``zero_pp_rank_0_mp_rank_*``)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
LATEST = ("latest", "latest_universal")
FP32, STEP = "fp32", "step"
#: the keys of a per-parameter state file's dict (``ds_to_universal`` merges stage-1/2 fragments along dim 0)
PARAM, CAT_DIM = "param", "cat_dim"
#: ``universal_checkpoint_info`` of a data-parallel run (no tensor/pipeline parallelism): the version is all of it
UNIVERSAL_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_VERSION = 0.4


def is_folder_name(name: object) -> bool:
    """Whether a tensor name can be a folder under ``zero/`` (no separators, not ``.``/``..``): names come from a
    checkpoint's metadata and must not lead outside it."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and \
        not any(c in name for c in ("/", "\\", "\0"))
