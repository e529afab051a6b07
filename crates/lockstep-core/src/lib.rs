//! The leaf every lockstep crate builds on; it depends on no other lockstep crate.
//!
//! - [`config`]: the one config idiom. Each crate declares typed serde sections for the keys it
//!   owns; this module deserializes them into values or one [`ConfigError`] `{file, key,
//!   problem}`, refuses unknown keys with the nearest known key suggested, and resolves paths
//!   relative to the config file.
//! - [`rng`]: SplitMix64 (Steele, Lea & Flood 2014), the one generator behind every seeded
//!   stream (network building, Poisson inputs, reference models, initial conditions), so a
//!   stream keyed by (seed, sample, ...) gives the same numbers in every crate.
//! - [`memory`]: the memory this process may still use (cgroup limit or `MemAvailable`) and its
//!   peak resident set, for the checks that refuse runs which cannot fit before any output is
//!   touched, and for the benchmarks.
//! - [`output_dir`]: the `.lockstep-output` marker and the one rule deciding whether an
//!   existing output folder may be replaced (only what lockstep wrote is ever deleted).
//! - [`interrupt`]: the process-wide Ctrl-C flag a front end sets and the libraries poll at
//!   points where stopping leaves nothing half done.
//!
//! - `testing` (feature `testing`, tests only): running the Python checks of the
//!   workspace's tests.
//!
//! Guarantees: no I/O beyond reading the files and `/proc`/cgroup entries named in the docs,
//! and writing the output-folder marker when asked ([`output_dir::write_marker`]); no global
//! state but the [`interrupt`] flag; every function is deterministic given its inputs.

pub mod config;
pub mod interrupt;
pub mod memory;
pub mod output_dir;
pub mod rng;

pub use config::ConfigError;
