//! `lockstep-train-check CONFIG [--resume CHECKPOINT] [--inject-failure FAULT]`: trains the
//! reference linear model (`lockstep_train::reference`) with the engine under the current
//! launch (serial, threads or `mpirun`), to check an installation and to test the engine end
//! to end.
//!
//! The config is a training config (`run`, `training`, `output`) plus
//! `"model": {"dim": 8, "init_by_rank": false, "diverge_at": [update, rank], "dataset": n,
//! "memory_per_sample": bytes}`. `--inject-failure` takes a [`Fault`] (`validation`,
//! `output_setup`, `update:K:RANK`, `callback:K`). Prints the summary as one JSON line on the
//! chief: updates, final losses, loss history and the parameters' checksum.

use lockstep_comm::World;
use lockstep_core::config::{check_keys, config_dir, field_names, from_value, read_json};
use lockstep_train::config::{EngineOutput, EngineRun, EngineTraining};
use lockstep_train::job::{agree_on_validation, run_job};
use lockstep_train::reference::{LinearRegression, RegressionData};
use lockstep_train::testing::Fault;
use lockstep_train::{EngineConfig, EngineOptions, TrainError};
use serde::Deserialize;
use serde_json::Value;
use std::path::PathBuf;

const USAGE: &str =
    "usage: lockstep-train-check CONFIG [--resume CHECKPOINT] [--inject-failure FAULT]";

/// `model` of the check config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    #[serde(default = "default_dim")]
    dim: usize,
    #[serde(default)]
    init_by_rank: bool,
    #[serde(default)]
    diverge_at: Option<(u64, usize)>,
    #[serde(default)]
    dataset: Option<u64>,
    #[serde(default)]
    memory_per_sample: Option<u64>,
}

fn default_dim() -> usize {
    8
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            dim: default_dim(),
            init_by_rank: false,
            diverge_at: None,
            dataset: None,
            memory_per_sample: None,
        }
    }
}

fn main() {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap_or_else(|e| {
        eprintln!("lockstep-train-check: {e}");
        std::process::exit(2)
    });
    if let Err(e) = run(&world) {
        let rank = world.comm().rank();
        if e.is_agreed() {
            // Every rank knows: one reports, all leave through MPI_Finalize.
            if !matches!(e, TrainError::RefusedByPeer { .. }) {
                lockstep_comm::eprint_flush(&format!(
                    "lockstep-train-check: error on rank {rank}: {:#}",
                    anyhow::Error::from(e)
                ));
            }
            drop(world);
            std::process::exit(1);
        }
        world.fail(&anyhow::Error::from(e));
    }
}

fn usage() -> TrainError {
    TrainError::config("argv", USAGE)
}

/// Reads the arguments and the config (nothing is written).
fn prepare(args: &[String]) -> Result<(EngineConfig, EngineOptions, ModelSection), TrainError> {
    let path = PathBuf::from(args.first().ok_or_else(usage)?);
    let (mut resume, mut fault) = (None, None);
    let mut rest = args[1..].iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(usage)?;
        match flag.as_str() {
            "--resume" => resume = Some(PathBuf::from(value)),
            "--inject-failure" => {
                fault = Some(
                    value
                        .parse::<Fault>()
                        .map_err(|m| TrainError::config("--inject-failure", m))?,
                )
            }
            _ => return Err(usage()),
        }
    }
    let config = read_json(&path)?;
    let in_file = |e: lockstep_core::config::ConfigError| e.in_file(&path);
    if let Some(obj) = config.as_object() {
        check_keys(obj, &["run", "training", "output", "model"], "").map_err(in_file)?;
    }
    for (section, keys) in [
        ("run", field_names::<EngineRun>()),
        ("training", field_names::<EngineTraining>()),
        ("output", field_names::<EngineOutput>()),
    ] {
        if let Some(obj) = config.get(section).and_then(Value::as_object) {
            check_keys(obj, keys, section).map_err(in_file)?;
        }
    }
    let cfg = EngineConfig::from_json(&config, &config_dir(&path)).map_err(|e| match e {
        TrainError::Config(c) => TrainError::Config(c.in_file(&path)),
        other => other,
    })?;
    let model: ModelSection = match config.get("model") {
        None => ModelSection::default(),
        Some(v) => from_value(v, "model").map_err(in_file)?,
    };
    if !(1..=1 << 20).contains(&model.dim) {
        return Err(TrainError::config(
            "model.dim",
            format!("{} must be between 1 and 1048576", model.dim),
        ));
    }
    let opts = EngineOptions {
        resolved_config: config.clone(),
        resume,
        quiet: false,
        fault,
        ..EngineOptions::default()
    };
    Ok((cfg, opts, model))
}

fn run(world: &World) -> Result<(), TrainError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}\n\ntrains the reference linear model with the engine under the current launch (serial, threads, mpirun)");
        return Ok(());
    }
    // Every rank reads the same arguments and files: they agree on any error.
    let (cfg, opts, model) = agree_on_validation(world.comm(), prepare(&args))?;
    let seed = cfg.seed;
    let summary = run_job(world, &cfg, &opts, |rank| {
        let init = if model.init_by_rank { rank as u64 } else { 0 };
        let mut m = LinearRegression::new(model.dim, seed, rank, init, model.diverge_at);
        if let Some(bytes) = model.memory_per_sample {
            m = m.with_memory_per_sample(bytes);
        }
        let data = RegressionData {
            dim: model.dim,
            seed,
            dataset: model.dataset,
        };
        Ok((m, data))
    })?;
    if world.comm().is_chief() {
        println!(
            "{}",
            serde_json::json!({
                "updates": summary.updates,
                "final_losses": summary.final_losses,
                "loss_history": summary.loss_history,
                "checksum": format!("{:016x}", summary.params_checksum),
            })
        );
    }
    Ok(())
}
