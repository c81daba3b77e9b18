"""Library entry points: consolidate a checkpoint to an HF folder, or load/iterate its full state dict."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .errors import CheckpointCorruptError, InvalidArgumentError
from .readers import open_plan

if TYPE_CHECKING:
    import torch


@dataclass
class ConsolidateResult:
    source: str
    tag: str
    out: str
    dtype: str
    files: list[str]
    copied: list[str]
    tensors: int
    parameters: int
    tied: dict[str, str]
    bytes_written: int
    seconds: float
    push: dict | None = None  # zckpt.hub.PushResult.to_dict() with push_to

    def to_dict(self) -> dict:
        return asdict(self)


def consolidate(src: str | Path, out: str | Path, *, dtype: "str | torch.dtype" = "bf16", tag: str | None = None,
                max_shard_size: int | str = "5GB", exclude_frozen: bool = False, overwrite: bool = False,
                quiet: bool = True, workers: int | None = None, push_to: str | None = None) -> ConsolidateResult:
    """Write SRC's weights as an HF-loadable folder OUT (safetensors at ``dtype``, config and tokenizer copied).

    Everything is validated before the first byte is written; OUT appears only when complete. OUT also gets
    ``zckpt.json``: what the checkpoint said about its training (source format, stage, world size, step, ...), which
    ``zckpt push`` puts on the model card. With ``push_to`` (a Hub repo id), the token is checked first and OUT is
    then pushed and verified by :func:`zckpt.hub.push`.
    """
    from tqdm.auto import tqdm

    from .assemble import parse_dtype
    from .integrity import checked, regions_read
    from .outdir import check_output, check_space, staged_output
    from .verify import consolidate_needs
    from .writers import WRITERS

    started = time.perf_counter()
    out = Path(out)
    dtype = parse_dtype(dtype)
    max_shard_size = parse_size(max_shard_size)
    plan = open_plan(src, tag, exclude_frozen=exclude_frozen)
    check_output(out, [Path(src)] + ([Path(plan.model_dir)] if plan.model_dir else []), overwrite)
    _check_config(plan.model_dir)
    check_space(out, consolidate_needs(plan, dtype, workers)[0],
                f"the consolidated model ({dtype or 'as stored'})")
    if push_to is not None:
        from .hub import check_can_push

        check_can_push(push_to)
    writer = WRITERS["hf"]
    with staged_output(out, overwrite) as staging, checked(regions_read(plan)), \
            tqdm(total=writer.total_bytes(plan), unit="B", unit_scale=True, unit_divisor=1024, desc="consolidate",
                 disable=quiet) as bar:
        written = writer.write(plan, staging, bar.update, dtype=dtype, max_shard_size=max_shard_size,
                               workers=workers)
        _write_facts(staging, plan, written, dtype)
    result = ConsolidateResult(
        source=plan.source, tag=plan.tag, out=str(out), dtype=dtype or "as stored",
        files=written.files, copied=written.copied, tensors=written.tensors, parameters=written.parameters,
        tied=dict(plan.aliases), bytes_written=written.bytes_written,
        seconds=round(time.perf_counter() - started, 3))
    if push_to is not None:
        result.push = _push(out, push_to, quiet)
    return result


def _write_facts(folder: Path, plan, written, dtype: str | None) -> None:
    from . import __version__
    from .hub import write_facts

    write_facts(folder, {
        "source_format": plan.format, "source_version": plan.version, "zero_stage": plan.stage,
        "world_size": plan.world_size, "train_dtype": plan.train_dtype, "step": plan.step, "tag": plan.tag,
        "dtype": dtype, "parameters": written.parameters, "tensors": written.tensors,
        "tied": dict(plan.aliases), "written_by": f"zckpt {__version__}"})


def _push(out: Path, repo_id: str, quiet: bool) -> dict:
    from .errors import HubError
    from .hub import push

    try:
        return push(out, repo_id, quiet=quiet).to_dict()
    except HubError as exc:  # OUT is complete and stays: say how to retry only the push
        raise type(exc)(f"{exc} (the model is in {out}: push it again with `zckpt push {out} {repo_id}`)") from exc


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units as huggingface_hub; KiB/MiB/GiB binary); ints pass through."""
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(value)
        if not match:
            raise InvalidArgumentError(f"--max-shard-size {value!r} is not a size; use e.g. 5GB, 500MB or 1GiB")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise InvalidArgumentError(f"--max-shard-size must be positive, got {value!r}")
    return size


def _check_config(model_dir: str | None) -> None:
    if model_dir is None:
        return
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise CheckpointCorruptError(f"{path} holds a JSON {type(config).__name__}, not an object; a model config is "
                                     "an object such as {\"model_type\": ...}; fix or remove it")


def iter_state_dict(src: str | Path, dtype: "str | torch.dtype | None" = "fp32", *, tag: str | None = None,
                    exclude_frozen: bool = False, workers: int | None = None
                    ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(name, tensor)`` one at a time, floating tensors cast to ``dtype`` (None: as stored).

    Tied aliases are not yielded; ``zckpt.open_plan(src).aliases`` lists them. The checksums of the bytes read
    (:mod:`zckpt.integrity`) are checked beside the reads and confirmed after the last tensor: a mismatch raises
    :class:`~zckpt.errors.CheckpointCorruptError` at the end of the iteration.
    """
    from .assemble import default_workers, iter_assembled, parse_dtype
    from .integrity import checked, regions_read
    from .tensors import cast, read_tensor

    name = parse_dtype(dtype)
    plan = open_plan(src, tag, exclude_frozen=exclude_frozen)
    with checked(regions_read(plan)):
        for tplan, tensor in iter_assembled(plan.tensors, lambda t, files: cast(read_tensor(t, files), name),
                                            workers=workers or default_workers()):
            yield tplan.name, tensor


def load_state_dict(src: str | Path, dtype: "str | torch.dtype | None" = "fp32", *, tag: str | None = None,
                    exclude_frozen: bool = False) -> dict[str, "torch.Tensor"]:
    """The full state dict (tied aliases share their canonical tensor), like DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` but without DeepSpeed and with a choice of dtype."""
    plan = open_plan(src, tag, exclude_frozen=exclude_frozen)
    state = dict(iter_state_dict(src, dtype, tag=tag, exclude_frozen=exclude_frozen))
    for alias, canonical in plan.aliases.items():
        state[alias] = state[canonical]
    return state
