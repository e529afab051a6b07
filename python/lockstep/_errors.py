"""The exceptions of the lockstep package.

Every error of the library reaches Python as a :class:`LockstepError` carrying the
library's message (the same text the ``lockstep`` command prints). Each subclass also
derives from the matching built-in exception, so ``except ValueError`` and
``except FileNotFoundError`` work as usual.
"""

from __future__ import annotations

__all__ = [
    "LockstepError",
    "InvalidInputError",
    "LockstepFileNotFoundError",
    "RunError",
]


class LockstepError(Exception):
    """Base class of every error raised by lockstep."""


class InvalidInputError(LockstepError, ValueError):
    """Bad input: an array of the wrong shape or values, an unknown option, a config key
    or value the library refuses (the message names it as you wrote it)."""


class LockstepFileNotFoundError(LockstepError, FileNotFoundError):
    """A file or folder that does not exist (a config, a run directory, a checkpoint)."""


class RunError(LockstepError, RuntimeError):
    """A run stopped: a run directory of another kind, an output folder lockstep may not
    replace, a failed replica, a device that cannot be opened, and the like."""
