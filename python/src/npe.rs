//! `lockstep.npe`: a trained posterior loaded from its run ([`lockstep_npe::trained::load`]),
//! sampled as `lockstep npe sample` samples it ([`lockstep_npe::sampling::draw`], the same
//! chunks and seed stream, so the same samples bit for bit), its log-probabilities
//! ([`lockstep_npe::DeviceModel::log_prob`]), and training from settings
//! ([`lockstep_npe::stages::train_stages`], as `lockstep npe train`).

use crate::errors::{exception, from_error, invalid, Kind};
use lockstep_npe::sampling::{self, SampleRequest};
use lockstep_npe::stages::{train_stages, TrainRequest};
use lockstep_npe::trained::{self, Trained};
use lockstep_npe::{DeviceKind, DeviceModel, NpeError, Placement};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use std::path::PathBuf;

/// How a draw stopped early: Python's signal handler raised (Ctrl-C), or the library
/// refused.
enum Stop {
    /// `KeyboardInterrupt` (or another exception of a signal handler).
    Py(PyErr),
    /// The library's error.
    Npe(NpeError),
}

impl From<NpeError> for Stop {
    fn from(e: NpeError) -> Self {
        Stop::Npe(e)
    }
}

impl Stop {
    fn into_py(self) -> PyErr {
        match self {
            Stop::Py(e) => e,
            Stop::Npe(e) => from_error(e),
        }
    }
}

/// A trained posterior on a device (the extension's half of `lockstep.npe.Posterior`).
#[pyclass(name = "_Posterior", module = "lockstep._lockstep", unsendable)]
pub struct Posterior {
    trained: Trained,
    model: DeviceModel,
    device: String,
}

/// The observation rows of `x` (`[x_dim]` or `[n, x_dim]`, float64) as the network's
/// float32 values, each checked by the library ([`Trained::checked_observation`]).
fn observations(t: &Trained, x: &PyReadonlyArray2<'_, f64>) -> PyResult<Vec<f32>> {
    let rows = x.shape()[0];
    let flat = x
        .as_slice()
        .map_err(|_| invalid("x is not C-contiguous (the wrapper makes it so)"))?;
    let d = x.shape()[1];
    let mut out = Vec::with_capacity(flat.len());
    for (i, row) in flat.chunks_exact(d.max(1)).enumerate() {
        let source = if rows == 1 {
            "x".to_string()
        } else {
            format!("x[{i}]")
        };
        out.extend(t.checked_observation(row, &source).map_err(from_error)?);
    }
    if d == 0 {
        out.extend(t.checked_observation(&[], "x").map_err(from_error)?);
    }
    Ok(out)
}

#[pymethods]
impl Posterior {
    /// Loads the posterior of `path` (a run directory, `checkpoints/latest`, a checkpoint
    /// file or the folder of a run of several stages) onto `device` (`cpu`, `gpu`, `cuda`).
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf, device: &str) -> PyResult<Self> {
        let kind: DeviceKind = device
            .parse()
            .map_err(|e: NpeError| invalid(format!("device={device:?}: {e}")))?;
        crate::detached(py, || {
            let trained = trained::load(&path).map_err(from_error)?;
            let placement = Placement::for_slot(kind, 0)
                .map_err(|e| exception(Kind::Run, format!("device={device:?}: {e}")))?;
            let model = DeviceModel::from_model(&trained.model, &placement).map_err(from_error)?;
            Ok(Posterior {
                trained,
                model,
                device: placement.describe(),
            })
        })
    }

    /// The parameter names, in column order.
    #[getter]
    fn parameter_names(&self) -> Vec<String> {
        self.trained.task.parameter_names()
    }

    /// The prior's support: `(low, high, periodic)` per parameter.
    #[getter]
    fn prior_bounds(&self) -> Vec<(f64, f64, bool)> {
        self.trained
            .task
            .prior_bounds()
            .iter()
            .map(|b| (b.low, b.high, b.periodic))
            .collect()
    }

    /// The task's name (`two_moons`, `gw_chirp`, ...).
    #[getter]
    fn task(&self) -> String {
        self.trained.task.name().to_string()
    }

    /// Length of an observation x.
    #[getter]
    fn x_dim(&self) -> usize {
        self.trained.task.x_dim()
    }

    /// The run directory of the checkpoint.
    #[getter]
    fn run_dir(&self) -> PathBuf {
        self.trained.run_dir.clone()
    }

    /// The checkpoint file read.
    #[getter]
    fn checkpoint(&self) -> PathBuf {
        self.trained.checkpoint.clone()
    }

    /// Optimizer updates behind the parameters.
    #[getter]
    fn update(&self) -> u64 {
        self.trained.update
    }

    /// What the network computes on (`cpu`, the GPU adapter, the CUDA device).
    #[getter]
    fn device(&self) -> String {
        self.device.clone()
    }

    /// Draws `n` samples for the observation `x` (`[1, x_dim]`, float64) in chunks of
    /// `batch_size` rows, straight into the float32 array returned (`[n, dim]`), with the
    /// filter's report: `(samples, report, drawn, outside)`. Stops on Ctrl-C between chunks.
    #[pyo3(signature = (x, n, seed, batch_size, inside_prior))]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        x: PyReadonlyArray2<'py, f64>,
        n: u64,
        seed: u64,
        batch_size: usize,
        inside_prior: bool,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, String, u64, u64)> {
        if n == 0 {
            return Err(invalid("n=0: draw at least 1 sample"));
        }
        if batch_size == 0 {
            return Err(invalid("batch_size=0: draw at least 1 row per chunk"));
        }
        if x.shape()[0] != 1 {
            return Err(invalid(format!(
                "x has {} rows; sampling takes one observation (shape (x_dim,))",
                x.shape()[0]
            )));
        }
        let t = &self.trained;
        let xf = observations(t, &x)?;
        let d = t.task.theta_dim();
        let mut m = lockstep_core::memory::MemoryEstimate::new();
        m.add(
            "the posterior samples returned (float32)",
            n.saturating_mul(4 * d as u64),
        )
        .driven_by("n");
        m.check_here("this sample").map_err(from_error)?;
        let rows =
            usize::try_from(n).map_err(|_| invalid(format!("n={n} does not fit this machine")))?;
        let out = PyArray2::<f32>::zeros(py, [rows, d], false);
        // SAFETY: `out` was just created here and is not shared with Python code yet; it
        // stays alive (held by this frame) while the slice is written below.
        let buffer = unsafe { out.as_slice_mut() }
            .map_err(|_| exception(Kind::Run, "a new array is not contiguous"))?;
        let request = SampleRequest {
            num_samples: n,
            seed,
            inside_prior,
            chunk: batch_size,
            inside_prior_name: "inside_prior=True",
        };
        let model = &self.model;
        let filter = crate::detached(py, || {
            let mut done = 0usize;
            sampling::draw(t, model, &xf, &request, &mut |rows: &[f32]| {
                buffer[done..done + rows.len()].copy_from_slice(rows);
                done += rows.len();
                crate::check_signals().map_err(Stop::Py)
            })
        })
        .map_err(Stop::into_py)?;
        let report = filter.report(n, "inside_prior=True");
        Ok((out, report, filter.drawn, filter.outside))
    }

    /// `log q(theta | x)` per row of `theta` (`[n, dim]`, float32) for the observation
    /// `x` (`[1, x_dim]` for all rows, or `[n, x_dim]`, float64), `batch_size` rows per
    /// pass, into the float32 array returned (`[n]`). Stops on Ctrl-C between chunks.
    #[pyo3(signature = (theta, x, batch_size))]
    fn log_prob<'py>(
        &self,
        py: Python<'py>,
        theta: PyReadonlyArray2<'py, f32>,
        x: PyReadonlyArray2<'py, f64>,
        batch_size: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        if batch_size == 0 {
            return Err(invalid("batch_size=0: evaluate at least 1 row per chunk"));
        }
        let t = &self.trained;
        let (n, d) = (theta.shape()[0], theta.shape()[1]);
        if d != t.task.theta_dim() {
            return Err(invalid(format!(
                "theta has {d} columns; the task {} has {} parameters ({})",
                t.task.name(),
                t.task.theta_dim(),
                t.task.parameter_names().join(", ")
            )));
        }
        if x.shape()[0] != 1 && x.shape()[0] != n {
            return Err(invalid(format!(
                "x has {} rows but theta has {n}; give one observation (shape (x_dim,)) or one per row of theta (shape (n, x_dim))",
                x.shape()[0]
            )));
        }
        let theta = theta
            .as_slice()
            .map_err(|_| invalid("theta is not C-contiguous (the wrapper makes it so)"))?;
        if let Some(i) = theta.iter().position(|v| !v.is_finite()) {
            return Err(invalid(format!(
                "theta[{}, {}] is {}; give finite parameter values",
                i / d,
                i % d,
                theta[i]
            )));
        }
        let xf = observations(t, &x)?;
        let xd = t.task.x_dim();
        let per_row = x.shape()[0] == n && n != 1;
        let out = PyArray1::<f32>::zeros(py, [n], false);
        // SAFETY: `out` was just created here and is not shared with Python code yet; it
        // stays alive (held by this frame) while the slice is written below.
        let buffer = unsafe { out.as_slice_mut() }
            .map_err(|_| exception(Kind::Run, "a new array is not contiguous"))?;
        let model = &self.model;
        crate::detached(py, || -> PyResult<()> {
            let mut repeated = Vec::new();
            for start in (0..n).step_by(batch_size) {
                let rows = batch_size.min(n - start);
                let xs: &[f32] = if per_row {
                    &xf[start * xd..(start + rows) * xd]
                } else {
                    if repeated.len() != rows * xd {
                        repeated = xf.repeat(rows);
                    }
                    &repeated
                };
                let lp = model.log_prob(&theta[start * d..(start + rows) * d], xs, rows);
                buffer[start..start + rows].copy_from_slice(&lp);
                crate::check_signals()?;
            }
            Ok(())
        })?;
        Ok(out)
    }
}

/// Trains the posterior of the settings file `settings` into `train_dir`, as
/// `lockstep npe train` does (every rank of an MPI job calls it), and returns per stage run
/// `(run_dir, loss_names, loss_history)`. `num_samples` and `epochs` override
/// `data.num_samples` and every stage's `epochs` (the command's quick-try flags).
#[pyfunction]
#[pyo3(signature = (settings, train_dir, overwrite, resume, cpu, num_samples=None, epochs=None))]
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn _npe_train(
    py: Python<'_>,
    settings: PathBuf,
    train_dir: PathBuf,
    overwrite: bool,
    resume: Option<PathBuf>,
    cpu: bool,
    num_samples: Option<u64>,
    epochs: Option<u64>,
) -> PyResult<Vec<(PathBuf, Vec<Vec<f64>>)>> {
    for (name, v) in [("num_samples", num_samples), ("epochs", epochs)] {
        if v == Some(0) {
            return Err(crate::errors::exception(
                crate::errors::Kind::Invalid,
                format!("{name}=0: give a count of at least 1"),
            ));
        }
    }
    let request = TrainRequest {
        settings_file: settings,
        train_dir,
        overwrite,
        resume,
        force_cpu: cpu,
        overrides: lockstep_npe::settings::Overrides {
            num_samples,
            epochs,
        },
    };
    crate::world::with_world(py, |world| {
        let summaries =
            crate::interruptible(py, || train_stages(&request, world))?.map_err(from_error)?;
        Ok(summaries
            .into_iter()
            .map(|s| (s.output_dir, s.loss_history))
            .collect())
    })
}

/// Adds this module's names.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Posterior>()?;
    m.add_function(wrap_pyfunction!(_npe_train, m)?)?;
    Ok(())
}
