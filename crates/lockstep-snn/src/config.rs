//! From a config file to a model: the typed sections of a BMTK-style config that lockstep-snn
//! owns (`inputs`, the model's keys of `run`, `training` and `output`) and the trainable model
//! built from a training config.
//!
//! A training config's `run`, `training` and `output` are shared with the training engine:
//! [`SnnRun`], [`SnnTraining`] and [`SnnOutput`] accept the engine's keys, and the caller that
//! knows both parts (`lockstep train`) refuses every other key with
//! [`lockstep_core::config::check_keys`] over the union of their
//! [`field_names`](lockstep_core::config::field_names). `inputs.<name>` entries
//! ([`InputSection`]) belong to this crate alone and refuse unknown keys themselves.

use std::collections::BTreeMap;
use std::path::Path;

use lockstep_core::config::ConfigError;
use lockstep_sonata::SonataConfig;
use serde::de::{self, IgnoredAny};
use serde::{Deserialize, Deserializer};

use crate::error::{Result, SnnError};
use crate::input::{InputSpec, PoissonSpec};
use crate::loss::LossesSection;
use crate::network::NetworkSpec;
use crate::scalar::{Surrogate, SurrogateSpec};
use crate::sonata::spike_trains_for_virtual_nodes;
use crate::training::{BpttOptions, DeviceRequest, Dtype, SnnModel};

/// The model's keys of a training config's `run` (the engine owns the others, e.g.
/// `batch_size`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnnRun {
    /// Time step (ms); required.
    #[serde(default)]
    pub dt: Option<f64>,
    /// Steps per sample; required, at least 1.
    #[serde(default)]
    pub seq_len: Option<u64>,
    /// Precision of BPTT: `"float32"` (default: the batched float32 kernels) or `"float64"`
    /// (the per-sample double-precision BPTT).
    #[serde(default)]
    pub dtype: Option<Dtype>,
    /// Where BPTT computes: `"cpu"` (default), `"gpu"` (the adapter of the rank's node-local
    /// index, or of the thread replica), `"gpu:N"` (adapter N of `lockstep info`).
    #[serde(default)]
    pub device: Option<DeviceRequest>,
    /// Seed of the Poisson inputs without their own `seed` (the engine's seed too; default 0).
    #[serde(default)]
    pub seed: Option<u64>,
}

/// `training.gradient_checkpointing`: `false` (default), `true` (chunks of 25 steps) or a
/// chunk size in steps (at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GradientCheckpointing(pub Option<usize>);

impl<'de> Deserialize<'de> for GradientCheckpointing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = GradientCheckpointing;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or a chunk size in steps (at least 1)")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> std::result::Result<Self::Value, E> {
                Ok(GradientCheckpointing(b.then_some(25)))
            }
            fn visit_u64<E: de::Error>(self, k: u64) -> std::result::Result<Self::Value, E> {
                match k {
                    0 => Err(E::invalid_value(de::Unexpected::Unsigned(0), &self)),
                    k => Ok(GradientCheckpointing(Some(k as usize))),
                }
            }
            fn visit_i64<E: de::Error>(self, k: i64) -> std::result::Result<Self::Value, E> {
                match u64::try_from(k) {
                    Ok(k) => self.visit_u64(k),
                    Err(_) => Err(E::invalid_value(de::Unexpected::Signed(k), &self)),
                }
            }
            fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
                Ok(GradientCheckpointing(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The model's keys of a training config's `training` (the engine owns the others, e.g.
/// `optimizer`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnnTraining {
    /// The loss terms (`TargetFiringRate`, `VoltageRegularization`), checked when the
    /// config is read; required.
    #[serde(default)]
    pub losses: Option<LossesSection>,
    /// The pseudo-derivative of the spike function (default gauss).
    #[serde(default)]
    pub pseudo_derivative: Option<SurrogateSpec>,
    /// Recompute the forward pass in chunks instead of storing every step.
    #[serde(default)]
    pub gradient_checkpointing: GradientCheckpointing,
    /// Train the input (virtual-node) weights too (default false).
    #[serde(default)]
    pub train_input_weights: Option<bool>,
}

/// The model's keys of a training config's `output` (the engine owns the others, e.g.
/// `output_dir`): the spike files of the simulation written beside the trained weights, and
/// the spikes of training trials.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnnOutput {
    /// SONATA spikes file name.
    #[serde(default)]
    pub spikes_file: Option<String>,
    /// BMTK's spikes CSV file name.
    #[serde(default)]
    pub spikes_file_csv: Option<String>,
    /// Write the spikes of one training trial at chosen updates ([`TrainingSpikes`]).
    #[serde(default)]
    pub training_spikes: Option<TrainingSpikes>,
}

/// The folder of the run directory that holds the training trials' spike files.
pub const TRAINING_SPIKES_DIR: &str = "spikes";

/// `output.training_spikes`: the spikes of one training trial, the first sample of the global
/// batch, written at chosen updates as SONATA spike files
/// `RUN_DIR/spikes/update_NNNNNN.h5` (one population per non-virtual population, times in
/// ms from the trial's start, as `lockstep simulate` writes them).
///
/// Update `N` is the forward pass computed with the weights after `N` optimizer updates
/// (those of `checkpoints/update_NNNNNN.safetensors`), i.e. the pass of the `(N+1)`-th update
/// whose loss is row `N + 1` of `callbacks/losses.csv`; update 0 is the untrained network.
/// The spikes are those the training computed (no second simulation), in its precision
/// (`run.dtype`) and from its initial state (at rest).
///
/// Exactly one of the keys: `{"updates": [0, 50, 100]}` or `{"every": 50}` (updates 0, 50,
/// 100, ...). Every update must lie below the run's number of updates
/// ([`TrainingSpikes::validate`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpikes {
    /// The updates to record, each in `0 .. training.optimizer_updates`.
    #[serde(default)]
    pub updates: Option<Vec<u64>>,
    /// Record updates `0, every, 2 every, ...` (at least 1).
    #[serde(default)]
    pub every: Option<u64>,
}

impl TrainingSpikes {
    /// Checks the section for a run of `total_updates` optimizer updates: exactly one of
    /// `updates` (non-empty, each below `total_updates`) and `every` (at least 1).
    ///
    /// Errors: a [`ConfigError`] naming the key under `output.training_spikes` (no file; the
    /// caller adds it).
    pub fn validate(&self, total_updates: u64) -> std::result::Result<(), ConfigError> {
        const KEY: &str = "output.training_spikes";
        match (&self.updates, self.every) {
            (Some(_), Some(_)) => Err(ConfigError::new(
                KEY,
                "gives both `updates` and `every`; keep one",
            )),
            (None, None) => Err(ConfigError::new(
                KEY,
                "needs `updates` (a list of updates, e.g. [0, 50, 100]) or `every` (an interval in updates, e.g. 50)",
            )),
            (None, Some(0)) => Err(ConfigError::new(
                format!("{KEY}.every"),
                "must be at least 1 (updates between two recorded trials)",
            )),
            (None, Some(_)) => Ok(()),
            (Some(list), None) if list.is_empty() => Err(ConfigError::new(
                format!("{KEY}.updates"),
                "is empty; list the updates to record (e.g. [0, 50, 100]) or remove output.training_spikes",
            )),
            (Some(list), None) => match list.iter().find(|&&u| u >= total_updates) {
                Some(u) => Err(ConfigError::new(
                    format!("{KEY}.updates"),
                    format!(
                        "update {u} is not below the run's {total_updates} updates (training.optimizer_updates or --updates); update N records the forward pass with the weights after N updates, so 0..{} can be recorded",
                        total_updates.saturating_sub(1)
                    ),
                )),
                None => Ok(()),
            },
        }
    }

    /// True when update `update` (0-based, see [`TrainingSpikes`]) is recorded.
    pub fn records(&self, update: u64) -> bool {
        match (&self.updates, self.every) {
            (Some(list), _) => list.contains(&update),
            (None, Some(k)) if k > 0 => update.is_multiple_of(k),
            _ => false,
        }
    }

    /// The file of update `update`, relative to the run directory:
    /// `spikes/update_NNNNNN.h5`.
    pub fn file_of(update: u64) -> std::path::PathBuf {
        Path::new(TRAINING_SPIKES_DIR).join(format!("update_{update:06}.h5"))
    }

    /// The update of a training spikes file name (`update_NNNNNN.h5` gives `N`), or `None`
    /// for any other name.
    pub fn update_of(file: &Path) -> Option<u64> {
        file.file_name()?
            .to_str()?
            .strip_prefix("update_")?
            .strip_suffix(".h5")?
            .parse()
            .ok()
    }
}

/// The sections of a training config lockstep-snn reads (with
/// [`lockstep_sonata::CIRCUIT_KEYS`], the top-level keys of a training config besides the
/// engine's).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnnTrainConfig {
    /// `run` (shared with the engine).
    #[serde(default)]
    pub run: SnnRun,
    /// `training` (shared with the engine).
    #[serde(default)]
    pub training: SnnTraining,
    /// `output` (shared with the engine).
    #[serde(default)]
    pub output: SnnOutput,
    /// `inputs.<name>`.
    #[serde(default)]
    pub inputs: BTreeMap<String, InputSection>,
}

impl SnnTrainConfig {
    /// Reads lockstep-snn's sections of a resolved training config.
    ///
    /// Errors: [`ConfigError`] naming the config file and the key.
    pub fn from_config(cfg: &SonataConfig) -> std::result::Result<Self, ConfigError> {
        lockstep_core::config::from_value(&cfg.json, "").map_err(|e| e.in_file(&cfg.path))
    }
}

/// One `inputs.<name>` entry (unknown keys refused): `{"input_type": "spikes", "module":
/// "sonata" | "h5" | "hdf5", "input_file": ..., "node_set": <virtual population>}` or
/// `{"input_type": "poisson", "rate": Hz, "node_set": <virtual population>, "seed": n}`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSection {
    /// `"spikes"` (default) or `"poisson"`.
    #[serde(default)]
    pub input_type: Option<String>,
    /// The spike file format (`"sonata"`, `"h5"`, `"hdf5"`), or `"poisson"`.
    #[serde(default)]
    pub module: Option<String>,
    /// The virtual population the input drives.
    #[serde(default)]
    pub node_set: Option<String>,
    /// The SONATA spikes file (spike inputs).
    #[serde(default)]
    pub input_file: Option<String>,
    /// Poisson rate (Hz).
    #[serde(default)]
    pub rate: Option<f64>,
    /// Poisson seed (default `run.seed`).
    #[serde(default)]
    pub seed: Option<u64>,
    /// BMTK's trial selector of spike files: accepted, not used.
    #[serde(default)]
    pub trial: Option<IgnoredAny>,
}

/// A [`ConfigError`] of `cfg`'s file.
pub(crate) fn cfg_err(cfg_path: &Path, key: &str, problem: impl Into<String>) -> SnnError {
    SnnError::Config(ConfigError::new(key, problem).in_file(cfg_path))
}

/// Compiles the `inputs` table into an [`InputSpec`] for the virtual nodes of `spec`
/// (`run_seed` seeds Poisson inputs without their own seed); returns it with the input
/// names. Reads spike files; writes nothing.
pub(crate) fn inputs_from_config(
    cfg: &SonataConfig,
    inputs: &BTreeMap<String, InputSection>,
    run_seed: u64,
    spec: &NetworkSpec,
) -> Result<(InputSpec, Vec<String>)> {
    let mut input = InputSpec::default();
    let mut names = Vec::new();
    for (name, v) in inputs {
        let key = |k: &str| format!("inputs.{name}.{k}");
        let input_type = v.input_type.as_deref().unwrap_or("spikes");
        let module = v.module.as_deref().unwrap_or("");
        let node_set = v.node_set.as_deref();
        match (input_type, module) {
            ("spikes", "sonata" | "h5" | "hdf5") => {
                let file = v
                    .input_file
                    .as_deref()
                    .ok_or_else(|| cfg_err(&cfg.path, &key("input_file"), "is missing"))?;
                let path = cfg.resolve_path(file);
                if !path.is_file() {
                    return Err(SnnError::InvalidInput {
                        input: format!("inputs.{name}"),
                        reason: format!(
                            "input_file '{}' does not exist; check the path and manifest",
                            path.display()
                        ),
                    });
                }
                let spikes = lockstep_sonata::read_spikes(&path)?;
                let label = path.display().to_string();
                let trains = spike_trains_for_virtual_nodes(spec, &spikes, &label, node_set)?;
                let merged = input
                    .spike_trains
                    .get_or_insert_with(|| vec![Vec::new(); spec.virtual_nodes.len()]);
                for (m, t) in merged.iter_mut().zip(trains) {
                    m.extend(t);
                    m.sort_by(f64::total_cmp);
                }
            }
            ("poisson", _) | ("spikes", "poisson") => {
                let rate = v.rate.ok_or_else(|| {
                    cfg_err(&cfg.path, &key("rate"), "is missing or not a number (Hz)")
                })?;
                let seed = v.seed.unwrap_or(run_seed);
                let ns = node_set.ok_or_else(|| {
                    cfg_err(
                        &cfg.path,
                        &key("node_set"),
                        "is missing (the virtual population to drive)",
                    )
                })?;
                if !spec.virtual_nodes.iter().any(|vn| vn.population == ns) {
                    let pops = spec.virtual_populations();
                    let have = if pops.is_empty() {
                        "the network has none".to_string()
                    } else {
                        format!("the network's: '{}'", pops.join("', '"))
                    };
                    return Err(cfg_err(
                        &cfg.path,
                        &key("node_set"),
                        format!("'{ns}' has no virtual nodes in the network (a virtual population with at least one node is needed; {have})"),
                    ));
                }
                let p = input.poisson.get_or_insert_with(|| PoissonSpec {
                    rates_hz: vec![0.0; spec.virtual_nodes.len()],
                    seed,
                });
                p.seed = seed;
                for (r, vn) in p.rates_hz.iter_mut().zip(&spec.virtual_nodes) {
                    if vn.population == ns {
                        *r = rate;
                    }
                }
            }
            _ => {
                return Err(cfg_err(
                    &cfg.path,
                    &format!("inputs.{name}"),
                    format!(
                        "input_type '{input_type}' with module '{module}' is not supported; use input_type \"spikes\" with module \"sonata\", or input_type \"poisson\""
                    ),
                ))
            }
        }
        names.push(name.clone());
    }
    Ok((input, names))
}

/// `run.dt` (ms) and `run.seq_len` (steps) of a training config, both required.
///
/// Errors: [`SnnError::Config`] naming the missing key.
pub(crate) fn clock(cfg: &SonataConfig, run: &SnnRun) -> Result<(f64, usize)> {
    let dt = run
        .dt
        .ok_or_else(|| cfg_err(&cfg.path, "run.dt", "is missing or not a number (ms)"))?;
    let seq_len = run.seq_len.filter(|&t| t > 0).ok_or_else(|| {
        cfg_err(
            &cfg.path,
            "run.seq_len",
            "is missing or not a positive integer (steps)",
        )
    })?;
    Ok((dt, seq_len as usize))
}

/// Builds a trainable model from a lockstep training config (SONATA/BMTK style).
///
/// Keys read ([`SnnTrainConfig`]; others belong to the training engine and are left to it):
/// * the network (`networks`/`network`, `components`) through `lockstep-sonata`;
/// * `run.dt` (ms) and `run.seq_len` (steps), both required; `run.seed` seeds Poisson inputs;
/// * `inputs` as in `lockstep simulate` (SONATA spike files and/or Poisson virtual nodes);
/// * `training.losses` (`TargetFiringRate`, `VoltageRegularization`; see [`Loss`](crate::Loss)), required;
/// * `training.pseudo_derivative` (see [`SurrogateSection`](crate::SurrogateSection));
/// * `training.gradient_checkpointing`: `false` (default), `true` (chunks of 25 steps) or a
///   chunk size in steps;
/// * `training.train_input_weights`: `false` (default) or `true`;
/// * `run.dtype`: `"float32"` (default: the batched float32 kernels) or `"float64"` (the
///   per-sample double-precision BPTT);
/// * `run.device`: `"cpu"` (default), `"gpu"` or `"gpu:N"` (float32 only); `gpu_slot` is
///   the replica's slot among the node's GPUs (its node-local rank, or its thread index).
///
/// Returns the circuit (for exporting weights) and the model. Writes nothing.
///
/// Errors: [`SnnError::Config`] (`FILE: KEY: PROBLEM`) for a missing or invalid key, and the
/// network, input and model errors of what the config names.
pub fn model_from_config(config: &Path) -> Result<(lockstep_sonata::Circuit, SnnModel)> {
    model_from_config_on(config, 0)
}

/// [`model_from_config`] for the replica in GPU slot `gpu_slot` (see there).
///
/// Errors: those of [`model_from_config`], and no GPU adapter, or one that cannot be opened,
/// when `run.device` asks for a GPU.
pub fn model_from_config_on(
    config: &Path,
    gpu_slot: usize,
) -> Result<(lockstep_sonata::Circuit, SnnModel)> {
    model_from_config_on_device(config, gpu_slot, None)
}

/// [`model_from_config_on`] with `device` in place of the config's `run.device` when given
/// (`lockstep bench bptt --device`).
///
/// Errors: those of [`model_from_config_on`].
pub fn model_from_config_on_device(
    config: &Path,
    gpu_slot: usize,
    device: Option<DeviceRequest>,
) -> Result<(lockstep_sonata::Circuit, SnnModel)> {
    let cfg = SonataConfig::from_file(config)?;
    let mut sections = SnnTrainConfig::from_config(&cfg)?;
    if device.is_some() {
        sections.run.device = device;
    }
    let circuit = lockstep_sonata::Circuit::from_sonata_config(cfg.clone())?;
    let spec = crate::sonata::network_spec_from_circuit(&circuit)?;
    let (dt, seq_len) = clock(&cfg, &sections.run)?;
    let run_seed = sections.run.seed.unwrap_or(0);
    let (input, _) = inputs_from_config(&cfg, &sections.inputs, run_seed, &spec)?;
    let training = sections.training;
    let losses = training.losses.ok_or_else(|| {
        cfg_err(
            &cfg.path,
            "training.losses",
            "is missing; e.g. [{\"name\": \"TargetFiringRate\", \"firing_rate\": 10}]",
        )
    })?;
    let losses = losses.compile(&spec, &cfg.dir)?;
    let surrogate = training
        .pseudo_derivative
        .map(Surrogate::try_from)
        .transpose()
        .map_err(|e| SnnError::Config(e.under("training.pseudo_derivative").in_file(&cfg.path)))?
        .unwrap_or_default();
    let opts = BpttOptions {
        seq_len,
        surrogate,
        train_input_weights: training.train_input_weights.unwrap_or(false),
        gradient_checkpointing: training.gradient_checkpointing.0,
        losses,
        dtype: sections.run.dtype.unwrap_or_default(),
        device: sections.run.device.unwrap_or_default(),
        device_slot: gpu_slot,
        ..Default::default()
    };
    let model = SnnModel::new(&spec, dt, &input, opts).map_err(|e| match e {
        SnnError::Config(c) => SnnError::Config(c.in_file(&cfg.path)),
        e @ SnnError::Gpu(_) if opts_device_is_gpu(&sections.run) => SnnError::Config(
            lockstep_core::config::ConfigError::new("run.device", e.to_string()).in_file(&cfg.path),
        ),
        e => e,
    })?;
    Ok((circuit, model))
}

/// Whether the config's `run.device` asks for a GPU.
fn opts_device_is_gpu(run: &SnnRun) -> bool {
    matches!(run.device, Some(DeviceRequest::Gpu(_)))
}

/// Names of the loss terms of a model, in the order of [`LossAndGrad::terms`](crate::LossAndGrad::terms).
pub fn loss_names(model: &SnnModel) -> Vec<String> {
    model
        .opts
        .losses
        .iter()
        .map(|l| l.name().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sections_read_typed_and_refuse_bad_values_with_the_key() {
        let t: SnnTrainConfig = lockstep_core::config::from_value(
            &json!({"run": {"dt": 0.5, "seq_len": 10, "batch_size": 2},
                    "training": {"gradient_checkpointing": true, "optimizer": {}},
                    "inputs": {"lgn": {"input_type": "poisson", "rate": 5.0, "node_set": "lgn"}}}),
            "",
        )
        .unwrap();
        assert_eq!((t.run.dt, t.run.seq_len), (Some(0.5), Some(10)));
        assert_eq!(t.training.gradient_checkpointing.0, Some(25));
        assert_eq!(t.inputs["lgn"].rate, Some(5.0));
        for (v, key, text) in [
            (
                json!({"run": {"dtype": "flaot32"}}),
                "run.dtype",
                "did you mean `float32`",
            ),
            (
                json!({"training": {"gradient_checkpointing": 0}}),
                "training.gradient_checkpointing",
                "chunk size",
            ),
            (
                json!({"training": {"train_input_weights": "yes"}}),
                "training.train_input_weights",
                "invalid type",
            ),
            (
                json!({"inputs": {"lgn": {"rat": 5.0}}}),
                "inputs.lgn.rat",
                "did you mean `rate`",
            ),
        ] {
            let e = lockstep_core::config::from_value::<SnnTrainConfig>(&v, "").unwrap_err();
            assert_eq!(e.key, key, "{e}");
            assert!(e.problem.contains(text), "{e}");
        }
    }

    /// `training.losses` entries are typed: a bad loss, key or value is refused when the
    /// config is read (before any network is built), naming the entry and the nearest name.
    #[test]
    fn losses_are_checked_when_the_config_is_read() {
        let t: SnnTrainConfig = lockstep_core::config::from_value(
            &json!({"training": {"losses": [
                {"type": "TargetFiringRate", "firing_rate": {"v1": 5.0}},
                {"name": "VoltageRegularization"}]}}),
            "",
        )
        .unwrap();
        assert!(t.training.losses.is_some());
        for (v, key, text) in [
            (
                json!([{"name": "TargetFiringRat", "firing_rate": 5}]),
                "training.losses[0]",
                "unknown value `TargetFiringRat`; did you mean `TargetFiringRate`?",
            ),
            (
                json!([{"name": "VoltageRegularization"}, {"name": "Crossentropy"}]),
                "training.losses[1]",
                "known values: TargetFiringRate, VoltageRegularization",
            ),
            (
                json!({"VoltageRegularization": {"cots": 1}}),
                "training.losses.VoltageRegularization.cots",
                "did you mean `cost`",
            ),
            (
                json!([{"name": "TargetFiringRate", "firing_rate": 5, "rate_unit": "Hz"}]),
                "training.losses[0].rate_unit",
                "did you mean `rate_units`",
            ),
            (
                json!([{"name": "TargetFiringRate", "firing_rate": 5, "rate_units": "hz"}]),
                "training.losses[0]",
                "did you mean `Hz`",
            ),
            (
                json!([{"name": "TargetFiringRate"}]),
                "training.losses[0]",
                "missing field `firing_rate`",
            ),
            (
                json!([{"name": "VoltageRegularization", "cost": "high"}]),
                "training.losses[0]",
                "invalid type",
            ),
            (json!([]), "training.losses", "is empty"),
            (json!(5), "training.losses", "a list or an object of losses"),
        ] {
            let v = json!({"training": {"losses": v}});
            let e = lockstep_core::config::from_value::<SnnTrainConfig>(&v, "").unwrap_err();
            assert_eq!(e.key, key, "{e}");
            assert!(e.problem.contains(text), "{e}");
        }
    }
}
