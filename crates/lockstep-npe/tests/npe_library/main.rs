//! lockstep-npe's integration tests in one test binary (`cargo test --release --workspace
//! --test npe_library`; one module a topic, `-- training::` runs one of them).
//!
//! One binary, not one per file: each binary compiles its own copy of the models' generic
//! code (burn's autodiff over the ndarray and wgpu backends), which cost about 8 minutes of
//! every `make test` as nine binaries. Two files stay binaries of their own, because they need
//! a process to themselves: `tests/jacobian.rs` (burn's ndarray device takes its float type
//! from its first use in a process, and that test runs in f64 while these run in f32) and
//! `tests/stages.rs` (it changes the working directory).

mod activation_kernel;
mod common;
mod device_step;
mod gw_waveform;
mod nflows_export;
mod sbibm_reference;
mod spline;
mod spline_kernel;
mod svd;
mod sync_batch_norm;
mod training;
