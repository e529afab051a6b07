"""Conversions of user arrays to what the extension reads in place (no copy when the input
already is a C-ordered array of the right dtype)."""

from __future__ import annotations

import numpy as np

from ._errors import InvalidInputError


def as_array(value, dtype, name: str, ndim_ok: tuple[int, ...]) -> np.ndarray:
    """``value`` (an array, a list, a scalar sequence) as a C-contiguous array of
    ``dtype`` whose number of dimensions is one of ``ndim_ok``.

    Raises InvalidInputError naming ``name`` for values that are not real numbers
    (strings, complex numbers, ragged lists) or a wrong number of dimensions.
    """
    if isinstance(value, np.ndarray) and value.dtype.kind == "c":
        raise InvalidInputError(f"{name} is complex ({value.dtype}); give real numbers")
    if isinstance(value, np.ndarray) and value.dtype.kind not in "fiub":
        raise InvalidInputError(
            f"{name} has dtype {value.dtype}; give real numbers (float64 or float32)"
        )
    try:
        arr = np.ascontiguousarray(value, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{name} is not an array of real numbers: {e}") from None
    if arr.ndim not in ndim_ok:
        want = " or ".join(f"{d}-D" for d in ndim_ok)
        raise InvalidInputError(f"{name} has shape {arr.shape}; it must be {want}")
    return arr


def progress_default(progress):
    """``progress`` as a bool: ``None`` means a bar only where stderr is a terminal (as the
    ``lockstep`` command does)."""
    if progress is None:
        import sys

        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):
            return False
    return bool(progress)


def existing_path(path, what: str) -> str:
    """``path`` as a string, or LockstepFileNotFoundError naming it and ``what`` it should
    be when nothing is there."""
    import os

    from ._errors import LockstepFileNotFoundError

    p = os.fspath(path)
    if not os.path.exists(p):
        raise LockstepFileNotFoundError(f"{p}: no such file or folder ({what})")
    return p
