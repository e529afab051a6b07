"""lockstep from Python: FMM N-body forces on arrays, trained NPE posteriors (sbi/Dingo
style), spiking-network training and simulation (BMTK style), over the Rust library crates
the ``lockstep`` command runs.

Groups
------
lockstep.nbody
    :func:`lockstep.nbody.forces` (FMM or direct gravity of arrays),
    :func:`lockstep.nbody.simulate` (whole runs from a config).
lockstep.npe
    :class:`lockstep.npe.Posterior` (``load``, ``sample``, ``log_prob``),
    :func:`lockstep.npe.train`.
lockstep.simulate, lockstep.train
    Spiking networks from SONATA configs, as ``lockstep simulate`` and ``lockstep train``.

Errors are :class:`LockstepError` (subclasses derive from ``ValueError``,
``FileNotFoundError`` and ``RuntimeError`` as fits) with the library's message.

MPI: under ``mpirun -n N python script.py`` lockstep initialises MPI at its first job (and
finalises it at exit). To use mpi4py in the same script, import lockstep first and let it
own MPI: set ``mpi4py.rc.initialize = False`` and ``mpi4py.rc.finalize = False`` before
``from mpi4py import MPI``, and call a lockstep job (or :func:`lockstep.mpi_rank_and_size`)
first, so that MPI is initialised once, by lockstep, on the main thread.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Dict, List, NamedTuple, Optional, Union

from . import _lockstep
from ._arrays import existing_path, progress_default
from ._errors import InvalidInputError, LockstepError, LockstepFileNotFoundError, RunError
from . import nbody, npe

__all__ = [
    "LockstepError",
    "InvalidInputError",
    "LockstepFileNotFoundError",
    "RunError",
    "TrainResult",
    "mpi_rank_and_size",
    "nbody",
    "npe",
    "simulate",
    "train",
    "__version__",
]

__version__: str = _lockstep.__version__

PathLike = Union[str, "os.PathLike[str]"]

atexit.register(_lockstep._finalize)


def mpi_rank_and_size() -> tuple:
    """This process's rank and the number of ranks ``(rank, size)``.

    Under an MPI launcher (``mpirun``, ``srun``) this initialises MPI (lockstep owns its
    initialisation, see the package docstring); elsewhere it returns ``(0, 1)``.
    """
    return tuple(_lockstep._rank_and_size())


def simulate(config: PathLike, trials: int = 1, progress: Optional[bool] = None) -> Dict[str, Any]:
    """Simulates a SONATA point-neuron network, as ``lockstep simulate CONFIG`` does.

    The SONATA files (spikes, reports, log) are written where the config's ``output``
    section says, as by the command; the spikes and reports come back as arrays, read from
    those files.

    Parameters
    ----------
    config : str or os.PathLike
        A BMTK-style simulation config (``run.tstop``, ``run.dt``, inputs, networks,
        output, reports).
    trials : int, default 1
        Independent trials run together (the spikes and reports of trial 0 are written
        and returned).
    progress : bool, optional
        A progress bar on stderr; default: only where stderr is a terminal.

    Returns
    -------
    dict
        ``spikes``: a dict of ``node_ids`` (uint64, ``[spikes]``), ``timestamps`` (float64,
        ms, ``[spikes]``) and ``population`` (list of str, ``[spikes]``), in the file's
        order. ``reports``: per report name a dict with ``file``, ``variable`` and
        ``populations``: per population ``node_ids`` (uint64 ``[nodes]``), ``element_ids``,
        ``times`` (float64 ms ``[frames]``), ``time`` (``[start, stop, step]`` ms),
        ``data`` (float64 ``[frames, nodes]``) and ``units``. Also the summary the
        command prints: ``n_neurons``, ``n_steps``, ``dt``, ``tstop``, ``n_spikes``,
        ``syn_events``, ``rates`` (rows ``(group, name, cells, spikes, rate_hz)``),
        ``build_s``, ``simulate_s``, ``spikes_file``, ``output_dir``, ``warnings``.

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C, within 1024 time steps; nothing is written.
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InvalidInputError(f"trials={trials!r}: give an integer >= 1")
    return _lockstep._simulate(existing_path(config, "the simulation config"), trials, progress_default(progress))


class TrainResult(NamedTuple):
    """What :func:`train` returns."""

    #: The run directory.
    run_dir: str
    #: Reduced loss terms of every update run by this call, ``[updates][terms]``.
    loss_history: List[List[float]]


def train(
    config: PathLike,
    updates: Optional[int] = None,
    output_dir: Optional[PathLike] = None,
    overwrite: bool = False,
    resume: Optional[PathLike] = None,
    cpu: bool = False,
) -> TrainResult:
    """Trains a SONATA point-neuron network with BPTT, as ``lockstep train CONFIG`` does.

    Serial runs and thread replicas (``run.distribution``) run in this process; under
    ``mpirun -n N python script.py`` every rank calls it and each is one replica.

    Parameters
    ----------
    config : str or os.PathLike
        The training config (SONATA/BMTK style: manifest, networks, inputs, run, training,
        output).
    updates : int, optional
        Replaces ``training.optimizer_updates`` (the command's ``--updates``).
    output_dir : str or os.PathLike, optional
        Replaces ``output.output_dir`` (``--output-dir``).
    overwrite : bool, default False
        Sets ``output.overwrite_output_dir`` (``--overwrite``).
    resume : str or os.PathLike, optional
        Continue from this checkpoint (``--resume``).
    cpu : bool, default False
        Compute on the CPU whatever ``run.device`` says (``--cpu``).

    Returns
    -------
    TrainResult
        The run directory and the loss history (the values the command logs).

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C: every replica stops after the update under way, a checkpoint of it is
        written (its path is in the message) and ``resume=`` the run directory continues
        exactly where it stopped.
    """
    if updates is not None and (isinstance(updates, bool) or not isinstance(updates, int) or updates < 0):
        raise InvalidInputError(f"updates={updates!r}: give a non-negative integer")
    run_dir, history = _lockstep._train(
        existing_path(config, "the training config"),
        updates,
        None if output_dir is None else os.fspath(output_dir),
        bool(overwrite),
        None if resume is None else os.fspath(resume),
        bool(cpu),
    )
    return TrainResult(os.fspath(run_dir), history)
