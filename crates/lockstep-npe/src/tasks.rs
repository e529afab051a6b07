//! Simulation-based inference tasks as data sources for the engine.
//!
//! Every sample `(θ, x)` is simulated from its own SplitMix64 stream keyed by
//! `(seed, global sample index)` ([`sample_rng`]), so a global batch is the same whatever the
//! replica count or batch split (invariants 4-5 of the design). Definitions follow sbibm
//! (Lueckmann et al. 2021, "Benchmarking Simulation-Based Inference", AISTATS;
//! `sbibm/tasks/*/task.py`).

pub use crate::task::{sample_rng, PriorBound, Task};
use lockstep_core::config::ConfigError;
use lockstep_core::rng::{splitmix64, SplitMix64};
use lockstep_train::{Batch, BatchSource};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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
    fn prior_bounds(&self) -> Vec<PriorBound> {
        vec![PriorBound::interval(-1.0, 1.0); 2]
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

/// sbibm `slcp` ("simple likelihood, complex posterior", Papamakarios et al. 2019):
/// θ ~ U(-3, 3)⁵; with `m = (θ₀, θ₁)`, `s₁ = θ₂²`, `s₂ = θ₃²`, `ρ = tanh θ₄` and
/// `S = [[s₁², ρ s₁ s₂], [ρ s₁ s₂, s₂²]]`, x is 4 independent draws from N(m, S), flattened
/// to 8 values `(x₁₀, x₁₁, x₂₀, ...)` (sbibm `tasks/slcp/task.py`, `num_data = 4`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Slcp;

impl Task for Slcp {
    fn name(&self) -> &str {
        "slcp"
    }
    fn theta_dim(&self) -> usize {
        5
    }
    fn x_dim(&self) -> usize {
        8
    }
    fn prior_bounds(&self) -> Vec<PriorBound> {
        vec![PriorBound::interval(-3.0, 3.0); 5]
    }
    fn simulate(&self, rng: &mut SplitMix64, theta: &mut [f64], x: &mut [f64]) {
        for t in theta.iter_mut() {
            *t = 6.0 * rng.uniform() - 3.0;
        }
        Slcp::data(theta, rng, x);
    }
}

impl Slcp {
    /// Draws the data x `[8]` given θ `[5]` (the simulator without the prior).
    pub fn data(theta: &[f64], rng: &mut SplitMix64, x: &mut [f64]) {
        let (s1, s2) = (theta[2] * theta[2], theta[3] * theta[3]);
        let rho = theta[4].tanh();
        let c = (1.0 - rho * rho).max(0.0).sqrt();
        for pair in x.chunks_exact_mut(2) {
            let (z0, z1) = (rng.normal(), rng.normal());
            // Cholesky factor of S: [[s1, 0], [rho s2, sqrt(1 - rho^2) s2]].
            pair[0] = theta[0] + s1 * z0;
            pair[1] = theta[1] + s2 * (rho * z0 + c * z1);
        }
    }
}

/// The task of a settings file: `data.task`, tagged by `name` (a bare name means the
/// defaults), e.g. `{name: gaussian_linear, dim: 10}`, `two_moons`, `slcp`,
/// `{name: gw_chirp, f_max: 64}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum TaskSpec {
    /// [`GaussianLinear`].
    GaussianLinear {
        /// Dimension of θ and x (sbibm: 10).
        #[serde(default = "default_gl_dim")]
        dim: usize,
        /// Prior variance per component (sbibm: 0.1).
        #[serde(default = "default_gl_scale")]
        prior_scale: f64,
        /// Noise variance per component (sbibm: 0.1).
        #[serde(default = "default_gl_scale")]
        simulator_scale: f64,
    },
    /// [`TwoMoons`].
    TwoMoons,
    /// [`Slcp`].
    Slcp,
    /// [`crate::gw::GwChirp`]: the gravitational-wave chirp task.
    GwChirp(crate::gw::GwChirp),
}

fn default_gl_dim() -> usize {
    10
}
fn default_gl_scale() -> f64 {
    0.1
}

impl TaskSpec {
    /// The task as a simulator.
    ///
    /// Errors: a [`ConfigError`] (key relative to the task) for values out of range.
    pub fn build(&self) -> Result<Arc<dyn Task>, ConfigError> {
        Ok(match *self {
            TaskSpec::GaussianLinear {
                dim,
                prior_scale,
                simulator_scale,
            } => {
                if dim == 0 {
                    return Err(ConfigError::new("dim", "must be at least 1"));
                }
                for (k, v) in [
                    ("prior_scale", prior_scale),
                    ("simulator_scale", simulator_scale),
                ] {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(ConfigError::new(
                            k,
                            format!("{v} is not a positive variance"),
                        ));
                    }
                }
                Arc::new(GaussianLinear {
                    dim,
                    prior_scale,
                    simulator_scale,
                })
            }
            TaskSpec::TwoMoons => Arc::new(TwoMoons),
            TaskSpec::Slcp => Arc::new(Slcp),
            TaskSpec::GwChirp(ref g) => {
                g.validate()?;
                Arc::new(g.clone())
            }
        })
    }
}

/// A task as the engine's [`BatchSource`]: inputs are x `[samples, x_dim]`, targets θ
/// `[samples, theta_dim]`.
///
/// Either an unbounded stream ([`TaskSource::new`]: global index i is simulation i) or a
/// data set of `n` simulations ([`TaskSource::dataset`]: simulation `j < n` is keyed by
/// `(seed, j)`; epoch `e` visits them in a permutation drawn from `(seed, e)`, as a data
/// loader shuffles each epoch). Both depend only on the global sample index, never on the
/// replica count.
#[derive(Clone)]
pub struct TaskSource {
    task: Arc<dyn Task>,
    seed: u64,
    dataset: Option<u64>,
    /// The permutation of the epoch last visited (chief only).
    order: Option<(u64, Arc<Vec<u64>>)>,
    /// Threads that simulate a batch (each a contiguous part; 1: the calling thread).
    workers: usize,
    /// The held-out validation set: simulations `first .. first + count` of the stream.
    validation: Option<(u64, u64)>,
}

impl TaskSource {
    /// An unbounded stream of simulations of `task` keyed by `seed`.
    pub fn new(task: Arc<dyn Task>, seed: u64) -> Self {
        TaskSource {
            task,
            seed,
            dataset: None,
            order: None,
            workers: 1,
            validation: None,
        }
    }

    /// A data set of the simulations `0 .. samples` of `task` keyed by `seed`, shuffled per
    /// epoch.
    pub fn dataset(task: Arc<dyn Task>, seed: u64, samples: u64) -> Self {
        TaskSource {
            task,
            seed,
            dataset: Some(samples),
            order: None,
            workers: 1,
            validation: None,
        }
    }

    /// Simulates each batch on `workers` threads, each a contiguous part of the batch (the
    /// batch is the same for any count: every simulation is keyed by its index).
    #[must_use]
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers.max(1);
        self
    }

    /// A held-out validation set ([`BatchSource::validation_batch`]): the simulations
    /// `first .. first + count` keyed by `(seed, index)`, in order (`lockstep npe`: the test
    /// set `train_samples .. num_samples`).
    #[must_use]
    pub fn with_validation(mut self, first: u64, count: u64) -> Self {
        self.validation = (count > 0).then_some((first, count));
        self
    }

    /// The data set simulation that global index `index` visits.
    fn simulation_index(&mut self, index: u64) -> u64 {
        let Some(n) = self.dataset else {
            return index;
        };
        let epoch = index / n;
        let order = match &self.order {
            Some((e, o)) if *e == epoch => o.clone(),
            _ => {
                let o = Arc::new(epoch_permutation(self.seed, epoch, n));
                self.order = Some((epoch, o.clone()));
                o
            }
        };
        order[(index % n) as usize]
    }
}

/// Fisher-Yates permutation of `0 .. n` from SplitMix64 keyed by `(seed, epoch)`.
pub fn epoch_permutation(seed: u64, epoch: u64, n: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..n).collect();
    let mut rng = SplitMix64::new(splitmix64(splitmix64(seed ^ 0xE90C_4A11) ^ epoch));
    for i in (1..p.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

impl BatchSource for TaskSource {
    fn input_width(&self) -> usize {
        self.task.x_dim()
    }
    fn target_width(&self) -> usize {
        self.task.theta_dim()
    }
    fn num_samples(&self) -> Option<u64> {
        self.dataset
    }
    /// Simulation i is keyed by `(seed, i)` and the epoch order by `(seed, epoch)`.
    fn keyed_by_sample(&self) -> bool {
        true
    }

    /// Errors: a simulation gave a value that is not finite in float32 (see
    /// [`TaskSource::check_batch`]).
    fn global_batch(&mut self, first_sample: u64, count: usize) -> anyhow::Result<Batch> {
        let indices: Vec<u64> = (0..count as u64)
            .map(|i| self.simulation_index(first_sample + i))
            .collect();
        let b = self.simulate_batch(first_sample, &indices);
        self.check_batch(&b, &indices)?;
        Ok(b)
    }

    fn validation_samples(&self) -> u64 {
        self.validation.map_or(0, |(_, count)| count)
    }

    fn validation_batch(&mut self, first: u64, count: usize) -> anyhow::Result<Batch> {
        let Some((start, total)) = self.validation else {
            anyhow::bail!("this task source has no validation set");
        };
        if first + count as u64 > total {
            anyhow::bail!(
                "validation samples {first}..{} asked of a set of {total}",
                first + count as u64
            );
        }
        let indices: Vec<u64> = (0..count as u64).map(|i| start + first + i).collect();
        let b = self.simulate_batch(first, &indices);
        self.check_batch(&b, &indices)?;
        Ok(b)
    }
}

impl TaskSource {
    /// Checks that every value of `batch` (the simulations `indices`) is finite in float32:
    /// a NaN or infinite value, or one beyond float32's range, would make the loss NaN and
    /// the engine blame the learning rate.
    ///
    /// Errors: the first such value, naming the task, the simulation and the component.
    pub fn check_batch(&self, batch: &Batch, indices: &[u64]) -> anyhow::Result<()> {
        let (td, xd) = (self.task.theta_dim(), self.task.x_dim());
        let bad = |values: &[f32], width: usize, what: &str| -> anyhow::Result<()> {
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                let (j, c) = (i / width, i % width);
                let mut theta = vec![0.0; td];
                let mut x = vec![0.0; xd];
                self.task
                    .simulate(&mut sample_rng(self.seed, indices[j]), &mut theta, &mut x);
                let v = if what == "θ" { theta[c] } else { x[c] };
                anyhow::bail!(
                    "data.task ({}): simulation {} (data.seed {}) gave {what} value {} = {v:e}, which is not a finite float32 number (the network computes in float32, range ±3.4e38); the data, not the training settings, must change",
                    self.task.name(),
                    indices[j],
                    self.seed,
                    c + 1
                );
            }
            Ok(())
        };
        bad(&batch.targets, td, "θ")?;
        bad(&batch.inputs, xd, "x")
    }

    /// Global samples `first_sample .. first_sample + count` as a batch (inputs x, targets
    /// θ): what [`BatchSource::global_batch`] returns; simulating never fails.
    pub fn batch(&mut self, first_sample: u64, count: usize) -> Batch {
        let indices: Vec<u64> = (0..count as u64)
            .map(|i| self.simulation_index(first_sample + i))
            .collect();
        self.simulate_batch(first_sample, &indices)
    }

    /// The simulations `indices` as a batch whose first sample is `first_sample`, simulated
    /// on the source's worker threads.
    fn simulate_batch(&self, first_sample: u64, indices: &[u64]) -> Batch {
        let count = indices.len();
        let (td, xd) = (self.task.theta_dim(), self.task.x_dim());
        let mut batch = Batch {
            first_sample,
            samples: count,
            inputs: vec![0.0; count * xd],
            targets: vec![0.0; count * td],
        };
        let (task, seed) = (&*self.task, self.seed);
        let simulate = |ks: &[u64], inputs: &mut [f32], targets: &mut [f32]| {
            let (mut theta, mut x) = (vec![0.0; td], vec![0.0; xd]);
            for (j, &k) in ks.iter().enumerate() {
                task.simulate(&mut sample_rng(seed, k), &mut theta, &mut x);
                let (xi, ti) = (
                    &mut inputs[j * xd..(j + 1) * xd],
                    &mut targets[j * td..(j + 1) * td],
                );
                xi.iter_mut().zip(&x).for_each(|(a, &b)| *a = b as f32);
                ti.iter_mut().zip(&theta).for_each(|(a, &b)| *a = b as f32);
            }
        };
        let per = count.div_ceil(self.workers.min(count).max(1)).max(1);
        if per >= count {
            simulate(indices, &mut batch.inputs, &mut batch.targets);
        } else {
            std::thread::scope(|scope| {
                let parts = indices
                    .chunks(per)
                    .zip(batch.inputs.chunks_mut(per * xd))
                    .zip(batch.targets.chunks_mut(per * td));
                for ((ks, xi), ti) in parts {
                    scope.spawn(move || simulate(ks, xi, ti));
                }
            });
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_do_not_depend_on_the_split() {
        let mut s = TaskSource::new(Arc::new(GaussianLinear::new(3)), 7);
        let whole = s.global_batch(10, 8).unwrap();
        for workers in [2, 3, 8, 20] {
            let mut w = TaskSource::new(Arc::new(GaussianLinear::new(3)), 7).with_workers(workers);
            assert_eq!(w.global_batch(10, 8).unwrap(), whole, "{workers} workers");
        }
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
    fn a_dataset_is_shuffled_per_epoch_and_visits_every_simulation() {
        let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(1));
        let mut s = TaskSource::dataset(task.clone(), 3, 10);
        let e0 = s.global_batch(0, 10).unwrap().targets;
        let e1 = s.global_batch(10, 10).unwrap().targets;
        assert_ne!(e0, e1, "epochs are shuffled");
        let mut a = e0.clone();
        let mut b = e1.clone();
        a.sort_by(f32::total_cmp);
        b.sort_by(f32::total_cmp);
        assert_eq!(a, b, "every epoch visits the same simulations");
        // A split batch reads the same samples.
        let mut t = TaskSource::dataset(task, 3, 10);
        let part = [
            t.global_batch(10, 4).unwrap().targets,
            t.global_batch(14, 6).unwrap().targets,
        ]
        .concat();
        assert_eq!(part, e1);
    }

    #[test]
    fn slcp_data_has_the_task_covariance() {
        // θ fixed: the 4 draws of x follow N(m, S); check the moments over many draws.
        let theta = [0.5, -1.0, 1.2, 0.8, 0.6];
        let (s1, s2, rho) = (1.44, 0.64, 0.6f64.tanh());
        let mut rng = sample_rng(5, 0);
        let (mut m, mut v, mut c) = ([0.0; 2], [0.0; 2], 0.0);
        let n = 40_000;
        let mut x = [0.0; 8];
        for _ in 0..n / 4 {
            Slcp::data(&theta, &mut rng, &mut x);
            for p in x.chunks_exact(2) {
                let (a, b) = (p[0] - theta[0], p[1] - theta[1]);
                m[0] += a;
                m[1] += b;
                v[0] += a * a;
                v[1] += b * b;
                c += a * b;
            }
        }
        let nf = n as f64;
        assert!((m[0] / nf).abs() < 0.03 && (m[1] / nf).abs() < 0.03);
        assert!((v[0] / nf / (s1 * s1) - 1.0).abs() < 0.03, "{}", v[0] / nf);
        assert!((v[1] / nf / (s2 * s2) - 1.0).abs() < 0.03, "{}", v[1] / nf);
        assert!((c / nf / (rho * s1 * s2) - 1.0).abs() < 0.06, "{}", c / nf);
    }

    #[test]
    fn task_specs_parse_with_their_defaults() {
        let t: TaskSpec =
            serde_json::from_value(serde_json::json!({"name": "gw_chirp", "f_max": 64.0})).unwrap();
        let task = t.build().unwrap();
        assert_eq!(
            (task.name(), task.theta_dim(), task.x_dim()),
            ("gw_chirp", 5, 4 * 177)
        );
        let e = lockstep_core::config::from_value::<TaskSpec>(
            &serde_json::json!({"name": "gw_chirp", "fmax": 64.0}),
            "data.task",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("did you mean `f_max`"), "{e}");
        let t: TaskSpec = serde_json::from_value(serde_json::json!({"name": "slcp"})).unwrap();
        assert_eq!(t.build().unwrap().x_dim(), 8);
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

    /// Issue 47: variances of 1e-42 (strain-like units) standardize as variances of 0.1 do
    /// (the old absolute floor of 1e-24 made θ's deviation 1e-12, 1e9 times too large).
    #[test]
    fn gaussian_linear_on_a_tiny_scale_standardizes_by_its_own_scale() {
        let tiny = GaussianLinear {
            dim: 2,
            prior_scale: 1e-42,
            simulator_scale: 1e-42,
        };
        let s = tiny.standardization();
        for j in 0..2 {
            assert!((s.theta_std[j] / 1e-21 - 1.0).abs() < 0.03, "{s:?}");
            assert!((s.x_std[j] / (2e-42f64).sqrt() - 1.0).abs() < 0.03, "{s:?}");
        }
        assert!(tiny
            .data_scale()
            .check(&tiny.parameter_names())
            .unwrap()
            .is_empty());
    }

    /// A simulation whose values are not finite in float32 stops training with a message
    /// naming the data (not the learning rate).
    #[test]
    fn batches_with_values_beyond_float32_are_refused_naming_the_simulation() {
        let big = GaussianLinear {
            dim: 2,
            prior_scale: 1e300,
            simulator_scale: 1.0,
        };
        let mut src = TaskSource::dataset(Arc::new(big), 4, 100);
        let e = src.global_batch(0, 10).unwrap_err().to_string();
        assert!(
            e.starts_with("data.task (gaussian_linear): simulation ")
                && e.contains("θ value 1 = ")
                && e.contains("the data, not the training settings"),
            "{e}"
        );
        let mut ok = TaskSource::dataset(Arc::new(GaussianLinear::new(2)), 4, 100);
        assert!(ok.global_batch(0, 10).is_ok());
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
