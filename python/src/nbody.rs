//! `lockstep.nbody`: gravity of arrays of particles ([`lockstep_nbody::Gravity`], the
//! force evaluation of `lockstep nbody`'s runs) and whole runs from a config file
//! ([`lockstep_nbody::config::run_nbody_config_on`], as `lockstep nbody` runs them).

use crate::errors::{exception, from_error, invalid, Kind};
use crate::world;
use lockstep_nbody::{ForceSettings, Gravity, Method, NearField, Particles, RunOptions};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use std::path::PathBuf;

/// Accelerations `[N, 3]` and potentials `[N]`, as NumPy arrays.
type ForcesOut<'py> = (Bound<'py, PyArray2<f64>>, Bound<'py, PyArray1<f64>>);

/// Acceleration `[N, 3]` and potential `[N]` of the particles `pos` (`[N, 3]`, float64,
/// C order) with masses `mass` (`[N]`, float64) on themselves: the library's
/// `Gravity::forces` with the given settings (validated by `Gravity::new` and
/// `Particles::validate`, as a run validates its config), on `device`: `"cpu"`, `"gpu"` or
/// `"gpu:N"` (adapter N of `lockstep info`), as `forces.device` of a config. The Python
/// wrapper (`lockstep.nbody.forces`) converts lists, dtypes and orders first.
#[pyfunction]
#[pyo3(signature = (pos, mass, g, softening, method, order, theta, leaf_size, near_field, device))]
#[allow(clippy::too_many_arguments)]
fn _nbody_forces<'py>(
    py: Python<'py>,
    pos: PyReadonlyArray2<'py, f64>,
    mass: PyReadonlyArray1<'py, f64>,
    g: f64,
    softening: f64,
    method: &str,
    order: usize,
    theta: f64,
    leaf_size: usize,
    near_field: &str,
    device: &str,
) -> PyResult<ForcesOut<'py>> {
    let device_text = device;
    let device = device.parse().map_err(|_| {
        invalid(format!(
            "device={device:?}: use \"cpu\", \"gpu\" or \"gpu:N\" (N from `lockstep info`)"
        ))
    })?;
    let method = match method {
        "fmm" => Method::Fmm,
        "direct" => Method::Direct,
        other => {
            return Err(invalid(format!(
                "method={other:?}: use \"fmm\" (the fast multipole method) or \"direct\" (direct summation, O(N^2))"
            )))
        }
    };
    let near_field = match near_field {
        "f32" => NearField::F32,
        "f64" => NearField::F64,
        other => {
            return Err(invalid(format!(
                "near_field={other:?}: use \"f32\" (the default) or \"f64\""
            )))
        }
    };
    let shape = pos.shape();
    if shape.len() != 2 || shape[1] != 3 {
        return Err(invalid(format!(
            "pos has shape {shape:?}; give positions as an array of shape (N, 3)"
        )));
    }
    let n = shape[0];
    if mass.len() != n {
        return Err(invalid(format!(
            "mass has {} values but pos has {n} rows; give one mass per particle",
            mass.len()
        )));
    }
    let flat = pos
        .as_slice()
        .map_err(|_| invalid("pos is not C-contiguous (the wrapper makes it so)"))?;
    let mass = mass
        .as_slice()
        .map_err(|_| invalid("mass is not contiguous (the wrapper makes it so)"))?;
    let settings = ForceSettings {
        method,
        softening,
        order,
        theta,
        leaf_size,
        near_field,
        device,
    };
    let named = format!("device={device_text:?}");
    let mut gravity = Gravity::new(settings, g).map_err(|e| match e {
        // The library names its config key; here the user wrote the argument.
        lockstep_nbody::NbodyError::Gpu(m) => {
            exception(Kind::Run, m.replace("forces.device", &named))
        }
        e => from_error(e),
    })?;
    let pos3: Vec<[f64; 3]> = flat.chunks_exact(3).map(|p| [p[0], p[1], p[2]]).collect();
    let particles = Particles::from_arrays(
        pos3,
        vec![[0.0; 3]; n],
        mass.to_vec(),
        (0..n as u64).collect(),
    )
    .map_err(from_error)?;
    let forces = crate::interruptible(py, || {
        particles.validate()?;
        gravity.forces(&particles)
    })?
    .map_err(from_error)?;
    let acc: Vec<f64> = forces.acc.into_iter().flatten().collect();
    let acc = acc
        .into_pyarray(py)
        .reshape([n, 3])
        .expect("3 N values reshape to (N, 3)");
    Ok((acc, forces.pot.into_pyarray(py)))
}

/// Runs the N-body config at `config` (every rank of an MPI job calls it, the particles
/// sharded over the ranks) and returns the run's summary as JSON text
/// (`lockstep_nbody::Summary`).
#[pyfunction]
#[pyo3(signature = (config, output_dir, overwrite, quiet, progress))]
fn _nbody_simulate(
    py: Python<'_>,
    config: PathBuf,
    output_dir: Option<PathBuf>,
    overwrite: bool,
    quiet: bool,
    progress: bool,
) -> PyResult<String> {
    world::with_world(py, |world| {
        let opts = RunOptions {
            progress: world.comm().is_chief() && progress,
            quiet: quiet || !world.comm().is_chief(),
            output_dir,
            overwrite,
            ..Default::default()
        };
        let summary = crate::interruptible(py, || {
            lockstep_nbody::config::run_nbody_config_on(world.comm(), &config, &opts)
        })?
        .map_err(from_error)?;
        serde_json::to_string(&summary)
            .map_err(|e| crate::errors::exception(crate::errors::Kind::Run, e.to_string()))
    })
}

/// Adds this module's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_nbody_forces, m)?)?;
    m.add_function(wrap_pyfunction!(_nbody_simulate, m)?)?;
    Ok(())
}
