//! The NEST-exact simulation (double precision): cell models and their constants
//! (`model.rs`), NEST's time grid and propagators (`nest.rs`), one neuron's step, generic
//! over [`Scalar`](crate::Scalar) (`step.rs`; the training engines reproduce it), the
//! per-trial forward recursion and `simulate` (`forward.rs`) with its structure-of-arrays
//! kernel (`kernel.rs`), and the `lockstep simulate` run from a BMTK-style config
//! (`config.rs`: spikes, membrane reports, rates; `reports.rs`: the reports placed on the
//! time grid).

pub(crate) mod config;
pub(crate) mod forward;
pub(crate) mod kernel;
pub(crate) mod model;
pub(crate) mod nest;
pub(crate) mod reports;
pub(crate) mod step;
