//! `lockstep train CONFIG`: trains a SONATA point-neuron network with BPTT, serially or
//! sample-parallel (threads or MPI), as `run.distribution` says.

use anyhow::{Context, Result};
use lockstep_comm::World;
use lockstep_core::config::{check_keys, field_names, ConfigError};
use lockstep_snn::{PoissonTrials, SnnReplica};
use lockstep_sonata::SonataConfig;
use lockstep_train::config::{EngineConfig, EngineOutput, EngineRun, EngineTraining};
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::{EngineOptions, TrainError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Options of `lockstep train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The training config (SONATA/BMTK style: manifest, networks, inputs, run, training, output).
    pub config: PathBuf,
    /// Continue from this checkpoint (any replica count).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override training.optimizer_updates (e.g. a short smoke run).
    #[arg(long)]
    pub updates: Option<u64>,
    /// Override output.output_dir.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Override output.overwrite_output_dir to true.
    #[arg(long)]
    pub overwrite: bool,
}

/// Top-level keys of a training config.
const TOP_KEYS: &[&str] = &[
    "manifest",
    "components",
    "networks",
    "network",
    "inputs",
    "run",
    "training",
    "output",
    "target_simulator",
    "node_sets",
    "node_sets_file",
];
/// Keys of `run` read by the model.
const MODEL_RUN_KEYS: &[&str] = &["dt", "seq_len", "dtype"];
/// Keys of `training` read by the model.
const MODEL_TRAINING_KEYS: &[&str] = &[
    "losses",
    "pseudo_derivative",
    "gradient_checkpointing",
    "train_input_weights",
];
/// Keys of `output` read by the simulate-style outputs.
const MODEL_OUTPUT_KEYS: &[&str] = &["spikes_file", "spikes_file_csv"];

/// Rejects unknown keys (with the nearest known key) and unsupported values: the shared
/// sections against the union of the engine's and the model's keys.
///
/// Errors: a [`ConfigError`] naming the key (no file; the caller adds it).
pub fn check_config(json: &Value) -> Result<(), ConfigError> {
    let obj = json
        .as_object()
        .ok_or_else(|| ConfigError::new("", "the config must be a JSON object"))?;
    check_keys(obj, TOP_KEYS, "")?;
    let sections: [(&str, &[&str], &[&str]); 3] = [
        ("run", field_names::<EngineRun>(), MODEL_RUN_KEYS),
        (
            "training",
            field_names::<EngineTraining>(),
            MODEL_TRAINING_KEYS,
        ),
        ("output", field_names::<EngineOutput>(), MODEL_OUTPUT_KEYS),
    ];
    for (name, engine, model) in sections {
        if let Some(sec) = json.get(name).and_then(Value::as_object) {
            check_keys(sec, &[engine, model].concat(), name)?;
        }
    }
    match json.pointer("/run/dtype").and_then(Value::as_str) {
        None | Some("float32") | Some("float64") => Ok(()),
        Some(other) => Err(ConfigError::new(
            "run.dtype",
            format!("{other:?} is not supported; use \"float32\" (default) or \"float64\""),
        )),
    }
}

/// Command-line overrides of a training config.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// training.optimizer_updates.
    pub updates: Option<u64>,
    /// output.output_dir.
    pub output_dir: Option<PathBuf>,
    /// output.overwrite_output_dir = true.
    pub overwrite: bool,
    /// run.distribution (`Some(Value::Null)` removes it: a serial run).
    pub distribution: Option<Value>,
    /// training.checkpoint_every.
    pub checkpoint_every: Option<u64>,
    /// training.optimizer (replaces the whole object).
    pub optimizer: Option<Value>,
}

/// Reads and checks a training config, applies `overrides`, and returns the resolved JSON
/// (manifest substituted, paths resolved) with the engine's part of it.
///
/// Errors: unreadable config, unknown keys, invalid engine settings.
pub fn prepare(config: &Path, overrides: &Overrides) -> Result<(Value, EngineConfig)> {
    let sonata = SonataConfig::from_file(config)?;
    let mut json = sonata.json.clone();
    check_config(&json).map_err(|e| e.in_file(config))?;
    let root = json.as_object_mut().context("config")?;
    if let Some(u) = overrides.updates {
        let t = root.entry("training").or_insert(json!({}));
        t["optimizer_updates"] = json!(u);
        if let Some(t) = t.as_object_mut() {
            t.remove("epochs");
        }
    }
    if let Some(o) = &overrides.optimizer {
        root.entry("training").or_insert(json!({}))["optimizer"] = o.clone();
    }
    if let Some(k) = overrides.checkpoint_every {
        root.entry("training").or_insert(json!({}))["checkpoint_every"] = json!(k);
    }
    if let Some(d) = &overrides.distribution {
        let run = root.entry("run").or_insert(json!({}));
        match d {
            Value::Null => {
                if let Some(r) = run.as_object_mut() {
                    r.remove("distribution");
                }
            }
            d => run["distribution"] = d.clone(),
        }
    }
    if let Some(dir) = &overrides.output_dir {
        root.entry("output").or_insert(json!({}))["output_dir"] =
            json!(std::path::absolute(dir)?.to_string_lossy());
    }
    if overrides.overwrite {
        root.entry("output").or_insert(json!({}))["overwrite_output_dir"] = json!(true);
    }
    let cfg = EngineConfig::from_json(&json, &sonata.dir).map_err(|e| match e {
        TrainError::Config(c) => TrainError::Config(c.in_file(config)),
        other => other,
    })?;
    Ok((json, cfg))
}

/// Reads the config, applies the command-line overrides, and trains. Under MPI every rank
/// reads the config and the ranks agree on any error before anything is written.
///
/// Errors: config errors (agreed across ranks, see [`TrainError::is_agreed`]) and every
/// error of the run.
pub fn run(args: &TrainArgs, world: &World) -> Result<()> {
    let overrides = Overrides {
        updates: args.updates,
        output_dir: args.output_dir.clone(),
        overwrite: args.overwrite,
        ..Overrides::default()
    };
    let prepared = prepare(&args.config, &overrides).map_err(TrainError::Build);
    let (json, cfg) = agree_on_validation(world.comm(), prepared)?;
    // Serial runs use every core for the trials of a batch; replicas compute on one core each.
    let parallel = cfg.distribution.is_none();
    let opts = EngineOptions {
        resolved_config: json,
        resume: args.resume.clone(),
        ..EngineOptions::default()
    };
    let config: &Path = &args.config;
    run_job(world, &cfg, &opts, |_rank| {
        Ok((SnnReplica::from_config(config, parallel)?, PoissonTrials))
    })?;
    Ok(())
}
