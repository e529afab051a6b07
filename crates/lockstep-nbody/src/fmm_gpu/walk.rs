//! The dual tree walk on the GPU (`walk.wgsl`, docs/nbody.md "Forces on the GPU"): the
//! interaction lists of [`crate::fmm::Fmm::walk_lists`] built on the device from the tree's
//! nodes, centres and radii, so that neither the walk (ten times the tree's host time at
//! N = 1e6) nor its lists (303 MB there) cost the host anything.
//!
//! Two submissions and two host synchronisations per evaluation: the walk (one fixed
//! sequence of dispatches per step of the breadth-first walk, the frontier's size on the
//! device as indirect dispatch sizes), then the read of its entry count and of any capacity
//! it overflowed (the walk then runs again with the sizes it needed; the sizes that worked
//! are kept for the next evaluation); then the sort of the entries into rows, the rows and
//! the numbers the host plans the evaluation with (longest rows, the most source particles
//! of a P2P row, forced M2P entries, P2P pairs), read back as a few words.
//!
//! The lists are the host walk's, row by row as sets: a row's entries are in the order the
//! breadth-first walk found them, not the host's depth-first order, so a GPU evaluation
//! sums them in another order (the same bits on every run, not the host-list run's bits).

use std::sync::{Arc, Mutex};

use lockstep_gpu::{wgpu, GpuContext, GpuError, ReadRange};

use super::pipelines::{Array, Module};
use super::sort_scan::{
    args_buffer, record, scan_levels, sizes, Rec, Recorder, Size, M_ARGS, REC_BYTES, REDUCE, SCAN,
    SORT_TILE, WG,
};

/// The kernels' source: the shared ones, then the walk's.
const SHADER: &str = concat!(include_str!("sort_scan.wgsl"), include_str!("walk.wgsl"));
/// Words of the `meta` array and where `walk.wgsl` keeps its values.
const META_WORDS: usize = 64;
const M_FSIZE: usize = 0;
const M_ECOUNT: usize = 3;
const M_FLAG: usize = 4;
const M_NEED_F: usize = 5;
const M_NEED_E: usize = 6;
const M_MAXF: usize = 7;
const M_BASE: usize = 8;
const M_PAIRS: usize = 12;
const M_STATS: usize = 16;

/// The storage arrays of `walk.wgsl` (group 0, in binding order).
const ARRAYS: [Array; 9] = [
    Array::ro("nodes", "vec4<u32>", 16),
    Array::ro("geo", "vec4<f32>", 16),
    Array::rw("front_a", "vec2<u32>", 8),
    Array::rw("front_b", "vec2<u32>", 8),
    Array::rw("ent_a", "vec2<u32>", 8),
    Array::rw("ent_b", "vec2<u32>", 8),
    Array::rw("scan", "u32", 4),
    Array::rw("meta", "u32", 4),
    Array::rw("out", "u32", 4),
];

/// The entry points: the shared ones (`sort_scan.rs`), then the walk's.
const ENTRIES: [&str; 12] = [
    "scan_up",
    "scan_down",
    "sort_count",
    "sort_scatter",
    "walk_count",
    "walk_next",
    "walk_write",
    "walk_advance",
    "rows",
    "items",
    "stats_block",
    "stats_final",
];
const WALK_COUNT: usize = 4;
const WALK_NEXT: usize = 5;
const WALK_WRITE: usize = 6;
const WALK_ADVANCE: usize = 7;
const ROWS: usize = 8;
const ITEMS: usize = 9;
const STATS_BLOCK: usize = 10;
const STATS_FINAL: usize = 11;

/// The rules of the host walk ([`crate::fmm::Fmm::walk_lists`]) the device walk applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalkRules {
    /// Opening angle.
    pub theta: f64,
    /// Largest `n_A n_B` of a well-separated pair with a leaf target done by P2P.
    pub direct_max: usize,
    /// Largest non-leaf source node summed directly against a neighbouring target leaf.
    pub p2p_node_max: usize,
}

/// What the evaluation's plan needs of the lists, from either walk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ListShape {
    /// Entries of the M2L, M2P and P2P lists.
    pub counts: [usize; 3],
    /// Their longest rows.
    pub longest: [usize; 3],
    /// The most source particles of one P2P row.
    pub p2p_row_particles: usize,
    /// Imported cells that failed the opening test at a target leaf (forced M2P).
    pub forced: usize,
    /// Particle pairs of the P2P list, one-sided.
    pub p2p_pairs: u64,
}

/// The lists of a device walk: `out` holds the sources of the M2L, M2P then P2P entries
/// (`shape.counts` of each, in row order), then the row offsets of each kind (`[nn + 1]`
/// each, relative to the kind's first entry).
pub(crate) struct DeviceLists {
    /// `[counts.sum() + 3 (nn + 1)]` u32.
    pub out: wgpu::Buffer,
    /// Counts, longest rows and the rest.
    pub shape: ListShape,
    /// Tree nodes (rows per kind).
    pub nn: usize,
    /// Steps of the breadth-first walk recorded.
    pub steps: usize,
    /// Walks run (more than one when a capacity overflowed).
    pub runs: usize,
    /// The largest frontier.
    pub max_frontier: usize,
    /// Pairs the walk visited (each a frontier entry of one step).
    pub pairs: u64,
}

impl DeviceLists {
    /// Words of `out`.
    pub fn words(&self) -> usize {
        self.shape.counts.iter().sum::<usize>() + 3 * (self.nn + 1)
    }
}

/// Passes of the radix sort of the entries of a tree of `nn` nodes: 4 bits of the key
/// (`kind << kb | target`) each, an even count so that the result ends where it began.
fn sort_passes(nn: usize) -> u32 {
    (key_bits(nn) + 2).div_ceil(4).next_multiple_of(2)
}

/// Device-memory bytes of a walk that visited `pairs` pairs and sorted `entries` entries of
/// a tree of `nn` nodes: a traffic model for the bench, not a measurement. Per pair its
/// frontier entry read by the count and write kernels and written once as a child (24 B)
/// and its two nodes' words, centres and radii read by both kernels (128 B; an upper bound:
/// they stay in an H200's 50 MB L2 up to about 780,000 nodes); per entry its write (8 B), a
/// read, a read and a write per sort pass (24 B each) and the items kernel's read and write
/// (12 B); the row offsets (12 B per node).
pub(crate) fn modelled_bytes(pairs: u64, entries: u64, nn: usize) -> u64 {
    let passes = sort_passes(nn) as u64;
    pairs * (24 + 128) + entries * (8 + 24 * passes + 12) + 12 * (nn as u64 + 1)
}

/// Bits of an entry's target node in its sort key (`kind << kb | target`): `2^kb > nn`.
fn key_bits(nn: usize) -> u32 {
    32 - (nn as u32).leading_zeros()
}

/// The walk's kernels and the capacities that sufficed last time.
pub(crate) struct DeviceWalk {
    ctx: Arc<GpuContext>,
    module: Module,
    /// Frontier and entry capacities of the last walk that fitted.
    caps: Mutex<Option<(usize, usize)>>,
}

impl DeviceWalk {
    /// Compiles the kernels.
    ///
    /// Errors: [`GpuError::Device`].
    pub fn new(ctx: &Arc<GpuContext>) -> Result<DeviceWalk, GpuError> {
        let module = Module::new(ctx, "walk.wgsl", SHADER, &ARRAYS, REC_BYTES, &ENTRIES)?;
        Ok(DeviceWalk {
            ctx: ctx.clone(),
            module,
            caps: Mutex::new(None),
        })
    }

    /// The lists of the walk over the tree whose packed nodes are `nodes` (`fmm.wgsl`'s
    /// layout, `nn` of them, `depth` levels below the root) and whose node then imported
    /// cell centres and radii are `geo` (`[2 (nn + cells)]`: (hi.xyz, radius hi), (lo.xyz,
    /// radius lo), relative to the tree's cube centre), with the host walk's `rules`.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] naming the buffer; [`GpuError::Device`] (also
    /// a walk that did not end within its steps); [`GpuError::Timeout`].
    pub fn lists(
        &self,
        nodes: &wgpu::Buffer,
        b_geo: &wgpu::Buffer,
        (nn, cells, depth): (usize, usize, usize),
        rules: WalkRules,
    ) -> Result<DeviceLists, GpuError> {
        let (mut cap_f, mut cap_e) = self
            .caps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or((64 * nn + 4096, 64 * nn + 4096));
        // A pair of the k-th step has nodes k levels below the root between them, so the
        // walk ends within 2 depth + 1 steps.
        let steps = 2 * depth + 1;
        for run in 1..=12 {
            // Indices are u32 on the device: the two frontier scans' words, the entries
            // and the rows after them.
            let words = (2 * (cap_f + cap_f / 128 + 1024)).max(cap_e + 3 * (nn + 1));
            if words >= u32::MAX as usize {
                return Err(self.fail(&format!(
                    "it needs room for {} frontier pairs and {} list entries, more than 32-bit indices reach; run more ranks (mpirun -n R) or raise forces.leaf_size",
                    cap_f, cap_e
                )));
            }
            match self.walk(nodes, b_geo, (nn, cells, steps), rules, (cap_f, cap_e))? {
                Ok((walked, max_frontier)) => {
                    *self.caps.lock().unwrap_or_else(|p| p.into_inner()) = Some((cap_f, cap_e));
                    let pairs = walked.pairs;
                    let (out, shape) = self.rows(nodes, b_geo, nn, walked)?;
                    return Ok(DeviceLists {
                        out,
                        shape,
                        nn,
                        steps,
                        runs: run,
                        max_frontier,
                        pairs,
                    });
                }
                Err((need_f, need_e)) => {
                    // A frontier that overflowed stopped the walk (later steps may need
                    // more); entries that overflowed were counted to the end (exact, unless
                    // the frontier stopped the walk too).
                    if need_f > cap_f {
                        cap_f = (2 * cap_f).max(need_f + need_f / 4);
                    }
                    if need_e > cap_e {
                        cap_e = need_e.saturating_add(need_e / 16);
                    }
                }
            }
        }
        Err(self.fail("the walk's frontier or lists kept outgrowing their buffers"))
    }

    fn fail(&self, message: &str) -> GpuError {
        GpuError::Device {
            adapter: self.ctx.adapter.name.clone(),
            message: format!("N-body dual tree walk on the GPU: {message}"),
        }
    }

    /// One walk with frontier capacity `cap_f` and entry capacity `cap_e`: the entries (in
    /// `ent_a` of the returned buffers) and the largest frontier, or the sizes it needed.
    #[allow(clippy::type_complexity)]
    fn walk(
        &self,
        nodes: &wgpu::Buffer,
        geo: &wgpu::Buffer,
        (nn, cells, steps): (usize, usize, usize),
        rules: WalkRules,
        (cap_f, cap_e): (usize, usize),
    ) -> Result<Result<(Walked, usize), (usize, usize)>, GpuError> {
        let ctx = &self.ctx;
        let (seg_a, words_a) = scan_levels(0, cap_f as u64);
        let (seg_b, words_b) = scan_levels(words_a, cap_f as u64);
        let ent_words = cap_e as u64;
        let (_, sort_words) = scan_levels(0, 16 * ent_words.div_ceil(SORT_TILE));
        let stats_words = 8 * (nn as u64).div_ceil(SCAN) + 8;
        let scan_words = (words_a + words_b).max(sort_words).max(stats_words);
        let front_a = ctx.storage_windowed("walk frontier", 8 * cap_f as u64, REDUCE)?;
        let front_b = ctx.storage_windowed("walk frontier (next)", 8 * cap_f as u64, REDUCE)?;
        let ent_a = ctx.storage_windowed("walk entries", 8 * ent_words, REDUCE)?;
        let ent_b = ctx.storage_windowed("walk entries (sorted)", 8 * ent_words, REDUCE)?;
        let scan = ctx.storage_windowed("walk scans", 4 * scan_words, REDUCE)?;
        let meta = ctx.storage("walk state", 4 * META_WORDS as u64, REDUCE)?;
        let args = args_buffer(ctx);
        let none = ctx.storage("no lists yet", 16, REDUCE)?;
        let bound = self.module.bind(
            ctx,
            "walk buffers",
            &[
                nodes, geo, &front_a, &front_b, &ent_a, &ent_b, &scan, &meta, &none,
            ],
        )?;
        // The first frontier: (root, root) and (root, cell) for every imported cell.
        let mut first: Vec<[u32; 2]> = vec![[0, 0]];
        first.extend((0..cells).map(|k| [0, (nn + k) as u32 | (2 << 30)]));
        if first.len() > cap_f {
            return Ok(Err((first.len(), cap_e)));
        }
        ctx.write(&front_a, 0, &first);
        let mut m = [0u32; META_WORDS];
        m[M_FSIZE] = first.len() as u32;
        m[M_PAIRS] = first.len() as u32;
        m[M_MAXF] = first.len() as u32;
        m[M_ARGS..M_ARGS + 12].copy_from_slice(&sizes(first.len() as u64));
        ctx.write(&meta, 0, &m);
        ctx.write(&args, 0, &m[M_ARGS..M_ARGS + 16]);

        let th2 = rules.theta * rules.theta;
        let th2_hi = th2 as f32;
        let base = Rec {
            nn: nn as u32,
            direct_max: rules.direct_max.min(u32::MAX as usize) as u32,
            p2p_node_max: rules.p2p_node_max.min(u32::MAX as usize) as u32,
            th2: [th2_hi, (th2 - th2_hi as f64) as f32],
            cap_f: cap_f as u32,
            cap_e: cap_e as u32,
            kb: key_bits(nn),
            ..Default::default()
        };
        let mut r = Recorder::default();
        for step in 0..steps {
            let parity = (step % 2) as u32;
            let per_pair = Rec {
                parity,
                s: [seg_a.s[0], seg_b.s[0], 0, 0],
                ..base
            };
            r.push(WALK_COUNT, per_pair, Size::Indirect(4 * M_ARGS as u64));
            r.scan(base, seg_a, M_FSIZE as u32, 0, true);
            r.scan(base, seg_b, M_FSIZE as u32, 0, true);
            let totals = Rec {
                s: [seg_a.total(), seg_b.total(), 0, 0],
                ..base
            };
            r.push(WALK_NEXT, totals, Size::Direct(1));
            r.push(WALK_WRITE, per_pair, Size::Indirect(4 * M_ARGS as u64));
            r.push(WALK_ADVANCE, base, Size::Direct(1));
            r.passes.push(Vec::new());
        }
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        record(
            ctx,
            &self.module,
            &mut enc,
            &bound,
            &r,
            Some((&meta, &args)),
        );
        let raw = ctx.submit_and_read(
            enc,
            &[ReadRange {
                buffer: &meta,
                offset: 0,
                bytes: 4 * META_WORDS as u64,
            }],
        )?;
        let m: Vec<u32> = bytemuck::pod_collect_to_vec(&raw[0]);
        if m[M_FLAG] != 0 {
            let need_f = m[M_NEED_F] as usize;
            // After a frontier overflow the entries counted are a lower bound: grow them
            // as the frontier grows.
            let need_e = if m[M_FLAG] & 1 != 0 && m[M_FLAG] & 2 != 0 {
                (m[M_NEED_E] as usize).max(2 * cap_e)
            } else {
                m[M_NEED_E] as usize
            };
            return Ok(Err((need_f, need_e)));
        }
        if m[M_FSIZE] != 0 {
            return Err(self.fail(&format!(
                "{} pairs left after {steps} steps of a tree of depth below {}",
                m[M_FSIZE],
                steps / 2
            )));
        }
        let pairs = m[M_PAIRS] as u64 | ((m[M_PAIRS + 1] as u64) << 32);
        let walked = Walked {
            pairs,
            front_a,
            front_b,
            ent_a,
            ent_b,
            scan,
            meta,
            count: m[M_ECOUNT] as usize,
        };
        Ok(Ok((walked, m[M_MAXF] as usize)))
    }

    /// Sorts the entries of `walked` into rows: the lists' buffer and their shape.
    fn rows(
        &self,
        nodes: &wgpu::Buffer,
        geo: &wgpu::Buffer,
        nn: usize,
        walked: Walked,
    ) -> Result<(wgpu::Buffer, ListShape), GpuError> {
        let ctx = &self.ctx;
        let count = walked.count;
        let words = count + 3 * (nn + 1);
        let out = ctx.storage_windowed("interaction lists", 4 * words as u64, REDUCE)?;
        let bound = self.module.bind(
            ctx,
            "walk rows",
            &[
                nodes,
                geo,
                &walked.front_a,
                &walked.front_b,
                &walked.ent_a,
                &walked.ent_b,
                &walked.scan,
                &walked.meta,
                &out,
            ],
        )?;
        let kb = key_bits(nn);
        let ntiles = (count as u64).div_ceil(SORT_TILE);
        let (seg, _) = scan_levels(0, 16 * ntiles);
        let base = Rec {
            nn: nn as u32,
            kb,
            count: count as u32,
            ..Default::default()
        };
        let mut r = Recorder::default();
        r.sort(base, seg, count, sort_passes(nn));
        let groups = |n: usize| (n as u32).div_ceil(WG);
        r.push(ROWS, base, Size::Direct(groups(3 * (nn + 1))));
        r.push(ITEMS, base, Size::Direct(groups(count)));
        let blocks = (nn as u64).div_ceil(SCAN) as u32;
        r.push(STATS_BLOCK, base, Size::Direct(blocks));
        let fin = Rec {
            len: blocks,
            ..base
        };
        r.push(STATS_FINAL, fin, Size::Direct(1));
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        record(ctx, &self.module, &mut enc, &bound, &r, None);
        let raw = ctx.submit_and_read(
            enc,
            &[ReadRange {
                buffer: &walked.meta,
                offset: 0,
                bytes: 4 * META_WORDS as u64,
            }],
        )?;
        let m: Vec<u32> = bytemuck::pod_collect_to_vec(&raw[0]);
        let starts = [
            m[M_BASE] as usize,
            m[M_BASE + 1] as usize,
            m[M_BASE + 2] as usize,
        ];
        let counts = [
            starts[1] - starts[0],
            starts[2] - starts[1],
            count - starts[2],
        ];
        let s = &m[M_STATS..M_STATS + 7];
        let shape = ListShape {
            counts,
            longest: [s[0] as usize, s[1] as usize, s[2] as usize],
            p2p_row_particles: s[3] as usize,
            forced: s[4] as usize,
            p2p_pairs: s[5] as u64 | ((s[6] as u64) << 32),
        };
        Ok((out, shape))
    }
}

/// A finished walk's buffers and entry count, for [`DeviceWalk::rows`].
struct Walked {
    pairs: u64,
    front_a: wgpu::Buffer,
    front_b: wgpu::Buffer,
    ent_a: wgpu::Buffer,
    ent_b: wgpu::Buffer,
    scan: wgpu::Buffer,
    meta: wgpu::Buffer,
    count: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fmm::{Fmm, FmmParams, RemoteCell, SourceSet, WalkLists};
    use crate::fmm_gpu::{cube_centre, packed_nodes, walk_geo, GpuForces, ListsOf};

    fn particles(clumpy: bool, n: u64, seed: u64) -> crate::Particles {
        crate::fmm_gpu::test_particles(clumpy.then_some(6), n, seed)
    }

    /// The rows of compressed rows `(offsets, items)`, each sorted.
    fn sorted_rows(off: &[u32], items: &[u32]) -> Vec<Vec<u32>> {
        off.windows(2)
            .map(|w| {
                let mut r = items[w[0] as usize..w[1] as usize].to_vec();
                r.sort_unstable();
                r
            })
            .collect()
    }

    /// Walks `sources` on the host and on the device (whose frontier and entry buffers
    /// start at `caps`, if given) and checks that every row of every list holds the same
    /// sources and that the shapes agree; returns the device walk's runs.
    fn same_lists(
        gpu: &GpuForces,
        what: &str,
        params: FmmParams,
        sources: &SourceSet,
        caps: Option<(usize, usize)>,
    ) -> usize {
        let fmm = Fmm::new(params).unwrap();
        let tree = fmm.build_tree_nodes(sources);
        let remote = sources.remote_cells;
        let host: WalkLists = fmm.walk_lists(&tree, remote);
        let ctx = gpu.context();
        let nodes = ctx
            .storage_from("tree nodes", &packed_nodes(&tree), "-")
            .unwrap();
        let geo = walk_geo(&tree, remote, cube_centre(&tree));
        let geo = ctx
            .storage_from("node centres and radii", &geo, "-")
            .unwrap();
        let (direct_max, p2p_node_max) = fmm.walk_limits();
        let rules = WalkRules {
            theta: params.theta,
            direct_max,
            p2p_node_max,
        };
        if let Some(c) = caps {
            *gpu.walk.caps.lock().unwrap() = Some(c);
        }
        let nn = tree.nodes.len();
        let dev = gpu
            .walk
            .lists(&nodes, &geo, (nn, remote.len(), tree.depth()), rules)
            .unwrap();
        let out: Vec<u32> = ctx.read(&dev.out, 0, dev.words()).unwrap();
        let m: usize = dev.shape.counts.iter().sum();
        let mut start = 0;
        for (k, (name, (off, items))) in
            [("M2L", &host.m2l), ("M2P", &host.m2p), ("P2P", &host.p2p)]
                .into_iter()
                .enumerate()
        {
            let c = dev.shape.counts[k];
            let d_off = &out[m + k * (nn + 1)..m + (k + 1) * (nn + 1)];
            let d_items = &out[start..start + c];
            start += c;
            let (dr, hr) = (sorted_rows(d_off, d_items), sorted_rows(off, items));
            if let Some(t) = (0..nn).find(|&t| dr[t] != hr[t]) {
                panic!(
                    "{what}: {name} rows differ first at node {t} of {nn} ({} vs {} entries): device {:?}, host {:?}; shapes {:?} vs {:?}",
                    d_items.len(),
                    items.len(),
                    dr[t],
                    hr[t],
                    dev.shape,
                    ListsOf::Host(&host).shape(&tree)
                );
            }
        }
        assert_eq!(
            dev.shape,
            ListsOf::Host(&host).shape(&tree),
            "{what}: shapes"
        );
        println!(
            "{what}: {} nodes, lists {:?}, {} steps, {} run(s), largest frontier {}",
            nn, dev.shape.counts, dev.steps, dev.runs, dev.max_frontier
        );
        dev.runs
    }

    /// The device walk builds the host walk's lists, row by row: Plummer and clumpy
    /// systems, several orders, opening angles and leaf sizes (so P2P pairs, M2P and the
    /// direct sums of small source subtrees all occur), imported particles and cells (one
    /// of them failing the opening test: forced M2P), coincident particles, one particle;
    /// and buffers too small at first (the walk runs again with the sizes it needed).
    #[test]
    fn device_walk_builds_the_host_walks_lists() {
        let gpu = GpuForces::open(None, 0).unwrap();
        let base = FmmParams::default();
        for (clumpy, n, order, theta, leaf_size) in [
            (false, 3000, 3, 0.6, 16),
            (true, 4000, 6, 0.5, 32),
            (false, 2500, 4, 0.9, 8),
            (true, 2000, 2, 0.4, 64),
        ] {
            let p = particles(clumpy, n, 7 + n);
            let params = FmmParams {
                order,
                theta,
                leaf_size,
                ..base
            };
            let src = SourceSet::local(p.valid_pos(), p.valid_mass());
            let what =
                format!("clumpy {clumpy}, n {n}, p {order}, theta {theta}, leaf {leaf_size}");
            same_lists(&gpu, &what, params, &src, None);
        }
        // Imported particles and cells, as a rank of a sharded run receives them.
        let p = particles(false, 3000, 3);
        let q = particles(true, 800, 4);
        let nterms = (4 * 5 * 6) / 6;
        let cell = |center: [f64; 3], radius: f64| RemoteCell {
            center,
            radius,
            multipole: vec![0.0; nterms],
        };
        let cells = vec![
            cell([40.0, 0.0, 0.0], 2.0),
            cell([0.0, -35.0, 5.0], 4.0),
            cell([0.5, 0.2, 0.1], 0.5), // inside the system: fails the opening test
        ];
        let src = SourceSet {
            pos: p.valid_pos(),
            mass: p.valid_mass(),
            remote_pos: q.valid_pos(),
            remote_mass: q.valid_mass(),
            remote_cells: &cells,
        };
        let params = FmmParams {
            order: 3,
            leaf_size: 16,
            ..base
        };
        same_lists(&gpu, "imported particles and cells", params, &src, None);
        // 300 coincident particles among others, and one particle alone.
        let mut pos = p.valid_pos()[..1000].to_vec();
        pos.extend(std::iter::repeat_n([0.25, -0.5, 0.125], 300));
        let mass = vec![1e-3; pos.len()];
        let src = SourceSet::local(&pos, &mass);
        same_lists(&gpu, "coincident", params, &src, None);
        let one = SourceSet::local(&pos[..1], &mass[..1]);
        same_lists(&gpu, "one particle", params, &one, None);
        // Buffers far too small: the walk runs again.
        let src = SourceSet::local(p.valid_pos(), p.valid_mass());
        let runs = same_lists(&gpu, "tiny buffers", params, &src, Some((8, 8)));
        assert!(runs > 1, "the walk should have outgrown its buffers");
    }
}
