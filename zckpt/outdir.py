"""All-or-nothing output folders: write into a temporary sibling, rename into place at the end.

A crash, an error, Ctrl-C, SIGTERM or SIGHUP leaves OUT as it was (absent, or the old contents with
``--overwrite``) and no half-written files behind:

* :func:`staged_output` writes into ``.zckpt-staging-<name>-*`` beside OUT and renames it into place at the end;
  any exception removes it.
* :func:`signals_raise` turns SIGTERM / SIGHUP / SIGINT into :class:`~zckpt.errors.Interrupted` while a command runs,
  so the same ``except`` path removes the staging folder (``timeout`` sends SIGTERM). Commands that stage output
  (consolidate, reshard, push's checks, prune) wrap their work in it through :func:`staged_output` or directly.
* SIGKILL and power loss cannot be handled: each staging folder holds a marker (:data:`MARKER`: host, pid and the
  process's start time), and the next run that stages beside it removes staging folders whose owner is gone.

OUT is checked before any work (:func:`check_output`): not the source, not inside it, not a file, not a mount
point and not the current folder (which a rename cannot replace). The source is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import (InsufficientSpaceError, Interrupted, InvalidArgumentError, OutputExistsError, ZckptError,
                     output_os_error, source_os_error)

STAGING_PREFIX = ".zckpt-staging-"
#: inside every staging folder while it exists; removed just before the final rename
MARKER = ".zckpt-staging.json"
_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None), signal.SIGINT)
                 if s is not None)


def check_output(out: Path, sources: list[Path], overwrite: bool) -> None:
    """Refuse outputs that would clobber data or the source, or that a final rename cannot replace, before any
    work starts."""
    out_r = out.resolve()
    for src in sources:
        src_r = src.resolve()
        if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
            raise InvalidArgumentError(f"OUT {out} overlaps the source {src}; choose a folder outside it")
    cwd = Path.cwd().resolve()
    if out_r == cwd or out_r in cwd.parents:
        raise InvalidArgumentError(f"OUT {out} is the current folder (or holds it): zckpt builds OUT beside it and "
                                   "renames it into place, which cannot replace the folder you are in; pass a new "
                                   "folder, e.g. ./model")
    if out.is_dir() and os.path.ismount(out):
        raise InvalidArgumentError(f"OUT {out} is a mount point: zckpt builds OUT beside it and renames it into "
                                   f"place, which cannot replace a mount point; pass a folder inside it, e.g. "
                                   f"{out / 'model'}")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is a file; choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} exists and is not empty; pass --overwrite to replace it or choose another OUT")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_space(out: Path, needed: int, what: str) -> None:
    """Refuse early when the disk that will hold OUT has less than ``needed`` bytes free (``what`` says what the
    estimate covers). With ``--overwrite`` the old OUT stays until the new one is complete, so it does not count."""
    from .report import human_bytes

    where = _existing_ancestor(out.parent)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # cannot tell: the write itself will report a full disk
    if needed > free:
        raise InsufficientSpaceError(f"{out}: {what} needs about {human_bytes(needed)} but {where} has "
                                     f"{human_bytes(free)} free; free space or choose an OUT on another disk")


@contextmanager
def signals_raise() -> Iterator[None]:
    """While the body runs (main thread only), SIGTERM, SIGHUP and SIGINT raise :class:`Interrupted` in the main
    thread, so ``except``/``finally`` clean-up runs as for any error; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}; no output was left behind", signum)

    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let clean-up finish: a second Ctrl-C / SIGTERM during it is ignored (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _write_marker(folder: Path) -> None:
    info = {"tool": "zckpt", "host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    (folder / MARKER).write_text(json.dumps(info), encoding="utf-8")


def _owner_gone(folder: Path) -> bool:
    """True when ``folder`` is one of our staging folders (valid marker) whose process on this host is gone."""
    try:
        info = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        pid, host = int(info["pid"]), info["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if info.get("tool") != "zckpt" or host != socket.gethostname():
        return False
    if pid == os.getpid():
        return False
    return not _alive(pid, info.get("start"))


def _alive(pid: int, start: str | None) -> bool:
    """Is process ``pid`` (started at ``start``, when known) still running? With /proc the start time tells a reused
    pid apart; without it (macOS), whether the pid exists."""
    if Path("/proc/self/stat").exists():
        now = _start_time(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(parent: Path) -> list[Path]:
    """Remove staging folders of ours in ``parent`` left by a killed run (SIGKILL, power loss); returns them."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir() and not entry.is_symlink() \
                and _owner_gone(entry):
            _restore_old(entry, parent)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _restore_old(entry: Path, parent: Path) -> None:
    """A ``.zckpt-staging-old-*`` folder holds the previous OUT of an --overwrite killed between its two renames:
    put that OUT back where it was (when nothing took its place) rather than delete it."""
    if not entry.name.startswith(STAGING_PREFIX + "old-"):
        return
    for child in entry.iterdir():
        if child.name != MARKER and child.is_dir() and not (parent / child.name).exists():
            os.rename(child, parent / child.name)


def _make_staging(parent: Path, prefix: str) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it 0700; OUT should look like any mkdir'd folder
    _write_marker(staging)
    return staging


def _remove(folder: Path) -> None:
    for _ in range(3):  # a writer thread finishing late may recreate a file: try again
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return


@contextmanager
def staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out`` in one rename. Signals raise
    :class:`Interrupted` meanwhile; OS errors become :class:`~zckpt.errors.OutputWriteError` (or
    :class:`~zckpt.errors.SourceUnreadableError` when the failing file is not under OUT)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out.parent)
    except OSError as exc:
        raise output_os_error(exc) from None
    with signals_raise():
        try:
            staging = _make_staging(out.parent, STAGING_PREFIX + out.name + "-")
        except OSError as exc:
            raise output_os_error(exc) from None
        try:
            yield staging
            _fsync_dir_files(staging)
            with _signals_ignored():  # the renames are not interrupted half-way (they take microseconds)
                _publish(staging, out, overwrite)
        except BaseException as exc:
            with _signals_ignored():
                _remove(staging)
            if isinstance(exc, OSError) and not isinstance(exc, ZckptError):
                raise _os_error(exc, staging, out) from None
            raise


def _os_error(exc: OSError, staging: Path, out: Path) -> ZckptError:
    name = str(exc.filename) if exc.filename is not None else None
    if name is not None and not (name.startswith(str(staging)) or name.startswith(str(out))
                                 or name.startswith(str(out.parent / STAGING_PREFIX))):
        return source_os_error(exc)
    if name is not None and name.startswith(str(staging)):
        exc.filename = str(out / os.path.relpath(name, staging))  # name the file as the user will know it
    elif name is None:
        exc.filename = str(out)  # a write on an open file (pwrite) names no file: name OUT
    return output_os_error(exc)


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    (staging / MARKER).unlink()
    if out.exists():
        if any(out.iterdir()) and not overwrite:
            raise OutputExistsError(f"{out} appeared while writing; pass --overwrite or choose another OUT")
        old = _make_staging(out.parent, STAGING_PREFIX + "old-")
        os.rename(out, old / out.name)
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(old / out.name, out)  # put the old OUT back
            raise
        finally:
            if not (old / out.name).exists():  # else the old OUT could not be put back: keep it for the user
                _remove(old)
    else:
        os.rename(staging, out)


def _fsync_dir_files(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
