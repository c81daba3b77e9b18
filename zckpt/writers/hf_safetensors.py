"""CheckpointPlan → Hugging Face model folder: ``model.safetensors`` (or shards + index), config and tokenizer files.

Sharding is planned before any I/O with huggingface_hub's ``split_state_dict_into_shards_factory`` over the plan's
output sizes, so shard names and the index are known up front. Each shard is streamed tensor by tensor
(:mod:`zckpt.writers.safetensors_stream`: header first, then each tensor's bytes at its offset); tied aliases are not written (``from_pretrained`` re-ties them), exactly
as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..assemble import default_workers, iter_assembled
from ..cast import output_dtype, write_cast
from ..plan import DTYPE_SIZES, CheckpointPlan, TensorPlan
from .safetensors_stream import Entry, PositionalWriter

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json",
)
_CODE_FILE_RE = re.compile(r"^(configuration|modeling|tokenization)_\w+\.py$")


@dataclass
class WriteResult:
    files: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    tensors: int = 0
    parameters: int = 0
    bytes_written: int = 0


def plan_shards(plan: CheckpointPlan, dtype: str | None, max_shard_size: int | str):
    """Shard assignment for the output, from sizes alone (no tensor is read)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    by_name = {t.name: t for t in plan.tensors}

    def size(t: TensorPlan) -> int:
        return t.numel * DTYPE_SIZES[output_dtype(t, dtype)]

    split = split_state_dict_into_shards_factory(
        by_name, get_storage_size=size, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    return split, by_name


def write_weights(plan: CheckpointPlan, out_dir: Path, dtype: str | None, *,
                  max_shard_size: int | str = "5GB", progress: Callable[[int], None] | None = None,
                  workers: int | None = None) -> WriteResult:
    """Write the plan's tensors as ``model*.safetensors`` (+ index) in ``out_dir``; ``progress(n)`` after each
    tensor's ``n`` source bytes."""
    split, by_name = plan_shards(plan, dtype, max_shard_size)
    result = WriteResult()
    order = {t.name: i for i, t in enumerate(plan.tensors)}
    for filename, names in split.filename_to_tensors.items():
        tensors = sorted((by_name[n] for n in names), key=lambda t: order[t.name])
        entries = [Entry(t.name, output_dtype(t, dtype), t.shape) for t in tensors]
        with open(out_dir / filename, "wb") as fh:
            writer = PositionalWriter(fh.fileno(), entries, metadata={"format": "pt"})

            def job(t: TensorPlan, files) -> int:
                return write_cast(t, files, dtype, lambda data, at: writer.write(t.name, data, at))

            stream = iter_assembled(tensors, job, workers=workers or default_workers())
            for tplan, nbytes in stream:
                result.bytes_written += nbytes
                result.tensors += 1
                result.parameters += tplan.numel
                if progress is not None:
                    progress(tplan.nbytes)
            writer.close()
        result.files.append(filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": split.metadata["total_size"], "total_parameters": result.parameters},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        result.files.append(INDEX_NAME)
    return result


def copy_model_files(model_dir: Path | None, out_dir: Path, dtype: str | None) -> list[str]:
    """Copy config/generation config/tokenizer (and remote-code) files; set the config's dtype to the output's."""
    if model_dir is None:
        return []
    copied = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or not (path.name in MODEL_FILES or _CODE_FILE_RE.match(path.name)):
            continue
        if path.name == "config.json" and dtype is not None:
            _write_config(path, out_dir / path.name, dtype)
        else:
            shutil.copy2(path, out_dir / path.name)
        copied.append(path.name)
    return copied


def _write_config(src: Path, dst: Path, dtype: str) -> None:
    config = json.loads(src.read_text(encoding="utf-8"))
    name = dtype
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = name
    dst.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
