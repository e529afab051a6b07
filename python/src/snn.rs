//! `lockstep.simulate` and `lockstep.train`: the forward simulation of a SONATA network
//! ([`lockstep_snn::simulate_config`], as `lockstep simulate`) with its spikes and reports
//! read back from the SONATA files it wrote ([`lockstep_sonata::read_spikes`],
//! [`lockstep_sonata::read_report`]), and training from a config
//! ([`lockstep_snn::train_config`], as `lockstep train`).

use crate::errors::from_anyhow;
use lockstep_snn::{Overrides, RunProgress, SimulateOptions};
use numpy::{IntoPyArray, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;

/// An indicatif bar on stderr, in trial steps (as `lockstep simulate` draws it).
struct Bar(indicatif::ProgressBar);

impl RunProgress for Bar {
    fn start(&self, total_steps: u64) {
        self.0.set_length(total_steps);
        self.0.set_position(0);
    }
    fn advance(&self, steps: u64) {
        self.0.inc(steps);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Simulates the config at `config` (`trials` independent trials; trial 0 written) and
/// returns a dict: the summary's values, `spikes` (population, node_ids, timestamps of the
/// spikes file, file order) and `reports` (per report: variable, units and per population
/// node_ids, time, data `[frames, nodes]`).
#[pyfunction]
#[pyo3(signature = (config, trials, progress))]
fn _simulate<'py>(
    py: Python<'py>,
    config: PathBuf,
    trials: usize,
    progress: bool,
) -> PyResult<Bound<'py, PyDict>> {
    if trials == 0 {
        return Err(crate::errors::invalid(
            "trials=0: a simulation runs at least 1 trial (trial 0 is the one written)",
        ));
    }
    let bar: Option<Arc<dyn RunProgress>> = progress.then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Arc::new(Bar(bar)) as Arc<dyn RunProgress>
    });
    let opts = SimulateOptions {
        batch: trials,
        progress: bar,
        ..SimulateOptions::default()
    };
    let (s, spikes, reports) = crate::interruptible(py, || -> anyhow::Result<_> {
        let s = lockstep_snn::simulate_config(&config, &opts)?;
        let spikes = lockstep_sonata::read_spikes(&s.spikes_file)?;
        let reports = s
            .reports
            .iter()
            .map(|r| Ok((r.name.clone(), lockstep_sonata::read_report(&r.file)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((s, spikes, reports))
    })?
    .map_err(from_anyhow)?;
    let d = PyDict::new(py);
    d.set_item("output_dir", &s.output_dir)?;
    d.set_item("spikes_file", &s.spikes_file)?;
    d.set_item("spikes_file_csv", &s.spikes_file_csv)?;
    d.set_item("n_neurons", s.n_neurons)?;
    d.set_item("n_steps", s.n_steps)?;
    d.set_item("dt", s.dt)?;
    d.set_item("tstop", s.tstop)?;
    d.set_item("n_spikes", s.n_spikes)?;
    d.set_item("syn_events", s.syn_events)?;
    d.set_item("build_s", s.build_s)?;
    d.set_item("simulate_s", s.simulate_s)?;
    d.set_item("warnings", &s.warnings)?;
    let rates = PyList::empty(py);
    for r in &s.rates {
        let group = match r.group {
            lockstep_snn::RateGroup::All => "all",
            lockstep_snn::RateGroup::Population => "population",
            lockstep_snn::RateGroup::NodeType => "node type",
        };
        rates.append((group, &r.name, r.cells, r.spikes, r.rate_hz))?;
    }
    d.set_item("rates", rates)?;
    let mut population = Vec::new();
    let mut node_ids = Vec::new();
    let mut timestamps = Vec::new();
    for p in spikes.populations {
        population.extend(std::iter::repeat_n(p.population.clone(), p.node_ids.len()));
        node_ids.extend(p.node_ids);
        timestamps.extend(p.timestamps);
    }
    let sp = PyDict::new(py);
    sp.set_item("population", population)?;
    sp.set_item("node_ids", node_ids.into_pyarray(py))?;
    sp.set_item("timestamps", timestamps.into_pyarray(py))?;
    d.set_item("spikes", sp)?;
    let reps = PyDict::new(py);
    for ((name, report), summary) in reports.into_iter().zip(&s.reports) {
        let r = PyDict::new(py);
        r.set_item("file", &summary.file)?;
        r.set_item("variable", report.variable)?;
        let pops = PyDict::new(py);
        for p in report.populations {
            let e = PyDict::new(py);
            let (frames, elements) = (p.n_frames(), p.n_elements());
            e.set_item("units", &p.units)?;
            e.set_item("time", p.time.to_vec())?;
            e.set_item("times", p.times().into_pyarray(py))?;
            e.set_item("node_ids", p.node_ids.into_pyarray(py))?;
            e.set_item("element_ids", p.element_ids.into_pyarray(py))?;
            e.set_item("data", p.data.into_pyarray(py).reshape([frames, elements])?)?;
            pops.set_item(p.population, e)?;
        }
        r.set_item("populations", pops)?;
        reps.set_item(name, r)?;
    }
    d.set_item("reports", reps)?;
    Ok(d)
}

/// Trains the config at `config` as `lockstep train` does (every rank of an MPI job calls
/// it), with the overrides given, and returns `(run_dir, loss_history)`.
#[pyfunction]
#[pyo3(signature = (config, updates, output_dir, overwrite, resume, cpu))]
#[allow(clippy::type_complexity)]
fn _train(
    py: Python<'_>,
    config: PathBuf,
    updates: Option<u64>,
    output_dir: Option<PathBuf>,
    overwrite: bool,
    resume: Option<PathBuf>,
    cpu: bool,
) -> PyResult<(PathBuf, Vec<Vec<f64>>)> {
    let overrides = Overrides {
        updates,
        output_dir,
        overwrite,
        ..Overrides::default()
    };
    let force_cpu = cpu && lockstep_snn::asks_for_gpu(&config);
    crate::world::with_world(py, |world| {
        let s = crate::interruptible(py, || {
            lockstep_snn::train_config(world, &config, &overrides, resume, force_cpu)
        })?
        .map_err(from_anyhow)?;
        Ok((s.output_dir, s.loss_history))
    })
}

/// Adds this module's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_simulate, m)?)?;
    m.add_function(wrap_pyfunction!(_train, m)?)?;
    Ok(())
}
