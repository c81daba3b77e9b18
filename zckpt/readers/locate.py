"""Resolve what the user pointed at (SRC) to one checkpoint tag folder. Format-agnostic, no tensor I/O.

SRC may be:

* a tag folder itself (``global_step500/``) — holds ``*_model_states.pt`` (DeepSpeed) or ``manifest.json`` (engine);
* a save dir whose ``latest`` names the tag (or ``--tag``; a DeepSpeed universal save dir without ``latest``: its
  ``latest_universal``);
* an HF Trainer ``checkpoint-N/`` folder, which is a save dir plus ``config.json`` and tokenizer files;
* an HF Trainer output dir holding ``checkpoint-N/`` folders: the newest complete one is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine import checkpoint_format as spec

from ..errors import CheckpointIncompleteError, InvalidArgumentError, SourceNotFoundError

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Located:
    src: Path
    tag_dir: Path
    tag: str
    kind: str  # "tag-dir" | "save-dir" | "hf-checkpoint" | "hf-output-dir"
    model_dir: Path | None  # where config.json / tokenizer files sit, if anywhere


def is_tag_dir(path: Path) -> bool:
    """A folder holding one saved checkpoint: some registered reader claims it."""
    from . import reader_for

    return reader_for(path) is not None


def _model_dir(*candidates: Path) -> Path | None:
    for cand in candidates:
        if (cand / "config.json").is_file():
            return cand
    return None


def read_latest(save_dir: Path) -> str:
    """The tag named by ``save_dir/latest``, validated (the engine format's rules, which DeepSpeed's tags meet)."""
    try:
        tag = spec.read_latest(save_dir)
    except spec.IncompleteError:
        raise CheckpointIncompleteError(f"{save_dir / 'latest'} is empty (an interrupted save?); pass --tag with one "
                                        f"of: {_list_tags(save_dir)}") from None
    except spec.FormatError as exc:
        raise CheckpointIncompleteError(f"{exc} (--tag)") from None
    if tag is None:
        raise SourceNotFoundError(f"{save_dir} has no 'latest' file; pass --tag with one of: {_list_tags(save_dir)}")
    return tag


def _list_tags(save_dir: Path) -> str:
    tags = sorted(p.name for p in save_dir.iterdir() if is_tag_dir(p))
    return ", ".join(tags) if tags else "(no tag folders found)"


def _read_latest_universal(save_dir: Path) -> str:
    """The tag named by ``latest_universal`` (what DeepSpeed's ``ds_to_universal`` writes beside its output)."""
    path = save_dir / "latest_universal"
    tag = path.read_bytes()[:4096].decode("utf-8", errors="replace").strip()
    try:
        spec.check_tag(tag)
    except spec.FormatError:
        raise CheckpointIncompleteError(f"{path} names no valid tag ({tag[:80]!r}); pass --tag with one of: "
                                        f"{_list_tags(save_dir)}") from None
    return tag


def _locate_in_save_dir(save_dir: Path, tag: str | None, kind: str) -> Located:
    if tag is None and not (save_dir / "latest").is_file() and (save_dir / "latest_universal").is_file():
        tag = _read_latest_universal(save_dir)  # a universal save dir: DeepSpeed reads this file then
        origin = f"{save_dir / 'latest_universal'} names tag {tag!r}"
    elif tag is None:
        if not (save_dir / "latest").is_file():
            raise SourceNotFoundError(
                f"{save_dir} has no 'latest' file; pass --tag with one of: {_list_tags(save_dir)}")
        tag = read_latest(save_dir)
        origin = f"{save_dir / 'latest'} names tag {tag!r}"
    else:
        origin = f"--tag {tag!r}"
    tag_dir = save_dir / tag
    if not tag_dir.is_dir():
        raise CheckpointIncompleteError(
            f"{origin} but {tag_dir} does not exist; pass --tag with one of: {_list_tags(save_dir)}")
    if not is_tag_dir(tag_dir):
        from . import markers

        raise CheckpointIncompleteError(f"{tag_dir} holds no checkpoint files (no {markers()})")
    return Located(save_dir, tag_dir, tag, kind, _model_dir(save_dir))


def _checkpoint_folders(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def _is_complete_save_dir(path: Path) -> bool:
    try:
        _locate_in_save_dir(path, None, "hf-checkpoint")
        return True
    except (SourceNotFoundError, CheckpointIncompleteError):
        return False


def locate(src: str | Path, tag: str | None = None) -> Located:
    """Find the tag folder SRC refers to, or raise a one-line error saying what SRC should look like."""
    src = Path(src)
    if not src.exists():
        raise SourceNotFoundError(f"{src} does not exist")
    if not src.is_dir():
        raise SourceNotFoundError(f"{src} is a file; pass the checkpoint folder (the one holding 'latest' or "
                                  "global_step*/)")
    if is_tag_dir(src):
        if tag is not None and tag != src.name:
            raise InvalidArgumentError(f"{src} is already a tag folder; drop --tag {tag!r} or pass its parent")
        return Located(src, src, src.name, "tag-dir", _model_dir(src.parent, src))
    if tag is not None and _CHECKPOINT_RE.match(tag) and (src / tag).is_dir():  # --tag checkpoint-500 on a run dir
        found = _locate_in_save_dir(src / tag, None, "hf-output-dir")
        return Located(src, found.tag_dir, found.tag, "hf-output-dir", found.model_dir)
    if (src / "latest").is_file() or tag is not None or any(is_tag_dir(p) for p in src.iterdir()):
        return _locate_in_save_dir(src, tag, "hf-checkpoint" if _model_dir(src) else "save-dir")
    checkpoints = _checkpoint_folders(src)
    if checkpoints:
        for _step, folder in checkpoints:
            if _is_complete_save_dir(folder):
                found = _locate_in_save_dir(folder, None, "hf-output-dir")
                return Located(src, found.tag_dir, found.tag, "hf-output-dir", found.model_dir)
        names = ", ".join(p.name for _, p in checkpoints)
        raise CheckpointIncompleteError(f"{src} holds {names} but none is a complete checkpoint "
                                        "(each lacks 'latest' or its tag folder)")
    raise SourceNotFoundError(
        f"{src} is not a checkpoint: expected a 'latest' file, a global_step*/ folder, *_model_states.pt files, "
        "or checkpoint-N/ folders")
