"""Typed errors. Every error carries a one-line message that says what is wrong and how to fix it.

The CLI maps :class:`ZckptError` to ``error: <message>`` and exit code 2 in one place (``zckpt.cli.main``);
anything else is a bug and shows a traceback.
"""

from __future__ import annotations


class ZckptError(Exception):
    """Base class: a problem with the user's input, reported without a traceback."""

    exit_code = 2


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
