//! The error type of `lockstep-snn`.
//!
//! Every variant names what was being read (file, node type, edge, config key), the
//! offending value, and how to fix it. Bad input never panics.

use std::path::PathBuf;

/// Everything that can go wrong while building, simulating or training a point-neuron network.
#[derive(Debug, thiserror::Error)]
pub enum SnnError {
    /// A node type uses a model lockstep-snn does not implement.
    #[error("node type '{node_type}' uses model '{model}', which lockstep-snn cannot simulate: {reason}")]
    UnsupportedModel {
        /// Node type id and/or name (e.g. `101 (Rorb)`).
        node_type: String,
        /// The `model_template` (e.g. `nest:glif_psc`).
        model: String,
        /// Why it is rejected and what is supported instead.
        reason: String,
    },

    /// A cell-model parameter is missing, has the wrong type or an invalid value.
    #[error("node type '{node_type}' ({model}): parameter '{key}' = {value}: {reason}")]
    InvalidParameter {
        /// Node type id and/or name.
        node_type: String,
        /// The `model_template`.
        model: String,
        /// The parameter name in the dynamics_params JSON.
        key: String,
        /// The offending value as text (or `missing`).
        value: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// The simulation time step is not usable on NEST's time grid.
    #[error("time step dt = {dt} ms is invalid: {reason}")]
    InvalidDt {
        /// The time step in ms.
        dt: f64,
        /// What is wrong.
        reason: String,
    },

    /// An edge's delay is shorter than one time step (NEST refuses such connections).
    #[error("{edges}: delay {delay_ms} ms is shorter than one time step (dt = {dt} ms); every delay must be at least dt. Fix the edge type's 'delay' or use a smaller run.dt")]
    DelayTooShort {
        /// Which edges (population, edge index / type).
        edges: String,
        /// The delay in ms.
        delay_ms: f64,
        /// The time step in ms.
        dt: f64,
    },

    /// An edge's receptor type does not exist on its target's model.
    #[error("{edges}: receptor_type {receptor} is invalid for target node type '{node_type}' ({model}): {reason}")]
    InvalidReceptor {
        /// Which edges.
        edges: String,
        /// The NEST receptor_type.
        receptor: i64,
        /// Target node type.
        node_type: String,
        /// Target model.
        model: String,
        /// What is allowed.
        reason: String,
    },

    /// Structural inconsistency in a network specification (indices out of range, sizes).
    #[error("invalid network: {0}")]
    InvalidNetwork(String),

    /// An input (spike file, Poisson source) is invalid.
    #[error("input '{input}': {reason}")]
    InvalidInput {
        /// The input name or file.
        input: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// A configuration key is missing or invalid: `FILE: KEY: PROBLEM`.
    #[error(transparent)]
    Config(#[from] lockstep_core::config::ConfigError),

    /// The output directory exists and the config does not allow overwriting it.
    #[error("output directory '{path}' already exists; set \"output\": {{\"overwrite_output_dir\": true}} or choose another output_dir")]
    OutputExists {
        /// The output directory.
        path: PathBuf,
    },

    /// A file system operation failed.
    #[error("{what} '{path}': {cause}")]
    Io {
        /// What was being done (e.g. "cannot create output directory").
        what: String,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },

    /// Shapes of buffers passed to the training API disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),

    /// An error from the SONATA reader.
    #[error(transparent)]
    Sonata(Box<lockstep_sonata::SonataError>),

    /// The run would need more memory than the machine has (checked before any output).
    #[error(transparent)]
    Memory(#[from] lockstep_core::memory::MemoryError),
    /// The GPU: no adapter, a missing feature, a buffer over the adapter's limits, a device
    /// error.
    #[error(transparent)]
    Gpu(#[from] lockstep_gpu::GpuError),
    /// A stop was asked for ([`lockstep_core::interrupt`], Ctrl-C in the Python package)
    /// during the simulation; nothing was written.
    #[error("the simulation was interrupted (Ctrl-C) before its end; nothing was written")]
    Interrupted,
    /// An optimizer update on the GPU left a parameter infinite or NaN (the training state on
    /// the device; the host path reports it as lockstep-train's `NonFiniteParameter`).
    #[error("parameter {index} became {value} after an optimizer update on the GPU; lower training.optimizer.learning_rate or check the optimizer settings")]
    NonFiniteParameter {
        /// Index in the flat trainable buffer.
        index: usize,
        /// The value.
        value: f32,
    },
}

impl From<lockstep_sonata::SonataError> for SnnError {
    fn from(e: lockstep_sonata::SonataError) -> Self {
        SnnError::Sonata(Box::new(e))
    }
}

/// Result alias of this crate.
pub type Result<T, E = SnnError> = std::result::Result<T, E>;
