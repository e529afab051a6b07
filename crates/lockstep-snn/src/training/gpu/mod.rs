//! The GPU engine (`run.device: "gpu"`): the float32 BPTT step as WGSL compute kernels run
//! through wgpu (Vulkan, Metal, DX12; Mesa's lavapipe without a GPU), one process or thread
//! replica per GPU.
//!
//! The kernels (`bptt.wgsl`) repeat the float32 CPU engine's operations in its order, with
//! deterministic sums (spike delivery as a pull over each target's in-edges, the spike
//! adjoint as a gather over each source's out-edges, each weight gradient owned by one
//! invocation): the same inputs give the same bits on every run, and on a driver that does
//! not fuse multiply-adds (lavapipe) the forward pass has the CPU engine's bits. The whole
//! time loop runs on the device, one command buffer per pass; the losses and the gradient
//! come back once per call. Files: `layout.rs` (the network packed for the device, the
//! kernels' constants), `engine.rs` (buffers, kernels, one call).

mod engine;
mod layout;

pub(crate) use engine::GpuEngine;
