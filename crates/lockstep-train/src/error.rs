//! Errors of the training engine.
//!
//! Display rule: a variant either prints its cause in its own message or exposes it as
//! [`std::error::Error::source`], never both, so a caller that prints the whole chain
//! (`{:#}` of an `anyhow::Error`) shows every cause exactly once.

use lockstep_comm::CommError;
use lockstep_core::config::ConfigError;
use lockstep_core::memory::MemoryError;
use lockstep_core::output_dir::OutputDirError;
use std::path::PathBuf;
use thiserror::Error;

/// Everything that can stop a training run. Messages name the key, file or value and the fix.
#[derive(Debug, Error)]
pub enum TrainError {
    /// The configuration is invalid; detected before any output is written. Displayed as
    /// `FILE: KEY: PROBLEM`.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The run would not fit in the memory of this machine; detected before any output is
    /// written.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The output directory cannot be used (exists without overwrite, not lockstep's, ...).
    #[error(transparent)]
    OutputDir(#[from] OutputDirError),
    /// Reading or writing a file failed; the OS error is the [`source`](std::error::Error::source).
    #[error("{}: {action}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done, e.g. `cannot create the output directory`.
        action: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint cannot be used or written.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// Why it was refused.
        message: String,
    },
    /// A collective failed (a peer died, mismatched collectives, ...).
    #[error("communication failed")]
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
    /// The model or the batch source failed during training; its error (with its own causes)
    /// is the [`source`](std::error::Error::source).
    #[error("model error at update {update}")]
    Model {
        /// The update during which it happened.
        update: u64,
        /// The model's error.
        #[source]
        error: anyhow::Error,
    },
    /// The model or its config could not be read or built (network, inputs, losses); the
    /// model's error, shown as is.
    #[error(transparent)]
    Build(anyhow::Error),
    /// Every rank of the job stopped during validation, before any output; this is this
    /// rank's own reason (only the lowest-numbered refusing rank carries one).
    #[error(transparent)]
    Refused(Box<TrainError>),
    /// Every rank of the job stopped during validation because rank `rank` refused the run
    /// (that rank reports why).
    #[error("rank {rank} refused the run during validation")]
    RefusedByPeer {
        /// The rank that reports the reason.
        rank: usize,
    },
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
    /// Loss scaling skipped update after update ([`crate::grad_scaler`]): `skipped`
    /// consecutive updates up to `update` (all of this run's, when `whole_run`), or the scale
    /// reached its floor; the gradient overflows whatever the scale, and the run learns
    /// nothing. Every replica takes the same decision (invariant 9).
    #[error("{}the loss scaler skipped {skipped} update(s) in a row up to update {update} (the gradient overflowed each time; loss scale now {scale:e}{}), so {}; lower training.grad_scaler.init_scale or backoff_factor, or turn mixed precision off", if *.whole_run { "nothing was trained: " } else { "" }, if *.at_floor { ", its floor" } else { "" }, if *.whole_run { "no update was applied and nothing is exported" } else { "training stopped" })]
    UpdatesSkipped {
        /// The update the run stopped at.
        update: u64,
        /// Consecutive skipped updates up to it.
        skipped: u64,
        /// The loss scale now.
        scale: f32,
        /// The scale reached its floor (the smallest positive normal float32).
        at_floor: bool,
        /// Every update of this run was skipped (found at its end, before any export).
        whole_run: bool,
    },
    /// A stop was asked for ([`lockstep_core::interrupt`], Ctrl-C in the Python package):
    /// every replica stopped after update `update`, and the chief wrote a checkpoint there
    /// (`checkpoint`, when the run has a run directory) that `--resume` continues from.
    #[error("interrupted (Ctrl-C) after update {update}{}", match checkpoint { Some(c) => format!("; checkpoint {}, resume from it with --resume (Python: resume=...)", c.display()), None => String::new() })]
    Interrupted {
        /// Updates completed in total.
        update: u64,
        /// The checkpoint written at the stop (chief, with a run directory).
        checkpoint: Option<PathBuf>,
    },
    /// A failure injected by a [`crate::testing::Fault`] (failure tests only).
    #[error("injected failure ({what}) on rank {rank}")]
    Injected {
        /// Where it was injected.
        what: String,
        /// The rank it was injected on.
        rank: usize,
    },
}

impl TrainError {
    /// A [`TrainError::Config`] for `key` (file unknown).
    pub fn config(key: impl Into<String>, problem: impl Into<String>) -> Self {
        TrainError::Config(ConfigError::new(key, problem))
    }

    /// A [`TrainError::Io`]: `action` on `path` failed with `source`.
    pub fn io(path: impl Into<PathBuf>, action: impl Into<String>, source: std::io::Error) -> Self {
        TrainError::Io {
            path: path.into(),
            action: action.into(),
            source,
        }
    }

    /// True for errors that every rank of the job returns at the same point, each knowing the
    /// job failed (validation agreed across ranks, the chief's output setup broadcast to all,
    /// an interruption agreed through the update's metrics):
    /// the process may then leave through `MPI_Finalize` and a non-zero exit instead of
    /// aborting the job. Anything else (a model error on one rank, a lost peer) must abort.
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            TrainError::Refused(_)
                | TrainError::RefusedByPeer { .. }
                | TrainError::Interrupted { .. }
        )
    }
}
