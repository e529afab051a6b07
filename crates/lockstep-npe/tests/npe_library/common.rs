//! Helpers shared by the integration tests.
#![allow(dead_code)]

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lockstep_core::rng::SplitMix64;
use lockstep_npe::spline::{rational_quadratic_spline, SplineParams};
use lockstep_npe::{EmbeddingConfig, FlowConfig, NetworkConfig, Norm, NpeNetwork, Standardization};

pub fn tensor<B: Backend>(v: Vec<f64>, rows: usize, cols: usize) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
}

/// Random spline parameters for `m` scalars (unnormalized values ~ scale·N(0,1)) and inputs spread over and beyond `[-B, B]`.
pub fn random_splines(
    m: usize,
    k: usize,
    bound: f64,
    scale: f64,
    seed: u64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut rng = SplitMix64::new(seed);
    let mut draw = |n: usize, s: f64| (0..n).map(|_| s * rng.normal()).collect::<Vec<f64>>();
    let w = draw(m * k, scale);
    let h = draw(m * k, scale);
    let d = draw(m * (k - 1), scale);
    let x: Vec<f64> = (0..m)
        .map(|i| -1.2 * bound + 2.4 * bound * (i as f64 + 0.5) / m as f64)
        .collect();
    (x, w, h, d)
}

pub fn spline<B: Backend>(
    x: &[f64],
    w: &[f64],
    h: &[f64],
    d: &[f64],
    k: usize,
    inverse: bool,
    sp: &SplineParams,
) -> (Vec<f64>, Vec<f64>) {
    let m = x.len();
    let (y, ld) = rational_quadratic_spline(
        tensor::<B>(x.to_vec(), m, 1),
        tensor::<B>(w.to_vec(), m, k),
        tensor::<B>(h.to_vec(), m, k),
        tensor::<B>(d.to_vec(), m, k - 1),
        inverse,
        sp,
    );
    let f = |t: Tensor<B, 2>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    (f(y), f(ld))
}

pub fn small_network(theta_dim: usize, x_dim: usize, norm: Norm, tail_bound: f64) -> NpeNetwork {
    let config = NetworkConfig {
        embedding: EmbeddingConfig {
            hidden_dims: vec![16, 8],
            output_dim: 4,
            norm,
            projection: None,
        },
        flow: FlowConfig {
            num_flow_steps: 3,
            hidden_dim: 16,
            num_transform_blocks: 2,
            num_bins: 6,
            tail_bound,
            norm,
        },
        batch_norm_eps: lockstep_npe::layers::DINGO_BATCH_NORM_EPS,
    };
    NpeNetwork::new(
        config,
        theta_dim,
        x_dim,
        Standardization::identity(theta_dim, x_dim),
        5,
    )
    .unwrap()
}

/// Initial parameters plus N(0, s²) noise, so the flow is far from the identity.
pub fn random_params(net: &NpeNetwork, s: f64, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (mut p, st) = net.initial_values(seed);
    let mut rng = SplitMix64::new(seed ^ 99);
    p.iter_mut().for_each(|v| *v += (s * rng.normal()) as f32);
    (p, st)
}

pub fn det3(a: &[f64]) -> f64 {
    a[0] * (a[4] * a[8] - a[5] * a[7]) - a[1] * (a[3] * a[8] - a[5] * a[6])
        + a[2] * (a[3] * a[7] - a[4] * a[6])
}

/// Makes float32 the CPU device's default float type before a test touches
/// `NdArray<f64>`: burn fixes one default float dtype per device at its first use, and
/// `NdArray<f32>` and `NdArray<f64>` share the CPU device, so a test whose f64 reference
/// ran first made `Tensor::from_data` in the float32 tests of this binary (which run in
/// parallel) build f64 tensors. The f64 references cast their tensors explicitly.
pub fn cpu_default_f32() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let t = Tensor::<burn::backend::NdArray<f32>, 1>::from_data([0.0f32], &Default::default());
        assert_eq!(t.dtype(), burn::tensor::DType::F32);
    });
}
