"""The ``zckpt`` command: thin typer commands over the library; errors become one line in one place.

Only typer is imported at start-up; each command imports what it needs, so ``--help`` and metadata-only commands
answer quickly (torch is imported by the commands that do tensor math).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="zckpt",
    help="ZeRO checkpoints made usable: inspect DeepSpeed / engine checkpoints, consolidate them into "
         "Hugging Face safetensors, reshard them for another world size.\n\nExamples:\n\n\b\n"
         "  zckpt consolidate output/checkpoint-500 model-bf16/\n  zckpt reshard output/checkpoint-500 ws8/ "
         "--world-size 8",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: rich's import alone costs ~0.3 s, and --help must answer fast
)

# Shared option types (style habit 5).
SrcArg = Annotated[Path, typer.Argument(help="Checkpoint: DeepSpeed save dir, tag folder, HF checkpoint-N/ or "
                                             "HF Trainer output dir.", show_default=False)]
TagOpt = Annotated[Optional[str], typer.Option("--tag", help="Tag folder to read (default: named by 'latest').")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")]


BestOpt = Annotated[bool, typer.Option("--best", help="SRC is a run folder: use its best checkpoint (as `zckpt "
                                                       "best SRC` picks it).")]
RunArg = Annotated[Path, typer.Argument(help="Run folder holding checkpoint-N/ folders (HF Trainer output_dir or "
                                             "a CheckpointManager run_dir).", show_default=False)]
MetricOpt = Annotated[Optional[str], typer.Option("--metric", help="Metric deciding the best checkpoint, e.g. "
                                                                   "eval_loss (default: the run's, from "
                                                                   "trainer_state.json; else eval_loss).")]
DirectionOpt = Annotated[Optional[bool], typer.Option("--higher-is-better/--lower-is-better",
                                                      help="Direction of --metric (default: the run's; else lower "
                                                           "for names ending in 'loss').", show_default=False)]


def _best_or(src: Path, best: bool, tag: Optional[str]) -> Path:
    if not best:
        return src
    from ..errors import InvalidArgumentError
    from ..registry import require_best, scan

    if tag is not None:
        raise InvalidArgumentError(f"--best picks the checkpoint folder itself; drop --tag {tag!r}")
    best = require_best(scan(src))
    if best.kind == "weights":
        raise InvalidArgumentError(f"the best checkpoint {best.path} holds model weights only (save_only_model): it "
                                   f"is already an HF model folder; load it with from_pretrained")
    return best.path


def _say(text: str) -> None:
    """Print a command's report: each line made printable (names and values quoted from a checkpoint may hold
    control characters; JSON output escapes them itself)."""
    from ..errors import printable

    print("\n".join(printable(line, 10**6) for line in text.split("\n")))


class ReshardFormat(str, Enum):
    """``zckpt reshard --format``: which writer lays the checkpoint out."""

    engine = "engine"
    universal = "universal"
    deepspeed = "deepspeed"


def _out_arg(what: str):
    return Annotated[Path, typer.Argument(help=f"{what} (must not exist or be empty, unless --overwrite).",
                                          show_default=False)]


def _workers_opt(help: str):
    return Annotated[Optional[int], typer.Option("--workers", help=help)]


@app.callback()
def _root(debug: DebugOpt = False) -> None:
    """Global options."""


@app.command(epilog="Examples:\n\n\b\n  zckpt consolidate ckpts/ model-bf16/\n"
                    "  zckpt consolidate out/checkpoint-500 hf-model/ --dtype fp16 --max-shard-size 2GB\n"
                    "  zckpt consolidate ckpts/global_step100 fp32/ --dtype fp32 --json")
def consolidate(
    src: SrcArg,
    out: _out_arg("Output folder"),
    dtype: Annotated[str, typer.Option("--dtype", help="Output dtype of floating tensors: bf16, fp16 or fp32.")]
    = "bf16",
    tag: TagOpt = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest output shard, e.g. 5GB, 500MB.")]
    = "5GB",
    exclude_frozen: Annotated[bool, typer.Option("--exclude-frozen", help="Drop frozen (requires_grad=False) "
                                                                          "parameters.")] = False,
    overwrite: OverwriteOpt = False,
    workers: _workers_opt("Reader threads (default: by CPU count).") = None,
    push_to: Annotated[Optional[str], typer.Option("--push-to", help="Then push OUT to this Hub repository and "
                                                                    "verify it, as `zckpt push OUT REPO_ID`.")]
    = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
    best: BestOpt = False,
) -> None:
    """Consolidate a sharded ZeRO checkpoint into an HF-loadable safetensors folder (bf16 by default)."""
    from ..api import consolidate as run

    result = run(_best_or(src, best, tag), out, dtype=dtype, tag=tag, max_shard_size=max_shard_size,
                 exclude_frozen=exclude_frozen, overwrite=overwrite, quiet=quiet or as_json, workers=workers,
                 push_to=push_to)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    from ..report import human_bytes

    tied = ", ".join(f"{a} -> {c}" for a, c in result.tied.items()) or "none"
    _say(f"wrote {result.out}: {result.tensors} tensors, {result.parameters:,} parameters, {result.dtype}, "
          f"{human_bytes(result.bytes_written)} in {len(result.files)} file(s) [{result.seconds:.2f}s]")
    _say(f"  from {result.source} (tag {result.tag}); tied, written once: {tied}")
    if result.copied:
        _say(f"  copied: {', '.join(result.copied)}")
    if result.push is not None:
        from ..hub import PushResult, render

        _say("\n".join(render(PushResult(**result.push))))


@app.command(epilog="Examples:\n\n\b\n  zckpt reshard ckpts/ ckpts-ws8/ --world-size 8\n"
                    "  zckpt reshard out/checkpoint-500 resume-ws4/ --world-size 4 --stage 3\n"
                    "  zckpt reshard ckpts/ resume/ --world-size 16 --config ds_config.json --json\n"
                    "  zckpt reshard out/checkpoint-500 uni/ --world-size 8 --format universal\n"
                    "  zckpt reshard ckpts/ ds-ws4/ --world-size 4 --format deepspeed")
def reshard(
    src: SrcArg,
    out: _out_arg("Output save dir"),
    world_size: Annotated[int, typer.Option("--world-size", "-n", help="Number of ranks that will resume from OUT.",
                                            show_default=False)],
    stage: Annotated[Optional[int], typer.Option("--stage", help="ZeRO stage of the resuming run (default: "
                                                                 "--config's, else the source's).")] = None,
    reduce_bucket_size: Annotated[Optional[int], typer.Option(
        "--reduce-bucket-size", help="Stage 0-2 bucket size of the resuming run (default: --config's, else the "
                                     "source's, else 5e8).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="ds_config JSON of the run that will load OUT "
                                                                    "(its zero_optimization stage and buckets).")]
    = None,
    tag: TagOpt = None,
    format: Annotated[ReshardFormat, typer.Option(
        "--format", case_sensitive=False, help="engine: an engine checkpoint; universal: DeepSpeed's universal "
                                               "checkpoint (load_universal); deepspeed: a native DeepSpeed ZeRO "
                                               "checkpoint for --world-size ranks.")] = ReshardFormat.engine,
    overwrite: OverwriteOpt = False,
    workers: _workers_opt("Writer threads (default: 8, or the CPU count if higher).") = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
    best: BestOpt = False,
) -> None:
    """Lay a checkpoint's full training state out for another world size (and ZeRO stage): an engine checkpoint
    that engine.load_checkpoint resumes at --world-size ranks (fp32 masters, optimizer state, scheduler, counters),
    or, with --format, one that DeepSpeed resumes from."""
    from ..reshard import reshard as run

    result = run(_best_or(src, best, tag), out, world_size=world_size, stage=stage,
                 reduce_bucket_size=reduce_bucket_size, config=config, tag=tag, overwrite=overwrite,
                 quiet=quiet or as_json, workers=workers,
                 format=format.value)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    from ..report import human_bytes

    _say(f"wrote {result.out}: tag {result.tag}, {result.parameters:,} trainable parameters with "
          f"{', '.join(result.state_keys)}; {human_bytes(result.bytes_written)} in {len(result.files)} file(s) "
          f"[{result.seconds:.2f}s]")
    if result.format == "universal":
        _say(f"  from {result.source} ({result.source_format}, world size {result.from_world_size}, ZeRO stage "
              f"{result.from_stage}); DeepSpeed resumes it at any world size and stage with "
              '"checkpoint": {"load_universal": true}')
        return
    _say(f"  from {result.source} ({result.source_format}): world size {result.from_world_size} -> "
          f"{result.to_world_size}, ZeRO stage {result.from_stage} -> {result.to_stage}")


@app.command(epilog="Examples:\n\n\b\n  zckpt push model-bf16/ user/my-model --dry-run\n"
                    "  zckpt push model-bf16/ user/my-model --private\n"
                    "  zckpt push model-bf16/ org/my-model --revision step-500 --create-pr --json")
def push(
    folder: Annotated[Path, typer.Argument(help="Consolidated model folder (OUT of zckpt consolidate).",
                                           show_default=False)],
    repo_id: Annotated[str, typer.Argument(help="Hub repository, e.g. user/model (created if missing).",
                                           show_default=False)],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch to push to (created if missing; "
                                                                       "default main).")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit title.")] = None,
    create_pr: Annotated[bool, typer.Option("--create-pr", help="Open a pull request instead of committing to "
                                                                "the branch.")] = False,
    token: Annotated[Optional[str], typer.Option("--token", help="Hub token (default: HF_TOKEN, then the stored "
                                                                 "login).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be pushed; touch nothing remote.")]
    = False,
    overwrite_card: Annotated[bool, typer.Option("--overwrite-card", help="Replace the repository's README.md "
                                                                          "with this folder's card.")] = False,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Push a consolidated model to the Hugging Face Hub: allowlisted files only, a model card, verified commit."""
    from ..hub import push as run, render

    result = run(folder, repo_id, private=private, revision=revision, commit_message=commit_message,
                 create_pr=create_pr, token=token, dry_run=dry_run, overwrite_card=overwrite_card,
                 quiet=quiet or as_json)
    _say(json.dumps(result.to_dict(), indent=2) if as_json else "\n".join(render(result)))


@app.command(epilog="Examples:\n\n\b\n  zckpt inspect ckpts/\n  zckpt inspect out/checkpoint-500 --json")
def inspect(src: SrcArg, tag: TagOpt = None, as_json: JsonOpt = False) -> None:
    """Describe a checkpoint: format, ZeRO stage, world size, dtype, step, parameter counts, files."""
    from ..report import inspect as run, render

    report = run(src, tag)
    _say(json.dumps(report, indent=2) if as_json else render(report))
    if report["problem"]:
        raise typer.Exit(2)


@app.command(name="list", epilog="Examples:\n\n\b\n  zckpt list output/\n  zckpt list output/ --metric "
                                 "accuracy --json")
def list_(run_dir: RunArg, metric: MetricOpt = None, greater_is_better: DirectionOpt = None,
          as_json: JsonOpt = False) -> None:
    """Table of a run's checkpoint-N/ folders: step, metrics, size, complete or not; best and latest marked."""
    from ..registry import render_run, scan

    run = scan(run_dir, metric, greater_is_better)
    print(json.dumps(run.to_dict(), indent=2) if as_json else render_run(run))


@app.command(epilog="Examples:\n\n\b\n  zckpt best output/\n  zckpt consolidate $(zckpt best output/) model/\n"
                    "  zckpt best output/ --metric accuracy --higher-is-better")
def best(run_dir: RunArg, metric: MetricOpt = None, greater_is_better: DirectionOpt = None) -> None:
    """Print the path of a run's best checkpoint folder (and nothing else)."""
    from ..registry import best_path

    print(best_path(run_dir, metric, greater_is_better))


@app.command(epilog="Examples:\n\n\b\n  zckpt prune output/ --keep 2 --dry-run\n  zckpt prune output/ --keep 1 --yes")
def prune(
    run_dir: RunArg,
    keep: Annotated[int, typer.Option("--keep", help="Complete checkpoints to keep (save_total_limit); the newest "
                                                     "and the best are always kept.", show_default=False)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    metric: MetricOpt = None,
    greater_is_better: DirectionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete old checkpoints by Transformers' save_total_limit rules: keeps the newest and the best; never touches
    incomplete or unrecognised folders."""
    from ..errors import InvalidArgumentError
    from ..registry import apply_rotation, plan_rotation, render_plan, scan

    plan = plan_rotation(scan(run_dir, metric, greater_is_better), keep)
    if not as_json:
        print(render_plan(plan))
    if dry_run or not plan.delete:
        if as_json:
            print(json.dumps({**plan.to_dict(), "deleted": []}, indent=2))
        return
    if not yes:
        if as_json or not sys.stdin.isatty():
            raise InvalidArgumentError("prune deletes checkpoints: pass --yes to confirm (or --dry-run to look)")
        if not typer.confirm(f"delete {len(plan.delete)} checkpoint(s)?"):
            raise typer.Exit(1)
    deleted = apply_rotation(plan)
    if as_json:
        print(json.dumps({**plan.to_dict(), "deleted": [str(p) for p in deleted]}, indent=2))
    else:
        print(f"deleted {len(deleted)} checkpoint(s)")


@app.command(epilog="Examples:\n\n\b\n  zckpt verify ckpts/\n  zckpt verify out/ --deep\n"
                    "  zckpt verify ckpts/ --tag global_step100 --json")
def verify(
    src: SrcArg,
    tag: TagOpt = None,
    deep: Annotated[bool, typer.Option("--deep", help="Check every checksum the checkpoint records, not only "
                                                      "those of the weights and optimizer state.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check that a checkpoint is usable: files present and consistent across ranks, latest / COMMITTED, headers,
    fragment maps, sha256 / CRC-32; estimate the disk and RAM consolidate / reshard need. Exit 0 only if usable."""
    from ..verify import render, verify as run

    report = run(src, tag, deep=deep)
    _say(json.dumps(report.to_dict(), indent=2) if as_json else render(report))
    if not report.usable:
        raise typer.Exit(2)


@app.command(epilog="Example:\n\n  zckpt demo")
def demo(
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write the model (default: a temp dir).")]
    = None,
) -> None:
    """Train a tiny LM with the engine (ZeRO-3, 2 CPU ranks), consolidate and load it; then a real DeepSpeed one."""
    from ..demo import run

    run(out)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. Every failure ends here as one line on stderr, ``error: <file>: <cause>; <fix>``, and exit 2:
    library errors (:class:`~zckpt.errors.ZckptError`), OS errors (permissions, disk full, read-only, ...) and
    usage errors; Ctrl-C / SIGTERM / SIGHUP exit 128 + the signal (130 for Ctrl-C) with a message. ``--debug``
    re-raises with the traceback. Anything else is a bug: one line saying so, exit 1 (``--debug`` for details)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, not only before the command
        args = ["--debug"] + [a for a in args if a != "--debug"]
    sys.exit(_run(args, debug))


def _run(args: list[str], debug: bool) -> int:
    try:  # typer >= 0.2x vendors click; its exceptions are not click's
        from typer._click.exceptions import ClickException
    except ImportError:  # pragma: no cover
        from click import ClickException

    from ..errors import ZckptError, describe_os_error, printable

    interrupted = "interrupted (Ctrl-C); no output was left behind"
    try:
        result = app(args=args, prog_name="zckpt", standalone_mode=False)
        if result == 130:  # typer turns KeyboardInterrupt into a silent exit code 130
            return _fail(interrupted, 130)
        return result if isinstance(result, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except ClickException as exc:  # usage errors: click's own message, exit 2
        exc.show()
        return exc.exit_code
    except typer.Abort as exc:  # typer turns EOFError into Abort ("Aborted!")
        if debug:
            raise
        cause = exc.__cause__
        return _fail(f"internal error ({type(cause).__name__}: {printable(cause, 300)}); rerun with --debug and "
                     "report the traceback" if cause is not None else interrupted, 1 if cause is not None else 130)
    except ZckptError as exc:
        if debug:
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        return _fail(interrupted, 130)
    except OSError as exc:
        if debug:
            raise
        return _fail(describe_os_error(exc), 2)
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback with --debug
        if debug:
            raise
        return _fail(f"internal error ({type(exc).__name__}: {printable(exc, 300)}); rerun with --debug and "
                     "report the traceback", 1)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
