//! One call's plan ([`plan_passes`]): the dispatches of the forward and backward passes in
//! order, with the per-step uniform each reads, for the GPU engine to record
//! (`engine.rs`); and the compiled kernels they name ([`Kernels`]).

use lockstep_gpu::wgpu;

use crate::training::gpu::layout::Layout;

/// The kernels of one shape.
pub(super) struct Kernels {
    pub draw: wgpu::ComputePipeline,
    pub permute_weights: wgpu::ComputePipeline,
    pub deliver: wgpu::ComputePipeline,
    pub update_draw: wgpu::ComputePipeline,
    pub spmv_in: wgpu::ComputePipeline,
    pub neuron_backward: wgpu::ComputePipeline,
    pub loss_sums: wgpu::ComputePipeline,
}

/// One per-step uniform (`Step` in the shader).
#[derive(Clone, Copy)]
pub(super) struct StepArgs {
    pub t: u32,
    /// Index into the whole tape (not yet split into buffers).
    pub tape: usize,
    pub accumulate: bool,
}

/// A pass's dispatches with their uniform slots, and the chunk boundary it restores first.
pub(super) type Pass = (Option<usize>, Vec<(Call, usize)>);

/// One call's plan: the forward pass per chunk, the backward passes, the per-step uniforms.
pub(super) type Plan = (Vec<Vec<(Call, usize)>>, Vec<Pass>, Vec<StepArgs>);

/// A recorded dispatch: which kernel, how many workgroups, which step uniform.
pub(super) struct Call {
    pub kernel: fn(&Kernels) -> &wgpu::ComputePipeline,
    pub groups: u32,
    pub args: StepArgs,
}

/// The dispatches of one call: the forward pass per chunk, the backward pass per chunk (from
/// the last, with the chunk boundary it restores first when segmented), and the per-step
/// uniforms they use (one slot per dispatch, in order of use). First the weights in in-edge
/// order (`permute_weights`), then two dispatches per step
/// forward (`deliver`, `update_draw`), the loss sums after the last (`loss_sums`), and two
/// per step backward (`spmv_in`, `neuron_backward`);
/// segmented BPTT adds the recomputed chunk's forward steps and the Poisson draws of the
/// `max_delay` steps before it, trained input weights one draw per chunk.
pub(super) fn plan_passes(l: &Layout, chunk: Option<usize>) -> Plan {
    let t_len = l.t;
    let wg = l.wg;
    let forward_step = |calls: &mut Vec<Call>, args: StepArgs| {
        calls.push(Call {
            kernel: |k| &k.deliver,
            groups: wg.deliver,
            args,
        });
        calls.push(Call {
            kernel: |k| &k.update_draw,
            groups: wg.update_draw(),
            args,
        });
    };
    let draw = |t: usize| Call {
        kernel: |k| &k.draw,
        groups: wg.draw,
        args: StepArgs {
            t: t as u32,
            tape: 0,
            accumulate: false,
        },
    };
    // The forward pass, cut at chunk boundaries (their state is copied out in between).
    let bounds: Vec<usize> = match chunk {
        Some(k) => (0..t_len).step_by(k).collect(),
        None => vec![0],
    };
    let mut fwd: Vec<Vec<Call>> = Vec::new();
    for (ci, &t0) in bounds.iter().enumerate() {
        let t1 = bounds.get(ci + 1).copied().unwrap_or(t_len);
        let mut calls = Vec::new();
        if ci == 0 {
            calls.push(Call {
                kernel: |k| &k.permute_weights,
                groups: wg.permute,
                args: StepArgs {
                    t: 0,
                    tape: 0,
                    accumulate: false,
                },
            });
        }
        for t in t0..t1 {
            let args = StepArgs {
                t: t as u32,
                tape: if chunk.is_some() { t - t0 } else { t },
                accumulate: true,
            };
            forward_step(&mut calls, args);
        }
        fwd.push(calls);
    }
    // After the last step: the loss sums per sample and the rate losses' derivatives, which
    // the backward pass reads (no round trip through the host).
    if let Some(last) = fwd.last_mut() {
        last.push(Call {
            kernel: |k| &k.loss_sums,
            groups: wg.loss,
            args: StepArgs {
                t: 0,
                tape: 0,
                accumulate: false,
            },
        });
    }
    // The backward pass, chunk by chunk from the last (recomputing each when segmented).
    let mut bwd: Vec<(Option<usize>, Vec<Call>)> = Vec::new();
    for (ci, &t0) in bounds.iter().enumerate().rev() {
        let t1 = bounds.get(ci + 1).copied().unwrap_or(t_len);
        let tape_of = |t: usize| if chunk.is_some() { t - t0 } else { t };
        let mut calls = Vec::new();
        if chunk.is_some() {
            // The Poisson counts of the steps before the chunk that its arrivals read.
            for t in t0.saturating_sub(l.d)..t0 {
                calls.push(draw(t));
            }
            for t in t0..t1 {
                forward_step(
                    &mut calls,
                    StepArgs {
                        t: t as u32,
                        tape: tape_of(t),
                        accumulate: false,
                    },
                );
            }
        }
        if l.train_in && t1 > t0 {
            // The Poisson counts of the chunk's last step, which its input gradient reads
            // first (each `spmv_in` then draws the step before its own).
            calls.push(draw(t1 - 1));
        }
        let at = |t: usize| StepArgs {
            t: t as u32,
            tape: tape_of(t),
            accumulate: false,
        };
        for t in (t0..t1).rev() {
            calls.push(Call {
                kernel: |k| &k.spmv_in,
                groups: wg.spmv_in(l.train_in),
                args: at(t),
            });
            calls.push(Call {
                kernel: |k| &k.neuron_backward,
                groups: wg.neuron_backward,
                args: at(t),
            });
        }
        bwd.push((chunk.map(|_| ci), calls));
    }
    // One uniform slot per dispatch, in order of use.
    let mut steps: Vec<StepArgs> = Vec::new();
    let mut with_slots = |cs: Vec<Call>| -> Vec<(Call, usize)> {
        cs.into_iter()
            .map(|c| {
                steps.push(c.args);
                (c, steps.len() - 1)
            })
            .collect()
    };
    let fwd: Vec<Vec<(Call, usize)>> = fwd.into_iter().map(&mut with_slots).collect();
    let bwd: Vec<Pass> = bwd.into_iter().map(|(k, cs)| (k, with_slots(cs))).collect();
    (fwd, bwd, steps)
}
