//! The training state on the device ([`TrainingState`]; lockstep-train's
//! `device_state` seam, `docs/design.md` "Training state on a device"): one replica's
//! parameters, the update's gradient and the optimizer's slots in device buffers, with the
//! kernels of `training_state.wgsl` (the pass's gradient added in, Adam or SGD with the sign
//! constraint). Nothing here waits for the device except the read-backs.

use std::sync::Arc;

use lockstep_gpu::{wgpu, GpuContext};
use lockstep_train::{DeviceRule, DeviceUpdate};

use crate::error::{Result, SnnError};
use crate::training::gpu::wide_arith::Wide;
use lockstep_gpu::windows::{window_len, windows_of};

/// The kernels' source.
const SHADER: &str = include_str!("training_state.wgsl");
/// Invocations per workgroup of every kernel here.
const WORKGROUP: u32 = 256;
/// Bytes of the update's uniform (`Update` in the shader: 12 scalars).
const UPDATE_BYTES: u64 = 48;
/// Sign codes per `u32` word (2 bits each).
const SIGNS_PER_WORD: usize = 16;

/// Parameters, gradient and optimizer slots of one replica on its GPU, `[n_params]` float32
/// each (pA for the parameters), and the kernels that update them.
pub(super) struct TrainingState {
    n: usize,
    params: wgpu::Buffer,
    grad: wgpu::Buffer,
    /// Adam's `[m, v]`, or SGD's `[velocity, placeholder]`.
    slots: [wgpu::Buffer; 2],
    /// How many of `slots` the optimizer has (Adam 2, SGD 1).
    n_slots: usize,
    /// The windows the kernels run over: `(first parameter, parameters)`, each within the
    /// adapter's binding limit for float64 values (the pass's gradient).
    windows: Vec<(usize, usize)>,
    update_args: wgpu::Buffer,
    /// `[1]` u32, set by an update that leaves a parameter infinite or NaN.
    bad: wgpu::Buffer,
    /// The sign constraints, 16 two-bit codes per word.
    signs: wgpu::Buffer,
    /// Per window: the training state's bindings.
    groups: Vec<wgpu::BindGroup>,
    pass_layout: wgpu::BindGroupLayout,
    /// The type of a pass's gradient (the BPTT kernels' `grad`).
    wide: Wide,
    accumulate: wgpu::ComputePipeline,
    adam: wgpu::ComputePipeline,
    sgd: wgpu::ComputePipeline,
}

/// The sign constraints (`+1`, `-1`, `0` per parameter) packed as the shader reads them.
fn pack_signs(signs: &[i8]) -> Vec<u32> {
    let mut words = vec![0u32; signs.len().div_ceil(SIGNS_PER_WORD).max(1)];
    for (i, &s) in signs.iter().enumerate() {
        let code = match s.signum() {
            1 => 1u32,
            -1 => 2,
            _ => 0,
        };
        words[i / SIGNS_PER_WORD] |= code << (2 * (i % SIGNS_PER_WORD));
    }
    words
}

/// `bytes` of `buffer` from byte `offset`, as a binding.
fn window(buffer: &wgpu::Buffer, bytes: u64, offset: u64) -> wgpu::BindingResource<'_> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer,
        offset,
        size: wgpu::BufferSize::new(bytes),
    })
}

/// The workgroups of a kernel over `n` values, folded under 65,535 per dimension.
fn groups(n: usize) -> (u32, u32) {
    let total = (n as u32).div_ceil(WORKGROUP);
    let x = total.min(65_535);
    (x, if x == 0 { 0 } else { total.div_ceil(x) })
}

impl TrainingState {
    /// Takes `params` (`[n]`), the optimizer's `slots` (each `[n]`; Adam `[m, v]`, SGD
    /// `[velocity]`) and the parameters' sign constraints (`[n]`: +1, -1, 0) onto the device,
    /// with a zero gradient, and compiles the kernels.
    ///
    /// The BPTT kernels' pass gradient it adds in is of the wide type `wide`.
    ///
    /// Errors: more than two slots or a slot of another length ([`SnnError::Shape`]); a
    /// buffer over the adapter's limits; a device error.
    pub fn new(
        ctx: &Arc<GpuContext>,
        params: &[f32],
        slots: &[Vec<f32>],
        signs: &[i8],
        wide: Wide,
    ) -> Result<TrainingState> {
        let n = params.len();
        if slots.len() > 2 || slots.iter().any(|s| s.len() != n) || signs.len() != n {
            return Err(SnnError::Shape(format!(
                "the training state on the device takes at most 2 optimizer slots of the {n} parameters' length"
            )));
        }
        let reduce = "the number of trainable edges";
        let params_buf = ctx.storage_windowed_from("trainable parameters", params, reduce)?;
        let grad = ctx.storage_windowed("the update's gradient (f32)", 4 * n as u64, reduce)?;
        let slot = |k: usize| match slots.get(k) {
            Some(s) => ctx.storage_windowed_from("optimizer slot", s, reduce),
            None => ctx.storage("optimizer slot (unused)", 16, reduce),
        };
        let slot_bufs = [slot(0)?, slot(1)?];
        let signs_buf =
            ctx.storage_windowed_from("sign constraints", &pack_signs(signs), reduce)?;
        let bad = ctx.storage("non-finite parameter flag", 16, reduce)?;
        // Windows within the binding limit for the pass's float64 gradient (so for every
        // float32 array too), a multiple of 1,024 parameters (64 sign words) each.
        let windows = windows_of(n, window_len(8, ctx.max_storage()));
        let update_args = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("optimizer update"),
            size: UPDATE_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let storage = lockstep_gpu::windows::storage_entry;
        let mut entries: Vec<wgpu::BindGroupLayoutEntry> = [false, false, false, false, true]
            .iter()
            .enumerate()
            .map(|(b, &ro)| storage(b as u32, ro))
            .collect();
        entries.push(storage(6, false));
        entries.push(wgpu::BindGroupLayoutEntry {
            binding: 5,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: wgpu::BufferSize::new(UPDATE_BYTES),
            },
            count: None,
        });
        let state_layout = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("training state"),
                entries: &entries,
            });
        let pass_layout = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("a pass's gradient"),
                entries: &[storage(0, true)],
            });
        let groups: Vec<wgpu::BindGroup> = windows
            .iter()
            .map(|&(first, len)| {
                let f32s = |buffer| window(buffer, 4 * len as u64, 4 * first as u64);
                let slot_of = |k: usize| match slots.get(k) {
                    Some(_) => f32s(&slot_bufs[k]),
                    None => slot_bufs[k].as_entire_binding(),
                };
                let words = len.div_ceil(SIGNS_PER_WORD) as u64;
                let resources = [
                    f32s(&params_buf),
                    f32s(&grad),
                    slot_of(0),
                    slot_of(1),
                    window(&signs_buf, 4 * words, 4 * (first / SIGNS_PER_WORD) as u64),
                    update_args.as_entire_binding(),
                    bad.as_entire_binding(),
                ];
                ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("training state (a window)"),
                    layout: &state_layout,
                    entries: &resources
                        .into_iter()
                        .enumerate()
                        .map(|(b, resource)| wgpu::BindGroupEntry {
                            binding: b as u32,
                            resource,
                        })
                        .collect::<Vec<_>>(),
                })
            })
            .collect();
        let module = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("training_state.wgsl"),
                source: wgpu::ShaderSource::Wgsl(
                    format!("alias wide = {};\n{SHADER}", wide.wgsl_type()).into(),
                ),
            });
        let pipeline = |entry: &str, with_pass: bool| {
            let layouts: Vec<Option<&wgpu::BindGroupLayout>> = if with_pass {
                vec![Some(&state_layout), Some(&pass_layout)]
            } else {
                vec![Some(&state_layout)]
            };
            let pl = ctx
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(entry),
                    bind_group_layouts: &layouts,
                    immediate_size: 0,
                });
            ctx.compute_pipeline(&pl, &module, entry)
        };
        let state = TrainingState {
            n,
            accumulate: pipeline("accumulate", true),
            adam: pipeline("adam", false),
            sgd: pipeline("sgd", false),
            params: params_buf,
            grad,
            slots: slot_bufs,
            n_slots: slots.len(),
            windows,
            update_args,
            bad,
            signs: signs_buf,
            groups,
            pass_layout,
            wide,
        };
        ctx.check()?;
        Ok(state)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.n
    }

    /// The parameters' buffer (`[n]` float32, pA).
    pub fn params(&self) -> &wgpu::Buffer {
        &self.params
    }

    /// Records into `enc` the kernel that adds a pass's mean gradient (`pass_grad`, the BPTT
    /// kernels' wide accumulators; its first `n` values) into the update's gradient, one
    /// dispatch per window. Returns the launches recorded.
    pub fn record_accumulate(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        pass_grad: &wgpu::Buffer,
    ) -> u64 {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&self.accumulate);
        for (&(first, len), group) in self.windows.iter().zip(&self.groups) {
            let pass_group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("a pass's gradient (a window)"),
                layout: &self.pass_layout,
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: pass_grad,
                        offset: self.wide.bytes() * first as u64,
                        size: wgpu::BufferSize::new(self.wide.bytes() * len as u64),
                    }),
                }],
            });
            let (x, y) = groups(len);
            pass.set_bind_group(0, group, &[]);
            pass.set_bind_group(1, &pass_group, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        self.windows.len() as u64
    }

    /// Reads the parameters into `params` and the slots into `slots` (lengths as uploaded):
    /// one submission and one wait.
    ///
    /// Errors: lengths other than uploaded ([`SnnError::Shape`]); the device's.
    pub fn download(
        &self,
        ctx: &GpuContext,
        params: &mut [f32],
        slots: &mut [Vec<f32>],
    ) -> Result<()> {
        if params.len() != self.n
            || slots.len() != self.n_slots
            || slots.iter().any(|s| s.len() != self.n)
        {
            return Err(SnnError::Shape(
                "the host's parameters or optimizer slots are not the device's shape".into(),
            ));
        }
        // One array at a time: the read-back buffer grows to the largest, not to their sum.
        params.copy_from_slice(&ctx.read::<f32>(&self.params, 0, self.n)?);
        for (s, b) in slots.iter_mut().zip(&self.slots) {
            s.copy_from_slice(&ctx.read::<f32>(b, 0, self.n)?);
        }
        Ok(())
    }

    /// The flag an update sets when it leaves a parameter infinite or NaN (`[1]` u32; 16
    /// bytes), for reading with a pass's loss sums.
    pub fn bad_flag(&self) -> &wgpu::Buffer {
        &self.bad
    }

    /// The first parameter that is infinite or NaN, as the error that reports it (one
    /// read-back of the parameters); `None` when all are finite.
    ///
    /// Errors: the device's.
    pub fn non_finite(&self, ctx: &GpuContext) -> Result<Option<SnnError>> {
        let p: Vec<f32> = ctx.read(&self.params, 0, self.n)?;
        Ok(p.iter()
            .position(|x| !x.is_finite())
            .map(|index| SnnError::NonFiniteParameter {
                index,
                value: p[index],
            }))
    }

    /// Device bytes of the training state's buffers.
    pub fn device_bytes(&self) -> u64 {
        [&self.params, &self.grad, &self.slots[0], &self.slots[1]]
            .iter()
            .map(|b| b.size())
            .sum::<u64>()
            + self.bad.size()
            + self.signs.size()
    }

    /// Reads the update's gradient (`[n]` float32) into `grad`: one submission and one wait.
    ///
    /// Errors: `grad` of another length ([`SnnError::Shape`]); the device's.
    pub fn read_gradient(&self, ctx: &GpuContext, grad: &mut [f32]) -> Result<()> {
        if grad.len() != self.n {
            return Err(SnnError::Shape(format!(
                "a gradient of {} values for {} parameters",
                grad.len(),
                self.n
            )));
        }
        let g: Vec<f32> = ctx.read(&self.grad, 0, self.n)?;
        grad.copy_from_slice(&g);
        Ok(())
    }

    /// Ends the update in one submission the host does not wait for: `reduced` (the host's
    /// reduced gradient, `[n]`) replaces the device's first when given; `Some(update)` then
    /// applies the optimizer and the sign constraint; either way the gradient is zeroed for
    /// the next update. Returns the launches recorded (one per window with an update).
    ///
    /// Errors: `reduced` of another length, or an update rule the slots do not fit
    /// ([`SnnError::Shape`]).
    pub fn finish_update(
        &self,
        ctx: &GpuContext,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> Result<u64> {
        if let Some(r) = reduced {
            if r.len() != self.n {
                return Err(SnnError::Shape(format!(
                    "a reduced gradient of {} values for {} parameters",
                    r.len(),
                    self.n
                )));
            }
            ctx.write(&self.grad, 0, r);
        }
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let mut launches = 0;
        if let Some(u) = update {
            let (kernel, args, slots) = match u.rule {
                DeviceRule::Adam {
                    beta1,
                    one_minus_beta1,
                    beta2,
                    one_minus_beta2,
                    epsilon,
                    keep,
                    c1,
                    c2,
                } => (
                    &self.adam,
                    [
                        keep,
                        beta1,
                        one_minus_beta1,
                        beta2,
                        one_minus_beta2,
                        epsilon,
                        c1,
                        c2,
                        0.0,
                    ],
                    2,
                ),
                DeviceRule::Sgd { momentum } => (
                    &self.sgd,
                    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, momentum],
                    1,
                ),
            };
            if slots != self.n_slots {
                return Err(SnnError::Shape(format!(
                    "the update needs {slots} optimizer slot(s); {} were uploaded",
                    self.n_slots
                )));
            }
            let mut words = vec![u.learning_rate, u.grad_factor, u.unscale];
            words.extend_from_slice(&args);
            ctx.write(&self.update_args, 0, &words);
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(kernel);
            for (&(_, len), group) in self.windows.iter().zip(&self.groups) {
                let (x, y) = groups(len);
                pass.set_bind_group(0, group, &[]);
                pass.dispatch_workgroups(x, y, 1);
                launches += 1;
            }
        }
        enc.clear_buffer(&self.grad, 0, None);
        ctx.submit(enc.finish());
        Ok(launches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_pack_two_bits_each_sixteen_to_a_word() {
        let signs: Vec<i8> = (0..35).map(|i| [1i8, -1, 0][i % 3]).collect();
        let words = pack_signs(&signs);
        assert_eq!(words.len(), 3);
        for (i, &s) in signs.iter().enumerate() {
            let code = (words[i / 16] >> (2 * (i % 16))) & 3;
            let want = match s {
                1 => 1,
                -1 => 2,
                _ => 0,
            };
            assert_eq!(code, want, "parameter {i}");
        }
        assert_eq!(pack_signs(&[]), vec![0]);
    }

    #[test]
    fn workgroups_fold_under_the_dimension_limit() {
        assert_eq!(groups(0), (0, 0));
        assert_eq!(groups(1), (1, 1));
        assert_eq!(groups(256 * 65_535), (65_535, 1));
        let (x, y) = groups(24_450_000);
        assert!(x <= 65_535 && x as u64 * y as u64 * 256 >= 24_450_000);
    }
}
