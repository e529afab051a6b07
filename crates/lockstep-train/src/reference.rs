//! A small reference model and data source for checking the engine end to end (used by the
//! tests and by `lockstep-train-check`): linear regression with per-sample target noise.
//!
//! Sample i (global index) has inputs `x_i[d] = u(seed, i, d)` uniform in [-1, 1) and target
//! `y_i = w_true . x_i`; the model adds noise `0.05 * u(seed, i, D)` to the target (keyed by
//! the global sample index, never the rank: invariant 5) and scales its inputs by frozen
//! per-dimension factors. Loss terms, each a mean over samples: `mse = mean (s*w.x - y~)^2`
//! and `l2 = 1e-3 * |w|^2`.
//!
//! With [`LinearRegression::with_device_state`] the model emulates a device that keeps the
//! training state ([`crate::device_state`]): separate "device" copies of the weights, the
//! optimizer slots and the gradient, updated by the [`DeviceUpdate`] formula, and counters
//! of every crossing, so the tests can check what the engine moves and when.
//!
//! For checks only: this is not a model for users.

use crate::device_state::{DeviceRule, DeviceState, DeviceUpdate};
use crate::{Batch, BatchSource, Model};
use anyhow::{bail, Result};
use lockstep_core::memory::MemoryEstimate;
use lockstep_core::rng::{splitmix64, GOLDEN_GAMMA};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Uniform in [-1, 1) from a counter-based hash of `(seed, a, b)`: SplitMix64's mixer of
/// `(seed - 1) * gamma + a * c1 + b * c2` (24 random bits).
pub fn uniform(seed: u64, a: u64, b: u64) -> f32 {
    let key = seed
        .wrapping_sub(1)
        .wrapping_mul(GOLDEN_GAMMA)
        .wrapping_add(a.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(b.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7));
    ((splitmix64(key) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The data source: `dim` inputs and one target per sample.
#[derive(Debug, Clone)]
pub struct RegressionData {
    /// Input dimension.
    pub dim: usize,
    /// Seed of the inputs.
    pub seed: u64,
    /// Samples in the data set (`None`: unbounded).
    pub dataset: Option<u64>,
}

impl BatchSource for RegressionData {
    fn input_width(&self) -> usize {
        self.dim
    }
    fn target_width(&self) -> usize {
        1
    }
    fn num_samples(&self) -> Option<u64> {
        self.dataset
    }
    /// Sample i is drawn from `(seed, i)` alone.
    fn keyed_by_sample(&self) -> bool {
        true
    }
    fn global_batch(&mut self, first_sample: u64, count: usize) -> Result<Batch> {
        let mut inputs = Vec::with_capacity(count * self.dim);
        let mut targets = Vec::with_capacity(count);
        for s in 0..count as u64 {
            let idx = match self.dataset {
                Some(n) => (first_sample + s) % n,
                None => first_sample + s,
            };
            let mut y = 0.0f32;
            for d in 0..self.dim {
                let x = uniform(self.seed, idx, d as u64);
                inputs.push(x);
                y += x * (d as f32 + 1.0) / self.dim as f32;
            }
            targets.push(y);
        }
        Ok(Batch {
            first_sample,
            samples: count,
            inputs,
            targets,
        })
    }
}

/// The model: trainable weights `w[dim]`, frozen input scales `s[dim]`.
#[derive(Debug, Clone)]
pub struct LinearRegression {
    w: Vec<f32>,
    s: Vec<f32>,
    seed: u64,
    rank: usize,
    diverge_at: Option<(u64, usize)>,
    updates: u64,
    bytes_per_sample: u64,
    delay: std::time::Duration,
    /// `Some(scale)`: the gradient is of the loss times `scale`, each value past f16's
    /// largest finite value (65504) becoming infinite, as a half-precision pass overflows.
    loss_scale: Option<f32>,
    /// The emulated device ([`LinearRegression::with_device_state`]).
    device: Option<EmulatedDevice>,
}

/// What crossed between the host and [`LinearRegression`]'s emulated device, summed over
/// every replica that shares the counters.
#[derive(Debug, Default)]
pub struct DeviceCounts {
    /// [`DeviceState::upload`] calls.
    pub uploads: AtomicU64,
    /// [`DeviceState::download`] calls (read-backs of the parameters and slots).
    pub downloads: AtomicU64,
    /// [`DeviceState::read_gradient`] calls (read-backs of the gradient).
    pub gradient_reads: AtomicU64,
    /// [`DeviceState::gradient_is_finite`] calls.
    pub finite_tests: AtomicU64,
    /// Updates applied on the device.
    pub applied: AtomicU64,
    /// Updates skipped (`finish_update(None, _)`).
    pub skipped: AtomicU64,
    /// Updates applied to a gradient the host uploaded.
    pub uploaded_gradients: AtomicU64,
}

impl DeviceCounts {
    /// The count `c` (one of this struct's fields) now.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::SeqCst)
    }
}

/// The emulated device's state: the weights, slots and gradient it owns once uploaded.
#[derive(Debug, Clone)]
struct EmulatedDevice {
    resident: bool,
    w: Vec<f32>,
    slots: Vec<Vec<f32>>,
    grad: Vec<f32>,
    /// The next pass starts a new gradient.
    fresh: bool,
    counts: Arc<DeviceCounts>,
}

impl LinearRegression {
    /// The model of replica `rank` with `dim` weights, initialised from `init` (replicas
    /// built with different `init` differ until the startup broadcast);
    /// `diverge_at = Some((update, r))`: replica r perturbs its weights after `update` (to
    /// check that divergence is detected).
    pub fn new(
        dim: usize,
        seed: u64,
        rank: usize,
        init: u64,
        diverge_at: Option<(u64, usize)>,
    ) -> Self {
        let init_rank = init;
        LinearRegression {
            w: (0..dim)
                .map(|d| 0.1 * uniform(7 + init_rank, d as u64, 0))
                .collect(),
            s: (0..dim)
                .map(|d| 1.0 + 0.1 * uniform(9 + init_rank, d as u64, 1))
                .collect(),
            seed,
            rank,
            diverge_at,
            updates: 0,
            bytes_per_sample: 4 * (dim as u64 + 1),
            delay: std::time::Duration::ZERO,
            loss_scale: None,
            device: None,
        }
    }

    /// Emulates a device that keeps the weights, gradient and optimizer slots
    /// ([`Model::device_state`]), counting every crossing into `counts`.
    #[must_use]
    pub fn with_device_state(mut self, counts: Arc<DeviceCounts>) -> Self {
        self.device = Some(EmulatedDevice {
            resident: false,
            w: Vec::new(),
            slots: Vec::new(),
            grad: Vec::new(),
            fresh: true,
            counts,
        });
        self
    }

    /// Emulates a half-precision pass with loss scaling ([`Model::set_loss_scale`]): the
    /// gradient is computed in f32 for the loss times the scale, and any value whose
    /// magnitude exceeds f16's largest finite value (65504) becomes infinite.
    #[must_use]
    pub fn with_loss_scaling(mut self) -> Self {
        self.loss_scale = Some(1.0);
        self
    }

    /// Sleeps `delay` in every [`Model::loss_and_grad`] (a slow replica, for the timing
    /// tests).
    #[must_use]
    pub fn with_delay(mut self, delay: std::time::Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Claims `bytes` of working memory per sample in [`Model::memory_estimate`] (the
    /// memory-check tests make it huge on purpose); default: one input row and target.
    #[must_use]
    pub fn with_memory_per_sample(mut self, bytes: u64) -> Self {
        self.bytes_per_sample = bytes;
        self
    }
}

impl Model for LinearRegression {
    fn trainable(&self) -> &[f32] {
        &self.w
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        &mut self.w
    }
    fn frozen(&self) -> &[f32] {
        &self.s
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        &mut self.s
    }
    fn loss_names(&self) -> Vec<String> {
        vec!["mse".into(), "l2".into()]
    }
    fn sample_separable(&self) -> bool {
        true
    }
    fn set_loss_scale(&mut self, scale: f32) -> bool {
        match &mut self.loss_scale {
            Some(s) => {
                *s = scale;
                true
            }
            None => false,
        }
    }
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> Result<Vec<f64>> {
        std::thread::sleep(self.delay);
        match self.device.take() {
            Some(mut dev) if dev.resident => {
                // On the emulated device: the device's weights, the gradient added into
                // the device's buffer (zeroed when an update starts, as the host's is).
                if dev.fresh {
                    dev.grad.iter_mut().for_each(|g| *g = 0.0);
                    dev.fresh = false;
                }
                let mut micro = vec![0.0f32; dev.w.len()];
                let terms = self.pass(&dev.w, batch, &mut micro);
                dev.grad.iter_mut().zip(&micro).for_each(|(a, b)| *a += *b);
                self.device = Some(dev);
                terms
            }
            other => {
                self.device = other;
                let w = self.w.clone();
                self.pass(&w, batch, grad)
            }
        }
    }
    fn device_state(&mut self) -> Option<&mut dyn DeviceState> {
        match self.device {
            Some(_) => Some(self),
            None => None,
        }
    }
    fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        let mut e = MemoryEstimate::new();
        e.add(
            "per-sample inputs",
            self.bytes_per_sample.saturating_mul(local_batch as u64),
        )
        .driven_by("run.batch_size");
        e
    }
    fn after_update(&mut self) {
        self.updates += 1;
        if let Some((u, r)) = self.diverge_at {
            if self.updates == u && self.rank == r {
                match &mut self.device {
                    Some(d) if d.resident => d.w[0] += 1e-3,
                    _ => self.w[0] += 1e-3,
                }
            }
        }
    }
    fn export(&self, dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
        let path = dir.join("weights.json");
        let text = serde_json::to_string_pretty(&serde_json::json!({"w": self.w, "s": self.s}))?;
        crate::checkpoint::write_atomic(&path, text.as_bytes())?;
        Ok(vec![path])
    }
}

impl DeviceState for LinearRegression {
    fn upload(&mut self, slots: &[Vec<f32>]) -> Result<()> {
        let w = self.w.clone();
        let dev = self.device.as_mut().expect("a device model");
        dev.counts.uploads.fetch_add(1, Ordering::SeqCst);
        dev.grad = vec![0.0; w.len()];
        dev.w = w;
        dev.slots = slots.to_vec();
        dev.resident = true;
        dev.fresh = true;
        Ok(())
    }
    fn download(&mut self, slots: &mut [Vec<f32>]) -> Result<()> {
        let dev = self.device.as_mut().expect("a device model");
        dev.counts.downloads.fetch_add(1, Ordering::SeqCst);
        self.w.copy_from_slice(&dev.w);
        for (h, d) in slots.iter_mut().zip(&dev.slots) {
            h.copy_from_slice(d);
        }
        Ok(())
    }
    fn release(&mut self) {
        if let Some(dev) = &mut self.device {
            dev.resident = false;
        }
    }
    fn read_gradient(&mut self, grad: &mut [f32]) -> Result<()> {
        let dev = self.device.as_mut().expect("a device model");
        dev.counts.gradient_reads.fetch_add(1, Ordering::SeqCst);
        grad.copy_from_slice(&dev.grad);
        Ok(())
    }
    fn gradient_is_finite(&mut self) -> Result<bool> {
        let dev = self.device.as_mut().expect("a device model");
        dev.counts.finite_tests.fetch_add(1, Ordering::SeqCst);
        Ok(dev.grad.iter().all(|g| g.is_finite()))
    }
    fn finish_update(
        &mut self,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> Result<()> {
        let dev = self.device.as_mut().expect("a device model");
        dev.fresh = true;
        let Some(u) = update else {
            dev.counts.skipped.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        };
        dev.counts.applied.fetch_add(1, Ordering::SeqCst);
        if let Some(r) = reduced {
            dev.counts.uploaded_gradients.fetch_add(1, Ordering::SeqCst);
            dev.grad.copy_from_slice(r);
        }
        apply_device_update(u, &mut dev.w, &mut dev.slots, &dev.grad);
        Ok(())
    }
}

/// [`DeviceUpdate`]'s formula, value by value, as a device kernel computes it.
pub fn apply_device_update(u: &DeviceUpdate, w: &mut [f32], slots: &mut [Vec<f32>], grad: &[f32]) {
    let lr = u.learning_rate;
    match u.rule {
        DeviceRule::Adam {
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            epsilon,
            keep,
            c1,
            c2,
        } => {
            let (m, rest) = slots.split_at_mut(1);
            let (m, v) = (&mut m[0], &mut rest[0]);
            for i in 0..w.len() {
                let g = grad[i] * u.grad_factor * u.unscale;
                let mut p = w[i] * keep;
                m[i] = beta1 * m[i] + one_minus_beta1 * g;
                v[i] = beta2 * v[i] + one_minus_beta2 * g * g;
                p -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + epsilon);
                w[i] = p;
            }
        }
        DeviceRule::Sgd { momentum } => {
            let vel = &mut slots[0];
            for i in 0..w.len() {
                let g = grad[i] * u.grad_factor * u.unscale;
                vel[i] = momentum * vel[i] + g;
                w[i] -= lr * vel[i];
            }
        }
    }
}

impl LinearRegression {
    /// The loss terms of `batch` with weights `w`; the gradient is added into `grad`.
    fn pass(&self, w: &[f32], batch: &Batch, grad: &mut [f32]) -> Result<Vec<f64>> {
        let dim = w.len();
        if batch.inputs.len() != batch.samples * dim || batch.targets.len() != batch.samples {
            bail!("batch shape does not match the model's {dim} inputs");
        }
        let mut mse = 0.0f64;
        let inv = 1.0 / batch.samples as f32;
        for i in 0..batch.samples {
            let x = &batch.inputs[i * dim..(i + 1) * dim];
            let noise = 0.05 * uniform(self.seed, batch.first_sample + i as u64, dim as u64);
            let y = batch.targets[i] + noise;
            let pred: f32 = (0..dim).map(|d| self.s[d] * w[d] * x[d]).sum();
            let r = pred - y;
            mse += (r * r) as f64;
            for d in 0..dim {
                grad[d] += 2.0 * r * self.s[d] * x[d] * inv;
            }
        }
        let l2: f32 = 1e-3 * w.iter().map(|w| w * w).sum::<f32>();
        for (g, w) in grad.iter_mut().zip(w) {
            *g += 2e-3 * w;
        }
        if let Some(scale) = self.loss_scale {
            for g in grad.iter_mut() {
                *g *= scale;
                if g.abs() > 65504.0 {
                    *g = f32::INFINITY.copysign(*g);
                }
            }
        }
        Ok(vec![mse / batch.samples as f64, l2 as f64])
    }
}
