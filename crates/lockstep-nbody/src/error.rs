//! Error type of the crate: every message names the file, key or parameter, the offending
//! value, and the fix.

use std::path::{Path, PathBuf};

use lockstep_core::ConfigError;

/// Errors of `lockstep-nbody`. Bad input never panics; it ends up here.
#[derive(Debug, thiserror::Error)]
pub enum NbodyError {
    /// More particles must live on a rank than its padded arrays hold.
    #[error(
        "particle capacity exceeded on rank {rank}: {needed} particles do not fit into the \
         {capacity} slots of its arrays; allocate at least {needed} slots \
         (`Particles::with_capacity`; `capacity_factor` pads the count a rank starts with)"
    )]
    CapacityOverflow {
        /// Rank that overflowed.
        rank: usize,
        /// Particles that had to fit.
        needed: usize,
        /// Padded capacity of the arrays.
        capacity: usize,
    },
    /// A numeric or enumerated parameter is out of its valid range.
    #[error("invalid parameter `{name}` = {value}: {fix}")]
    InvalidParameter {
        /// Parameter (config key) name.
        name: String,
        /// Offending value, formatted.
        value: String,
        /// What a valid value looks like.
        fix: String,
    },
    /// The JSON configuration could not be read or is invalid (`FILE: KEY: PROBLEM`).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The output folder cannot be used (exists and may not be replaced, is a file, holds
    /// files lockstep did not write).
    #[error("output folder {}: {problem}", dir.display())]
    OutputDir {
        /// The folder.
        dir: PathBuf,
        /// What is wrong and the fix.
        problem: String,
    },
    /// An HDF5 file could not be read or written.
    #[error("HDF5 file {path}, object `{object}`: {message}")]
    Hdf5 {
        /// HDF5 file.
        path: PathBuf,
        /// Group, dataset or attribute.
        object: String,
        /// What went wrong and how to fix it.
        message: String,
    },
    /// A file or directory could not be read or written.
    #[error("I/O error on {path}: {cause}")]
    Io {
        /// File or directory.
        path: PathBuf,
        /// Underlying error.
        cause: std::io::Error,
    },
    /// The GPU of `forces.device` cannot be used (no adapter, a buffer over its limits, a
    /// device error or timeout); the message names the adapter, the buffer or the phase.
    #[error("forces.device: {0}")]
    Gpu(String),
    /// A collective operation failed (a peer rank failed or the arguments disagree).
    #[error("collective communication failed: {0}")]
    Comm(String),
    /// Every rank stopped before the run began (validation, initial conditions, the output
    /// folder), each knowing it; this is this rank's own reason (only the lowest-numbered
    /// refusing rank carries one).
    #[error(transparent)]
    Refused(Box<NbodyError>),
    /// Every rank stopped before the run began because rank `rank` refused it while `what`
    /// (that rank reports why).
    #[error("rank {rank} refused the run ({what})")]
    RefusedByPeer {
        /// The rank that reports the reason.
        rank: usize,
        /// The step that failed there, e.g. `preparing the output folder`.
        what: String,
    },
    /// A stop was asked for ([`lockstep_core::interrupt`], Ctrl-C in the Python package):
    /// the force evaluation or the run stopped at its next check; the snapshots already
    /// written stay, nothing else is.
    #[error("interrupted (Ctrl-C)")]
    Interrupted,
}

impl NbodyError {
    /// Shorthand for [`NbodyError::InvalidParameter`].
    pub fn param(name: &str, value: impl std::fmt::Display, fix: &str) -> Self {
        NbodyError::InvalidParameter {
            name: name.to_string(),
            value: value.to_string(),
            fix: fix.to_string(),
        }
    }

    /// This error as a problem with a key of the config file `file`: an
    /// [`NbodyError::InvalidParameter`] becomes `FILE: NAME: VALUE is invalid: FIX`, any other
    /// error `FILE: MESSAGE` (a [`NbodyError::Config`] keeps its own file).
    pub fn in_config(self, file: &Path) -> Self {
        match self {
            NbodyError::InvalidParameter { name, value, fix } => NbodyError::Config(
                ConfigError::new(name, format!("invalid value {value}: {fix}")).in_file(file),
            ),
            NbodyError::Config(e) => NbodyError::Config(e.in_file(file)),
            other => NbodyError::Config(ConfigError::new("", other.to_string()).in_file(file)),
        }
    }

    /// True for errors that every rank returns at the same point before the run began,
    /// each knowing the job failed ([`NbodyError::Refused`], [`NbodyError::RefusedByPeer`]):
    /// the process may leave through `MPI_Finalize` with a non-zero status instead of
    /// aborting the job.
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            NbodyError::Refused(_) | NbodyError::RefusedByPeer { .. }
        )
    }

    /// `Err(NbodyError::Interrupted)` once a stop was asked for
    /// ([`lockstep_core::interrupt`]).
    ///
    /// Errors: [`NbodyError::Interrupted`].
    pub fn check_interrupt() -> Result<(), NbodyError> {
        lockstep_core::interrupt::check().map_err(|_| NbodyError::Interrupted)
    }

    /// Shorthand for [`NbodyError::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        NbodyError::Io {
            path: path.into(),
            cause: source,
        }
    }
}
