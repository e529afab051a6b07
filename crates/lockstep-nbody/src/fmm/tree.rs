//! Morton (z-order) octree over a source set (docs/nbody.md, "Forces").
//!
//! Particles are sorted by 63-bit Morton keys (21 bits per axis) of a bounding cube; a node
//! is a contiguous range of the sorted particles, split into its non-empty octants until it
//! holds at most `leaf_size` particles (or the keys are exhausted). Nodes are stored in
//! breadth-first order, so each level is a contiguous range and children follow parents.
//! Expansion centres are centres of mass; `radius` is the largest distance from the centre
//! to a particle of the node (Dehnen 2002, the `r_max` of the opening criterion).

use rayon::prelude::*;

use super::expansion::Tables;
use crate::direct::SoA;

/// Bits per axis of a Morton key.
pub const MORTON_BITS: u32 = 21;

/// One tree node: the sorted particles `start..end`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Node {
    /// First sorted particle.
    pub start: usize,
    /// One past the last sorted particle.
    pub end: usize,
    /// Index of the first child (children are contiguous), meaningless for leaves.
    pub first_child: usize,
    /// Number of children (0 for a leaf).
    pub nchild: usize,
    /// Parent index (the root is its own parent).
    pub parent: usize,
    /// Depth (root 0).
    pub level: usize,
    /// Expansion centre (centre of mass, or geometric centre for massless nodes), kpc.
    pub center: [f64; 3],
    /// Largest distance from `center` to a particle of the node, kpc.
    pub radius: f64,
    /// Number of target particles (local particles, as opposed to imported sources).
    pub ntargets: usize,
}

impl Node {
    /// True when the node has no children.
    pub fn is_leaf(&self) -> bool {
        self.nchild == 0
    }
    /// Children indices.
    pub fn children(&self) -> std::ops::Range<usize> {
        self.first_child..self.first_child + self.nchild
    }
    /// Particle count.
    pub fn count(&self) -> usize {
        self.end - self.start
    }
}

/// Spreads the low 21 bits of `v` to every third bit.
fn spread3(v: u64) -> u64 {
    let mut x = v & 0x1f_ffff;
    x = (x | (x << 32)) & 0x1f00000000ffff;
    x = (x | (x << 16)) & 0x1f0000ff0000ff;
    x = (x | (x << 8)) & 0x100f00f00f00f00f;
    x = (x | (x << 4)) & 0x10c30c30c30c30c3;
    x = (x | (x << 2)) & 0x1249249249249249;
    x
}

/// Morton key of `x` in the cube with corner `lo` and side `side`.
pub fn morton_key(x: [f64; 3], lo: [f64; 3], side: f64) -> u64 {
    let scale = (1u64 << MORTON_BITS) as f64 / side;
    let q = |c: usize| -> u64 {
        let v = ((x[c] - lo[c]) * scale).floor();
        v.clamp(0.0, ((1u64 << MORTON_BITS) - 1) as f64) as u64
    };
    (spread3(q(0)) << 2) | (spread3(q(1)) << 1) | spread3(q(2))
}

/// A Morton octree with multipoles over a set of sources, the first `ntargets_in` of which
/// are targets.
#[derive(Debug, Clone)]
pub struct Tree {
    /// Sorted position -> input index.
    pub perm: Vec<usize>,
    /// Sorted sources.
    pub(crate) soa: SoA,
    /// Sorted Morton keys.
    pub keys: Vec<u64>,
    /// Nodes in breadth-first order.
    pub nodes: Vec<Node>,
    /// `level_start[l]..level_start[l+1]` are the nodes of level `l`.
    pub level_start: Vec<usize>,
    /// Multipoles `[node][nterms]` about each node's centre (mass units, kpc^|n|).
    pub multipoles: Vec<f64>,
    /// Input indices `< n_targets` are targets.
    pub n_targets: usize,
    /// Corner of the bounding cube, kpc.
    pub lo: [f64; 3],
    /// Side of the bounding cube, kpc.
    pub side: f64,
}

impl Tree {
    /// Builds the nodes of the tree of `pos`/`mass` (input order), without multipoles
    /// ([`Tree::upward_pass`] adds them); inputs `0..n_targets` are targets.
    pub fn build_nodes(pos: &[[f64; 3]], mass: &[f64], n_targets: usize, leaf_size: usize) -> Tree {
        let (lo, side) = bounding_cube(pos);
        Tree::build_nodes_in(pos, mass, n_targets, leaf_size, (lo, side))
    }

    /// [`Tree::build_nodes`] in the cube `(corner, side)` (kpc), which must hold every
    /// point (a point outside takes the key of the nearest cell): the GPU's tree builds its
    /// own cube (`fmm_gpu`'s device tree), and the tests build the host's in it.
    pub fn build_nodes_in(
        pos: &[[f64; 3]],
        mass: &[f64],
        n_targets: usize,
        leaf_size: usize,
        (lo, side): ([f64; 3], f64),
    ) -> Tree {
        let n = pos.len();
        let mut order: Vec<(u64, usize)> = pos
            .par_iter()
            .enumerate()
            .map(|(i, x)| (morton_key(*x, lo, side), i))
            .collect();
        order.par_sort_unstable();
        let keys: Vec<u64> = order.iter().map(|o| o.0).collect();
        let perm: Vec<usize> = order.iter().map(|o| o.1).collect();
        let soa = SoA {
            x: perm.iter().map(|&i| pos[i][0]).collect(),
            y: perm.iter().map(|&i| pos[i][1]).collect(),
            z: perm.iter().map(|&i| pos[i][2]).collect(),
            m: perm.iter().map(|&i| mass[i]).collect(),
        };
        // Prefix count of targets in sorted order.
        let mut tprefix = vec![0usize; n + 1];
        for s in 0..n {
            tprefix[s + 1] = tprefix[s] + usize::from(perm[s] < n_targets);
        }

        let mut nodes = subdivide(&keys, leaf_size);
        let depth = nodes.last().map(|n| n.level).unwrap_or(0);
        let mut level_start = vec![0usize; depth + 2];
        for l in 0..=depth + 1 {
            level_start[l] = nodes.partition_point(|nd| nd.level < l);
        }
        // Centres, radii, target counts.
        nodes
            .par_iter_mut()
            .for_each(|nd| set_geometry(nd, &soa, &tprefix));
        Tree {
            perm,
            soa,
            keys,
            nodes,
            level_start,
            multipoles: Vec::new(),
            n_targets,
            lo,
            side,
        }
    }

    /// Builds the tree of `pos`/`mass` (input order) with its multipoles: [`Tree::build_nodes`]
    /// then [`Tree::upward_pass`]; inputs `0..n_targets` are targets.
    pub fn build(
        pos: &[[f64; 3]],
        mass: &[f64],
        n_targets: usize,
        leaf_size: usize,
        tables: &Tables,
    ) -> Tree {
        let mut tree = Tree::build_nodes(pos, mass, n_targets, leaf_size);
        tree.upward_pass(tables);
        tree
    }

    /// Computes the multipoles `[node][nterms]` level by level from the leaves up: P2M at
    /// the leaves, M2M into each parent (Dehnen 2014, eqs. 12-13).
    pub fn upward_pass(&mut self, tables: &Tables) {
        let nt = tables.nterms;
        let nodes = &self.nodes;
        let level_start = &self.level_start;
        let soa = &self.soa;
        let mut multipoles = vec![0.0; nodes.len() * nt];
        for l in (0..level_start.len() - 1).rev() {
            let (head, tail) = multipoles.split_at_mut(level_start[l + 1] * nt);
            let below_start = level_start[l + 1];
            let tail: &[f64] = tail;
            head[level_start[l] * nt..]
                .par_chunks_mut(nt)
                .enumerate()
                .for_each_init(
                    || vec![0.0; nt],
                    |scratch, (k, mp)| {
                        let nd = &nodes[level_start[l] + k];
                        if nd.is_leaf() {
                            tables.p2m_soa(soa, nd.start..nd.end, nd.center, mp, scratch);
                        } else {
                            for c in nd.children() {
                                let off = (c - below_start) * nt;
                                tables.m2m(
                                    &tail[off..off + nt],
                                    nodes[c].center,
                                    nd.center,
                                    mp,
                                    scratch,
                                );
                            }
                        }
                    },
                );
        }
        self.multipoles = multipoles;
    }

    /// Multipole coefficients of node `i`.
    pub fn multipole(&self, i: usize, nterms: usize) -> &[f64] {
        &self.multipoles[i * nterms..(i + 1) * nterms]
    }

    /// Depth of the deepest node.
    pub fn depth(&self) -> usize {
        self.level_start.len().saturating_sub(2)
    }
}

/// Smallest axis-aligned cube (corner, side) holding all points, slightly enlarged.
pub fn bounding_cube(pos: &[[f64; 3]]) -> ([f64; 3], f64) {
    let (bmin, bmax) = pos
        .par_iter()
        .fold(
            || ([f64::INFINITY; 3], [f64::NEG_INFINITY; 3]),
            |(mut a, mut b), x| {
                for k in 0..3 {
                    a[k] = a[k].min(x[k]);
                    b[k] = b[k].max(x[k]);
                }
                (a, b)
            },
        )
        .reduce(
            || ([f64::INFINITY; 3], [f64::NEG_INFINITY; 3]),
            |(a1, b1), (a2, b2)| {
                let mut a = a1;
                let mut b = b1;
                for k in 0..3 {
                    a[k] = a[k].min(a2[k]);
                    b[k] = b[k].max(b2[k]);
                }
                (a, b)
            },
        );
    if pos.is_empty() {
        return ([0.0; 3], 1.0);
    }
    cube_from_bounds(bmin, bmax)
}

/// Cube (corner, side) holding the box `bmin..bmax`; a unit cube at the origin for an empty
/// box. The rule is the GPU's (`fmm_gpu/tree.wgsl`, which builds the same tree on the
/// device), computed the way it computes it: the largest extent from the bounds split into
/// (hi, lo) f32 pairs, `(max_hi - min_hi) + (max_lo - min_lo)` in f32; the side the smallest
/// power of two at least `1 + 2^-10` times that (1 for a point, at least 2^-100); the corner
/// `2^-30` sides below `bmin`. A power-of-two side makes the Morton keys' scaling exact.
pub fn cube_from_bounds(bmin: [f64; 3], bmax: [f64; 3]) -> ([f64; 3], f64) {
    if (0..3).any(|k| bmin[k].partial_cmp(&bmax[k]).is_none_or(|o| o.is_gt())) {
        return ([0.0; 3], 1.0);
    }
    let pair = |x: f64| {
        let hi = x as f32;
        (hi, (x - hi as f64) as f32)
    };
    let ext = (0..3)
        .map(|k| {
            let (a, al) = pair(bmax[k]);
            let (b, bl) = pair(bmin[k]);
            (a - b) + (al - bl)
        })
        .fold(0.0f32, f32::max);
    let side = if ext > 0.0 {
        pow2_at_least(ext * 1.000_976_6).max(2f32.powi(-100))
    } else {
        1.0
    };
    let side = side as f64;
    let pad = side * 2f64.powi(-30);
    (bmin.map(|b| b - pad), side)
}

/// The smallest power of two at least `v` (positive and normal).
fn pow2_at_least(v: f32) -> f32 {
    let b = v.to_bits();
    let mut e = b & 0x7f80_0000;
    if b & 0x007f_ffff != 0 {
        e += 0x0080_0000;
    }
    f32::from_bits(e)
}

/// The nodes of the octree over the sorted Morton `keys` in breadth-first order (so by
/// level), the root first: a node with more than `leaf_size` (at least 1) particles is split
/// into its non-empty octants, down to the keys' last level. Centres, radii and target counts
/// are left to [`set_geometry`].
fn subdivide(keys: &[u64], leaf_size: usize) -> Vec<Node> {
    let mut nodes = vec![Node {
        start: 0,
        end: keys.len(),
        first_child: 0,
        nchild: 0,
        parent: 0,
        level: 0,
        center: [0.0; 3],
        radius: 0.0,
        ntargets: 0,
    }];
    let leaf_size = leaf_size.max(1);
    let mut i = 0;
    while i < nodes.len() {
        let nd = nodes[i];
        if nd.count() > leaf_size && nd.level < MORTON_BITS as usize {
            let shift = 3 * (MORTON_BITS as usize - 1 - nd.level);
            let ks = &keys[nd.start..nd.end];
            let first = nodes.len();
            let mut b0 = nd.start;
            for o in 1..=8u64 {
                let b1 = if o == 8 {
                    nd.end
                } else {
                    nd.start + ks.partition_point(|k| ((k >> shift) & 7) < o)
                };
                if b1 > b0 {
                    nodes.push(Node {
                        start: b0,
                        end: b1,
                        first_child: 0,
                        nchild: 0,
                        parent: i,
                        level: nd.level + 1,
                        center: [0.0; 3],
                        radius: 0.0,
                        ntargets: 0,
                    });
                }
                b0 = b1;
            }
            nodes[i].first_child = first;
            nodes[i].nchild = nodes.len() - first;
        }
        i += 1;
    }
    nodes
}

/// Sets the centre (centre of mass, or of the bounding box when massless), the radius (the
/// farthest particle from the centre) and the target count (from the prefix counts
/// `tprefix` of targets in sorted order) of `nd`, whose particles are `soa[nd.start..nd.end]`.
fn set_geometry(nd: &mut Node, soa: &SoA, tprefix: &[usize]) {
    let r = nd.start..nd.end;
    let mut m = 0.0;
    let mut c = [0.0; 3];
    let mut bmin = [f64::INFINITY; 3];
    let mut bmax = [f64::NEG_INFINITY; 3];
    for s in r.clone() {
        let w = soa.m[s];
        let x = [soa.x[s], soa.y[s], soa.z[s]];
        m += w;
        for k in 0..3 {
            c[k] += w * x[k];
            bmin[k] = bmin[k].min(x[k]);
            bmax[k] = bmax[k].max(x[k]);
        }
    }
    nd.center = if m > 0.0 {
        [c[0] / m, c[1] / m, c[2] / m]
    } else if nd.count() > 0 {
        [
            0.5 * (bmin[0] + bmax[0]),
            0.5 * (bmin[1] + bmax[1]),
            0.5 * (bmin[2] + bmax[2]),
        ]
    } else {
        [0.0; 3]
    };
    let mut r2max: f64 = 0.0;
    for s in r {
        let d = [
            soa.x[s] - nd.center[0],
            soa.y[s] - nd.center[1],
            soa.z[s] - nd.center[2],
        ];
        r2max = r2max.max(d[0] * d[0] + d[1] * d[1] + d[2] * d[2]);
    }
    nd.radius = r2max.sqrt();
    nd.ntargets = tprefix[nd.end] - tprefix[nd.start];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn morton_keys_order_octants() {
        let lo = [0.0; 3];
        assert_eq!(morton_key([0.1, 0.1, 0.1], lo, 1.0) >> 60, 0);
        assert_eq!(morton_key([0.9, 0.1, 0.1], lo, 1.0) >> 60, 4);
        assert_eq!(morton_key([0.1, 0.9, 0.1], lo, 1.0) >> 60, 2);
        assert_eq!(morton_key([0.1, 0.1, 0.9], lo, 1.0) >> 60, 1);
        assert_eq!(morton_key([0.9, 0.9, 0.9], lo, 1.0) >> 60, 7);
    }

    #[test]
    fn tree_nodes_partition_particles_and_respect_leaf_size() {
        let mut r = crate::rng::Rng::new(5);
        let pos: Vec<[f64; 3]> = (0..3000)
            .map(|_| [r.normal(), r.normal() * 0.1, r.uniform()])
            .collect();
        let mass = vec![1.0; pos.len()];
        let t = Tables::new(2);
        let tree = Tree::build(&pos, &mass, 2000, 16, &t);
        let mut covered = vec![0u32; pos.len()];
        let mut targets = 0;
        for nd in &tree.nodes {
            if nd.is_leaf() {
                assert!(nd.count() <= 16);
                targets += nd.ntargets;
                for s in nd.start..nd.end {
                    covered[s] += 1;
                }
            } else {
                let ch = &tree.nodes[nd.children()];
                assert_eq!(ch.first().unwrap().start, nd.start);
                assert_eq!(ch.last().unwrap().end, nd.end);
            }
            // Monopole equals the node mass, dipole vanishes about the centre of mass.
            let mp = tree.multipole(tree.nodes.iter().position(|x| x == nd).unwrap(), t.nterms);
            assert!((mp[0] - nd.count() as f64).abs() < 1e-9);
            for d in &mp[1..4] {
                assert!(d.abs() < 1e-9 * nd.count() as f64);
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        assert_eq!(targets, 2000);
        assert!(tree.keys.windows(2).all(|w| w[0] <= w[1]));
    }
}
