//! Batched forward simulation.
//!
//! [`TrialState`] is one trial in the layout BPTT's reference uses: contiguous arrays
//! `u [neuron]`, `asc [neuron, n_asc]`, `y1`/`y2 [neuron, port]`, `refr [neuron]` and a ring
//! buffer `ring [slot, neuron, port]` of `max_delay + 1` slots, advanced by
//! [`TrialState::step`], generic over [`Scalar`]. [`simulate`] runs the same recursion in
//! double precision through `crate::simulation::kernel` (structure-of-arrays, four neurons per
//! vector operation), bitwise equal to `TrialState::<f64>::step`. A trial's whole working set
//! (about 300 KB for the 450-cell network at dt 0.1 ms) stays in cache while it advances;
//! trials never interact, so trials run in parallel (rayon) without any synchronisation and
//! give bit-identical results for any thread count.
//!
//! Spike delivery follows NEST: a spike emitted in update step `t` (time stamp `(t+1) dt`)
//! with delay `d` steps is added to the ring slot read in step `t + d`, where it enters
//! `y1` at the end of that step and affects `U` from step `t + d + 1` on.

use rayon::prelude::*;

use crate::input::Inputs;
use crate::network::Network;
use crate::scalar::{Scalar, Surrogate};
use crate::simulation::kernel::{SimPlan, SimTrial};
use crate::simulation::model::InitialState;
use crate::simulation::step::{step_neuron, NeuronStateMut};

/// State of one trial. Shapes in the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialState<S> {
    /// `[neuron]` membrane potential relative to `E_L` (mV), internal order.
    pub u: Vec<S>,
    /// `[neuron, n_asc]` after-spike currents (pA).
    pub asc: Vec<S>,
    /// `[neuron, n_ports]` PSC derivative states (pA/ms).
    pub y1: Vec<S>,
    /// `[neuron, n_ports]` PSC currents (pA).
    pub y2: Vec<S>,
    /// `[neuron]` remaining refractory steps.
    pub refr: Vec<u32>,
    /// `[ring_len, neuron, n_ports]` summed weights (pA) arriving per step.
    pub ring: Vec<S>,
}

impl<S: Scalar> TrialState<S> {
    /// A trial at its initial state.
    pub fn new(net: &Network, init: InitialState) -> Self {
        let n = net.n_neurons();
        let mut u = vec![S::zero(); n];
        let mut asc = vec![S::zero(); n * net.n_asc];
        if init == InitialState::Nest {
            for g in &net.groups {
                for i in g.start..g.end {
                    u[i] = S::from_f64(g.consts.u0);
                    for (a, ac) in g.consts.asc.iter().enumerate() {
                        asc[i * net.n_asc + a] = S::from_f64(ac.init);
                    }
                }
            }
        }
        TrialState {
            u,
            asc,
            y1: vec![S::zero(); n * net.n_ports],
            y2: vec![S::zero(); n * net.n_ports],
            refr: vec![0; n],
            ring: vec![S::zero(); net.ring_len() * n * net.n_ports],
        }
    }

    /// Advance by one update step `t` (0-based) of global sample `sample`.
    ///
    /// `w_rec`/`w_in` are the weights in CSR order (pA). `z` (`[neuron]`, internal order)
    /// receives the spikes of this step. Returns the number of synaptic events delivered.
    ///
    /// # Panics
    /// If `self` was not made for `net`, or `w_rec`, `w_in`, `z` are shorter than
    /// `net.recurrent.len()`, `net.input.len()`, `net.n_neurons()`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        net: &Network,
        w_rec: &[S],
        w_in: &[S],
        inputs: &Inputs,
        sample: u64,
        t: usize,
        sg: &Surrogate,
        z: &mut [S],
    ) -> u64 {
        let n = net.n_neurons();
        let np = net.n_ports;
        let na = net.n_asc;
        let rl = net.ring_len();
        let slot = t % rl;
        let stride = n * np;
        {
            let arrivals = &self.ring[slot * stride..(slot + 1) * stride];
            for g in &net.groups {
                let c = &g.consts;
                let gp = c.ports.len();
                let ga = c.asc.len();
                let (a, b) = (g.start, g.end);
                let it = self.u[a..b]
                    .iter_mut()
                    .zip(self.refr[a..b].iter_mut())
                    .zip(self.y1[a * np..b * np].chunks_exact_mut(np))
                    .zip(self.y2[a * np..b * np].chunks_exact_mut(np))
                    .zip(arrivals[a * np..b * np].chunks_exact(np))
                    .zip(z[a..b].iter_mut());
                if na > 0 {
                    for ((((((u, refr), y1), y2), x), zi), asc) in
                        it.zip(self.asc[a * na..b * na].chunks_exact_mut(na))
                    {
                        *zi = step_neuron(
                            c,
                            NeuronStateMut {
                                u,
                                asc: &mut asc[..ga],
                                y1: &mut y1[..gp],
                                y2: &mut y2[..gp],
                                refr,
                            },
                            &x[..gp],
                            sg,
                        );
                    }
                } else {
                    for (((((u, refr), y1), y2), x), zi) in it {
                        *zi = step_neuron(
                            c,
                            NeuronStateMut {
                                u,
                                asc: &mut [],
                                y1: &mut y1[..gp],
                                y2: &mut y2[..gp],
                                refr,
                            },
                            &x[..gp],
                            sg,
                        );
                    }
                }
            }
        }
        self.ring[slot * stride..(slot + 1) * stride].fill(S::zero());
        let mut events = 0u64;
        // Recurrent spikes of this step.
        for (i, &zi) in z.iter().enumerate().take(n) {
            if !(S::HAS_DERIVATIVE || zi.re() != 0.0) {
                continue;
            }
            for seg in net.recurrent.segments_of(i) {
                let base = ((t + seg.delay as usize) % rl) * stride + seg.port as usize;
                let (a, b) = (seg.start as usize, seg.end as usize);
                for (&off, &w) in net.recurrent.target_off[a..b].iter().zip(&w_rec[a..b]) {
                    self.ring[base + off as usize] += w * zi;
                }
                events += (b - a) as u64;
            }
        }
        // Input spikes emitted in this step.
        let ring = &mut self.ring;
        inputs.for_each(sample, t, |v, count| {
            let cnt = count as f64;
            for seg in net.input.segments_of(v as usize) {
                let base = ((t + seg.delay as usize) % rl) * stride + seg.port as usize;
                let (a, b) = (seg.start as usize, seg.end as usize);
                for (&off, &w) in net.input.target_off[a..b].iter().zip(&w_in[a..b]) {
                    ring[base + off as usize] += w.mulc(cnt);
                }
                events += (b - a) as u64;
            }
        });
        events
    }
}

/// Options of a forward simulation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimOptions {
    /// Initial state of every trial.
    pub initial: InitialState,
    /// Run trials on rayon's thread pool.
    pub parallel: bool,
    /// Pseudo-derivative (only used by scalar types with derivatives).
    pub surrogate: Surrogate,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            initial: InitialState::Nest,
            parallel: true,
            surrogate: Surrogate::default(),
        }
    }
}

/// Spikes of one trial.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrialSpikes {
    /// Global sample index of the trial.
    pub sample: u64,
    /// `(step, neuron)`: the neuron (external index) spiked in update step `step`, i.e. at
    /// time `(step + 1) * dt` ms (NEST's spike time stamp). Sorted by step, then neuron.
    pub spikes: Vec<(u32, u32)>,
    /// Synaptic events delivered (recurrent + input edges).
    pub syn_events: u64,
}

/// A membrane-potential recording of trial 0: `V_m` (mV, NEST's `U + E_L`) of `neurons`
/// after update step counts `first_step`, `first_step + stride`, ... (`n_frames` frames),
/// i.e. at times `first_step * dt`, `(first_step + stride) * dt`, ... ms: the state at the end
/// of the step that ends at that time, as NEST's `multimeter` samples it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmRecorder {
    /// `[cell]` neurons to record (external indices).
    pub neurons: Vec<u32>,
    /// Step count (>= 1) of the first frame.
    pub first_step: usize,
    /// Steps between frames (>= 1).
    pub stride: usize,
    /// Number of frames; the last is at step count `first_step + (n_frames - 1) * stride`,
    /// which must not exceed the run's steps.
    pub n_frames: usize,
}

impl VmRecorder {
    /// Bytes the recording holds: `n_frames * neurons * 8`.
    pub fn bytes(&self) -> u64 {
        (self.n_frames as u64)
            .saturating_mul(self.neurons.len() as u64)
            .saturating_mul(8)
    }
}

/// Optional parts of a run of [`simulate_with`].
#[derive(Clone, Copy, Default)]
pub struct SimExtras<'a> {
    /// Membrane-potential recordings of trial 0.
    pub record_vm: &'a [VmRecorder],
    /// Called from the trials' threads with the number of update steps a trial has just
    /// completed (in chunks of at most [`PROGRESS_CHUNK`] steps); a run makes
    /// `batch * n_steps` in all.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Stop every trial at its next chunk of [`PROGRESS_CHUNK`] steps once a stop is asked
    /// for ([`lockstep_core::interrupt`]); the output then holds the steps run so far, and
    /// the caller must discard it. Off for training, whose passes must complete.
    pub stop_on_interrupt: bool,
}

impl std::fmt::Debug for SimExtras<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimExtras")
            .field("record_vm", &self.record_vm)
            .field("progress", &self.progress.is_some())
            .field("stop_on_interrupt", &self.stop_on_interrupt)
            .finish()
    }
}

/// Steps between two progress reports of a trial.
pub const PROGRESS_CHUNK: usize = 1024;

/// Result of [`simulate`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimOutput {
    /// One entry per trial of the batch.
    pub trials: Vec<TrialSpikes>,
    /// Steps simulated.
    pub n_steps: usize,
    /// Time step (ms).
    pub dt: f64,
    /// One `[frame, cell]` row-major `V_m` block (mV) of trial 0 per [`VmRecorder`] of the
    /// run, in the recorders' order (empty without recorders).
    pub vm: Vec<Vec<f64>>,
}

/// Simulate `batch` trials (global sample indices `first_sample..first_sample + batch`) for
/// `n_steps` steps with the network's own weights, in double precision (NEST-exact).
pub fn simulate(
    net: &Network,
    inputs: &Inputs,
    n_steps: usize,
    batch: usize,
    first_sample: u64,
    opts: &SimOptions,
) -> SimOutput {
    simulate_with(
        net,
        inputs,
        n_steps,
        batch,
        first_sample,
        opts,
        &SimExtras::default(),
    )
}

/// [`simulate`], also recording the membrane potentials of trial 0 and reporting progress
/// ([`SimExtras`]). Recording reads the state; it changes no spike.
///
/// # Panics
/// If a recorder names a neuron index `>= net.n_neurons()`, has `first_step` or `stride` 0,
/// or ends after `n_steps` (validate recorders against the run first).
pub fn simulate_with(
    net: &Network,
    inputs: &Inputs,
    n_steps: usize,
    batch: usize,
    first_sample: u64,
    opts: &SimOptions,
    extras: &SimExtras<'_>,
) -> SimOutput {
    for r in extras.record_vm {
        assert!(
            r.first_step >= 1
                && r.stride >= 1
                && (r.n_frames == 0 || r.first_step + (r.n_frames - 1) * r.stride <= n_steps),
            "V_m recorder outside the run's {n_steps} steps: {r:?}"
        );
    }
    // (internal index, E_L) of every recorded neuron.
    let recorded: Vec<Vec<(usize, f64)>> = extras
        .record_vm
        .iter()
        .map(|r| {
            r.neurons
                .iter()
                .map(|&e| {
                    let i = net.rank[e as usize] as usize;
                    (i, net.consts_of(i).e_l)
                })
                .collect()
        })
        .collect();
    let plan = SimPlan::new(net);
    let run = |b: usize| -> (TrialSpikes, Vec<Vec<f64>>) {
        let sample = first_sample + b as u64;
        let mut st = SimTrial::new(net, opts.initial);
        let mut out = TrialSpikes {
            sample,
            ..Default::default()
        };
        let record = b == 0;
        let mut vm: Vec<Vec<f64>> = extras
            .record_vm
            .iter()
            .map(|r| {
                Vec::with_capacity(if record {
                    r.n_frames * r.neurons.len()
                } else {
                    0
                })
            })
            .collect();
        let mut fired: Vec<u32> = Vec::new();
        let mut since_report = 0usize;
        for t in 0..n_steps {
            out.syn_events += st.step(net, &plan, inputs, sample, t, &opts.surrogate, &mut fired);
            for i in fired.iter_mut() {
                *i = net.order[*i as usize];
            }
            fired.sort_unstable();
            out.spikes.extend(fired.iter().map(|&e| (t as u32, e)));
            if record {
                // The state now holds time (t + 1) * dt.
                let m = t + 1;
                for ((r, cells), v) in extras.record_vm.iter().zip(&recorded).zip(&mut vm) {
                    if m >= r.first_step
                        && (m - r.first_step) % r.stride == 0
                        && (m - r.first_step) / r.stride < r.n_frames
                    {
                        v.extend(cells.iter().map(|&(i, e_l)| st.u()[i] + e_l));
                    }
                }
            }
            since_report += 1;
            if since_report == PROGRESS_CHUNK || t + 1 == n_steps {
                if let Some(p) = extras.progress {
                    p(since_report as u64);
                }
                since_report = 0;
                if extras.stop_on_interrupt && lockstep_core::interrupt::requested() {
                    break;
                }
            }
        }
        (out, vm)
    };
    let mut results: Vec<(TrialSpikes, Vec<Vec<f64>>)> = if opts.parallel {
        (0..batch).into_par_iter().map(run).collect()
    } else {
        (0..batch).map(run).collect()
    };
    let vm = if results.is_empty() {
        vec![Vec::new(); extras.record_vm.len()]
    } else {
        std::mem::take(&mut results[0].1)
    };
    SimOutput {
        trials: results.into_iter().map(|(t, _)| t).collect(),
        n_steps,
        dt: net.grid.dt,
        vm,
    }
}
