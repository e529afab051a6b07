//! Calibration of a trained posterior: the P-P test Dingo users run (as bilby's
//! `make_pp_plot`).
//!
//! For each injection `(θ*, x)` simulated from the task, draw posterior samples from
//! `q(θ | x)` and record per parameter the percentile of the true value among them (the
//! fraction of samples below it). For a calibrated posterior every parameter's percentiles are
//! uniform on [0, 1]; the one-sample Kolmogorov-Smirnov test against U(0, 1) gives a p-value
//! per parameter.

use crate::backend::TrainBackend;
use crate::error::NpeError;
use crate::model::NpeModel;
use crate::task::{sample_rng, Task};
use lockstep_core::rng::splitmix64;

/// The Kolmogorov-Smirnov statistic `D = sup |F_n(u) - u|` of `values` against U(0, 1) and
/// its p-value, from the asymptotic Kolmogorov distribution with Stephens' small-sample
/// correction `λ = (√n + 0.12 + 0.11/√n) D`, `p = 2 Σ_{j≥1} (-1)^{j-1} exp(-2 j² λ²)`
/// (Stephens 1970, J. R. Stat. Soc. B 32, 115; Press et al., Numerical Recipes, 3rd ed.,
/// §14.3.3; accurate to about 1e-2 in p for n ≥ 20 and better for the small p that matter).
/// Returns `(D, p)`; `(NaN, NaN)` for no values.
pub fn ks_uniform(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let nf = n as f64;
    let d = v
        .iter()
        .enumerate()
        .map(|(i, &u)| {
            let u = u.clamp(0.0, 1.0);
            ((i as f64 + 1.0) / nf - u).max(u - i as f64 / nf)
        })
        .fold(0.0, f64::max);
    let lambda = (nf.sqrt() + 0.12 + 0.11 / nf.sqrt()) * d;
    (d, kolmogorov_q(lambda))
}

/// `Q_KS(λ) = 2 Σ_{j≥1} (-1)^{j-1} exp(-2 j² λ²)`, the Kolmogorov survival function
/// (scipy's `kstwobign.sf`). Below λ = 0.2 the series converges slowly and the value is 1
/// within 1e-9, which is returned.
pub fn kolmogorov_q(lambda: f64) -> f64 {
    if lambda < 0.2 {
        return 1.0;
    }
    let mut sum = 0.0;
    let mut sign = 1.0;
    for j in 1..=200 {
        let term = sign * (-2.0 * (j * j) as f64 * lambda * lambda).exp();
        sum += term;
        if term.abs() < 1e-16 * sum.abs().max(1e-300) {
            break;
        }
        sign = -sign;
    }
    (2.0 * sum).clamp(0.0, 1.0)
}

/// The result of a P-P test.
#[derive(Debug, Clone, PartialEq)]
pub struct PpResult {
    /// Parameter names `[theta_dim]`.
    pub names: Vec<String>,
    /// True parameters per injection `[injections][theta_dim]`.
    pub truths: Vec<Vec<f64>>,
    /// Percentile of the true value among the posterior samples, per injection and parameter
    /// `[injections][theta_dim]`, in [0, 1].
    pub percentiles: Vec<Vec<f64>>,
    /// KS p-value per parameter `[theta_dim]` ([`ks_uniform`]).
    pub p_values: Vec<f64>,
}

impl PpResult {
    /// The percentiles of parameter `j` over all injections.
    pub fn column(&self, j: usize) -> Vec<f64> {
        self.percentiles.iter().map(|r| r[j]).collect()
    }

    /// Fisher's combination of the per-parameter p-values is not independent across
    /// parameters; this reports the smallest p-value, the usual pass criterion ("every
    /// parameter above the threshold").
    pub fn min_p_value(&self) -> f64 {
        self.p_values.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// The stream of injection `i` for a P-P test keyed by `seed` (distinct from the training
/// streams `sample_rng(seed, index)` of [`crate::TaskSource`]).
pub fn injection_rng(seed: u64, i: u64) -> lockstep_core::rng::SplitMix64 {
    sample_rng(splitmix64(seed ^ 0x9090_7070_5050_3030), i)
}

/// Simulates injection `i` of `task` under `seed`: `(θ* [theta_dim], x [x_dim])`.
pub fn injection(task: &dyn Task, seed: u64, i: u64) -> (Vec<f64>, Vec<f64>) {
    let (mut theta, mut x) = (vec![0.0; task.theta_dim()], vec![0.0; task.x_dim()]);
    task.simulate(&mut injection_rng(seed, i), &mut theta, &mut x);
    (theta, x)
}

/// The observation x of an injection as the network's float32 values, checked
/// ([`crate::task::Standardization::observation`]).
///
/// Errors: [`NpeError::Data`] naming the injection and the value (`injection 7 (seed 3):
/// the simulated x: value 2 is NaN`).
pub fn injection_observation<B: TrainBackend>(
    model: &NpeModel<B>,
    x: &[f64],
    seed: u64,
    i: u64,
) -> Result<Vec<f32>, NpeError> {
    model
        .network
        .standardization
        .observation(x)
        .map_err(|m| NpeError::Data(format!("injection {i} (seed {seed}): the simulated x: {m}")))
}

/// Runs the P-P test: `injections` injections of `task` (keyed by `seed`), `samples` posterior
/// samples each from `model` (base draws keyed by `seed` and the injection).
///
/// Errors: an injection whose x cannot reach the network ([`injection_observation`]).
pub fn pp_test<B: TrainBackend>(
    model: &NpeModel<B>,
    task: &dyn Task,
    seed: u64,
    injections: usize,
    samples: usize,
) -> Result<PpResult, NpeError> {
    pp_test_with_progress(model, task, seed, injections, samples, &mut |_| {})
}

/// [`pp_test`], calling `progress(done)` after each injection (a long test reports how far
/// it is).
///
/// Errors: as [`pp_test`].
pub fn pp_test_with_progress<B: TrainBackend>(
    model: &NpeModel<B>,
    task: &dyn Task,
    seed: u64,
    injections: usize,
    samples: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<PpResult, NpeError> {
    let d = task.theta_dim();
    let mut truths = Vec::with_capacity(injections);
    let mut percentiles = Vec::with_capacity(injections);
    for i in 0..injections as u64 {
        let (theta, x) = injection(task, seed, i);
        let xf = injection_observation(model, &x, seed, i)?;
        let s = model.sample(&xf, samples, splitmix64(seed ^ 0xA5A5) ^ i);
        let row: Vec<f64> = (0..d)
            .map(|j| {
                let below = (0..samples)
                    .filter(|&k| (s[k * d + j] as f64) < theta[j])
                    .count();
                below as f64 / samples as f64
            })
            .collect();
        truths.push(theta);
        percentiles.push(row);
        progress(i as usize + 1);
    }
    let mut r = PpResult {
        names: task.parameter_names(),
        truths,
        percentiles,
        p_values: Vec::new(),
    };
    r.p_values = (0..d).map(|j| ks_uniform(&r.column(j)).1).collect();
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::rng::SplitMix64;

    #[test]
    fn ks_p_values_match_scipy() {
        // scipy 1.17 `kstest(x, "uniform")`: statistic 0.38, exact p-value 0.083077 (n = 10);
        // Stephens' corrected asymptotic value is 0.083362.
        let x = [0.05, 0.1, 0.2, 0.21, 0.3, 0.5, 0.55, 0.6, 0.61, 0.62];
        let (d, p) = ks_uniform(&x);
        assert!((d - 0.38).abs() < 1e-12, "D {d}");
        assert!((p - 0.083_362).abs() < 1e-5, "p {p}");
        assert!((p - 0.083_077).abs() < 1e-3, "p {p}");
        // Uniform draws give large p-values, shifted ones tiny p-values.
        let mut rng = SplitMix64::new(3);
        let u: Vec<f64> = (0..500).map(|_| rng.uniform()).collect();
        assert!(ks_uniform(&u).1 > 0.01);
        let shifted: Vec<f64> = u.iter().map(|v| v * 0.9).collect();
        assert!(ks_uniform(&shifted).1 < 1e-3);
    }

    /// Issue 47: a long P-P test reports each injection to its progress callback, and an
    /// injection whose simulated x cannot reach the network is refused by name.
    #[test]
    fn pp_reports_progress_and_refuses_unusable_injections() {
        use crate::flow::{EmbeddingConfig, FlowConfig, NetworkConfig, NpeNetwork};
        use crate::task::Standardization;
        use crate::tasks::GaussianLinear;
        use crate::CpuAutodiff;
        let config = NetworkConfig {
            embedding: EmbeddingConfig {
                hidden_dims: vec![4],
                output_dim: 2,
                norm: Default::default(),
                projection: None,
            },
            flow: FlowConfig {
                num_flow_steps: 1,
                hidden_dim: 4,
                num_transform_blocks: 1,
                num_bins: 4,
                tail_bound: 3.0,
                norm: Default::default(),
            },
            batch_norm_eps: crate::layers::DINGO_BATCH_NORM_EPS,
        };
        let net = NpeNetwork::new(config, 2, 2, Standardization::identity(2, 2), 1).unwrap();
        let model = NpeModel::<CpuAutodiff>::new(net, 1, Default::default());
        let mut seen = Vec::new();
        let r = pp_test_with_progress(&model, &GaussianLinear::new(2), 3, 5, 20, &mut |done| {
            seen.push(done)
        })
        .unwrap();
        assert_eq!(seen, [1, 2, 3, 4, 5]);
        assert_eq!(r.percentiles.len(), 5);
        // Variances of 1e80: x of order 1e40 does not fit float32.
        let huge = GaussianLinear {
            dim: 2,
            prior_scale: 1.0,
            simulator_scale: 1e80,
        };
        let e = pp_test(&model, &huge, 3, 5, 20).unwrap_err().to_string();
        assert!(
            e.starts_with("injection 0 (seed 3): the simulated x: value ")
                && e.contains("beyond float32's range"),
            "{e}"
        );
    }

    #[test]
    fn kolmogorov_q_known_values() {
        // scipy 1.17 kstwobign.sf(1.0) = 0.26999967, kstwobign.sf(0.5) = 0.96394524.
        assert!((kolmogorov_q(1.0) - 0.269_999_67).abs() < 1e-7);
        assert!((kolmogorov_q(0.5) - 0.963_945_24).abs() < 1e-7);
    }
}
