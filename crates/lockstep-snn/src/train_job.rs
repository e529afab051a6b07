//! A training job of a spiking network from its config file, as `lockstep train` and the
//! Python package's `lockstep.train` run it: the config read and checked (unknown keys
//! refused with the nearest key, [`check_config`]), overrides applied ([`prepare`]), every
//! MPI rank agreeing on the verdict before anything is written, then the engine's job with
//! one [`SnnReplica`] per replica ([`train_config`]).

use crate::{
    DeviceRequest, PoissonTrials, SnnOutput, SnnReplica, SnnRun, SnnTrainConfig, SnnTraining,
};
use anyhow::{Context, Result};
use lockstep_comm::World;
use lockstep_core::config::{check_keys, field_names, from_value, ConfigError};
use lockstep_sonata::{SonataConfig, CIRCUIT_KEYS};
use lockstep_train::config::{EngineConfig, EngineOutput, EngineRun, EngineTraining, Strategy};
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::{EngineOptions, TrainError, TrainSummary};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Rejects unknown keys (with the nearest known key) and unsupported values: the top level
/// against the circuit's and the model's sections, the shared sections (`run`, `training`,
/// `output`) against the union of the engine's and the model's keys, and the model's
/// sections by reading them.
///
/// Errors: a [`ConfigError`] naming the key (no file; the caller adds it).
pub fn check_config(json: &Value) -> Result<(), ConfigError> {
    let obj = json
        .as_object()
        .ok_or_else(|| ConfigError::new("", "the config must be a JSON object"))?;
    check_keys(
        obj,
        &[CIRCUIT_KEYS, field_names::<SnnTrainConfig>()].concat(),
        "",
    )?;
    let sections: [(&str, &[&str], &[&str]); 3] = [
        ("run", field_names::<EngineRun>(), field_names::<SnnRun>()),
        (
            "training",
            field_names::<EngineTraining>(),
            field_names::<SnnTraining>(),
        ),
        (
            "output",
            field_names::<EngineOutput>(),
            field_names::<SnnOutput>(),
        ),
    ];
    for (name, engine, model) in sections {
        if let Some(sec) = json.get(name).and_then(Value::as_object) {
            check_keys(sec, &[engine, model].concat(), name)?;
        }
    }
    from_value::<SnnTrainConfig>(json, "").map(drop)
}

/// Overrides of a training config (`lockstep train`'s flags, the Python keywords).
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
    let model: SnnTrainConfig = from_value(&json, "").map_err(|e| e.in_file(config))?;
    if let Some(spikes) = &model.output.training_spikes {
        spikes
            .validate(cfg.updates)
            .map_err(|e| e.in_file(config))?;
    }
    Ok((json, cfg))
}

/// Reads the config at `config`, applies `overrides`, and trains on this process's share of
/// `world` (every rank of an MPI job calls it); `resume` continues from a checkpoint (any
/// replica count), `force_cpu` computes on the CPU whatever `run.device` says. Under MPI
/// every rank reads the config and the ranks agree on any error before anything is written.
/// Notes on stderr: the device a replica computes on when it is not the CPU, and the
/// warning of a software GPU adapter.
///
/// Errors: config errors (agreed across ranks, see [`TrainError::is_agreed`], as a
/// [`TrainError`] inside the `anyhow::Error`) and every error of the run.
pub fn train_config(
    world: &World,
    config: &Path,
    overrides: &Overrides,
    resume: Option<PathBuf>,
    force_cpu: bool,
) -> Result<TrainSummary> {
    let prepared = prepare(config, overrides).map_err(TrainError::Build);
    let (json, cfg) = agree_on_validation(world.comm(), prepared)?;
    // Serial runs use every core for the trials of a batch; replicas compute on one core each.
    let parallel = cfg.distribution.is_none();
    let opts = EngineOptions {
        resolved_config: json,
        resume,
        ..EngineOptions::default()
    };
    // The GPU slot of a replica: its index among thread replicas, or under MPI its
    // node-local rank (each rank binds the GPU its launcher allocated on its node).
    let threads = cfg
        .distribution
        .as_ref()
        .is_some_and(|d| d.strategy == Strategy::Threads);
    let local_rank = world.launch.local_rank;
    let summary = run_job(world, &cfg, &opts, |rank| {
        let slot = if threads { rank } else { local_rank };
        let device = force_cpu.then_some(DeviceRequest::Cpu);
        let replica = SnnReplica::from_config_on_device(config, parallel, slot, device)?;
        let device = replica.model().device_description();
        if device != "cpu" && (rank == 0 || device.contains("shared")) {
            eprintln!("rank {rank}: computes on {device}");
        }
        if rank == 0 {
            if let Some(warning) = replica.model().software_adapter_warning() {
                eprintln!("{warning}");
            }
        }
        Ok((replica, PoissonTrials))
    })?;
    Ok(summary)
}

/// Whether the training config at `path` sets `run.device` to a GPU (read leniently: any
/// error leaves it to the real reading of the config).
pub fn asks_for_gpu(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["run"]["device"].as_str().map(|d| d.starts_with("gpu")))
        .unwrap_or(false)
}
