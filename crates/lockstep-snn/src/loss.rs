//! Training losses (`GLIF3.md`, "Training"): `TargetFiringRate` and `VoltageRegularization`.
//!
//! Both are means over samples (and neurons, and for the regularizer time steps), hence
//! *sample-separable*: the mean of per-replica means over equal slices is the global mean,
//! which the sample-parallel engine relies on. Each loss says so through
//! [`Loss::sample_separable`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Result, SnnError};
use crate::network::NetworkSpec;
use crate::scalar::Scalar;

/// Units of a firing-rate target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum RateUnits {
    /// Hz: `rate = spike_count / (seq_len * dt / 1000)` (default).
    #[default]
    #[serde(rename = "Hz")]
    Hz,
    /// Spikes per step: `rate = spike_count / seq_len`.
    #[serde(rename = "spikes_per_step")]
    SpikesPerStep,
}

/// Where a firing-rate target comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum RateTarget {
    /// The same target for every neuron.
    Uniform(f64),
    /// One target per key: a population name, a node type id, a node type name
    /// (`model_name`), or the full cell-type label (`"100 (Scnn1a)"`).
    PerPopulation(BTreeMap<String, f64>),
    /// A CSV with columns `node_id` and `firing_rate` (or `target`), optionally `population`;
    /// comma or whitespace separated.
    PerNodeCsv(PathBuf),
}

impl RateTarget {
    /// Parses the JSON form: a number, an object `{key: rate}`, or a CSV path string.
    pub fn from_json(v: &serde_json::Value, base_dir: &Path) -> Result<Self> {
        match v {
            serde_json::Value::Number(n) => Ok(RateTarget::Uniform(n.as_f64().unwrap_or(f64::NAN))),
            serde_json::Value::Object(m) => {
                let mut out = BTreeMap::new();
                for (k, x) in m {
                    let r = x.as_f64().ok_or_else(|| SnnError::InvalidInput {
                        input: "TargetFiringRate.firing_rate".into(),
                        reason: format!("entry '{k}' = {x} must be a number"),
                    })?;
                    out.insert(k.clone(), r);
                }
                Ok(RateTarget::PerPopulation(out))
            }
            serde_json::Value::String(s) => {
                let p = Path::new(s);
                Ok(RateTarget::PerNodeCsv(if p.is_absolute() {
                    p.to_path_buf()
                } else {
                    base_dir.join(p)
                }))
            }
            other => Err(SnnError::InvalidInput {
                input: "TargetFiringRate.firing_rate".into(),
                reason: format!(
                    "{other} must be a number, an object of per-population rates or a CSV path"
                ),
            }),
        }
    }

    /// Target per neuron (external order of `spec.neurons`).
    pub fn resolve(&self, spec: &NetworkSpec) -> Result<Vec<f64>> {
        let out = match self {
            RateTarget::Uniform(r) => vec![*r; spec.neurons.len()],
            RateTarget::PerPopulation(map) => {
                let mut out = Vec::with_capacity(spec.neurons.len());
                for nr in &spec.neurons {
                    let label = &spec.cell_types[nr.cell_type].name;
                    let (id, name) = match label.split_once(" (") {
                        Some((id, rest)) => {
                            (id.to_string(), rest.trim_end_matches(')').to_string())
                        }
                        None => (label.clone(), label.clone()),
                    };
                    let r = [nr.population.as_str(), label.as_str(), id.as_str(), name.as_str()]
                        .iter()
                        .find_map(|k| map.get(*k))
                        .ok_or_else(|| SnnError::InvalidInput {
                            input: "TargetFiringRate.firing_rate".into(),
                            reason: format!(
                                "no target for node {} of population '{}' (cell type '{label}'); keys given: {}",
                                nr.node_id,
                                nr.population,
                                map.keys().cloned().collect::<Vec<_>>().join(", ")
                            ),
                        })?;
                    out.push(*r);
                }
                out
            }
            RateTarget::PerNodeCsv(path) => read_target_csv(path, spec)?,
        };
        if let Some((i, r)) = out
            .iter()
            .enumerate()
            .find(|(_, r)| !(r.is_finite() && **r >= 0.0))
        {
            return Err(SnnError::InvalidInput {
                input: "TargetFiringRate.firing_rate".into(),
                reason: format!("target {r} for neuron {i} must be finite and >= 0"),
            });
        }
        Ok(out)
    }
}

fn read_target_csv(path: &Path, spec: &NetworkSpec) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|source| SnnError::Io {
        what: "cannot read the firing-rate CSV".into(),
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |reason: String| SnnError::InvalidInput {
        input: path.display().to_string(),
        reason,
    };
    let split = |l: &str| -> Vec<String> {
        if l.contains(',') {
            l.split(',').map(|s| s.trim().to_string()).collect()
        } else {
            l.split_whitespace().map(str::to_string).collect()
        }
    };
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = split(lines.next().ok_or_else(|| bad("is empty".into()))?);
    let col = |names: &[&str]| header.iter().position(|h| names.contains(&h.as_str()));
    let id_c = col(&["node_id"]).ok_or_else(|| {
        bad(format!(
            "needs a 'node_id' column (header: {})",
            header.join(",")
        ))
    })?;
    let r_c = col(&["firing_rate", "target", "target_rate", "rate"]).ok_or_else(|| {
        bad(format!(
            "needs a 'firing_rate' column (header: {})",
            header.join(",")
        ))
    })?;
    let pop_c = col(&["population", "pop_name"]);
    let mut map: BTreeMap<(Option<String>, u64), f64> = BTreeMap::new();
    for (ln, l) in lines.enumerate() {
        let f = split(l);
        let get = |c: usize| {
            f.get(c)
                .ok_or_else(|| bad(format!("row {} has {} fields", ln + 2, f.len())))
        };
        let id: u64 = get(id_c)?.parse().map_err(|_| {
            bad(format!(
                "row {}: node_id '{}' is not an integer",
                ln + 2,
                f[id_c]
            ))
        })?;
        let r: f64 = get(r_c)?
            .parse()
            .map_err(|_| bad(format!("row {}: rate '{}' is not a number", ln + 2, f[r_c])))?;
        let pop = pop_c.map(|c| f.get(c).cloned().unwrap_or_default());
        map.insert((pop, id), r);
    }
    spec.neurons
        .iter()
        .map(|nr| {
            map.get(&(Some(nr.population.clone()), nr.node_id))
                .or_else(|| map.get(&(None, nr.node_id)))
                .copied()
                .ok_or_else(|| {
                    bad(format!(
                        "no row for node {} of population '{}'",
                        nr.node_id, nr.population
                    ))
                })
        })
        .collect()
}

/// A training loss.
#[derive(Debug, Clone, PartialEq)]
pub enum Loss {
    /// `mean over samples and neurons of (target - rate)^2`.
    TargetFiringRate {
        /// `[neuron]` targets (external order), in `units`.
        target: Vec<f64>,
        /// Units of targets and rates.
        units: RateUnits,
    },
    /// `cost * mean over samples, steps and neurons of relu(|v - 0.5| - 0.5)^2`, with
    /// `v = U / (V_th - E_L)` the normalized membrane potential after each step.
    VoltageRegularization {
        /// Weight of the term.
        cost: f64,
    },
}

impl Loss {
    /// Name used in logs and CSV callbacks.
    pub fn name(&self) -> &'static str {
        match self {
            Loss::TargetFiringRate { .. } => "TargetFiringRate",
            Loss::VoltageRegularization { .. } => "VoltageRegularization",
        }
    }

    /// True when the loss is a mean of per-sample terms (so the mean of replica means over
    /// equal slices is the global mean). Both losses here are; a loss that couples samples
    /// would return false and the sample-parallel engine refuses it.
    pub fn sample_separable(&self) -> bool {
        match self {
            Loss::TargetFiringRate { .. } | Loss::VoltageRegularization { .. } => true,
        }
    }
}

/// `relu(|v - 0.5| - 0.5)` and its derivative with respect to `v`.
#[inline]
pub(crate) fn vreg_r(v: f64) -> (f64, f64) {
    if v > 1.0 {
        (v - 1.0, 1.0)
    } else if v < 0.0 {
        (-v, -1.0)
    } else {
        (0.0, 0.0)
    }
}

/// The same `relu(|v - 0.5| - 0.5)` on any scalar (value decides the branch).
#[inline]
pub(crate) fn vreg_r_generic<S: Scalar>(v: S) -> S {
    let x = v.re();
    if x > 1.0 {
        v - S::from_f64(1.0)
    } else if x < 0.0 {
        -v
    } else {
        S::zero()
    }
}
