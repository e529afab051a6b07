//! `lockstep-train-check CONFIG [--resume CHECKPOINT]`: trains the reference linear model
//! (`lockstep_train::reference`) with the engine under the current launch (serial, threads or
//! `mpirun`), to check an installation and to test the engine end to end.
//!
//! The config is a training config (`run`, `training`, `output`) plus
//! `"model": {"dim": 8, "init_by_rank": false, "diverge_at": [update, rank], "dataset": n}`.
//! Prints the summary as one JSON line on the chief: updates, final losses, loss history and
//! the parameters' checksum.

use lockstep_comm::World;
use lockstep_train::config::{check_keys, OUTPUT_KEYS, RUN_KEYS, TRAINING_KEYS};
use lockstep_train::job::run_job;
use lockstep_train::reference::{LinearRegression, RegressionData};
use lockstep_train::{EngineConfig, TrainError, TrainOptions};
use serde_json::Value;
use std::path::PathBuf;

fn main() {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap_or_else(|e| {
        eprintln!("lockstep-train-check: {e}");
        std::process::exit(2)
    });
    if let Err(e) = run(&world) {
        world.fail(&e);
    }
}

fn run(world: &World) -> Result<(), TrainError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: lockstep-train-check CONFIG [--resume CHECKPOINT]\n\ntrains the reference linear model with the engine under the current launch (serial, threads, mpirun)");
        return Ok(());
    }
    let path = PathBuf::from(args.first().ok_or_else(|| {
        TrainError::config(
            "argv",
            "usage: lockstep-train-check CONFIG [--resume CHECKPOINT]",
        )
    })?);
    let resume = match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("--resume"), Some(p)) => Some(PathBuf::from(p)),
        (None, _) => None,
        _ => {
            return Err(TrainError::config(
                "argv",
                "usage: lockstep-train-check CONFIG [--resume CHECKPOINT]",
            ))
        }
    };
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| TrainError::io(&path, e))?;
    if let Some(obj) = config.as_object() {
        check_keys(obj, &["run", "training", "output", "model"], "")?;
    }
    for (section, keys) in [
        ("run", RUN_KEYS),
        ("training", TRAINING_KEYS),
        ("output", OUTPUT_KEYS),
    ] {
        if let Some(obj) = config.get(section).and_then(Value::as_object) {
            check_keys(obj, keys, section)?;
        }
    }
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let cfg = EngineConfig::from_json(&config, dir)?;
    let model = config.get("model").cloned().unwrap_or(Value::Null);
    let empty = serde_json::Map::new();
    let model = match &model {
        Value::Null => &empty,
        Value::Object(m) => m,
        other => {
            return Err(TrainError::config(
                "model",
                format!("must be an object, found {other}"),
            ))
        }
    };
    check_keys(
        model,
        &["dim", "init_by_rank", "diverge_at", "dataset"],
        "model",
    )?;
    let uint = |key: &str| -> Result<Option<u64>, TrainError> {
        match model.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                TrainError::config(
                    format!("model.{key}"),
                    format!("must be a non-negative integer, found {v}"),
                )
            }),
        }
    };
    let dim = uint("dim")?.unwrap_or(8) as usize;
    if !(1..=1 << 20).contains(&dim) {
        return Err(TrainError::config(
            "model.dim",
            format!("{dim} must be between 1 and 1048576"),
        ));
    }
    let by_rank = match model.get("init_by_rank") {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| {
            TrainError::config(
                "model.init_by_rank",
                format!("must be true or false, found {v}"),
            )
        })?,
    };
    let dataset = uint("dataset")?;
    let diverge = match model.get("diverge_at") {
        None => None,
        Some(v) => match v
            .as_array()
            .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
            .as_deref()
        {
            Some([Some(u), Some(r)]) => Some((*u, *r as usize)),
            _ => {
                return Err(TrainError::config(
                    "model.diverge_at",
                    format!("must be [update, rank], found {v}"),
                ))
            }
        },
    };
    let opts = TrainOptions {
        resolved_config: config.clone(),
        resume,
        quiet: false,
    };
    let seed = cfg.seed;
    let summary = run_job(world, &cfg, &opts, |rank| {
        let init = if by_rank { rank as u64 } else { 0 };
        Ok((
            LinearRegression::new(dim, seed, rank, init, diverge),
            RegressionData { dim, seed, dataset },
        ))
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
