//! Gravity on a GPU (`forces.device: "gpu"`, docs/nbody.md "Forces on the GPU"): the FMM
//! force evaluation and direct summation as WGSL kernels (`fmm.wgsl`) on the device layer
//! of `lockstep-gpu` (wgpu; lavapipe in CI).
//!
//! What runs where:
//!
//! - **Host** (rayon, as the CPU path): the Morton tree (`Fmm::build_tree_nodes`) and the
//!   dual tree walk's interaction lists (`Fmm::walk_lists`), flattened into compressed
//!   rows. Both are branchy, pointer-chasing work a GPU does poorly and that costs a small
//!   share of a CPU evaluation (tree about 5%, walk about 10% at N = 1e6); the lists are
//!   O(N) integers, so uploading them is cheaper than building them on the device would be
//!   to write. The host also does the locally essential tree exchange of sharded runs (MPI).
//! - **Device**, in four submissions per evaluation: P2M at the leaves and M2M level by
//!   level (one dispatch per level); M2L (one thread per target node over its whole list)
//!   and L2L level by level; P2P (one workgroup per target leaf, the sources of each node
//!   of its list staged 64 at a time in workgroup memory); L2P and M2P per particle, then
//!   the copy of the results into a read-back buffer.
//!
//! Precision: f32 arithmetic only (no `SHADER_F64` needed). Points are (hi, lo) pairs of f32
//! relative to the tree's cube centre, so differences of nearby points keep about 1e-7 of
//! their own size; derivative tensors are evaluated at a power-of-two-scaled separation; sums
//! over sources are compensated (hi, lo) accumulators. No atomics: every sum runs in a fixed
//! order, so two runs give the same bits. The accelerations agree with the CPU FMM's to
//! about 1e-6 relative (`tests/nbody_gpu.rs`) at orders 1..=3; higher orders are refused
//! ([`MAX_ORDER`]).
//!
//! Limits: workgroup counts above 65,535 go to a second dispatch dimension; every buffer is
//! checked against the adapter's storage-binding limit and a buffer over it is refused,
//! naming it (more ranks or GPUs split the particles); every wait on the device has a
//! timeout ([`GPU_TIMEOUT`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_gpu::{wgpu, DeviceRequest, GpuContext, GpuError, Selected};

use crate::direct::Forces;
use crate::fmm::{Fmm, FmmStats, ForceDevice, PhaseSeconds, SourceSet};
use crate::NbodyError;

/// The kernels' source.
const SHADER: &str = include_str!("fmm.wgsl");
/// Threads per workgroup of every kernel (`WG` in `fmm.wgsl`).
const WG: u32 = 64;
/// Bytes of one dispatch's parameter record in the uniform buffer (the dynamic-offset
/// alignment wgpu guarantees).
const PARAM_STRIDE: u64 = 256;
/// Bytes of the `Params` struct of `fmm.wgsl` (32 words).
const PARAM_BYTES: u64 = 128;
/// Longest wait for one submission or read-back; a device that has not finished by then
/// is reported as hung, naming the phase.
pub const GPU_TIMEOUT: Duration = Duration::from_secs(300);
/// The highest expansion order the GPU FMM accepts. Orders 4..=6 disagree with the CPU FMM
/// on lavapipe once the M2L lists grow long (Plummer spheres of a few thousand particles at
/// theta 0.6-0.9: errors of order 1 on a tenth of the particles, not yet understood), so they
/// are refused, naming `forces.order`, instead of giving wrong forces.
pub const MAX_ORDER: usize = 3;

/// The error of an FMM order the GPU path does not run ([`MAX_ORDER`]).
pub fn order_error(order: usize) -> NbodyError {
    NbodyError::param(
        "forces.order",
        order,
        &format!(
            "the FMM on the GPU (forces.device: \"gpu\") runs orders 1..={MAX_ORDER} for now (higher orders disagree with the CPU FMM and are refused); set forces.order <= {MAX_ORDER} or forces.device: \"cpu\""
        ),
    )
}

/// The error of `forces.method: "fmm"` with `forces.device: "gpu"` in a config: the GPU FMM
/// ([`GpuForces`] through [`Fmm::on_device`]) agrees with the CPU FMM on a few thousand
/// particles but not beyond (Plummer N = 20,000 at p = 3: median error 0.45 against direct
/// sums; a known defect of issue 56), so runs refuse it rather than compute wrong forces.
pub fn fmm_refused() -> NbodyError {
    NbodyError::param(
        "forces.method",
        "\"fmm\" with forces.device \"gpu\"",
        "the FMM on the GPU is not enabled for runs yet (it disagrees with the CPU FMM beyond a few thousand particles); use forces.method: \"direct\" on the GPU or forces.device: \"cpu\" for the FMM",
    )
}

/// What shrinks the buffers of one evaluation, for the messages of buffers too large.
const REDUCE: &str = "the particles per rank (run more ranks or GPUs: mpirun -n R) or forces.order";

/// Host-side split of the last evaluation on the device (seconds and bytes), for the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuSplit {
    /// Tree build on the host.
    pub tree: f64,
    /// Dual tree walk and the flattened lists on the host.
    pub lists: f64,
    /// Packing and uploading positions, centres, lists and tables (host to device).
    pub upload: f64,
    /// P2M and M2M on the device.
    pub upward: f64,
    /// M2L and L2L on the device.
    pub m2l: f64,
    /// P2P on the device.
    pub p2p: f64,
    /// L2P and M2P on the device.
    pub far: f64,
    /// Read-back of the results and their unsorting (device to host).
    pub download: f64,
    /// Bytes uploaded.
    pub bytes_up: u64,
    /// Bytes read back.
    pub bytes_down: u64,
}

impl GpuSplit {
    /// Sum of the phases.
    pub fn total(&self) -> f64 {
        self.tree
            + self.lists
            + self.upload
            + self.upward
            + self.m2l
            + self.p2p
            + self.far
            + self.download
    }
}

struct Kernels {
    p2m: wgpu::ComputePipeline,
    m2m: wgpu::ComputePipeline,
    m2l: wgpu::ComputePipeline,
    l2l: wgpu::ComputePipeline,
    p2p: wgpu::ComputePipeline,
    far: wgpu::ComputePipeline,
    direct: wgpu::ComputePipeline,
}

/// Gravity on one GPU adapter: the compiled kernels on the process's shared device
/// ([`GpuContext::open`]). Implements [`ForceDevice`] for [`Fmm::on_device`].
pub struct GpuForces {
    ctx: Arc<GpuContext>,
    selected: Selected,
    kernels: Kernels,
    layout0: wgpu::BindGroupLayout,
    layout1: wgpu::BindGroupLayout,
    last: Mutex<GpuSplit>,
}

impl std::fmt::Debug for GpuForces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuForces({})", self.describe())
    }
}

/// A device-layer error as an N-body error: its message with the N-body's key
/// (`forces.device`) where the device layer names the training key.
fn gpu_error(e: GpuError) -> NbodyError {
    NbodyError::Gpu(e.to_string().replace("run.device", "forces.device"))
}

/// The slot a process binds its GPU by: the node-local rank under a launcher (mpirun,
/// srun), else `fallback` (the rank of thread ranks in one process).
pub fn device_slot(fallback: usize) -> usize {
    lockstep_comm::launch::detect_launch().map_or(fallback, |l| l.local_rank)
}

/// The device of `request` for a process in `slot` ([`device_slot`]): None for
/// `"cpu"`, the GPU's kernels for `"gpu"` / `"gpu:N"` (the adapter selection of
/// `run.device`: the node-local rank's adapter among those `CUDA_VISIBLE_DEVICES` leaves,
/// wrapping and shared when there are more ranks than adapters).
///
/// Errors: [`NbodyError::Gpu`] (no adapter, no such adapter, the device refused).
pub fn open_device(
    request: DeviceRequest,
    slot: usize,
) -> Result<Option<Arc<dyn ForceDevice>>, NbodyError> {
    match request {
        DeviceRequest::Cpu => Ok(None),
        DeviceRequest::Gpu(index) => Ok(Some(Arc::new(GpuForces::open(index, slot)?))),
    }
}

impl GpuForces {
    /// Opens adapter `index` (`gpu:N`), or the adapter of `slot` (`gpu`), and compiles the
    /// kernels.
    ///
    /// Errors: [`NbodyError::Gpu`].
    pub fn open(index: Option<usize>, slot: usize) -> Result<GpuForces, NbodyError> {
        let all = lockstep_gpu::process_adapters();
        let cuda = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let selected =
            lockstep_gpu::select_adapter(&all, index, slot, cuda.as_deref()).map_err(gpu_error)?;
        let ctx = GpuContext::open(selected.adapter.index).map_err(gpu_error)?;
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = (0..8).map(|b| storage(b, b < 5)).collect();
        let layout0 = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("nbody buffers"),
                entries: &entries,
            });
        let layout1 = ctx
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("nbody dispatch parameters"),
                entries: &[wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(PARAM_BYTES),
                    },
                    count: None,
                }],
            });
        let module = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("fmm.wgsl"),
                source: wgpu::ShaderSource::Wgsl(SHADER.into()),
            });
        let pl = ctx
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("nbody"),
                bind_group_layouts: &[Some(&layout0), Some(&layout1)],
                immediate_size: 0,
            });
        let kernel = |entry: &str| {
            ctx.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                })
        };
        let kernels = Kernels {
            p2m: kernel("p2m"),
            m2m: kernel("m2m"),
            m2l: kernel("m2l"),
            l2l: kernel("l2l"),
            p2p: kernel("p2p"),
            far: kernel("far"),
            direct: kernel("direct"),
        };
        ctx.check().map_err(gpu_error)?;
        Ok(GpuForces {
            ctx,
            selected,
            kernels,
            layout0,
            layout1,
            last: Mutex::new(GpuSplit::default()),
        })
    }

    /// The adapter this engine computes on.
    pub fn selected(&self) -> &Selected {
        &self.selected
    }

    /// The device context.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// The split of the last evaluation (host tree and lists, transfers, kernels).
    pub fn last_split(&self) -> GpuSplit {
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, what: &str, message: impl std::fmt::Display) -> NbodyError {
        NbodyError::Gpu(format!(
            "GPU adapter [{}] {:?}, {what}: {message}",
            self.selected.adapter.index, self.selected.adapter.name
        ))
    }

    /// Submits `enc` and waits at most [`GPU_TIMEOUT`] for it; device errors and the
    /// timeout name `what`.
    fn run(&self, enc: wgpu::CommandEncoder, what: &str) -> Result<(), NbodyError> {
        let index = self.ctx.queue.submit([enc.finish()]);
        self.ctx
            .device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: Some(GPU_TIMEOUT),
            })
            .map_err(|e| {
                self.err(
                    what,
                    format!("{e} (waited at most {} s)", GPU_TIMEOUT.as_secs()),
                )
            })?;
        self.ctx.check().map_err(gpu_error)
    }

    /// Maps `staging` (already filled by a finished submission) and reads `len` vec4s.
    fn read(&self, staging: &wgpu::Buffer, len: usize) -> Result<Vec<[f32; 4]>, NbodyError> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.ctx
            .device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: Some(GPU_TIMEOUT),
            })
            .map_err(|e| self.err("reading the forces back", e))?;
        match rx.recv_timeout(GPU_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.err("reading the forces back", e)),
            Err(e) => return Err(self.err("reading the forces back", e)),
        }
        let out = {
            let view = staging.get_mapped_range(..);
            bytemuck::pod_collect_to_vec::<u8, [f32; 4]>(&view[..len * 16])
        };
        staging.unmap();
        Ok(out)
    }

    fn staging(&self, bytes: u64) -> wgpu::Buffer {
        self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("nbody read-back"),
            size: bytes.max(16),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    fn bind0(&self, buffers: [&wgpu::Buffer; 8]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        self.ctx
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("nbody buffers"),
                layout: &self.layout0,
                entries: &entries,
            })
    }

    /// The uniform buffer of the dispatch records `params` and its bind group.
    fn params_group(&self, params: &[Params]) -> wgpu::BindGroup {
        let mut bytes = vec![0u8; params.len().max(1) * PARAM_STRIDE as usize];
        for (k, p) in params.iter().enumerate() {
            let at = k * PARAM_STRIDE as usize;
            bytes[at..at + PARAM_BYTES as usize].copy_from_slice(bytemuck::cast_slice(&p.0));
        }
        let buf = wgpu::util::DeviceExt::create_buffer_init(
            &self.ctx.device,
            &wgpu::util::BufferInitDescriptor {
                label: Some("nbody dispatch parameters"),
                contents: &bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            },
        );
        self.ctx
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("nbody dispatch parameters"),
                layout: &self.layout1,
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &buf,
                        offset: 0,
                        size: wgpu::BufferSize::new(PARAM_BYTES),
                    }),
                }],
            })
    }

    fn storage<T: bytemuck::Pod>(
        &self,
        name: &str,
        data: &[T],
    ) -> Result<wgpu::Buffer, NbodyError> {
        self.ctx.storage_from(name, data, REDUCE).map_err(gpu_error)
    }
}

/// One dispatch's `Params` record of `fmm.wgsl` (32 words; floats as bits).
#[derive(Debug, Clone, Copy)]
struct Params([u32; 32]);

/// Word positions in [`Params`], as `fmm.wgsl` declares them.
mod w {
    pub const FIRST: usize = 0;
    pub const COUNT: usize = 1;
    pub const N_ALL: usize = 2;
    pub const NN: usize = 3;
    pub const NT: usize = 4;
    pub const P: usize = 5;
    pub const NGRAD: usize = 6;
    pub const EPS2: usize = 7;
    pub const R2MIN: usize = 8;
    pub const O_PARENT: usize = 9;
    pub const O_AXIS: usize = 10;
    pub const O_DEGREE: usize = 11;
    pub const O_SHIFT: usize = 12;
    pub const N_SHIFT: usize = 13;
    pub const O_DREST: usize = 14;
    pub const O_DJ: usize = 15;
    pub const O_DROW: usize = 16;
    pub const O_ROWS: usize = 17;
    pub const O_RSTART: usize = 18;
    pub const O_GRAD: usize = 19;
    pub const O_P2P_OFF: usize = 20;
    pub const O_P2P_ITEMS: usize = 21;
    pub const O_M2L_OFF: usize = 22;
    pub const O_M2L_ITEMS: usize = 23;
    pub const O_M2P_OFF: usize = 24;
    pub const O_M2P_ITEMS: usize = 25;
    pub const O_LEAFOF: usize = 26;
    pub const O_LIST: usize = 27;
    pub const F_INV: usize = 28;
    pub const F_DC: usize = 29;
    pub const F_SIGN: usize = 30;
    pub const TARGET0: usize = 31;
}

impl Params {
    fn with(&self, first: usize, count: usize, list: u32) -> Params {
        let mut p = *self;
        p.0[w::FIRST] = first as u32;
        p.0[w::COUNT] = count as u32;
        p.0[w::O_LIST] = list;
        p
    }
}

/// Appends `v` to `buf`, returning its offset.
fn push(buf: &mut Vec<u32>, v: &[u32]) -> u32 {
    let at = buf.len() as u32;
    buf.extend_from_slice(v);
    at
}

fn pushf(buf: &mut Vec<f32>, v: &[f64]) -> u32 {
    let at = buf.len() as u32;
    buf.extend(v.iter().map(|&x| x as f32));
    at
}

/// A point relative to `origin` as the (hi, lo) f32 pair of `fmm.wgsl`, the 4th component
/// of hi set to `w`.
fn split(x: [f64; 3], origin: [f64; 3], w: f64) -> [[f32; 4]; 2] {
    let mut hi = [0f32; 4];
    let mut lo = [0f32; 4];
    for c in 0..3 {
        let d = x[c] - origin[c];
        hi[c] = d as f32;
        lo[c] = (d - hi[c] as f64) as f32;
    }
    hi[3] = w as f32;
    [hi, lo]
}

/// Workgroups for `groups` in two dimensions (at most 65,535 in x).
fn grid(groups: u32) -> (u32, u32) {
    let x = groups.clamp(1, 65_535);
    (x, groups.div_ceil(x).max(1))
}

fn dispatch(
    pass: &mut wgpu::ComputePass,
    pipeline: &wgpu::ComputePipeline,
    group1: &wgpu::BindGroup,
    slot: usize,
    groups: u32,
) {
    if groups == 0 {
        return;
    }
    pass.set_pipeline(pipeline);
    pass.set_bind_group(1, group1, &[(slot as u64 * PARAM_STRIDE) as u32]);
    let (x, y) = grid(groups);
    pass.dispatch_workgroups(x, y, 1);
}

/// Smallest squared separation the kernels use, relative to the squared cube side: pairs
/// closer than `1e-10` of the side count as that far apart (finite `m / r^3` in f32), as
/// the CPU's f32 near field does relative to its source extent.
const R2MIN_REL: f64 = 1e-20;

impl ForceDevice for GpuForces {
    fn fmm_forces(
        &self,
        fmm: &Fmm,
        sources: &SourceSet,
        g: f64,
        softening: f64,
    ) -> Result<(Forces, FmmStats), NbodyError> {
        if fmm.params().order > MAX_ORDER {
            return Err(order_error(fmm.params().order));
        }
        let n_local = sources.pos.len();
        let mut split_t = GpuSplit::default();
        let clock = Instant::now();
        let tree = fmm.build_tree_nodes(sources);
        split_t.tree = clock.elapsed().as_secs_f64();
        let clock = Instant::now();
        let lists = fmm.walk_lists(&tree, sources.remote_cells);
        split_t.lists = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        let tables = fmm.tables();
        let ft = tables.flat();
        let nt = tables.nterms;
        let nn = tree.nodes.len();
        let n_all = tree.perm.len();
        let remote = sources.remote_cells;
        let origin = [
            tree.lo[0] + 0.5 * tree.side,
            tree.lo[1] + 0.5 * tree.side,
            tree.lo[2] + 0.5 * tree.side,
        ];
        let soa = &tree.soa;
        let pts: Vec<[f32; 4]> = (0..n_all)
            .flat_map(|s| split(soa.point(s), origin, soa.m[s]))
            .collect();
        let cen: Vec<[f32; 4]> = tree
            .nodes
            .iter()
            .map(|n| n.center)
            .chain(remote.iter().map(|c| c.center))
            .flat_map(|c| split(c, origin, 0.0))
            .collect();
        let nodes: Vec<[u32; 4]> = tree
            .nodes
            .iter()
            .flat_map(|n| {
                [
                    [
                        n.start as u32,
                        n.end as u32,
                        n.first_child as u32,
                        n.nchild as u32,
                    ],
                    [n.parent as u32, n.ntargets as u32, n.level as u32, 0],
                ]
            })
            .collect();
        let mut leaf_of = vec![0u32; n_all];
        let mut leaves = Vec::new();
        for (k, n) in tree.nodes.iter().enumerate() {
            if n.is_leaf() {
                leaves.push(k as u32);
                for s in n.start..n.end {
                    leaf_of[s] = k as u32;
                }
            }
        }
        let p2p_targets: Vec<u32> = (0..nn as u32)
            .filter(|&a| lists.p2p.0[a as usize + 1] > lists.p2p.0[a as usize])
            .collect();
        let mut u = Vec::new();
        let mut f = Vec::new();
        let mut base = Params([0; 32]);
        {
            let b = &mut base.0;
            b[w::N_ALL] = n_all as u32;
            b[w::NN] = nn as u32;
            b[w::NT] = nt as u32;
            b[w::P] = tables.p as u32;
            b[w::NGRAD] = (ft.grad.len() / 3) as u32;
            b[w::EPS2] = ((softening * softening) as f32).to_bits();
            b[w::R2MIN] = ((R2MIN_REL * tree.side * tree.side) as f32)
                .max(f32::MIN_POSITIVE)
                .to_bits();
            b[w::O_PARENT] = push(&mut u, &ft.parent);
            b[w::O_AXIS] = push(&mut u, &ft.axis);
            b[w::O_DEGREE] = push(&mut u, &ft.degree);
            b[w::O_SHIFT] = push(&mut u, &ft.shift);
            b[w::N_SHIFT] = (ft.shift.len() / 3) as u32;
            b[w::O_DREST] = push(&mut u, &ft.deriv_rest);
            b[w::O_DJ] = push(&mut u, &ft.deriv_j);
            b[w::O_DROW] = push(&mut u, &ft.deriv_rows);
            b[w::O_ROWS] = push(&mut u, &ft.rows);
            b[w::O_RSTART] = push(&mut u, &ft.row_start);
            b[w::O_GRAD] = push(&mut u, &ft.grad);
            b[w::O_P2P_OFF] = push(&mut u, &lists.p2p.0);
            b[w::O_P2P_ITEMS] = push(&mut u, &lists.p2p.1);
            b[w::O_M2L_OFF] = push(&mut u, &lists.m2l.0);
            b[w::O_M2L_ITEMS] = push(&mut u, &lists.m2l.1);
            b[w::O_M2P_OFF] = push(&mut u, &lists.m2p.0);
            b[w::O_M2P_ITEMS] = push(&mut u, &lists.m2p.1);
            b[w::O_LEAFOF] = push(&mut u, &leaf_of);
            b[w::F_INV] = pushf(&mut f, &ft.inv_step);
            b[w::F_DC] = pushf(&mut f, &ft.deriv_c);
            b[w::F_SIGN] = pushf(&mut f, &ft.sign);
        }
        let o_leaves = push(&mut u, &leaves);
        let o_targets = push(&mut u, &p2p_targets);
        let mut mp0 = vec![0f32; (nn + remote.len()) * nt];
        for (k, c) in remote.iter().enumerate() {
            for (o, &v) in mp0[(nn + k) * nt..(nn + k + 1) * nt]
                .iter_mut()
                .zip(&c.multipole)
            {
                *o = v as f32;
            }
        }
        // The dispatch records, in the order of the submissions below.
        let levels = tree.level_start.len() - 1;
        let mut params = vec![base.with(0, leaves.len(), o_leaves)];
        for l in (0..levels).rev() {
            let (a, b) = (tree.level_start[l], tree.level_start[l + 1]);
            params.push(base.with(a, b - a, 0));
        }
        let m2l_slot = params.len();
        params.push(base.with(0, nn, 0));
        let l2l_slot = params.len();
        for l in 1..levels {
            let (a, b) = (tree.level_start[l], tree.level_start[l + 1]);
            params.push(base.with(a, b - a, 0));
        }
        let p2p_slot = params.len();
        params.push(base.with(0, p2p_targets.len(), o_targets));
        let far_slot = params.len();
        params.push(base.with(0, n_all, 0));

        let b_pts = self.storage("particles (positions and masses)", &pts)?;
        let b_cen = self.storage("node and imported cell centres", &cen)?;
        let b_nodes = self.storage("tree nodes", &nodes)?;
        let b_lists = self.storage("interaction lists and index tables", &u)?;
        let b_tabf = self.storage("expansion coefficient tables", &f)?;
        let b_mp = self.storage("multipoles", &mp0)?;
        let out_bytes = (2 * n_all * 16) as u64;
        let b_loc = self
            .ctx
            .storage("local expansions", (nn * nt * 4) as u64, REDUCE)
            .map_err(gpu_error)?;
        let b_out = self
            .ctx
            .storage("particle fields", out_bytes, REDUCE)
            .map_err(gpu_error)?;
        let staging = self.staging(out_bytes);
        let group0 = self.bind0([
            &b_pts, &b_cen, &b_nodes, &b_lists, &b_tabf, &b_mp, &b_loc, &b_out,
        ]);
        let group1 = self.params_group(&params);
        split_t.bytes_up = 4
            * (pts.len() * 4 + cen.len() * 4 + nodes.len() * 4 + u.len() + f.len() + mp0.len())
                as u64;
        split_t.bytes_down = out_bytes;
        split_t.upload = clock.elapsed().as_secs_f64();

        let k = &self.kernels;
        let groups = |n: usize| (n as u32).div_ceil(WG);
        let phase = |record: &dyn Fn(&mut wgpu::ComputePass), copy: bool, what: &str| {
            let clock = Instant::now();
            let mut enc = self.ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_bind_group(0, &group0, &[]);
                record(&mut pass);
            }
            if copy {
                enc.copy_buffer_to_buffer(&b_out, 0, &staging, 0, out_bytes.max(16));
            }
            self.run(enc, what).map(|_| clock.elapsed().as_secs_f64())
        };
        split_t.upward = phase(
            &|pass| {
                dispatch(pass, &k.p2m, &group1, 0, groups(leaves.len()));
                for (s, l) in (0..levels).rev().enumerate() {
                    let count = tree.level_start[l + 1] - tree.level_start[l];
                    dispatch(pass, &k.m2m, &group1, 1 + s, groups(count));
                }
            },
            false,
            "the upward pass (P2M, M2M)",
        )?;
        split_t.m2l = phase(
            &|pass| {
                dispatch(pass, &k.m2l, &group1, m2l_slot, groups(nn));
                for (s, l) in (1..levels).enumerate() {
                    let count = tree.level_start[l + 1] - tree.level_start[l];
                    dispatch(pass, &k.l2l, &group1, l2l_slot + s, groups(count));
                }
            },
            false,
            "the far field (M2L, L2L)",
        )?;
        split_t.p2p = phase(
            &|pass| dispatch(pass, &k.p2p, &group1, p2p_slot, p2p_targets.len() as u32),
            false,
            "the near field (P2P)",
        )?;
        split_t.far = phase(
            &|pass| dispatch(pass, &k.far, &group1, far_slot, groups(n_all)),
            true,
            "the far field at the particles (L2P, M2P)",
        )?;
        let clock = Instant::now();
        let raw = self.read(&staging, 2 * n_all)?;
        let mut out = Forces::zeros(n_local);
        for (s, &i) in tree.perm.iter().enumerate() {
            if i < n_local {
                let (hi, lo) = (raw[2 * s], raw[2 * s + 1]);
                let v = |c: usize| g * (hi[c] as f64 + lo[c] as f64);
                out.acc[i] = [v(0), v(1), v(2)];
                out.pot[i] = v(3);
            }
        }
        split_t.download = clock.elapsed().as_secs_f64();
        let stats = FmmStats {
            nodes: nn,
            depth: tree.depth(),
            m2l: lists.m2l.1.len(),
            m2p: lists.m2p.1.len(),
            p2p_blocks: lists.p2p.1.len(),
            p2p_pairs: lists.p2p_pairs,
            forced_m2l: lists.forced,
            seconds: PhaseSeconds {
                tree: split_t.tree,
                traversal: split_t.lists + split_t.upload,
                upward: split_t.upward,
                m2l: split_t.m2l,
                l2l: 0.0,
                l2p: split_t.far + split_t.download,
                m2p: 0.0,
                p2p: split_t.p2p,
            },
        };
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = split_t;
        Ok((out, stats))
    }

    fn direct_forces(
        &self,
        targets: &[[f64; 3]],
        offset: Option<usize>,
        pos: &[[f64; 3]],
        mass: &[f64],
        g: f64,
        softening: f64,
    ) -> Result<Forces, NbodyError> {
        let n = targets.len();
        if n == 0 {
            return Ok(Forces::zeros(0));
        }
        let clock = Instant::now();
        let (lo, side) =
            crate::fmm::tree::bounding_cube(if pos.is_empty() { targets } else { pos });
        let origin = [lo[0] + 0.5 * side, lo[1] + 0.5 * side, lo[2] + 0.5 * side];
        let mut pts: Vec<[f32; 4]> = pos
            .iter()
            .zip(mass)
            .flat_map(|(&x, &m)| split(x, origin, m))
            .collect();
        // Targets that are not sources follow the sources (never matched as themselves).
        let target0 = match offset {
            Some(o) => o,
            None => {
                pts.extend(targets.iter().flat_map(|&x| split(x, origin, 0.0)));
                pos.len()
            }
        };
        let mut base = Params([0; 32]);
        base.0[w::N_ALL] = pos.len() as u32;
        base.0[w::COUNT] = n as u32;
        base.0[w::TARGET0] = target0 as u32;
        base.0[w::EPS2] = ((softening * softening) as f32).to_bits();
        base.0[w::R2MIN] = ((R2MIN_REL * side * side) as f32)
            .max(f32::MIN_POSITIVE)
            .to_bits();
        let b_pts = self.storage("particles (positions and masses)", &pts)?;
        let unused = |name| self.ctx.storage(name, 16, REDUCE).map_err(gpu_error);
        let (dummy, d5, d6) = (
            unused("unused")?,
            unused("unused (5)")?,
            unused("unused (6)")?,
        );
        let out_bytes = (2 * n * 16) as u64;
        let b_out = self
            .ctx
            .storage("particle fields", out_bytes, REDUCE)
            .map_err(gpu_error)?;
        let staging = self.staging(out_bytes);
        let group0 = self.bind0([&b_pts, &dummy, &dummy, &dummy, &dummy, &d5, &d6, &b_out]);
        let group1 = self.params_group(&[base]);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_bind_group(0, &group0, &[]);
            dispatch(
                &mut pass,
                &self.kernels.direct,
                &group1,
                0,
                (n as u32).div_ceil(WG),
            );
        }
        enc.copy_buffer_to_buffer(&b_out, 0, &staging, 0, out_bytes);
        let upload = clock.elapsed().as_secs_f64();
        let clock = Instant::now();
        self.run(enc, "direct summation")?;
        let kernel = clock.elapsed().as_secs_f64();
        let clock = Instant::now();
        let raw = self.read(&staging, 2 * n)?;
        let mut out = Forces::zeros(n);
        for i in 0..n {
            let (hi, lo) = (raw[2 * i], raw[2 * i + 1]);
            let v = |c: usize| g * (hi[c] as f64 + lo[c] as f64);
            out.acc[i] = [v(0), v(1), v(2)];
            out.pot[i] = v(3);
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = GpuSplit {
            upload,
            p2p: kernel,
            download: clock.elapsed().as_secs_f64(),
            bytes_up: (pts.len() * 16) as u64,
            bytes_down: out_bytes,
            ..Default::default()
        };
        Ok(out)
    }

    fn software_warning(&self) -> Option<String> {
        self.selected
            .adapter
            .software_warning("forces.device: \"cpu\"")
    }

    fn describe(&self) -> String {
        let s = &self.selected;
        format!(
            "GPU adapter [{}] {} ({}{})",
            s.adapter.index,
            s.adapter.name,
            s.note,
            if s.shared {
                "; shared with other ranks of this node"
            } else {
                ""
            }
        )
    }
}
