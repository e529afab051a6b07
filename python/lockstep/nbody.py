"""Gravitational N-body: FMM or direct-summation forces on arrays, and whole runs.

The forces are the library's (``lockstep-nbody``), computed by the same code as the
``lockstep nbody`` command: the results equal the library's bit for bit.

Units follow the N-body code (``docs/nbody.md``): positions in kpc, masses in the mass unit
of ``G`` (``G`` in kpc (km/s)^2 per mass unit), accelerations in (km/s)^2/kpc and potentials
in (km/s)^2. With ``G=1`` any consistent unit system works.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _lockstep
from ._arrays import as_array, existing_path, progress_default
from ._errors import InvalidInputError

__all__ = ["forces", "simulate"]

PathLike = Union[str, "os.PathLike[str]"]


def forces(
    pos: Any,
    mass: Any,
    G: float = 1.0,
    softening: float = 0.0,
    method: str = "fmm",
    order: int = 6,
    theta: float = 0.6,
    leaf_size: int = 32,
    near_field: str = "f32",
    device: str = "cpu",
) -> Tuple[np.ndarray, np.ndarray]:
    """Gravitational acceleration and potential of particles on themselves.

    Parameters
    ----------
    pos : array_like, shape (N, 3)
        Positions (kpc). Any real dtype and memory order; converted to C-ordered float64
        (no copy when it already is).
    mass : array_like, shape (N,)
        Masses (finite, >= 0), in the mass unit of ``G``.
    G : float, default 1.0
        Gravitational constant in code units (finite, > 0).
    softening : float, default 0.0
        Plummer softening length eps (kpc, finite, >= 0): the potential of a source of mass
        m at distance r is ``-G m / sqrt(r^2 + eps^2)``.
    method : {"fmm", "direct"}, default "fmm"
        The fast multipole method, or direct summation (O(N^2), the reference).
    order : int, default 6
        FMM expansion order p, 1..6.
    theta : float, default 0.6
        FMM opening angle, in (0, 1).
    leaf_size : int, default 32
        Largest number of particles in an FMM leaf.
    near_field : {"f32", "f64"}, default "f32"
        Arithmetic of the FMM near-field sums (see ``lockstep_nbody::NearField``).
    device : {"cpu", "gpu", "gpu:N"}, default "cpu"
        Where the forces are computed: the CPU, a GPU through Vulkan (the first adapter
        ``CUDA_VISIBLE_DEVICES`` leaves, as ``forces.device: "gpu"`` of a config), or adapter
        N of ``lockstep info``. The GPU computes in float32 arithmetic with compensated sums
        and agrees with the CPU to about 1e-5 relative (docs/nbody.md).

    Returns
    -------
    acc : numpy.ndarray, shape (N, 3), float64
        Accelerations, (km/s)^2/kpc (with G in kpc (km/s)^2 per mass unit).
    pot : numpy.ndarray, shape (N,), float64
        Potentials, (km/s)^2 (negative for attractive gravity; a particle does not act on
        itself).

    Raises
    ------
    InvalidInputError
        Wrong shapes, non-finite positions, negative masses, parameters out of range.

    Notes
    -----
    The GIL is released while the forces are computed (other Python threads run). Ctrl-C
    raises ``KeyboardInterrupt`` at the end of the FMM phase under way (tree, upward pass,
    traversal, M2L, L2L/L2P, M2P), within a block of targets of the direct sums, or after
    a GPU evaluation.

    Examples
    --------
    >>> import numpy as np, lockstep
    >>> pos = np.random.default_rng(0).normal(size=(1000, 3))
    >>> acc, pot = lockstep.nbody.forces(pos, np.full(1000, 1e-3), G=1.0, softening=0.01)
    >>> acc.shape, pot.shape
    ((1000, 3), (1000,))
    """
    p = as_array(pos, np.float64, "pos", (2,))
    if p.shape[1:] != (3,):
        raise InvalidInputError(
            f"pos has shape {p.shape}; give positions as an array of shape (N, 3)"
        )
    m = as_array(mass, np.float64, "mass", (1,))
    return _lockstep._nbody_forces(
        p,
        m,
        float(G),
        float(softening),
        str(method),
        _count(order, "order"),
        float(theta),
        _count(leaf_size, "leaf_size"),
        str(near_field),
        str(device),
    )


def simulate(
    config: PathLike,
    output_dir: Optional[PathLike] = None,
    overwrite: bool = False,
    quiet: bool = True,
    progress: Optional[bool] = None,
) -> dict:
    """Runs an N-body config, as ``lockstep nbody CONFIG`` does.

    Under ``mpirun -n N python script.py`` every rank calls it and the particles are
    sharded over the ranks.

    Parameters
    ----------
    config : str or os.PathLike
        The N-body config (JSON: units, initial conditions, forces, integrator, time,
        output).
    output_dir : str or os.PathLike, optional
        Replaces ``output.dir`` of the config.
    overwrite : bool, default False
        Replace an earlier lockstep nbody output in the output folder.
    quiet : bool, default True
        Print nothing (no diagnostics table, no summary); ``False`` prints as the command.
    progress : bool, optional
        A progress bar on stderr; default: only where stderr is a terminal.

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C, before the next step (or the next phase of a force evaluation); the
        snapshots already written stay.

    Returns
    -------
    dict
        The run's summary: ``num_total``, ``steps``, ``diagnostics`` (a list of dicts:
        ``time``, ``kinetic``, ``potential``, ``momentum``, ...), ``energy_drift``,
        ``max_energy_drift``, ``momentum_drift``, ``files`` (snapshots of this rank),
        ``output_dir`` and ``wall_seconds``.
    """
    text = _lockstep._nbody_simulate(
        existing_path(config, "the N-body config"),
        None if output_dir is None else os.fspath(output_dir),
        bool(overwrite),
        bool(quiet),
        progress_default(progress),
    )
    return json.loads(text)


def _count(value: Any, name: str) -> int:
    """``value`` as a non-negative int, or InvalidInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidInputError(f"{name}={value!r}: give a non-negative integer")
    return int(value)
