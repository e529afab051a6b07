//! The GPU engine's entry ([`GpuEngine`]): the adapter it computes on, the resident buffers
//! and compiled kernels of one model and batch shape, and one call's passes (the whole time
//! loop, forward and backward, recorded into one command buffer; the loss sums, reduced on
//! the device, and on the host path the gradient read back once at its end).

use std::sync::{Arc, Mutex};

use lockstep_core::memory::MemoryEstimate;
use lockstep_gpu::{wgpu, GpuContext, ReadRange, Selected};

use crate::error::{Result, SnnError};
use crate::scalar::PseudoDerivative;
use crate::simulation::model::InitialState;
use crate::training::gpu::layout::{tape_step_bytes, Layout};
use crate::training::gpu::plan::{plan_passes, Call, Kernels, Pass, StepArgs};
use crate::training::gpu::training_state::TrainingState;
use crate::training::gpu::wide_arith::Wide;
use crate::training::options::{DeviceCounts, LossAndGrad, StepTiming};
use crate::training::problem::Problem;

/// The kernels' source (constants prepended per model and batch).
const SHADER: &str = include_str!("bptt.wgsl");
/// The fixed bindings of group 0 in `bptt.wgsl` (binding, read-only): the network's
/// constants. The windowed arrays (the network's indices, weights, gradient and edges, and
/// the per-sample state, counters, masks, voltage sums and adjoint state) follow from
/// `layout::FIRST_WINDOW`.
const FIXED_BINDINGS: [(u32, bool); 2] = [(1, true), (2, true)];
/// Bytes between two per-step uniforms (every adapter's dynamic-offset alignment divides it).
const STEP_STRIDE: u64 = 256;
/// Bytes of one per-step uniform (`Step` in the shader, rounded to 16).
const STEP_BYTES: u64 = 16;

/// The float32 BPTT step on a GPU through wgpu (`run.device: "gpu"`).
pub(crate) struct GpuEngine {
    pub(super) ctx: Arc<GpuContext>,
    selected: Selected,
    resident: Mutex<Option<Resident>>,
    /// The parameters, gradient and optimizer slots while training keeps them on the device
    /// (lockstep-train's `device_state`); kept apart from the buffers of a batch shape.
    pub(super) training: Mutex<Option<TrainingState>>,
    /// The kernels' wide type, by the adapter's features.
    pub(super) wide: Wide,
}

/// Where a call's weights come from and where its gradient goes.
#[derive(Clone, Copy)]
enum Weights<'a> {
    /// The host's parameters, uploaded; the gradient read back and returned.
    Host(&'a [f32]),
    /// The device's training state: its parameters copied on the device, the gradient added
    /// into its update's gradient (nothing of either crosses the bus).
    Device,
}

impl std::fmt::Debug for GpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuEngine({})", self.ctx.adapter.name)
    }
}

impl Clone for GpuEngine {
    /// The same adapter; the clone builds its own buffers at its first call.
    fn clone(&self) -> Self {
        GpuEngine {
            ctx: self.ctx.clone(),
            selected: self.selected.clone(),
            resident: Mutex::new(None),
            training: Mutex::new(None),
            wide: self.wide,
        }
    }
}

/// What shapes the resident buffers and kernels: batch, steps, chunk, trained inputs.
type ShapeKey = (usize, usize, Option<usize>, bool);

/// The buffers and kernels of one model and batch shape, kept between calls.
struct Resident {
    key: ShapeKey,
    layout: Layout,
    kernels: Kernels,
    net_f32: wgpu::Buffer,
    net_f64: wgpu::Buffer,
    weights: wgpu::Buffer,
    state: wgpu::Buffer,
    /// The forward state at the first step (uploaded once, copied into `state` per call).
    initial_state: wgpu::Buffer,
    state_u32: wgpu::Buffer,
    masks: wgpu::Buffer,
    vreg: wgpu::Buffer,
    adj: wgpu::Buffer,
    grad: wgpu::Buffer,
    steps: wgpu::Buffer,
    /// The layout of group 2 (the per-step uniform).
    step_layout: wgpu::BindGroupLayout,
    /// Per tape buffer: its bind group (group 1).
    tape_groups: Vec<wgpu::BindGroup>,
    group0: wgpu::BindGroup,
    group2: wgpu::BindGroup,
    /// Chunk boundaries of segmented BPTT: (f32 state, refractory counters).
    boundaries: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    /// Device bytes of all buffers.
    device_bytes: u64,
    /// Uniform slots the steps buffer holds.
    step_slots: usize,
    /// Whether the untrained input weights are in `weights` (written at the first call).
    fixed_inputs_written: bool,
    /// Whether `steps` holds this shape's per-step uniforms (written at the first call).
    steps_written: bool,
    /// The network's indices (`net_u32`; the batch's first sample is written per call).
    net_u32: wgpu::Buffer,
}

impl GpuEngine {
    /// The engine on the adapter `selected` (opened once per process and shared).
    ///
    /// Its kernels use float64 and 64-bit integers where the adapter has `SHADER_F64` and
    /// `SHADER_INT64`, else 32-bit types only ([`Wide`]: the same spikes either way).
    ///
    /// Errors: the adapter cannot be opened.
    pub fn new(selected: Selected) -> Result<GpuEngine> {
        let ctx = GpuContext::open(selected.adapter.index)?;
        let wide = Wide::of(ctx.features);
        Ok(GpuEngine {
            ctx,
            selected,
            resident: Mutex::new(None),
            training: Mutex::new(None),
            wide,
        })
    }

    /// How the log names the kernels' arithmetic: empty with float64, else a note.
    pub fn arithmetic_note(&self) -> &'static str {
        self.wide.note()
    }

    /// Whether the kernels use float64 and 64-bit integers ([`Wide::F64`]).
    pub fn kernels_64bit(&self) -> bool {
        self.wide == Wide::F64
    }

    /// The adapter and how it was chosen.
    pub fn selected(&self) -> &Selected {
        &self.selected
    }

    /// The open device this engine computes on.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// Frees the device buffers (the next call allocates them again).
    pub fn release(&self) {
        *self.resident.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Builds (or keeps) the buffers and kernels for `batch` samples and checks every buffer
    /// against the adapter's limits, allocating on the device. Returns the device bytes.
    ///
    /// Errors: a buffer over the adapter's limits (named, with its size and the keys that
    /// shrink it), or a device error.
    pub fn prepare(&self, p: &Problem, batch: usize) -> Result<u64> {
        let mut slot = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        self.resident_for(&mut slot, p, batch)?;
        Ok(slot.as_ref().map_or(0, |r| r.device_bytes))
    }

    fn resident_for<'a>(
        &self,
        slot: &'a mut Option<Resident>,
        p: &Problem,
        batch: usize,
    ) -> Result<&'a mut Resident> {
        let key: ShapeKey = (
            batch,
            p.opts.seq_len,
            p.opts.gradient_checkpointing,
            p.opts.train_input_weights,
        );
        if slot.as_ref().is_none_or(|r| r.key != key) {
            *slot = None;
            *slot = Some(Resident::new(&self.ctx, p, batch, key, self.wide)?);
        }
        Ok(slot.as_mut().expect("resident buffers"))
    }

    /// Bytes of stored forward state per sample on the device, `(unsegmented, segmented)`:
    /// the potential or held potential and the decayed after-spike currents of every step
    /// (float32), the spike masks, and with segments one chunk's tape plus the state at
    /// every chunk boundary.
    pub fn tape_bytes_per_sample(p: &Problem) -> (usize, usize) {
        let n = p.net.n_neurons();
        let (x, a) = tape_step_bytes(n, p.net.n_asc, 1);
        let t = p.opts.seq_len;
        let step = (x + a) as usize + n.div_ceil(4);
        let full = step * t;
        let seg = match p.opts.gradient_checkpointing {
            Some(k) => {
                let np = p.net.n_ports.max(1);
                let boundary = 4 * n * (2 + p.net.n_asc + 2 * np);
                step * k.min(t) + t.div_ceil(k) * boundary + n.div_ceil(4) * t
            }
            None => full,
        };
        (full, seg)
    }

    /// The host memory one call needs (the device's buffers are not host memory): the
    /// gradient read back in f64 and returned in f32, the layout of the network built on the
    /// host when the buffers are made (per recurrent edge 12 bytes, per input edge 20), and
    /// the loss sums read back (per sample, one per rate loss and two).
    pub fn memory_estimate(p: &Problem, local_batch: usize) -> MemoryEstimate {
        let params = p.n_params() as u64;
        let sums = (p.rate_losses.len() + 2) as u64;
        let mut e = MemoryEstimate::new();
        e.add(
            "gradient read back from the GPU (f64 at most) and returned (f32)",
            12 * params,
        )
        .add(
            "network layout built for the GPU (in-edge lists, out-edge targets)",
            12 * p.net.weights_rec.len() as u64 + 20 * p.net.weights_in.len() as u64,
        )
        .add(
            "loss sums read back (per sample, f64 at most)",
            8 * sums * local_batch.max(1) as u64,
        )
        .add(
            "compiled network (per edge: target offset, edge id, sign)",
            p.network_bytes(),
        )
        .driven_by("run.batch_size");
        e
    }

    /// Loss and mean gradient over the local batch of global samples `first_sample ..
    /// first_sample + batch` on the GPU, with the split of the call's time: the call is one
    /// submission, so `forward_s` is the host's recording of the forward pass and
    /// `backward_s` the rest, the device's work on both passes included.
    ///
    /// Errors: `batch == 0`, `params.len() != n_params()`, a buffer over the adapter's
    /// limits, or a device error.
    pub fn loss_and_grad(
        &self,
        p: &Problem,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        p.check_params(params)?;
        self.call(p, Weights::Host(params), first_sample, batch)
    }

    /// [`GpuEngine::loss_and_grad`] with the training state on the device
    /// ([`GpuEngine::upload_training`]): the device's parameters, and the mean gradient
    /// added into the device's gradient of the update (the returned `grad` is empty). One
    /// host synchronisation: the loss sums, reduced on the device, read back after the
    /// backward pass (the passes and the gradient's accumulation are one submission).
    ///
    /// Errors: those of [`GpuEngine::loss_and_grad`]; no training state on the device, or
    /// one of another length than the model's parameters.
    pub fn loss_and_grad_on_device(
        &self,
        p: &Problem,
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        self.call(p, Weights::Device, first_sample, batch)
    }

    /// One call on `weights`: the inputs written, then in one submission the forward pass,
    /// the loss sums and the rate losses' derivatives on the device and the backward pass;
    /// the loss sums per sample read back at its end (with the gradient on the host path),
    /// the loss terms from them on the host.
    fn call(
        &self,
        p: &Problem,
        weights: Weights<'_>,
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        if batch == 0 {
            return Err(SnnError::Shape("batch must be at least 1".into()));
        }
        let mut slot = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.resident_for(&mut slot, p, batch)?;
        let training = self.training.lock().unwrap_or_else(|p| p.into_inner());
        let train = match weights {
            Weights::Host(_) => None,
            Weights::Device => Some(training_for(training.as_ref(), p)?),
        };
        let ctx = &self.ctx;
        let mut timing = StepTiming::default();
        let chunk = p
            .opts
            .gradient_checkpointing
            .map(|k| k.min(r.layout.t).max(1));
        let (fwd, bwd, steps) = plan_passes(&r.layout, chunk);
        let mut launches = fwd
            .iter()
            .chain(bwd.iter().map(|(_, c)| c))
            .flatten()
            .filter(|(c, _)| c.groups > 0)
            .count() as u64;
        let uploaded = r.write_inputs(ctx, p, weights, first_sample, batch, &steps);

        // One submission: the forward pass, the loss sums and the rate losses' derivatives
        // (`loss_sums`, on the device), the backward pass; one read-back at its end.
        let clock = std::time::Instant::now();
        let enc = r.forward(ctx, train, &fwd, chunk.is_some());
        timing.forward_s = clock.elapsed().as_secs_f64();
        let clock = std::time::Instant::now();
        let back = r.backward(ctx, p, train, &bwd, enc)?;
        timing.backward_s = clock.elapsed().as_secs_f64();
        if let (Some(t), true) = (train, back.bad) {
            // An earlier update left a parameter infinite or NaN: stop, naming it.
            return Err(t.non_finite(ctx)?.unwrap_or(SnnError::Shape(
                "an update flagged a non-finite parameter that the read-back does not show".into(),
            )));
        }
        let (terms, n_spikes) = p.batch_terms_from_sums(&back.sums, batch);
        let first_spikes = back
            .masks
            .as_ref()
            .map(|m| first_sample_spikes(p, &r.layout, m));
        launches += back.launches;
        timing.device = Some(DeviceCounts {
            launches,
            host_syncs: 1,
            bytes_to_host: back.read_bytes,
            bytes_to_device: uploaded,
        });
        let mut out = p.finish(terms, back.grad, n_spikes, batch);
        out.first_spikes = first_spikes;
        Ok((out, timing))
    }
}

/// The training state on the device for a call of `p`'s model.
///
/// Errors: none uploaded, or one of another length than the model's parameters.
fn training_for<'a>(t: Option<&'a TrainingState>, p: &Problem) -> Result<&'a TrainingState> {
    match t {
        Some(t) if t.len() == p.n_params() => Ok(t),
        Some(t) => Err(SnnError::Shape(format!(
            "the training state on the device has {} parameters; the model has {}",
            t.len(),
            p.n_params()
        ))),
        None => Err(SnnError::Shape(
            "the training state is not on the device (no upload)".into(),
        )),
    }
}

/// The first sample's spikes as `(step, neuron id)` pairs, sorted, from the masks `raw`
/// (`[step, neuron, word]` u32, lane 0 the first sample).
fn first_sample_spikes(p: &Problem, l: &Layout, raw: &[u8]) -> Vec<(u32, u32)> {
    let fired: Vec<u32> = bytemuck::pod_collect_to_vec(raw);
    let mut s = Vec::new();
    for t in 0..l.t {
        for i in 0..l.n {
            if fired[(t * l.n + i) * l.w] & 1 != 0 {
                s.push((t as u32, p.net.order[i]));
            }
        }
    }
    s.sort_unstable();
    s
}

/// What the backward pass of a call gives back.
struct Readback {
    /// The loss sums per sample (`[rate losses + 2, B]`, [`Layout::o_loss`]).
    sums: Vec<f64>,
    /// The first sample's spike masks, when recorded.
    masks: Option<Vec<u8>>,
    /// With the training state on the device: an update left a parameter non-finite.
    bad: bool,
    /// The mean gradient (`[n_params]`), or empty when it went into the device's.
    grad: Vec<f32>,
    /// Bytes read back.
    read_bytes: u64,
    /// Launches added to the plan's (the gradient's accumulation).
    launches: u64,
}

impl Resident {
    /// Writes one call's inputs: the parameters (from the host; from the device they are
    /// copied in the forward pass), the untrained input weights and the per-step uniforms
    /// (once per shape), the surrogate, the voltage-regularization coefficient and the
    /// batch's first sample. Returns the bytes uploaded.
    fn write_inputs(
        &mut self,
        ctx: &GpuContext,
        p: &Problem,
        weights: Weights<'_>,
        first_sample: u64,
        batch: usize,
        steps: &[StepArgs],
    ) -> u64 {
        let l = &self.layout;
        let mut uploaded = 0u64;
        if let Weights::Host(params) = weights {
            ctx.write(&self.weights, 0, params);
            uploaded += 4 * params.len() as u64;
        }
        if !l.train_in && !self.fixed_inputs_written {
            let w_in: Vec<f32> = p.net.weights_in.iter().map(|&x| x as f32).collect();
            ctx.write(&self.weights, 4 * l.e_rec as u64, &w_in);
            uploaded += 4 * w_in.len() as u64;
            self.fixed_inputs_written = true;
        }
        let sg = &p.opts.surrogate;
        let kind = match sg.kind {
            PseudoDerivative::Gauss => 0.0f32,
            PseudoDerivative::Triangle => 1.0,
        };
        ctx.write(
            &self.net_f32,
            4 * l.o_sg as u64,
            &[kind, sg.gain as f32, sg.width as f32],
        );
        let vcoef = p.vreg_cost / (batch as f64 * l.n as f64 * l.t as f64);
        let wb = l.wide.bytes();
        ctx.write(
            &self.net_f64,
            wb * l.o_vcoef as u64,
            &l.wide.encode(&[vcoef]),
        );
        if steps.len() > self.step_slots {
            self.steps = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("per-step uniforms"),
                size: steps.len() as u64 * STEP_STRIDE,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            self.group2 = step_group(ctx, &self.step_layout, &self.steps);
            self.step_slots = steps.len();
            self.steps_written = false;
        }
        // The per-step uniforms depend on the shape only: written at the shape's first call.
        if !self.steps_written {
            let mut uni = vec![0u8; steps.len() * STEP_STRIDE as usize];
            for (s, a) in steps.iter().enumerate() {
                let words: [u32; 3] = [a.t, (a.tape % l.tape_steps) as u32, a.accumulate as u32];
                let o = s * STEP_STRIDE as usize;
                uni[o..o + 12].copy_from_slice(bytemuck::cast_slice(&words));
            }
            ctx.write(&self.steps, 0, &uni);
            uploaded += uni.len() as u64;
            self.steps_written = true;
        }
        let s0 = [first_sample as u32, (first_sample >> 32) as u32];
        ctx.write(&self.net_u32, 4 * l.o_s0 as u64, &s0);
        uploaded + 4 * 3 + wb + 8
    }

    /// Records the forward pass (`fwd`, per chunk; `segmented`: each chunk's boundary state
    /// copied out first; its last dispatch `loss_sums`) from the initial state, with the
    /// device's parameters copied in first when `train` is given. Nothing is submitted.
    fn forward(
        &self,
        ctx: &GpuContext,
        train: Option<&TrainingState>,
        fwd: &[Vec<(Call, usize)>],
        segmented: bool,
    ) -> wgpu::CommandEncoder {
        let l = &self.layout;
        let nb = (l.n * l.b) as u64;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(
            &self.initial_state,
            0,
            &self.state,
            0,
            4 * l.state_len as u64,
        );
        if let Some(t) = train.filter(|t| t.len() > 0) {
            enc.copy_buffer_to_buffer(t.params(), 0, &self.weights, 0, 4 * t.len() as u64);
        }
        for buf in [
            &self.state_u32,
            &self.masks,
            &self.vreg,
            &self.adj,
            &self.grad,
        ] {
            enc.clear_buffer(buf, 0, None);
        }
        for (ci, calls) in fwd.iter().enumerate() {
            if segmented {
                let (bf, bu) = &self.boundaries[ci];
                enc.copy_buffer_to_buffer(&self.state, 0, bf, 0, 4 * l.boundary_f32 as u64);
                enc.copy_buffer_to_buffer(&self.state_u32, 0, bu, 0, 4 * nb);
            }
            self.record(&mut enc, calls);
        }
        enc
    }

    /// Records the backward pass (`bwd`, per chunk from the last, each chunk's boundary
    /// restored first when segmented) after the forward pass in `enc`, and submits both. With
    /// `train` the gradient is added into the device's; else the wide (float64 or float32)
    /// gradient is read back, in float32. In the same read-back (the call's one host synchronisation): the
    /// loss sums per sample, when recorded the first sample's spike masks, and with `train`
    /// its non-finite flag.
    ///
    /// Errors: the device's.
    fn backward(
        &self,
        ctx: &GpuContext,
        p: &Problem,
        train: Option<&TrainingState>,
        bwd: &[Pass],
        mut enc: wgpu::CommandEncoder,
    ) -> Result<Readback> {
        let l = &self.layout;
        for (k, calls) in bwd {
            if let Some(k) = k {
                let (bf, bu) = &self.boundaries[*k];
                enc.copy_buffer_to_buffer(bf, 0, &self.state, 0, 4 * l.boundary_f32 as u64);
                enc.copy_buffer_to_buffer(bu, 0, &self.state_u32, 0, 4 * (l.n * l.b) as u64);
            }
            self.record(&mut enc, calls);
        }
        let launches = match train {
            Some(t) => t.record_accumulate(ctx, &mut enc, &self.grad),
            None => 0,
        };
        let wb = l.wide.bytes();
        let mut reads = vec![ReadRange {
            buffer: &self.vreg,
            offset: wb * l.o_loss as u64,
            bytes: wb * (l.loss_parts * l.b) as u64,
        }];
        if p.opts.record_first_sample {
            reads.push(ReadRange {
                buffer: &self.masks,
                offset: 0,
                bytes: 4 * (l.t * l.n * l.w) as u64,
            });
        }
        match train {
            Some(t) => reads.push(ReadRange {
                buffer: t.bad_flag(),
                offset: 0,
                bytes: 4,
            }),
            None => reads.push(ReadRange {
                buffer: &self.grad,
                offset: 0,
                bytes: wb * (l.e_rec + if l.train_in { l.e_in } else { 0 }) as u64,
            }),
        }
        let mut back = ctx.submit_and_read(enc, &reads)?.into_iter();
        let read_bytes = reads.iter().map(|r| r.bytes).sum();
        // The staging copies need not be aligned for f64: read from the bytes.
        let sums = l.wide.decode(&back.next().expect("the loss sums"));
        let masks = p
            .opts
            .record_first_sample
            .then(|| back.next().expect("the masks"));
        let last = back.next().expect("the flag or the gradient");
        let (bad, grad) = match train {
            Some(_) => {
                let flag: Vec<u32> = bytemuck::pod_collect_to_vec(&last);
                (flag[0] != 0, Vec::new())
            }
            None => (
                false,
                l.wide.decode(&last).into_iter().map(|g| g as f32).collect(),
            ),
        };
        Ok(Readback {
            sums,
            masks,
            bad,
            grad,
            read_bytes,
            launches,
        })
    }
}

/// Errors unless the adapter binds every storage binding of the kernels (the fixed ones,
/// the windows, the tape's two) per kernel; `reduce` names what shrinks them.
fn check_bindings(ctx: &GpuContext, l: &Layout, reduce: &str) -> Result<()> {
    let bindings =
        FIXED_BINDINGS.len() + l.windows.all.iter().map(|w| w.count()).sum::<usize>() + 2;
    let per_stage = ctx.limits.max_storage_buffers_per_shader_stage as usize;
    if bindings > per_stage {
        return Err(SnnError::Shape(format!(
            "the network's and the batch's arrays need {bindings} storage bindings on {} (windows of {} bytes), which binds {per_stage} per kernel; reduce {reduce}",
            ctx.adapter.name,
            ctx.max_storage()
        )));
    }
    Ok(())
}

/// The kernels of `bptt.wgsl` for layout `l` (its constants and windows prepended) with the
/// bind group layouts of groups 0-2.
fn compile_kernels(ctx: &GpuContext, l: &Layout, groups: [&wgpu::BindGroupLayout; 3]) -> Kernels {
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("bptt.wgsl"),
            source: wgpu::ShaderSource::Wgsl(format!("{}\n{SHADER}", l.header).into()),
        });
    let pl = ctx
        .device
        .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("bptt"),
            bind_group_layouts: &groups.map(Some),
            immediate_size: 0,
        });
    let kernel = |entry: &str| ctx.compute_pipeline(&pl, &module, entry);
    Kernels {
        draw: kernel("draw"),
        permute_weights: kernel("permute_weights"),
        deliver: kernel("deliver"),
        update_draw: kernel("update_draw"),
        spmv_in: kernel("spmv_in"),
        neuron_backward: kernel("neuron_backward"),
        loss_sums: kernel("loss_sums"),
    }
}

/// The forward state at the first step (`[state_len]`, the layout's): at rest (zero), or
/// NEST's initial potential `u0` and after-spike currents per neuron with
/// [`InitialState::Nest`].
fn initial_state(p: &Problem, l: &Layout) -> Vec<f32> {
    let (n, b, na) = (l.n, l.b, l.na);
    let mut init = vec![0.0f32; l.state_len];
    if p.opts.initial == InitialState::Nest {
        for g in &p.net.groups {
            for i in g.start..g.end {
                init[i * b..(i + 1) * b].fill(g.consts.u0 as f32);
                for (a, ac) in g.consts.asc.iter().enumerate() {
                    let o = n * b + (i * na + a) * b;
                    init[o..o + b].fill(ac.init as f32);
                }
            }
        }
    }
    init
}

/// The bind group of the per-step uniforms (group 2, dynamic offset).
fn step_group(
    ctx: &GpuContext,
    layout: &wgpu::BindGroupLayout,
    steps: &wgpu::Buffer,
) -> wgpu::BindGroup {
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("per-step uniform"),
        layout,
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: steps,
                offset: 0,
                size: wgpu::BufferSize::new(STEP_BYTES),
            }),
        }],
    })
}

/// The three bind group layouts of the kernels: network and state, tape, per-step uniform.
fn layouts(
    ctx: &GpuContext,
    l: &Layout,
) -> (
    wgpu::BindGroupLayout,
    wgpu::BindGroupLayout,
    wgpu::BindGroupLayout,
) {
    let storage = lockstep_gpu::windows::storage_entry;
    // Bindings of group 0, read-only or not, as `bptt.wgsl` declares them, then the
    // windows of the arrays that may exceed one binding.
    let mut g0: Vec<wgpu::BindGroupLayoutEntry> = FIXED_BINDINGS
        .iter()
        .map(|&(b, ro)| storage(b, ro))
        .collect();
    for w in &l.windows.all {
        g0.extend(w.layout_entries());
    }
    let l0 = ctx
        .device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("network and state"),
            entries: &g0,
        });
    let l1 = ctx
        .device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("tape"),
            entries: &[storage(0, false), storage(1, false)],
        });
    let l2 = ctx
        .device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("step"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: wgpu::BufferSize::new(STEP_BYTES),
                },
                count: None,
            }],
        });
    (l0, l1, l2)
}

impl Resident {
    /// Allocates the buffers of `p` for `b` samples (checking each against the adapter's
    /// limits), uploads the network and compiles the kernels.
    fn new(
        ctx: &Arc<GpuContext>,
        p: &Problem,
        b: usize,
        key: ShapeKey,
        wide: Wide,
    ) -> Result<Resident> {
        let max = ctx.max_storage();
        let layout = Layout::new(p, b, max, wide)?;
        let l = &layout;
        // Before any allocation: the windows must fit the adapter's bindings per kernel.
        check_bindings(
            ctx,
            l,
            "the network's size (cells, edges), run.batch_size or run.seq_len",
        )?;
        let reduce_net = "the network's size (cells, edges) or run.seq_len";
        let reduce_batch = "run.batch_size or run.seq_len";
        let mut bytes = 0u64;
        let mut count = |buf: &wgpu::Buffer| {
            bytes += buf.size();
        };
        let net_u32 =
            ctx.storage_windowed_from("network indices (net_u32)", &l.net_u32, reduce_net)?;
        count(&net_u32);
        let net_f32 = ctx.storage_from("cell constants (net_f32)", &l.net_f32, reduce_net)?;
        count(&net_f32);
        let net_f64 = ctx.storage_from(
            "cell constants (net_f64)",
            &wide.encode(&l.net_f64),
            reduce_net,
        )?;
        count(&net_f64);
        let edges_u32 = ctx.storage_windowed_from(
            "recurrent edges (in-edge lists, targets)",
            &l.edges_u32,
            "the number of recurrent edges",
        )?;
        count(&edges_u32);
        let weights = ctx.storage_windowed(
            "weights (parameters' order, then the recurrent ones in in-edge order)",
            4 * (2 * l.e_rec + l.e_in) as u64,
            "the number of edges",
        )?;
        count(&weights);
        let state = ctx.storage_windowed("forward state", 4 * l.state_len as u64, reduce_batch)?;
        count(&state);
        let initial_state =
            ctx.storage_windowed_from("initial state", &initial_state(p, l), reduce_batch)?;
        count(&initial_state);
        let state_u32 = ctx.storage_windowed(
            "refractory counters, spike counts and Poisson counts",
            4 * l.state_u32_len as u64,
            reduce_batch,
        )?;
        count(&state_u32);
        let masks = ctx.storage_windowed(
            "spike masks of every step",
            4 * l.masks_len as u64,
            "run.seq_len or run.batch_size",
        )?;
        count(&masks);
        let vreg = ctx.storage_windowed(
            "voltage-regularization and loss sums",
            wide.bytes() * l.vreg_len as u64,
            reduce_batch,
        )?;
        count(&vreg);
        let adj = ctx.storage_windowed("adjoint state", 4 * l.adj_len as u64, reduce_batch)?;
        count(&adj);
        let grad = ctx.storage_windowed(
            "gradient accumulators",
            wide.bytes() * (l.e_rec + l.e_in) as u64,
            "the number of edges",
        )?;
        count(&grad);
        let tape_len = l.tape_len(p.opts.gradient_checkpointing);
        let (x_step, a_step) = tape_step_bytes(l.n, l.na, b);
        let mut tapes = Vec::new();
        let mut t = 0;
        while t < tape_len {
            let s = l.tape_steps.min(tape_len - t);
            let x = ctx.storage(
                "tape (potentials)",
                x_step * s as u64,
                "run.batch_size or training.gradient_checkpointing",
            )?;
            let a = ctx.storage(
                "tape (after-spike currents)",
                a_step * s as u64,
                "run.batch_size or training.gradient_checkpointing",
            )?;
            count(&x);
            count(&a);
            tapes.push((x, a));
            t += s;
        }
        let mut boundaries = Vec::new();
        if let Some(k) = p.opts.gradient_checkpointing {
            for _ in 0..l.t.div_ceil(k.max(1)) {
                let f = ctx.storage_windowed(
                    "chunk boundary (state)",
                    4 * l.boundary_f32 as u64,
                    reduce_batch,
                )?;
                let u = ctx.storage_windowed(
                    "chunk boundary (refractory counters)",
                    4 * (l.n * b) as u64,
                    reduce_batch,
                )?;
                count(&f);
                count(&u);
                boundaries.push((f, u));
            }
        }
        let (l0, l1, l2) = layouts(ctx, l);
        let buffers: [&wgpu::Buffer; 2] = [&net_f32, &net_f64];
        let mut entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .zip(FIXED_BINDINGS)
            .map(|(buf, (binding, _))| wgpu::BindGroupEntry {
                binding,
                resource: buf.as_entire_binding(),
            })
            .collect();
        // In the order of `ArrayWindows::all`.
        let windowed = [
            &net_u32, &weights, &grad, &edges_u32, &state, &state_u32, &masks, &vreg, &adj,
        ];
        for (w, buf) in l.windows.all.iter().zip(windowed) {
            entries.extend(w.entries(buf));
        }
        let group0 = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("network and state"),
            layout: &l0,
            entries: &entries,
        });
        let tape_groups = tapes
            .iter()
            .map(|(x, a)| {
                ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("tape"),
                    layout: &l1,
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: x.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: a.as_entire_binding(),
                        },
                    ],
                })
            })
            .collect();
        let step_slots = 4 * l.t + 2 * l.d + 8;
        let steps = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("per-step uniforms"),
            size: step_slots as u64 * STEP_STRIDE,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let group2 = step_group(ctx, &l2, &steps);
        let kernels = compile_kernels(ctx, l, [&l0, &l1, &l2]);
        ctx.check()?;
        Ok(Resident {
            key,
            layout,
            kernels,
            net_f32,
            net_f64,
            weights,
            state,
            initial_state,
            state_u32,
            masks,
            vreg,
            adj,
            grad,
            steps,
            step_layout: l2,
            tape_groups,
            group0,
            group2,
            boundaries,
            device_bytes: bytes,
            step_slots,
            fixed_inputs_written: false,
            steps_written: false,
            net_u32,
        })
    }

    /// Records `calls` (each with its uniform slot) into one compute pass of `enc`.
    fn record(&self, enc: &mut wgpu::CommandEncoder, calls: &[(Call, usize)]) {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_bind_group(0, &self.group0, &[]);
        let max_x = 65_535u32;
        let mut tape_bound = usize::MAX;
        for (c, s) in calls {
            if c.groups == 0 {
                continue;
            }
            let tb = c.args.tape / self.layout.tape_steps;
            if tb != tape_bound {
                pass.set_bind_group(1, &self.tape_groups[tb], &[]);
                tape_bound = tb;
            }
            pass.set_bind_group(2, &self.group2, &[(*s as u64 * STEP_STRIDE) as u32]);
            pass.set_pipeline((c.kernel)(&self.kernels));
            let x = c.groups.min(max_x);
            pass.dispatch_workgroups(x, c.groups.div_ceil(x), 1);
        }
    }
}
