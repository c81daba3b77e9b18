"""Typed errors. Every error carries a one-line message that says what is wrong and how to fix it.

The CLI maps :class:`ZckptError` to ``error: <message>`` and exit code 2 in one place (``zckpt.cli.main``);
anything else is a bug and shows a traceback.
"""

from __future__ import annotations

import errno as _errno
import re

#: characters never echoed from a file: C0/C1 controls (ANSI escapes, carriage returns, bells), DEL
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: the longest message we print: a message quoting a file stays one readable line
MAX_MESSAGE = 2000


def printable(text: object, limit: int = MAX_MESSAGE) -> str:
    """``text`` safe for a terminal line: control characters (escape sequences, ``\\r``, newlines) shown as
    ``\\xNN``, cut to ``limit`` characters."""
    text = str(text).replace("\n", "\\n")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else text[:limit] + "..."


class ZckptError(Exception):
    """Base class: a problem with the user's input, reported without a traceback. The message is made printable
    (:func:`printable`) once, here, so nothing quoted from a file reaches a terminal raw."""

    exit_code = 2

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(printable(message), *args)


class SourceNotFoundError(ZckptError):
    """SRC does not exist or holds no checkpoint zckpt recognises."""


class CheckpointIncompleteError(ZckptError):
    """A file the checkpoint needs is missing, empty, or truncated."""


class CheckpointCorruptError(ZckptError):
    """A file is present but its contents contradict the rest of the checkpoint."""


class UnsafePickleError(ZckptError):
    """A pickle asked for a global outside the allow-list; nothing from it was executed."""


class UnsupportedCheckpointError(ZckptError):
    """A valid checkpoint using a feature zckpt does not handle yet."""


class OutputExistsError(ZckptError):
    """OUT exists and is not empty; pass --overwrite to replace it."""


class InvalidArgumentError(ZckptError):
    """A flag or argument value is invalid."""


class ModelFolderError(ZckptError):
    """FOLDER is not a complete consolidated model, or holds something that must not be pushed (a link leaving it)."""


class HubError(ZckptError):
    """The Hub (or the way to it) failed: network, a server error, a failure mid-upload; the message says whether
    anything was committed."""


class HubAuthError(HubError):
    """No token, an invalid one (401), or one that may not write to the repository (403)."""


class HubNotFoundError(HubError):
    """The repository or revision does not exist (404) and is not being created."""


class HubVerifyError(HubError):
    """The commit landed but its files do not match the local ones (name, size or hash)."""


class SourceUnreadableError(ZckptError):
    """The operating system refused to read part of the source (permissions, I/O error, a symlink loop, ...)."""


class OutputWriteError(ZckptError):
    """The operating system refused to write OUT (disk full, read-only file system, permissions, ...); nothing
    was left behind."""


class InsufficientSpaceError(OutputWriteError):
    """The disk holding OUT lacks the space the output needs; checked before any work."""


class Interrupted(ZckptError):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the command; staging was removed. Exit code 128 + signal."""

    def __init__(self, message: object = "", signum: int = 2) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


#: errno -> (what happened, what to do); the fix says which of SRC / OUT to look at via ``{role}``
_OS_FIXES = {
    _errno.EACCES: ("permission denied", "check the permissions of {role} (or run as a user who may {verb} it)"),
    _errno.EPERM: ("operation not permitted", "check the permissions and attributes of {role}"),
    _errno.ENOSPC: ("no space left on the device", "free space on that disk or choose an OUT on another one"),
    _errno.EDQUOT: ("disk quota exceeded", "free space within your quota or choose an OUT on another disk"),
    _errno.EROFS: ("read-only file system", "choose a {role} on a writable file system"),
    _errno.EISDIR: ("a folder is where a file should be", "remove or rename that folder"),
    _errno.ENOTDIR: ("a file is where a folder should be", "remove or rename that file"),
    _errno.EEXIST: ("it exists and is not a folder", "every parent of {role} must be a folder; choose another path"),
    _errno.ELOOP: ("too many levels of symbolic links (a symlink loop)", "fix the link so it names a real path"),
    _errno.ENOENT: ("no such file or folder", "check the path; it may have been removed while zckpt ran"),
    _errno.EIO: ("input/output error from the device", "check the disk (dmesg); copy the files elsewhere"),
    _errno.EFBIG: ("file too large for this file system or process limit", "raise the limit (ulimit -f) or "
                                                                          "choose another OUT"),
    _errno.ENAMETOOLONG: ("file name too long", "use a shorter path"),
    _errno.EMFILE: ("too many open files", "raise the limit (ulimit -n)"),
    _errno.EXDEV: ("cross-device rename", "choose OUT on one file system"),
    _errno.EBUSY: ("device or resource busy (a mount point?)", "choose a folder inside it as {role}"),
}


def describe_os_error(exc: OSError, role: str = "the path") -> str:
    """One line for an OSError: the file, the cause (errno name), the fix."""
    name = _errno.errorcode.get(exc.errno or 0, "error")
    cause, fix = _OS_FIXES.get(exc.errno, (exc.strerror or type(exc).__name__, "check {role} and retry"))
    verb = "write" if role.startswith("OUT") else "read"
    where = exc.filename if exc.filename is not None else role
    if exc.filename2 is not None:
        where = f"{where} -> {exc.filename2}"
    return f"{where}: {cause} ({name}); {fix.format(role=role, verb=verb)}"


def source_os_error(exc: OSError) -> SourceUnreadableError:
    return SourceUnreadableError(describe_os_error(exc, "SRC"))


def output_os_error(exc: OSError) -> OutputWriteError:
    return OutputWriteError(describe_os_error(exc, "OUT") + "; nothing was left behind")
