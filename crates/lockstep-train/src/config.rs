//! The engine's part of a training config (`run`, `training`, `output`) and the distribution
//! plan derived from it and from the launch.
//!
//! The engine reads only its own keys; the model reads the rest. [`check_keys`] rejects
//! unknown keys with the nearest known key suggested, so the caller that knows the whole schema
//! (engine keys + model keys) can reject typos.

use crate::optim::{OptimizerConfig, Schedule};
use crate::TrainError;
use lockstep_comm::launch::LaunchEnv;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Keys of `run` the engine reads.
pub const RUN_KEYS: &[&str] = &["batch_size", "seed", "distribution"];
/// Keys of `training` the engine reads.
pub const TRAINING_KEYS: &[&str] = &[
    "optimizer",
    "optimizer_updates",
    "epochs",
    "steps_per_epoch",
    "gradient_updates_per_optimizer_step",
    "checkpoint_every",
    "checksum_every",
    "early_stop_loss",
    "log_every",
];
/// Keys of `output` the engine reads.
pub const OUTPUT_KEYS: &[&str] = &["output_dir", "overwrite_output_dir", "log_file"];
/// Keys of `run.distribution`.
pub const DISTRIBUTION_KEYS: &[&str] = &["strategy", "devices", "global_batch_size"];

/// How replicas are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// One process per device, launched by `mpirun`/`srun` (recommended).
    Mpi,
    /// One process, one thread per device (`"threads"`, synonym `"mirrored"`).
    Threads,
}

/// `run.distribution`.
#[derive(Debug, Clone, PartialEq)]
pub struct DistributionConfig {
    /// `strategy`: `"mpi"`, `"threads"` or `"mirrored"`.
    pub strategy: Strategy,
    /// `devices`: explicit device list such as `["cpu:0", "cpu:1"]`.
    pub devices: Option<Vec<String>>,
    /// `global_batch_size`: must equal `run.batch_size x replicas`.
    pub global_batch_size: Option<usize>,
}

/// The engine's settings, read from a config's `run`, `training` and `output` sections.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// `run.batch_size`: samples per replica per micro-batch (the local batch).
    pub batch_size: usize,
    /// `run.seed`: seeds every random stream (keyed with the global sample index).
    pub seed: u64,
    /// `run.distribution`; `None` is a serial run.
    pub distribution: Option<DistributionConfig>,
    /// `training.optimizer`.
    pub optimizer: OptimizerConfig,
    /// Optimizer updates to run: `training.optimizer_updates`, or `epochs x steps_per_epoch`.
    pub updates: u64,
    /// `training.steps_per_epoch` (updates per epoch; default: all updates are one epoch).
    pub steps_per_epoch: u64,
    /// `training.gradient_updates_per_optimizer_step` (micro-batches per update, default 1).
    pub accumulation: usize,
    /// `training.checkpoint_every` updates (0 = only at the end).
    pub checkpoint_every: u64,
    /// `training.checksum_every` updates: compare parameter checksums across replicas (default 10).
    pub checksum_every: u64,
    /// `training.early_stop_loss`: stop once the reduced total loss falls below this value.
    pub early_stop_loss: Option<f64>,
    /// `training.log_every` updates (default 1).
    pub log_every: u64,
    /// `output.output_dir` (resolved against the config's folder).
    pub output_dir: PathBuf,
    /// `output.overwrite_output_dir` (default false: an existing directory is an error).
    pub overwrite_output_dir: bool,
    /// `output.log_file` (default `run.log`, inside the output directory).
    pub log_file: String,
}

/// Levenshtein distance, for "did you mean" suggestions.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The known key nearest to `key` (Levenshtein distance), for "did you mean" messages.
pub fn nearest_key<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    known.iter().min_by_key(|k| distance(key, k)).copied()
}

/// Rejects keys of `obj` not in `allowed`, suggesting the nearest known key.
///
/// Errors: [`TrainError::Config`] naming `path.key` and the suggestion.
pub fn check_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    path: &str,
) -> Result<(), TrainError> {
    for key in obj.keys() {
        if !allowed.contains(&key.as_str()) {
            let nearest = nearest_key(key, allowed);
            let hint = match nearest {
                Some(n) if distance(key, n) <= 3 => format!("; did you mean `{n}`?"),
                _ => format!("; known keys: {}", allowed.join(", ")),
            };
            return Err(TrainError::config(
                format!("{path}.{key}"),
                format!("unknown key{hint}"),
            ));
        }
    }
    Ok(())
}

fn section<'a>(root: &'a Value, name: &str) -> Result<&'a Map<String, Value>, TrainError> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    match root.get(name) {
        None => Ok(EMPTY.get_or_init(Map::new)),
        Some(Value::Object(m)) => Ok(m),
        Some(other) => Err(TrainError::config(
            name,
            format!("must be an object, found {other}"),
        )),
    }
}

pub(crate) fn get_u64(
    obj: &Map<String, Value>,
    path: &str,
    key: &str,
) -> Result<Option<u64>, TrainError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            TrainError::config(
                format!("{path}.{key}"),
                format!("must be a non-negative integer, found {v}"),
            )
        }),
    }
}

pub(crate) fn get_f64(
    obj: &Map<String, Value>,
    path: &str,
    key: &str,
) -> Result<Option<f64>, TrainError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            TrainError::config(
                format!("{path}.{key}"),
                format!("must be a number, found {v}"),
            )
        }),
    }
}

fn get_bool(obj: &Map<String, Value>, path: &str, key: &str) -> Result<Option<bool>, TrainError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| {
            TrainError::config(
                format!("{path}.{key}"),
                format!("must be true or false, found {v}"),
            )
        }),
    }
}

pub(crate) fn get_str<'a>(
    obj: &'a Map<String, Value>,
    path: &str,
    key: &str,
) -> Result<Option<&'a str>, TrainError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            TrainError::config(
                format!("{path}.{key}"),
                format!("must be a string, found {v}"),
            )
        }),
    }
}

fn parse_distribution(v: &Value) -> Result<DistributionConfig, TrainError> {
    let path = "run.distribution";
    let obj = v
        .as_object()
        .ok_or_else(|| TrainError::config(path, format!("must be an object, found {v}")))?;
    check_keys(obj, DISTRIBUTION_KEYS, path)?;
    let strategy = match get_str(obj, path, "strategy")? {
        Some("mpi") => Strategy::Mpi,
        Some("threads") | Some("mirrored") => Strategy::Threads,
        Some(other) => {
            return Err(TrainError::config(
                "run.distribution.strategy",
                format!("{other:?} is not a strategy; use \"mpi\" (one process per device) or \"threads\" (one thread per device; synonym \"mirrored\")"),
            ))
        }
        None => {
            return Err(TrainError::config(
                "run.distribution.strategy",
                "missing; use \"mpi\" or \"threads\"",
            ))
        }
    };
    let devices = match obj.get("devices") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|d| {
                    d.as_str().map(str::to_string).ok_or_else(|| {
                        TrainError::config(
                            "run.distribution.devices",
                            format!("entries must be strings such as \"cpu:0\", found {d}"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(other) => {
            return Err(TrainError::config(
                "run.distribution.devices",
                format!("must be a list such as [\"cpu:0\", \"cpu:1\"], found {other}"),
            ))
        }
    };
    let global_batch_size = get_u64(obj, path, "global_batch_size")?.map(|g| g as usize);
    Ok(DistributionConfig {
        strategy,
        devices,
        global_batch_size,
    })
}

impl EngineConfig {
    /// Reads the engine's keys from a resolved config (`run`, `training`, `output`); relative
    /// `output_dir` is resolved against `config_dir`. Unknown keys are the caller's to check.
    ///
    /// Errors: [`TrainError::Config`] naming the key, the value and the fix.
    pub fn from_json(config: &Value, config_dir: &Path) -> Result<EngineConfig, TrainError> {
        let run = section(config, "run")?;
        let training = section(config, "training")?;
        let output = section(config, "output")?;
        let batch_size = get_u64(run, "run", "batch_size")?.ok_or_else(|| {
            TrainError::config(
                "run.batch_size",
                "missing; set the samples per replica, e.g. 16",
            )
        })? as usize;
        if batch_size == 0 {
            return Err(TrainError::config("run.batch_size", "must be at least 1"));
        }
        let seed = get_u64(run, "run", "seed")?.unwrap_or(0);
        let distribution = match run.get("distribution") {
            None | Some(Value::Null) => None,
            Some(v) => Some(parse_distribution(v)?),
        };
        let optimizer = OptimizerConfig::from_json(training.get("optimizer"))?;
        let epochs = get_u64(training, "training", "epochs")?;
        let steps_per_epoch = get_u64(training, "training", "steps_per_epoch")?;
        let updates = match (
            get_u64(training, "training", "optimizer_updates")?,
            epochs,
            steps_per_epoch,
        ) {
            (Some(u), None, _) => u,
            (None, Some(e), Some(s)) => e * s,
            (Some(_), Some(_), _) => {
                return Err(TrainError::config(
                    "training.optimizer_updates",
                    "give either optimizer_updates or epochs x steps_per_epoch, not both",
                ))
            }
            _ => {
                return Err(TrainError::config(
                    "training.optimizer_updates",
                    "missing; set training.optimizer_updates, or training.epochs and training.steps_per_epoch",
                ))
            }
        };
        let accumulation = get_u64(training, "training", "gradient_updates_per_optimizer_step")?
            .unwrap_or(1) as usize;
        if accumulation == 0 {
            return Err(TrainError::config(
                "training.gradient_updates_per_optimizer_step",
                "must be at least 1",
            ));
        }
        let output_dir = get_str(output, "output", "output_dir")?.ok_or_else(|| {
            TrainError::config(
                "output.output_dir",
                "missing; name the run's output directory",
            )
        })?;
        let output_dir = if Path::new(output_dir).is_absolute() {
            PathBuf::from(output_dir)
        } else {
            config_dir.join(output_dir)
        };
        let mut optimizer = optimizer;
        if let Schedule::WarmupCosine { total_updates, .. } = &mut optimizer.schedule {
            if *total_updates == 0 {
                *total_updates = updates;
            }
        }
        Ok(EngineConfig {
            batch_size,
            seed,
            distribution,
            optimizer,
            updates,
            steps_per_epoch: steps_per_epoch.unwrap_or(updates).max(1),
            accumulation,
            checkpoint_every: get_u64(training, "training", "checkpoint_every")?.unwrap_or(0),
            checksum_every: get_u64(training, "training", "checksum_every")?.unwrap_or(10),
            early_stop_loss: get_f64(training, "training", "early_stop_loss")?,
            log_every: get_u64(training, "training", "log_every")?
                .unwrap_or(1)
                .max(1),
            output_dir,
            overwrite_output_dir: get_bool(output, "output", "overwrite_output_dir")?
                .unwrap_or(false),
            log_file: get_str(output, "output", "log_file")?
                .unwrap_or("run.log")
                .to_string(),
        })
    }
}

/// How a run is distributed, decided before any output is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `None` for a serial run.
    pub strategy: Option<Strategy>,
    /// Number of replicas (ranks).
    pub replicas: usize,
    /// Samples per replica per micro-batch (`run.batch_size`).
    pub local_batch: usize,
    /// `local_batch x replicas`: samples of one micro-batch across all replicas.
    pub global_batch: usize,
    /// The device of each replica, e.g. `cpu:0`.
    pub devices: Vec<String>,
    /// Things the user should know (logged by the chief), e.g. more thread replicas than cores.
    pub warnings: Vec<String>,
}

/// Decides the distribution of a run from its config and the launch (invariants 1-3).
///
/// - no `run.distribution`: serial; launched with more than one MPI rank is an error;
/// - `"mpi"`: needs an MPI launch (`mpirun`/`srun`); one replica per rank;
/// - `"threads"`: needs a single process; replicas = `devices`, else
///   `global_batch_size / batch_size`, else the available cores;
/// - `devices` must name existing, distinct devices, one per replica;
/// - `global_batch_size`, when given, must equal `batch_size x replicas`;
/// - a loss that is not sample-separable cannot be split across replicas.
///
/// `available_cores` is the machine's CPU count (for `cpu:N` devices).
///
/// Errors: [`TrainError::Config`] naming the key, both numbers where relevant, and the fix.
pub fn plan(
    cfg: &EngineConfig,
    launch: &LaunchEnv,
    available_cores: usize,
    loss_is_sample_separable: bool,
) -> Result<Plan, TrainError> {
    if crate::engine::injected("validation", launch.rank, None) {
        return Err(TrainError::config(
            "run",
            "injected failure at config validation",
        ));
    }
    let b = cfg.batch_size;
    let Some(dist) = &cfg.distribution else {
        if launch.size > 1 {
            return Err(TrainError::config(
                "run.distribution",
                format!(
                    "this config has no run.distribution (a serial run) but was launched by {} with {} ranks; add \"distribution\": {{\"strategy\": \"mpi\"}} to run, or start it without mpirun/srun",
                    launch.launcher, launch.size
                ),
            ));
        }
        return Ok(Plan {
            strategy: None,
            replicas: 1,
            local_batch: b,
            global_batch: b,
            devices: vec!["cpu:0".into()],
            warnings: Vec::new(),
        });
    };
    let replicas = match dist.strategy {
        Strategy::Mpi => {
            if !launch.is_mpi_launch() {
                return Err(TrainError::config(
                    "run.distribution.strategy",
                    "is \"mpi\" but this process was not started by mpirun, mpiexec or srun; run `mpirun -n N lockstep train CONFIG`, or use \"threads\" for one process",
                ));
            }
            launch.size
        }
        Strategy::Threads => {
            if launch.size > 1 {
                return Err(TrainError::config(
                    "run.distribution.strategy",
                    format!(
                        "is \"threads\" (one process) but {} started {} processes; start one process, or use \"mpi\"",
                        launch.launcher, launch.size
                    ),
                ));
            }
            match (&dist.devices, dist.global_batch_size) {
                (Some(d), _) => d.len(),
                (None, Some(g)) if g % b == 0 && g >= b => g / b,
                (None, Some(0)) => {
                    return Err(TrainError::config(
                        "run.distribution.global_batch_size",
                        format!("must be at least run.batch_size ({b}): it is batch_size x replicas"),
                    ))
                }
                (None, Some(g)) => {
                    return Err(TrainError::config(
                        "run.distribution.global_batch_size",
                        format!("{g} is not a multiple of run.batch_size {b}; it must equal batch_size x replicas"),
                    ))
                }
                (None, None) => available_cores.max(1),
            }
        }
    };
    let devices = match &dist.devices {
        Some(list) => {
            if list.len() != replicas {
                return Err(TrainError::config(
                    "run.distribution.devices",
                    format!(
                        "lists {} devices but the run has {replicas} replicas (ranks); list one device per replica",
                        list.len()
                    ),
                ));
            }
            for (i, d) in list.iter().enumerate() {
                if list[..i].contains(d) {
                    return Err(TrainError::config(
                        "run.distribution.devices",
                        format!("lists {d:?} twice; each replica needs its own device"),
                    ));
                }
                check_device(d, available_cores)?;
            }
            list.clone()
        }
        None => (0..replicas).map(|r| format!("cpu:{r}")).collect(),
    };
    if replicas == 0 {
        return Err(TrainError::config(
            "run.distribution.devices",
            "is empty; list at least one device",
        ));
    }
    if let Some(g) = dist.global_batch_size {
        if g != b * replicas {
            return Err(TrainError::config(
                "run.distribution.global_batch_size",
                format!(
                    "is {g} but run.batch_size {b} x {replicas} replicas = {}; batch_size is per replica: set global_batch_size to {} or change batch_size",
                    b * replicas,
                    b * replicas
                ),
            ));
        }
    }
    if replicas > 1 && !loss_is_sample_separable {
        return Err(TrainError::config(
            "training.losses",
            "a loss of this run is not sample-separable (not a mean over samples), so replicas cannot average their gradients; train it serially",
        ));
    }
    let mut warnings = Vec::new();
    if dist.strategy == Strategy::Threads && replicas > available_cores {
        warnings.push(format!(
            "warning: {replicas} thread replicas share {available_cores} CPU cores; each replica is meant to compute on its own core (lower run.distribution.global_batch_size, or use \"mpi\" across machines)"
        ));
    }
    Ok(Plan {
        strategy: Some(dist.strategy),
        replicas,
        local_batch: b,
        global_batch: b * replicas,
        devices,
        warnings,
    })
}

fn check_device(d: &str, available_cores: usize) -> Result<(), TrainError> {
    let key = "run.distribution.devices";
    let (kind, index) = d.split_once(':').unwrap_or((d, ""));
    let index: usize = index
        .parse()
        .map_err(|_| TrainError::config(key, format!("{d:?} is not a device; write \"cpu:N\"")))?;
    match kind {
        "cpu" if index < available_cores => Ok(()),
        "cpu" => Err(TrainError::config(
            key,
            format!("{d:?} does not exist: this machine has {available_cores} CPU cores (cpu:0 to cpu:{})", available_cores.saturating_sub(1)),
        )),
        "cuda" | "gpu" => Err(TrainError::config(
            key,
            format!("{d:?}: this build has no CUDA backend yet; use \"cpu:N\" devices"),
        )),
        _ => Err(TrainError::config(
            key,
            format!("{d:?} is not a device; write \"cpu:N\""),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_comm::launch::Launcher;
    use serde_json::json;

    fn cfg(run: Value) -> EngineConfig {
        let c = json!({"run": run, "training": {"optimizer_updates": 3}, "output": {"output_dir": "out"}});
        EngineConfig::from_json(&c, Path::new("/tmp")).unwrap()
    }

    fn mpi(size: usize) -> LaunchEnv {
        LaunchEnv {
            launcher: Launcher::OpenMpi,
            rank: 0,
            size,
            local_rank: 0,
            slurm_job_id: None,
        }
    }

    #[test]
    fn serial_is_the_default_and_ignores_cores() {
        let p = plan(
            &cfg(json!({"batch_size": 4})),
            &LaunchEnv::serial(),
            8,
            true,
        )
        .unwrap();
        assert_eq!((p.replicas, p.global_batch, p.strategy), (1, 4, None));
    }

    #[test]
    fn serial_config_under_mpirun_is_refused() {
        let e = plan(&cfg(json!({"batch_size": 4})), &mpi(2), 2, true).unwrap_err();
        assert!(e.to_string().contains("with 2 ranks"), "{e}");
    }

    #[test]
    fn mpi_strategy_needs_mpirun() {
        let c = cfg(json!({"batch_size": 4, "distribution": {"strategy": "mpi"}}));
        assert!(plan(&c, &LaunchEnv::serial(), 2, true)
            .unwrap_err()
            .to_string()
            .contains("not started by mpirun"));
        let p = plan(&c, &mpi(2), 2, true).unwrap();
        assert_eq!((p.replicas, p.global_batch), (2, 8));
    }

    #[test]
    fn global_batch_must_match_and_names_both_numbers() {
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "mpi", "global_batch_size": 16}}),
        );
        let e = plan(&c, &mpi(2), 2, true).unwrap_err().to_string();
        assert!(e.contains("16") && e.contains("= 8"), "{e}");
    }

    #[test]
    fn threads_replicas_from_devices_or_global_batch() {
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "mirrored", "devices": ["cpu:0", "cpu:1"]}}),
        );
        assert_eq!(plan(&c, &LaunchEnv::serial(), 2, true).unwrap().replicas, 2);
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "threads", "global_batch_size": 12}}),
        );
        assert_eq!(plan(&c, &LaunchEnv::serial(), 2, true).unwrap().replicas, 3);
        let e = plan(&c, &mpi(2), 2, true).unwrap_err().to_string();
        assert!(e.contains("\"threads\""), "{e}");
    }

    #[test]
    fn bad_devices_are_named() {
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "threads", "devices": ["cpu:0", "cpu:0"]}}),
        );
        assert!(plan(&c, &LaunchEnv::serial(), 2, true)
            .unwrap_err()
            .to_string()
            .contains("twice"));
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "threads", "devices": ["cpu:0", "cpu:7"]}}),
        );
        assert!(plan(&c, &LaunchEnv::serial(), 2, true)
            .unwrap_err()
            .to_string()
            .contains("cpu:7"));
        let c = cfg(
            json!({"batch_size": 4, "distribution": {"strategy": "mpi", "devices": ["cpu:0"]}}),
        );
        assert!(plan(&c, &mpi(2), 2, true)
            .unwrap_err()
            .to_string()
            .contains("one device per replica"));
    }

    #[test]
    fn non_separable_loss_is_refused_in_parallel_only() {
        let c = cfg(json!({"batch_size": 4, "distribution": {"strategy": "mpi"}}));
        assert!(plan(&c, &mpi(2), 2, false).is_err());
        assert!(plan(
            &cfg(json!({"batch_size": 4})),
            &LaunchEnv::serial(),
            2,
            false
        )
        .is_ok());
    }

    #[test]
    fn unknown_keys_get_a_suggestion() {
        let obj = json!({"stratgy": "mpi"});
        let e = check_keys(
            obj.as_object().unwrap(),
            DISTRIBUTION_KEYS,
            "run.distribution",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("run.distribution.stratgy") && e.contains("did you mean `strategy`"),
            "{e}"
        );
    }
}
