"""Resolve what the user pointed at (SRC) to one checkpoint tag folder. Format-agnostic, no tensor I/O.

SRC may be:

* a tag folder itself (``global_step500/``) — holds ``*_model_states.pt`` (DeepSpeed) or ``manifest.json`` (engine);
* a save dir whose ``latest`` names the tag (or ``--tag``; a DeepSpeed universal save dir without ``latest``: its
  ``latest_universal``);
* an HF Trainer ``checkpoint-N/`` folder, which is a save dir plus ``config.json`` and tokenizer files;
* an HF Trainer output dir holding ``checkpoint-N/`` folders: the newest complete one is used.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine import checkpoint_format as spec

from ..errors import (CheckpointCorruptError, CheckpointIncompleteError, InvalidArgumentError, SourceNotFoundError,
                      source_os_error)

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
        config = cand / "config.json"
        if config.is_file():
            return cand
        if config.exists() or config.is_symlink():
            raise CheckpointCorruptError(f"{config} is {_what(config)}, not the model's config file; remove it or "
                                         "replace it with the model's config.json")
    return None


def _what(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a dangling symlink (or a symlink loop)"
    return "a folder" if path.is_dir() else "not a regular file"


def _listable(folder: Path) -> None:
    """Raise :class:`SourceUnreadableError` when ``folder`` cannot be listed (permissions), instead of letting an
    empty listing pass for "no checkpoint files"."""
    try:
        with os.scandir(folder):
            pass
    except OSError as exc:
        raise source_os_error(exc) from None


def _links_outside(latest: Path, save_dir: Path) -> bool:
    return latest.is_symlink() and save_dir.resolve() not in latest.resolve().parents


def _check_latest_file(save_dir: Path) -> None:
    """``latest`` must be a file. One that is a symlink leaving the checkpoint (the Hugging Face cache links every
    file to a blob) is accepted only when it names a tag folder that exists: its content is never quoted, as it may
    be a system file's."""
    latest = save_dir / "latest"
    if _links_outside(latest, save_dir) and latest.is_file():
        try:
            tag = spec.read_latest(save_dir)
        except spec.FormatError:
            tag = None
        if tag is None or not (save_dir / tag).is_dir():
            raise CheckpointCorruptError(f"{latest} is a symlink to a file outside the checkpoint that does not name "
                                         f"one of its tag folders; replace it, or pass --tag with one of: "
                                         f"{_list_tags(save_dir)}")
    if latest.exists() and not latest.is_file():
        raise CheckpointCorruptError(f"{latest} is {_what(latest)}; it should be a file naming a tag folder — "
                                     f"replace it, or pass --tag with one of: {_list_tags(save_dir)}")


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
        _check_latest_file(save_dir)
        if not (save_dir / "latest").is_file():
            raise SourceNotFoundError(
                f"{save_dir} has no 'latest' file; pass --tag with one of: {_list_tags(save_dir)}")
        tag = read_latest(save_dir)
        origin = f"{save_dir / 'latest'} names tag {tag!r}"
    else:
        origin = f"--tag {tag!r}"
    tag_dir = save_dir / tag
    if tag_dir.is_dir():
        _listable(tag_dir)
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
        if src.is_symlink():
            try:
                os.stat(src)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SourceNotFoundError(f"{src} is a symlink loop (it leads back to itself); point it at the "
                                              "checkpoint folder") from None
            raise SourceNotFoundError(f"{src} is a symlink to {os.readlink(src)}, which does not exist")
        raise SourceNotFoundError(f"{src} does not exist")
    if src.is_dir():
        _listable(src)
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
