//! From a config file to a model: the keys of a BMTK-style config that lockstep-snn reads
//! (`run.dt`, `run.seq_len`, `inputs`, the model's part of `training`) and the trainable
//! model built from a training config.

use std::path::Path;

use lockstep_sonata::SonataConfig;
use serde_json::Value;

use crate::bptt::{BpttOptions, Dtype, SnnModel};
use crate::error::{Result, SnnError};
use crate::input::{InputSpec, PoissonSpec};
use crate::network::NetworkSpec;
use crate::scalar::Surrogate;
use crate::sonata::spike_trains_for_virtual_nodes;

pub(crate) fn cfg_err(path: &Path, key: &str, problem: impl Into<String>) -> SnnError {
    SnnError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        problem: problem.into(),
    }
}

pub(crate) fn get_f64(cfg: &SonataConfig, ptr: &str, key: &str) -> Result<Option<f64>> {
    match cfg.json.pointer(ptr) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| cfg_err(&cfg.path, key, format!("must be a number, found {v}"))),
    }
}

pub(crate) fn get_str<'a>(
    cfg: &'a SonataConfig,
    v: &'a Value,
    key: &str,
) -> Result<Option<&'a str>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        other => Err(cfg_err(
            &cfg.path,
            key,
            format!("must be a string, found {other}"),
        )),
    }
}

/// Parses the config's `inputs` (and `run.seed` for Poisson inputs) into an [`InputSpec`]
/// for the virtual nodes of `spec`; returns it with the input names. Reads spike files;
/// writes nothing.
pub(crate) fn inputs_from_config(
    cfg: &SonataConfig,
    spec: &NetworkSpec,
) -> Result<(InputSpec, Vec<String>)> {
    let run_seed = get_f64(cfg, "/run/seed", "run.seed")?.unwrap_or(0.0) as u64;

    let mut input = InputSpec::default();
    let mut names = Vec::new();
    if let Some(inputs) = cfg.json.get("inputs") {
        let Value::Object(map) = inputs else {
            return Err(cfg_err(
                &cfg.path,
                "inputs",
                format!("must be an object, found {inputs}"),
            ));
        };
        for (name, v) in map {
            let key = |k: &str| format!("inputs.{name}.{k}");
            let Value::Object(entry) = v else {
                return Err(cfg_err(
                    &cfg.path,
                    &format!("inputs.{name}"),
                    "must be an object",
                ));
            };
            // Unknown keys are typos (a misspelled `rate` would otherwise be ignored).
            const KNOWN: &[&str] = &[
                "input_type",
                "module",
                "node_set",
                "input_file",
                "rate",
                "seed",
                "trial",
            ];
            lockstep_train::config::check_keys(entry, KNOWN, &format!("inputs.{name}"))
                .map_err(|e| cfg_err(&cfg.path, &e.key, e.problem))?;
            let input_type =
                get_str(cfg, &v["input_type"], &key("input_type"))?.unwrap_or("spikes");
            let module = get_str(cfg, &v["module"], &key("module"))?.unwrap_or("");
            let node_set = get_str(cfg, &v["node_set"], &key("node_set"))?;
            match (input_type, module) {
                ("spikes", "sonata" | "h5" | "hdf5") => {
                    let file = get_str(cfg, &v["input_file"], &key("input_file"))?
                        .ok_or_else(|| cfg_err(&cfg.path, &key("input_file"), "is missing"))?;
                    let path = cfg.resolve_path(file);
                    if !path.is_file() {
                        return Err(SnnError::InvalidInput {
                            input: format!("inputs.{name}"),
                            reason: format!("input_file '{}' does not exist; check the path and manifest", path.display()),
                        });
                    }
                    let spikes = lockstep_sonata::read_spikes(&path)?;
                    let label = path.display().to_string();
                    let trains = spike_trains_for_virtual_nodes(spec, &spikes, &label, node_set)?;
                    let merged = input.spike_trains.get_or_insert_with(|| vec![Vec::new(); spec.virtual_nodes.len()]);
                    for (m, t) in merged.iter_mut().zip(trains) {
                        m.extend(t);
                        m.sort_by(f64::total_cmp);
                    }
                }
                ("poisson", _) | ("spikes", "poisson") => {
                    let rate = v["rate"]
                        .as_f64()
                        .ok_or_else(|| cfg_err(&cfg.path, &key("rate"), "is missing or not a number (Hz)"))?;
                    let seed = v["seed"].as_u64().unwrap_or(run_seed);
                    let ns = node_set.ok_or_else(|| {
                        cfg_err(&cfg.path, &key("node_set"), "is missing (the virtual population to drive)")
                    })?;
                    if !spec.virtual_nodes.iter().any(|vn| vn.population == ns) {
                        return Err(cfg_err(&cfg.path, &key("node_set"), format!("'{ns}' has no virtual nodes in the network (a virtual population with at least one node is needed)")));
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
    }
    Ok((input, names))
}

/// Builds a trainable model from a lockstep training config (SONATA/BMTK style).
///
/// Keys read (others belong to the training engine and are left to it):
/// * the network (`networks`/`network`, `components`) through `lockstep-sonata`;
/// * `run.dt` (ms) and `run.seq_len` (steps), both required; `run.seed` seeds Poisson inputs;
/// * `inputs` as in `lockstep simulate` (SONATA spike files and/or Poisson virtual nodes);
/// * `training.losses` (`TargetFiringRate`, `VoltageRegularization`; see [`Loss`](crate::Loss)), required;
/// * `training.pseudo_derivative` (see [`Surrogate::from_json`]);
/// * `training.gradient_checkpointing`: `false` (default), `true` (chunks of 25 steps) or a
///   chunk size in steps;
/// * `training.train_input_weights`: `false` (default) or `true`;
/// * `run.dtype`: `"float32"` (default: the batched float32 kernels) or `"float64"` (the
///   per-sample double-precision BPTT).
///
/// Returns the circuit (for exporting weights) and the model. Writes nothing.
pub fn model_from_config(config: &std::path::Path) -> Result<(lockstep_sonata::Circuit, SnnModel)> {
    use serde_json::Value;
    let cfg = lockstep_sonata::SonataConfig::from_file(config)?;
    let circuit = lockstep_sonata::Circuit::from_sonata_config(cfg.clone())?;
    let spec = crate::sonata::network_spec_from_circuit(&circuit)?;
    let err = |key: &str, problem: String| SnnError::Config {
        path: cfg.path.clone(),
        key: key.into(),
        problem,
    };
    let dt = cfg
        .json
        .pointer("/run/dt")
        .and_then(Value::as_f64)
        .ok_or_else(|| err("run.dt", "is missing or not a number (ms)".into()))?;
    let seq_len = cfg
        .json
        .pointer("/run/seq_len")
        .and_then(Value::as_u64)
        .filter(|&t| t > 0)
        .ok_or_else(|| {
            err(
                "run.seq_len",
                "is missing or not a positive integer (steps)".into(),
            )
        })? as usize;
    let (input, _) = inputs_from_config(&cfg, &spec)?;
    let training = cfg.json.get("training").cloned().unwrap_or(Value::Null);
    let losses_v = training.get("losses").ok_or_else(|| {
        err(
            "training.losses",
            "is missing; e.g. [{\"name\": \"TargetFiringRate\", \"firing_rate\": 10}]".into(),
        )
    })?;
    let losses = crate::loss::losses_from_json(losses_v, &spec, &cfg.dir)?;
    if losses.is_empty() {
        return Err(err("training.losses", "is empty".into()));
    }
    let surrogate = Surrogate::from_json(training.get("pseudo_derivative"))?;
    let gradient_checkpointing = match training.get("gradient_checkpointing") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(25),
        Some(v) => Some(v.as_u64().filter(|&k| k > 0).ok_or_else(|| {
            err(
                "training.gradient_checkpointing",
                format!("{v} must be true, false or a chunk size in steps"),
            )
        })? as usize),
    };
    let train_input_weights = match training.get("train_input_weights") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(err(
                "training.train_input_weights",
                format!("{v} must be true or false"),
            ))
        }
    };
    let dtype = match cfg.json.pointer("/run/dtype") {
        None | Some(Value::Null) => Dtype::Float32,
        Some(Value::String(s)) if s == "float32" => Dtype::Float32,
        Some(Value::String(s)) if s == "float64" => Dtype::Float64,
        Some(v) => {
            return Err(err(
                "run.dtype",
                format!("{v} is not supported; use \"float32\" (default) or \"float64\""),
            ))
        }
    };
    let opts = BpttOptions {
        seq_len,
        surrogate,
        train_input_weights,
        gradient_checkpointing,
        losses,
        dtype,
        ..Default::default()
    };
    let model = SnnModel::new(&spec, dt, &input, opts)?;
    Ok((circuit, model))
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
