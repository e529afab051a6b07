//! `lockstep train CONFIG`: trains a SONATA point-neuron network with BPTT, serially or
//! sample-parallel (threads or MPI), as `run.distribution` says.

use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_snn::{PoissonTrials, SnnReplica};
use lockstep_sonata::SonataConfig;
use lockstep_train::config::{check_keys, EngineConfig, OUTPUT_KEYS, RUN_KEYS, TRAINING_KEYS};
use lockstep_train::job::run_job;
use lockstep_train::TrainOptions;
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

/// Rejects unknown keys (with the nearest known key) and unsupported values.
pub fn check_config(json: &Value) -> Result<()> {
    let obj = json
        .as_object()
        .context("the config must be a JSON object")?;
    check_keys(obj, TOP_KEYS, "config")?;
    let sections: [(&str, &[&str], &[&str]); 3] = [
        ("run", RUN_KEYS, MODEL_RUN_KEYS),
        ("training", TRAINING_KEYS, MODEL_TRAINING_KEYS),
        ("output", OUTPUT_KEYS, MODEL_OUTPUT_KEYS),
    ];
    for (name, engine, model) in sections {
        if let Some(sec) = json.get(name).and_then(Value::as_object) {
            let allowed: Vec<&str> = engine.iter().chain(model).copied().collect();
            check_keys(sec, &allowed, name)?;
        }
    }
    match json.pointer("/run/dtype").and_then(Value::as_str) {
        None | Some("float32") => {}
        Some(other) => bail!("config error at `run.dtype`: {other:?} is not supported; lockstep trains in \"float32\""),
    }
    Ok(())
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
    check_config(&json)?;
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
    let cfg = EngineConfig::from_json(&json, &sonata.dir)?;
    Ok((json, cfg))
}

/// Reads the config, applies the command-line overrides, and trains.
pub fn run(args: &TrainArgs, world: &World) -> Result<()> {
    let overrides = Overrides {
        updates: args.updates,
        output_dir: args.output_dir.clone(),
        overwrite: args.overwrite,
        ..Overrides::default()
    };
    let (json, cfg) = prepare(&args.config, &overrides)?;
    // Serial runs use every core for the trials of a batch; replicas compute on one core each.
    let parallel = cfg.distribution.is_none();
    let opts = TrainOptions {
        resolved_config: json,
        resume: args.resume.clone(),
        quiet: false,
    };
    let config: &Path = &args.config;
    run_job(world, &cfg, &opts, |_rank| {
        Ok((SnnReplica::from_config(config, parallel)?, PoissonTrials))
    })?;
    Ok(())
}
