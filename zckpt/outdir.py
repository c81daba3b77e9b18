"""All-or-nothing output folders: write into a temporary sibling, rename into place at the end.

A crash, an error or Ctrl-C leaves OUT as it was (absent, or the old contents with ``--overwrite``) and no
half-written files behind. The source is never touched: OUT may not be SRC, inside it, or contain it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import InvalidArgumentError, OutputExistsError

STAGING_PREFIX = ".zckpt-staging-"


def check_output(out: Path, sources: list[Path], overwrite: bool) -> None:
    """Refuse outputs that would clobber data or the source, before any work starts."""
    out_r = out.resolve()
    for src in sources:
        src_r = src.resolve()
        if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
            raise InvalidArgumentError(f"OUT {out} overlaps the source {src}; choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is a file; choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} exists and is not empty; pass --overwrite to replace it or choose another OUT")


@contextmanager
def staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out`` in one rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX + out.name + "-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it 0700; OUT should look like any mkdir'd folder
    try:
        yield staging
        _fsync_dir_files(staging)
        if out.exists():
            if any(out.iterdir()) and not overwrite:
                raise OutputExistsError(f"{out} appeared while writing; pass --overwrite or choose another OUT")
            old = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX + "old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fsync_dir_files(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
