//! `lockstep-nbody`: sharded particles, FMM gravity, leapfrog integrators and snapshots
//! (specification `docs/nbody.md`).

// Numerical kernels index several arrays with one loop variable; iterator chains would hide
// the index algebra of the multipole formulas.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

pub mod accuracy;
pub mod config;
pub mod direct;
pub mod error;
pub mod fmm;
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
pub use fmm::{fmm, Fmm, FmmParams, FmmStats, PhaseSeconds, RemoteCell, SourceSet};
pub use ic::InitialConditions;
pub use integrate::{
    simulate, Diagnostics, ForceSettings, Gravity, Integrator, Method, SimulateOptions,
};
pub use particles::Particles;
pub use units::Units;
