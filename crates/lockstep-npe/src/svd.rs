//! Dingo's reduced-basis first embedding layer (`model.embedding_kwargs.svd`), initialized from
//! a singular value decomposition of training inputs (Dax et al. 2021; Dingo's
//! `LinearProjectionRB` and `SVDBasis`).
//!
//! Settings, in Dingo's shape:
//!
//! ```yaml
//! embedding_kwargs:
//!   svd: {size: 32, num_training_samples: 2000, num_validation_samples: 200}
//! ```
//!
//! - `num_training_samples` inputs are drawn from their own keyed stream
//!   ([`basis_rng`]: `(seed, index)`, the same on every replica and for every replica count)
//!   and decomposed; `num_validation_samples` more (default 0) measure how well the truncated
//!   basis reconstructs held-out inputs: Dingo's mismatch `1 - Re⟨d, d̂⟩ / (|d| |d̂|)` of each
//!   input `d` and its projection `d̂` onto the basis.
//! - How the input is cut ([`BasisLayout`], from the task): a task whose x is complex series
//!   per detector (`gw_chirp`: `[detector][re, im][frequency]`) gets one complex SVD per block
//!   (detector) of the task's basis inputs ([`crate::tasks::Task::basis_sample`]: for
//!   `gw_chirp` the noise-free whitened waveforms at a fixed 100 Mpc, as Dingo), and the
//!   block's layer maps its `[re, im]` values to the real and imaginary parts of the `size`
//!   complex coefficients `c = d V` (`2 size` outputs per block), with the network's fixed
//!   standardization of x folded into the weight and bias, so the layer outputs exactly the
//!   reduced-basis coefficients of the whitened strain. Any other task gets one real SVD of
//!   its standardized inputs (what the layer sees) and `size` outputs `c = x_std V`.
//! - The SVD is computed in f64 by nalgebra's Golub-Kahan SVD (singular values sorted in
//!   descending order), once per process before training: deterministic, so every replica
//!   starts from the same values, which the engine's startup broadcast makes exact in any
//!   case; afterwards the layer is a normal trainable layer, checkpointed and restored as the
//!   others (`embedding_net.layers_rb.{block}.weight` / `.bias`); a later training stage may
//!   freeze it (`freeze_rb_layer`).

use crate::error::NpeError;
use crate::flow::NpeNetwork;
pub use crate::flow::ProjectionConfig;
pub use crate::task::BasisLayout;
use crate::task::{sample_rng, Standardization, Task};
use lockstep_core::config::ConfigError;
use lockstep_core::rng::{splitmix64, SplitMix64};
use nalgebra::{Complex, ComplexField, DMatrix};
use serde::{Deserialize, Serialize};

/// `model.embedding_kwargs.svd`: the reduced basis of the first embedding layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SvdSettings {
    /// Inputs decomposed (Dingo: e.g. 50000).
    pub num_training_samples: usize,
    /// Held-out inputs whose reconstruction mismatch is reported (default 0: none).
    #[serde(default)]
    pub num_validation_samples: usize,
    /// Basis elements kept per block (Dingo: e.g. 200).
    pub size: usize,
}

/// The most inputs one SVD may take (its matrix is `num_training_samples x len` f64 or
/// complex values).
pub const MAX_SAMPLES: usize = 200_000;

impl SvdSettings {
    /// Checks the sizes against the task's layout.
    ///
    /// Errors: a [`ConfigError`] whose key is relative to `svd` (`size`,
    /// `num_training_samples`): a size of 0, more basis elements than a block has values
    /// or than there are training inputs, or more than [`MAX_SAMPLES`] inputs.
    pub fn check(&self, layout: &BasisLayout) -> Result<(), ConfigError> {
        let len = layout.basis_len();
        if self.size == 0 || self.size > len {
            return Err(ConfigError::new(
                "size",
                format!(
                    "{} basis elements: give 1 to {len} (the {} of each block of the input)",
                    self.size,
                    layout.describe_len()
                ),
            ));
        }
        if self.num_training_samples < self.size {
            return Err(ConfigError::new(
                "num_training_samples",
                format!(
                    "{} inputs cannot span {} basis elements; give at least size ({})",
                    self.num_training_samples, self.size, self.size
                ),
            ));
        }
        if self.num_training_samples + self.num_validation_samples > MAX_SAMPLES {
            return Err(ConfigError::new(
                "num_training_samples",
                format!("with num_validation_samples more than {MAX_SAMPLES} inputs; use fewer"),
            ));
        }
        Ok(())
    }
}

/// The random stream of basis input `index` under `seed`: separate from the data set's
/// simulations, keyed like them (never by rank).
pub fn basis_rng(seed: u64, index: u64) -> SplitMix64 {
    sample_rng(splitmix64(seed ^ 0x5BD1_E995_0000_0017), index)
}

/// A computed reduced basis: per block the first `size` right singular vectors `V` and every
/// singular value, and the validation mismatches.
#[derive(Debug, Clone)]
pub struct ReducedBasis {
    /// How x is cut.
    pub layout: BasisLayout,
    /// Basis elements kept per block.
    pub size: usize,
    /// Per block, `V` as `[basis_len x size]` row-major (`v[j * size + c]`, component `j` of
    /// basis vector `c`; imaginary parts 0 for a real layout). Columns are orthonormal.
    pub v: Vec<Vec<Complex<f64>>>,
    /// Per block, all singular values of the training matrix, descending.
    pub singular_values: Vec<Vec<f64>>,
    /// Per block, the mismatch of each validation input (empty without validation inputs).
    pub mismatches: Vec<Vec<f64>>,
    /// Training inputs decomposed.
    pub num_training_samples: usize,
    /// Wall time of drawing the inputs and the SVDs (s).
    pub seconds: f64,
}

/// The first `size` right singular vectors (`[len x size]`, columns orthonormal) and all
/// singular values (descending) of `rows` (`[samples x len]`).
///
/// Errors: the SVD did not converge within 10000 iterations.
pub fn top_right_singular_vectors<T: ComplexField<RealField = f64>>(
    rows: DMatrix<T>,
    size: usize,
) -> Result<(DMatrix<T>, Vec<f64>), NpeError> {
    let len = rows.ncols();
    let eps = f64::EPSILON * 5.0;
    let svd = nalgebra::SVD::try_new(rows, false, true, eps, 10_000).ok_or_else(|| {
        NpeError::Numerical("the SVD did not converge within 10000 iterations".into())
    })?;
    let v_t = svd
        .v_t
        .ok_or_else(|| NpeError::Numerical("the SVD computed no right singular vectors".into()))?;
    if v_t.nrows() < size {
        return Err(NpeError::Numerical(format!(
            "the SVD has {} singular vectors; {size} were asked for",
            v_t.nrows()
        )));
    }
    // V = Vᴴ's conjugate transpose; keep the first `size` columns.
    let v = DMatrix::from_fn(len, size, |j, c| v_t[(c, j)].clone().conjugate());
    Ok((v, svd.singular_values.iter().copied().collect()))
}

/// Dingo's mismatch of `d` and its projection onto the orthonormal columns of `v`:
/// `1 - Re⟨d, d̂⟩ / (|d| |d̂|)`, `d̂ = (d V) Vᴴ` (0 for a vector inside the span, 1 for one
/// orthogonal to it; 0 for `d = 0`).
pub fn mismatch(d: &[Complex<f64>], v: &DMatrix<Complex<f64>>) -> f64 {
    let (len, size) = v.shape();
    let coeff: Vec<Complex<f64>> = (0..size)
        .map(|c| (0..len).map(|j| d[j] * v[(j, c)]).sum())
        .collect();
    let rec: Vec<Complex<f64>> = (0..len)
        .map(|j| (0..size).map(|c| coeff[c] * v[(j, c)].conj()).sum())
        .collect();
    let norm = |z: &[Complex<f64>]| z.iter().map(|a| a.norm_sqr()).sum::<f64>().sqrt();
    let (n1, n2) = (norm(d), norm(&rec));
    if n1 == 0.0 {
        return 0.0;
    }
    if n2 == 0.0 {
        return 1.0;
    }
    let inner: f64 = d.iter().zip(&rec).map(|(a, b)| (a.conj() * b).re).sum();
    1.0 - inner / (n1 * n2)
}

impl ReducedBasis {
    /// Draws the basis inputs of `task` keyed by `seed` ([`basis_rng`]) and decomposes them.
    /// A real layout decomposes the standardized inputs (`standardization` of the network);
    /// a complex one the task's raw basis inputs per block.
    ///
    /// Errors: the settings do not fit the task's layout ([`SvdSettings::check`]), or an SVD
    /// fails.
    pub fn compute(
        task: &dyn Task,
        seed: u64,
        settings: &SvdSettings,
        standardization: &Standardization,
    ) -> Result<ReducedBasis, NpeError> {
        let start = std::time::Instant::now();
        let layout = task.basis_layout();
        settings.check(&layout)?;
        let (n_train, n_val) = (
            settings.num_training_samples,
            settings.num_validation_samples,
        );
        let xd = task.x_dim();
        let mut inputs = vec![0.0f64; (n_train + n_val) * xd];
        for (i, x) in inputs.chunks_exact_mut(xd).enumerate() {
            task.basis_sample(&mut basis_rng(seed, i as u64), x);
            if let BasisLayout::Real { .. } = layout {
                for (j, v) in x.iter_mut().enumerate() {
                    *v = (*v - standardization.x_mean[j]) / standardization.x_std[j];
                }
            }
        }
        let size = settings.size;
        let mut basis = ReducedBasis {
            layout: layout.clone(),
            size,
            v: Vec::new(),
            singular_values: Vec::new(),
            mismatches: Vec::new(),
            num_training_samples: n_train,
            seconds: 0.0,
        };
        for block in 0..layout.blocks() {
            let value = |i: usize, j: usize| -> Complex<f64> {
                let x = &inputs[i * xd..(i + 1) * xd];
                match layout {
                    BasisLayout::Real { .. } => Complex::new(x[j], 0.0),
                    BasisLayout::Complex { bins, .. } => {
                        let b = &x[2 * block * bins..2 * (block + 1) * bins];
                        Complex::new(b[j], b[bins + j])
                    }
                }
            };
            let len = layout.basis_len();
            let v: DMatrix<Complex<f64>> = match layout {
                BasisLayout::Real { .. } => {
                    let rows = DMatrix::from_fn(n_train, len, |i, j| value(i, j).re);
                    let (v, s) = top_right_singular_vectors(rows, size)?;
                    basis.singular_values.push(s);
                    v.map(|a| Complex::new(a, 0.0))
                }
                BasisLayout::Complex { .. } => {
                    let rows = DMatrix::from_fn(n_train, len, value);
                    let (v, s) = top_right_singular_vectors(rows, size)?;
                    basis.singular_values.push(s);
                    v
                }
            };
            let mism = (n_train..n_train + n_val)
                .map(|i| {
                    let d: Vec<Complex<f64>> = (0..len).map(|j| value(i, j)).collect();
                    mismatch(&d, &v)
                })
                .collect();
            basis.mismatches.push(mism);
            let mut flat = Vec::with_capacity(len * size);
            for j in 0..len {
                for c in 0..size {
                    flat.push(v[(j, c)]);
                }
            }
            basis.v.push(flat);
        }
        basis.seconds = start.elapsed().as_secs_f64();
        Ok(basis)
    }

    /// The layer's `(weight [outputs x inputs] row-major, bias [outputs])` per block, acting
    /// on the standardized x of `standardization`: a real layout `W = Vᵀ`, `b = 0`; a complex
    /// one the map of the raw block `[re, im]` to `[Re c, Im c]`, `c = d V`, with the
    /// standardization folded in (`W = W_raw diag(σ)`, `b = W_raw μ`).
    pub fn layer_values(&self, standardization: &Standardization) -> Vec<(Vec<f32>, Vec<f32>)> {
        let (n, len) = (self.size, self.layout.basis_len());
        let inputs = self.layout.block_inputs();
        (0..self.layout.blocks())
            .map(|block| {
                let v = &self.v[block];
                let outputs = self.layout.block_outputs(n);
                let mut w = vec![0.0f64; outputs * inputs];
                match self.layout {
                    BasisLayout::Real { .. } => {
                        for c in 0..n {
                            for j in 0..len {
                                w[c * inputs + j] = v[j * n + c].re;
                            }
                        }
                    }
                    BasisLayout::Complex { .. } => {
                        let k = len;
                        for c in 0..n {
                            for j in 0..k {
                                let z = v[j * n + c];
                                w[c * inputs + j] = z.re;
                                w[c * inputs + k + j] = -z.im;
                                w[(n + c) * inputs + j] = z.im;
                                w[(n + c) * inputs + k + j] = z.re;
                            }
                        }
                    }
                }
                let mut bias = vec![0.0f64; outputs];
                if let BasisLayout::Complex { .. } = self.layout {
                    let off = block * inputs;
                    let (mu, sigma) = (
                        &standardization.x_mean[off..off + inputs],
                        &standardization.x_std[off..off + inputs],
                    );
                    for (r, b) in bias.iter_mut().enumerate() {
                        let row = &mut w[r * inputs..(r + 1) * inputs];
                        *b = row.iter().zip(mu).map(|(a, m)| a * m).sum();
                        row.iter_mut().zip(sigma).for_each(|(a, s)| *a *= s);
                    }
                }
                (
                    w.into_iter().map(|a| a as f32).collect(),
                    bias.into_iter().map(|a| a as f32).collect(),
                )
            })
            .collect()
    }

    /// Writes the basis into the reduced-basis layer of `network` in `params` (its
    /// trainable buffer).
    ///
    /// Errors: the network has no reduced-basis layer, or one of another size or layout.
    pub fn initialize(&self, network: &NpeNetwork, params: &mut [f32]) -> Result<(), NpeError> {
        network.set_projection(params, &self.layer_values(&network.standardization))
    }

    /// The summary Dingo prints: per block the basis size, the singular values around the
    /// cut and the validation mismatches (mean, median, 99th percentile, max).
    pub fn report(&self) -> Vec<String> {
        let blocks = self.layout.blocks();
        let mut lines = vec![format!(
            "SVD-initialized first embedding layer: {blocks} block(s) x {} basis elements from {} inputs per block (SVD in {:.1} s)",
            self.size, self.num_training_samples, self.seconds
        )];
        for b in 0..blocks {
            let s = &self.singular_values[b];
            let kept: f64 = s[..self.size].iter().map(|x| x * x).sum();
            let all: f64 = s.iter().map(|x| x * x).sum();
            let mut line = format!(
                "  block {b}: singular values s_1 = {:.4e}, s_{} = {:.4e}{}; kept {:.6} of the training inputs' squared norm",
                s[0],
                self.size,
                s[self.size - 1],
                s.get(self.size)
                    .map(|x| format!(", s_{} = {x:.4e}", self.size + 1))
                    .unwrap_or_default(),
                kept / all.max(f64::MIN_POSITIVE)
            );
            let mut m = self.mismatches[b].clone();
            if !m.is_empty() {
                m.sort_by(f64::total_cmp);
                let q = |p: f64| m[((m.len() - 1) as f64 * p).round() as usize];
                let mean = m.iter().sum::<f64>() / m.len() as f64;
                line.push_str(&format!(
                    "; validation mismatch over {} held-out inputs: mean {mean:.3e}, median {:.3e}, 99% {:.3e}, max {:.3e}",
                    m.len(),
                    q(0.5),
                    q(0.99),
                    m[m.len() - 1]
                ));
            }
            lines.push(line);
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Complex data in a known 3-dimensional subspace of C^12 (orthonormal columns `q`),
    /// with decreasing coefficient scales: the SVD basis spans it, reconstructs held-out
    /// members exactly, and a vector orthogonal to it has mismatch 1.
    #[test]
    fn the_basis_spans_the_data_subspace() {
        let (len, rank) = (12, 3);
        let mut rng = SplitMix64::new(4);
        let raw = DMatrix::from_fn(len, rank, |_, _| Complex::new(rng.normal(), rng.normal()));
        let q = raw.qr().q();
        let draw = |rng: &mut SplitMix64| -> Vec<Complex<f64>> {
            let a: Vec<Complex<f64>> = (0..rank)
                .map(|c| Complex::new(rng.normal(), rng.normal()) * (3.0 - c as f64))
                .collect();
            (0..len)
                .map(|j| (0..rank).map(|c| q[(j, c)] * a[c]).sum())
                .collect()
        };
        let rows: Vec<Vec<Complex<f64>>> = (0..40).map(|_| draw(&mut rng)).collect();
        let m = DMatrix::from_fn(40, len, |i, j| rows[i][j]);
        let (v, s) = top_right_singular_vectors(m, rank).unwrap();
        assert!(s[rank] < 1e-10 * s[0] && s[rank - 1] > 1e-3 * s[0], "{s:?}");
        // Rows d = aᵀ Qᵀ: the right singular vectors span conj(Q), so V Vᴴ = conj(Q Qᴴ)
        // and d̂ = d V Vᴴ projects onto the span of Q.
        let p1 = &v * v.adjoint();
        let p2 = (&q * q.adjoint()).conjugate();
        assert!((p1 - p2).norm() < 1e-10);
        let held_out = draw(&mut rng);
        assert!(mismatch(&held_out, &v).abs() < 1e-12);
        // A vector orthogonal to the span: its projection is 0, mismatch 1.
        let e0: Vec<Complex<f64>> = (0..len)
            .map(|j| Complex::new(if j == 0 { 1.0 } else { 0.0 }, 0.0))
            .collect();
        let proj: Vec<Complex<f64>> = (0..len)
            .map(|j| (0..rank).map(|c| q[(j, c)] * q[(0, c)].conj()).sum())
            .collect();
        let orth: Vec<Complex<f64>> = e0.iter().zip(&proj).map(|(a, b)| a - b).collect();
        assert!((mismatch(&orth, &v) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn sizes_are_checked_against_the_layout() {
        let s = |size, n| SvdSettings {
            num_training_samples: n,
            num_validation_samples: 0,
            size,
        };
        let layout = BasisLayout::Complex {
            blocks: 2,
            bins: 10,
        };
        assert!(s(10, 10).check(&layout).is_ok());
        let e = s(11, 100).check(&layout).unwrap_err();
        assert!(e.key == "size" && e.problem.contains("1 to 10"), "{e}");
        let e = s(0, 100).check(&layout).unwrap_err();
        assert_eq!(e.key, "size");
        let e = s(8, 5).check(&layout).unwrap_err();
        assert!(
            e.key == "num_training_samples" && e.problem.contains("at least size"),
            "{e}"
        );
    }
}
