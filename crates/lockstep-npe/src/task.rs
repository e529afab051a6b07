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

    /// The support of the prior per θ component ([`PriorBound`]): where posterior samples
    /// may lie. Default: unbounded.
    fn prior_bounds(&self) -> Vec<PriorBound> {
        vec![PriorBound::UNBOUNDED; self.theta_dim()]
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
    /// stream (identical on every replica), as Dingo standardizes from its training set; see
    /// [`Task::data_scale`].
    fn standardization(&self) -> Standardization {
        self.data_scale().standardization
    }

    /// The data's own scale, from 10,000 simulations of a fixed stream: per component of θ
    /// and x its mean and standard deviation (Welford's algorithm in f64, so no floor and no
    /// cancellation: data in units of 1e-21 standardizes as data in units of 1), its largest
    /// magnitude, and whether it is constant ([`DataScale`]).
    fn data_scale(&self) -> DataScale {
        let (td, xd) = (self.theta_dim(), self.x_dim());
        let n = 10_000u64;
        let mut stats = vec![Moments::default(); td + xd];
        let (mut theta, mut x) = (vec![0.0; td], vec![0.0; xd]);
        for i in 0..n {
            self.simulate(&mut sample_rng(0x5_7A4D, i), &mut theta, &mut x);
            for (m, &v) in stats.iter_mut().zip(theta.iter().chain(&x)) {
                m.push(v);
            }
        }
        DataScale::from_moments(&stats[..td], &stats[td..])
    }
}

/// The prior's support of one θ component: `[low, high]`; a periodic component (an angle
/// such as a coalescence phase) lives on the circle `[low, high)`, so a value outside is the
/// same as its wrapped value, not outside the prior.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PriorBound {
    /// Lower bound (`-inf`: none).
    pub low: f64,
    /// Upper bound (`inf`: none).
    pub high: f64,
    /// The component is periodic with period `high - low`.
    pub periodic: bool,
}

impl PriorBound {
    /// No bound.
    pub const UNBOUNDED: PriorBound = PriorBound {
        low: f64::NEG_INFINITY,
        high: f64::INFINITY,
        periodic: false,
    };

    /// `[low, high]`.
    pub fn interval(low: f64, high: f64) -> Self {
        PriorBound {
            low,
            high,
            periodic: false,
        }
    }

    /// The circle `[low, high)`.
    pub fn periodic(low: f64, high: f64) -> Self {
        PriorBound {
            low,
            high,
            periodic: true,
        }
    }

    /// `v` wrapped into `[low, high)` for a periodic component; unchanged otherwise.
    pub fn wrap(&self, v: f64) -> f64 {
        if !self.periodic {
            return v;
        }
        let period = self.high - self.low;
        let w = self.low + (v - self.low).rem_euclid(period);
        // rem_euclid can round up to the period itself.
        if w >= self.high {
            self.low
        } else {
            w
        }
    }

    /// `v` lies in the support (a periodic component: always, once wrapped).
    pub fn contains(&self, v: f64) -> bool {
        self.periodic || (v >= self.low && v <= self.high)
    }
}

/// Running mean, variance and largest magnitude of one component (Welford's algorithm, f64).
#[derive(Debug, Clone, Copy, Default)]
struct Moments {
    n: u64,
    mean: f64,
    m2: f64,
    max_abs: f64,
    non_finite: Option<f64>,
}

impl Moments {
    fn push(&mut self, v: f64) {
        if !v.is_finite() {
            self.non_finite.get_or_insert(v);
            return;
        }
        self.n += 1;
        self.max_abs = self.max_abs.max(v.abs());
        let delta = v - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (v - self.mean);
    }

    /// `(mean, standard deviation)`; the deviation is not floored.
    fn mean_std(&self) -> (f64, f64) {
        let var = if self.n > 0 {
            (self.m2 / self.n as f64).max(0.0)
        } else {
            0.0
        };
        (self.mean, var.sqrt())
    }
}

/// The smallest magnitude float32 holds at full precision (its smallest normal number); the
/// network computes in float32.
pub const F32_MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;
/// The largest magnitude float32 holds.
pub const F32_MAX: f64 = f32::MAX as f64;

/// The scale of a task's data, measured on its fixed standardization stream
/// ([`Task::data_scale`]): the standardization to use, and what makes the data unusable or
/// special in float32.
///
/// A component is *constant* when its standard deviation is 0 or below float32's resolution
/// at its magnitude (`std <= f32::EPSILON x max|v|`): a constant x component is left
/// unscaled (mean subtracted, deviation 1) and reported by [`DataScale::check`]; a constant
/// θ component is refused (its posterior is a point a flow cannot represent).
#[derive(Debug, Clone, PartialEq)]
pub struct DataScale {
    /// The standardization (constant components: deviation 1).
    pub standardization: Standardization,
    /// Largest magnitude per θ component.
    pub theta_max_abs: Vec<f64>,
    /// Largest magnitude per x component.
    pub x_max_abs: Vec<f64>,
    /// Standard deviation per θ component as measured (0 for a constant one).
    pub theta_std_measured: Vec<f64>,
    /// Standard deviation per x component as measured.
    pub x_std_measured: Vec<f64>,
    /// A non-finite value simulated, per θ component (the first seen).
    theta_non_finite: Vec<Option<f64>>,
    /// A non-finite value simulated, per x component.
    x_non_finite: Vec<Option<f64>>,
}

fn is_constant(std: f64, max_abs: f64) -> bool {
    std == 0.0 || std <= f32::EPSILON as f64 * max_abs
}

impl DataScale {
    fn from_moments(theta: &[Moments], x: &[Moments]) -> DataScale {
        let part = |ms: &[Moments]| {
            let mut mean = Vec::new();
            let mut std = Vec::new();
            let mut measured = Vec::new();
            for m in ms {
                let (mu, s) = m.mean_std();
                measured.push(s);
                mean.push(mu);
                std.push(if is_constant(s, m.max_abs) { 1.0 } else { s });
            }
            let max_abs = ms.iter().map(|m| m.max_abs).collect::<Vec<_>>();
            let bad = ms.iter().map(|m| m.non_finite).collect::<Vec<_>>();
            (mean, std, measured, max_abs, bad)
        };
        let (theta_mean, theta_std, theta_std_measured, theta_max_abs, theta_non_finite) =
            part(theta);
        let (x_mean, x_std, x_std_measured, x_max_abs, x_non_finite) = part(x);
        DataScale {
            standardization: Standardization {
                theta_mean,
                theta_std,
                x_mean,
                x_std,
            },
            theta_max_abs,
            x_max_abs,
            theta_std_measured,
            x_std_measured,
            theta_non_finite,
            x_non_finite,
        }
    }

    /// Checks that the data fits the network's float32: every simulated value finite and
    /// within float32's range, no component whose values all lie below float32's normal
    /// range, and no constant θ component. `names` are the θ names. Returns notes to log:
    /// the constant x components left unscaled.
    ///
    /// Errors: a message naming the component (`θ component chirp_mass`, `x value 12`) and
    /// what is wrong with the data (not with the training settings).
    pub fn check(&self, names: &[String]) -> Result<Vec<String>, String> {
        let mut notes = Vec::new();
        let mut constant = Vec::new();
        let theta_name = |j: usize| {
            format!(
                "θ component {}",
                names.get(j).cloned().unwrap_or_else(|| j.to_string())
            )
        };
        let x_name = |j: usize| format!("x value {}", j + 1);
        let parts = [
            (
                &self.theta_max_abs,
                &self.theta_std_measured,
                &self.theta_non_finite,
                true,
            ),
            (
                &self.x_max_abs,
                &self.x_std_measured,
                &self.x_non_finite,
                false,
            ),
        ];
        for (max_abs, std, bad, is_theta) in parts {
            for j in 0..max_abs.len() {
                let name = if is_theta { theta_name(j) } else { x_name(j) };
                if let Some(v) = bad[j] {
                    return Err(format!(
                        "the simulator gave {name} = {v}; the data must be finite"
                    ));
                }
                if max_abs[j] > F32_MAX {
                    return Err(format!(
                        "the simulated {name} reaches {:e}, beyond float32's range (±3.4e38) in which the network computes; express the data in units in which its values lie within float32's range",
                        max_abs[j]
                    ));
                }
                if max_abs[j] > 0.0 && max_abs[j] < F32_MIN_NORMAL {
                    return Err(format!(
                        "the simulated {name} is at most {:e} in magnitude, below float32's normal range (1.2e-38) in which the network computes; express the data in larger units",
                        max_abs[j]
                    ));
                }
                if is_constant(std[j], max_abs[j]) {
                    if is_theta {
                        return Err(format!(
                            "{name} is constant over the prior (standard deviation {:e} at magnitude {:e}); a posterior over it is a point, which a normalizing flow cannot represent: remove the parameter or give it a prior of positive width",
                            std[j], max_abs[j]
                        ));
                    }
                    constant.push((j + 1).to_string());
                }
            }
        }
        if !constant.is_empty() {
            notes.push(format!(
                "x value(s) {} are constant in the simulations; they are left unscaled (mean subtracted, not divided by a zero deviation)",
                constant.join(", ")
            ));
        }
        Ok(notes)
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

    /// An observation x (raw units, `[x_dim]`) as the float32 values the network takes,
    /// checked: every value finite, within float32's range, and its standardized value
    /// `(x - mean) / std` within float32's range too.
    ///
    /// Errors: the first value that fails, by its position counted from 1 (`value 1 is NaN`,
    /// `value 2 is 1e39, beyond float32's range ...`); the caller names where x came from.
    pub fn observation(&self, x: &[f64]) -> Result<Vec<f32>, String> {
        if x.len() != self.x_mean.len() {
            return Err(format!(
                "has {} values; the network expects {}",
                x.len(),
                self.x_mean.len()
            ));
        }
        x.iter()
            .enumerate()
            .map(|(i, &v)| {
                let pos = i + 1;
                if v.is_nan() {
                    return Err(format!("value {pos} is NaN"));
                }
                if v.is_infinite() {
                    return Err(format!("value {pos} is {v}"));
                }
                if v.abs() > F32_MAX {
                    return Err(format!(
                        "value {pos} is {v:e}, beyond float32's range (±3.4e38) in which the network computes"
                    ));
                }
                let z = (v - self.x_mean[i]) / self.x_std[i];
                if z.abs() > F32_MAX {
                    return Err(format!(
                        "value {pos} is {v:e}, {z:e} standard deviations from the training data's mean: beyond float32's range (±3.4e38) in which the network computes"
                    ));
                }
                Ok(v as f32)
            })
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// θ ~ N(0, 1)², x = (θ₀ · scale, constant), or a constant θ₁ with `constant_theta`.
    struct Toy {
        scale: f64,
        constant_theta: bool,
        nan: bool,
    }

    impl Task for Toy {
        fn name(&self) -> &str {
            "toy"
        }
        fn theta_dim(&self) -> usize {
            2
        }
        fn x_dim(&self) -> usize {
            2
        }
        fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]) {
            theta[0] = rng.normal() * self.scale;
            theta[1] = if self.constant_theta {
                0.5
            } else {
                rng.normal()
            };
            x[0] = if self.nan { f64::NAN } else { theta[0] };
            x[1] = 7.0;
        }
    }

    fn toy(scale: f64) -> Toy {
        Toy {
            scale,
            constant_theta: false,
            nan: false,
        }
    }

    #[test]
    fn standardization_follows_the_data_scale_and_flags_constant_components() {
        for scale in [1e-21, 1.0, 1e30] {
            let s = toy(scale).data_scale();
            let st = &s.standardization;
            assert!(
                (st.theta_std[0] / scale - 1.0).abs() < 0.03,
                "scale {scale}: {:?}",
                st.theta_std
            );
            assert!((st.x_std[0] / scale - 1.0).abs() < 0.03);
            // The constant x component is left unscaled and reported.
            assert_eq!((st.x_mean[1], st.x_std[1]), (7.0, 1.0));
            let notes = s.check(&["a".into(), "b".into()]).unwrap();
            assert!(
                notes.len() == 1 && notes[0].contains("x value(s) 2 are constant"),
                "{notes:?}"
            );
        }
    }

    #[test]
    fn data_outside_float32_or_a_constant_parameter_is_refused_naming_the_data() {
        let names = ["a".to_string(), "b".to_string()];
        let e = toy(1e100).data_scale().check(&names).unwrap_err();
        assert!(
            e.contains("θ component a") && e.contains("beyond float32's range"),
            "{e}"
        );
        let e = toy(1e-45).data_scale().check(&names).unwrap_err();
        assert!(e.contains("below float32's normal range"), "{e}");
        let e = Toy {
            scale: 1.0,
            constant_theta: true,
            nan: false,
        }
        .data_scale()
        .check(&names)
        .unwrap_err();
        assert!(e.contains("θ component b is constant"), "{e}");
        let e = Toy {
            scale: 1.0,
            constant_theta: false,
            nan: true,
        }
        .data_scale()
        .check(&names)
        .unwrap_err();
        assert!(e.contains("x value 1 = NaN"), "{e}");
    }

    #[test]
    fn observations_that_do_not_fit_float32_are_refused_by_position() {
        let s = Standardization {
            theta_mean: vec![0.0; 2],
            theta_std: vec![1.0; 2],
            x_mean: vec![0.0, 0.0],
            x_std: vec![1e-30, 1.0],
        };
        assert_eq!(s.observation(&[1e-30, 0.2]).unwrap(), [1e-30f32, 0.2]);
        for (x, m) in [
            ([f64::NAN, 0.2], "value 1 is NaN"),
            ([0.1, f64::INFINITY], "value 2 is inf"),
            ([f64::NEG_INFINITY, 0.2], "value 1 is -inf"),
            ([1e39, 0.2], "value 1 is 1e39, beyond float32's range"),
            ([-1e300, 0.0], "value 1 is -1e300, beyond float32's range"),
            ([1e10, 0.0], "value 1 is 1e10, "),
        ] {
            let e = s.observation(&x).unwrap_err();
            assert!(e.starts_with(m), "{x:?}: {e}");
        }
        assert!(s.observation(&[0.0]).unwrap_err().contains("has 1 values"));
    }

    #[test]
    fn periodic_bounds_wrap_and_intervals_contain() {
        let tau = 2.0 * std::f64::consts::PI;
        let phase = PriorBound::periodic(0.0, tau);
        for (v, w) in [(-0.5, tau - 0.5), (tau + 1.0, 1.0), (3.0, 3.0), (tau, 0.0)] {
            assert!(
                (phase.wrap(v) - w).abs() < 1e-12,
                "{v} -> {}",
                phase.wrap(v)
            );
            assert!(phase.contains(phase.wrap(v)));
        }
        let unit = PriorBound::interval(-1.0, 1.0);
        assert_eq!(unit.wrap(3.0), 3.0);
        assert!(unit.contains(1.0) && !unit.contains(1.0001) && !unit.contains(-2.0));
        assert!(PriorBound::UNBOUNDED.contains(1e30));
    }
}
