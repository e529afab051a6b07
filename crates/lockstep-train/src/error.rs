//! Errors of the training engine.

use lockstep_comm::CommError;
use std::path::PathBuf;
use thiserror::Error;

/// Everything that can stop a training run. Messages name the key, file or value and the fix.
#[derive(Debug, Error)]
pub enum TrainError {
    /// The configuration is invalid; detected before any output is written.
    #[error("config error at `{key}`: {message}")]
    Config {
        /// The JSON key path, e.g. `run.distribution.global_batch_size`.
        key: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A checkpoint cannot be used.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// Why it was refused.
        message: String,
    },
    /// A collective failed (a peer died, mismatched collectives, ...).
    #[error("communication failed: {0}")]
    Comm(#[from] CommError),
    /// The replicas' parameters differ (invariant 7).
    #[error("replicas diverged at update {update}: parameter checksums differ across ranks ({checksums}); every replica must apply the same update")]
    Diverged {
        /// The optimizer update after which the checksums were compared.
        update: u64,
        /// The checksum of each rank.
        checksums: String,
    },
    /// The reduced loss is not finite.
    #[error("the loss became {value} at update {update}; lower training.optimizer.learning_rate or check the inputs")]
    NonFinite {
        /// The update.
        update: u64,
        /// The reduced loss.
        value: f64,
    },
    /// Another rank failed; this rank stops with it.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// The failing rank.
        rank: usize,
        /// Its report.
        message: String,
    },
    /// The model or the batch source failed during training.
    #[error("model error at update {update}: {error}")]
    Model {
        /// The update during which it happened.
        update: u64,
        /// The model's error (its message carries its causes).
        error: anyhow::Error,
    },
    /// The model could not be built (network, inputs or losses of the config).
    #[error("{0}")]
    Build(anyhow::Error),
    /// The parameters are no longer finite after an update.
    #[error("parameter {index} became {value} after update {update}; lower training.optimizer.learning_rate or check the optimizer settings")]
    NonFiniteParameter {
        /// The update.
        update: u64,
        /// Index in the flat trainable buffer.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A failure injected by the test-only switch `LOCKSTEP_TEST_INJECT_FAILURE`.
    #[error("injected failure ({0}) on rank {1}")]
    Injected(String, usize),
}

impl TrainError {
    /// A [`TrainError::Config`] for `key`.
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        TrainError::Config {
            key: key.into(),
            message: message.into(),
        }
    }

    /// A [`TrainError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, err: impl std::fmt::Display) -> Self {
        TrainError::Io {
            path: path.into(),
            message: err.to_string(),
        }
    }
}
