//! The error type of `lockstep-npe`.
//!
//! Display rule (as lockstep-train's): a variant either prints its cause in its own message or
//! exposes it as [`std::error::Error::source`], never both, so a caller that prints the whole
//! chain (`{:#}` of an `anyhow::Error`) shows every cause exactly once. Messages name the file
//! and key as the user wrote them (`FILE: KEY: PROBLEM`), the offending value, and the fix.
//!
//! The methods of lockstep-train's `Model` and `BatchSource` traits return that crate's
//! `anyhow::Result`; [`crate::model::NpeModel`] and [`crate::tasks::TaskSource`] turn an
//! [`NpeError`] into it unchanged (its whole chain of causes kept).

use lockstep_core::config::ConfigError;
use lockstep_core::output_dir::OutputDirError;
use lockstep_train::TrainError;

/// Everything that can go wrong in neural posterior estimation: settings, networks and their
/// parameters, reduced bases, checkpoints and run directories, training.
#[derive(Debug, thiserror::Error)]
pub enum NpeError {
    /// A settings file, or a key in it, is invalid; detected before any output is written.
    /// Displayed as `FILE: KEY: PROBLEM` (unknown keys refused with the nearest key).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A value does not fit what it is used with: widths of a network, a parameter count, a
    /// frozen block name, a sample set, a reference task or observation that is not bundled.
    /// The message names the value and what would fit.
    #[error("{0}")]
    Invalid(String),
    /// A numerical method failed: an SVD that does not converge, a classifier that diverges.
    #[error("{0}")]
    Numerical(String),
    /// Stored data cannot be used: a run directory without the settings of an NPE run, a
    /// checkpoint that does not fit the network its run describes, a malformed bundled
    /// reference file. The message names the file.
    #[error("{0}")]
    Data(String),
    /// A file or folder cannot be read or written: `what` names it and the action; the OS
    /// error is the [`source`](std::error::Error::source).
    #[error("{what}")]
    Io {
        /// What was being done, naming the file (e.g. `cannot read posterior.safetensors`).
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An output cannot go where it was asked to: it exists and replacing it was not asked
    /// for. The message names it and the options that fix it.
    #[error("{0}")]
    Output(String),
    /// An output folder may not be replaced (not written by lockstep, a file, unreadable).
    #[error(transparent)]
    OutputDir(#[from] OutputDirError),
    /// A SyncBatchNorm training pass failed among the replicas (a failed peer, replicas that
    /// disagree on the network); the message names the rank.
    #[error("{0}")]
    Replicas(String),
    /// The training engine stopped (its config, a checkpoint it cannot find or verify, a
    /// failed replica, ...); shown as the engine reports it.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// An error and where it happened: `context` names the file and key (e.g.
    /// `settings.yaml: training.stage_1.freeze`); the error is the
    /// [`source`](std::error::Error::source).
    #[error("{context}")]
    Context {
        /// Where: the file and key, or the step that failed.
        context: String,
        /// What went wrong there.
        #[source]
        source: Box<NpeError>,
    },
}

impl NpeError {
    /// This error with `context` (where it happened) in front of it.
    pub fn context(self, context: impl Into<String>) -> Self {
        NpeError::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    /// An I/O error while doing `what` (which names the file).
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        NpeError::Io {
            what: what.into(),
            source,
        }
    }
}
