//! The phases of one training step timed apart (`lockstep bench npe`): unpacking the flat
//! parameters into leaf tensors, the embedding's forward pass, the flow's forward pass and
//! the loss, the backward pass, packing the gradients into the flat buffer, and the Adam
//! update. Each phase ends when its kernels have run (on a device, a synchronisation after
//! it), so the sum of the phases exceeds an untimed step's time on a GPU.
//!
//! It lives in this crate, reached through the non-generic [`DeviceModel::step_phases`], so
//! that its code (every layer on every backend) compiles once here and not again in the
//! program that times it: without sharing generics (release builds), a generic function is
//! compiled in every crate that instantiates it.

use crate::backend::TrainBackend;
use crate::device_model::DeviceModel;
use crate::error::NpeError;
use crate::layers::Pass;
use crate::model::NpeModel;
use crate::params::{to_vec, Params, Partition};
use lockstep_train::{Optimizer, OptimizerConfig};
use std::time::Instant;

/// The names of the six phases [`DeviceModel::step_phases`] times, in its order, for the
/// CPU backend (`host`) or a device.
pub fn phase_names(host: bool) -> [&'static str; 6] {
    if host {
        [
            "unpack params -> tensors",
            "forward: embedding",
            "forward: flow + loss",
            "backward",
            "pack grads -> flat",
            "Adam update",
        ]
    } else {
        [
            "copy params host -> device",
            "forward: embedding",
            "forward: flow + loss",
            "backward",
            "copy grads device -> flat",
            "Adam update (host)",
        ]
    }
}

/// What [`DeviceModel::step_phases`] runs: the batch and how many steps.
#[derive(Debug, Clone, Copy)]
pub struct PhaseRun<'a> {
    /// Parameters `θ`, `[n * theta_dim]`.
    pub theta: &'a [f32],
    /// Observations `x`, `[n * x_dim]`.
    pub x: &'a [f32],
    /// Samples in the batch.
    pub n: usize,
    /// Steps run first and not timed.
    pub warmup: usize,
    /// Steps timed (the medians are over these).
    pub steps: usize,
}

impl DeviceModel {
    /// Median seconds of each phase of a training step ([`phase_names`]) over `run.steps`
    /// steps after `run.warmup`, from the trainable values `initial` (the model's own are not
    /// changed); `probe` is called once per step when the activations and every gradient are
    /// alive (the step's peak memory).
    ///
    /// Errors: [`NpeError::Numerical`] when the loss is not finite; [`NpeError::Invalid`]
    /// when the device fails.
    pub fn step_phases(
        &self,
        initial: &[f32],
        run: &PhaseRun<'_>,
        probe: &mut dyn FnMut(),
    ) -> Result<[f64; 6], NpeError> {
        match self {
            DeviceModel::Cpu(m) => phases(m, initial, run, probe),
            DeviceModel::Gpu(m) => phases(m, initial, run, probe),
            #[cfg(feature = "cuda")]
            DeviceModel::Cuda(m) => phases(m, initial, run, probe),
            #[cfg(feature = "fusion")]
            DeviceModel::GpuFusion(m) => phases(m, initial, run, probe),
        }
    }
}

/// [`DeviceModel::step_phases`] for one backend.
fn phases<B: TrainBackend>(
    model: &NpeModel<B>,
    initial: &[f32],
    run: &PhaseRun<'_>,
    probe: &mut dyn FnMut(),
) -> Result<[f64; 6], NpeError> {
    let (network, device, n) = (&model.network, model.device(), run.n);
    // A phase ends when its kernels have run (a no-op on the CPU backend).
    let sync =
        || B::sync(device).map_err(|e| NpeError::Invalid(format!("the device failed: {e:?}")));
    let layout = network.layout();
    let all = Partition::all_trainable(layout);
    let mut params = initial.to_vec();
    let (_, mut state) = network.initial_values(0);
    let mut grad = vec![0.0f32; params.len()];
    let mut opt = Optimizer::new(OptimizerConfig::default(), params.len());
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); 6];
    for i in 0..run.warmup + run.steps {
        let mut t = [0.0f64; 6];
        let c = Instant::now();
        // As NpeModel does: on a device one upload and one packed gradient read-back.
        let p = if B::HOST_MEMORY {
            Params::<B>::leaves(layout, &params, device)
        } else {
            Params::<B>::partitioned_leaves_packed(layout, &all, &params, &[], device)
        };
        sync()?;
        t[0] = c.elapsed().as_secs_f64();
        let mut pass = Pass {
            params: &p,
            state: &mut state,
            state_layout: network.state_layout(),
            training: true,
            sync: None,
        };
        let c = Instant::now();
        let context = network.context(&mut pass, run.x, n);
        sync()?;
        t[1] = c.elapsed().as_secs_f64();
        let c = Instant::now();
        let lp = network.log_prob_with_context(&mut pass, run.theta, &context, n);
        let loss = lp.mean().neg();
        let value = to_vec(loss.clone().detach())[0];
        t[2] = c.elapsed().as_secs_f64();
        if !value.is_finite() {
            return Err(NpeError::Numerical(format!("the loss is {value}")));
        }
        let c = Instant::now();
        let mut grads = loss.backward();
        sync()?;
        t[3] = c.elapsed().as_secs_f64();
        probe();
        let c = Instant::now();
        if B::HOST_MEMORY {
            p.write_gradients(layout, &mut grads, &mut grad);
        } else {
            p.read_partitioned_gradients_with(layout, &all, &mut grads, &mut grad, Vec::new());
        }
        t[4] = c.elapsed().as_secs_f64();
        let c = Instant::now();
        opt.update(&mut params, &grad);
        t[5] = c.elapsed().as_secs_f64();
        if i >= run.warmup {
            for (v, x) in times.iter_mut().zip(t) {
                v.push(x);
            }
        }
    }
    let mut out = [0.0; 6];
    for (o, v) in out.iter_mut().zip(times.iter_mut()) {
        v.sort_by(f64::total_cmp);
        *o = match v.len() {
            0 => f64::NAN,
            k if k % 2 == 1 => v[k / 2],
            k => 0.5 * (v[k / 2 - 1] + v[k / 2]),
        };
    }
    Ok(out)
}
