"""The ``zckpt`` command: thin typer commands over the library; errors become one line in one place.

Only typer is imported at start-up; each command imports what it needs, so ``--help`` and metadata-only commands
answer quickly (torch is imported by the commands that do tensor math).
"""

from __future__ import annotations

import json
import sys
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
) -> None:
    """Consolidate a sharded ZeRO checkpoint into an HF-loadable safetensors folder (bf16 by default)."""
    from ..api import consolidate as run

    result = run(src, out, dtype=dtype, tag=tag, max_shard_size=max_shard_size,
                 exclude_frozen=exclude_frozen, overwrite=overwrite, quiet=quiet or as_json, workers=workers,
                 push_to=push_to)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    from ..report import human_bytes

    tied = ", ".join(f"{a} -> {c}" for a, c in result.tied.items()) or "none"
    print(f"wrote {result.out}: {result.tensors} tensors, {result.parameters:,} parameters, {result.dtype}, "
          f"{human_bytes(result.bytes_written)} in {len(result.files)} file(s) [{result.seconds:.2f}s]")
    print(f"  from {result.source} (tag {result.tag}); tied, written once: {tied}")
    if result.copied:
        print(f"  copied: {', '.join(result.copied)}")
    if result.push is not None:
        from ..hub import PushResult, render

        print("\n".join(render(PushResult(**result.push))))


@app.command(epilog="Examples:\n\n\b\n  zckpt reshard ckpts/ ckpts-ws8/ --world-size 8\n"
                    "  zckpt reshard out/checkpoint-500 resume-ws4/ --world-size 4 --stage 3\n"
                    "  zckpt reshard ckpts/ resume/ --world-size 16 --config ds_config.json --json\n"
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
    format: Annotated[str, typer.Option("--format", help="engine|universal|deepspeed. engine: an engine checkpoint; deepspeed: a plain DeepSpeed ZeRO "
                                             "checkpoint that DeepSpeed's load_checkpoint resumes at --world-size; "
                                             "universal: a DeepSpeed universal checkpoint.")] = "engine",
    overwrite: OverwriteOpt = False,
    workers: _workers_opt("Writer threads (default: 8, or the CPU count if higher).") = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Lay a checkpoint's full training state out for another world size (and ZeRO stage): an engine checkpoint
    that engine.load_checkpoint resumes at --world-size ranks (fp32 masters, optimizer state, scheduler, counters),
    or with --format deepspeed a plain DeepSpeed ZeRO checkpoint that DeepSpeed's load_checkpoint resumes."""
    from ..reshard import reshard as run

    result = run(src, out, world_size=world_size, stage=stage, reduce_bucket_size=reduce_bucket_size,
                 config=config, tag=tag, overwrite=overwrite, quiet=quiet or as_json, workers=workers, format=format)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    from ..report import human_bytes

    print(f"wrote {result.out}: tag {result.tag}, {result.parameters:,} trainable parameters with "
          f"{', '.join(result.state_keys)}; {human_bytes(result.bytes_written)} in {len(result.files)} file(s) "
          f"[{result.seconds:.2f}s]")
    print(f"  from {result.source} ({result.source_format}): world size {result.from_world_size} -> "
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
    print(json.dumps(result.to_dict(), indent=2) if as_json else "\n".join(render(result)))


@app.command(epilog="Examples:\n\n\b\n  zckpt inspect ckpts/\n  zckpt inspect out/checkpoint-500 --json")
def inspect(src: SrcArg, tag: TagOpt = None, as_json: JsonOpt = False) -> None:
    """Describe a checkpoint: format, ZeRO stage, world size, dtype, step, parameter counts, files."""
    from ..report import inspect as run, render

    report = run(src, tag)
    print(json.dumps(report, indent=2) if as_json else render(report))
    if report["problem"]:
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
    """Run the CLI; library errors become ``error: <one line>`` and exit code 2 (``--debug`` re-raises)."""
    from ..errors import ZckptError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:  # accepted anywhere on the line, not only before the command
        args = ["--debug"] + [a for a in args if a != "--debug"]
    try:
        app(args=args, prog_name="zckpt")
    except ZckptError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted; no output was left behind", file=sys.stderr)
        sys.exit(130)
