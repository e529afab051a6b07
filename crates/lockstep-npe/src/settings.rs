//! Dingo-shaped training settings of `lockstep npe train SETTINGS.yaml`.
//!
//! The file has Dingo's four sections (Dax et al. 2021; Dingo's `train_settings.yaml`):
//!
//! ```yaml
//! data:                      # lockstep: a simulator instead of a waveform data set file
//!   task: {name: gaussian_linear, dim: 3}
//!   num_samples: 100000      # simulations in the data set (keyed by (seed, index))
//!   train_fraction: 0.95     # the rest is the test set (its loss is logged at the end)
//!   seed: 0                  # simulations, permutations, initial parameters
//! model:
//!   posterior_model_type: normalizing_flow
//!   posterior_kwargs:
//!     num_flow_steps: 5
//!     base_transform_kwargs:
//!       hidden_dim: 64
//!       num_transform_blocks: 2
//!       activation: elu
//!       dropout_probability: 0.0
//!       batch_norm: false    # or norm: layer_norm | batch_norm | none
//!       num_bins: 8
//!       base_transform_type: rq-coupling
//!       tail_bound: 1.0      # lockstep key (Dingo fixes 1.0)
//!   embedding_kwargs:
//!     output_dim: 16
//!     hidden_dims: [64, 64]
//!     activation: elu
//!     dropout: 0.0
//!     norm: layer_norm
//! training:
//!   stage_0:
//!     epochs: 20
//!     batch_size: 512        # the total batch over all replicas
//!     optimizer: {type: adam, lr: 0.001}
//!     scheduler: {type: cosine, T_max: 20}
//!   stage_1:                 # optional later stages, trained one after the other
//!     epochs: 10
//!     batch_size: 1024
//!     optimizer: {type: adamw, lr: 0.0001, weight_decay: 0.01}
//!     scheduler: {type: step, step_size: 4, gamma: 0.5}
//!     freeze_rb_layer: true  # keep the SVD layer fixed (Dingo)
//!     freeze: [embedding_net.initial_layer, embedding_net.blocks.0]   # lockstep key
//! local:
//!   device: cpu              # cpu, gpu (wgpu: Vulkan/Metal/DX12) or cuda (feature cuda)
//!   replicas: 2              # thread replicas (under mpirun: one per rank); alias num_gpus
//!   checkpoint_epochs: 5
//! ```
//!
//! Every section is a typed serde struct that refuses unknown keys with the nearest known
//! one ([`lockstep_core::config`]). Keys Dingo has whose semantics are not implemented
//! (`runtime_limits`, dropout) are recognised and refused with an error that says so,
//! rather than silently ignored; `automatic_mixed_precision: true` runs on a GPU and is
//! refused on the CPU.
//!
//! [`NpeSettings::engine_config`] turns one stage into the lockstep-train engine's config
//! (`run`, `training`, `output`): the stage's `batch_size` is the total batch, divided
//! equally over the replicas (a remainder is refused, naming both numbers); an epoch is
//! `floor(num_samples × train_fraction / (batch_size × gradient_updates_per_optimizer_step))`
//! updates whatever the replica count; the cosine and step schedules (PyTorch
//! `CosineAnnealingLR` with `T_max` and `StepLR` with `step_size` in epochs) are applied per
//! update, equal to Dingo's per-epoch values at every epoch boundary. Each stage starts a
//! fresh optimizer and schedule from the parameters the previous stage ended with, as Dingo
//! does.

use crate::flow::{EmbeddingConfig, FlowConfig, NetworkConfig, ProjectionConfig};
use crate::layers::{Norm, DINGO_BATCH_NORM_EPS, LEGACY_BATCH_NORM_EPS};
use crate::svd::SvdSettings;
use crate::task::Task;
use crate::tasks::TaskSpec;
use lockstep_core::config::{from_value, unknown_problem, ConfigError};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The whole settings file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NpeSettings {
    /// The simulated data set.
    pub data: DataSettings,
    /// The network.
    pub model: ModelSettings,
    /// The training stages.
    pub training: TrainingSettings,
    /// Machine-local settings (replicas, device, checkpoints); not part of the model.
    #[serde(default)]
    pub local: LocalSettings,
}

/// `data`: the simulator and the data set drawn from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSettings {
    /// The task (`{name: gaussian_linear, dim: 3}`, or a bare name for its defaults).
    #[serde(deserialize_with = "task_or_name")]
    pub task: TaskSpec,
    /// Simulations in the data set.
    pub num_samples: u64,
    /// Fraction of the data set used for training (Dingo: `train_fraction`); the rest is the
    /// test set. Default 0.95.
    #[serde(default = "default_train_fraction")]
    pub train_fraction: f64,
    /// Keys every simulation (with its index), the flow's permutations and the initial
    /// parameters. Default 0.
    #[serde(default)]
    pub seed: u64,
}

fn default_train_fraction() -> f64 {
    0.95
}

/// `data.task` as a map tagged by `name`, or a bare name (the task's defaults). Errors keep
/// serde's `unknown variant` / `unknown field` text, so the nearest name is suggested.
fn task_or_name<'de, D: Deserializer<'de>>(d: D) -> Result<TaskSpec, D::Error> {
    struct TaskVisitor;
    impl<'de> Visitor<'de> for TaskVisitor {
        type Value = TaskSpec;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a task name or a map with `name` and the task's keys")
        }
        fn visit_str<E: de::Error>(self, name: &str) -> Result<TaskSpec, E> {
            TaskSpec::deserialize(de::value::MapDeserializer::new(std::iter::once((
                "name", name,
            ))))
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<TaskSpec, A::Error> {
            TaskSpec::deserialize(de::value::MapAccessDeserializer::new(map))
        }
    }
    d.deserialize_any(TaskVisitor)
}

/// `model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    /// Only `normalizing_flow` (the default).
    #[serde(default)]
    pub posterior_model_type: Option<String>,
    /// The flow.
    pub posterior_kwargs: PosteriorKwargs,
    /// The embedding network.
    pub embedding_kwargs: EmbeddingKwargs,
    /// lockstep's key: the eps of the BatchNorm layers. A settings file without it gets
    /// nflows'/Dingo's 1e-3 ([`DINGO_BATCH_NORM_EPS`]), written into the run's `config.json`
    /// when some network uses BatchNorm; a stored run without it was trained with 1e-5
    /// ([`LEGACY_BATCH_NORM_EPS`]) and keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_norm_eps: Option<f64>,
}

/// `model.posterior_kwargs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PosteriorKwargs {
    /// Flow steps (permutation + LU linear + spline coupling). Dingo: 30.
    pub num_flow_steps: usize,
    /// The coupling transforms.
    pub base_transform_kwargs: BaseTransformKwargs,
    /// Filled in by Dingo from the data (θ dimension); checked when given.
    #[serde(default)]
    pub input_dim: Option<usize>,
    /// Filled in by Dingo from the embedding (`output_dim`); checked when given.
    #[serde(default)]
    pub context_dim: Option<usize>,
}

/// `model.posterior_kwargs.base_transform_kwargs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaseTransformKwargs {
    /// Hidden width of each coupling's conditioner.
    pub hidden_dim: usize,
    /// Residual blocks per conditioner.
    pub num_transform_blocks: usize,
    /// Only `elu` (the default).
    #[serde(default)]
    pub activation: Option<String>,
    /// Only 0 (the default).
    #[serde(default)]
    pub dropout_probability: Option<f64>,
    /// Dingo's switch: BatchNorm in the conditioners (default false).
    #[serde(default)]
    pub batch_norm: Option<bool>,
    /// lockstep's switch: `none`, `layer_norm` (`LayerNorm`) or `batch_norm` (`BatchNorm`).
    #[serde(default)]
    pub norm: Option<Norm>,
    /// Spline bins (default 8).
    #[serde(default = "default_num_bins")]
    pub num_bins: usize,
    /// Only `rq-coupling` (the default).
    #[serde(default)]
    pub base_transform_type: Option<String>,
    /// Spline tail bound in standardized units (default 1.0, as Dingo).
    #[serde(default = "default_tail_bound")]
    pub tail_bound: f64,
}

fn default_num_bins() -> usize {
    8
}
fn default_tail_bound() -> f64 {
    1.0
}

/// `model.embedding_kwargs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingKwargs {
    /// Context features produced. Dingo: 128.
    pub output_dim: usize,
    /// Widths of the residual blocks.
    pub hidden_dims: Vec<usize>,
    /// Only `elu` (the default).
    #[serde(default)]
    pub activation: Option<String>,
    /// Only 0 (the default).
    #[serde(default)]
    pub dropout: Option<f64>,
    /// Dingo's switch: BatchNorm in the blocks (default false).
    #[serde(default)]
    pub batch_norm: Option<bool>,
    /// lockstep's switch: `none`, `layer_norm` or `batch_norm`.
    #[serde(default)]
    pub norm: Option<Norm>,
    /// Dingo's reduced-basis first layer, initialized from an SVD of training inputs
    /// (`{size, num_training_samples, num_validation_samples}`; see [`crate::svd`]).
    #[serde(default)]
    pub svd: Option<SvdSettings>,
    /// Filled in by Dingo from the data; checked when given (`[x_dim]` or `[.., x_dim]`).
    #[serde(default)]
    pub input_dims: Option<Vec<usize>>,
}

/// `training`: `stage_0`, then optionally `stage_1`, `stage_2`, ... (consecutive).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSettings {
    /// The first stage.
    pub stage_0: StageSettings,
    /// Every other key as written: the later stages `stage_1`, `stage_2`, ..., read and
    /// checked into [`TrainingSettings::later`]; any other key is refused as unknown
    /// (nearest: `stage_0`).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
    /// The later stages in order, read from `other` when the settings are checked.
    #[serde(skip)]
    pub later: Vec<StageSettings>,
}

/// `training.stage_N`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSettings {
    /// Epochs of this stage.
    pub epochs: u64,
    /// The total batch over all replicas.
    pub batch_size: usize,
    /// The optimizer.
    pub optimizer: OptimizerSettings,
    /// The learning-rate schedule (default constant).
    #[serde(default)]
    pub scheduler: Option<SchedulerSettings>,
    /// Micro-batches accumulated per optimizer update (default 1); one all-reduce per update.
    #[serde(default)]
    pub gradient_updates_per_optimizer_step: Option<usize>,
    /// Dingo: keep the SVD-initialized layer (`embedding_net.layers_rb`) fixed in this stage.
    #[serde(default)]
    pub freeze_rb_layer: Option<bool>,
    /// lockstep: further blocks kept fixed in this stage, by dotted name prefix
    /// (`embedding_net.initial_layer`, `embedding_net.blocks.0`, `flow.steps.3`, ...).
    #[serde(default)]
    pub freeze: Vec<String>,
    /// Dingo: noise ASDs of a GW data set. Not applicable to simulator tasks (refused).
    #[serde(default)]
    pub asd_dataset_path: Option<Value>,
    /// Dingo: mixed precision in this stage's training passes: linear layers and activations
    /// in float16 on float32 master weights, with dynamic loss scaling
    /// ([`crate::fused_ops::Precision::Half`], lockstep-train's `grad_scaler`). Needs a GPU
    /// (`local.device: gpu` with float16 in shaders, or `cuda`); refused on the CPU.
    #[serde(default)]
    pub automatic_mixed_precision: Option<bool>,
    /// lockstep: the loss scaler of a mixed-precision stage, PyTorch `GradScaler`'s keyword
    /// arguments (`init_scale` 65536, `growth_factor` 2, `backoff_factor` 0.5,
    /// `growth_interval` 2000 by default); only with `automatic_mixed_precision: true`.
    #[serde(default)]
    pub grad_scaler: Option<lockstep_train::GradScalerConfig>,
    /// sbi's `clip_max_norm` (PyTorch `clip_grad_norm_`): clip the gradient, reduced over
    /// all replicas and unscaled under mixed precision, to this global L2 norm before each
    /// optimizer step (sbi's `NPE.train` defaults to 5.0; absent: no clipping, as Dingo).
    #[serde(default)]
    pub clip_max_norm: Option<f64>,
}

/// `optimizer`, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerSettings {
    /// Adam (PyTorch `torch.optim.Adam`).
    Adam {
        /// Learning rate.
        lr: f64,
        /// `(beta1, beta2)`, default `(0.9, 0.999)`.
        #[serde(default)]
        betas: Option<[f64; 2]>,
        /// Denominator offset, default 1e-8.
        #[serde(default)]
        eps: Option<f64>,
        /// Only 0 (the default): Adam's L2 weight decay is not implemented (use `adamw`).
        #[serde(default)]
        weight_decay: Option<f64>,
        /// PyTorch's fused kernel switch: accepted, no effect on the result.
        #[serde(default)]
        fused: Option<bool>,
    },
    /// AdamW (PyTorch `torch.optim.AdamW`, decoupled weight decay).
    #[serde(rename = "adamw")]
    AdamW {
        /// Learning rate.
        lr: f64,
        /// `(beta1, beta2)`, default `(0.9, 0.999)`.
        #[serde(default)]
        betas: Option<[f64; 2]>,
        /// Denominator offset, default 1e-8.
        #[serde(default)]
        eps: Option<f64>,
        /// Decoupled weight decay, default 0.01 (PyTorch's).
        #[serde(default)]
        weight_decay: Option<f64>,
        /// PyTorch's fused kernel switch: accepted, no effect on the result.
        #[serde(default)]
        fused: Option<bool>,
    },
    /// SGD with momentum (PyTorch `torch.optim.SGD`).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (default 0).
        #[serde(default)]
        momentum: Option<f64>,
    },
}

/// `scheduler`, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SchedulerSettings {
    /// The base learning rate throughout.
    Constant,
    /// PyTorch `CosineAnnealingLR`: from the base rate to `eta_min` over `T_max` epochs.
    Cosine {
        /// Epochs of the half cosine (default: the stage's epochs).
        #[serde(rename = "T_max", default)]
        t_max: Option<u64>,
        /// Final learning rate (default 0).
        #[serde(default)]
        eta_min: f64,
    },
    /// PyTorch `ReduceLROnPlateau` (Dingo's `reduce_on_plateau`), stepped with the test loss
    /// (the held-out simulations) at the end of every epoch; needs `data.train_fraction`
    /// below 1.
    ReduceOnPlateau {
        /// Rate multiplier of a reduction (default 0.1).
        #[serde(default = "default_gamma")]
        factor: f64,
        /// Epochs without improvement tolerated (default 10).
        #[serde(default = "default_patience")]
        patience: u64,
        /// Relative improvement that counts (default 1e-4).
        #[serde(default = "default_threshold")]
        threshold: f64,
        /// Epochs after a reduction before bad epochs count again (default 0).
        #[serde(default)]
        cooldown: u64,
        /// Lower bound of the rate (default 0).
        #[serde(default)]
        min_lr: f64,
    },
    /// PyTorch `StepLR`: the rate times `gamma` every `step_size` epochs.
    Step {
        /// Epochs between two decays.
        step_size: u64,
        /// Decay factor (default 0.1).
        #[serde(default = "default_gamma")]
        gamma: f64,
    },
}

fn default_gamma() -> f64 {
    0.1
}

fn default_patience() -> u64 {
    10
}

fn default_threshold() -> f64 {
    1e-4
}

/// `local`: how this machine runs the training (not part of the model or its checkpoints).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalSettings {
    /// `cpu` (the default), `gpu` (burn's wgpu backend on the replica's Vulkan/Metal/DX12
    /// adapter) or `cuda` (burn's CUDA backend, feature `cuda`): [`crate::device`].
    #[serde(default)]
    pub device: Option<String>,
    /// Thread replicas in one process (default 1). Under `mpirun`/`srun` the replicas are
    /// the ranks; a value here must then equal the rank count.
    #[serde(default)]
    pub replicas: Option<usize>,
    /// Dingo's key for the replica count (one replica per device): an alias of `replicas`
    /// (MPI ranks under `mpirun`/`srun`, threads otherwise); also `request_gpus` of
    /// `lockstep npe submit --condor`.
    #[serde(default)]
    pub num_gpus: Option<usize>,
    /// Write a checkpoint every this many epochs (default: only at the end).
    #[serde(default)]
    pub checkpoint_epochs: Option<u64>,
    /// Log a line every this many updates (default: about 10 lines per epoch).
    #[serde(default)]
    pub log_every: Option<u64>,
    /// Dingo's data-loader workers (total over the replicas). Every replica simulates its own
    /// slice of each global batch (simulations are keyed by index, so the slices are the
    /// same for any replica count), on `max(1, N / replicas)` threads. 0 (the default): when
    /// it is needed. N >= 1: while a micro-batch trains, a loader thread of each replica
    /// simulates its next slice (the same batches, so the same training).
    #[serde(default)]
    pub num_workers: Option<usize>,
    /// Dingo's per-run time and epoch limits: not implemented yet (refused).
    #[serde(default)]
    pub runtime_limits: Option<Value>,
    /// Dingo's HTCondor resources, for `lockstep npe submit --condor`.
    #[serde(default)]
    pub condor: Option<CondorSettings>,
    /// Slurm resources, for `lockstep npe submit --slurm`.
    #[serde(default)]
    pub slurm: Option<SlurmSettings>,
}

/// `local.condor` (Dingo's keys): what the HTCondor job requests.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CondorSettings {
    /// `request_cpus` (default: the replica count plus `local.num_workers`).
    #[serde(default)]
    pub num_cpus: Option<usize>,
    /// `request_memory` in MB.
    #[serde(default)]
    pub memory_cpus: Option<u64>,
    /// Deprecated: the GPU count now comes from `local.num_gpus`; still accepted (with a
    /// warning) when `local.num_gpus` is absent, and must agree with it when both are given.
    #[serde(default)]
    pub num_gpus: Option<usize>,
    /// Minimum GPU memory in MB (`requirements = TARGET.CUDAGlobalMemoryMb > ...`).
    #[serde(default)]
    pub memory_gpus: Option<u64>,
    /// Bid of a pool that submits with `condor_submit_bid BID FILE` (as Dingo does at its
    /// home cluster); not a line of the file: `lockstep npe submit` prints that command.
    #[serde(default)]
    pub bid: Option<u64>,
    /// Lines copied verbatim into the submit description, before `queue`.
    #[serde(default)]
    pub extra_submit_lines: Vec<String>,
}

/// `local.slurm`: what the Slurm job requests.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// `--partition`.
    #[serde(default)]
    pub partition: Option<String>,
    /// `--time` (Slurm's formats, e.g. `12:00:00` or `2-00:00:00`).
    #[serde(default)]
    pub time: Option<String>,
    /// `--cpus-per-task` (default 1).
    #[serde(default)]
    pub cpus_per_task: Option<usize>,
    /// `--mem-per-cpu` in MB.
    #[serde(default)]
    pub memory_per_cpu: Option<u64>,
    /// `gpus_per_task` (default, one GPU per replica with `local.num_gpus`) or `gres`
    /// (`--gres=gpu:N` per node, for clusters without `--gpus-per-task`).
    #[serde(default)]
    pub gpu_request: Option<GpuRequest>,
    /// Lines copied verbatim into the script after the `#SBATCH` lines (e.g. `module load
    /// openmpi`).
    #[serde(default)]
    pub extra_lines: Vec<String>,
}

/// How a Slurm job asks for its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuRequest {
    /// `--gpus-per-task=1`.
    GpusPerTask,
    /// `--gres=gpu:N`.
    Gres,
}

fn not_yet(key: &str, what: &str) -> ConfigError {
    ConfigError::new(
        key,
        format!("{what} is not implemented in this version of lockstep; remove the key"),
    )
}

fn resolve_norm(
    key: &str,
    batch_norm: Option<bool>,
    norm: Option<Norm>,
) -> Result<Norm, ConfigError> {
    match (batch_norm, norm) {
        (Some(true), Some(n)) if n != Norm::BatchNorm => Err(ConfigError::new(
            format!("{key}.batch_norm"),
            format!("is true but {key}.norm is {n:?}; give one of them"),
        )),
        (_, Some(n)) => Ok(n),
        (Some(true), None) => Ok(Norm::BatchNorm),
        _ => Ok(Norm::None),
    }
}

/// `value` is in `[lo, hi)`, or the error for `key` (written as the user wrote it).
fn in_range(key: &str, value: f64, lo: f64, hi: f64, hint: &str) -> Result<(), ConfigError> {
    if value >= lo && value < hi {
        Ok(())
    } else {
        Err(ConfigError::new(
            key,
            format!("{value} is out of range: {hint}"),
        ))
    }
}

/// `training.stage_N.optimizer` (`k` is its key): every value in the range the optimizer
/// accepts, each error naming the key as the settings file writes it (`lr`, `betas`, `eps`,
/// `weight_decay`, `momentum`; the engine's own names never appear), and no Adam L2 weight
/// decay. The learning rate must also be positive in float32 (the engine's precision).
fn check_optimizer(k: &str, o: &OptimizerSettings) -> Result<(), ConfigError> {
    let lr = match o {
        OptimizerSettings::Adam { lr, .. }
        | OptimizerSettings::AdamW { lr, .. }
        | OptimizerSettings::Sgd { lr, .. } => *lr,
    };
    if !(lr.is_finite() && lr > 0.0 && (lr as f32) > 0.0 && (lr as f32).is_finite()) {
        return Err(ConfigError::new(
            format!("{k}.lr"),
            format!("must be a positive number (in float32's range), found {lr}; Dingo uses 1e-4 to 1e-3"),
        ));
    }
    let (betas, eps, weight_decay) = match o {
        OptimizerSettings::Adam {
            betas,
            eps,
            weight_decay,
            ..
        } => {
            if weight_decay.is_some_and(|w| w != 0.0) {
                return Err(not_yet(
                    &format!("{k}.weight_decay"),
                    "Adam's L2 weight decay (use `type: adamw` for decoupled weight decay)",
                ));
            }
            (betas, eps, None)
        }
        OptimizerSettings::AdamW {
            betas,
            eps,
            weight_decay,
            ..
        } => (betas, eps, *weight_decay),
        OptimizerSettings::Sgd { momentum, .. } => {
            if let Some(m) = momentum {
                in_range(
                    &format!("{k}.momentum"),
                    *m,
                    0.0,
                    1.0,
                    "use 0 <= momentum < 1 (e.g. 0.9)",
                )?;
            }
            return Ok(());
        }
    };
    if let Some([b1, b2]) = betas {
        for (i, b) in [b1, b2].into_iter().enumerate() {
            if !(*b >= 0.0 && *b < 1.0) {
                return Err(ConfigError::new(
                    format!("{k}.betas"),
                    format!("{b} (betas[{i}]) is out of range: each of betas must be in [0, 1) (PyTorch's default [0.9, 0.999])"),
                ));
            }
        }
    }
    if let Some(e) = eps {
        in_range(
            &format!("{k}.eps"),
            *e,
            f32::MIN_POSITIVE as f64,
            1.0,
            "use a small positive number such as 1e-8 (at least float32's 1.2e-38)",
        )?;
    }
    if let Some(w) = weight_decay {
        in_range(
            &format!("{k}.weight_decay"),
            w,
            0.0,
            1.0,
            "use 0 <= weight_decay < 1 (AdamW's default is 0.01)",
        )?;
    }
    Ok(())
}

/// The base learning rate of an optimizer (`lr`).
fn learning_rate(o: &OptimizerSettings) -> f64 {
    match o {
        OptimizerSettings::Adam { lr, .. }
        | OptimizerSettings::AdamW { lr, .. }
        | OptimizerSettings::Sgd { lr, .. } => *lr,
    }
}

/// The key a settings file writes for a key of the engine's config of stage `stage`
/// (`training.optimizer.learning_rate` is `training.stage_N.optimizer.lr`, ...): what a
/// message about an engine key must name. Keys the engine derives from several settings
/// keys name the stage.
pub fn settings_key(stage: usize, engine_key: &str) -> String {
    let sk = format!("training.stage_{stage}");
    let tail = engine_key
        .strip_prefix("training.optimizer.")
        .map(|t| match t {
            "learning_rate" => "optimizer.lr".to_string(),
            "beta1" | "beta2" => "optimizer.betas".to_string(),
            "epsilon" => "optimizer.eps".to_string(),
            "weight_decay" => "optimizer.weight_decay".to_string(),
            "momentum" => "optimizer.momentum".to_string(),
            "schedule.min_learning_rate" => "scheduler (eta_min or min_lr)".to_string(),
            "schedule.gamma" => "scheduler.gamma".to_string(),
            "schedule.factor" => "scheduler.factor".to_string(),
            "schedule.threshold" => "scheduler.threshold".to_string(),
            "schedule.step_updates" => "scheduler.step_size".to_string(),
            other => format!("optimizer ({other})"),
        });
    match (tail, engine_key) {
        (Some(t), _) => format!("{sk}.{t}"),
        (None, "run.batch_size") => format!("{sk}.batch_size"),
        (None, "training.epochs") => format!("{sk}.epochs"),
        (None, k) if k.starts_with("training.gradient_updates") => {
            format!("{sk}.gradient_updates_per_optimizer_step")
        }
        (None, k) if k.starts_with("output") => "--train-dir".to_string(),
        (None, k) if k.starts_with("training.checkpoint") => "local.checkpoint_epochs".into(),
        (None, k) if k.starts_with("training.log") => "local.log_every".into(),
        (None, _) => sk,
    }
}

/// `training.stage_N.scheduler` (`k` is its key): constant, cosine with `T_max` at least 1
/// or step with `step_size` at least 1 and `gamma` in (0, 1].
fn check_scheduler(k: &str, s: Option<&SchedulerSettings>, lr: f64) -> Result<(), ConfigError> {
    match s {
        Some(SchedulerSettings::Cosine { eta_min, .. }) if !(0.0..=lr).contains(eta_min) => {
            Err(ConfigError::new(
                format!("{k}.eta_min"),
                format!("{eta_min} must lie between 0 and the stage's optimizer.lr {lr}"),
            ))
        }
        Some(SchedulerSettings::ReduceOnPlateau { min_lr, .. }) if !(0.0..=lr).contains(min_lr) => {
            Err(ConfigError::new(
                format!("{k}.min_lr"),
                format!("{min_lr} must lie between 0 and the stage's optimizer.lr {lr}"),
            ))
        }
        Some(SchedulerSettings::ReduceOnPlateau { threshold, .. })
            if !(0.0..1.0).contains(threshold) =>
        {
            Err(ConfigError::new(
                format!("{k}.threshold"),
                format!("{threshold} is not in [0, 1)"),
            ))
        }
        Some(SchedulerSettings::ReduceOnPlateau { factor, .. })
            if !(*factor > 0.0 && *factor < 1.0) =>
        {
            Err(ConfigError::new(
                format!("{k}.factor"),
                format!("{factor} is not in (0, 1)"),
            ))
        }
        Some(SchedulerSettings::Step { step_size: 0, .. }) => Err(ConfigError::new(
            format!("{k}.step_size"),
            "must be at least 1 epoch",
        )),
        Some(SchedulerSettings::Step { gamma, .. }) if !(*gamma > 0.0 && *gamma <= 1.0) => Err(
            ConfigError::new(format!("{k}.gamma"), format!("{gamma} is not in (0, 1]")),
        ),
        Some(SchedulerSettings::Cosine { t_max: Some(0), .. }) => Err(ConfigError::new(
            format!("{k}.T_max"),
            "must be at least 1 epoch",
        )),
        _ => Ok(()),
    }
}

/// The widest spline interval `[-B, B]` accepted (`tail_bound`, in standardized units).
pub const MAX_TAIL_BOUND: f64 = 100.0;

/// The name of the SVD-initialized layer that `freeze_rb_layer` freezes (Dingo's name).
pub const RB_LAYER: &str = "embedding_net.layers_rb";

fn only(key: &str, given: &Option<String>, allowed: &str) -> Result<(), ConfigError> {
    match given {
        Some(v) if v != allowed => Err(ConfigError::new(
            key,
            format!("{v:?} is not supported; lockstep implements {allowed:?}"),
        )),
        _ => Ok(()),
    }
}

/// Parses YAML text into JSON: a key given twice in one mapping is refused with its line
/// (not "the last one wins"), and `.nan` / `.inf` are refused by their key (JSON has no such
/// numbers; they would otherwise read as null). Tags are dropped; keys that are not strings
/// are written as YAML writes them.
///
/// Errors: not YAML, a duplicate key (line and column), a non-finite number (its key).
pub fn yaml_to_json(text: &str) -> Result<Value, ConfigError> {
    let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).map_err(|e| {
        let m = e.to_string();
        // serde_yaml_ng: `[PATH: ]duplicate entry with key "K" at line L column C` (the
        // location of the mapping that holds the key twice).
        match m.split_once("duplicate entry with key ") {
            Some((path, rest)) => {
                let (key, at) = rest.split_once(" at ").unwrap_or((rest, ""));
                let at = if at.is_empty() {
                    String::new()
                } else {
                    format!(" (in the mapping at {at})")
                };
                ConfigError::new(
                    path.trim_end_matches(": "),
                    format!("the key {key} is given twice{at}; give each key once (YAML would keep only the last)"),
                )
            }
            None => ConfigError::new("", format!("not valid YAML: {m}")),
        }
    })?;
    convert_yaml(yaml, "")
}

fn convert_yaml(v: serde_yaml_ng::Value, key: &str) -> Result<Value, ConfigError> {
    use serde_yaml_ng::Value as Y;
    Ok(match v {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                json!(i)
            } else if let Some(u) = n.as_u64() {
                json!(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if !f.is_finite() {
                    return Err(ConfigError::new(
                        key,
                        format!("{n} is not a finite number; give a finite value"),
                    ));
                }
                json!(f)
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => Value::Array(
            items
                .into_iter()
                .enumerate()
                .map(|(i, item)| convert_yaml(item, &format!("{key}[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
        Y::Mapping(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m {
                let name = match k {
                    Y::String(s) => s,
                    other => serde_yaml_ng::to_string(&other)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                };
                let path = if key.is_empty() {
                    name.clone()
                } else {
                    format!("{key}.{name}")
                };
                let value = convert_yaml(v, &path)?;
                out.insert(name, value);
            }
            Value::Object(out)
        }
        Y::Tagged(t) => convert_yaml(t.value, key)?,
    })
}

/// How the replicas of a run are launched, decided by the caller from the launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// One process (serial, or thread replicas).
    SingleProcess,
    /// `n` MPI ranks.
    Mpi(usize),
}

/// Command-line overrides of a settings file for a quick try (`lockstep npe train
/// --num-samples N --epochs E`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `data.num_samples`: simulations in the data set.
    pub num_samples: Option<u64>,
    /// `training.stage_N.epochs` of every stage.
    pub epochs: Option<u64>,
}

impl Overrides {
    /// Writes the overrides into the settings `value` (the keys as the file spells them).
    pub fn apply(&self, value: &mut Value) {
        if let Some(n) = self.num_samples {
            if let Some(d) = value.get_mut("data").and_then(Value::as_object_mut) {
                d.insert("num_samples".into(), json!(n));
            }
        }
        if let Some(e) = self.epochs {
            if let Some(t) = value.get_mut("training").and_then(Value::as_object_mut) {
                for (k, stage) in t.iter_mut() {
                    if let (true, Some(st)) = (k.starts_with("stage_"), stage.as_object_mut()) {
                        st.insert("epochs".into(), json!(e));
                    }
                }
            }
        }
    }
}

/// A stored run's `npe` section (its `config.json`) as the run was trained: a BatchNorm
/// network stored without `model.batch_norm_eps` was trained with
/// [`LEGACY_BATCH_NORM_EPS`], which is written in (settings that do not parse are returned
/// as they are, for the caller's own error).
pub fn stored_npe_section(npe: &Value) -> Value {
    let mut v = npe.clone();
    let Ok(s) = NpeSettings::from_value(npe) else {
        return v;
    };
    if s.model.batch_norm_eps.is_none() && s.network_config().uses_batch_norm() {
        if let Some(m) = v.get_mut("model").and_then(Value::as_object_mut) {
            m.insert("batch_norm_eps".into(), json!(LEGACY_BATCH_NORM_EPS));
        }
    }
    v
}

/// The engine's `training.optimizer` of stage settings `st` with `steps` updates per epoch:
/// the optimizer and its schedule, epochs converted to updates.
fn optimizer_json(st: &StageSettings, steps: u64) -> Value {
    let mut optimizer = match &st.optimizer {
        OptimizerSettings::Adam { lr, betas, eps, .. } => {
            let [b1, b2] = betas.unwrap_or([0.9, 0.999]);
            json!({"name": "adam", "learning_rate": lr, "beta1": b1, "beta2": b2,
                   "epsilon": eps.unwrap_or(1e-8)})
        }
        OptimizerSettings::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
            ..
        } => {
            let [b1, b2] = betas.unwrap_or([0.9, 0.999]);
            json!({"name": "adamw", "learning_rate": lr, "beta1": b1, "beta2": b2,
                   "epsilon": eps.unwrap_or(1e-8), "weight_decay": weight_decay.unwrap_or(0.01)})
        }
        OptimizerSettings::Sgd { lr, momentum } => {
            json!({"name": "sgd", "learning_rate": lr, "momentum": momentum.unwrap_or(0.0)})
        }
    };
    match &st.scheduler {
        Some(SchedulerSettings::Cosine { t_max, eta_min }) => {
            let t = t_max.unwrap_or(st.epochs);
            optimizer["schedule"] = json!({"name": "warmup_cosine", "warmup_updates": 0,
                "total_updates": t * steps, "min_learning_rate": eta_min});
        }
        Some(SchedulerSettings::Step { step_size, gamma }) => {
            optimizer["schedule"] =
                json!({"name": "step", "step_updates": step_size * steps, "gamma": gamma});
        }
        Some(SchedulerSettings::ReduceOnPlateau {
            factor,
            patience,
            threshold,
            cooldown,
            min_lr,
        }) => {
            optimizer["schedule"] = json!({"name": "reduce_on_plateau", "factor": factor,
                "patience": patience, "threshold": threshold, "cooldown": cooldown,
                "min_learning_rate": min_lr});
        }
        _ => {}
    }
    optimizer
}

impl NpeSettings {
    /// Parses YAML settings text (Dingo's `True`/`False` are booleans) and checks them.
    ///
    /// Errors: not YAML (line and column), a key given twice in one mapping (its line), a
    /// non-finite number (`.nan`, `.inf`: its key), unknown keys (with the nearest key), values out
    /// of range, or keys of features not implemented yet ([`NpeSettings::from_value`]).
    ///
    /// These are a user's settings for a new run: when a network uses BatchNorm and
    /// `model.batch_norm_eps` is not given, it is set to Dingo's 1e-3 in both the settings and
    /// the returned value (which the run stores), so that stored runs say which eps they use.
    pub fn from_yaml(text: &str) -> Result<(NpeSettings, Value), ConfigError> {
        Self::from_yaml_with(text, &Overrides::default())
    }

    /// [`NpeSettings::from_yaml`] with `overrides` written in first.
    ///
    /// Errors: as [`NpeSettings::from_yaml`].
    pub fn from_yaml_with(
        text: &str,
        overrides: &Overrides,
    ) -> Result<(NpeSettings, Value), ConfigError> {
        let mut value = yaml_to_json(text)?;
        overrides.apply(&mut value);
        let mut s = Self::from_value(&value)?;
        if s.model.batch_norm_eps.is_none() && s.network_config().uses_batch_norm() {
            s.model.batch_norm_eps = Some(DINGO_BATCH_NORM_EPS);
            if let Some(m) = value.get_mut("model").and_then(Value::as_object_mut) {
                m.insert("batch_norm_eps".into(), json!(DINGO_BATCH_NORM_EPS));
            }
        }
        Ok((s, value))
    }

    /// Reads and checks a YAML settings file.
    ///
    /// Errors: as [`NpeSettings::from_yaml`], naming `path`.
    pub fn from_yaml_file(path: &Path) -> Result<(NpeSettings, Value), ConfigError> {
        Self::from_yaml_file_with(path, &Overrides::default())
    }

    /// [`NpeSettings::from_yaml_file`] with `overrides` written in first.
    ///
    /// Errors: as [`NpeSettings::from_yaml`], naming `path`.
    pub fn from_yaml_file_with(
        path: &Path,
        overrides: &Overrides,
    ) -> Result<(NpeSettings, Value), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new("", format!("cannot read the file: {e}")).in_file(path)
        })?;
        Self::from_yaml_with(&text, overrides).map_err(|e| e.in_file(path))
    }

    /// Deserializes and checks settings from a JSON value (a bare task name is its
    /// defaults).
    ///
    /// Errors: see [`NpeSettings::from_yaml`].
    pub fn from_value(value: &Value) -> Result<NpeSettings, ConfigError> {
        let mut s: NpeSettings = from_value(value, "")?;
        s.training.later = s.read_later_stages()?;
        s.check()?;
        Ok(s)
    }

    /// `training.stage_1`, `stage_2`, ... from the keys after `stage_0`: consecutive, each a
    /// typed stage; any other key refused with the nearest name.
    fn read_later_stages(&self) -> Result<Vec<StageSettings>, ConfigError> {
        let other = &self.training.other;
        let mut stages = Vec::new();
        for k in other.keys() {
            let n = k
                .strip_prefix("stage_")
                .and_then(|n| n.parse::<usize>().ok());
            if n.is_none_or(|n| n == 0 || format!("stage_{n}") != *k) {
                return Err(ConfigError::new(
                    format!("training.{k}"),
                    unknown_problem("key", k, &["stage_0", "stage_1"]),
                ));
            }
        }
        for n in 1..=other.len() {
            let key = format!("stage_{n}");
            let Some(v) = other.get(&key) else {
                let last = other.keys().last().cloned().unwrap_or_default();
                return Err(ConfigError::new(
                    format!("training.{last}"),
                    format!("stages must be consecutive, but training.{key} is missing"),
                ));
            };
            stages.push(from_value(v, &format!("training.{key}"))?);
        }
        Ok(stages)
    }

    /// Every stage in order: `stage_0`, then the later ones.
    pub fn stages(&self) -> Vec<&StageSettings> {
        std::iter::once(&self.training.stage_0)
            .chain(&self.training.later)
            .collect()
    }

    /// The blocks stage `stage` freezes: `embedding_net.layers_rb` with `freeze_rb_layer`,
    /// then its `freeze` list.
    pub fn frozen_blocks(&self, stage: usize) -> Vec<String> {
        let st = self.stages()[stage];
        let rb = (st.freeze_rb_layer == Some(true)).then(|| RB_LAYER.to_string());
        rb.into_iter().chain(st.freeze.iter().cloned()).collect()
    }

    /// Every check of values the types cannot express, section by section.
    fn check(&self) -> Result<(), ConfigError> {
        self.check_data()?;
        let task = self.task()?;
        self.check_posterior_kwargs(task.as_ref())?;
        self.check_embedding_kwargs(task.as_ref())?;
        if let Some(eps) = self.model.batch_norm_eps {
            if !(eps.is_finite() && eps > 0.0) {
                return Err(ConfigError::new(
                    "model.batch_norm_eps",
                    format!("{eps} is not a positive number (nflows and Dingo use 1e-3)"),
                ));
            }
        }
        self.check_training()?;
        self.check_local()
    }

    /// `data`: a non-empty data set, a train fraction in (0, 1] and a valid task.
    fn check_data(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        if d.num_samples == 0 {
            return Err(ConfigError::new("data.num_samples", "must be at least 1"));
        }
        if !(d.train_fraction > 0.0 && d.train_fraction <= 1.0) {
            return Err(ConfigError::new(
                "data.train_fraction",
                format!("{} is not in (0, 1]", d.train_fraction),
            ));
        }
        self.task().map(|_| ()).map_err(|e| e.under("data.task"))
    }

    /// `model.posterior_model_type` and `model.posterior_kwargs`: the implemented flow, and
    /// `input_dim` / `context_dim` (Dingo fills them in) agreeing with the task and embedding.
    fn check_posterior_kwargs(&self, task: &dyn Task) -> Result<(), ConfigError> {
        let m = &self.model;
        only(
            "model.posterior_model_type",
            &m.posterior_model_type,
            "normalizing_flow",
        )?;
        let p = &m.posterior_kwargs;
        let b = &p.base_transform_kwargs;
        let bk = "model.posterior_kwargs.base_transform_kwargs";
        only(&format!("{bk}.activation"), &b.activation, "elu")?;
        only(
            &format!("{bk}.base_transform_type"),
            &b.base_transform_type,
            "rq-coupling",
        )?;
        if b.dropout_probability.is_some_and(|x| x != 0.0) {
            return Err(not_yet(&format!("{bk}.dropout_probability"), "dropout"));
        }
        resolve_norm(bk, b.batch_norm, b.norm)?;
        if !(b.tail_bound > 0.0 && b.tail_bound <= MAX_TAIL_BOUND) {
            return Err(ConfigError::new(
                format!("{bk}.tail_bound"),
                format!(
                    "{} is out of range: the spline's interval [-B, B] is in standardized units (the data's standard deviations), so use 0 < B <= {MAX_TAIL_BOUND} (Dingo: 1.0; sbi: 3 to 5); a float32 spline over a wider interval has bins too coarse to resolve the data and goes NaN",
                    b.tail_bound
                ),
            ));
        }
        if b.num_bins < 2 {
            return Err(ConfigError::new(
                format!("{bk}.num_bins"),
                format!(
                    "{} is too few: a spline needs at least 2 bins (Dingo: 8)",
                    b.num_bins
                ),
            ));
        }
        for (key, v) in [
            ("num_flow_steps", p.num_flow_steps),
            ("base_transform_kwargs.hidden_dim", b.hidden_dim),
            (
                "base_transform_kwargs.num_transform_blocks",
                b.num_transform_blocks,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::new(
                    format!("model.posterior_kwargs.{key}"),
                    "must be at least 1",
                ));
            }
        }
        let output_dim = m.embedding_kwargs.output_dim;
        if let Some(c) = p.context_dim.filter(|&c| c != output_dim) {
            return Err(ConfigError::new(
                "model.posterior_kwargs.context_dim",
                format!("is {c} but model.embedding_kwargs.output_dim is {output_dim}; they must agree (or leave context_dim out)"),
            ));
        }
        if let Some(i) = p.input_dim.filter(|&i| i != task.theta_dim()) {
            return Err(ConfigError::new(
                "model.posterior_kwargs.input_dim",
                format!(
                    "is {i} but the task has {} parameters; leave it out",
                    task.theta_dim()
                ),
            ));
        }
        Ok(())
    }

    /// `model.embedding_kwargs`: the implemented activation and normalization, `input_dims`
    /// (Dingo fills it in) matching the task, and the `svd` layer's sizes.
    fn check_embedding_kwargs(&self, task: &dyn Task) -> Result<(), ConfigError> {
        let e = &self.model.embedding_kwargs;
        let ek = "model.embedding_kwargs";
        only(&format!("{ek}.activation"), &e.activation, "elu")?;
        if e.dropout.is_some_and(|x| x != 0.0) {
            return Err(not_yet(&format!("{ek}.dropout"), "dropout"));
        }
        resolve_norm(ek, e.batch_norm, e.norm)?;
        if e.output_dim == 0 {
            return Err(ConfigError::new(
                format!("{ek}.output_dim"),
                "must be at least 1",
            ));
        }
        if e.hidden_dims.is_empty() || e.hidden_dims.contains(&0) {
            return Err(ConfigError::new(
                format!("{ek}.hidden_dims"),
                format!(
                    "{:?}: give a non-empty list of positive widths, e.g. [64, 64]",
                    e.hidden_dims
                ),
            ));
        }
        if let Some(dims) = &e.input_dims {
            if dims.iter().product::<usize>() != task.x_dim() {
                return Err(ConfigError::new(
                    format!("{ek}.input_dims"),
                    format!(
                        "{dims:?} does not match the task's {} data values; leave it out",
                        task.x_dim()
                    ),
                ));
            }
        }
        if let Some(svd) = &e.svd {
            svd.check(&task.basis_layout())
                .map_err(|e| e.under(&format!("{ek}.svd")))?;
        }
        Ok(())
    }

    /// `training`: every stage with positive epochs, batch and accumulation, the implemented
    /// optimizer and scheduler options, `freeze_rb_layer` only with an SVD layer, and no Dingo
    /// keys whose features are not here.
    fn check_training(&self) -> Result<(), ConfigError> {
        for (n, st) in self.stages().into_iter().enumerate() {
            let sk = format!("training.stage_{n}");
            let accumulation = st.gradient_updates_per_optimizer_step.unwrap_or(1) as u64;
            for (key, value) in [
                ("epochs", st.epochs),
                ("batch_size", st.batch_size as u64),
                ("gradient_updates_per_optimizer_step", accumulation),
            ] {
                if value == 0 {
                    return Err(ConfigError::new(
                        format!("{sk}.{key}"),
                        "must be at least 1",
                    ));
                }
            }
            let net = self.network_config();
            let batch_norm =
                net.embedding.norm == Norm::BatchNorm || net.flow.norm == Norm::BatchNorm;
            if batch_norm && st.batch_size < 2 {
                return Err(ConfigError::new(
                    format!("{sk}.batch_size"),
                    "is 1, but BatchNorm normalizes by the batch's variance, which one sample does not have; use a batch of at least 2 or norm: layer_norm",
                ));
            }
            if st.freeze_rb_layer == Some(true) && self.model.embedding_kwargs.svd.is_none() {
                return Err(ConfigError::new(
                    format!("{sk}.freeze_rb_layer"),
                    "is true but the network has no SVD-initialized layer (model.embedding_kwargs.svd); remove the key or add the layer",
                ));
            }
            if st.asd_dataset_path.is_some() {
                return Err(ConfigError::new(
                    format!("{sk}.asd_dataset_path"),
                    "lockstep's tasks simulate their own noise; remove the key",
                ));
            }
            // On the CPU it is refused where the devices are opened (the run directory's
            // config.json keeps no `local` section, so it cannot be judged here).
            let amp = st.automatic_mixed_precision == Some(true);
            if let Some(g) = &st.grad_scaler {
                if !amp {
                    return Err(ConfigError::new(
                        format!("{sk}.grad_scaler"),
                        "is set, but the stage does not compute in mixed precision; set automatic_mixed_precision: true or remove grad_scaler",
                    ));
                }
                g.validate(&format!("{sk}.grad_scaler"))?;
            }
            if let Some(m) = st.clip_max_norm {
                if !(m.is_finite() && m > 0.0) {
                    return Err(ConfigError::new(
                        format!("{sk}.clip_max_norm"),
                        format!("{m} is not a norm to clip to; give a positive number (sbi's default is 5.0) or remove the key"),
                    ));
                }
            }
            check_optimizer(&format!("{sk}.optimizer"), &st.optimizer)?;
            check_scheduler(
                &format!("{sk}.scheduler"),
                st.scheduler.as_ref(),
                learning_rate(&st.optimizer),
            )?;
            let plateau = matches!(
                st.scheduler,
                Some(SchedulerSettings::ReduceOnPlateau { .. })
            );
            if plateau && self.train_samples() >= self.data.num_samples {
                return Err(ConfigError::new(
                    format!("{sk}.scheduler.type"),
                    "reduce_on_plateau steps on the test loss at each epoch end, but data.train_fraction leaves no test simulations; set it below 1 (Dingo: 0.95) or use cosine or step",
                ));
            }
        }
        Ok(())
    }

    /// `local`: CPU, at least one replica, and no Dingo keys whose features are not here.
    fn check_local(&self) -> Result<(), ConfigError> {
        let l = &self.local;
        if let Some(d) = &l.device {
            d.parse::<crate::device::DeviceKind>().map_err(|_| {
                ConfigError::new(
                    "local.device",
                    format!(
                        "{d:?} is not a device; use {}",
                        crate::device::DeviceKind::CHOICES
                    ),
                )
            })?;
        }
        for (key, v) in [("replicas", l.replicas), ("num_gpus", l.num_gpus)] {
            if v == Some(0) {
                return Err(ConfigError::new(
                    format!("local.{key}"),
                    "must be at least 1",
                ));
            }
        }
        if let (Some(g), Some(c)) = (l.num_gpus, l.condor.as_ref().and_then(|c| c.num_gpus)) {
            if g != c {
                return Err(ConfigError::new(
                    "local.condor.num_gpus",
                    format!("is {c} but local.num_gpus is {g}; remove local.condor.num_gpus (deprecated: the GPU count is local.num_gpus)"),
                ));
            }
        }
        if let (Some(r), Some(g)) = (l.replicas, l.num_gpus) {
            if r != g {
                return Err(ConfigError::new(
                    "local.num_gpus",
                    format!("is {g} but local.replicas is {r}; num_gpus is Dingo's name for the replica count, give one of them"),
                ));
            }
        }
        if l.runtime_limits.is_some() {
            return Err(not_yet(
                "local.runtime_limits",
                "per-run time and epoch limits",
            ));
        }
        Ok(())
    }

    /// The task as a simulator.
    ///
    /// Errors: values of `data.task` out of range (key relative to `data.task`).
    pub fn task(&self) -> Result<Arc<dyn Task>, ConfigError> {
        self.data.task.build()
    }

    /// The network configuration.
    pub fn network_config(&self) -> NetworkConfig {
        let m = &self.model;
        let b = &m.posterior_kwargs.base_transform_kwargs;
        let e = &m.embedding_kwargs;
        NetworkConfig {
            embedding: EmbeddingConfig {
                hidden_dims: e.hidden_dims.clone(),
                output_dim: e.output_dim,
                norm: resolve_norm("", e.batch_norm, e.norm).unwrap_or_default(),
                projection: e.svd.as_ref().and_then(|svd| {
                    let layout = self.task().ok()?.basis_layout();
                    Some(ProjectionConfig {
                        size: svd.size,
                        layout,
                    })
                }),
            },
            flow: FlowConfig {
                num_flow_steps: m.posterior_kwargs.num_flow_steps,
                hidden_dim: b.hidden_dim,
                num_transform_blocks: b.num_transform_blocks,
                num_bins: b.num_bins,
                tail_bound: b.tail_bound,
                norm: resolve_norm("", b.batch_norm, b.norm).unwrap_or_default(),
            },
            batch_norm_eps: m.batch_norm_eps.unwrap_or(LEGACY_BATCH_NORM_EPS),
        }
    }

    /// Training simulations: `floor(num_samples × train_fraction)`.
    pub fn train_samples(&self) -> u64 {
        ((self.data.num_samples as f64) * self.data.train_fraction).floor() as u64
    }

    /// Updates per epoch of stage `stage`: `floor(train_samples / (batch_size ×
    /// accumulation))`.
    pub fn steps_per_epoch(&self, stage: usize) -> u64 {
        let st = self.stages()[stage];
        let per_update =
            (st.batch_size * st.gradient_updates_per_optimizer_step.unwrap_or(1)) as u64;
        self.train_samples() / per_update.max(1)
    }

    /// The device of `local.device` (`cpu` when absent; checked by the settings' validation,
    /// an unknown value reads as `cpu` here).
    pub fn device(&self) -> crate::device::DeviceKind {
        self.local
            .device
            .as_deref()
            .and_then(|d| d.parse().ok())
            .unwrap_or_default()
    }

    /// The replica count for `launch`: the ranks under MPI, else `local.replicas` (or its
    /// alias `local.num_gpus`, default 1).
    ///
    /// Errors: the configured count disagrees with the MPI rank count.
    pub fn replicas(&self, launch: Launch) -> Result<usize, ConfigError> {
        let l = &self.local;
        let (key, configured) = match (l.replicas, l.num_gpus) {
            (None, Some(g)) => ("local.num_gpus", Some(g)),
            (r, _) => ("local.replicas", r),
        };
        match launch {
            Launch::Mpi(n) => match configured {
                Some(r) if r != n => Err(ConfigError::new(
                    key,
                    format!("is {r} but the job was launched with {n} MPI ranks (one replica per rank); remove the key or launch {r} ranks"),
                )),
                _ => Ok(n),
            },
            Launch::SingleProcess => Ok(configured.unwrap_or(1)),
        }
    }

    /// The engine's config (`run`, `training`, `output`) of stage `stage`, plus `npe`: these
    /// settings without `local` (so the checkpoints' config hash does not depend on the
    /// replicas), and `npe_stage`: the stage (so a checkpoint resumes only its own stage).
    ///
    /// Errors: the total batch is not divisible by the replicas, the data set holds less than
    /// one update, or the engine refuses a value.
    pub fn engine_config(
        &self,
        stage: usize,
        raw: &Value,
        launch: Launch,
        output_dir: &Path,
        overwrite: bool,
    ) -> Result<Value, ConfigError> {
        let st = self.stages()[stage];
        let sk = format!("training.stage_{stage}");
        let replicas = self.replicas(launch)?;
        if !st.batch_size.is_multiple_of(replicas) {
            return Err(ConfigError::new(
                format!("{sk}.batch_size"),
                format!(
                    "{} is the total batch and must divide equally over the {replicas} replicas; use a multiple of {replicas}",
                    st.batch_size
                ),
            ));
        }
        let steps = self.steps_per_epoch(stage);
        if steps == 0 {
            return Err(ConfigError::new(
                format!("{sk}.batch_size"),
                format!(
                    "{} (x gradient_updates_per_optimizer_step) is more than the {} training simulations (data.num_samples x data.train_fraction); lower it or simulate more",
                    st.batch_size,
                    self.train_samples()
                ),
            ));
        }
        let optimizer = optimizer_json(st, steps);
        let mut run = json!({"batch_size": st.batch_size / replicas, "seed": self.data.seed});
        match launch {
            Launch::Mpi(n) if n > 1 => {
                run["distribution"] =
                    json!({"strategy": "mpi", "global_batch_size": st.batch_size});
            }
            _ if replicas > 1 => {
                run["distribution"] =
                    json!({"strategy": "threads", "global_batch_size": st.batch_size});
            }
            _ => {}
        }
        let mut training = json!({
            "optimizer": optimizer,
            "epochs": st.epochs,
            "steps_per_epoch": steps,
            "log_every": self.local.log_every.unwrap_or((steps / 10).max(1)),
            "log_style": "dingo",
            "prefetch": self.local.num_workers.unwrap_or(0) > 0,
        });
        if let Some(k) = st.gradient_updates_per_optimizer_step {
            training["gradient_updates_per_optimizer_step"] = json!(k);
        }
        if st.automatic_mixed_precision == Some(true) {
            let g = st.grad_scaler.unwrap_or_default();
            training["grad_scaler"] = json!({"init_scale": g.init_scale,
                "growth_factor": g.growth_factor, "backoff_factor": g.backoff_factor,
                "growth_interval": g.growth_interval});
        }
        if let Some(m) = st.clip_max_norm {
            training["clip_max_norm"] = json!(m);
        }
        if let Some(c) = self.local.checkpoint_epochs {
            training["checkpoint_every"] = json!(c * steps);
        }
        let mut npe = raw.clone();
        if let Some(o) = npe.as_object_mut() {
            o.remove("local");
        }
        let config = json!({
            "npe": npe,
            "npe_stage": stage,
            "run": run,
            "training": training,
            "output": {"output_dir": output_dir, "overwrite_output_dir": overwrite},
        });
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
data:
  task: {name: gaussian_linear, dim: 3}
  num_samples: 10000
  train_fraction: 0.9
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      batch_norm: False
      num_bins: 8
      base_transform_type: rq-coupling
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    norm: LayerNorm
training:
  stage_0:
    epochs: 3
    batch_size: 64
    optimizer: {type: adam, lr: 0.001}
    scheduler: {type: cosine, T_max: 3}
local:
  replicas: 2
  checkpoint_epochs: 1
";

    fn err(text: &str) -> String {
        NpeSettings::from_yaml(text).unwrap_err().to_string()
    }

    #[test]
    fn dingo_shaped_settings_map_to_the_engine() {
        let (s, raw) = NpeSettings::from_yaml(GOOD).unwrap();
        let net = s.network_config();
        assert_eq!(net.embedding.norm, Norm::LayerNorm);
        assert_eq!(net.flow.norm, Norm::None);
        assert_eq!(s.steps_per_epoch(0), 9000 / 64);
        let c = s
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/out"), false)
            .unwrap();
        assert_eq!(c["run"]["batch_size"], 32);
        assert_eq!(c["run"]["distribution"]["strategy"], "threads");
        assert_eq!(c["training"]["steps_per_epoch"], 140);
        assert_eq!(c["training"]["checkpoint_every"], 140);
        assert_eq!(
            c["training"]["optimizer"]["schedule"]["total_updates"],
            3 * 140
        );
        assert!(c["npe"].get("local").is_none());
        let m = s
            .engine_config(0, &raw, Launch::Mpi(4), Path::new("/tmp/out"), false)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("local.replicas") && m.contains("4 MPI ranks"),
            "{m}"
        );
        let three = GOOD.replace("replicas: 2", "replicas: 3");
        let (s, raw) = NpeSettings::from_yaml(&three).unwrap();
        let e = s
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/out"), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("training.stage_0.batch_size")
                && e.contains("64")
                && e.contains("3 replicas"),
            "{e}"
        );
    }

    #[test]
    fn batch_norm_gets_dingos_eps_and_stored_runs_without_it_keep_1e5() {
        // No BatchNorm: nothing is added (earlier runs' settings compare equal on resume).
        let (s, raw) = NpeSettings::from_yaml(GOOD).unwrap();
        assert_eq!(s.model.batch_norm_eps, None);
        assert!(raw["model"].get("batch_norm_eps").is_none());
        // A new BatchNorm run: Dingo's 1e-3 in the settings and in what the run stores.
        let bn = GOOD.replace("batch_norm: False", "batch_norm: True");
        let (s, raw) = NpeSettings::from_yaml(&bn).unwrap();
        assert_eq!(s.model.batch_norm_eps, Some(DINGO_BATCH_NORM_EPS));
        assert_eq!(s.network_config().batch_norm_eps, 1e-3);
        assert_eq!(raw["model"]["batch_norm_eps"], 1e-3);
        // Given: kept.
        let text = bn.replace("model:\n", "model:\n  batch_norm_eps: 1.0e-4\n");
        let (s, _) = NpeSettings::from_yaml(&text).unwrap();
        assert_eq!(s.network_config().batch_norm_eps, 1e-4);
        let e = err(&bn.replace("model:\n", "model:\n  batch_norm_eps: 0\n"));
        assert!(
            e.contains("model.batch_norm_eps") && e.contains("positive"),
            "{e}"
        );
        // A stored BatchNorm run without the key (written before it existed) used 1e-5.
        let mut stored = raw.clone();
        stored["model"]
            .as_object_mut()
            .unwrap()
            .remove("batch_norm_eps");
        let resolved = stored_npe_section(&stored);
        assert_eq!(resolved["model"]["batch_norm_eps"], 1e-5);
        let s = NpeSettings::from_value(&resolved).unwrap();
        assert_eq!(s.network_config().batch_norm_eps, LEGACY_BATCH_NORM_EPS);
        // ... and one that has it keeps it.
        assert_eq!(stored_npe_section(&raw), raw);
    }

    #[test]
    fn unknown_keys_get_the_nearest_key() {
        let e = err(&GOOD.replace("num_flow_steps", "num_flow_step"));
        assert!(
            e.contains("model.posterior_kwargs.num_flow_step")
                && e.contains("did you mean `num_flow_steps`"),
            "{e}"
        );
        let e = err(&GOOD.replace("batch_size: 64", "batchsize: 64"));
        assert!(
            e.contains("training.stage_0.batchsize") && e.contains("`batch_size`"),
            "{e}"
        );
        let e = err(&GOOD.replace("gaussian_linear", "gausian_linear"));
        assert!(
            e.contains("data.task") && e.contains("did you mean `gaussian_linear`"),
            "{e}"
        );
        let e = err(&GOOD.replace("type: adam", "type: adan"));
        assert!(e.contains("did you mean `adam`"), "{e}");
    }

    /// `automatic_mixed_precision: true` on a GPU becomes the engine's loss scaler (PyTorch's
    /// defaults, or the stage's `grad_scaler`); `grad_scaler` needs it and names its keys.
    #[test]
    fn mixed_precision_on_a_gpu_sets_the_loss_scaler() {
        let amp = GOOD.replace(
            "    optimizer:",
            "    automatic_mixed_precision: true\n    optimizer:",
        );
        let gpu = amp.replace("local:\n", "local:\n  device: gpu\n");
        let (settings, raw) = NpeSettings::from_yaml(&gpu).unwrap();
        let json = settings
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/x"), false)
            .unwrap();
        assert_eq!(
            json["training"]["grad_scaler"],
            serde_json::json!({"init_scale": 65536.0, "growth_factor": 2.0,
                "backoff_factor": 0.5, "growth_interval": 2000})
        );
        let cfg = lockstep_train::EngineConfig::from_json(&json, Path::new("/")).unwrap();
        assert_eq!(cfg.grad_scaler, Some(Default::default()));
        let set = gpu.replace(
            "    automatic_mixed_precision: true\n",
            "    automatic_mixed_precision: true\n    grad_scaler: {init_scale: 1.0e10, growth_interval: 5}\n",
        );
        let (settings, raw) = NpeSettings::from_yaml(&set).unwrap();
        let json = settings
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/x"), false)
            .unwrap();
        assert_eq!(json["training"]["grad_scaler"]["init_scale"], 1.0e10);
        assert_eq!(json["training"]["grad_scaler"]["growth_interval"], 5);
        let e = err(&set.replace(
            "automatic_mixed_precision: true",
            "automatic_mixed_precision: false",
        ));
        assert!(
            e.contains("training.stage_0.grad_scaler")
                && e.contains("automatic_mixed_precision: true"),
            "{e}"
        );
        let e = err(&set.replace("growth_interval: 5", "growth_interval: 0"));
        assert!(
            e.contains("training.stage_0.grad_scaler.growth_interval"),
            "{e}"
        );
        // Without it, no loss scaling.
        let (settings, raw) =
            NpeSettings::from_yaml(&GOOD.replace("local:\n", "local:\n  device: gpu\n")).unwrap();
        let json = settings
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/x"), false)
            .unwrap();
        assert!(json["training"].get("grad_scaler").is_none());
    }

    #[test]
    fn later_features_are_refused_by_name() {
        let off = GOOD.replace(
            "    optimizer:",
            "    automatic_mixed_precision: false\n    optimizer:",
        );
        assert!(NpeSettings::from_yaml(&off).is_ok());
        let e = err(&format!(
            "{GOOD}  runtime_limits: {{max_epochs_per_run: 4}}\n"
        ));
        assert!(
            e.contains("local.runtime_limits") && e.contains("not implemented"),
            "{e}"
        );
        let e = err(&GOOD.replace(
            "local:",
            "  stage_2:\n    epochs: 1\n    batch_size: 64\n    optimizer: {type: adam, lr: 0.001}\nlocal:",
        ));
        assert!(
            e.contains("training.stage_2") && e.contains("training.stage_1 is missing"),
            "{e}"
        );
        let plateau = GOOD.replace(
            "{type: cosine, T_max: 3}",
            "{type: reduce_on_plateau, patience: 3, factor: 0.5}",
        );
        let (s, raw) = NpeSettings::from_yaml(&plateau).unwrap();
        let engine = s
            .engine_config(0, &raw, Launch::SingleProcess, Path::new("/tmp/x"), false)
            .unwrap();
        assert_eq!(
            engine["training"]["optimizer"]["schedule"],
            json!({"name": "reduce_on_plateau", "factor": 0.5, "patience": 3,
                   "threshold": 1e-4, "cooldown": 0, "min_learning_rate": 0.0})
        );
        let e = err(&plateau.replace("train_fraction: 0.9", "train_fraction: 1.0"));
        assert!(
            e.contains("training.stage_0.scheduler.type") && e.contains("train_fraction"),
            "{e}"
        );
        let e = err(&GOOD.replace("norm: LayerNorm", "norm: LayerNorm\n    batch_norm: True"));
        assert!(e.contains("embedding_kwargs.batch_norm"), "{e}");
        let e = err(&GOOD.replace("activation: elu", "activation: relu"));
        assert!(e.contains("activation") && e.contains("elu"), "{e}");
    }

    #[test]
    fn typed_sections_refuse_with_the_key() {
        let (s, _) = NpeSettings::from_yaml(
            &GOOD.replace("task: {name: gaussian_linear, dim: 3}", "task: two_moons"),
        )
        .unwrap();
        assert_eq!(s.data.task, TaskSpec::TwoMoons);
        let e = err(&GOOD.replace("task: {name: gaussian_linear, dim: 3}", "task: two_moon"));
        assert!(
            e.starts_with("data.task: ") && e.contains("did you mean `two_moons`"),
            "{e}"
        );
        let e = err(&GOOD.replace("  stage_0:", "  stage0:"));
        assert!(e.starts_with("training: missing field `stage_0`"), "{e}");
        let e = err(&GOOD.replace("local:", "  stage_0x: 1\nlocal:"));
        assert!(
            e.starts_with("training.stage_0x: ") && e.contains("did you mean `stage_0`"),
            "{e}"
        );
        let e = err(&GOOD.replace(
            "{type: adam, lr: 0.001}",
            "{type: adam, lr: 0.001, weight_decay: 0.01}",
        ));
        assert!(
            e.starts_with("training.stage_0.optimizer.weight_decay: ") && e.contains("adamw"),
            "{e}"
        );
        let e = err(&GOOD.replace("{type: cosine, T_max: 3}", "{type: step, step_size: 0}"));
        assert!(
            e.starts_with("training.stage_0.scheduler.step_size: "),
            "{e}"
        );
        let e = err(&GOOD.replace("{type: cosine, T_max: 3}", "{type: cosine, T_max: 0}"));
        assert!(e.starts_with("training.stage_0.scheduler.T_max: "), "{e}");
        let e = err(&GOOD.replace("num_samples: 10000", "num_samples: 0"));
        assert!(e.starts_with("data.num_samples: must be at least 1"), "{e}");
        let e = err(&GOOD.replace(
            "{name: gaussian_linear, dim: 3}",
            "{name: gaussian_linear, dim: 0}",
        ));
        assert!(e.starts_with("data.task.dim: "), "{e}");
        let e = err(&format!(
            "{GOOD}  runtime_limits: {{max_time_per_run: 100}}\n"
        ));
        assert!(e.starts_with("local.runtime_limits: "), "{e}");
    }

    const GW: &str = "
data:
  task: {name: gw_chirp, f_max: 40.0}
  num_samples: 1000
model:
  posterior_kwargs:
    num_flow_steps: 1
    base_transform_kwargs: {hidden_dim: 8, num_transform_blocks: 1}
  embedding_kwargs:
    svd: {size: 10, num_training_samples: 100, num_validation_samples: 10}
    output_dim: 4
    hidden_dims: [16]
training:
  stage_0:
    epochs: 1
    batch_size: 64
    optimizer: {type: adam, lr: 0.001}
";

    #[test]
    fn svd_settings_parse_and_bad_ones_are_refused() {
        let (s, _) = NpeSettings::from_yaml(GW).unwrap();
        let p = s.network_config().embedding.projection.unwrap();
        assert_eq!(p.size, 10);
        assert_eq!(
            p.layout,
            crate::task::BasisLayout::Complex {
                blocks: 2,
                bins: 81
            }
        );
        let (s, _) =
            NpeSettings::from_yaml(&GW.replace(", num_validation_samples: 10", "")).unwrap();
        assert_eq!(
            s.model.embedding_kwargs.svd.unwrap().num_validation_samples,
            0
        );
        let e = err(&GW.replace("num_validation_samples", "num_validaton_samples"));
        assert!(
            e.starts_with("model.embedding_kwargs.svd.num_validaton_samples: ")
                && e.contains("did you mean `num_validation_samples`"),
            "{e}"
        );
        let e = err(&GW.replace("size: 10", "size: 82"));
        assert!(
            e.starts_with("model.embedding_kwargs.svd.size: ") && e.contains("1 to 81"),
            "{e}"
        );
        let e = err(&GW.replace("num_training_samples: 100", "num_training_samples: 5"));
        assert!(
            e.starts_with("model.embedding_kwargs.svd.num_training_samples: "),
            "{e}"
        );
        let e = err(&GW.replace("size: 10, ", ""));
        assert!(
            e.starts_with("model.embedding_kwargs.svd: ") && e.contains("size"),
            "{e}"
        );
        let (s, _) = NpeSettings::from_yaml(
            &GW.replace("lr: 0.001}", "lr: 0.001}\n    freeze_rb_layer: True"),
        )
        .unwrap();
        assert_eq!(s.frozen_blocks(0), [RB_LAYER]);
    }

    /// Dingo's stages: each with its own batch, optimizer, schedule (per update, from epochs)
    /// and frozen blocks; `num_gpus` is the replica count; bad stages name their key.
    #[test]
    fn later_stages_map_to_their_own_engine_configs() {
        let two = GOOD.replace(
            "local:\n  replicas: 2",
            "  stage_1:
    epochs: 2
    batch_size: 128
    gradient_updates_per_optimizer_step: 2
    optimizer: {type: adamw, lr: 0.0001, weight_decay: 0.05, fused: true}
    scheduler: {type: step, step_size: 1, gamma: 0.5}
    freeze: [embedding_net.blocks.0]
local:
  num_gpus: 2",
        );
        let (s, raw) = NpeSettings::from_yaml(&two).unwrap();
        assert_eq!(s.stages().len(), 2);
        assert_eq!(s.frozen_blocks(1), ["embedding_net.blocks.0"]);
        assert!(s.frozen_blocks(0).is_empty());
        assert_eq!(s.steps_per_epoch(1), 9000 / 256);
        let c = s
            .engine_config(1, &raw, Launch::SingleProcess, Path::new("/tmp/out"), false)
            .unwrap();
        assert_eq!(c["npe_stage"], 1);
        assert_eq!(c["run"]["batch_size"], 64);
        assert_eq!(c["run"]["distribution"]["global_batch_size"], 128);
        assert_eq!(c["training"]["gradient_updates_per_optimizer_step"], 2);
        assert_eq!(c["training"]["epochs"], 2);
        let o = &c["training"]["optimizer"];
        assert_eq!(o["name"], "adamw");
        assert_eq!(o["weight_decay"], 0.05);
        assert_eq!(o["schedule"]["name"], "step");
        assert_eq!(o["schedule"]["step_updates"], 35);
        assert_eq!(s.replicas(Launch::SingleProcess).unwrap(), 2);
        let e = s
            .engine_config(1, &raw, Launch::Mpi(3), Path::new("/tmp/out"), false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("local.num_gpus: is 2"), "{e}");
        let e = err(&two.replace("batch_size: 128", "batch_sise: 128"));
        assert!(
            e.starts_with("training.stage_1.batch_sise: ") && e.contains("`batch_size`"),
            "{e}"
        );
        let e = err(&two.replace("gamma: 0.5", "gamma: 1.5"));
        assert!(e.starts_with("training.stage_1.scheduler.gamma: "), "{e}");
        let e = err(&two.replace("num_gpus: 2", "num_gpus: 2\n  replicas: 4"));
        assert!(
            e.starts_with("local.num_gpus: is 2 but local.replicas is 4"),
            "{e}"
        );
        let e = err(&two.replace("freeze: [", "freeze_rb_layer: true\n    freeze: ["));
        assert!(
            e.starts_with("training.stage_1.freeze_rb_layer: ") && e.contains("svd"),
            "{e}"
        );
        let e = err(&two.replace("  stage_1:", "  stage_01:"));
        assert!(e.starts_with("training.stage_01: "), "{e}");
    }

    /// Issue 47: a key given twice is refused with its line, `.nan` / `.inf` by their key,
    /// and optimizer values by the keys the file has (never the engine's names).
    #[test]
    fn duplicate_keys_non_finite_numbers_and_optimizer_values_are_refused_as_written() {
        let e = err(&GOOD.replace("    epochs: 3\n", "    epochs: 3\n    epochs: 4\n"));
        assert!(
            e.starts_with("training.stage_0: the key \"epochs\" is given twice (in the mapping at line 24 column 5)"),
            "{e}"
        );
        let e = err(&GOOD.replace("num_bins: 8", "num_bins: 8\n      tail_bound: .nan"));
        assert!(
            e.starts_with("model.posterior_kwargs.base_transform_kwargs.tail_bound: ")
                && e.contains("not a finite number"),
            "{e}"
        );
        let e = err(&GOOD.replace("lr: 0.001}", "lr: .inf}"));
        assert!(e.starts_with("training.stage_0.optimizer.lr: "), "{e}");
        for (to, key) in [
            ("{type: adam, lr: -0.1}", "lr"),
            ("{type: adam, lr: 1.0e-60}", "lr"),
            ("{type: adam, lr: 0.001, betas: [0.9, 1.0]}", "betas"),
            ("{type: adam, lr: 0.001, eps: 2.0}", "eps"),
            (
                "{type: adamw, lr: 0.001, weight_decay: -1.0}",
                "weight_decay",
            ),
            ("{type: sgd, lr: 0.001, momentum: 1.0}", "momentum"),
        ] {
            let e = err(&GOOD.replace("{type: adam, lr: 0.001}", to));
            assert!(
                e.starts_with(&format!("training.stage_0.optimizer.{key}: ")),
                "{to}: {e}"
            );
        }
        for bound in ["0", "-1.0", "10000.0"] {
            let e = err(&GOOD.replace(
                "num_bins: 8",
                &format!("num_bins: 8\n      tail_bound: {bound}"),
            ));
            assert!(
                e.starts_with("model.posterior_kwargs.base_transform_kwargs.tail_bound: "),
                "{bound}: {e}"
            );
        }
        let e = err(&GOOD
            .replace("norm: LayerNorm", "norm: batch_norm")
            .replace("batch_size: 64", "batch_size: 1"));
        assert!(
            e.starts_with("training.stage_0.batch_size: is 1, but BatchNorm"),
            "{e}"
        );
        let e = err(&GOOD.replace("hidden_dims: [16, 16]", "hidden_dims: [16, 0]"));
        assert!(e.starts_with("model.embedding_kwargs.hidden_dims: "), "{e}");
        let e = err(&GOOD.replace("T_max: 3}", "T_max: 3, eta_min: 0.1}"));
        assert!(e.starts_with("training.stage_0.scheduler.eta_min: "), "{e}");
        assert_eq!(
            settings_key(1, "training.optimizer.learning_rate"),
            "training.stage_1.optimizer.lr"
        );
        assert_eq!(
            settings_key(0, "training.optimizer.beta2"),
            "training.stage_0.optimizer.betas"
        );
        assert_eq!(
            settings_key(2, "training.optimizer.epsilon"),
            "training.stage_2.optimizer.eps"
        );
    }
}
