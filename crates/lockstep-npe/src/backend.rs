//! The backend traits the NPE network runs on: burn backends with the custom operations of
//! this crate, SyncBatchNorm ([`NormBackend`]) and fused activations ([`FusedOps`]).
//! The ndarray backend (f32, f64), wgpu, CUDA (feature `cuda`) and `Autodiff` over any of
//! them implement both.

use crate::fused_ops::FusedOps;
use crate::sync_batch_norm::NormBackend;

/// A backend with every custom operation of the NPE network (evaluation passes).
pub trait NpeBackend: NormBackend + FusedOps {}

impl<B: NormBackend + FusedOps> NpeBackend for B {}

/// The autodiff backends an [`crate::NpeModel`] trains on: the custom operations in training
/// and in the evaluation passes on the inner backend.
pub trait TrainBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: NpeBackend> + NpeBackend
{
}

impl<B> TrainBackend for B where
    B: burn::tensor::backend::AutodiffBackend<InnerBackend: NpeBackend> + NpeBackend
{
}
