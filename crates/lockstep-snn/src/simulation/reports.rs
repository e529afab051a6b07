//! The membrane reports of a `lockstep simulate` run: the config's `reports` entries (read by
//! [`lockstep_sonata::membrane_reports`]) placed on the run's time grid, with their cells
//! resolved to the network's neurons.

use std::collections::HashMap;
use std::path::Path;

use lockstep_sonata::{ReportDtype, SonataConfig};

use crate::config::cfg_err;
use crate::error::{Result, SnnError};
use crate::network::Network;
use crate::simulation::forward::VmRecorder;
use crate::simulation::nest::TICS_PER_MS;

/// A membrane report placed on the run's time grid.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedReport {
    /// The report's name.
    pub name: String,
    /// File name inside `output_dir`.
    pub file_name: String,
    /// The recorded population.
    pub population: String,
    /// `[cell]` recorded node ids (ascending).
    pub node_ids: Vec<u64>,
    /// What the kernel records.
    pub recorder: VmRecorder,
    /// `[start, stop, step]` in ms for `mapping/time`.
    pub time: [f64; 3],
    /// Data type of the file.
    pub dtype: ReportDtype,
    /// The report's interval key as the config wrote it (`interval`, or `dt`).
    pub interval_key: &'static str,
    /// Keys BMTK's pointnet would ignore (see
    /// [`lockstep_sonata::MembraneReportSettings::warnings`]).
    pub warnings: Vec<String>,
}

/// `x` ms as a whole number of steps of `net`'s grid, or `None` when it is off the grid.
fn grid_steps(net: &Network, x: f64) -> Option<i64> {
    let tics = x * TICS_PER_MS;
    let rounded = tics.round();
    let on_tic = (tics - rounded).abs() <= 1e-6 * rounded.abs().max(1.0);
    (x.is_finite() && on_tic && (rounded as i64) % net.grid.tics_per_step == 0)
        .then(|| rounded as i64 / net.grid.tics_per_step)
}

/// Places the config's membrane reports on the run's grid and resolves their cells.
pub(crate) fn plan_reports(
    cfg: &SonataConfig,
    net: &Network,
    n_steps: usize,
    output_dir: &Path,
) -> Result<Vec<PlannedReport>> {
    let sets = lockstep_sonata::node_sets(&cfg.json)
        .map_err(|e| SnnError::Config(e.in_file(&cfg.path)))?;
    let settings = lockstep_sonata::membrane_reports(cfg.json.get("reports"), &sets, output_dir)
        .map_err(|e| SnnError::Config(e.in_file(&cfg.path)))?;
    let mut by_node: HashMap<(&str, u64), u32> = HashMap::new();
    for (e, nr) in net.neurons.iter().enumerate() {
        by_node.insert((nr.population.as_str(), nr.node_id), e as u32);
    }
    let mut out = Vec::with_capacity(settings.len());
    for s in settings {
        let err = |k: &str, p: String| cfg_err(&cfg.path, &format!("reports.{}.{k}", s.name), p);
        let (first, last, stride) = report_frames(net, &s, n_steps, err)?;
        let (node_ids, neurons) = report_cells(net, &by_node, &s, err)?;
        let step_ms = |m: i64| (m * net.grid.tics_per_step) as f64 / TICS_PER_MS;
        out.push(PlannedReport {
            name: s.name.clone(),
            file_name: s.file_name.clone(),
            population: s.cells.population.clone(),
            node_ids,
            time: [step_ms(first), step_ms(last + stride), step_ms(stride)],
            recorder: VmRecorder {
                neurons,
                first_step: first as usize,
                stride: stride as usize,
                n_frames: ((last - first) / stride + 1) as usize,
            },
            dtype: s.dtype,
            interval_key: s.window_keys[2],
            warnings: s.warnings.clone(),
        });
    }
    Ok(out)
}

/// The recorded steps of report `s` on `net`'s grid: `(first, last, stride)` in steps, the
/// multiples of its `interval` in `(tstart, tstop]` of a run of `n_steps` steps. `err`
/// makes the error for a key of the report (named as the config wrote it).
fn report_frames(
    net: &Network,
    s: &lockstep_sonata::MembraneReportSettings,
    n_steps: usize,
    err: impl Fn(&str, String) -> SnnError,
) -> Result<(i64, i64, i64)> {
    let dt_ms = net.grid.dt;
    let [start_key, end_key, dt_key] = s.window_keys;
    let step_ms = |m: i64| (m * net.grid.tics_per_step) as f64 / TICS_PER_MS;
    let stride = match s.dt {
        None => 1,
        Some(d) => match grid_steps(net, d) {
            Some(k) if k >= 1 => k,
            _ => {
                return Err(err(
                    dt_key,
                    format!("{d} ms must be a positive whole multiple of run.dt ({dt_ms} ms)"),
                ))
            }
        },
    };
    let on_grid = |k: &str, x: f64| {
        grid_steps(net, x).filter(|&m| m >= 0).ok_or_else(|| {
            err(
                k,
                format!("{x} ms must be a non-negative multiple of run.dt ({dt_ms} ms)"),
            )
        })
    };
    let start = s.start_time.map_or(Ok(0), |x| on_grid(start_key, x))?;
    let end = s
        .end_time
        .map_or(Ok(n_steps as i64), |x| on_grid(end_key, x))?;
    if end > n_steps as i64 {
        return Err(err(
            end_key,
            format!(
                "{} ms is after run.tstop ({} ms)",
                step_ms(end),
                step_ms(n_steps as i64)
            ),
        ));
    }
    if start >= end {
        return Err(err(
            start_key,
            format!(
                "{} ms must be before {end_key} ({} ms)",
                step_ms(start),
                step_ms(end)
            ),
        ));
    }
    let first = (start / stride + 1) * stride;
    let last = (end / stride) * stride;
    if first > last {
        return Err(err(
            dt_key,
            format!(
                "no recording time: no multiple of {} ms lies in ({} ms, {} ms]",
                step_ms(stride),
                step_ms(start),
                step_ms(end)
            ),
        ));
    }
    Ok((first, last, stride))
}

/// The cells report `s` records: its node ids (ascending) and their external neuron
/// indices (`by_node`: (population, node id) -> index). `err` makes the error for a key of
/// the report.
fn report_cells(
    net: &Network,
    by_node: &HashMap<(&str, u64), u32>,
    s: &lockstep_sonata::MembraneReportSettings,
    err: impl Fn(&str, String) -> SnnError,
) -> Result<(Vec<u64>, Vec<u32>)> {
    let pop = s.cells.population.as_str();
    if !net.neurons.iter().any(|n| n.population == pop) {
        let virt = net.virtual_nodes.iter().any(|v| v.population == pop);
        let mut known: Vec<&str> = net.neurons.iter().map(|n| n.population.as_str()).collect();
        known.dedup();
        return Err(err(
            "cells",
            if virt {
                format!("'{pop}' is a virtual (input) population; it has no membrane potential. Record one of: {}", known.join(", "))
            } else {
                format!("'{pop}' is not a node population or node set of this network (populations: {})", known.join(", "))
            },
        ));
    }
    let mut node_ids: Vec<u64> = match &s.cells.node_ids {
        Some(ids) => ids.clone(),
        None => net
            .neurons
            .iter()
            .filter(|n| n.population == pop)
            .map(|n| n.node_id)
            .collect(),
    };
    node_ids.sort_unstable();
    node_ids.dedup();
    let mut neurons = Vec::with_capacity(node_ids.len());
    for &id in &node_ids {
        neurons.push(*by_node.get(&(pop, id)).ok_or_else(|| {
            err(
                "cells",
                format!("population '{pop}' has no node with id {id}"),
            )
        })?);
    }
    if neurons.is_empty() {
        return Err(err(
            "cells",
            "selects no cell; list at least one node id".into(),
        ));
    }
    Ok((node_ids, neurons))
}
