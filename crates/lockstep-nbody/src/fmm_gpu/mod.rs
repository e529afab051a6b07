//! Gravity on a GPU (`forces.device: "gpu"`, docs/nbody.md "Forces on the GPU"): the FMM
//! force evaluation and direct summation as WGSL kernels (`fmm.wgsl`) on the device layer
//! of `lockstep-gpu` (wgpu; lavapipe in CI).
//!
//! What runs where:
//!
//! - **Device tree** (`tree.rs`, `tree.wgsl`; [`GpuForces::with_host_tree`] builds it on the
//!   host instead): from a resident shard's positions when nothing was imported, the host's
//!   tree in the same cube node for node; the host reads back the nodes and the order.
//! - **Host** (rayon, as the CPU path): the Morton tree where particles were imported or are
//!   not resident (`Fmm::build_tree_nodes`), and the locally essential tree exchange of
//!   sharded runs (MPI). Measured at N = 1e6 on 2 cores (docs/nbody.md), before the tree
//!   and the walk moved to the device: tree 0.11 s, lists 1.12 s, their packing and upload
//!   0.35 s (303 MB), against milliseconds for those bytes over PCIe.
//! - **Device walk** (`walk.rs`, `walk.wgsl`; [`GpuForces::with_host_lists`] walks on the
//!   host instead): the dual tree walk's interaction lists built from the uploaded nodes,
//!   centres and radii, the host walk's lists row by row, left on the device as compressed
//!   rows; two submissions and two host synchronisations.
//! - **Device**, in four submissions per evaluation: P2M at the leaves and M2M level by
//!   level (one dispatch per level); M2L (one thread per target node over its list) and L2L
//!   level by level; P2P (one workgroup per 64 targets of a leaf, the source particles of
//!   its row of source nodes staged 64 at a time in workgroup memory); L2P and M2P per
//!   particle, then the copy of the results into a read-back buffer.
//!
//! Bounded work per invocation on a software adapter: no dispatch gives one invocation more
//! than [`LOOP_BUDGET`] loop iterations (`LoopCost` counts them from the kernels' loops).
//! Mesa's llvmpipe (lavapipe, the CI adapter) silently ends every loop of an invocation once
//! its loops together have iterated 65,535 times (gallivm's `LP_MAX_TGSI_LOOP_ITERATIONS`),
//! which truncated long M2L lists and gave wrong forces (orders 4-6 at a few thousand
//! particles, order 3 at N = 20,000). Longer work is split into passes, each adding to what
//! the previous one wrote in a fixed order: M2L rows and M2P rows by entries, P2M by the
//! leaf's particles, P2P by source particles, direct sums by source ranges. A hardware
//! adapter ends no loop early, so it plans with [`HARDWARE_LOOP_BUDGET`]: one pass per
//! kernel ([`loop_budget_for`]).
//!
//! Precision: f32 arithmetic only (no `SHADER_F64` needed). Points are (hi, lo) pairs of f32
//! relative to the tree's cube centre, so differences of nearby points keep about 1e-7 of
//! their own size; derivative tensors are evaluated at a power-of-two-scaled separation; sums
//! over sources are compensated (hi, lo) accumulators, their intermediate sums hidden from the
//! shader compiler's algebraic rewrites (`opaque4` in `fmm.wgsl`; Mesa's NIR otherwise turns
//! `(a + b) - a` into `b` and the compensation into nothing). No atomics: every sum runs in a fixed
//! order, so two runs give the same bits. The accelerations agree with the CPU FMM's to a
//! few 1e-6 relative at orders 1..=6 (`tests/nbody_gpu.rs`: at most 7.5e-6 per particle).
//!
//! Limits: workgroup counts above 65,535 go to a second dispatch dimension; an array over
//! the adapter's storage-binding limit is bound in several windows, and only a buffer over
//! `max_buffer_size` is refused, naming it; indices are 32-bit words, so an evaluation
//! whose walk or expansions would need 2^32 of them (near 1.3e8 and 2e8 particles per rank
//! at order 6) is refused naming the array (more ranks or GPUs split the particles); every
//! wait on the device has a timeout ([`GPU_TIMEOUT`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_gpu::{wgpu, DeviceRequest, GpuContext, GpuError, Selected};

use crate::direct::Forces;
use crate::fmm::expansion::FlatTables;
use crate::fmm::tree::Tree;
use crate::fmm::{Fmm, FmmStats, ForceDevice, PhaseSeconds, RemoteCell, SourceSet, WalkLists};
use crate::NbodyError;

mod pipelines;
pub mod resident;
mod sort_scan;
mod tree;
mod walk;
use pipelines::{records_group, Array, Bound, Module, RECORD_STRIDE as PARAM_STRIDE};
pub use resident::{DeviceField, ResidentShard};
pub use tree::NOT_FINITE;
use tree::{BuiltTree, DeviceTree};
use walk::{DeviceLists, DeviceWalk, ListShape, WalkRules};

/// The kernels' source.
const SHADER: &str = include_str!("fmm.wgsl");
/// Threads per workgroup of every kernel (`WG` in `fmm.wgsl`).
const WG: u32 = 64;
/// Bytes of the `Params` struct of `fmm.wgsl` (40 words).
const PARAM_BYTES: u64 = 160;
/// Longest wait for one submission or read-back; a device that has not finished by then
/// is reported as hung, naming the phase.
pub const GPU_TIMEOUT: Duration = Duration::from_secs(300);
/// Loop iterations one invocation of a kernel runs at most per dispatch on a software
/// adapter (half of llvmpipe's 65,535: gallivm ends every loop of an invocation, silently,
/// once its loops together have iterated that often). Work beyond it is split into passes
/// (module docs); a smaller budget ([`GpuForces::with_loop_budget`]) splits more, with the
/// same results to rounding.
pub const LOOP_BUDGET: u32 = 32_768;

/// The loop budget on a hardware adapter, which ends no loop early: 2^30 iterations, more
/// than any row, leaf or source range of a problem that fits a GPU, so every kernel runs in
/// one pass (no M2L expansion stored and reloaded between passes, one dispatch per kernel
/// and level); small enough that the kernels' pass arithmetic (`chunk * chunk_len`) stays
/// within u32.
pub const HARDWARE_LOOP_BUDGET: u32 = 1 << 30;

/// The loop budget for an adapter: [`LOOP_BUDGET`] on a software adapter (type `Cpu`:
/// llvmpipe, the CI adapter, caps loops), [`HARDWARE_LOOP_BUDGET`] on any other.
pub fn loop_budget_for(software: bool) -> u32 {
    if software {
        LOOP_BUDGET
    } else {
        HARDWARE_LOOP_BUDGET
    }
}

/// What shrinks the buffers of one evaluation, for the messages of buffers too large.
const REDUCE: &str = "the particles per rank (run more ranks or GPUs: mpirun -n R) or forces.order";

/// Host-side split of the last evaluation on the device (seconds and bytes), for the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuSplit {
    /// Tree build on the host.
    pub tree: f64,
    /// The dual tree walk: on the device (its two submissions and waits, the default) or
    /// on the host with the flattened lists.
    pub lists: f64,
    /// Whether the walk ran on the device.
    pub walk_on_device: bool,
    /// Whether the tree was built on the device.
    pub tree_on_device: bool,
    /// Device tree builds run (more than one when its node buffer overflowed).
    pub tree_runs: u64,
    /// Steps of the device walk recorded.
    pub walk_steps: u64,
    /// Device walks run (more than one when a buffer overflowed).
    pub walk_runs: u64,
    /// The device walk's largest frontier (pairs).
    pub walk_frontier: u64,
    /// Pairs the device walk visited.
    pub walk_pairs: u64,
    /// The device walk's device-memory traffic by its model (bytes; `walk.rs`,
    /// `modelled_bytes`): not measured.
    pub walk_model_bytes: u64,
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
    /// The share of the P2P kernel's 64 invocations per task that sum pairs, averaged over
    /// its tasks (`p2p_lane_use`): a count from the tree, not a measurement.
    pub p2p_lane_use: f64,
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

/// The storage arrays of `fmm.wgsl` (group 0, in binding order): inputs, then the
/// multipoles, local expansions and particle fields.
const ARRAYS: [Array; 8] = [
    Array {
        name: "pts",
        ty: "vec4<f32>",
        elem: 16,
        read_only: true,
    },
    Array {
        name: "cen",
        ty: "vec4<f32>",
        elem: 16,
        read_only: true,
    },
    Array {
        name: "nodes",
        ty: "vec4<u32>",
        elem: 16,
        read_only: true,
    },
    Array {
        name: "lists",
        ty: "u32",
        elem: 4,
        read_only: true,
    },
    Array {
        name: "tabf",
        ty: "f32",
        elem: 4,
        read_only: true,
    },
    Array {
        name: "mp",
        ty: "f32",
        elem: 4,
        read_only: false,
    },
    Array {
        name: "loc",
        ty: "f32",
        elem: 4,
        read_only: false,
    },
    Array {
        name: "outp",
        ty: "vec4<f32>",
        elem: 16,
        read_only: false,
    },
];

/// The entry points of `fmm.wgsl`, in the order of [`Kernel`] (then the direct sums).
const ENTRIES: [&str; 7] = ["p2m", "m2m", "m2l", "l2l", "p2p", "far", "direct"];
/// The direct sums' pipeline among [`ENTRIES`].
const DIRECT: usize = 6;

/// Gravity on one GPU adapter: the compiled kernels on the process's shared device
/// ([`GpuContext::open`]). Implements [`ForceDevice`] for [`Fmm::on_device`].
pub struct GpuForces {
    ctx: Arc<GpuContext>,
    selected: Selected,
    /// `fmm.wgsl`, compiled per count of windows of its arrays.
    module: Module,
    last: Mutex<GpuSplit>,
    loop_budget: u32,
    /// The dual tree walk's kernels (`walk.wgsl`).
    walk: DeviceWalk,
    /// Walk on the host ([`GpuForces::with_host_lists`]).
    host_lists: bool,
    /// The tree's kernels (`tree.wgsl`).
    tree: DeviceTree,
    /// Tree on the host ([`GpuForces::with_host_tree`]).
    host_tree: bool,
}

impl std::fmt::Debug for GpuForces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuForces({})", self.describe())
    }
}

/// A device-layer error as an N-body error: its message with the N-body's key
/// (`forces.device`) where the device layer names the training key.
pub(crate) fn gpu_error(e: GpuError) -> NbodyError {
    NbodyError::Gpu(e.to_string().replace("run.device", "forces.device"))
}

/// The GPU engine of `fmm`, if its forces run on one.
pub fn gpu_of(fmm: &Fmm) -> Option<&GpuForces> {
    fmm.device()
        .and_then(|d| d.as_any().downcast_ref::<GpuForces>())
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
        let module = Module::new(&ctx, "fmm.wgsl", SHADER, &ARRAYS, PARAM_BYTES, &ENTRIES)
            .map_err(gpu_error)?;
        let loop_budget = loop_budget_for(selected.adapter.software);
        let walk = DeviceWalk::new(&ctx).map_err(gpu_error)?;
        let tree = DeviceTree::new(&ctx).map_err(gpu_error)?;
        Ok(GpuForces {
            ctx,
            selected,
            module,
            last: Mutex::new(GpuSplit::default()),
            loop_budget,
            walk,
            host_lists: false,
            tree,
            host_tree: false,
        })
    }

    /// This engine with at most `budget` (at least 1, at most [`HARDWARE_LOOP_BUDGET`]) loop
    /// iterations per kernel invocation and dispatch instead of the adapter's
    /// ([`loop_budget_for`]): a smaller budget runs more passes over the same work, the same
    /// forces to rounding (the tests split small problems this way); a budget over 65,535
    /// gives wrong forces on llvmpipe (lavapipe) once an invocation's loops exceed that.
    pub fn with_loop_budget(mut self, budget: u32) -> GpuForces {
        self.loop_budget = budget.clamp(1, HARDWARE_LOOP_BUDGET);
        self
    }

    /// This engine with the interaction lists built by the host's dual tree walk
    /// (`Fmm::walk_lists`, uploaded) when `host` instead of by the walk on the device
    /// (`walk.wgsl`, the default): the same lists, row by row, in another order within a
    /// row (the tests compare the two).
    pub fn with_host_lists(mut self, host: bool) -> GpuForces {
        self.host_lists = host;
        self
    }

    /// This engine with the Morton tree always built on the host when `host` (the tests
    /// compare the two), instead of on the device wherever the positions are there and
    /// nothing was imported (a resident shard of a one-rank run, [`GpuForces::fmm_field`]).
    pub fn with_host_tree(mut self, host: bool) -> GpuForces {
        self.host_tree = host;
        self
    }

    /// Whether [`GpuForces::fmm_field`] builds the tree on the device for a resident shard
    /// with nothing imported (it then reads no host positions but their count).
    pub fn builds_tree_on_device(&self) -> bool {
        !self.host_tree
    }

    /// Loop iterations per kernel invocation and dispatch this engine plans for.
    pub fn loop_budget(&self) -> u32 {
        self.loop_budget
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

    /// Group 0 for the arrays of `fmm.wgsl` in `buffers` (each bound as windows where it
    /// exceeds a binding), with the kernels for those windows.
    fn bind0(&self, buffers: [&wgpu::Buffer; 8]) -> Result<Bound, NbodyError> {
        self.module
            .bind(&self.ctx, "nbody buffers", &buffers)
            .map_err(gpu_error)
    }

    /// The uniform buffer of the dispatch records `params` and its bind group.
    fn params_group(&self, params: &[Params]) -> wgpu::BindGroup {
        let records: Vec<&[u32]> = params.iter().map(|p| &p.0[..]).collect();
        let label = "nbody dispatch parameters";
        records_group(
            &self.ctx,
            self.module.layout1(),
            label,
            &records,
            PARAM_BYTES,
        )
    }

    /// A storage buffer holding `data`, bound as windows where it exceeds a binding.
    fn storage<T: bytemuck::Pod>(
        &self,
        name: &str,
        data: &[T],
    ) -> Result<wgpu::Buffer, NbodyError> {
        self.ctx
            .storage_windowed_from(name, data, REDUCE)
            .map_err(gpu_error)
    }
}

/// One dispatch's `Params` record of `fmm.wgsl` (40 words; floats as bits).
#[derive(Debug, Clone, Copy)]
struct Params([u32; 40]);

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
    pub const ZERO: usize = 20;
    pub const O_P2P_ITEMS: usize = 21;
    pub const O_P2P_OFF: usize = 36;
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
    pub const CHUNK: usize = 32;
    pub const CHUNK_LEN: usize = 33;
    pub const SRC0: usize = 34;
    pub const SRC1: usize = 35;
}

impl Params {
    fn with(&self, first: usize, count: usize, list: u32) -> Params {
        let mut p = *self;
        p.0[w::FIRST] = first as u32;
        p.0[w::COUNT] = count as u32;
        p.0[w::O_LIST] = list;
        p
    }

    /// This record for pass `chunk` of a kernel that does `len` items per pass.
    fn pass(&self, chunk: usize, len: u32) -> Params {
        let mut p = *self;
        p.0[w::CHUNK] = chunk as u32;
        p.0[w::CHUNK_LEN] = len;
        p
    }
}

/// Loop iterations of the kernels of `fmm.wgsl` per unit of work at one expansion order,
/// counted from their loops (`nt` coefficients, order `p`) as llvmpipe counts them: a loop
/// that runs `k` times costs `k + 1` (its SIMD loop ends at the bottom, once more after the
/// last iteration), to split work into passes of at most a loop budget ([`LOOP_BUDGET`]) per
/// invocation.
#[derive(Debug, Clone, Copy)]
struct LoopCost {
    /// P2M per particle (monomials, accumulation).
    p2m_particle: u32,
    /// P2M per pass besides the particles (load and store of the multipole).
    p2m_fixed: u32,
    /// M2L per list entry (derivative tensor, powers, signed multipole, contraction).
    m2l_entry: u32,
    /// M2L per pass besides the entries (load and store of the expansion).
    m2l_fixed: u32,
    /// M2P per list entry (derivative tensor, powers, contraction).
    m2p_entry: u32,
    /// Far-field kernel per pass besides the M2P entries (the L2P).
    far_fixed: u32,
}

impl LoopCost {
    fn new(ft: &FlatTables, nt: usize, p: usize) -> LoopCost {
        let nt = nt as u32;
        let p = p as u32;
        // monomials (nt - 1 + 1), the h recursion (p + 1), the rows (nt + 1) and their
        // terms (each row once more).
        let derivs = nt + (p + 1) + (nt + 1) + ft.deriv_c.len() as u32 + nt;
        let powers = p + 2;
        let ngrad = (ft.grad.len() / 3) as u32;
        LoopCost {
            p2m_particle: 1 + nt + (nt + 1),
            p2m_fixed: 2 * (nt + 1) + 1,
            m2l_entry: 1 + derivs + powers + (nt + 1) + (nt + 1) + ft.rows.len() as u32 + nt,
            m2l_fixed: 2 * (nt + 1) + 1,
            m2p_entry: 1 + derivs + powers + (nt + 1),
            far_fixed: nt + (nt + 1) + (ngrad + 1) + 1,
        }
    }

    /// Items per pass when one pass costs `fixed` plus `per_item` per item (at least 1).
    fn per_pass(budget: u32, fixed: u32, per_item: u32) -> u32 {
        (budget.saturating_sub(fixed) / per_item.max(1)).max(1)
    }
}

/// Passes of `per_pass` items each over rows of at most `longest` items (at least 1 pass).
fn passes(longest: usize, per_pass: u32) -> usize {
    longest.div_ceil(per_pass as usize).max(1)
}

/// The longest row of compressed-row offsets `off` (`[rows + 1]`).
fn longest_row(off: &[u32]) -> usize {
    off.windows(2)
        .map(|w| (w[1] - w[0]) as usize)
        .max()
        .unwrap_or(0)
}

/// The tasks of the `p2p` kernel for the leaves of `tree`: `[leaf, first target]`, one per
/// 64 particles of each leaf with targets (in node order).
fn p2p_tasks(tree: &Tree) -> Vec<u32> {
    let mut tasks = Vec::new();
    for (a, nd) in tree.nodes.iter().enumerate() {
        if nd.is_leaf() && nd.ntargets > 0 {
            for first in (nd.start..nd.end).step_by(WG as usize) {
                tasks.extend([a as u32, first as u32]);
            }
        }
    }
    tasks
}

/// The share of the `p2p` kernel's 64 invocations that sum pairs, averaged over `tasks`
/// (from [`p2p_tasks`]): a task of `nt` targets gives each `64 / nt` invocations (the rest
/// idle), so a leaf of 10 targets keeps 60 of 64 busy; one invocation per target would keep
/// 10. 1 for no tasks. A count of lanes, the kernel's mapping written again in Rust (the
/// tests of its results are the GPU-against-CPU ones), not of work: in a partly filled
/// last tile some busy invocations have no source.
pub(crate) fn p2p_lane_use(tree: &Tree, tasks: &[u32]) -> f64 {
    let n = tasks.len() / 2;
    if n == 0 {
        return 1.0;
    }
    let busy: usize = tasks
        .chunks_exact(2)
        .map(|t| {
            let nt = (tree.nodes[t[0] as usize].end - t[1] as usize).min(WG as usize);
            (WG as usize / nt) * nt
        })
        .sum();
    busy as f64 / (WG as usize * n) as f64
}

/// Source particles per pass of the `p2p` kernel within `budget` loop iterations when the
/// longest P2P row has `longest_row` entries (llvmpipe's counting, module `LoopCost`): a
/// pass loops once over the row's entries (at most `5` iterations each: the entry loop, the
/// staging loop's rounds and exits, a few more than the kernel's 2 or 3) and once per staged
/// source (`66 / 64`: the pair loop of a full tile, its exit and a staging round; with k
/// invocations per target the pair loop is k times shorter and covers the final sum of the
/// k accumulators); at least one tile.
fn p2p_window(budget: u32, longest_row: usize) -> u32 {
    let fixed = 5 * longest_row as u64 + 2;
    let per = (budget as u64).saturating_sub(fixed) * 64 / 66;
    per.clamp(WG as u64, HARDWARE_LOOP_BUDGET as u64) as u32
}

/// The most source particles of one P2P row (`p2p`: compressed rows of source nodes).
fn p2p_row_particles(tree: &Tree, p2p: &(Vec<u32>, Vec<u32>)) -> usize {
    p2p.0
        .windows(2)
        .map(|w| {
            p2p.1[w[0] as usize..w[1] as usize]
                .iter()
                .map(|&b| tree.nodes[b as usize].count())
                .sum::<usize>()
        })
        .max()
        .unwrap_or(0)
}

/// The kernels of an FMM evaluation.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    P2m,
    M2m,
    M2l,
    L2l,
    P2p,
    Far,
}

/// The submissions of one FMM evaluation: the parameter records and, per submission (upward,
/// far field, near field, particles), its dispatches `(kernel, record, workgroups)` in order.
#[derive(Default)]
struct Plan {
    params: Vec<Params>,
    phases: [Vec<(Kernel, usize, u32)>; 4],
}

impl Plan {
    fn push(&mut self, phase: usize, kernel: Kernel, params: Params, groups: u32) {
        self.phases[phase].push((kernel, self.params.len(), groups));
        self.params.push(params);
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

/// The kernels' inputs of one FMM evaluation, packed on the host.
struct Packed {
    /// The tree's cube centre, kpc: the points are relative to it.
    origin: [f64; 3],
    /// Sorted particles: (hi, lo) pairs relative to the cube centre, the mass in hi's 4th.
    pts: Vec<[f32; 4]>,
    /// Node then imported-cell centres, (hi, lo) pairs.
    cen: Vec<[f32; 4]>,
    /// The `lists` binding: index tables, interaction lists, then leaf and task lists.
    u: Vec<u32>,
    /// The `tabf` binding: float tables.
    f: Vec<f32>,
    /// The imported cells' multipoles `[cells][nt]`, which follow the nodes' (computed on
    /// the device from zero) in the multipole array.
    mp_cells: Vec<f32>,
    /// The leaves, in node order.
    leaves: Vec<u32>,
    /// Where the leaf list and the P2P tasks (`[leaf, first target]` pairs) are in `u`.
    o_leaves: u32,
    o_tasks: u32,
    /// P2P tasks.
    n_tasks: usize,
    lane_use: f64,
    /// Words of device-built lists that follow `u` in the `lists` binding (copied there on
    /// the device; `u` ends where they start).
    tail: usize,
    /// The parameter words every dispatch shares.
    base: Params,
}

/// Where an evaluation's interaction lists come from: the host's walk, or the device's.
enum ListsOf<'a> {
    Host(&'a WalkLists),
    Device(&'a DeviceLists),
}

impl ListsOf<'_> {
    /// What the plan needs of them.
    fn shape(&self, tree: &Tree) -> ListShape {
        match self {
            ListsOf::Host(l) => ListShape {
                counts: [l.m2l.1.len(), l.m2p.1.len(), l.p2p.1.len()],
                longest: [
                    longest_row(&l.m2l.0),
                    longest_row(&l.m2p.0),
                    longest_row(&l.p2p.0),
                ],
                p2p_row_particles: p2p_row_particles(tree, &l.p2p),
                forced: l.forced,
                p2p_pairs: l.p2p_pairs,
            },
            ListsOf::Device(d) => d.shape,
        }
    }
}

/// The centre of `tree`'s cube, kpc: the origin of the kernels' points.
fn cube_centre(tree: &Tree) -> [f64; 3] {
    tree.lo.map(|lo| lo + 0.5 * tree.side)
}

/// `tree`'s nodes as `fmm.wgsl` and `walk.wgsl` read them: per node `[start, end,
/// first_child, nchild]` then `[parent, ntargets, level, 0]`.
fn packed_nodes(tree: &Tree) -> Vec<[u32; 4]> {
    tree.nodes
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
        .collect()
}

/// The centres and radii of `tree`'s nodes then of the imported cells `remote` for
/// `walk.wgsl`: (hi.xyz, radius hi), (lo.xyz, radius lo), the centres relative to `origin`.
fn walk_geo(tree: &Tree, remote: &[RemoteCell], origin: [f64; 3]) -> Vec<[f32; 4]> {
    let cells = remote.iter().map(|c| (c.center, c.radius));
    tree.nodes
        .iter()
        .map(|n| (n.center, n.radius))
        .chain(cells)
        .flat_map(|(c, r)| {
            let [mut hi, mut lo] = split(c, origin, 0.0);
            let rh = r as f32;
            hi[3] = rh;
            lo[3] = (r - rh as f64) as f32;
            [hi, lo]
        })
        .collect()
}

/// Packs `tree`, its `lists`, the order-`p` tables `ft` (`nt` coefficients) and the imported
/// cells `remote` for the kernels (softening `softening` kpc); the sorted points too unless a
/// resident shard makes them on the device (`points` false).
///
/// Errors: [`NbodyError::Gpu`] when an index the kernels compute in 32 bits would pass
/// 2^32 (see [`check_indices`]).
fn pack(
    tree: &Tree,
    lists: &ListsOf,
    (ft, p, nt): (&FlatTables, usize, usize),
    remote: &[RemoteCell],
    softening: f64,
    points: bool,
) -> Result<Packed, NbodyError> {
    let nn = tree.nodes.len();
    let n_all = tree.perm.len();
    let list_words = match lists {
        ListsOf::Host(l) => [&l.m2l, &l.m2p, &l.p2p]
            .iter()
            .map(|(off, items)| off.len() + items.len())
            .sum::<usize>(),
        ListsOf::Device(d) => d.shape.counts.iter().sum::<usize>() + 3 * (nn + 1),
    };
    // The index tables before the lists: a generous bound (their sizes grow with p and N).
    let table_words = ft.rows.len() + ft.grad.len() + ft.shift.len() + 8 * (n_all + nn) + 4096;
    check_indices(&[
        (
            "the expansions (nodes and imported cells x coefficients, twice)",
            2 * (nn + remote.len()) as u64 * nt as u64,
        ),
        (
            "the interaction lists and index tables",
            (table_words + list_words) as u64,
        ),
        ("the particles (positions and masses)", 8 * n_all as u64),
    ])?;
    let origin = cube_centre(tree);
    let soa = &tree.soa;
    let pts: Vec<[f32; 4]> = if points {
        (0..n_all)
            .flat_map(|s| split(soa.point(s), origin, soa.m[s]))
            .collect()
    } else {
        Vec::new()
    };
    let cen: Vec<[f32; 4]> = tree
        .nodes
        .iter()
        .map(|n| n.center)
        .chain(remote.iter().map(|c| c.center))
        .flat_map(|c| split(c, origin, 0.0))
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
    let mut u = Vec::new();
    let mut f = Vec::new();
    let mut base = Params([0; 40]);
    let b = &mut base.0;
    b[w::N_ALL] = n_all as u32;
    b[w::NN] = nn as u32;
    b[w::NT] = nt as u32;
    b[w::P] = p as u32;
    b[w::NGRAD] = (ft.grad.len() / 3) as u32;
    b[w::ZERO] = 0; // what `opaque4` XORs with: a zero the shader compiler cannot see

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
    b[w::O_LEAFOF] = push(&mut u, &leaf_of);
    let o_leaves = push(&mut u, &leaves);
    let tasks = p2p_tasks(tree);
    let o_tasks = push(&mut u, &tasks);
    let tail = match lists {
        ListsOf::Host(l) => {
            b[w::O_M2L_OFF] = push(&mut u, &l.m2l.0);
            b[w::O_M2L_ITEMS] = push(&mut u, &l.m2l.1);
            b[w::O_M2P_OFF] = push(&mut u, &l.m2p.0);
            b[w::O_M2P_ITEMS] = push(&mut u, &l.m2p.1);
            b[w::O_P2P_OFF] = push(&mut u, &l.p2p.0);
            b[w::O_P2P_ITEMS] = push(&mut u, &l.p2p.1);
            0
        }
        ListsOf::Device(d) => {
            // `DeviceLists::out`: the items of the three kinds, then their offsets.
            let at = u.len() as u32;
            let [c0, c1, c2] = d.shape.counts.map(|c| c as u32);
            let rows = (nn + 1) as u32;
            let m = c0 + c1 + c2;
            b[w::O_M2L_ITEMS] = at;
            b[w::O_M2P_ITEMS] = at + c0;
            b[w::O_P2P_ITEMS] = at + c0 + c1;
            b[w::O_M2L_OFF] = at + m;
            b[w::O_M2P_OFF] = at + m + rows;
            b[w::O_P2P_OFF] = at + m + 2 * rows;
            d.words()
        }
    };
    b[w::F_INV] = pushf(&mut f, &ft.inv_step);
    b[w::F_DC] = pushf(&mut f, &ft.deriv_c);
    b[w::F_SIGN] = pushf(&mut f, &ft.sign);
    let mut mp_cells = vec![0f32; remote.len() * nt];
    for (k, c) in remote.iter().enumerate() {
        for (o, &v) in mp_cells[k * nt..(k + 1) * nt].iter_mut().zip(&c.multipole) {
            *o = v as f32;
        }
    }
    Ok(Packed {
        origin,
        pts,
        cen,
        u,
        f,
        mp_cells,
        leaves,
        o_leaves,
        o_tasks,
        n_tasks: tasks.len() / 2,
        lane_use: p2p_lane_use(tree, &tasks),
        tail,
        base,
    })
}

/// Refuses an evaluation where an index the kernels compute in 32-bit words would wrap:
/// `arrays` are (name, words) pairs; each must stay below 2^32 (at order 6 the expansions
/// reach it near 2e8 particles per rank, past the walk's own limit near 1.3e8).
///
/// Errors: [`NbodyError::Gpu`] naming the array and what to do.
fn check_indices(arrays: &[(&str, u64)]) -> Result<(), NbodyError> {
    for &(name, words) in arrays {
        if words >= u32::MAX as u64 {
            return Err(NbodyError::Gpu(format!(
                "the FMM on the GPU indexes {name} in 32 bits, and this evaluation needs {words} words of them: run more ranks (mpirun -n R) or raise forces.leaf_size"
            )));
        }
    }
    Ok(())
}

/// The names of the four submissions of an FMM evaluation, for errors and timeouts.
const PHASES: [&str; 4] = [
    "the upward pass (P2M, M2M)",
    "the far field (M2L, L2L)",
    "the near field (P2P)",
    "the far field at the particles (L2P, M2P)",
];

impl GpuForces {
    /// The dispatches of one evaluation of `tree` with lists of `shape` packed in `packed`,
    /// no invocation over this engine's loop budget.
    fn plan(&self, tree: &Tree, shape: &ListShape, packed: &Packed, cost: LoopCost) -> Plan {
        let budget = self.loop_budget;
        let groups = |n: usize| (n as u32).div_ceil(WG);
        let base = packed.base;
        let o_leaves = packed.o_leaves;
        let mut plan = Plan::default();
        // Upward: P2M in passes over the leaves' particles, then M2M level by level.
        let nl = packed.leaves.len();
        let per = LoopCost::per_pass(budget, cost.p2m_fixed, cost.p2m_particle);
        let biggest = packed.leaves.iter();
        let biggest = biggest.map(|&a| tree.nodes[a as usize].count()).max();
        for c in 0..passes(biggest.unwrap_or(0), per) {
            let p = base.with(0, nl, o_leaves).pass(c, per);
            plan.push(0, Kernel::P2m, p, groups(nl));
        }
        let levels = tree.level_start.len() - 1;
        for l in (0..levels).rev() {
            let (a, b) = (tree.level_start[l], tree.level_start[l + 1]);
            plan.push(0, Kernel::M2m, base.with(a, b - a, 0), groups(b - a));
        }
        // Far field: M2L in passes over the rows, then L2L level by level.
        let nn = tree.nodes.len();
        let per = LoopCost::per_pass(budget, cost.m2l_fixed, cost.m2l_entry);
        for c in 0..passes(shape.longest[0], per) {
            plan.push(1, Kernel::M2l, base.with(0, nn, 0).pass(c, per), groups(nn));
        }
        for l in 1..levels {
            let (a, b) = (tree.level_start[l], tree.level_start[l + 1]);
            plan.push(1, Kernel::L2l, base.with(a, b - a, 0), groups(b - a));
        }
        // Near field: a workgroup per 64 targets of a leaf, one dispatch per window of the
        // rows' source particles.
        let (o, n) = (packed.o_tasks, packed.n_tasks);
        let per = p2p_window(budget, shape.longest[2]);
        for c in 0..passes(shape.p2p_row_particles, per) {
            plan.push(2, Kernel::P2p, base.with(0, n, o).pass(c, per), n as u32);
        }
        // Particles: L2P, and M2P in passes over the rows.
        let n_all = tree.perm.len();
        let per = LoopCost::per_pass(budget, cost.far_fixed, cost.m2p_entry);
        for c in 0..passes(shape.longest[1], per) {
            let p = base.with(0, n_all, 0).pass(c, per);
            plan.push(3, Kernel::Far, p, groups(n_all));
        }
        plan
    }

    /// The pipeline of `kernel` among `bound`'s.
    fn pipeline(bound: &Bound, kernel: Kernel) -> &wgpu::ComputePipeline {
        &bound.compiled.pipelines[kernel as usize]
    }

    /// Records `dispatches` `(kernel, record, workgroups)` in one compute pass; submits and
    /// waits, naming `what` in errors. Returns the seconds it took.
    fn submit(
        &self,
        groups: (&Bound, &wgpu::BindGroup),
        dispatches: &[(Kernel, usize, u32)],
        what: &str,
    ) -> Result<f64, NbodyError> {
        let clock = Instant::now();
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_bind_group(0, &groups.0.group, &[]);
            for &(kernel, slot, n) in dispatches {
                dispatch(
                    &mut pass,
                    Self::pipeline(groups.0, kernel),
                    groups.1,
                    slot,
                    n,
                );
            }
        }
        self.run(enc, what)?;
        Ok(clock.elapsed().as_secs_f64())
    }
}

impl GpuForces {
    /// The FMM evaluation of [`ForceDevice::fmm_forces`], its field left on the device for a
    /// resident shard's kick ([`ResidentShard::kick`]) or read back ([`DeviceField::read`]).
    ///
    /// Errors: [`NbodyError::Gpu`] (a buffer over the adapter's limits, naming it; the
    /// device failed or timed out, naming the phase).
    ///
    /// With `shard` (the resident shard whose particles are `sources.pos`, as last read
    /// back), the sorted points are made on the device from the shard's positions
    /// ([`ResidentShard::points`]): only the permutation and the imported particles cross
    /// the bus for them.
    pub fn fmm_field(
        &self,
        fmm: &Fmm,
        sources: &SourceSet,
        g: f64,
        softening: f64,
        shard: Option<&mut ResidentShard>,
    ) -> Result<(DeviceField, FmmStats), NbodyError> {
        crate::fmm::check_sources(sources, fmm.tables().nterms)?;
        let n_local = sources.pos.len();
        if n_local == 0 {
            return Ok((self.empty_field(g)?, FmmStats::default()));
        }
        let mut split_t = GpuSplit::default();
        let mut shard = shard;
        if let Some(s) = &shard {
            if s.num() != n_local {
                return Err(self.err(
                    "taking the positions from the resident shard",
                    format!("the shard holds {} particles, not {n_local}", s.num()),
                ));
            }
        }
        // The tree: on the device from a resident shard's positions when nothing was
        // imported, else on the host.
        let clock = Instant::now();
        let remote = sources.remote_cells;
        let on_device = !self.host_tree && sources.remote_pos.is_empty() && remote.is_empty();
        let built = match shard.as_deref_mut() {
            Some(s) if on_device => {
                let pos = s.positions().map_err(gpu_error)?;
                let leaf = fmm.params().leaf_size;
                Some(self.tree.build(pos, n_local, leaf).map_err(gpu_error)?)
            }
            _ => None,
        };
        let (tree, on_device) = match built {
            Some(BuiltTree {
                tree,
                nodes,
                geo,
                perm,
                host_perm,
                runs,
            }) => {
                split_t.tree_on_device = true;
                split_t.tree_runs = runs as u64;
                (tree, Some((nodes, geo, (perm, host_perm))))
            }
            None => (fmm.build_tree_nodes(sources), None),
        };
        let (dev_nodes, dev_geo, dev_perm) = match on_device {
            Some((n, g, p)) => (Some(n), Some(g), Some(p)),
            None => (None, None, None),
        };
        split_t.tree = clock.elapsed().as_secs_f64();
        // The lists: the walk on the device from the nodes, centres and radii (uploaded
        // unless the device built the tree), or on the host.
        let clock = Instant::now();
        let nn = tree.nodes.len();
        let mut walk_words = 0;
        let host_nodes = packed_nodes(&tree);
        let uploaded_nodes;
        let b_nodes = match &dev_nodes {
            Some(nodes) => nodes,
            None => {
                walk_words += 4 * host_nodes.len();
                uploaded_nodes = self.storage("tree nodes", &host_nodes)?;
                &uploaded_nodes
            }
        };
        let (host_lists, device_lists);
        let lists = if self.host_lists {
            host_lists = fmm.walk_lists(&tree, remote);
            ListsOf::Host(&host_lists)
        } else {
            let (direct_max, p2p_node_max) = fmm.walk_limits();
            let rules = WalkRules {
                theta: fmm.params().theta,
                direct_max,
                p2p_node_max,
            };
            let uploaded_geo;
            let b_geo = match &dev_geo {
                Some(geo) => geo,
                None => {
                    let geo = walk_geo(&tree, remote, cube_centre(&tree));
                    walk_words += 4 * geo.len();
                    uploaded_geo = self.storage("node centres and radii", &geo)?;
                    &uploaded_geo
                }
            };
            let sizes = (nn, remote.len(), tree.depth());
            device_lists = self
                .walk
                .lists(b_nodes, b_geo, sizes, rules)
                .map_err(gpu_error)?;
            split_t.walk_on_device = true;
            split_t.walk_steps = device_lists.steps as u64;
            split_t.walk_runs = device_lists.runs as u64;
            split_t.walk_frontier = device_lists.max_frontier as u64;
            split_t.walk_pairs = device_lists.pairs;
            split_t.walk_model_bytes = walk::modelled_bytes(
                device_lists.pairs,
                device_lists.shape.counts.iter().sum::<usize>() as u64,
                nn,
            );
            ListsOf::Device(&device_lists)
        };
        let shape = lists.shape(&tree);
        split_t.lists = clock.elapsed().as_secs_f64();

        let clock = Instant::now();
        let tables = fmm.tables();
        let ft = tables.flat();
        let nt = tables.nterms;
        let n_all = tree.perm.len();
        let order = (&ft, tables.p, nt);
        let packed = pack(&tree, &lists, order, remote, softening, shard.is_none())?;
        let plan = self.plan(&tree, &shape, &packed, LoopCost::new(&ft, nt, tables.p));
        let pk = &packed;
        let (b_perm, host_perm, b_cen) = match (dev_perm, dev_geo) {
            // The device's order and centres: nothing to upload.
            (Some((perm, host_perm)), Some(geo)) => (perm, host_perm, geo),
            _ => {
                let host_perm: Vec<u32> = tree.perm.iter().map(|&i| i as u32).collect();
                let b_perm = self.storage("particle order", &host_perm)?;
                let b_cen = self.storage("node and imported cell centres", &pk.cen)?;
                walk_words += host_perm.len() + 4 * pk.cen.len();
                (b_perm, host_perm, b_cen)
            }
        };
        let mut imported_words = 0;
        let b_pts = match shard {
            Some(shard) => {
                let origin = pk.origin;
                let imported: Vec<[f32; 4]> = (sources.remote_pos.iter().zip(sources.remote_mass))
                    .flat_map(|(&x, &m)| split(x, origin, m))
                    .collect();
                imported_words = 4 * imported.len();
                shard
                    .points(&b_perm, &imported, origin, n_all)
                    .map_err(gpu_error)?
            }
            None => self.storage("particles (positions and masses)", &pk.pts)?,
        };
        let b_lists = match &lists {
            ListsOf::Host(_) => self.storage("interaction lists and index tables", &pk.u)?,
            ListsOf::Device(d) => {
                // The tables from the host, the lists copied in after them on the device.
                let at = 4 * pk.u.len() as u64;
                let b = self
                    .ctx
                    .storage_windowed(
                        "interaction lists and index tables",
                        at + 4 * pk.tail as u64,
                        REDUCE,
                    )
                    .map_err(gpu_error)?;
                self.ctx.write(&b, 0, &pk.u);
                let mut enc = self.ctx.device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(&d.out, 0, &b, at, 4 * pk.tail as u64);
                self.ctx.queue.submit([enc.finish()]);
                b
            }
        };
        let b_tabf = self.storage("expansion coefficient tables", &pk.f)?;
        // The nodes' multipoles start from zero on the device; only the imported cells'
        // cross the bus.
        let mp_bytes = (4 * (nn * nt) + 4 * pk.mp_cells.len()) as u64;
        let b_mp = self
            .ctx
            .storage_windowed("multipoles", mp_bytes, REDUCE)
            .map_err(gpu_error)?;
        self.ctx.write(&b_mp, (4 * nn * nt) as u64, &pk.mp_cells);
        let out_bytes = (2 * n_all * 16) as u64;
        // Local expansions, then the low parts of the M2L's sums between its passes.
        let b_loc = self
            .ctx
            .storage_windowed("local expansions", (2 * nn * nt * 4) as u64, REDUCE)
            .map_err(gpu_error)?;
        let b_out = self
            .ctx
            .storage_windowed("particle fields", out_bytes, REDUCE)
            .map_err(gpu_error)?;
        let group0 = self.bind0([
            &b_pts, &b_cen, b_nodes, &b_lists, &b_tabf, &b_mp, &b_loc, &b_out,
        ])?;
        let group1 = self.params_group(&plan.params);
        // Up: the points (unless resident), the imported ones, the tables and lists, the
        // imported multipoles, and what the host tree and walk needed uploaded.
        let words = pk.pts.len() * 4 + imported_words + pk.u.len() + pk.f.len();
        let words = words + pk.mp_cells.len() + walk_words;
        split_t.bytes_up = 4 * words as u64;
        split_t.upload = clock.elapsed().as_secs_f64();
        split_t.p2p_lane_use = pk.lane_use;

        let mut seconds = [0.0; 4];
        for (k, dispatches) in plan.phases.iter().enumerate() {
            seconds[k] = self.submit((&group0, &group1), dispatches, PHASES[k])?;
        }
        [split_t.upward, split_t.m2l, split_t.p2p, split_t.far] = seconds;
        let stats = FmmStats {
            nodes: nn,
            depth: tree.depth(),
            m2l: shape.counts[0],
            m2p: shape.counts[1],
            p2p_blocks: shape.counts[2],
            p2p_pairs: shape.p2p_pairs,
            forced_m2l: shape.forced,
            seconds: PhaseSeconds {
                tree: split_t.tree,
                traversal: split_t.lists + split_t.upload,
                upward: split_t.upward,
                m2l: split_t.m2l,
                l2l: 0.0,
                l2p: split_t.far,
                m2p: 0.0,
                p2p: split_t.p2p,
            },
        };
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = split_t;
        let field = DeviceField {
            out: b_out,
            perm: b_perm,
            host_perm,
            n_local,
            g,
        };
        Ok((field, stats))
    }

    /// A field of no slots (an empty shard).
    fn empty_field(&self, g: f64) -> Result<DeviceField, NbodyError> {
        let none = |name| self.ctx.storage(name, 16, REDUCE).map_err(gpu_error);
        Ok(DeviceField {
            out: none("particle fields")?,
            perm: none("particle order")?,
            host_perm: Vec::new(),
            n_local: 0,
            g,
        })
    }

    /// Reads `field` back (the read-back's time and bytes added to the last split).
    fn read_field(&self, field: &DeviceField) -> Result<Forces, NbodyError> {
        let clock = Instant::now();
        let out = field.read(&self.ctx).map_err(gpu_error)?;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.download = clock.elapsed().as_secs_f64();
        last.bytes_down = (32 * field.slots()) as u64;
        Ok(out)
    }

    /// The direct sums of [`ForceDevice::direct_forces`], the field left on the device in
    /// the targets' order (slot `i` is target `i`).
    ///
    /// With `shard` (the resident shard whose particles are both the targets and the
    /// sources, `offset` `Some(0)`, as last read back) the sources' points are made on the
    /// device from the shard's positions ([`ResidentShard::points`]): only the targets'
    /// order (4 B per particle) crosses the bus, not the 32 B per particle of the points.
    ///
    /// Errors: [`NbodyError::Gpu`]; a `shard` that does not hold exactly the sources.
    pub fn direct_field(
        &self,
        targets: &[[f64; 3]],
        offset: Option<usize>,
        pos: &[[f64; 3]],
        mass: &[f64],
        g: f64,
        softening: f64,
        shard: Option<&mut ResidentShard>,
    ) -> Result<DeviceField, NbodyError> {
        let n = targets.len();
        if n == 0 {
            return self.empty_field(g);
        }
        let clock = Instant::now();
        let (lo, side) =
            crate::fmm::tree::bounding_cube(if pos.is_empty() { targets } else { pos });
        let origin = [lo[0] + 0.5 * side, lo[1] + 0.5 * side, lo[2] + 0.5 * side];
        if let Some(shard) = &shard {
            if offset != Some(0) || pos.len() != n || shard.num() != n {
                return Err(self.err(
                    "direct summation from a resident shard",
                    format!(
                        "the shard holds {} particles; its targets and sources must be those ({n} targets from {offset:?}, {} sources)",
                        shard.num(),
                        pos.len()
                    ),
                ));
            }
        }
        let mut pts: Vec<[f32; 4]> = if shard.is_some() {
            Vec::new()
        } else {
            pos.iter()
                .zip(mass)
                .flat_map(|(&x, &m)| split(x, origin, m))
                .collect()
        };
        // Targets that are not sources follow the sources (never matched as themselves).
        let target0 = match offset {
            Some(o) => o,
            None => {
                pts.extend(targets.iter().flat_map(|&x| split(x, origin, 0.0)));
                pos.len()
            }
        };
        let mut base = Params([0; 40]);
        base.0[w::N_ALL] = pos.len() as u32;
        base.0[w::COUNT] = n as u32;
        base.0[w::TARGET0] = target0 as u32;
        base.0[w::ZERO] = 0;
        base.0[w::EPS2] = ((softening * softening) as f32).to_bits();
        base.0[w::R2MIN] = ((R2MIN_REL * side * side) as f32)
            .max(f32::MIN_POSITIVE)
            .to_bits();
        let host_perm: Vec<u32> = (0..n as u32).collect();
        let b_perm = self.storage("particle order", &host_perm)?;
        let b_pts = match shard {
            Some(shard) => shard.points(&b_perm, &[], origin, n).map_err(gpu_error)?,
            None => self.storage("particles (positions and masses)", &pts)?,
        };
        let unused = |name| self.ctx.storage(name, 16, REDUCE).map_err(gpu_error);
        let (dummy, d5, d6) = (
            unused("unused")?,
            unused("unused (5)")?,
            unused("unused (6)")?,
        );
        let out_bytes = (2 * n * 16) as u64;
        let b_out = self
            .ctx
            .storage_windowed("particle fields", out_bytes, REDUCE)
            .map_err(gpu_error)?;
        let group0 = self.bind0([&b_pts, &dummy, &dummy, &dummy, &dummy, &d5, &d6, &b_out])?;
        // Passes over source ranges: a tile of 64 sources costs 66 loop iterations.
        let per = ((self.loop_budget.saturating_sub(1)) / (WG + 2) * WG).max(WG) as usize;
        let params: Vec<Params> = (0..passes(pos.len(), per as u32))
            .map(|c| {
                let mut p = base.pass(c, per as u32);
                p.0[w::SRC0] = (c * per) as u32;
                p.0[w::SRC1] = ((c + 1) * per).min(pos.len()) as u32;
                p
            })
            .collect();
        let group1 = self.params_group(&params);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_bind_group(0, &group0.group, &[]);
            for slot in 0..params.len() {
                let groups = (n as u32).div_ceil(WG);
                let direct = &group0.compiled.pipelines[DIRECT];
                dispatch(&mut pass, direct, &group1, slot, groups);
            }
        }
        let upload = clock.elapsed().as_secs_f64();
        let clock = Instant::now();
        self.run(enc, "direct summation")?;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = GpuSplit {
            upload,
            p2p: clock.elapsed().as_secs_f64(),
            bytes_up: (pts.len() * 16 + host_perm.len() * 4) as u64,
            ..Default::default()
        };
        Ok(DeviceField {
            out: b_out,
            perm: b_perm,
            host_perm,
            n_local: n,
            g,
        })
    }
}

impl GpuForces {
    /// The FMM forces on the particles of the resident `shard` (the local particles of
    /// `sources`, as last read back), read back in the shard's order: the evaluation of a
    /// step of a resident simulation ([`GpuForces::fmm_field`]), for the bench.
    ///
    /// Errors: as [`GpuForces::fmm_field`].
    pub fn resident_fmm_forces(
        &self,
        fmm: &Fmm,
        sources: &SourceSet,
        g: f64,
        softening: f64,
        shard: &mut ResidentShard,
    ) -> Result<(Forces, FmmStats), NbodyError> {
        let (field, mut stats) = self.fmm_field(fmm, sources, g, softening, Some(shard))?;
        let out = self.read_field(&field)?;
        stats.seconds.l2p += self.last_split().download;
        Ok((out, stats))
    }
}

impl ForceDevice for GpuForces {
    fn fmm_forces(
        &self,
        fmm: &Fmm,
        sources: &SourceSet,
        g: f64,
        softening: f64,
    ) -> Result<(Forces, FmmStats), NbodyError> {
        let (field, mut stats) = self.fmm_field(fmm, sources, g, softening, None)?;
        let out = self.read_field(&field)?;
        stats.seconds.l2p += self.last_split().download;
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
        let field = self.direct_field(targets, offset, pos, mass, g, softening, None)?;
        self.read_field(&field)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
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

/// A Plummer sphere or `clumps` Gaussian clumps of `n` particles (the device tree's and
/// walk's tests).
#[cfg(test)]
fn test_particles(clumps: Option<u64>, n: u64, seed: u64) -> crate::Particles {
    let ic = match clumps {
        Some(clumps) => crate::InitialConditions::Clumps {
            n,
            clumps,
            total_mass: 1.0,
            box_size: 10.0,
            clump_radius: 0.3,
            velocity_dispersion: 0.0,
            seed,
        },
        None => crate::InitialConditions::Plummer {
            n,
            total_mass: 1.0,
            scale_radius: 1.0,
            max_radius: 30.0,
            seed,
        },
    };
    ic.generate(1.0, 0, 1, 1.0).unwrap()
}

#[cfg(test)]
mod tests {
    use super::check_indices;

    /// The P2P kernel's lanes: on a Plummer tree with leaves of 32 (about 10 particles
    /// each) at least 85% of the 64 invocations of a task sum pairs (one invocation per
    /// target would keep about 15% busy); with leaves of 64 or more every full task keeps
    /// all 64.
    #[test]
    fn p2p_tasks_keep_most_lanes_busy() {
        let p = super::test_particles(None, 20_000, 3);
        let pos = p.valid_pos();
        let mass = p.valid_mass();
        let tree = super::Tree::build_nodes(pos, mass, pos.len(), 32);
        let tasks = super::p2p_tasks(&tree);
        let use_ = super::p2p_lane_use(&tree, &tasks);
        let one_per_target = (tree.nodes.iter().filter(|n| n.is_leaf()).map(|n| n.count()))
            .sum::<usize>() as f64
            / (64 * tasks.len() / 2) as f64;
        println!("P2P lanes busy: {use_:.3} (one per target: {one_per_target:.3})");
        assert!(
            use_ >= 0.85 && one_per_target < 0.3,
            "{use_} {one_per_target}"
        );
        let big = super::Tree::build_nodes(pos, mass, pos.len(), 256);
        let full = super::p2p_tasks(&big);
        let full: Vec<u32> = full
            .chunks_exact(2)
            .filter(|t| big.nodes[t[0] as usize].end - t[1] as usize >= 64)
            .flatten()
            .copied()
            .collect();
        assert!(!full.is_empty());
        assert_eq!(super::p2p_lane_use(&big, &full), 1.0);
    }

    /// An array whose 32-bit word index would wrap is refused, naming it and the way out;
    /// arrays just below 2^32 words pass.
    #[test]
    fn indices_past_32_bits_are_refused_naming_the_array() {
        let fits = (u32::MAX - 1) as u64;
        assert!(check_indices(&[("the expansions", fits)]).is_ok());
        let e = check_indices(&[("the lists", 1), ("the expansions", 1 << 32)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the expansions") && e.contains("4294967296") && e.contains("mpirun -n R"),
            "{e}"
        );
    }
}
