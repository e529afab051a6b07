//! Simulation-based inference tasks as data sources for the engine.
//!
//! Every sample `(θ, x)` is simulated from its own SplitMix64 stream keyed by
//! `(seed, global sample index)` ([`sample_rng`]), so a global batch is the same whatever the
//! replica count or batch split (invariants 4-5 of the design). Definitions follow sbibm
//! (Lueckmann et al. 2021, "Benchmarking Simulation-Based Inference", AISTATS;
//! `sbibm/tasks/*/task.py`).

use crate::flow::Standardization;
use lockstep_core::rng::{splitmix64, SplitMix64};
use lockstep_train::{Batch, BatchSource};
use std::sync::Arc;

/// The random stream of global sample `index` under `seed`.
pub fn sample_rng(seed: u64, index: u64) -> SplitMix64 {
    SplitMix64::new(splitmix64(
        splitmix64(seed) ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    ))
}

/// A simulator with a prior: draws θ from the prior and x from the simulator given θ.
pub trait Task: Send + Sync {
    /// The sbibm name, e.g. `gaussian_linear`.
    fn name(&self) -> &str;
    /// Components of θ.
    fn theta_dim(&self) -> usize;
    /// Components of x.
    fn x_dim(&self) -> usize;
    /// Draws θ ~ prior and x ~ p(x | θ) from `rng` into `theta` and `x`.
    fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]);

    /// Means and standard deviations of θ and x, estimated from 10,000 simulations of a fixed
    /// stream (identical on every replica), as Dingo standardizes from its training set.
    fn standardization(&self) -> Standardization {
        let (td, xd) = (self.theta_dim(), self.x_dim());
        let n = 10_000u64;
        let mut sums = vec![0.0f64; 2 * (td + xd)];
        let (mut theta, mut x) = (vec![0.0; td], vec![0.0; xd]);
        for i in 0..n {
            self.simulate(&mut sample_rng(0x5_7A4D, i), &mut theta, &mut x);
            for (j, v) in theta.iter().chain(&x).enumerate() {
                sums[2 * j] += v;
                sums[2 * j + 1] += v * v;
            }
        }
        let stat = |j: usize| {
            let m = sums[2 * j] / n as f64;
            let var = (sums[2 * j + 1] / n as f64 - m * m).max(1e-24);
            (m, var.sqrt())
        };
        let (theta_mean, theta_std) = (0..td).map(stat).unzip();
        let (x_mean, x_std) = (td..td + xd).map(stat).unzip();
        Standardization {
            theta_mean,
            theta_std,
            x_mean,
            x_std,
        }
    }
}

/// sbibm `gaussian_linear`: θ ~ N(0, prior_scale·I), x | θ ~ N(θ, simulator_scale·I), both in
/// `dim` dimensions (sbibm: dim 10, prior_scale 0.1, simulator_scale 0.1; the scales are
/// variances, as sbibm passes `precision_matrix = inverse(scale * I)`).
#[derive(Debug, Clone, PartialEq)]
pub struct GaussianLinear {
    /// Dimension of θ and x.
    pub dim: usize,
    /// Prior variance per component.
    pub prior_scale: f64,
    /// Noise variance per component.
    pub simulator_scale: f64,
}

impl GaussianLinear {
    /// sbibm's task with `dim` dimensions (scales 0.1).
    pub fn new(dim: usize) -> Self {
        GaussianLinear {
            dim,
            prior_scale: 0.1,
            simulator_scale: 0.1,
        }
    }

    /// The analytic posterior `p(θ | x) = N(mean, var·I)`: `var = 1/(1/prior + 1/noise)`,
    /// `mean = var · x / noise`. Returns `(mean [dim], var)`.
    pub fn posterior(&self, x: &[f64]) -> (Vec<f64>, f64) {
        let var = 1.0 / (1.0 / self.prior_scale + 1.0 / self.simulator_scale);
        (
            x.iter().map(|v| var * v / self.simulator_scale).collect(),
            var,
        )
    }
}

impl Task for GaussianLinear {
    fn name(&self) -> &str {
        "gaussian_linear"
    }
    fn theta_dim(&self) -> usize {
        self.dim
    }
    fn x_dim(&self) -> usize {
        self.dim
    }
    fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]) {
        let (ps, ns) = (self.prior_scale.sqrt(), self.simulator_scale.sqrt());
        for t in theta.iter_mut() {
            *t = ps * rng.normal();
        }
        for (xi, t) in x.iter_mut().zip(theta.iter()) {
            *xi = t + ns * rng.normal();
        }
    }
}

/// sbibm `two_moons`: θ ~ U(-1, 1)², `a ~ U(-π/2, π/2)`, `r ~ N(0.1, 0.01²)`,
/// `p = (r cos a + 0.25, r sin a)`, and with the rotation by -π/4
/// `x = p + (-|θ₀ + θ₁| / √2, (θ₁ - θ₀) / √2)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TwoMoons;

impl Task for TwoMoons {
    fn name(&self) -> &str {
        "two_moons"
    }
    fn theta_dim(&self) -> usize {
        2
    }
    fn x_dim(&self) -> usize {
        2
    }
    fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]) {
        theta[0] = 2.0 * rng.uniform() - 1.0;
        theta[1] = 2.0 * rng.uniform() - 1.0;
        let a = std::f64::consts::PI * (rng.uniform() - 0.5);
        let r = 0.1 + 0.01 * rng.normal();
        let (p0, p1) = (r * a.cos() + 0.25, r * a.sin());
        let s = std::f64::consts::FRAC_1_SQRT_2;
        x[0] = p0 - (s * (theta[0] + theta[1])).abs();
        x[1] = p1 + s * (theta[1] - theta[0]);
    }
}

/// A task as the engine's [`BatchSource`]: inputs are x `[samples, x_dim]`, targets θ
/// `[samples, theta_dim]`; an unbounded stream (every global index is a fresh simulation).
#[derive(Clone)]
pub struct TaskSource {
    task: Arc<dyn Task>,
    seed: u64,
}

impl TaskSource {
    /// Simulations of `task` keyed by `seed`.
    pub fn new(task: Arc<dyn Task>, seed: u64) -> Self {
        TaskSource { task, seed }
    }
}

impl BatchSource for TaskSource {
    fn input_width(&self) -> usize {
        self.task.x_dim()
    }
    fn target_width(&self) -> usize {
        self.task.theta_dim()
    }
    fn global_batch(&mut self, first_sample: u64, count: usize) -> anyhow::Result<Batch> {
        let (td, xd) = (self.task.theta_dim(), self.task.x_dim());
        let mut batch = Batch {
            first_sample,
            samples: count,
            inputs: Vec::with_capacity(count * xd),
            targets: Vec::with_capacity(count * td),
        };
        let (mut theta, mut x) = (vec![0.0; td], vec![0.0; xd]);
        for i in 0..count as u64 {
            self.task.simulate(
                &mut sample_rng(self.seed, first_sample + i),
                &mut theta,
                &mut x,
            );
            batch.inputs.extend(x.iter().map(|&v| v as f32));
            batch.targets.extend(theta.iter().map(|&v| v as f32));
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_do_not_depend_on_the_split() {
        let mut s = TaskSource::new(Arc::new(GaussianLinear::new(3)), 7);
        let whole = s.global_batch(10, 8).unwrap();
        let a = s.global_batch(10, 4).unwrap();
        let b = s.global_batch(14, 4).unwrap();
        assert_eq!(whole.inputs, [a.inputs, b.inputs].concat());
        assert_eq!(whole.targets, [a.targets, b.targets].concat());
        let other = TaskSource::new(Arc::new(GaussianLinear::new(3)), 8)
            .global_batch(10, 8)
            .unwrap();
        assert_ne!(whole.targets, other.targets);
    }

    #[test]
    fn gaussian_linear_moments() {
        let task = GaussianLinear::new(2);
        let s = task.standardization();
        // θ variance 0.1, x variance 0.2 (sampling error of 1e4 draws is ~1.5%).
        for j in 0..2 {
            assert!(
                (s.theta_std[j] - 0.1f64.sqrt()).abs() < 0.02 * 0.1f64.sqrt(),
                "{s:?}"
            );
            assert!(
                (s.x_std[j] - 0.2f64.sqrt()).abs() < 0.02 * 0.2f64.sqrt(),
                "{s:?}"
            );
        }
        let (m, v) = task.posterior(&[0.4, -0.2]);
        assert!(
            (v - 0.05).abs() < 1e-15 && (m[0] - 0.2).abs() < 1e-15 && (m[1] + 0.1).abs() < 1e-15
        );
    }

    #[test]
    fn two_moons_observations_lie_on_the_moons() {
        // For θ = 0 the data is the crescent p: its radius around (0.25, 0) is r ≈ 0.1.
        let mut rng = sample_rng(1, 2);
        let (mut t, mut x) = ([0.0; 2], [0.0; 2]);
        for _ in 0..100 {
            TwoMoons.simulate(&mut rng, &mut t, &mut x);
            let s = std::f64::consts::FRAC_1_SQRT_2;
            let p0 = x[0] + (s * (t[0] + t[1])).abs();
            let p1 = x[1] - s * (t[1] - t[0]);
            let r = ((p0 - 0.25).powi(2) + p1 * p1).sqrt();
            assert!(
                (r - 0.1).abs() < 0.06 && p0 >= 0.25 - 1e-12,
                "r {r} p0 {p0}"
            );
        }
    }
}
