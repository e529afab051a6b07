//! What a simulation-based inference task is, and the shapes the network takes from it: the
//! [`Task`] trait (a prior and a simulator), the keyed random stream of each global sample
//! ([`sample_rng`]), the fixed standardization of θ and x ([`Standardization`]) and how x is
//! cut into blocks for the reduced-basis layer ([`BasisLayout`]).
//!
//! A leaf of the crate: the tasks ([`crate::tasks`], [`crate::gw`]), the network
//! ([`crate::flow`]) and the reduced basis ([`crate::svd`]) all import it, and it imports none
//! of them.

use lockstep_core::rng::{splitmix64, SplitMix64, GOLDEN_GAMMA};
use serde::{Deserialize, Serialize};

/// The random stream of global sample `index` under `seed`.
pub fn sample_rng(seed: u64, index: u64) -> SplitMix64 {
    SplitMix64::new(splitmix64(
        splitmix64(seed) ^ index.wrapping_mul(GOLDEN_GAMMA),
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
    /// Names of the θ components (column names of posterior samples and P-P plots).
    /// Default: `theta_0`, `theta_1`, ...
    fn parameter_names(&self) -> Vec<String> {
        (0..self.theta_dim())
            .map(|i| format!("theta_{i}"))
            .collect()
    }

    /// How x is cut into blocks for the reduced-basis (SVD) first embedding layer
    /// ([`crate::svd`]). Default: one real block of all of x.
    fn basis_layout(&self) -> BasisLayout {
        BasisLayout::Real {
            width: self.x_dim(),
        }
    }

    /// One input `[x_dim]` for the reduced basis, drawn from `rng`. Default: the x of a
    /// simulation (noise included); tasks with a noise-free signal give that instead.
    fn basis_sample(&self, rng: &mut SplitMix64, x: &mut [f64]) {
        let mut theta = vec![0.0; self.theta_dim()];
        self.simulate(rng, &mut theta, x);
    }

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

/// Fixed affine standardization of θ and x: `(v - mean) / std` per component.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Standardization {
    /// Means of θ `[theta_dim]`.
    pub theta_mean: Vec<f64>,
    /// Standard deviations of θ `[theta_dim]`.
    pub theta_std: Vec<f64>,
    /// Means of x `[x_dim]`.
    pub x_mean: Vec<f64>,
    /// Standard deviations of x `[x_dim]`.
    pub x_std: Vec<f64>,
}

impl Standardization {
    /// The identity standardization for the given widths.
    pub fn identity(theta_dim: usize, x_dim: usize) -> Self {
        Standardization {
            theta_mean: vec![0.0; theta_dim],
            theta_std: vec![1.0; theta_dim],
            x_mean: vec![0.0; x_dim],
            x_std: vec![1.0; x_dim],
        }
    }
}

/// How an observation x is cut into blocks for the reduced basis.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BasisLayout {
    /// x as one real vector of `width` values (`width = x_dim`).
    Real {
        /// Values of x.
        width: usize,
    },
    /// `blocks` complex series of `bins` values, each stored as its real parts then its
    /// imaginary parts, blocks one after the other (`x_dim = 2 blocks bins`; Dingo's
    /// `[num_blocks, 2, num_bins]`).
    Complex {
        /// Blocks (detectors).
        blocks: usize,
        /// Complex values per block (frequency bins).
        bins: usize,
    },
}

impl BasisLayout {
    /// Blocks, each with its own basis and layer.
    pub fn blocks(&self) -> usize {
        match *self {
            BasisLayout::Real { .. } => 1,
            BasisLayout::Complex { blocks, .. } => blocks,
        }
    }

    /// Values of x per block (the layer's inputs per block).
    pub fn block_inputs(&self) -> usize {
        match *self {
            BasisLayout::Real { width } => width,
            BasisLayout::Complex { bins, .. } => 2 * bins,
        }
    }

    /// Length of a basis vector (real or complex values).
    pub fn basis_len(&self) -> usize {
        match *self {
            BasisLayout::Real { width } => width,
            BasisLayout::Complex { bins, .. } => bins,
        }
    }

    /// The layer's outputs per block for `size` basis elements (`2 size` for complex
    /// coefficients: real parts, then imaginary parts).
    pub fn block_outputs(&self, size: usize) -> usize {
        match self {
            BasisLayout::Real { .. } => size,
            BasisLayout::Complex { .. } => 2 * size,
        }
    }

    pub(crate) fn describe_len(&self) -> &'static str {
        match self {
            BasisLayout::Real { .. } => "values",
            BasisLayout::Complex { .. } => "complex values (frequency bins)",
        }
    }
}
