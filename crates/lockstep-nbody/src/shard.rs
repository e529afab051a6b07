//! Sharding across ranks (docs/nbody.md, "Sharding"; issue 9): Morton sample-sort
//! redistribution and FMM forces with a locally essential tree exchanged through a
//! [`Communicator`]. Every function here is a collective: every rank calls it in the same
//! order, and errors that depend on one rank's data are agreed on by all ranks first.

use lockstep_comm::{CommError, CommExt, Communicator, ReduceOp};

use crate::fmm::tree::{cube_from_bounds, morton_key, Tree};
use crate::fmm::{Fmm, FmmStats, RemoteCell, SourceSet};
use crate::fmm_gpu::{DeviceField, GpuForces, ResidentShard};
use crate::integrate::{
    simulate_on_device, simulate_with, Diagnostics, ForceSettings, Method, NbodySimulateOptions,
};
use crate::{Forces, NbodyError, Particles};

impl From<CommError> for NbodyError {
    fn from(e: CommError) -> Self {
        NbodyError::Comm(e.to_string())
    }
}

/// Global bounding cube (corner, side) of the valid particles of all ranks (all-reduce).
pub fn global_bounding_cube<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
) -> Result<([f64; 3], f64), NbodyError> {
    let mut mn = [f64::INFINITY; 3];
    let mut mx = [f64::NEG_INFINITY; 3];
    for x in p.valid_pos() {
        for k in 0..3 {
            mn[k] = mn[k].min(x[k]);
            mx[k] = mx[k].max(x[k]);
        }
    }
    comm.all_reduce(&mut mn, ReduceOp::Min)?;
    comm.all_reduce(&mut mx, ReduceOp::Max)?;
    Ok(cube_from_bounds(mn, mx))
}

/// What a redistribution moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RedistributeStats {
    /// Particles on this rank afterwards.
    pub num: usize,
    /// Bytes this rank sent in both exchanges.
    pub bytes_sent: usize,
    /// Largest rank count over the mean count (1 = perfectly balanced).
    pub imbalance: f64,
}

/// One particle on the wire: position, velocity, mass (f64 bits) and id.
type Record = [u64; 8];

fn record(p: &Particles, i: usize) -> Record {
    let (x, v) = (p.pos[i], p.vel[i]);
    [
        x[0].to_bits(),
        x[1].to_bits(),
        x[2].to_bits(),
        v[0].to_bits(),
        v[1].to_bits(),
        v[2].to_bits(),
        p.mass[i].to_bits(),
        p.id[i],
    ]
}

fn rec_pos(r: &Record) -> [f64; 3] {
    [
        f64::from_bits(r[0]),
        f64::from_bits(r[1]),
        f64::from_bits(r[2]),
    ]
}

/// Samples per rank for the splitters of the sample sort.
const SAMPLES: usize = 64;

/// Moves every particle to the rank owning its Morton-key range: a sample sort (every rank
/// contributes `SAMPLES` regularly spaced keys weighted by its count, all ranks agree on the
/// splitters, one `all_to_all_v`) followed by an exact rebalancing exchange along the global
/// key order, so rank `r` ends with particles `[floor(r N/size), floor((r+1) N/size))` of the
/// z-order (ties broken by id; the split of [`crate::particles::rank_range`], so a shard sized for
/// its initial share always fits, and ranks may end with none). Particles that do not fit the padded arrays are a
/// [`NbodyError::CapacityOverflow`] on every rank, naming `capacity_factor`.
pub fn redistribute<C: Communicator + ?Sized>(
    comm: &C,
    p: &mut Particles,
) -> Result<RedistributeStats, NbodyError> {
    let (rank, size) = (comm.rank(), comm.size());
    let (lo, side) = global_bounding_cube(comm, p)?;
    let key_of = |x: [f64; 3]| morton_key(x, lo, side);
    let mut keyed: Vec<(u64, u64, usize)> =
        (0..p.num).map(|i| (key_of(p.pos[i]), p.id[i], i)).collect();
    keyed.sort_unstable();
    // Splitters from weighted samples.
    let mut samples = [u64::MAX; SAMPLES];
    if p.num > 0 {
        for (k, s) in samples.iter_mut().enumerate() {
            *s = keyed[((2 * k + 1) * p.num) / (2 * SAMPLES)].0;
        }
    }
    let all_samples = comm.all_gather_vec(&samples)?;
    let counts = comm.all_gather_vec(&[p.num as u64])?;
    let total: u64 = counts.iter().sum();
    let mut weighted: Vec<(u64, f64)> = all_samples
        .iter()
        .enumerate()
        .filter(|(j, _)| counts[j / SAMPLES] > 0)
        .map(|(j, &k)| (k, counts[j / SAMPLES] as f64 / SAMPLES as f64))
        .collect();
    weighted.sort_by_key(|a| a.0);
    let mut splitters = Vec::with_capacity(size.saturating_sub(1));
    let mut cum = 0.0;
    let mut next = 1;
    for &(k, w) in &weighted {
        cum += w;
        while next < size && cum >= next as f64 * total as f64 / size as f64 {
            splitters.push(k);
            next += 1;
        }
    }
    while splitters.len() < size - 1 {
        splitters.push(u64::MAX);
    }
    let mut send = Vec::with_capacity(p.num);
    let mut send_counts = vec![0usize; size];
    for &(k, _, i) in &keyed {
        let d = splitters.partition_point(|&s| s <= k);
        send_counts[d] += 1;
        send.push(record(p, i));
    }
    let mut bytes_sent = send.len() * std::mem::size_of::<Record>();
    let (recv, _) = comm.all_to_all_v(&send, &send_counts)?;
    let mut recv: Vec<(u64, u64, Record)> = recv
        .into_iter()
        .map(|r| (key_of(rec_pos(&r)), r[7], r))
        .collect();
    recv.sort_unstable_by_key(|a| (a.0, a.1));
    // Exact rebalancing along the global order (ranks now hold increasing key ranges).
    let counts = comm.all_gather_vec(&[recv.len() as u64])?;
    let offset: u64 = counts[..rank].iter().sum();
    let mut send_counts = vec![0usize; size];
    for (j, _) in recv.iter().enumerate() {
        // Rank d owns global positions [floor(d N / size), floor((d+1) N / size)), the same
        // split as the initial conditions (`particles::rank_range`), so a rank never receives more
        // particles than it was sized for; with N < size some ranks own none.
        let g = offset + j as u64;
        let d = (((g as u128 + 1) * size as u128 - 1) / total.max(1) as u128) as usize;
        send_counts[d.min(size - 1)] += 1;
    }
    let send: Vec<Record> = recv.iter().map(|r| r.2).collect();
    bytes_sent += send.len() * std::mem::size_of::<Record>();
    let (mine, _) = comm.all_to_all_v(&send, &send_counts)?;
    let overflow = comm.all_reduce_scalar(u64::from(mine.len() > p.capacity()), ReduceOp::Max)?;
    if overflow > 0 {
        return Err(NbodyError::CapacityOverflow {
            rank,
            needed: mine
                .len()
                .max(p.capacity() + usize::from(mine.len() > p.capacity())),
            capacity: p.capacity(),
        });
    }
    for (i, r) in mine.iter().enumerate() {
        p.pos[i] = rec_pos(r);
        p.vel[i] = [
            f64::from_bits(r[3]),
            f64::from_bits(r[4]),
            f64::from_bits(r[5]),
        ];
        p.mass[i] = f64::from_bits(r[6]);
        p.id[i] = r[7];
    }
    for i in mine.len()..p.capacity() {
        p.pos[i] = [0.0; 3];
        p.vel[i] = [0.0; 3];
        p.mass[i] = 0.0;
        p.id[i] = 0;
    }
    p.num = mine.len();
    let max = comm.all_reduce_scalar(p.num as u64, ReduceOp::Max)?;
    let mean = total as f64 / size as f64;
    Ok(RedistributeStats {
        num: p.num,
        bytes_sent,
        imbalance: if mean > 0.0 { max as f64 / mean } else { 1.0 },
    })
}

/// Bounding boxes per rank describing its domain in the locally essential tree exchange.
const DOMAIN_BOXES: usize = 4096;

/// Nodes covering all particles of `tree` exactly once: the deepest level with at most
/// `max` such nodes (its nodes plus the leaves above it).
fn cover_nodes(tree: &crate::fmm::tree::Tree, max: usize) -> Vec<usize> {
    let nodes = &tree.nodes;
    let mut best = vec![0usize];
    for level in 1..tree.level_start.len() - 1 {
        let cover: Vec<usize> = (0..nodes.len())
            .filter(|&i| nodes[i].level == level || (nodes[i].level < level && nodes[i].is_leaf()))
            .collect();
        if cover.len() > max {
            break;
        }
        best = cover;
    }
    best
}

/// Work and traffic of one sharded force evaluation on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardForceStats {
    /// The local FMM (with imported sources).
    pub fmm: FmmStats,
    /// Multipole cells sent to other ranks.
    pub cells_sent: usize,
    /// Particles sent to other ranks.
    pub particles_sent: usize,
    /// Bytes sent in the locally essential tree exchange.
    pub bytes_sent: usize,
}

/// Globally correct gravity on this rank's valid particles: every rank builds its tree,
/// sends every other rank its locally essential tree (the multipoles of nodes with
/// `r_B < theta dist(z_B, receiver's domain boxes)`, the particles of leaves that fail it)
/// with two `all_to_all_v` exchanges, and evaluates its FMM with the imported sources.
pub fn sharded_forces<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
    fmm: &Fmm,
    g: f64,
    softening: f64,
) -> Result<(Forces, ShardForceStats), NbodyError> {
    let imported = exchange_essential(comm, p, fmm)?;
    let (forces, st) = fmm.forces(&imported.sources(p), g, softening)?;
    Ok((forces, imported.stats(st)))
}

/// What a rank imports in the locally essential tree exchange, and what it sent.
struct Imported {
    cells: Vec<RemoteCell>,
    pos: Vec<[f64; 3]>,
    mass: Vec<f64>,
    cells_sent: usize,
    particles_sent: usize,
    bytes_sent: usize,
}

impl Imported {
    /// The sources of this rank's evaluation: its particles `p` and the imports.
    fn sources<'a>(&'a self, p: &'a Particles) -> SourceSet<'a> {
        SourceSet {
            pos: p.valid_pos(),
            mass: p.valid_mass(),
            remote_pos: &self.pos,
            remote_mass: &self.mass,
            remote_cells: &self.cells,
        }
    }

    fn stats(&self, fmm: FmmStats) -> ShardForceStats {
        ShardForceStats {
            fmm,
            cells_sent: self.cells_sent,
            particles_sent: self.particles_sent,
            bytes_sent: self.bytes_sent,
        }
    }
}

/// The locally essential tree exchange of [`sharded_forces`] (two `all_to_all_v`).
fn exchange_essential<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
    fmm: &Fmm,
) -> Result<Imported, NbodyError> {
    let (rank, size) = (comm.rank(), comm.size());
    let (pos, mass) = (p.valid_pos(), p.valid_mass());
    let tree = if pos.is_empty() {
        None
    } else {
        Some(fmm.build_tree(&SourceSet::local(pos, mass)))
    };
    let boxes = comm.all_gather_vec(&domain_boxes(tree.as_ref(), pos))?;
    let nt = fmm.nterms();
    let cell_len = 4 + nt;
    let mut send = EssentialSend {
        theta: fmm.params().theta,
        nt,
        cells: Vec::new(),
        cell_counts: vec![0usize; size],
        parts: Vec::new(),
        part_counts: vec![0usize; size],
    };
    if let Some(tree) = &tree {
        for d in (0..size).filter(|&d| d != rank) {
            let bxs: Vec<&[f64]> = boxes[6 * DOMAIN_BOXES * d..6 * DOMAIN_BOXES * (d + 1)]
                .chunks_exact(6)
                .filter(|b| b[0] <= b[3])
                .collect();
            if !bxs.is_empty() {
                send.add_essential_tree(d, tree, pos, mass, &bxs);
            }
        }
    }
    let (cells_recv, _) = comm.all_to_all_v(&send.cells, &send.cell_counts)?;
    let (parts_recv, _) = comm.all_to_all_v(&send.parts, &send.part_counts)?;
    Ok(Imported {
        cells: cells_recv
            .chunks_exact(cell_len)
            .map(|c| RemoteCell {
                center: [c[0], c[1], c[2]],
                radius: c[3],
                multipole: c[4..].to_vec(),
            })
            .collect(),
        pos: parts_recv
            .chunks_exact(4)
            .map(|c| [c[0], c[1], c[2]])
            .collect(),
        mass: parts_recv.chunks_exact(4).map(|c| c[3]).collect(),
        cells_sent: send.cells.len() / cell_len,
        particles_sent: send.parts.len() / 4,
        bytes_sent: 8 * (send.cells.len() + send.parts.len()),
    })
}

/// This rank's domain for the exchange, flattened: the bounding boxes
/// `[xmin, ymin, zmin, xmax, ymax, zmax]` of up to [`DOMAIN_BOXES`] top nodes of the local
/// tree (a tight cover of the rank's particles); unused slots are inverted boxes.
fn domain_boxes(tree: Option<&Tree>, pos: &[[f64; 3]]) -> Vec<f64> {
    const EMPTY: [f64; 6] = [
        f64::INFINITY,
        f64::INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NEG_INFINITY,
        f64::NEG_INFINITY,
    ];
    let mut mine = vec![EMPTY; DOMAIN_BOXES];
    if let Some(tree) = tree {
        for (slot, i) in cover_nodes(tree, DOMAIN_BOXES).into_iter().enumerate() {
            let nd = &tree.nodes[i];
            for k in nd.start..nd.end {
                let j = tree.perm[k];
                for c in 0..3 {
                    mine[slot][c] = mine[slot][c].min(pos[j][c]);
                    mine[slot][3 + c] = mine[slot][3 + c].max(pos[j][c]);
                }
            }
        }
    }
    mine.iter().flatten().copied().collect()
}

/// The send buffers of the locally essential tree exchange, in destination order: cells
/// `[cx, cy, cz, radius, multipole...]` and particles `[x, y, z, m]`, with the `f64` count
/// per destination rank.
struct EssentialSend {
    /// The opening angle.
    theta: f64,
    /// Multipole terms per cell.
    nt: usize,
    cells: Vec<f64>,
    cell_counts: Vec<usize>,
    parts: Vec<f64>,
    part_counts: Vec<usize>,
}

impl EssentialSend {
    /// Appends what rank `d` (domain boxes `bxs`) needs of the local `tree`: the multipole
    /// of every outermost node that passes the opening criterion at all of `bxs`, the
    /// particles of the leaves that fail it.
    fn add_essential_tree(
        &mut self,
        d: usize,
        tree: &Tree,
        pos: &[[f64; 3]],
        mass: &[f64],
        bxs: &[&[f64]],
    ) {
        let (theta, nt) = (self.theta, self.nt);
        let (c0, p0) = (self.cells.len(), self.parts.len());
        let mut stack = vec![0usize];
        while let Some(i) = stack.pop() {
            let nd = &tree.nodes[i];
            // Distance from the node centre to the receiver's box: every receiving
            // particle sees the node under an angle below theta (tree-code criterion),
            // so the multipole is accurate at any of them (M2L or M2P there).
            let dist = bxs
                .iter()
                .map(|bx| {
                    (0..3)
                        .map(|k| {
                            (bx[k] - nd.center[k])
                                .max(nd.center[k] - bx[3 + k])
                                .max(0.0)
                                .powi(2)
                        })
                        .sum::<f64>()
                })
                .fold(f64::INFINITY, f64::min)
                .sqrt();
            if nd.radius < theta * dist {
                self.cells.extend_from_slice(&[
                    nd.center[0],
                    nd.center[1],
                    nd.center[2],
                    nd.radius,
                ]);
                self.cells.extend_from_slice(tree.multipole(i, nt));
            } else if nd.is_leaf() {
                for k in nd.start..nd.end {
                    let j = tree.perm[k];
                    self.parts
                        .extend_from_slice(&[pos[j][0], pos[j][1], pos[j][2], mass[j]]);
                }
            } else {
                stack.extend(nd.children().rev());
            }
        }
        self.cell_counts[d] = self.cells.len() - c0;
        self.part_counts[d] = self.parts.len() - p0;
    }
}

/// Sums per-rank diagnostics over all ranks (one all-reduce of 9 values).
pub fn reduce_diagnostics<C: Communicator + ?Sized>(
    comm: &C,
    d: &mut Diagnostics,
) -> Result<(), NbodyError> {
    let mut v = [
        d.kinetic,
        d.potential,
        d.momentum_scale,
        d.momentum[0],
        d.momentum[1],
        d.momentum[2],
        d.angular_momentum[0],
        d.angular_momentum[1],
        d.angular_momentum[2],
    ];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    d.kinetic = v[0];
    d.potential = v[1];
    d.momentum_scale = v[2];
    d.momentum = [v[3], v[4], v[5]];
    d.angular_momentum = [v[6], v[7], v[8]];
    Ok(())
}

/// Globally correct gravity on this rank's particles with the method of `settings`: FMM
/// through [`sharded_forces`], or direct summation over the all-gathered particles.
pub fn sharded_gravity<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
    settings: &ForceSettings,
    fmm: &Fmm,
    g: f64,
) -> Result<(Forces, ShardForceStats), NbodyError> {
    match settings.method {
        Method::Fmm => sharded_forces(comm, p, fmm, g, settings.softening),
        Method::Direct => {
            let (pos, mass, offset, bytes_sent) = gather_all(comm, p)?;
            let f = match fmm.device() {
                Some(d) => d.direct_forces(
                    p.valid_pos(),
                    Some(offset),
                    &pos,
                    &mass,
                    g,
                    settings.softening,
                )?,
                None => crate::direct::direct_on(
                    p.valid_pos(),
                    Some(offset),
                    &pos,
                    &mass,
                    g,
                    settings.softening,
                ),
            };
            Ok((
                f,
                ShardForceStats {
                    bytes_sent,
                    ..Default::default()
                },
            ))
        }
    }
}

/// Every rank's particles for direct sums: positions and masses in rank order, where this
/// rank's begin, and the bytes this rank sent.
type Gathered = (Vec<[f64; 3]>, Vec<f64>, usize, usize);

/// [`Gathered`] by one all-gather of the counts and one of the particles.
fn gather_all<C: Communicator + ?Sized>(comm: &C, p: &Particles) -> Result<Gathered, NbodyError> {
    let counts = comm.all_gather_vec(&[p.num as u64])?;
    let maxn = *counts.iter().max().unwrap_or(&0) as usize;
    let mut mine = vec![[0.0f64; 4]; maxn];
    for i in 0..p.num {
        mine[i] = [p.pos[i][0], p.pos[i][1], p.pos[i][2], p.mass[i]];
    }
    let flat: Vec<f64> = mine.iter().flatten().copied().collect();
    let all = comm.all_gather_vec(&flat)?;
    let mut pos = Vec::new();
    let mut mass = Vec::new();
    let mut offset = 0;
    for (r, &c) in counts.iter().enumerate() {
        if r == comm.rank() {
            offset = pos.len();
        }
        for k in 0..c as usize {
            let e = &all[(r * maxn + k) * 4..(r * maxn + k) * 4 + 4];
            pos.push([e[0], e[1], e[2]]);
            mass.push(e[3]);
        }
    }
    Ok((pos, mass, offset, 8 * flat.len()))
}

/// [`sharded_gravity`] on the GPU of `gpu` with the field left on the device for a resident
/// shard ([`crate::fmm_gpu::ResidentShard`]): the same exchange over host MPI, the imported
/// multipoles and particles uploaded; with `shard` (holding `p`'s particles) the FMM takes
/// the local positions from it ([`GpuForces::fmm_field`]).
///
/// Errors: as [`sharded_gravity`].
pub fn sharded_field<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
    settings: &ForceSettings,
    fmm: &Fmm,
    gpu: &GpuForces,
    g: f64,
    shard: Option<&mut ResidentShard>,
) -> Result<DeviceField, NbodyError> {
    let eps = settings.softening;
    let field = match settings.method {
        Method::Fmm => {
            let imported = exchange_essential(comm, p, fmm)?;
            gpu.fmm_field(fmm, &imported.sources(p), g, eps, shard)?.0
        }
        Method::Direct => {
            let (pos, mass, offset, _) = gather_all(comm, p)?;
            // One rank: its shard holds every source, so they need not be uploaded.
            let shard = if comm.size() == 1 { shard } else { None };
            gpu.direct_field(p.valid_pos(), Some(offset), &pos, &mass, g, eps, shard)?
        }
    };
    NbodyError::check_interrupt()?;
    Ok(field)
}

/// [`crate::simulate`] across the ranks of `comm`: the particles are first redistributed
/// (z-ordered layout, they stay there), then every step evaluates globally correct forces
/// with one locally essential tree exchange, and the diagnostics passed to `on_output` and
/// returned are sums over all ranks. With forces on a GPU and `opts.keep_on_device`, each
/// rank keeps its shard on its device between steps
/// ([`crate::integrate::simulate_on_device`]): the positions come to the host each step for the tree,
/// the exchange and outputs, the velocities only for outputs.
pub fn simulate_sharded<C: Communicator + ?Sized>(
    comm: &C,
    particles: &mut Particles,
    ts: &[f64],
    settings: &ForceSettings,
    g: f64,
    opts: &NbodySimulateOptions,
    on_output: impl FnMut(usize, &Particles, &Diagnostics) -> Result<(), NbodyError>,
    on_step: impl FnMut(usize),
) -> Result<Vec<Diagnostics>, NbodyError> {
    let fmm = settings.solver(crate::fmm_gpu::device_slot(comm.rank()))?;
    redistribute(comm, particles)?;
    if opts.keep_on_device {
        if let Some(gpu) = crate::fmm_gpu::gpu_of(&fmm) {
            return Ok(simulate_on_device(
                particles,
                ts,
                opts,
                gpu.context(),
                true,
                |p, shard| sharded_field(comm, p, settings, &fmm, gpu, g, Some(shard)),
                |d| reduce_diagnostics(comm, d),
                on_output,
                on_step,
            )?
            .0);
        }
    }
    simulate_with(
        particles,
        ts,
        opts,
        |p| Ok(sharded_gravity(comm, p, settings, &fmm, g)?.0),
        |d| reduce_diagnostics(comm, d),
        on_output,
        on_step,
    )
}

/// Bits of a temporary id that hold the particle's index on its original rank.
const INDEX_BITS: u32 = 40;

/// [`sharded_forces`] with the results returned to the original rank and index: the
/// particles of `p` are left where they are; a copy is redistributed along the Morton order
/// (its ids temporarily replaced by `(rank, index)` tags), forces are computed there, and
/// one more `all_to_all_v` sends each particle's acceleration and potential home. Output
/// `[p.num]` in `p`'s order.
pub fn sharded_forces_in_place<C: Communicator + ?Sized>(
    comm: &C,
    p: &Particles,
    fmm: &Fmm,
    g: f64,
    softening: f64,
) -> Result<(Forces, ShardForceStats), NbodyError> {
    let (rank, size) = (comm.rank(), comm.size());
    if p.num as u64 >= 1 << INDEX_BITS || size as u64 >= 1 << (64 - INDEX_BITS) {
        return Err(NbodyError::param(
            "sharded_forces_in_place",
            format!("{} particles on rank {rank} of {size}", p.num),
            "at most 2^40 particles per rank and 2^24 ranks; use the z-ordered layout (sharded_forces)",
        ));
    }
    let share = (p.num_total as usize).div_ceil(size.max(1)) + 1;
    let mut q = Particles::with_capacity(p.num.max(share), p.num_total);
    for i in 0..p.num {
        q.push(
            p.pos[i],
            p.vel[i],
            p.mass[i],
            ((rank as u64) << INDEX_BITS) | i as u64,
            rank,
        )?;
    }
    redistribute(comm, &mut q)?;
    let (f, stats) = sharded_forces(comm, &q, fmm, g, softening)?;
    let mut order: Vec<usize> = (0..q.num).collect();
    order.sort_by_key(|&i| q.id[i]);
    let mut send = Vec::with_capacity(5 * q.num);
    let mut counts = vec![0usize; size];
    for &i in &order {
        let home = (q.id[i] >> INDEX_BITS) as usize;
        counts[home] += 5;
        send.extend_from_slice(&[
            f64::from_bits(q.id[i] & ((1 << INDEX_BITS) - 1)),
            f.acc[i][0],
            f.acc[i][1],
            f.acc[i][2],
            f.pot[i],
        ]);
    }
    let (back, _) = comm.all_to_all_v(&send, &counts)?;
    let mut out = Forces::zeros(p.num);
    let mut seen = 0usize;
    for r in back.chunks_exact(5) {
        let i = r[0].to_bits() as usize;
        if i < p.num {
            out.acc[i] = [r[1], r[2], r[3]];
            out.pot[i] = r[4];
            seen += 1;
        }
    }
    if seen != p.num {
        return Err(NbodyError::Comm(format!(
            "rank {rank} got {seen} of its {} particles' forces back",
            p.num
        )));
    }
    Ok((out, stats))
}
