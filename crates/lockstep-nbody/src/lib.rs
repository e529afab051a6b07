//! `lockstep-nbody`: sharded particles, FMM gravity, leapfrog integrators and snapshots
//! (specification `docs/nbody.md`).
//!
//! What this crate guarantees:
//!
//! - **Accurate forces.** [`mod@fmm`] with its defaults (expansion order p = 6, opening angle
//!   theta = 0.6) gives accelerations within a 99th-percentile relative error of 1e-3 of
//!   direct summation ([`mod@direct`]) on Plummer spheres and clumped sets
//!   (`tests/accuracy.rs`), and the error falls as p rises.
//! - **Globally correct forces across ranks.** A sharded run (Morton sample-sort plus a
//!   locally essential tree exchange, [`shard`]) gives every particle the force the
//!   one-rank run gives it, on any rank count, with ranks that hold no particle, and the
//!   union of the per-rank snapshots equals the one-rank snapshot (`tests/sharded*.rs`).
//! - **Conservation.** With FMM forces, kick-drift-kick leapfrog keeps momentum within 1e-6
//!   relative per step (about 5e-9 measured) and energy within |dE/E| < 1e-3 over 1,000
//!   Plummer steps (about 6e-7 measured; `tests/conservation.rs`);
//!   drifts of a system with zero reference scale are reported as absolute values.
//! - **Inputs and outputs that lose nothing.** GADGET-format HDF5 sets are read in the
//!   shapes GADGET-4 and h5py write (multi-file, absent types, `MassTable`, single
//!   precision, `NumPart_Total` with its high word); a run validates its config, memory
//!   and output folder before writing anything, owns its output folder (the
//!   `.lockstep-output` rule of `lockstep_core::output_dir`), and a failing rank ends the
//!   whole run within seconds with its message.

// Numerical kernels index several arrays with one loop variable; iterator chains would hide
// the index algebra of the multipole formulas.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

pub mod accuracy;
pub mod config;
pub mod direct;
pub mod error;
pub mod fmm;
pub mod fmm_gpu;
pub mod ic;
pub mod integrate;
pub mod output;
pub mod particles;
pub mod rng;
pub mod shard;
pub mod snapshot;
pub mod units;

pub use config::{run_nbody_config, NbodyConfig, RunOptions, Summary};
pub use direct::{direct, direct_on, Forces};
pub use error::NbodyError;
pub use fmm::{
    fmm, Fmm, FmmParams, FmmStats, ForceDevice, NearField, PhaseSeconds, RemoteCell, SourceSet,
};
pub use ic::InitialConditions;
pub use integrate::{
    simulate, Diagnostics, ForceSettings, Gravity, Integrator, Method, NbodySimulateOptions,
};
pub use lockstep_gpu::DeviceRequest;
pub use particles::Particles;
pub use units::Units;
