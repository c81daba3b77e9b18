"""``zckpt verify``: is this checkpoint usable? Every check zckpt knows, a report, and what converting it will need.

For each checkpoint SRC holds (a tag folder; a save dir -> the tag ``latest`` names, or ``--tag``; an HF Trainer
output dir -> every ``checkpoint-N/``):

1. **located**: ``latest`` is a small regular file naming a plain tag whose folder exists (``read_latest``);
2. **committed / complete**: the engine's ``COMMITTED`` marker; every rank's files present and readable (DeepSpeed:
   every optimizer shard and model-states file the world size needs);
3. **structure**: manifest / pickles / safetensors headers parse and agree (keys, dtypes, extents), the ranks agree
   (stage, world size, partition sizes, step, COMMITTED's tag), and the fragment map covers every element of every
   parameter and optimizer state exactly once, no two fragments sharing a byte;
4. **checksums**: the sha256 (engine) / zip CRC-32 (DeepSpeed) of every region holding the weights or the
   optimizer state -- what consolidate, reshard and a resume read; with ``--deep``, every checksum the checkpoint
   records (e.g. DeepSpeed's 16-bit module copy in the model-states files).

Exit 0 only when every checkpoint checked is usable. The report also estimates the disk and memory that
``consolidate`` (bf16) and ``reshard`` (same world size) need; both commands refuse early when OUT's disk lacks it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ZckptError
from .plan import DTYPE_SIZES, CheckpointPlan

#: measured (docs/benchmarks.md): both commands stream through fixed buffers, flat in model size
_BASE_RAM = 60 * 2**20
_CHUNK = 16 * 2**20


def consolidate_needs(plan: CheckpointPlan, dtype: str | None = "bfloat16", workers: int | None = None
                      ) -> tuple[int, int]:
    """(bytes of disk, bytes of RAM) that consolidating ``plan`` at ``dtype`` needs: the output's tensor bytes plus
    headers and the copied config/tokenizer files; RAM per reader thread for the raw, cast and scratch chunks."""
    from .assemble import default_workers
    from .cast import output_dtype

    disk = sum(t.numel * DTYPE_SIZES[output_dtype(t, dtype)] + 256 + len(t.name) for t in plan.tensors)
    if plan.model_dir:
        disk += sum(p.stat().st_size for p in Path(plan.model_dir).iterdir() if p.is_file()
                    and p.stat().st_size < 2**30)
    return disk + 2**20, _BASE_RAM + (workers or default_workers()) * int(2.5 * _CHUNK)


def reshard_needs(plan: CheckpointPlan, table=None, workers: int = 8) -> tuple[int, int]:
    """(bytes of disk, bytes of RAM) that resharding ``plan`` needs: every rank's padded fp32 partition of the
    weights and of each optimizer state tensor, frozen parameters and buffers; RAM one chunk per writer thread."""
    training = plan.training
    states = len(training.state_keys) if training is not None else 0
    if table is not None:
        flat = sum(table.group_partition_numel) * table.world_size
    else:
        flat = sum(t.numel for t in plan.trainable())
    disk = flat * 4 * (1 + states) + sum(t.nbytes for t in plan.tensors if t.kind != "param")
    return disk + 2**20, _BASE_RAM + workers * _CHUNK


@dataclass
class CheckpointReport:
    source: str
    tag: str | None = None
    tag_dir: str | None = None
    format: str | None = None
    stage: int | None = None
    world_size: int | None = None
    step: int | None = None
    #: the checkpoint consolidate / reshard / a resume would use (in an HF output dir: the newest complete one)
    selected: bool = True
    passed: list[str] = field(default_factory=list)
    problem: str | None = None
    needs: dict[str, int] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.problem is None


@dataclass
class VerifyReport:
    source: str
    deep: bool
    checkpoints: list[CheckpointReport]
    seconds: float = 0.0

    @property
    def usable(self) -> bool:
        """The checkpoint that the commands would use passed every check (other checkpoint-N are reported)."""
        chosen = [c for c in self.checkpoints if c.selected]
        return bool(chosen) and all(c.usable for c in chosen)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "deep": self.deep, "usable": self.usable, "seconds": self.seconds,
                "checkpoints": [{**asdict(c), "usable": c.usable} for c in self.checkpoints]}


def _targets(src: Path, tag: str | None) -> list[tuple[Path, str | None]]:
    """(SRC to locate, tag) per checkpoint to check: each checkpoint-N/ of an HF Trainer output dir, else SRC."""
    from .readers.locate import _checkpoint_folders, is_tag_dir

    if tag is None and src.is_dir() and not is_tag_dir(src) and not (src / "latest").exists():
        found = _checkpoint_folders(src)
        if found:
            return [(folder, None) for _, folder in sorted(found)]
    return [(src, tag)]


def verify_one(src: Path, tag: str | None, deep: bool) -> CheckpointReport:
    from .integrity import regions_read, verify_regions
    from .readers import locate, read_plan

    report = CheckpointReport(source=str(src))
    try:
        located = locate(src, tag)
        report.tag, report.tag_dir = located.tag, str(located.tag_dir)
        report.passed.append(f"located: tag {located.tag} ({located.kind})")
        plan = read_plan(located)
        report.format, report.stage, report.world_size, report.step = (plan.format, plan.stage, plan.world_size,
                                                                       plan.step)
        present = sum(f.size or 0 for f in plan.files)
        report.passed.append(f"complete: {len(plan.files)} files present and readable ({present:,} bytes)"
                             + (", COMMITTED" if plan.format == "engine" else ""))
        _check_structure(plan)
        report.passed.append(f"structure: {len(plan.tensors)} tensors; the ranks agree (stage {plan.stage}, world "
                             f"size {plan.world_size}); fragments cover every element exactly once, no shared bytes")
        regions = regions_read(plan, with_state=True, deep=deep)
        checked = verify_regions(regions)
        kinds = sorted({c.algo for _, c in regions})
        report.passed.append(f"checksums: {len(regions)} regions, {checked:,} bytes, {'/'.join(kinds) or 'none'} "
                             f"match ({'every recorded checksum' if deep else 'weights and optimizer state'})")
        disk, ram = consolidate_needs(plan)
        report.needs = {"consolidate_disk": disk, "consolidate_ram": ram}
        if plan.training is not None and plan.training.has_optimizer_state:
            disk, ram = reshard_needs(plan)
            report.needs.update(reshard_disk=disk, reshard_ram=ram)
    except ZckptError as exc:
        report.problem = str(exc)
    except OSError as exc:
        from .errors import source_os_error

        report.problem = str(source_os_error(exc))
    return report


def _check_structure(plan: CheckpointPlan) -> None:
    from .errors import CheckpointCorruptError
    from .integrity import check_disjoint

    for tensor in plan.tensors:
        try:
            tensor.validate()
        except ValueError as exc:
            raise CheckpointCorruptError(f"{plan.source}: {exc}") from None
    check_disjoint(plan.tensors, plan.source)


def verify(src: str | Path, tag: str | None = None, *, deep: bool = False) -> VerifyReport:
    """Check SRC (every checkpoint-N of an HF Trainer output dir); never raises for a damaged checkpoint: problems
    are in the report. An unrecognisable SRC is reported as a problem too."""
    started = time.perf_counter()
    from .readers import locate

    src = Path(src)
    reports = [verify_one(path, t, deep) for path, t in _targets(src, tag)]
    if len(reports) > 1:
        try:
            chosen = str(locate(src, tag).tag_dir)
        except (ZckptError, OSError):
            chosen = None
        for r in reports:
            r.selected = r.tag_dir is not None and r.tag_dir == chosen
    return VerifyReport(str(src), deep, reports, round(time.perf_counter() - started, 3))


def render(report: VerifyReport) -> str:
    from .report import human_bytes

    lines = []
    for c in report.checkpoints:
        what = f"{c.format} ZeRO-{c.stage}, {c.world_size} rank(s), step {c.step}" if c.format else ""
        mark = "" if len(report.checkpoints) == 1 else (" (selected: the one commands use)" if c.selected else
                                                         " (not selected)")
        lines.append(f"{c.source}" + (f" [tag {c.tag}]" if c.tag else "") + (f": {what}" if what else "") + mark)
        lines += [f"  ok    {p}" for p in c.passed]
        if c.problem:
            lines.append(f"  FAIL  {c.problem}")
        if c.needs:
            text = (f"consolidate (bf16) needs {human_bytes(c.needs['consolidate_disk'])} of disk, "
                    f"~{human_bytes(c.needs['consolidate_ram'])} of RAM")
            if "reshard_disk" in c.needs:
                text += (f"; reshard needs {human_bytes(c.needs['reshard_disk'])} of disk, "
                         f"~{human_bytes(c.needs['reshard_ram'])} of RAM")
            lines.append(f"  needs {text}")
    passed = sum(c.usable for c in report.checkpoints)
    lines.append(f"{'usable' if report.usable else 'NOT usable'}: {passed} of {len(report.checkpoints)} "
                 f"checkpoint(s) passed{' (--deep)' if report.deep else ''} [{report.seconds:.2f}s]")
    return "\n".join(lines)
