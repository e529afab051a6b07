"""Neural posterior estimation: trained posteriors, sampled and evaluated as sbi and Dingo
users call them, and training from Dingo-style settings.

A :class:`Posterior` is the network of a ``lockstep npe train`` run. Its samples equal those
``lockstep npe sample`` writes for the same seed, bit for bit (the same library function
draws both, in the same chunks).
"""

from __future__ import annotations

import os
from typing import Any, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _lockstep
from ._arrays import as_array, existing_path
from ._errors import InvalidInputError

__all__ = ["Posterior", "PriorBound", "TrainResult", "train", "SAMPLE_CHUNK"]

PathLike = Union[str, "os.PathLike[str]"]

#: Rows drawn per pass of the network by ``lockstep npe sample``; the default
#: ``batch_size`` of :meth:`Posterior.sample` (the same samples as the command).
SAMPLE_CHUNK = 65536


class PriorBound(NamedTuple):
    """The prior's support of one parameter: ``[low, high]``, or for a periodic parameter
    (an angle) the circle ``[low, high)``. ``-inf``/``inf`` mean no bound."""

    low: float
    high: float
    periodic: bool


class Posterior:
    """A trained posterior q(theta | x), loaded with :meth:`Posterior.load`.

    Attributes
    ----------
    parameter_names : list of str
        The parameters, in the column order of samples and ``theta``.
    prior : list of PriorBound
        The prior's support, one bound per parameter.
    task : str
        The task's name (``two_moons``, ``gaussian_linear``, ``gw_chirp``, ...).
    x_dim : int
        Length of an observation.
    run_dir, checkpoint : str
        The run directory and the checkpoint file read.
    update : int
        Optimizer updates behind the parameters.
    device : str
        What the network computes on.
    last_report : str or None
        After :meth:`sample`: the fraction of the samples drawn outside the prior's
        support, in the words ``lockstep npe sample`` prints (``last_drawn`` and
        ``last_outside`` hold the counts).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.last_report: Optional[str] = None
        self.last_drawn: Optional[int] = None
        self.last_outside: Optional[int] = None

    @classmethod
    def load(cls, path: PathLike, device: str = "cpu") -> "Posterior":
        """Loads a trained posterior.

        Parameters
        ----------
        path : str or os.PathLike
            A run directory of ``lockstep npe train`` (its latest checkpoint), its
            ``checkpoints/latest``, a checkpoint file, or the folder of a run of several
            stages (the last stage).
        device : {"cpu", "gpu", "cuda"}, default "cpu"
            Where the network computes: the CPU, burn's wgpu backend on the first adapter
            ``lockstep info`` lists, or CUDA device 0 (a build with the ``cuda`` feature).

        Returns
        -------
        Posterior

        Raises
        ------
        LockstepFileNotFoundError
            ``path`` does not exist.
        LockstepError
            ``path`` is not the run of an NPE training (the message says what it found).
        InvalidInputError
            An unknown ``device``.
        """
        return cls(_lockstep._Posterior.load(
            existing_path(path, "a run directory or checkpoint of lockstep npe train"), str(device)
        ))

    @property
    def parameter_names(self) -> List[str]:
        """The parameter names, in the column order of samples and ``theta``."""
        return list(self._inner.parameter_names)

    @property
    def prior(self) -> List[PriorBound]:
        """The prior's support: one :class:`PriorBound` ``(low, high, periodic)`` per parameter."""
        return [PriorBound(*b) for b in self._inner.prior_bounds]

    @property
    def task(self) -> str:
        """The task's name (``two_moons``, ``gaussian_linear``, ``gw_chirp``, ...)."""
        return self._inner.task

    @property
    def x_dim(self) -> int:
        """Length of an observation ``x``."""
        return self._inner.x_dim

    @property
    def run_dir(self) -> str:
        """The run directory of the checkpoint."""
        return os.fspath(self._inner.run_dir)

    @property
    def checkpoint(self) -> str:
        """The checkpoint file read."""
        return os.fspath(self._inner.checkpoint)

    @property
    def update(self) -> int:
        """Optimizer updates behind the parameters."""
        return self._inner.update

    @property
    def device(self) -> str:
        """What the network computes on (``cpu``, the GPU adapter, the CUDA device)."""
        return self._inner.device

    def __repr__(self) -> str:
        return (
            f"Posterior(task={self.task!r}, parameters={self.parameter_names}, "
            f"checkpoint={self.checkpoint!r}, device={self.device!r})"
        )

    def _observation(self, x: Any, batched: bool) -> np.ndarray:
        if x is None:
            raise InvalidInputError("x is missing: give the observation, shape (x_dim,)")
        arr = as_array(x, np.float64, "x", (1, 2) if batched else (1,))
        return arr.reshape(1, -1) if arr.ndim == 1 else arr

    def sample(
        self,
        n: int,
        x: Any = None,
        batch_size: int = SAMPLE_CHUNK,
        inside_prior: bool = False,
        seed: int = 0,
        return_log_prob: bool = False,
    ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """Draws posterior samples for one observation.

        Parameters
        ----------
        n : int
            Number of samples (>= 1).
        x : array_like, shape (x_dim,)
            The observation, in the task's raw units (float64; values must be finite and
            within float32's range, as the network computes in float32).
        batch_size : int, default 65536
            Rows drawn per pass of the network. The default is the chunk of
            ``lockstep npe sample``: with it and the same ``seed`` the samples equal the
            command's bit for bit (another chunk size changes the last bits of the
            samples, through the blocking of the matrix products). Memory: the result plus
            one chunk.
        inside_prior : bool, default False
            Keep only samples inside the prior's support (drawing more until ``n`` are
            kept, at most 100 draws per sample kept; refused with the acceptance rate when
            the posterior lies mostly outside). Periodic parameters are always wrapped onto
            their circle.
        seed : int, default 0
            Seed of the base draws (``0 <= seed < 2**64``; a negative seed stands for
            ``2**64`` plus it, as in ``torch.manual_seed`` and the command's ``--seed``).
        return_log_prob : bool, default False
            Also return ``log q(theta | x)`` of each sample.

        Returns
        -------
        samples : numpy.ndarray, shape (n, dim), float32
            Columns in :attr:`parameter_names` order, in the parameters' units (float32, as
            the network computes and ``lockstep npe sample`` stores them).
        log_prob : numpy.ndarray, shape (n,), float32
            Only with ``return_log_prob=True``: the log-density of each sample, in the
            parameters' own units.

        Raises
        ------
        InvalidInputError
            A missing or wrongly sized observation, a NaN or infinite value in it (naming
            its position), ``n < 1``.
        KeyboardInterrupt
            Ctrl-C: sampling stops at the end of the current chunk.

        Notes
        -----
        The GIL is released while sampling; the samples are written straight into the
        returned array (no second copy is held). After the call, ``last_report`` holds the
        fraction of samples outside the prior's support, as the command prints it.
        """
        xs = self._observation(x, batched=False)
        count = _int(n, "n", 1)
        chunk = _int(batch_size, "batch_size", 1)
        samples, report, drawn, outside = self._inner.sample(
            xs, count, _seed(seed), chunk, bool(inside_prior)
        )
        self.last_report = report
        self.last_drawn = drawn
        self.last_outside = outside
        if return_log_prob:
            return samples, self.log_prob(samples, x=xs[0], batch_size=chunk)
        return samples

    def log_prob(self, theta: Any, x: Any = None, batch_size: int = SAMPLE_CHUNK) -> np.ndarray:
        """The posterior log-density ``log q(theta | x)``.

        Parameters
        ----------
        theta : array_like, shape (n, dim) or (dim,)
            Parameter values, columns in :attr:`parameter_names` order (converted to
            float32, the network's precision; must be finite).
        x : array_like, shape (x_dim,) or (n, x_dim)
            One observation for every row of ``theta``, or one per row (float64, finite).
        batch_size : int, default 65536
            Rows per pass of the network. The values equal the library's for the same rows
            in one pass; another chunking changes the blocking of the matrix products and
            so the last bits (relative differences of order 1e-7).

        Returns
        -------
        numpy.ndarray, shape (n,), float32
            The log-density of each row, in the parameters' own units (the standardization's
            Jacobian included).

        Raises
        ------
        InvalidInputError
            Wrong shapes, non-finite values (naming the position).
        KeyboardInterrupt
            Ctrl-C: stops at the end of the current chunk.
        """
        t = as_array(theta, np.float32, "theta", (1, 2))
        if t.ndim == 1:
            t = t.reshape(1, -1)
        xs = self._observation(x, batched=True)
        return self._inner.log_prob(t, xs, _int(batch_size, "batch_size", 1))


class TrainResult(NamedTuple):
    """What a training run returns."""

    #: The run directory (of the last stage run).
    run_dir: str
    #: Loss terms of every update of the call, ``[updates][terms]`` (all stages in order).
    loss_history: List[List[float]]
    #: Per stage run: ``(run_dir, loss_history)``.
    stages: List[Tuple[str, List[List[float]]]]


def train(
    settings: PathLike,
    train_dir: PathLike = "npe_output",
    overwrite: bool = False,
    resume: Optional[PathLike] = None,
    cpu: bool = False,
    num_samples: Optional[int] = None,
    epochs: Optional[int] = None,
) -> TrainResult:
    """Trains a posterior from Dingo-style YAML settings, as ``lockstep npe train`` does.

    Serial and thread replicas (``local.replicas``) run in this process; under
    ``mpirun -n N python script.py`` every rank calls it and each is one replica.

    Parameters
    ----------
    settings : str or os.PathLike
        The settings file (YAML, Dingo's shape: data, model, training.stage_N, local).
    train_dir : str or os.PathLike, default "npe_output"
        The run directory (Dingo's ``--train_dir``).
    overwrite : bool, default False
        Replace an existing run directory written by lockstep.
    resume : str or os.PathLike, optional
        Continue from this checkpoint, run directory or ``checkpoints/latest``.
    cpu : bool, default False
        Compute on the CPU whatever ``local.device`` says (the command's ``--cpu``).
    num_samples : int, optional
        For a quick try: ``data.num_samples`` (the command's ``--num-samples``; stored with
        the run as if the file said so).
    epochs : int, optional
        For a quick try: every stage's ``epochs`` (the command's ``--epochs``).

    Returns
    -------
    TrainResult
        The run directory and the loss history (the same values the command logs).

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C: every replica stops after the update under way and a checkpoint of it is
        written (its path is in the message); ``resume=`` continues from it.
    """
    stages = _lockstep._npe_train(
        existing_path(settings, "the NPE settings file"),
        os.fspath(train_dir),
        bool(overwrite),
        None if resume is None else os.fspath(resume),
        bool(cpu),
        None if num_samples is None else int(num_samples),
        None if epochs is None else int(epochs),
    )
    stages = [(os.fspath(d), h) for d, h in stages]
    history = [row for _, h in stages for row in h]
    return TrainResult(stages[-1][0] if stages else os.fspath(train_dir), history, stages)


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidInputError(f"{name}={value!r}: give an integer >= {low}")
    return int(value)


def _seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidInputError(f"seed={seed!r}: give an integer")
    s = int(seed)
    if not -(2**64) < s < 2**64:
        raise InvalidInputError(f"seed={seed!r}: give an integer in (-2**64, 2**64)")
    return s % (2**64)
