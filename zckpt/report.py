"""``zckpt inspect``: what a checkpoint is, from metadata alone (no tensor bytes, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import SourceNotFoundError, ZckptError
from .readers import locate, read_plan


def inspect(src: str | Path, tag: str | None = None) -> dict[str, Any]:
    """A JSON-able report. Problems with the checkpoint's files are reported in ``problem``, not raised,
    so the files present are still listed; an unrecognisable SRC raises."""
    located = locate(src, tag)
    report: dict[str, Any] = {"source": str(located.src), "source_kind": located.kind, "tag": located.tag,
                              "tag_dir": str(located.tag_dir), "model_dir": _str(located.model_dir),
                              "problem": None}
    try:
        plan = read_plan(located)
        for tensor in plan.tensors:
            tensor.validate()
    except (ZckptError, ValueError) as exc:
        if isinstance(exc, SourceNotFoundError):
            raise
        report["problem"] = str(exc)
        report["files"] = [{"path": str(p), "bytes": p.stat().st_size} for p in sorted(located.tag_dir.iterdir())
                           if p.is_file()]
        report["bytes_on_disk"] = sum(f["bytes"] for f in report["files"])
        return report
    report.update({
        "format": plan.format, "writer_version": plan.version, "zero_stage": plan.stage,
        "world_size": plan.world_size, "train_dtype": plan.train_dtype, "step": plan.step,
        "parameters": {"trainable": plan.count("param"), "frozen": plan.count("frozen"),
                       "tied": {a: c for a, c in plan.aliases.items()}},
        "buffers": plan.count("buffer"), "tensors": len(plan.tensors),
        "files": [{"path": f.path, "role": f.role, "rank": f.rank, "bytes": f.size} for f in plan.files],
        "training_state": _training(plan),
    })
    report["missing"] = [f["path"] for f in report["files"] if f["bytes"] is None]
    report["bytes_on_disk"] = sum(f["bytes"] or 0 for f in report["files"])
    return report


def _training(plan) -> dict[str, Any] | None:
    """What the checkpoint holds besides the weights (metadata only: scalars such as Adam's step are not read)."""
    training = plan.training
    if training is None:
        return None
    return {
        "optimizer": training.optimizer, "state_keys": list(training.state_keys),
        "groups": [{"index": g.index, "hparams": g.hparams, "scalars": [s.name for s in g.scalars]}
                   for g in training.groups],
        "scheduler": training.scheduler, "loss_scaler": training.loss_scaler, "counters": training.counters,
        "client_state_keys": sorted(training.client_state), "resumable": training.has_optimizer_state,
    }


def _training_rows(training: dict[str, Any] | None) -> list[tuple[str, str]]:
    if training is None:
        return [("training", "none: weights only, no optimizer state")]
    groups = "; ".join(f"{g['index']}: " + ", ".join(f"{k}={v}" for k, v in g["hparams"].items()
                                                       if k in ("lr", "weight_decay", "betas", "eps"))
                       for g in training["groups"])
    scaler = training["loss_scaler"]
    return [
        ("optimizer", f"{training['optimizer']}, state per parameter: {', '.join(training['state_keys']) or 'none'}"),
        ("groups", groups or "none"),
        ("scheduler", "none" if training["scheduler"] is None else
         str(training["scheduler"].get("type", training["scheduler"]))[:100]),
        ("loss scaler", "none" if scaler is None else f"{scaler.get('type', '?')}, scale {scaler.get('cur_scale')}"),
        ("counters", ", ".join(f"{k} {v}" for k, v in training["counters"].items()) or "none"),
        ("client keys", ", ".join(training["client_state_keys"]) or "none"),
    ]


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def render(report: dict[str, Any]) -> str:
    rows = [("source", f"{report['source']} ({report['source_kind']})"), ("tag", report["tag"])]
    if report.get("model_dir"):
        rows.append(("model files", report["model_dir"]))
    if "format" in report:
        params = report["parameters"]
        tied = ", ".join(f"{a} -> {c}" for a, c in params["tied"].items())
        rows += [
            ("format", f"{report['format']} {report['writer_version'] or ''}".strip()),
            ("step", str(report["step"])),
            ("zero stage", str(report["zero_stage"])),
            ("world size", str(report["world_size"])),
            ("train dtype", report["train_dtype"]),
            ("parameters", f"{params['trainable']:,} trainable, {params['frozen']:,} frozen, "
                           f"{len(params['tied'])} tied" + (f" ({tied})" if tied else "")),
            ("buffers", f"{report['buffers']:,} elements"),
            ("tensors", str(report["tensors"])),
        ] + _training_rows(report.get("training_state"))
    rows.append(("on disk", f"{human_bytes(report['bytes_on_disk'])} in {len(report['files'])} files"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("files:")
    for f in report["files"]:
        size = "MISSING" if f["bytes"] is None else human_bytes(f["bytes"])
        lines.append(f"  {size:>10}  {Path(f['path']).name}")
    if report["problem"]:
        lines.append(f"problem: {report['problem']}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
