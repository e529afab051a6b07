//! The classifier two-sample test (C2ST) as the SBI benchmark defines it (Lueckmann et al.
//! 2021, "Benchmarking Simulation-Based Inference", AISTATS; sbibm `metrics/c2st.py`;
//! Lopez-Paz & Oquab 2017): a classifier learns to tell samples `X` (e.g. reference posterior
//! samples) from samples `Y` (e.g. an estimator's posterior samples), and the score is its
//! held-out accuracy averaged over a K-fold cross-validation. 0.5 means the classifier cannot
//! tell them apart (identical distributions); 1.0 means it always can.
//!
//! As in sbibm, both sets are z-scored with the mean and (unbiased) standard deviation of `X`,
//! and the classifier is scikit-learn's `MLPClassifier` configuration: two hidden layers of
//! `10 × dim` ReLU units and a logistic output, Glorot-uniform initialization, Adam (learning
//! rate 1e-3, β = (0.9, 0.999), ε = 1e-8) on minibatches of 200 reshuffled every epoch, the
//! cross-entropy plus the L2 penalty `α/2 · Σ W² / batch` (α = 1e-4, weights only), stopped
//! when the epoch's mean training loss has not improved by more than 1e-4 for 10 epochs (or
//! after `max_epochs`); 5 folds of a shuffled K-fold split. The network and its gradients run
//! on burn's CPU backend through this crate's parameter [`Layout`], the updates through
//! lockstep-train's Adam. The random streams (initialization, shuffles, folds) are SplitMix64
//! streams of `seed`, so a C2ST is deterministic but not bitwise sbibm's (whose streams are
//! numpy's).

use crate::error::NpeError;
use crate::layers::{Builder, Init, Linear};
use crate::params::{to_vec, Layout, Params};
use crate::{CpuAutodiff, CpuBackend};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use lockstep_core::rng::{splitmix64, SplitMix64};
use lockstep_train::{Optimizer, OptimizerConfig};

/// Settings of the test (defaults: sbibm's).
#[derive(Debug, Clone, PartialEq)]
pub struct C2stOptions {
    /// Cross-validation folds (sbibm: 5).
    pub folds: usize,
    /// Seed of the folds, the initializations and the minibatch shuffles.
    pub seed: u64,
    /// Epoch limit of each classifier (scikit-learn's `max_iter`; sbibm: 10000).
    pub max_epochs: usize,
    /// Minibatch size (scikit-learn: `min(200, n)`).
    pub batch_size: usize,
    /// Adam learning rate (scikit-learn: 1e-3).
    pub learning_rate: f64,
    /// L2 penalty α (scikit-learn: 1e-4).
    pub alpha: f64,
    /// Minimum improvement of the epoch loss (scikit-learn `tol`: 1e-4).
    pub tol: f64,
    /// Epochs without that improvement before stopping (scikit-learn: 10).
    pub patience: usize,
}

impl Default for C2stOptions {
    fn default() -> Self {
        C2stOptions {
            folds: 5,
            seed: 1,
            max_epochs: 10_000,
            batch_size: 200,
            learning_rate: 1e-3,
            alpha: 1e-4,
            tol: 1e-4,
            patience: 10,
        }
    }
}

/// The C2ST accuracy of samples `x` (`[nx * dim]` row-major, the set that defines the
/// z-scoring, e.g. the reference samples) against `y` (`[ny * dim]`): the mean held-out
/// accuracy over the folds, in `[0, 1]` (0.5: indistinguishable).
///
/// Errors: `dim` is zero, a set's length is not a multiple of `dim`, there are fewer samples
/// than folds, fewer than 2 folds, or a value is not finite.
pub fn c2st(x: &[f32], y: &[f32], dim: usize, opts: &C2stOptions) -> Result<f64, NpeError> {
    Ok(c2st_folds(x, y, dim, opts)?.iter().sum::<f64>() / opts.folds as f64)
}

/// The held-out accuracy of each fold (see [`c2st`]; same errors).
pub fn c2st_folds(
    x: &[f32],
    y: &[f32],
    dim: usize,
    opts: &C2stOptions,
) -> Result<Vec<f64>, NpeError> {
    if dim == 0 || !x.len().is_multiple_of(dim) || !y.len().is_multiple_of(dim) {
        return Err(NpeError::Invalid(format!(
            "C2ST: the sample sets ({} and {} values) are not whole rows of {dim} components",
            x.len(),
            y.len()
        )));
    }
    let (nx, ny) = (x.len() / dim, y.len() / dim);
    if opts.folds < 2 || nx + ny < opts.folds || nx < 2 {
        return Err(NpeError::Invalid(format!(
            "C2ST: {nx} + {ny} samples cannot be split into {} folds (need at least 2 folds and 2 samples of X)",
            opts.folds
        )));
    }
    if let Some(v) = x.iter().chain(y).find(|v| !v.is_finite()) {
        return Err(NpeError::Invalid(format!(
            "C2ST: a sample value is {v}; every value must be finite"
        )));
    }
    // z-score with the mean and unbiased standard deviation of X (sbibm: torch.std).
    let mut mean = vec![0.0f64; dim];
    let mut var = vec![0.0f64; dim];
    for row in x.chunks_exact(dim) {
        for (m, &v) in mean.iter_mut().zip(row) {
            *m += v as f64 / nx as f64;
        }
    }
    for row in x.chunks_exact(dim) {
        for ((s, &v), m) in var.iter_mut().zip(row).zip(&mean) {
            *s += (v as f64 - m).powi(2) / (nx - 1) as f64;
        }
    }
    let std: Vec<f64> = var
        .iter()
        .map(|v| if *v > 0.0 { v.sqrt() } else { 1.0 })
        .collect();
    let data: Vec<f32> = x
        .iter()
        .chain(y)
        .enumerate()
        .map(|(i, &v)| ((v as f64 - mean[i % dim]) / std[i % dim]) as f32)
        .collect();
    let labels: Vec<f32> = (0..nx + ny)
        .map(|i| if i < nx { 0.0 } else { 1.0 })
        .collect();

    // Shuffled K-fold: a permutation cut into `folds` contiguous parts (the first
    // `n % folds` parts one larger), as scikit-learn's KFold(shuffle=True).
    let n = nx + ny;
    let mut order: Vec<usize> = (0..n).collect();
    shuffle(
        &mut order,
        &mut SplitMix64::new(splitmix64(opts.seed ^ 0xC257)),
    );
    let mut bounds = vec![0usize];
    for k in 0..opts.folds {
        let size = n / opts.folds + usize::from(k < n % opts.folds);
        bounds.push(bounds[k] + size);
    }
    let folds: Vec<(Vec<usize>, Vec<usize>)> = (0..opts.folds)
        .map(|k| {
            let test = order[bounds[k]..bounds[k + 1]].to_vec();
            let train = order[..bounds[k]]
                .iter()
                .chain(&order[bounds[k + 1]..])
                .copied()
                .collect();
            (train, test)
        })
        .collect();
    let fold_accuracy = |k: usize| {
        let (train, test) = &folds[k];
        let mut clf = Classifier::new(dim, splitmix64(opts.seed.wrapping_add(k as u64 + 1)));
        clf.fit(&data, &labels, train, opts);
        if clf.params.iter().all(|v| v.is_finite()) {
            clf.accuracy(&data, &labels, test)
        } else {
            f64::NAN
        }
    };
    // The folds are independent: run them two at a time (the CPU backend is single-threaded).
    let mut acc = vec![0.0; opts.folds];
    for chunk in (0..opts.folds).collect::<Vec<_>>().chunks(2) {
        std::thread::scope(|s| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&k| (k, s.spawn(move || fold_accuracy(k))))
                .collect();
            for (k, h) in handles {
                acc[k] = h.join().unwrap_or(f64::NAN);
            }
        });
    }
    if acc.iter().any(|a| a.is_nan()) {
        return Err(NpeError::Numerical(
            "C2ST: a fold's classifier diverged (its parameters are not finite)".into(),
        ));
    }
    Ok(acc)
}

fn shuffle(v: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// scikit-learn's `MLPClassifier(hidden_layer_sizes=(10 d, 10 d), activation="relu")` for two
/// classes: one logit output.
struct Classifier {
    layout: Layout,
    layers: [Linear; 3],
    /// Indices of the weights (penalized) in the layout; biases are not.
    weights: Vec<usize>,
    params: Vec<f32>,
    dim: usize,
    seed: u64,
}

impl Classifier {
    fn new(dim: usize, seed: u64) -> Self {
        let h = 10 * dim;
        let mut b = Builder::default();
        // Glorot uniform, bound sqrt(6 / (fan_in + fan_out)), weights and biases alike.
        let glorot = |i: usize, o: usize| Init::Uniform((6.0 / (i + o) as f32).sqrt());
        let layers = [
            Linear::with_init(&mut b, "layers.0", dim, h, glorot(dim, h)),
            Linear::with_init(&mut b, "layers.1", h, h, glorot(h, h)),
            Linear::with_init(&mut b, "layers.2", h, 1, glorot(h, 1)),
        ];
        let (params, _) = b.initial_values(seed);
        let layout = b.params.clone();
        let weights = layout
            .specs()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.name.ends_with(".weight"))
            .map(|(i, _)| i)
            .collect();
        Classifier {
            layout,
            layers,
            weights,
            params,
            dim,
            seed,
        }
    }

    fn logits<B: crate::fused_ops::FusedOps>(
        &self,
        p: &Params<B>,
        x: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let h = relu(self.layers[0].forward(p, x));
        let h = relu(self.layers[1].forward(p, h));
        self.layers[2].forward(p, h)
    }

    fn rows(&self, data: &[f32], labels: &[f32], idx: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let d = self.dim;
        let mut x = Vec::with_capacity(idx.len() * d);
        let mut t = Vec::with_capacity(idx.len());
        for &i in idx {
            x.extend_from_slice(&data[i * d..(i + 1) * d]);
            t.push(labels[i]);
        }
        (x, t)
    }

    fn fit(&mut self, data: &[f32], labels: &[f32], train: &[usize], o: &C2stOptions) {
        let device = Default::default();
        let config = OptimizerConfig {
            learning_rate: o.learning_rate,
            ..OptimizerConfig::default()
        };
        let mut adam = Optimizer::new(config, self.params.len());
        let mut rng = SplitMix64::new(splitmix64(self.seed ^ 0x5A5A));
        let mut order = train.to_vec();
        let mut grad = vec![0.0f32; self.params.len()];
        let (mut best, mut stale) = (f64::INFINITY, 0usize);
        let batch = o.batch_size.clamp(1, train.len().max(1));
        for _ in 0..o.max_epochs {
            shuffle(&mut order, &mut rng);
            let mut sum = 0.0f64;
            for chunk in order.chunks(batch) {
                let m = chunk.len();
                let (x, t) = self.rows(data, labels, chunk);
                let p = Params::<CpuAutodiff>::leaves(&self.layout, &self.params, &device);
                let xt =
                    Tensor::<CpuAutodiff, 2>::from_data(TensorData::new(x, [m, self.dim]), &device);
                let tt = Tensor::<CpuAutodiff, 2>::from_data(TensorData::new(t, [m, 1]), &device);
                let z = self.logits(&p, xt);
                // Binary cross-entropy with logits: softplus(z) - t z, with softplus written
                // as max(z, 0) + log(1 + exp(-|z|)) so that large logits do not overflow.
                let softplus = relu(z.clone()) + z.clone().abs().neg().exp().log1p();
                let loss = (softplus - z * tt).mean();
                let value = to_vec(loss.clone().detach())[0] as f64;
                let mut grads = loss.backward();
                p.write_gradients(&self.layout, &mut grads, &mut grad);
                // L2 penalty α/2 Σ W² / m on the weights: its gradient α W / m.
                let mut penalty = 0.0f64;
                for &w in &self.weights {
                    let spec = &self.layout.specs()[w];
                    let range = spec.offset..spec.offset + spec.numel();
                    for (g, &v) in grad[range.clone()].iter_mut().zip(&self.params[range]) {
                        *g += (o.alpha * v as f64 / m as f64) as f32;
                        penalty += (v as f64).powi(2);
                    }
                }
                sum += (value + 0.5 * o.alpha * penalty / m as f64) * m as f64;
                adam.update(&mut self.params, &grad);
            }
            let epoch_loss = sum / train.len() as f64;
            // A loss that is not finite counts as no improvement (the fit then stops).
            if epoch_loss.is_nan() || epoch_loss > best - o.tol {
                stale += 1;
            } else {
                stale = 0;
            }
            best = best.min(epoch_loss);
            if stale >= o.patience {
                break;
            }
        }
    }

    fn accuracy(&self, data: &[f32], labels: &[f32], test: &[usize]) -> f64 {
        let device = Default::default();
        let p = Params::<CpuBackend>::from_flat(&self.layout, &self.params, &device);
        let (x, t) = self.rows(data, labels, test);
        let xt =
            Tensor::<CpuBackend, 2>::from_data(TensorData::new(x, [test.len(), self.dim]), &device);
        let z = to_vec(self.logits(&p, xt));
        let right = z
            .iter()
            .zip(&t)
            .filter(|(z, t)| (**z > 0.0) == (**t > 0.5))
            .count();
        right as f64 / test.len().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, dim: usize, shift: f64, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n * dim)
            .map(|i| (rng.normal() + if i % dim == 0 { shift } else { 0.0 }) as f32)
            .collect()
    }

    #[test]
    fn identical_distributions_score_one_half_and_separated_ones_one() {
        let opts = C2stOptions {
            max_epochs: 200,
            ..C2stOptions::default()
        };
        let (n, d) = (1000, 2);
        let x = gaussian(n, d, 0.0, 1);
        let same = c2st(&x, &gaussian(n, d, 0.0, 2), d, &opts).unwrap();
        assert!((same - 0.5).abs() < 0.05, "same distribution: {same}");
        // Means 10 sd apart: every test point is classified right.
        let far = c2st(&x, &gaussian(n, d, 10.0, 3), d, &opts).unwrap();
        assert!(far > 0.99, "separated: {far}");
        // A one-sd shift: the Bayes accuracy is Φ(1/2) = 0.691.
        let mid = c2st(&x, &gaussian(n, d, 1.0, 4), d, &opts).unwrap();
        assert!((mid - 0.691).abs() < 0.04, "one-sd shift: {mid}");
    }

    #[test]
    fn bad_input_is_refused_by_name() {
        let o = C2stOptions::default();
        let e = c2st(&[0.0; 5], &[0.0; 4], 2, &o).unwrap_err().to_string();
        assert!(e.contains("whole rows of 2"), "{e}");
        let e = c2st(&[0.0, f32::NAN, 1.0, 2.0], &[0.0; 4], 1, &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("finite"), "{e}");
        let e = c2st(&[0.0, 1.0], &[0.0], 1, &o).unwrap_err().to_string();
        assert!(e.contains("5 folds"), "{e}");
    }
}
