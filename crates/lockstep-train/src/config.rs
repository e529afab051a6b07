//! The engine's part of a training config (`run`, `training`, `output`) and the distribution
//! plan derived from it and from the launch.
//!
//! The sections are shared with the model: the engine deserializes its typed parts
//! ([`EngineRun`], [`EngineTraining`], [`EngineOutput`]) with
//! [`lockstep_core::config::from_value`] and ignores the model's keys; the caller that knows
//! the whole schema refuses unknown keys with [`lockstep_core::config::check_keys`] over the
//! union of [`field_names`](lockstep_core::config::field_names) of the engine's and the
//! model's sections. `run.distribution` and `training.optimizer` belong to the engine alone
//! and refuse unknown keys themselves.

use crate::optim::{OptimizerConfig, Schedule};
use crate::TrainError;
use lockstep_comm::launch::LaunchEnv;
use lockstep_core::config::{from_value, ConfigError};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// How replicas are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// One process per device, launched by `mpirun`/`srun` (recommended).
    Mpi,
    /// One process, one thread per device (`"threads"`, synonym `"mirrored"`).
    #[serde(alias = "mirrored")]
    Threads,
}

/// `run.distribution` as written (unknown keys refused).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributionSection {
    /// `strategy`: `"mpi"`, `"threads"` or `"mirrored"` (required).
    pub strategy: Option<Strategy>,
    /// `devices`: explicit device list such as `["cpu:0", "cpu:1"]`.
    pub devices: Option<Vec<String>>,
    /// `global_batch_size`: must equal `run.batch_size x replicas`.
    pub global_batch_size: Option<usize>,
}

/// `run.distribution`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct DistributionConfig {
    /// `strategy`.
    pub strategy: Strategy,
    /// `devices`: explicit device list such as `["cpu:0", "cpu:1"]`.
    pub devices: Option<Vec<String>>,
    /// `global_batch_size`: must equal `run.batch_size x replicas`.
    pub global_batch_size: Option<usize>,
}

/// The engine's keys of `run` (the model reads the others, e.g. `dt`, `seq_len`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EngineRun {
    /// Samples per replica per micro-batch (required, at least 1).
    pub batch_size: Option<usize>,
    /// Seeds every random stream, keyed with the global sample index (default 0).
    pub seed: Option<u64>,
    /// The distribution; absent: a serial run.
    pub distribution: Option<DistributionSection>,
}

/// The engine's keys of `training` (the model reads the others, e.g. `losses`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EngineTraining {
    /// The optimizer (default Adam, learning rate 1e-3).
    pub optimizer: Option<OptimizerConfig>,
    /// Optimizer updates to run (or `epochs` x `steps_per_epoch`).
    pub optimizer_updates: Option<u64>,
    /// Epochs (with `steps_per_epoch`).
    pub epochs: Option<u64>,
    /// Updates per epoch.
    pub steps_per_epoch: Option<u64>,
    /// Micro-batches accumulated per optimizer update (default 1).
    pub gradient_updates_per_optimizer_step: Option<usize>,
    /// Checkpoint every this many updates (default 0: only at the end).
    pub checkpoint_every: Option<u64>,
    /// Compare the replicas' parameter checksums every this many updates (default 10).
    pub checksum_every: Option<u64>,
    /// Stop once the reduced total loss falls below this value.
    pub early_stop_loss: Option<f64>,
    /// Log a line every this many updates (default 1).
    pub log_every: Option<u64>,
    /// The log line's format (default `lockstep`).
    pub log_style: Option<LogStyle>,
    /// Draw the next micro-batch on a loader thread while the current one trains (default
    /// false): the chief's next global micro-batch, or each replica's own slice of it when
    /// the source is keyed by sample.
    pub prefetch: Option<bool>,
    /// Dynamic loss scaling for mixed precision (PyTorch's `GradScaler`; absent: none).
    pub grad_scaler: Option<crate::GradScalerConfig>,
    /// Clip the reduced gradient to this global L2 norm before the optimizer step (PyTorch's
    /// `clip_grad_norm_`, sbi's `clip_max_norm`; absent: no clipping).
    pub clip_max_norm: Option<f64>,
}

/// The format of the periodic training log line (`training.log_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogStyle {
    /// `update U/N epoch E loss L (terms) S samples/s comm C% ETA T s`.
    #[default]
    Lockstep,
    /// Dingo's line (Dax et al.'s `dingo.core.utils.trainutils`):
    /// `Train Epoch: E [done/total (P%)]   Loss: L (mean)   Time Dataloader: D (mean)
    /// Time Network: N (mean)` and, with replicas, `Time Loss Aggregation: A (mean)`: each the
    /// update's value and the running mean over the epoch so far, in seconds, timings the
    /// slowest replica's, the loss the mean over every sample of the global batch.
    Dingo,
}

/// The engine's keys of `output` (the model may read others, e.g. `spikes_file`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EngineOutput {
    /// The run directory (required; relative to the config's folder).
    pub output_dir: Option<PathBuf>,
    /// Replace an existing run directory (default false).
    pub overwrite_output_dir: Option<bool>,
    /// The log file's name inside the run directory (default `run.log`).
    pub log_file: Option<String>,
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
    /// `training.log_style` (default `lockstep`).
    pub log_style: LogStyle,
    /// `training.prefetch`: the next micro-batch is drawn on a loader thread during the
    /// current one, by the chief or, from a source keyed by sample, by every replica for its
    /// own slice (the same batches, so the same updates; default false).
    pub prefetch: bool,
    /// `training.grad_scaler`: dynamic loss scaling for a model that computes in half
    /// precision ([`crate::grad_scaler`]); `None`: the loss is not scaled.
    pub grad_scaler: Option<crate::GradScalerConfig>,
    /// `training.clip_max_norm`: the largest global L2 norm of the reduced (and, with loss
    /// scaling, unscaled) gradient; a larger one is scaled down to it before the optimizer
    /// step, as PyTorch's `clip_grad_norm_` does after DDP's all-reduce. `None`: no clipping.
    pub clip_max_norm: Option<f64>,
    /// `output.output_dir` (resolved against the config's folder).
    pub output_dir: PathBuf,
    /// `output.overwrite_output_dir` (default false: an existing directory is an error).
    pub overwrite_output_dir: bool,
    /// `output.log_file` (default `run.log`, inside the output directory).
    pub log_file: String,
}

/// Deserializes section `name` of `config` (absent: the type's default).
fn section<T: DeserializeOwned + Default>(config: &Value, name: &str) -> Result<T, ConfigError> {
    match config.get(name) {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => from_value(v, name),
    }
}

impl EngineConfig {
    /// Reads the engine's keys from a resolved config (`run`, `training`, `output`); a
    /// relative `output_dir` is resolved against `config_dir`. Unknown keys of the shared
    /// sections are the caller's to refuse (see the module docs).
    ///
    /// Errors: [`TrainError::Config`] naming the key, the value and the fix (no file: the
    /// caller adds it with [`ConfigError::in_file`]).
    pub fn from_json(config: &Value, config_dir: &Path) -> Result<EngineConfig, TrainError> {
        let run: EngineRun = section(config, "run")?;
        let training: EngineTraining = section(config, "training")?;
        let output: EngineOutput = section(config, "output")?;
        Ok(Self::from_sections(run, training, output, config_dir)?)
    }

    /// Checks the engine's typed sections and combines them (defaults filled in,
    /// `output_dir` resolved against `config_dir`).
    ///
    /// Errors: a [`ConfigError`] naming the key.
    pub fn from_sections(
        run: EngineRun,
        training: EngineTraining,
        output: EngineOutput,
        config_dir: &Path,
    ) -> Result<EngineConfig, ConfigError> {
        let batch_size = match run.batch_size {
            None => {
                return Err(ConfigError::new(
                    "run.batch_size",
                    "missing; set the samples per replica, e.g. 16",
                ))
            }
            Some(0) => return Err(ConfigError::new("run.batch_size", "must be at least 1")),
            Some(b) => b,
        };
        let distribution = run.distribution.map(|d| match d.strategy {
            Some(strategy) => Ok(DistributionConfig {
                strategy,
                devices: d.devices,
                global_batch_size: d.global_batch_size,
            }),
            None => Err(ConfigError::new(
                "run.distribution.strategy",
                "missing; use \"mpi\" (one process per device) or \"threads\" (one thread per device)",
            )),
        });
        let distribution = distribution.transpose()?;
        let mut optimizer = training.optimizer.unwrap_or_default();
        optimizer
            .validate()
            .map_err(|e| e.under("training.optimizer"))?;
        let updates = match (
            training.optimizer_updates,
            training.epochs,
            training.steps_per_epoch,
        ) {
            (Some(u), None, _) => u,
            (None, Some(e), Some(s)) => e * s,
            (Some(_), Some(_), _) => {
                return Err(ConfigError::new(
                    "training.optimizer_updates",
                    "give either optimizer_updates or epochs x steps_per_epoch, not both",
                ))
            }
            _ => {
                return Err(ConfigError::new(
                    "training.optimizer_updates",
                    "missing; set training.optimizer_updates, or training.epochs and training.steps_per_epoch",
                ))
            }
        };
        let accumulation = training.gradient_updates_per_optimizer_step.unwrap_or(1);
        if accumulation == 0 {
            return Err(ConfigError::new(
                "training.gradient_updates_per_optimizer_step",
                "must be at least 1",
            ));
        }
        let output_dir = output.output_dir.ok_or_else(|| {
            ConfigError::new(
                "output.output_dir",
                "missing; name the run's output directory",
            )
        })?;
        if let Some(g) = &training.grad_scaler {
            g.validate("training.grad_scaler")?;
        }
        if let Some(m) = training.clip_max_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(ConfigError::new(
                    "training.clip_max_norm",
                    format!("{m} is not a norm to clip to; give a positive number (sbi's default is 5.0) or remove the key"),
                ));
            }
        }
        if let Schedule::WarmupCosine { total_updates, .. } = &mut optimizer.schedule {
            if *total_updates == 0 {
                *total_updates = updates;
            }
        }
        Ok(EngineConfig {
            batch_size,
            seed: run.seed.unwrap_or(0),
            distribution,
            optimizer,
            updates,
            steps_per_epoch: training.steps_per_epoch.unwrap_or(updates).max(1),
            accumulation,
            checkpoint_every: training.checkpoint_every.unwrap_or(0),
            checksum_every: training.checksum_every.unwrap_or(10),
            early_stop_loss: training.early_stop_loss,
            log_every: training.log_every.unwrap_or(1).max(1),
            log_style: training.log_style.unwrap_or_default(),
            prefetch: training.prefetch.unwrap_or(false),
            grad_scaler: training.grad_scaler,
            clip_max_norm: training.clip_max_norm,
            output_dir: lockstep_core::config::resolve_path(config_dir, output_dir),
            overwrite_output_dir: output.overwrite_output_dir.unwrap_or(false),
            log_file: output.log_file.unwrap_or_else(|| "run.log".to_string()),
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
    /// Replicas that share this machine's memory: 1 serially, every replica of a threads
    /// run, the ranks of an MPI launch on this node ([`LaunchEnv::local_size`], from the
    /// launcher's environment).
    pub replicas_on_this_machine: usize,
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
            replicas_on_this_machine: 1,
        });
    };
    let replicas = replica_count(dist, launch, b, available_cores)?;
    let devices = replica_devices(dist, replicas, available_cores)?;
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
        replicas_on_this_machine: match dist.strategy {
            Strategy::Threads => replicas,
            Strategy::Mpi => launch.local_size,
        },
    })
}

/// The number of replicas of a distributed run: the MPI ranks, or for threads the devices
/// listed, else `global_batch_size / batch_size` (`b`), else the available cores.
///
/// Errors: [`TrainError::Config`] when the strategy does not match the launch or
/// `global_batch_size` is not a positive multiple of `b`.
fn replica_count(
    dist: &DistributionConfig,
    launch: &LaunchEnv,
    b: usize,
    available_cores: usize,
) -> Result<usize, TrainError> {
    Ok(match dist.strategy {
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
    })
}

/// The device of each replica: `run.distribution.devices` (one per replica, distinct,
/// existing) or `cpu:0..replicas`.
///
/// Errors: [`TrainError::Config`] naming `run.distribution.devices`.
fn replica_devices(
    dist: &DistributionConfig,
    replicas: usize,
    available_cores: usize,
) -> Result<Vec<String>, TrainError> {
    Ok(match &dist.devices {
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
            local_size: size,
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
        let c = json!({"run": {"batch_size": 4, "distribution": {"stratgy": "mpi"}},
            "training": {"optimizer_updates": 3}, "output": {"output_dir": "out"}});
        let e = EngineConfig::from_json(&c, Path::new("/tmp"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("run.distribution.stratgy") && e.contains("did you mean `strategy`"),
            "{e}"
        );
    }

    /// The memory check's replica count of an MPI run is the launch's ranks on this node.
    #[test]
    fn mpi_replicas_on_this_machine_are_the_node_local_ranks() {
        let c = cfg(json!({"batch_size": 4, "distribution": {"strategy": "mpi"}}));
        let two_hosts = LaunchEnv {
            local_size: 2,
            ..mpi(4)
        };
        let p = plan(&c, &two_hosts, 2, true).unwrap();
        assert_eq!((p.replicas, p.replicas_on_this_machine), (4, 2));
        assert_eq!(
            plan(&c, &mpi(4), 2, true).unwrap().replicas_on_this_machine,
            4
        );
    }

    #[test]
    fn bad_values_name_the_key() {
        let base = |run: Value, training: Value| json!({"run": run, "training": training, "output": {"output_dir": "out"}});
        let err = |c: Value| {
            EngineConfig::from_json(&c, Path::new("/tmp"))
                .unwrap_err()
                .to_string()
        };
        let e = err(base(json!({}), json!({"optimizer_updates": 3})));
        assert!(e.contains("run.batch_size: missing"), "{e}");
        let e = err(base(
            json!({"batch_size": -1}),
            json!({"optimizer_updates": 3}),
        ));
        assert!(
            e.contains("run.batch_size") && e.contains("invalid value"),
            "{e}"
        );
        let e = err(base(
            json!({"batch_size": 2, "distribution": {"strategy": "mirroed"}}),
            json!({"optimizer_updates": 3}),
        ));
        assert!(
            e.contains("run.distribution.strategy") && e.contains("did you mean `mirrored`"),
            "{e}"
        );
        let e = err(base(
            json!({"batch_size": 2}),
            json!({"optimizer_updates": 3, "gradient_updates_per_optimizer_step": 0}),
        ));
        assert!(
            e.contains("training.gradient_updates_per_optimizer_step: must be at least 1"),
            "{e}"
        );
        let e = err(base(json!({"batch_size": 2}), json!({"epochs": 3})));
        assert!(e.contains("training.optimizer_updates: missing"), "{e}");
    }
}
