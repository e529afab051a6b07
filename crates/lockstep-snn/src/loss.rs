//! Training losses (`docs/neuron-models.md`, "Training"): `TargetFiringRate` and `VoltageRegularization`.
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

/// Where a firing-rate target comes from (`firing_rate` of `TargetFiringRate`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(
    untagged,
    expecting = "a number (the same target for every neuron), an object {population or node type: rate} or the path of a per-node CSV"
)]
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
    /// Parses the JSON form: a number, an object `{key: rate}`, or a CSV path string
    /// (relative to `base_dir`).
    ///
    /// Errors: [`SnnError::Config`] for any other value.
    pub fn from_json(v: &serde_json::Value, base_dir: &Path) -> Result<Self> {
        Ok(lockstep_core::config::from_value::<RateTarget>(v, "firing_rate")?.in_dir(base_dir))
    }

    /// Resolves a relative CSV path against `base_dir` (the config's folder).
    fn in_dir(self, base_dir: &Path) -> Self {
        match self {
            RateTarget::PerNodeCsv(p) => RateTarget::PerNodeCsv(base_dir.join(p)),
            other => other,
        }
    }

    /// Target per neuron (external order of `spec.neurons`).
    pub fn resolve(&self, spec: &NetworkSpec) -> Result<Vec<f64>> {
        let out = match self {
            RateTarget::Uniform(r) => vec![*r; spec.neurons.len()],
            RateTarget::PerPopulation(map) => {
                let mut out = Vec::with_capacity(spec.neurons.len());
                let mut known: Vec<String> = Vec::new();
                for nr in &spec.neurons {
                    let label = &spec.cell_types[nr.cell_type].name;
                    let (id, name) = match label.split_once(" (") {
                        Some((id, rest)) => {
                            (id.to_string(), rest.trim_end_matches(')').to_string())
                        }
                        None => (label.clone(), label.clone()),
                    };
                    for k in [&nr.population, label, &id, &name] {
                        if !known.contains(k) {
                            known.push(k.clone());
                        }
                    }
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
                // A key that names no population or node type would be ignored silently.
                if let Some(bad) = map.keys().find(|k| !known.contains(k)) {
                    let known: Vec<&str> = known.iter().map(String::as_str).collect();
                    return Err(SnnError::InvalidInput {
                        input: "TargetFiringRate.firing_rate".into(),
                        reason: format!(
                            "{} (keys are populations, node type ids or node type names)",
                            lockstep_core::config::unknown_problem("population", bad, &known)
                        ),
                    });
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
        what: "cannot read the firing-rate CSV named by TargetFiringRate.firing_rate in training.losses (a relative path is taken from the config's folder)".into(),
        path: path.to_path_buf(),
        cause: source,
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

/// One loss term of `training.losses`, as written (unknown keys refused).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(tag = "name", deny_unknown_fields)]
enum LossConfig {
    /// Mean squared distance of the firing rates from their targets.
    TargetFiringRate {
        /// The targets (Hz, or spikes per step with `rate_units`).
        firing_rate: RateTarget,
        /// `"Hz"` (default) or `"spikes_per_step"`.
        #[serde(default)]
        rate_units: RateUnits,
    },
    /// Penalty on membrane potentials outside the resting-to-threshold range.
    VoltageRegularization {
        /// Weight of the term (default 1).
        #[serde(default = "unit_cost")]
        cost: f64,
    },
}

fn unit_cost() -> f64 {
    1.0
}

impl LossConfig {
    /// Reads one entry from its JSON object, which names the loss with `"name"` (`name` given
    /// when the entry is keyed by loss name; `"type"` is read as `"name"` when the entry has
    /// no `"name"`).
    fn from_object<E: serde::de::Error>(
        mut entry: serde_json::Map<String, serde_json::Value>,
        name: Option<String>,
    ) -> std::result::Result<Self, E> {
        match name {
            Some(n) => {
                entry.insert("name".into(), serde_json::Value::String(n));
            }
            None if !entry.contains_key("name") => {
                if let Some(t) = entry.remove("type") {
                    entry.insert("name".into(), t);
                }
            }
            None => {}
        }
        // serde's messages ("unknown field `cots`, expected `cost`", "unknown variant ...")
        // reach the config error, which names the entry's key path and the nearest name.
        <LossConfig as serde::Deserialize>::deserialize(serde_json::Value::Object(entry))
            .map_err(E::custom)
    }
}

/// `training.losses`, read and checked when the config is read: a non-empty list of objects
/// with `"name"` (`TargetFiringRate` or `VoltageRegularization`; `"type"` is read as
/// `"name"`), or a non-empty object keyed by those names.
///
/// * `TargetFiringRate`: `firing_rate` (number, `{population or node type: rate}`, or a
///   per-node CSV path relative to the config's folder), `rate_units` (`"Hz"` default or
///   `"spikes_per_step"`);
/// * `VoltageRegularization`: `cost` (default 1).
///
/// Deserialization errors (through [`lockstep_core::config::from_value`]) name
/// `training.losses[i].KEY` (or `training.losses.NAME.KEY`) for an unknown loss or key, with
/// the nearest known name, or a value of the wrong type. The targets are resolved against a
/// network by [`LossesSection::compile`].
#[derive(Debug, Clone, PartialEq)]
pub struct LossesSection(Vec<LossConfig>);

impl<'de> serde::Deserialize<'de> for LossesSection {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
        use serde::Deserialize as _;
        use serde_json::{Map, Value};

        /// A list entry: an object that names its loss.
        struct Listed(LossConfig);
        impl<'de> serde::Deserialize<'de> for Listed {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                LossConfig::from_object(Map::<String, Value>::deserialize(d)?, None).map(Listed)
            }
        }
        /// The value of an entry keyed by loss name.
        struct Named(String);
        impl<'de> DeserializeSeed<'de> for Named {
            type Value = LossConfig;
            fn deserialize<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> std::result::Result<LossConfig, D::Error> {
                LossConfig::from_object(Map::<String, Value>::deserialize(d)?, Some(self.0))
            }
        }
        const EMPTY: &str =
            "is empty; e.g. [{\"name\": \"TargetFiringRate\", \"firing_rate\": 10}]";
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LossesSection;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list or an object of losses")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<LossesSection, A::Error> {
                let mut out = Vec::new();
                while let Some(Listed(l)) = seq.next_element()? {
                    out.push(l);
                }
                match out.is_empty() {
                    true => Err(de::Error::custom(EMPTY)),
                    false => Ok(LossesSection(out)),
                }
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<LossesSection, A::Error> {
                let mut out = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    out.push(map.next_value_seed(Named(name))?);
                }
                match out.is_empty() {
                    true => Err(de::Error::custom(EMPTY)),
                    false => Ok(LossesSection(out)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl LossesSection {
    /// The losses of `spec`, in the order written (CSV targets relative to `base_dir`, the
    /// config's folder); at least one.
    ///
    /// Errors: the errors of [`RateTarget::resolve`] (a target that names no population or
    /// node type, a node without a target, a negative or non-finite rate, an unreadable CSV).
    pub fn compile(&self, spec: &NetworkSpec, base_dir: &Path) -> Result<Vec<Loss>> {
        self.0
            .iter()
            .map(|l| {
                Ok(match l {
                    LossConfig::TargetFiringRate {
                        firing_rate,
                        rate_units,
                    } => Loss::TargetFiringRate {
                        target: firing_rate.clone().in_dir(base_dir).resolve(spec)?,
                        units: *rate_units,
                    },
                    LossConfig::VoltageRegularization { cost } => {
                        Loss::VoltageRegularization { cost: *cost }
                    }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::{CellType, NeuronSpec};
    use crate::simulation::model::CellModel;
    use serde_json::json;

    fn spec() -> NetworkSpec {
        let iaf = CellModel::from_template("nest:iaf_psc_alpha", &json!({}), "x").unwrap();
        NetworkSpec {
            cell_types: vec![
                CellType {
                    name: "100 (Scnn1a)".into(),
                    model: iaf.clone(),
                },
                CellType {
                    name: "105 (LIF_exc)".into(),
                    model: iaf,
                },
            ],
            neurons: vec![
                NeuronSpec {
                    population: "v1".into(),
                    node_id: 0,
                    cell_type: 0,
                },
                NeuronSpec {
                    population: "v1".into(),
                    node_id: 1,
                    cell_type: 1,
                },
                NeuronSpec {
                    population: "v2".into(),
                    node_id: 0,
                    cell_type: 1,
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn rate_targets_number_table_and_csv() {
        let s = spec();
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            RateTarget::from_json(&json!(7.5), dir.path())
                .unwrap()
                .resolve(&s)
                .unwrap(),
            vec![7.5; 3]
        );
        let t = RateTarget::from_json(&json!({"Scnn1a": 10.0, "105": 3.0}), dir.path()).unwrap();
        assert_eq!(t.resolve(&s).unwrap(), vec![10.0, 3.0, 3.0]);
        let t = RateTarget::from_json(&json!({"v2": 1.0, "Scnn1a": 2.0}), dir.path()).unwrap();
        let e = t.resolve(&s).unwrap_err().to_string();
        assert!(e.contains("node 1 of population 'v1'"), "{e}");
        // Every cell has a target, but one key names nothing in the network.
        let t = RateTarget::from_json(&json!({"v1": 1.0, "v2": 2.0, "Scnn1b": 3.0}), dir.path())
            .unwrap();
        let e = t.resolve(&s).unwrap_err().to_string();
        assert!(
            e.contains("unknown population `Scnn1b`; did you mean `Scnn1a`?"),
            "{e}"
        );
        std::fs::write(
            dir.path().join("t.csv"),
            "node_id,population,firing_rate\n0,v1,4\n1,v1,5\n0,v2,6\n",
        )
        .unwrap();
        let t = RateTarget::from_json(&json!("t.csv"), dir.path()).unwrap();
        assert_eq!(t.resolve(&s).unwrap(), vec![4.0, 5.0, 6.0]);
        std::fs::write(dir.path().join("bad.csv"), "node_id firing_rate\n0 4\n").unwrap();
        let e = RateTarget::from_json(&json!("bad.csv"), dir.path())
            .unwrap()
            .resolve(&s)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.csv") && e.contains("no row for node 1"),
            "{e}"
        );
        // A CSV that is not there: the message names the file and the key that names it.
        let e = RateTarget::from_json(&json!("missing.csv"), dir.path())
            .unwrap()
            .resolve(&s)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.csv") && e.contains("TargetFiringRate.firing_rate"),
            "{e}"
        );
    }

    /// `training.losses` read as the config reader reads it, then compiled against `s`.
    fn losses_from_json(v: &serde_json::Value, s: &NetworkSpec, d: &Path) -> Result<Vec<Loss>> {
        lockstep_core::config::from_value::<LossesSection>(v, "training.losses")?.compile(s, d)
    }

    #[test]
    fn losses_parse_from_list_and_object() {
        let s = spec();
        let d = Path::new(".");
        let l = losses_from_json(
            &json!([{"name": "TargetFiringRate", "firing_rate": 5, "rate_units": "spikes_per_step"},
                    {"name": "VoltageRegularization", "cost": 0.5}]),
            &s,
            d,
        )
        .unwrap();
        assert_eq!(
            l,
            vec![
                Loss::TargetFiringRate {
                    target: vec![5.0; 3],
                    units: RateUnits::SpikesPerStep
                },
                Loss::VoltageRegularization { cost: 0.5 }
            ]
        );
        assert!(l.iter().all(Loss::sample_separable));
        let l =
            losses_from_json(&json!({"TargetFiringRate": {"firing_rate": 2.0}}), &s, d).unwrap();
        assert_eq!(
            l,
            vec![Loss::TargetFiringRate {
                target: vec![2.0; 3],
                units: RateUnits::Hz
            }]
        );
        let e = losses_from_json(&json!([{"name": "Crossentropy"}]), &s, d)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Crossentropy") && e.contains("TargetFiringRate"),
            "{e}"
        );
        let e = losses_from_json(&json!({"VoltageRegularization": {"cots": 1}}), &s, d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cots"), "{e}");
    }
}
