//! A shard's particles kept on the GPU between the steps of a simulation (issue 56,
//! docs/nbody.md "Forces on the GPU"): positions and velocities live in padded device
//! buffers of the shard's `capacity` (`num` valid, `num_total` over all ranks, as
//! [`Particles`] and jz-fmm's per-device arrays), the leapfrog's drift and kick run as
//! kernels (`resident.wgsl`), and a force evaluation leaves its field on the device
//! ([`DeviceField`]) for the kick.
//!
//! What crosses the bus per step: in a one-rank FMM run, whose tree is built on the device
//! from this shard (`fmm_gpu/tree.rs`), the tree's order (4 B per particle) and nodes; in a
//! sharded run or with direct sums, the positions (32 B per particle), for the exchange, the
//! host's tree or the direct sums' box. The velocities and the field cross only at outputs
//! (the energy needs them) and at the end. Kicks and drifts are recorded as they come and
//! submitted ahead of the next evaluation or read-back.
//!
//! Precision: positions and velocities are double-float pairs (hi, lo) of f32 (about 48
//! significant bits; `resident.wgsl`), so the host's f64 state is kept to about 4e-15
//! relative, and what the host reads back (hi + lo, exact in f64) is what the device holds.

use std::sync::Arc;

use lockstep_gpu::{wgpu, GpuContext, GpuError, ReadRange};

use super::pipelines::{records_group, Array, Bound, Module, RECORD_STRIDE as STEP_STRIDE};
use crate::direct::Forces;
use crate::particles::Particles;

/// The kernels' source.
const SHADER: &str = include_str!("resident.wgsl");
/// Threads per workgroup (`WG` in `resident.wgsl`).
const WG: u32 = 64;
/// Bytes of `Step` in `resident.wgsl`.
const STEP_BYTES: u64 = 64;
/// The storage arrays of `resident.wgsl` (group 0, in binding order).
const ARRAYS: [Array; 4] = [
    Array {
        name: "pos",
        ty: "vec4<f32>",
        elem: 16,
        read_only: false,
    },
    Array {
        name: "vel_or_points",
        ty: "vec4<f32>",
        elem: 16,
        read_only: false,
    },
    Array {
        name: "field_or_imported",
        ty: "vec4<f32>",
        elem: 16,
        read_only: true,
    },
    Array {
        name: "perm",
        ty: "u32",
        elem: 4,
        read_only: true,
    },
];
/// The entry points of `resident.wgsl`.
const ENTRIES: [&str; 3] = ["drift", "kick", "gather"];
/// Their indices in [`ENTRIES`].
const DRIFT: usize = 0;
const KICK: usize = 1;
const GATHER: usize = 2;
/// What shrinks the shard's buffers, for the messages of buffers too large.
const REDUCE: &str =
    "the particles per rank (run more ranks or GPUs: mpirun -n R) or capacity_factor";

/// A force evaluation's result left on the device: `(a / G, phi / G)` as (hi, lo) f32 pairs
/// per slot of the evaluation's order, and which particle of the shard each slot is.
#[derive(Debug)]
pub struct DeviceField {
    /// `[2 * slots]` vec4 of f32: (hi, lo) of (acceleration / G, potential / G).
    pub(crate) out: wgpu::Buffer,
    /// `[slots]` u32: the shard index of each slot (`>= n_local`: not a local particle).
    pub(crate) perm: wgpu::Buffer,
    /// The same on the host, for reading the field back in the shard's order.
    pub(crate) host_perm: Vec<u32>,
    /// Local particles (the shard's `num`).
    pub(crate) n_local: usize,
    /// G in code units.
    pub(crate) g: f64,
}

impl DeviceField {
    /// Slots of the evaluation (local and imported particles).
    pub fn slots(&self) -> usize {
        self.host_perm.len()
    }

    /// Reads the field back: acceleration `[n_local][3]` and potential `[n_local]` in the
    /// shard's order, `G (hi + lo)` in f64 (one submission and host synchronisation).
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn read(&self, ctx: &GpuContext) -> Result<Forces, GpuError> {
        let mut out = Forces::zeros(self.n_local);
        if self.slots() == 0 {
            return Ok(out);
        }
        let bytes = (32 * self.slots()) as u64;
        let enc = ctx.device.create_command_encoder(&Default::default());
        let range = ReadRange {
            buffer: &self.out,
            offset: 0,
            bytes,
        };
        let raw = ctx
            .submit_and_read(enc, &[range])?
            .pop()
            .expect("one range");
        let raw: Vec<[f32; 4]> = bytemuck::pod_collect_to_vec(&raw);
        for (s, &i) in self.host_perm.iter().enumerate() {
            let i = i as usize;
            if i < self.n_local {
                let (hi, lo) = (raw[2 * s], raw[2 * s + 1]);
                let v = |c: usize| self.g * (hi[c] as f64 + lo[c] as f64);
                out.acc[i] = [v(0), v(1), v(2)];
                out.pot[i] = v(3);
            }
        }
        Ok(out)
    }
}

/// One recorded kernel: a drift of every particle, or a kick by a field.
enum Op {
    Drift(f64),
    Kick(Bound, u32, f64, f64),
}

/// The words of one `Step` record of `resident.wgsl`.
fn step_words(num: usize, slots: u32, dt: f64, g: f64, origin: [f64; 3]) -> [u32; 16] {
    let [dt_hi, dt_lo] = pair(dt);
    let [g_hi, g_lo] = pair(g);
    let o = origin.map(pair);
    let mut w = [0u32; 16];
    w[0] = num as u32;
    w[1] = slots;
    // w[2] = 0: the zero `opaque` XORs with.
    w[4..8].copy_from_slice(&[dt_hi, dt_lo, g_hi, g_lo].map(f32::to_bits));
    for c in 0..3 {
        w[8 + c] = o[c][0].to_bits();
        w[12 + c] = o[c][1].to_bits();
    }
    w
}

/// A shard's positions and velocities on the device, with the drift and kick kernels.
pub struct ResidentShard {
    ctx: Arc<GpuContext>,
    /// `resident.wgsl`, compiled per count of windows of its arrays.
    module: Module,
    /// `[2 * capacity]` vec4: (hi, lo) positions, kpc.
    pos: wgpu::Buffer,
    /// `[2 * capacity]` vec4: (hi, lo) velocities, km/s.
    vel: wgpu::Buffer,
    /// The drift's bind group (no field).
    drift_group: Bound,
    capacity: usize,
    num: usize,
    num_total: u64,
    pending: Vec<Op>,
    /// An error a recorded step met ([`ResidentShard::kick`]), for the next read-back.
    failed: Option<GpuError>,
    /// Submissions and bytes read back since this shard was made (its own, not the forces').
    reads: u64,
    bytes_read: u64,
}

impl std::fmt::Debug for ResidentShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ResidentShard(num {}, capacity {}, num_total {})",
            self.num, self.capacity, self.num_total
        )
    }
}

/// A value as the (hi, lo) f32 pair of `resident.wgsl`.
fn pair(x: f64) -> [f32; 2] {
    let hi = x as f32;
    [hi, (x - hi as f64) as f32]
}

/// Vectors as (hi, lo) vec4 pairs, padded with zeros to `capacity` entries, with `w[i]`
/// (the masses) in hi's 4th component where given.
fn pairs(v: &[[f64; 3]], w: Option<&[f64]>, capacity: usize) -> Vec<[f32; 4]> {
    let mut out = vec![[0f32; 4]; 2 * capacity.max(1)];
    for (i, x) in v.iter().enumerate() {
        for c in 0..3 {
            [out[2 * i][c], out[2 * i + 1][c]] = pair(x[c]);
        }
        if let Some(w) = w {
            out[2 * i][3] = w[i] as f32;
        }
    }
    out
}

impl ResidentShard {
    /// Uploads the shard `p` (its `capacity()` slots, `num` valid) to the device of `ctx`
    /// and compiles the kernels.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] naming the buffer (positions or velocities,
    /// 32 B per slot) over the adapter's buffer limit (over a storage binding they are bound
    /// as windows); [`GpuError::Device`].
    pub fn new(ctx: &Arc<GpuContext>, p: &Particles) -> Result<ResidentShard, GpuError> {
        let capacity = p.capacity().max(p.num);
        let pos = ctx.storage_windowed_from(
            "resident particle positions",
            &pairs(&p.pos[..p.num], Some(&p.mass[..p.num]), capacity),
            REDUCE,
        )?;
        let vel = ctx.storage_windowed_from(
            "resident particle velocities",
            &pairs(&p.vel[..p.num], None, capacity),
            REDUCE,
        )?;
        let module = Module::new(ctx, "resident.wgsl", SHADER, &ARRAYS, STEP_BYTES, &ENTRIES)?;
        let none = ctx.storage("no field", 16, REDUCE)?;
        let drift_group = module.bind(ctx, "resident shard", &[&pos, &vel, &none, &none])?;
        ctx.check()?;
        Ok(ResidentShard {
            ctx: ctx.clone(),
            module,
            pos,
            vel,
            drift_group,
            capacity,
            num: p.num,
            num_total: p.num_total,
            pending: Vec::new(),
            failed: None,
            reads: 0,
            bytes_read: 0,
        })
    }

    /// Slots of the padded device arrays.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Valid particles of this shard.
    pub fn num(&self) -> usize {
        self.num
    }

    /// Valid particles over all ranks.
    pub fn num_total(&self) -> u64 {
        self.num_total
    }

    /// Read-backs of this shard (each one submission and one host synchronisation) and
    /// the bytes they moved, since it was made.
    pub fn reads(&self) -> (u64, u64) {
        (self.reads, self.bytes_read)
    }

    /// Reads `field` back in the shard's order ([`DeviceField::read`]).
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn read_field(&mut self, field: &DeviceField) -> Result<Forces, GpuError> {
        self.reads += 1;
        self.bytes_read += (32 * field.slots()) as u64;
        field.read(&self.ctx)
    }

    /// The positions buffer with every recorded step submitted before whatever the caller
    /// submits next (the device tree reads it).
    ///
    /// Errors: the error a recorded step met.
    pub(crate) fn positions(&mut self) -> Result<&wgpu::Buffer, GpuError> {
        self.take_failure()?;
        if !self.pending.is_empty() {
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            self.record(&mut enc, &self.pending_ops());
            self.ctx.queue.submit([enc.finish()]);
            self.pending.clear();
        }
        Ok(&self.pos)
    }

    /// Records `x += v dt` (kpc; `dt` in kpc/(km/s)); it runs with the next read-back.
    pub fn drift(&mut self, dt: f64) {
        self.pending.push(Op::Drift(dt));
    }

    /// Records `v += a dt` with the acceleration of `field`; it runs with the next read-back.
    /// An error binding the field (compiling the kernels for a new count of windows) is
    /// returned by the next read-back ([`ResidentShard::fetch`], [`ResidentShard::points`]).
    pub fn kick(&mut self, field: &DeviceField, dt: f64) {
        let buffers = [&self.pos, &self.vel, &field.out, &field.perm];
        match self.module.bind(&self.ctx, "resident shard", &buffers) {
            Ok(group) => self
                .pending
                .push(Op::Kick(group, field.slots() as u32, dt, field.g)),
            Err(e) => {
                self.failed.get_or_insert(e);
            }
        }
    }

    /// The error a recorded step met, once.
    fn take_failure(&mut self) -> Result<(), GpuError> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records the dispatches of `ops` `(kernel, bind group, items, step words)` in one
    /// compute pass of `enc`, each with its `Step` record.
    fn record(&self, enc: &mut wgpu::CommandEncoder, ops: &[(usize, &Bound, u32, [u32; 16])]) {
        if ops.is_empty() {
            return;
        }
        let records: Vec<&[u32]> = ops.iter().map(|op| &op.3[..]).collect();
        let label = "resident shard steps";
        let layout1 = self.module.layout1();
        let group1 = records_group(&self.ctx, layout1, label, &records, STEP_BYTES);
        let mut pass = enc.begin_compute_pass(&Default::default());
        for (k, (entry, bound, items, _)) in ops.iter().enumerate() {
            if *items == 0 {
                continue;
            }
            pass.set_pipeline(&bound.compiled.pipelines[*entry]);
            pass.set_bind_group(0, &bound.group, &[]);
            pass.set_bind_group(1, &group1, &[(k as u64 * STEP_STRIDE) as u32]);
            let groups = items.div_ceil(WG);
            let x = groups.clamp(1, 65_535);
            pass.dispatch_workgroups(x, groups.div_ceil(x), 1);
        }
    }

    /// The recorded drifts and kicks as dispatches for [`ResidentShard::record`].
    fn pending_ops(&self) -> Vec<(usize, &Bound, u32, [u32; 16])> {
        let num = self.num as u32;
        self.pending
            .iter()
            .map(|op| match op {
                Op::Drift(dt) => (
                    DRIFT,
                    &self.drift_group,
                    num,
                    step_words(self.num, 0, *dt, 0.0, [0.0; 3]),
                ),
                Op::Kick(group, slots, dt, g) => (
                    KICK,
                    group,
                    if num == 0 { 0 } else { *slots },
                    step_words(self.num, *slots, *dt, *g, [0.0; 3]),
                ),
            })
            .collect()
    }

    /// The FMM's sorted points (`fmm.wgsl`'s particle buffer: `[2 * slots]` vec4, (hi, lo)
    /// relative to `origin`, the tree's cube centre, with the mass) made on the device from
    /// the shard's positions in the order `perm` (`[slots]`, the tree's permutation; the
    /// recorded steps run first), the imported particles' points `imported` (packed so on
    /// the host, in import order) filling their slots: 4 B per particle and the imports
    /// cross the bus instead of 32 B per particle. Submitted without a wait; the evaluation's
    /// first submission follows it on the queue.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] naming the buffer; [`GpuError::Device`].
    pub fn points(
        &mut self,
        perm: &wgpu::Buffer,
        imported: &[[f32; 4]],
        origin: [f64; 3],
        slots: usize,
    ) -> Result<wgpu::Buffer, GpuError> {
        self.take_failure()?;
        let out = self.ctx.storage_windowed(
            "particles (positions and masses)",
            (32 * slots) as u64,
            REDUCE,
        )?;
        let inp = self
            .ctx
            .storage_windowed_from("imported particles", imported, REDUCE)?;
        let buffers = [&self.pos, &out, &inp, perm];
        let group = self.module.bind(&self.ctx, "resident shard", &buffers)?;
        let mut ops = self.pending_ops();
        let words = step_words(self.num, slots as u32, 0.0, 0.0, origin);
        ops.push((GATHER, &group, slots as u32, words));
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        self.record(&mut enc, &ops);
        self.ctx.queue.submit([enc.finish()]);
        self.pending.clear();
        self.ctx.check()?;
        Ok(out)
    }

    /// Runs the recorded kernels and reads back the positions (and the velocities when
    /// `velocities`) into `p` (entries `0..num`): one submission, one host synchronisation.
    ///
    /// Errors: [`GpuError::Device`], [`GpuError::Timeout`].
    pub fn fetch(&mut self, p: &mut Particles, velocities: bool) -> Result<(), GpuError> {
        self.take_failure()?;
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        self.record(&mut enc, &self.pending_ops());
        self.pending.clear();
        let bytes = (32 * self.num) as u64;
        let mut ranges = vec![ReadRange {
            buffer: &self.pos,
            offset: 0,
            bytes,
        }];
        if velocities {
            ranges.push(ReadRange {
                buffer: &self.vel,
                offset: 0,
                bytes,
            });
        }
        let raw = self.ctx.submit_and_read(enc, &ranges)?;
        self.reads += 1;
        self.bytes_read += bytes * ranges.len() as u64;
        let unpack = |raw: &[u8], out: &mut [[f64; 3]]| {
            let v: Vec<[f32; 4]> = bytemuck::pod_collect_to_vec(raw);
            for (i, x) in out.iter_mut().enumerate() {
                for c in 0..3 {
                    x[c] = v[2 * i][c] as f64 + v[2 * i + 1][c] as f64;
                }
            }
        };
        unpack(&raw[0], &mut p.pos[..self.num]);
        if velocities {
            unpack(&raw[1], &mut p.vel[..self.num]);
        }
        Ok(())
    }
}
