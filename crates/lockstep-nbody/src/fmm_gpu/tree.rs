//! The FMM's Morton tree built on the GPU from a resident shard's positions (`tree.wgsl`,
//! docs/nbody.md "Forces on the GPU"), so that a step of a resident simulation needs no
//! tree on the host: the host reads back the nodes (their ranges, centres, radii and target
//! counts, 64 B per node) and the particle order (4 B per particle) for the plan and the
//! outputs, and the device keeps them for the walk and the FMM's kernels.
//!
//! One submission and two host synchronisations: the build (bounding box, cube, keys, their
//! radix sort, the nodes level by level with the level sizes on the device, the geometry in
//! chunks of 1,024 particles so that a large node is many workgroups),
//! then the read of the node count (and whether the node buffer overflowed: the build then
//! runs again with the size it needed, kept for the next evaluation), then the read of the
//! nodes and the order.
//!
//! The tree is the host's `Tree::build_nodes_in` in the same cube, node for node, as long as
//! no particle lies within about 2^-47 of a cell edge of its key (the device's keys come from
//! a double-float difference, the host's from an f64 one); centres and radii agree to about
//! 1e-14 relative (double-float sums in another order).

use std::sync::{Arc, Mutex};

use lockstep_gpu::{wgpu, GpuContext, GpuError, ReadRange};

use super::pipelines::{Array, Module};
use super::sort_scan::{
    args_buffer, record, scan_levels, sizes, Rec, Recorder, Size, M_ARGS, REC_BYTES, REDUCE,
    SORT_TILE, WG,
};
use crate::direct::SoA;
use crate::fmm::tree::{Node, Tree, MORTON_BITS};

/// The kernels' source: the shared ones, then the tree's.
const SHADER: &str = concat!(include_str!("sort_scan.wgsl"), include_str!("tree.wgsl"));
/// Words of the `meta` array and where `tree.wgsl` keeps its values.
const META_WORDS: usize = 96;
const T_LS: usize = 0;
const T_GEO_ARGS: usize = 44;
const T_CNT: usize = 48;
const T_FLAG: usize = 72;
const T_NEED: usize = 73;
const T_TOTAL: usize = 74;
/// The cube's four vec4 at the start of `fl`, then the bounding box's partial reductions.
const F_PART: u64 = 4;
/// Particles per workgroup of the bounding box's reduction (`BOUNDS_WG`).
const BOUNDS_WG: u64 = 128;

/// The error of a build from positions that are not all finite (the box's reduction saw an
/// inf or NaN): the simulation reads the positions back to name the particle.
pub const NOT_FINITE: &str =
    "N-body tree on the GPU: a position is not finite (or the particles span more than f32 holds)";

/// The storage arrays of `tree.wgsl` (group 0, in binding order).
const ARRAYS: [Array; 11] = [
    Array::ro("pos", "vec4<f32>", 16),
    Array::rw("keys", "vec2<u32>", 8),
    Array::rw("ent_a", "vec2<u32>", 8),
    Array::rw("ent_b", "vec2<u32>", 8),
    Array::rw("scan", "u32", 4),
    Array::rw("meta", "u32", 4),
    Array::rw("nodes", "vec4<u32>", 16),
    Array::rw("geo", "vec4<f32>", 16),
    Array::rw("fl", "vec4<f32>", 16),
    Array::rw("perm", "u32", 4),
    Array::rw("part", "vec4<f32>", 16),
];

/// The entry points: the shared ones (`sort_scan.rs`), then the tree's.
const ENTRIES: [&str; 20] = [
    "scan_up",
    "scan_down",
    "sort_count",
    "sort_scatter",
    "bounds_first",
    "bounds_more",
    "cube",
    "keys",
    "regather",
    "sorted",
    "split_count",
    "level_next",
    "split_write",
    "chunk_prep",
    "chunk_count",
    "chunk_total",
    "geo_sums",
    "geo_centre",
    "geo_reach",
    "geo_radius",
];
const BOUNDS_FIRST: usize = 4;
const BOUNDS_MORE: usize = 5;
const CUBE: usize = 6;
const KEYS: usize = 7;
const REGATHER: usize = 8;
const SORTED: usize = 9;
const SPLIT_COUNT: usize = 10;
const LEVEL_NEXT: usize = 11;
const SPLIT_WRITE: usize = 12;
const CHUNK_PREP: usize = 13;
const CHUNK_COUNT: usize = 14;
const CHUNK_TOTAL: usize = 15;
const GEO_SUMS: usize = 16;
const GEO_CENTRE: usize = 17;
const GEO_REACH: usize = 18;
const GEO_RADIUS: usize = 19;
/// Particles per chunk of the geometry (`CH` in `tree.wgsl`).
const CHUNK: u64 = 1024;

/// A tree built on the device: its host copy and the device arrays the walk and the FMM
/// read.
pub(crate) struct BuiltTree {
    /// Nodes, levels, cube and order (no sorted positions, keys or multipoles).
    pub tree: Tree,
    /// `[2 nodes]` vec4<u32>: the FMM kernels' node layout.
    pub nodes: wgpu::Buffer,
    /// `[2 nodes]` vec4<f32>: centre (hi, lo) relative to the cube's centre and radius.
    pub geo: wgpu::Buffer,
    /// `[n]` u32: the shard index of each sorted slot.
    pub perm: wgpu::Buffer,
    /// The same order on the host.
    pub host_perm: Vec<u32>,
    /// Builds run (more than one when the node buffer overflowed).
    pub runs: usize,
}

/// The tree's kernels and the node capacity that sufficed last time.
pub(crate) struct DeviceTree {
    ctx: Arc<GpuContext>,
    module: Module,
    cap: Mutex<Option<usize>>,
}

impl DeviceTree {
    /// Compiles the kernels.
    ///
    /// Errors: [`GpuError::Device`].
    pub fn new(ctx: &Arc<GpuContext>) -> Result<DeviceTree, GpuError> {
        let module = Module::new(ctx, "tree.wgsl", SHADER, &ARRAYS, REC_BYTES, &ENTRIES)?;
        Ok(DeviceTree {
            ctx: ctx.clone(),
            module,
            cap: Mutex::new(None),
        })
    }

    /// The tree of the `n` (at least 1) particles of the resident positions `pos`
    /// (`resident.wgsl`'s layout), all of them targets, with leaves of at most `leaf`
    /// particles.
    ///
    /// Errors: [`GpuError::BufferTooLarge`] naming the buffer; [`GpuError::Device`] (also
    /// [`NOT_FINITE`] for a position that is not finite); [`GpuError::Timeout`].
    pub fn build(&self, pos: &wgpu::Buffer, n: usize, leaf: usize) -> Result<BuiltTree, GpuError> {
        let leaf = leaf.max(1);
        let mut cap = self
            .cap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(4 * n.div_ceil(leaf) + 64 * MORTON_BITS as usize);
        for run in 1..=12 {
            match self.try_build(pos, n, leaf, cap)? {
                Ok(mut built) => {
                    *self.cap.lock().unwrap_or_else(|p| p.into_inner()) = Some(cap);
                    built.runs = run;
                    return Ok(built);
                }
                Err(need) => cap = (2 * cap).max(need + need / 4),
            }
        }
        Err(GpuError::Device {
            adapter: self.ctx.adapter.name.clone(),
            message: "N-body tree on the GPU: the nodes kept outgrowing their buffer".into(),
        })
    }

    /// One build with room for `cap` nodes: the tree, or the nodes it needed.
    fn try_build(
        &self,
        pos: &wgpu::Buffer,
        n: usize,
        leaf: usize,
        cap: usize,
    ) -> Result<Result<BuiltTree, usize>, GpuError> {
        let ctx = &self.ctx;
        let n64 = n as u64;
        // The bounding box's reductions: 128 to 1 per level.
        let mut box_levels = vec![n64.div_ceil(BOUNDS_WG)];
        while *box_levels.last().expect("a level") > 1 {
            let g = box_levels.last().expect("a level").div_ceil(BOUNDS_WG);
            box_levels.push(g);
        }
        let fl_len = F_PART + 4 * box_levels.iter().sum::<u64>();
        let (sort_seg, sort_words) = scan_levels(0, 16 * n64.div_ceil(SORT_TILE));
        let (node_seg, node_words) = scan_levels(0, cap as u64);
        let scan_words = sort_words.max(node_words);
        let keys = ctx.storage_windowed("tree keys", 8 * n64, REDUCE)?;
        let ent_a = ctx.storage_windowed("tree sort (keys, particles)", 8 * n64, REDUCE)?;
        let ent_b = ctx.storage_windowed("tree sorted keys", 8 * n64, REDUCE)?;
        let scan = ctx.storage_windowed("tree scans", 4 * scan_words, REDUCE)?;
        let meta = ctx.storage("tree state", 4 * META_WORDS as u64, REDUCE)?;
        let nodes = ctx.storage_windowed("tree nodes", 32 * cap as u64, REDUCE)?;
        let geo = ctx.storage_windowed("node centres and radii", 32 * cap as u64, REDUCE)?;
        let fl = ctx.storage_windowed("tree cube", 16 * fl_len, REDUCE)?;
        let perm = ctx.storage_windowed("particle order", 4 * n64, REDUCE)?;
        // Chunks: at most one per node plus the particles of each level over CHUNK.
        let chunks = cap as u64 + (MORTON_BITS as u64 + 1) * n64.div_ceil(CHUNK) + 1;
        let part = ctx.storage_windowed("node partial sums", 7 * 16 * chunks, REDUCE)?;
        let args = args_buffer(ctx);
        let bound = self.module.bind(
            ctx,
            "tree buffers",
            &[
                pos, &keys, &ent_a, &ent_b, &scan, &meta, &nodes, &geo, &fl, &perm, &part,
            ],
        )?;
        // The root, level 0, and its dispatch sizes.
        ctx.write(&nodes, 0, &[[0u32, n as u32, 0, 0], [0, 0, 0, 0]]);
        let mut m = [0u32; META_WORDS];
        m[T_LS + 1] = 1;
        m[T_CNT] = 1;
        m[T_TOTAL] = 1;
        m[M_ARGS..M_ARGS + 12].copy_from_slice(&sizes(1));
        m[T_GEO_ARGS..T_GEO_ARGS + 3].copy_from_slice(&[1, 1, 1]);
        ctx.write(&meta, 0, &m);
        ctx.write(&args, 0, &m[M_ARGS..M_ARGS + 16]);

        let base = Rec {
            count: n as u32,
            leaf: leaf as u32,
            n_targets: n as u32,
            cap_f: cap as u32,
            ..Default::default()
        };
        let groups = |items: u64, per: u64| items.div_ceil(per) as u32;
        let mut r = Recorder::default();
        // Bounding box, cube, keys, sort.
        let mut at = F_PART;
        r.push(
            BOUNDS_FIRST,
            Rec {
                s: [0, at as u32, 0, 0],
                ..base
            },
            Size::Direct(box_levels[0] as u32),
        );
        for w in box_levels.windows(2) {
            let next = at + 4 * w[0];
            let rec = Rec {
                len: w[0] as u32,
                s: [at as u32, next as u32, 0, 0],
                ..base
            };
            r.push(BOUNDS_MORE, rec, Size::Direct(groups(w[0], BOUNDS_WG)));
            at = next;
        }
        let cube = Rec {
            s: [at as u32, 0, 0, 0],
            ..base
        };
        r.push(CUBE, cube, Size::Direct(1));
        r.push(KEYS, base, Size::Direct(groups(n64, WG as u64)));
        r.sort(base, sort_seg, n, 8);
        r.push(REGATHER, base, Size::Direct(groups(n64, WG as u64)));
        r.sort(base, sort_seg, n, 8);
        r.push(SORTED, base, Size::Direct(groups(n64, WG as u64)));
        // The nodes, a level per compute pass (its sizes copied in between).
        for level in 0..MORTON_BITS {
            r.passes.push(Vec::new());
            let rec = Rec {
                level,
                s: node_seg.s,
                ..base
            };
            r.push(SPLIT_COUNT, rec, Size::Indirect(4 * M_ARGS as u64));
            r.scan(base, node_seg, (T_CNT as u32) + level, 0, true);
            let next = Rec {
                level,
                s: [0, node_seg.total(), 0, 0],
                ..base
            };
            r.push(LEVEL_NEXT, next, Size::Direct(1));
            r.push(SPLIT_WRITE, rec, Size::Indirect(4 * M_ARGS as u64));
        }
        // The geometry in chunks: their count per node, first chunks, then the sums.
        r.push(CHUNK_PREP, base, Size::Direct(1));
        r.passes.push(Vec::new());
        let per_node = || Size::Indirect(4 * M_ARGS as u64);
        let per_chunk = || Size::Indirect(4 * T_GEO_ARGS as u64);
        let rec = Rec {
            s: node_seg.s,
            ..base
        };
        r.push(CHUNK_COUNT, rec, per_node());
        r.scan(base, node_seg, T_TOTAL as u32, 0, true);
        let total = Rec {
            s: [0, node_seg.total(), 0, 0],
            ..base
        };
        r.push(CHUNK_TOTAL, total, Size::Direct(1));
        r.passes.push(Vec::new());
        r.push(GEO_SUMS, rec, per_chunk());
        r.push(GEO_CENTRE, rec, per_node());
        r.push(GEO_REACH, rec, per_chunk());
        r.push(GEO_RADIUS, rec, per_node());
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
            &[
                ReadRange {
                    buffer: &meta,
                    offset: 0,
                    bytes: 4 * META_WORDS as u64,
                },
                ReadRange {
                    buffer: &fl,
                    offset: 0,
                    bytes: 16 * F_PART,
                },
            ],
        )?;
        let m: Vec<u32> = bytemuck::pod_collect_to_vec(&raw[0]);
        let cube: Vec<[f32; 4]> = bytemuck::pod_collect_to_vec(&raw[1]);
        if cube[2][3] != 0.0 {
            return Err(GpuError::Device {
                adapter: ctx.adapter.name.clone(),
                message: NOT_FINITE.into(),
            });
        }
        if m[T_FLAG] != 0 {
            return Ok(Err(m[T_NEED] as usize));
        }
        let total = m[T_TOTAL] as usize;
        let enc = ctx.device.create_command_encoder(&Default::default());
        let raw = ctx.submit_and_read(
            enc,
            &[
                ReadRange {
                    buffer: &nodes,
                    offset: 0,
                    bytes: 32 * total as u64,
                },
                ReadRange {
                    buffer: &geo,
                    offset: 0,
                    bytes: 32 * total as u64,
                },
                ReadRange {
                    buffer: &perm,
                    offset: 0,
                    bytes: 4 * n64,
                },
            ],
        )?;
        let words: Vec<[u32; 4]> = bytemuck::pod_collect_to_vec(&raw[0]);
        let g: Vec<[f32; 4]> = bytemuck::pod_collect_to_vec(&raw[1]);
        let host_perm: Vec<u32> = bytemuck::pod_collect_to_vec(&raw[2]);
        let pair = |h: f32, l: f32| h as f64 + l as f64;
        let lo = [0, 1, 2].map(|c| pair(cube[0][c], cube[1][c]));
        let side = cube[0][3] as f64;
        let origin = [0, 1, 2].map(|c| pair(cube[2][c], cube[3][c]));
        let tree_nodes: Vec<Node> = (0..total)
            .map(|k| {
                let (a, b) = (words[2 * k], words[2 * k + 1]);
                let (h, l) = (g[2 * k], g[2 * k + 1]);
                Node {
                    start: a[0] as usize,
                    end: a[1] as usize,
                    first_child: a[2] as usize,
                    nchild: a[3] as usize,
                    parent: b[0] as usize,
                    level: b[2] as usize,
                    center: [0, 1, 2].map(|c| origin[c] + pair(h[c], l[c])),
                    radius: pair(h[3], l[3]),
                    ntargets: b[1] as usize,
                }
            })
            .collect();
        let depth = tree_nodes.last().map_or(0, |nd| nd.level);
        let level_start = (0..=depth + 1).map(|l| m[T_LS + l] as usize).collect();
        let tree = Tree {
            perm: host_perm.iter().map(|&i| i as usize).collect(),
            soa: SoA::default(),
            keys: Vec::new(),
            nodes: tree_nodes,
            level_start,
            multipoles: Vec::new(),
            n_targets: n,
            lo,
            side,
        };
        Ok(Ok(BuiltTree {
            tree,
            nodes,
            geo,
            perm,
            host_perm,
            runs: 1,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fmm_gpu::{GpuForces, ResidentShard};
    use crate::Particles;

    fn generated(clumpy: bool, n: u64, seed: u64) -> crate::Particles {
        crate::fmm_gpu::test_particles(clumpy.then_some(5), n, seed)
    }

    fn of(pos: &[[f64; 3]], mass: &[f64]) -> Particles {
        let mut p = Particles::with_capacity(pos.len() + 7, pos.len() as u64);
        for (i, (&x, &m)) in pos.iter().zip(mass).enumerate() {
            p.push(x, [0.0; 3], m, i as u64, 0).unwrap();
        }
        p
    }

    /// Builds the tree of `p` on the device (its node buffer starting at `cap`, if given)
    /// and on the host in the device's cube from the positions the device holds, and checks
    /// that they are the same tree; returns the device's builds.
    fn same_tree(
        gpu: &GpuForces,
        what: &str,
        p: &Particles,
        leaf: usize,
        cap: Option<usize>,
    ) -> usize {
        let ctx = gpu.context();
        let mut shard = ResidentShard::new(ctx, p).unwrap();
        let dt = DeviceTree::new(ctx).unwrap();
        if let Some(c) = cap {
            *dt.cap.lock().unwrap() = Some(c);
        }
        let n = p.num;
        let built = dt.build(shard.positions().unwrap(), n, leaf).unwrap();
        let d = &built.tree;
        // What the device holds: each coordinate as the sum of its f32 pair.
        let held: Vec<[f64; 3]> = p.pos[..n]
            .iter()
            .map(|x| x.map(|c| (c as f32) as f64 + ((c - (c as f32) as f64) as f32) as f64))
            .collect();
        let mass: Vec<f64> = p.mass[..n].iter().map(|&m| m as f32 as f64).collect();
        let h = Tree::build_nodes_in(&held, &mass, n, leaf, (d.lo, d.side));
        assert_eq!(d.perm, h.perm, "{what}: order");
        assert_eq!(d.level_start, h.level_start, "{what}: levels");
        assert_eq!(d.nodes.len(), h.nodes.len(), "{what}: nodes");
        let tol = 1e-12 * d.side;
        for (k, (a, b)) in d.nodes.iter().zip(&h.nodes).enumerate() {
            let shape = |x: &Node| {
                (
                    x.start,
                    x.end,
                    x.first_child,
                    x.nchild,
                    x.parent,
                    x.level,
                    x.ntargets,
                )
            };
            assert_eq!(shape(a), shape(b), "{what}: node {k}");
            for c in 0..3 {
                assert!(
                    (a.center[c] - b.center[c]).abs() <= tol,
                    "{what}: node {k} centre {:?} vs {:?}",
                    a.center,
                    b.center
                );
            }
            assert!(
                (a.radius - b.radius).abs() <= tol,
                "{what}: node {k} radius {} vs {}",
                a.radius,
                b.radius
            );
        }
        assert_eq!(built.host_perm.len(), n);
        println!(
            "{what}: {} nodes, depth {}, side {}, {} build(s)",
            d.nodes.len(),
            d.depth(),
            d.side,
            built.runs
        );
        built.runs
    }

    /// The device builds the host's tree in its cube: Plummer and clumpy systems, leaves of
    /// 1 to 64, 300 coincident particles (a chain down to the keys' last level), massless
    /// particles (centres at their box's centre), one particle, a particle at a corner far
    /// out; and a node buffer far too small at first (it builds again).
    #[test]
    fn device_tree_is_the_host_tree_in_its_cube() {
        let gpu = GpuForces::open(None, 0).unwrap();
        for (clumpy, n, leaf) in [
            (false, 3000, 16),
            (true, 4000, 32),
            (false, 500, 1),
            (true, 2000, 64),
        ] {
            let p = generated(clumpy, n, 11 + n);
            same_tree(
                &gpu,
                &format!("clumpy {clumpy}, n {n}, leaf {leaf}"),
                &p,
                leaf,
                None,
            );
        }
        let p = generated(false, 1000, 3);
        let mut pos = p.pos[..p.num].to_vec();
        pos.extend(std::iter::repeat_n([0.25, -0.5, 0.125], 300));
        pos.push([40.0, -40.0, 40.0]);
        let mut mass = vec![1e-3; pos.len()];
        for m in mass.iter_mut().step_by(3) {
            *m = 0.0;
        }
        for m in mass[1000..1300].iter_mut() {
            *m = 0.0;
        }
        same_tree(
            &gpu,
            "coincident, massless, a far corner",
            &of(&pos, &mass),
            8,
            None,
        );
        same_tree(&gpu, "one particle", &of(&pos[..1], &mass[..1]), 8, None);
        let runs = same_tree(&gpu, "tiny node buffer", &p, 16, Some(3));
        assert!(runs > 1, "the build should have outgrown its node buffer");
    }
}
