//! Fast multipole method for softened gravity (docs/nbody.md, "Forces"; Dehnen 2002, 2014).
//!
//! A Morton octree ([`tree`]) carries Cartesian multipoles of order `p` about each node's
//! centre of mass. A dual tree traversal with the opening criterion
//! `r_A + r_B < theta |z_A - z_B|` (Dehnen 2002) assigns far node pairs to multipole-to-local
//! (M2L) translations and near leaf pairs to direct particle-particle sums (P2P); local
//! expansions are pushed down (L2L) and evaluated at the particles (L2P). Without softening
//! the derivatives of `1/r` are harmonic, and M2L/M2P contract only the `(p+1)^2` folded
//! coefficients of each multipole ([`expansion::Contraction`]). The traversal is
//! one-directional (target, source) but the set of visited pairs is symmetric, so the near
//! field is pairwise symmetric and momentum is conserved to the far-field truncation error.
//!
//! Sources may include imported particles and imported multipoles ([`SourceSet`]): this is
//! the entry point for the locally essential tree of sharded runs (issue 9). Work is
//! parallel within the rank (rayon): the traversal over target subtrees, M2L over target
//! nodes, L2L per level, L2P/P2P over target leaves.

pub mod expansion;
mod p2p;
pub mod tree;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::direct::Forces;
use crate::NbodyError;
use expansion::Tables;
use tree::{Node, Tree};

/// FMM accuracy and work-split parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FmmParams {
    /// Expansion order `p`, 1..=6 (`(p+1)(p+2)(p+3)/6` coefficients per node).
    #[serde(default = "default_order")]
    pub order: usize,
    /// Opening angle `theta` in (0, 1): node pairs with `r_A + r_B < theta d` interact by M2L.
    #[serde(default = "default_theta")]
    pub theta: f64,
    /// Largest number of particles in a leaf.
    #[serde(default = "default_leaf")]
    pub leaf_size: usize,
    /// Arithmetic of the near-field (P2P) sums: `"f32"` (default) or `"f64"`.
    #[serde(default)]
    pub near_field: NearField,
}

/// Arithmetic of the near-field (P2P) sums.
///
/// `F32` (the default) stores each target leaf's sources relative to the leaf centre,
/// scaled by powers of two, in single precision; a pair's force then carries a relative
/// error of about `1e-7 * L / r` (`L` the extent of the gathered sources, `r` the pair's
/// separation), and partial sums are added in f64 every 128 sources. With any softening,
/// or separations above `1e-4 L`, that is far below the far-field truncation error (the
/// 99th percentile of the relative acceleration error of the default p = 6, theta = 0.6
/// is unchanged at 2.4e-4 on a 10^6-particle Plummer sphere). Pairs closer than `1e-10 L`
/// count as that far apart. `F64` sums in double precision (for unsoftened systems with
/// very close pairs), at about 1.6 times the near-field cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NearField {
    /// Single precision on centred, scaled coordinates, accumulated in f64.
    #[default]
    F32,
    /// Double precision throughout.
    F64,
}

fn default_order() -> usize {
    6
}
fn default_theta() -> f64 {
    0.6
}
fn default_leaf() -> usize {
    32
}

impl Default for FmmParams {
    fn default() -> Self {
        FmmParams {
            order: default_order(),
            theta: default_theta(),
            leaf_size: default_leaf(),
            near_field: NearField::F32,
        }
    }
}

impl FmmParams {
    /// Checks the ranges: `order` in 1..=6, `0 < theta < 1`, `leaf_size >= 1`.
    pub fn validate(&self) -> Result<(), NbodyError> {
        if !(1..=6).contains(&self.order) {
            return Err(NbodyError::param(
                "forces.order",
                self.order,
                "the expansion order p must be in 1..=6",
            ));
        }
        if !(self.theta.is_finite() && self.theta > 0.0 && self.theta < 1.0) {
            return Err(NbodyError::param(
                "forces.theta",
                self.theta,
                "the opening angle must be in (0, 1); 0.6 is the default",
            ));
        }
        if self.leaf_size == 0 {
            return Err(NbodyError::param(
                "forces.leaf_size",
                self.leaf_size,
                "leaves must hold at least one particle (16..64 is typical)",
            ));
        }
        Ok(())
    }
}

/// An imported source cell: a multipole of order `p` about `center` (from another rank's
/// tree, [`Tree::multipole`]), bounding sphere `radius` about the centre.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteCell {
    /// Expansion centre, kpc.
    pub center: [f64; 3],
    /// Largest distance of the cell's particles from the centre, kpc.
    pub radius: f64,
    /// `(p+1)(p+2)(p+3)/6` multipole coefficients (see [`expansion`]).
    pub multipole: Vec<f64>,
}

/// Sources of one force evaluation: the local particles (which are also the targets) plus
/// imported particles and imported multipole cells that only act as sources.
#[derive(Debug, Clone, Copy)]
pub struct SourceSet<'a> {
    /// Local positions `[n][3]`, kpc (targets and sources).
    pub pos: &'a [[f64; 3]],
    /// Local masses `[n]`.
    pub mass: &'a [f64],
    /// Imported particle positions `[n_remote][3]` (sources only).
    pub remote_pos: &'a [[f64; 3]],
    /// Imported particle masses `[n_remote]`.
    pub remote_mass: &'a [f64],
    /// Imported multipole cells (sources only).
    pub remote_cells: &'a [RemoteCell],
}

impl<'a> SourceSet<'a> {
    /// Only local particles.
    pub fn local(pos: &'a [[f64; 3]], mass: &'a [f64]) -> Self {
        SourceSet {
            pos,
            mass,
            remote_pos: &[],
            remote_mass: &[],
            remote_cells: &[],
        }
    }
}

/// Work counts of one FMM evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FmmStats {
    /// Tree nodes.
    pub nodes: usize,
    /// Tree depth.
    pub depth: usize,
    /// M2L translations.
    pub m2l: usize,
    /// Multipole-to-particle evaluations (target leaf, source node) pairs.
    pub m2p: usize,
    /// Leaf-leaf P2P blocks.
    pub p2p_blocks: usize,
    /// Particle-particle interactions.
    pub p2p_pairs: u64,
    /// Imported cells that reached a target leaf without passing the opening test (the
    /// sender should have sent particles instead; they are evaluated by M2P).
    pub forced_m2l: usize,
    /// Wall-clock seconds of each phase.
    pub seconds: PhaseSeconds,
}

/// Wall-clock seconds of the phases of one FMM evaluation ([`Fmm::forces`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseSeconds {
    /// Morton keys, sort, nodes, centres and radii.
    pub tree: f64,
    /// Multipoles: P2M at the leaves, M2M up the tree.
    pub upward: f64,
    /// Dual tree traversal and the interaction lists.
    pub traversal: f64,
    /// Multipole-to-local translations.
    pub m2l: f64,
    /// Local-to-local shifts down the tree.
    pub l2l: f64,
    /// Local expansions evaluated at the particles.
    pub l2p: f64,
    /// Multipoles evaluated at the particles of sparse target leaves.
    pub m2p: f64,
    /// Direct particle-particle sums.
    pub p2p: f64,
}

impl PhaseSeconds {
    /// Sum over the phases.
    pub fn total(&self) -> f64 {
        self.tree
            + self.upward
            + self.traversal
            + self.m2l
            + self.l2l
            + self.l2p
            + self.m2p
            + self.p2p
    }
}

/// A device that evaluates forces in place of the CPU code (`forces.device: "gpu"`: the
/// WGSL kernels of `crate::fmm_gpu`). The tree and the interaction lists are the host's
/// (`Fmm::build_tree_nodes`, `Fmm::walk_lists`); the device does the arithmetic.
pub trait ForceDevice: std::fmt::Debug + Send + Sync {
    /// [`Fmm::forces`] of `fmm` on the device: acceleration `[n][3]` (kpc (km/s)^2 per kpc
    /// with G = `g`) and potential `[n]` of the local particles of `sources`, with the work
    /// counts and phase times.
    fn fmm_forces(
        &self,
        fmm: &Fmm,
        sources: &SourceSet,
        g: f64,
        softening: f64,
    ) -> Result<(Forces, FmmStats), NbodyError>;

    /// Direct summation on the device ([`crate::direct::direct_on`]): the field at
    /// `targets` (`[n][3]`) of all `pos`/`mass`; `offset` says where the targets sit among
    /// the sources (each skips itself there).
    fn direct_forces(
        &self,
        targets: &[[f64; 3]],
        offset: Option<usize>,
        pos: &[[f64; 3]],
        mass: &[f64],
        g: f64,
        softening: f64,
    ) -> Result<Forces, NbodyError>;

    /// The adapter, for logs (`[index] name`, and whether other ranks share it).
    fn describe(&self) -> String;

    /// A warning when the device is a software emulation (lavapipe), else None.
    fn software_warning(&self) -> Option<String>;

    /// The device as [`std::any::Any`], for the device-resident paths that need its concrete
    /// type (`fmm_gpu::GpuForces`: a simulation keeping its particles on the GPU).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The FMM solver: parameters and precomputed expansion tables.
#[derive(Debug, Clone)]
pub struct Fmm {
    params: FmmParams,
    tables: Tables,
    /// Evaluate near-field pairs within a task once for both particles (always, except in
    /// the test that compares it with the one-sided sums).
    mutual_p2p: bool,
    /// The harmonic M2L/M2P contraction without softening ([`Tables::contraction`]); the
    /// full one always when false (tests compare the two).
    harmonic_far_field: bool,
    /// The GPU that evaluates the forces (`forces.device: "gpu"`), or None for the CPU.
    device: Option<std::sync::Arc<dyn ForceDevice>>,
}

#[derive(Default)]
struct Lists {
    m2l: Vec<(usize, usize)>,
    m2p: Vec<(usize, usize)>,
    p2p: Vec<(usize, usize)>,
    forced: usize,
}

/// The interaction lists of one walk for the GPU (`Fmm::walk_lists`): compressed rows
/// `(offsets [nodes + 1], items)` per target node; sources `>= nodes` are imported cells.
pub(crate) struct WalkLists {
    /// Multipole-to-local pairs.
    pub m2l: (Vec<u32>, Vec<u32>),
    /// Multipole-to-particle pairs (target leaves).
    pub m2p: (Vec<u32>, Vec<u32>),
    /// Particle-particle pairs (target leaves; sources are node particle ranges).
    pub p2p: (Vec<u32>, Vec<u32>),
    /// Imported cells that failed the opening test at a target leaf.
    pub forced: usize,
    /// Particle pairs of the P2P list, one-sided.
    pub p2p_pairs: u64,
}

/// Compressed rows: `items[offsets[t]..offsets[t+1]]` are the sources of target `t`.
struct Csr {
    offsets: Vec<usize>,
    items: Vec<usize>,
}

impl Csr {
    /// The sources of target `t`.
    fn row(&self, t: usize) -> &[usize] {
        &self.items[self.offsets[t]..self.offsets[t + 1]]
    }
}

/// The interaction lists of one evaluation, grouped by target node.
struct InteractionLists {
    m2l: Csr,
    m2p: Csr,
    /// Imported cells that failed the opening test at a target leaf.
    forced: usize,
}

/// Groups `(target, source)` pairs by target with a stable counting sort: the sources of a
/// target keep the (deterministic) order of the traversal.
fn csr(pairs: Vec<(usize, usize)>, n: usize) -> Csr {
    let mut offsets = vec![0usize; n + 1];
    for &(t, _) in &pairs {
        offsets[t + 1] += 1;
    }
    for i in 0..n {
        offsets[i + 1] += offsets[i];
    }
    let mut cursor = offsets.clone();
    let mut items = vec![0usize; pairs.len()];
    for (t, s) in pairs {
        items[cursor[t]] = s;
        cursor[t] += 1;
    }
    Csr { offsets, items }
}

impl Fmm {
    /// Solver with validated parameters.
    pub fn new(params: FmmParams) -> Result<Self, NbodyError> {
        params.validate()?;
        Ok(Fmm {
            params,
            tables: Tables::new(params.order),
            mutual_p2p: true,
            harmonic_far_field: true,
            device: None,
        })
    }

    /// This solver with its force evaluations on `device` (the GPU, `crate::fmm_gpu`): the tree
    /// and the interaction lists are still built here, on the host.
    pub fn on_device(mut self, device: std::sync::Arc<dyn ForceDevice>) -> Self {
        self.device = Some(device);
        self
    }

    /// The GPU this solver evaluates on, if any.
    pub fn device(&self) -> Option<&std::sync::Arc<dyn ForceDevice>> {
        self.device.as_ref()
    }

    /// The expansion tables.
    pub(crate) fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The interaction lists of the dual tree walk of `tree` (local plus imported
    /// particles) and the imported cells `remote`, without evaluating anything: the same
    /// walk, tasks and order as [`Fmm::forces`], for the GPU path. Each list is grouped by
    /// target node (stable: a target's sources keep the walk's order).
    pub(crate) fn walk_lists(&self, tree: &Tree, remote: &[RemoteCell]) -> WalkLists {
        let nodes = &tree.nodes;
        let mut level = 0;
        while level + 1 < tree.level_start.len() - 1 {
            let count = tree.level_start[level + 1] - tree.level_start[level];
            if count >= TASKS {
                break;
            }
            level += 1;
        }
        let mut tasks: Vec<usize> = (0..nodes.len())
            .filter(|&i| nodes[i].level == level || (nodes[i].level < level && nodes[i].is_leaf()))
            .collect();
        tasks.sort_by_key(|&t| nodes[t].start);
        let lists = tasks
            .into_par_iter()
            .map(|t| {
                let w = Walker {
                    nodes,
                    remote,
                    theta: self.params.theta,
                    task: nodes[t],
                    direct_max: DIRECT_PER_TERM * self.tables.nterms,
                    m2p_ratio: 1.0,
                    p2p_node_max: P2P_NODE_LEAVES * self.params.leaf_size,
                    m2p_max: usize::MAX,
                };
                let mut out = Lists::default();
                w.walk(0, 0, &mut out);
                for (k, c) in remote.iter().enumerate() {
                    w.walk_remote(0, nodes.len() + k, c, &mut out);
                }
                out
            })
            .reduce(Lists::default, |mut a, mut b| {
                a.m2l.append(&mut b.m2l);
                a.m2p.append(&mut b.m2p);
                a.p2p.append(&mut b.p2p);
                a.forced += b.forced;
                a
            });
        let nn = nodes.len();
        let pairs = lists
            .p2p
            .iter()
            .map(|&(a, b)| (nodes[a].count() * nodes[b].count()) as u64)
            .sum();
        let flat = |c: Csr| {
            (
                c.offsets.iter().map(|&o| o as u32).collect(),
                c.items.iter().map(|&i| i as u32).collect(),
            )
        };
        WalkLists {
            m2l: flat(csr(lists.m2l, nn)),
            m2p: flat(csr(lists.m2p, nn)),
            p2p: flat(csr(lists.p2p, nn)),
            forced: lists.forced,
            p2p_pairs: pairs,
        }
    }

    /// The walk's rules beyond the opening angle ([`Fmm::walk_lists`]), for the GPU's walk:
    /// the largest `n_A n_B` of a well-separated pair with a leaf target summed directly,
    /// and the largest non-leaf source node summed directly against a neighbouring leaf.
    pub(crate) fn walk_limits(&self) -> (usize, usize) {
        (
            DIRECT_PER_TERM * self.tables.nterms,
            P2P_NODE_LEAVES * self.params.leaf_size,
        )
    }

    /// Parameters.
    pub fn params(&self) -> &FmmParams {
        &self.params
    }

    /// Number of multipole coefficients per node.
    pub fn nterms(&self) -> usize {
        self.tables.nterms
    }

    /// Builds the tree of local plus imported particles (locals first, they are targets).
    pub fn build_tree(&self, sources: &SourceSet) -> Tree {
        let mut tree = self.build_tree_nodes(sources);
        tree.upward_pass(&self.tables);
        tree
    }

    /// Gravity on the local particles of `sources` from all of its sources: acceleration
    /// `[n][3]` and potential `[n]` (G = `g`, Plummer softening `softening` kpc, no
    /// self-interaction).
    ///
    /// Phases (each timed in [`FmmStats::seconds`]): tree build, upward pass (P2M, M2M),
    /// dual tree traversal, M2L, L2L, then per target leaf L2P, M2P and P2P.
    ///
    /// Errors: [`NbodyError::InvalidParameter`] when the masses do not match the positions, an
    /// imported multipole has the wrong number of coefficients, or a position is not finite;
    /// [`NbodyError::Interrupted`] at the end of a phase once a stop was asked for
    /// ([`lockstep_core::interrupt`]).
    pub fn forces(
        &self,
        sources: &SourceSet,
        g: f64,
        softening: f64,
    ) -> Result<(Forces, FmmStats), NbodyError> {
        check_sources(sources, self.tables.nterms)?;
        let n_local = sources.pos.len();
        if n_local == 0 {
            return Ok((Forces::zeros(0), FmmStats::default()));
        }
        if let Some(device) = &self.device {
            let out = device.fmm_forces(self, sources, g, softening)?;
            NbodyError::check_interrupt()?;
            return Ok(out);
        }
        let eps2 = softening * softening;
        let mut clock = PhaseClock::new();
        let mut tree = self.build_tree_nodes(sources);
        clock.lap(&mut |s| &mut s.tree);
        NbodyError::check_interrupt()?;
        tree.upward_pass(&self.tables);
        let scheme = if self.harmonic_far_field {
            self.tables.contraction(eps2)
        } else {
            &self.tables.full
        };
        let coeffs = self.source_coefficients(&tree, sources.remote_cells, scheme);
        clock.lap(&mut |s| &mut s.upward);
        NbodyError::check_interrupt()?;
        let n_all = tree.perm.len();
        let mut acc_s = vec![[0.0f64; 3]; n_all];
        let mut pot_s = vec![0.0f64; n_all];
        let walked = self.traverse(&tree, sources.remote_cells, eps2, &mut acc_s, &mut pot_s);
        clock.split_lap(walked.p2p_share(), &mut |s| &mut s.traversal, &mut |s| {
            &mut s.p2p
        });
        NbodyError::check_interrupt()?;
        let lists = interaction_lists(walked.lists, tree.nodes.len());
        let sources_far = FarSources {
            tree: &tree,
            remote: sources.remote_cells,
            scheme,
            coeffs: &coeffs,
        };
        let mut locals = self.m2l_pass(&sources_far, &lists.m2l, eps2);
        clock.lap(&mut |s| &mut s.m2l);
        NbodyError::check_interrupt()?;
        self.l2l_pass(&tree, &mut locals);
        clock.lap(&mut |s| &mut s.l2l);
        self.l2p_pass(&tree, &locals, &mut acc_s, &mut pot_s);
        clock.lap(&mut |s| &mut s.l2p);
        self.m2p_pass(&sources_far, &lists.m2p, eps2, &mut acc_s, &mut pot_s);
        clock.lap(&mut |s| &mut s.m2p);
        NbodyError::check_interrupt()?;
        let out = unsort_scaled(&tree, n_local, g, &acc_s, &pot_s);
        let stats = FmmStats {
            nodes: tree.nodes.len(),
            depth: tree.depth(),
            m2l: lists.m2l.items.len(),
            p2p_blocks: walked.p2p_blocks,
            m2p: lists.m2p.items.len(),
            p2p_pairs: walked.p2p_pairs,
            forced_m2l: lists.forced,
            seconds: clock.seconds,
        };
        Ok((out, stats))
    }

    /// The nodes of the tree of local plus imported particles, without multipoles.
    pub(crate) fn build_tree_nodes(&self, sources: &SourceSet) -> Tree {
        let leaf = self.params.leaf_size;
        if sources.remote_pos.is_empty() {
            Tree::build_nodes(sources.pos, sources.mass, sources.pos.len(), leaf)
        } else {
            let mut pos = sources.pos.to_vec();
            pos.extend_from_slice(sources.remote_pos);
            let mut mass = sources.mass.to_vec();
            mass.extend_from_slice(sources.remote_mass);
            Tree::build_nodes(&pos, &mass, sources.pos.len(), leaf)
        }
    }

    /// The [`Tables::source_coefficients`] of every source (tree nodes, then imported
    /// cells) for the contraction `scheme`: `[source][scheme.ncoeffs()]`.
    fn source_coefficients(
        &self,
        tree: &Tree,
        remote: &[RemoteCell],
        scheme: &expansion::Contraction,
    ) -> Vec<f64> {
        let tables = &self.tables;
        let (nt, nc, nn) = (tables.nterms, scheme.ncoeffs(), tree.nodes.len());
        let mut coeffs = vec![0.0; (nn + remote.len()) * nc];
        coeffs.par_chunks_mut(nc).enumerate().for_each_init(
            || vec![0.0; nt],
            |s, (b, out)| {
                let mp = if b < nn {
                    tree.multipole(b, nt)
                } else {
                    &remote[b - nn].multipole[..]
                };
                tables.source_coefficients(scheme, mp, out, s);
            },
        );
        coeffs
    }

    /// Local expansions `[node][nterms]` from the M2L list, parallel over target nodes,
    /// [`expansion::LANES`] sources at a time.
    fn m2l_pass(&self, far: &FarSources, m2l: &Csr, eps2: f64) -> Vec<f64> {
        let tables = &self.tables;
        let nt = tables.nterms;
        let nn = far.tree.nodes.len();
        let mut locals = vec![0.0; nn * nt];
        locals.par_chunks_mut(nt).enumerate().for_each_init(
            || (expansion::BatchWork::default(), Vec::new()),
            |(w, srcs), (a, loc)| {
                let row = m2l.row(a);
                // A stop asked for skips the rest; `forces` returns the error after the pass.
                if row.is_empty() || lockstep_core::interrupt::requested() {
                    return;
                }
                srcs.clear();
                srcs.extend(row.iter().map(|&b| far.source(b)));
                let za = far.tree.nodes[a].center;
                tables.m2l_batch(far.scheme, srcs, za, eps2, loc, w);
            },
        );
        locals
    }

    /// Pushes the local expansions down the levels (L2L), parallel over the nodes of a level.
    fn l2l_pass(&self, tree: &Tree, locals: &mut [f64]) {
        let tables = &self.tables;
        let nt = tables.nterms;
        for l in 1..tree.level_start.len() - 1 {
            let (head, tail) = locals.split_at_mut(tree.level_start[l] * nt);
            let head: &[f64] = head;
            let lvl = tree.level_start[l];
            let cnt = tree.level_start[l + 1] - lvl;
            tail[..cnt * nt]
                .par_chunks_mut(nt)
                .enumerate()
                .for_each_init(
                    || vec![0.0; nt],
                    |s, (k, loc)| {
                        let nd = &tree.nodes[lvl + k];
                        if nd.ntargets == 0 {
                            return;
                        }
                        let p = nd.parent;
                        let zp = tree.nodes[p].center;
                        tables.l2l(&head[p * nt..(p + 1) * nt], zp, nd.center, loc, s);
                    },
                );
        }
    }

    /// Evaluates each target leaf's local expansion at its particles (L2P), added to the
    /// sorted-order outputs `acc_s`, `pot_s`.
    fn l2p_pass(&self, tree: &Tree, locals: &[f64], acc_s: &mut [[f64; 3]], pot_s: &mut [f64]) {
        let tables = &self.tables;
        let nt = tables.nterms;
        leaf_slices(tree, acc_s, pot_s)
            .into_par_iter()
            .for_each_init(
                || vec![0.0; nt],
                |s, (lf, acc, pot)| {
                    let nd: &Node = &tree.nodes[lf];
                    let loc = &locals[lf * nt..(lf + 1) * nt];
                    for (k, i) in (nd.start..nd.end).enumerate() {
                        let x = tree.soa.point(i);
                        let (phi, gr) = tables.l2p(loc, nd.center, x, s);
                        for c in 0..3 {
                            acc[k][c] += gr[c];
                        }
                        pot[k] -= phi;
                    }
                },
            );
    }

    /// Adds the multipoles of the M2P list evaluated at each particle of the target leaves,
    /// [`expansion::LANES`] particles at a time.
    fn m2p_pass(
        &self,
        far: &FarSources,
        m2p: &Csr,
        eps2: f64,
        acc_s: &mut [[f64; 3]],
        pot_s: &mut [f64],
    ) {
        let tables = &self.tables;
        let tree = far.tree;
        leaf_slices(tree, acc_s, pot_s)
            .into_par_iter()
            .filter(|(lf, _, _)| !m2p.row(*lf).is_empty())
            .for_each_init(expansion::BatchWork::default, |w, (lf, acc, pot)| {
                let nd: &Node = &tree.nodes[lf];
                let xs: Vec<[f64; 3]> = (nd.start..nd.end).map(|i| tree.soa.point(i)).collect();
                for &b in m2p.row(lf) {
                    let (zb, cs) = far.source(b);
                    for (c0, chunk) in xs.chunks(expansion::LANES).enumerate() {
                        let (phi, gr) = tables.m2p_batch(far.scheme, cs, zb, chunk, eps2, w);
                        for l in 0..chunk.len() {
                            let k = c0 * expansion::LANES + l;
                            for c in 0..3 {
                                acc[k][c] += gr[c][l];
                            }
                            pot[k] -= phi[l];
                        }
                    }
                }
            });
    }
    /// Dual tree traversal: collects the (target node, source) M2L and M2P pairs and sums
    /// the near field (P2P) of each task's target leaves right away into `acc_s`/`pot_s`
    /// (sorted order), so the P2P pairs, by far the most numerous, are never stored
    /// globally. Sources `>= nodes.len()` are imported cells. Parallel over target subtrees
    /// ("tasks", which partition the particles); an interaction whose target is an
    /// ancestor of several tasks is kept by the task that starts at the ancestor's first
    /// particle.
    fn traverse(
        &self,
        tree: &Tree,
        remote: &[RemoteCell],
        eps2: f64,
        acc_s: &mut [[f64; 3]],
        pot_s: &mut [f64],
    ) -> Traversal {
        let nodes = &tree.nodes;
        // A fixed number of tasks, not one per thread: which pairs are evaluated mutually
        // depends on the tasks, and results must not depend on the thread count.
        let want = TASKS;
        let mut level = 0;
        while level + 1 < tree.level_start.len() - 1 {
            let count = tree.level_start[level + 1] - tree.level_start[level];
            if count >= want {
                break;
            }
            level += 1;
        }
        let mut tasks: Vec<usize> = (0..nodes.len())
            .filter(|&i| nodes[i].level == level || (nodes[i].level < level && nodes[i].is_leaf()))
            .collect();
        tasks.sort_by_key(|&t| nodes[t].start);
        let mut work = Vec::with_capacity(tasks.len());
        let (mut acc_rest, mut pot_rest) = (acc_s, pot_s);
        for &t in &tasks {
            let c = nodes[t].count();
            let (a, ar) = std::mem::take(&mut acc_rest).split_at_mut(c);
            let (p, pr) = std::mem::take(&mut pot_rest).split_at_mut(c);
            (acc_rest, pot_rest) = (ar, pr);
            work.push((t, a, p));
        }
        let walker = |t: usize| Walker {
            nodes,
            remote,
            theta: self.params.theta,
            task: nodes[t],
            direct_max: DIRECT_PER_TERM * self.tables.nterms,
            m2p_ratio: 1.0,
            p2p_node_max: P2P_NODE_LEAVES * self.params.leaf_size,
            m2p_max: usize::MAX,
        };
        let near_field = self.params.near_field;
        // The near-field kernels' softening and mass scale (the largest source mass).
        let near_scale = (eps2, tree.soa.m.iter().copied().fold(0.0, f64::max));
        // Pairs are evaluated once for both particles when every particle is a target (no
        // imported sources, whose partners would never be walked).
        let mutual = self.mutual_p2p && nodes[0].ntargets == nodes[0].count();
        work.into_par_iter()
            .map_init(NearBuffers::default, |(buf32, buf64), (t, acc, pot)| {
                // A stop asked for skips the remaining tasks; `forces` returns the error.
                if lockstep_core::interrupt::requested() {
                    return Traversal::default();
                }
                let clock = std::time::Instant::now();
                let mut out = Lists::default();
                let w = walker(t);
                w.walk(0, 0, &mut out);
                for (k, c) in remote.iter().enumerate() {
                    w.walk_remote(0, nodes.len() + k, c, &mut out);
                }
                let walked = clock.elapsed().as_secs_f64();
                let near = std::mem::take(&mut out.p2p);
                let p2p_blocks = near.len();
                let task = &nodes[t];
                let p2p_pairs = match near_field {
                    NearField::F32 => {
                        task_p2p(tree, near, task, mutual, near_scale, acc, pot, buf32)
                    }
                    NearField::F64 => {
                        task_p2p(tree, near, task, mutual, near_scale, acc, pot, buf64)
                    }
                };
                Traversal {
                    lists: out,
                    p2p_blocks,
                    p2p_pairs,
                    walk_cpu: walked,
                    p2p_cpu: clock.elapsed().as_secs_f64() - walked,
                }
            })
            .reduce(Traversal::default, |mut a, mut b| {
                // Order-preserving (rayon reduces in sequence order): deterministic lists.
                a.lists.m2l.append(&mut b.lists.m2l);
                a.lists.m2p.append(&mut b.lists.m2p);
                a.lists.forced += b.lists.forced;
                a.p2p_blocks += b.p2p_blocks;
                a.p2p_pairs += b.p2p_pairs;
                a.walk_cpu += b.walk_cpu;
                a.p2p_cpu += b.p2p_cpu;
                a
            })
    }
}

/// Result of [`Fmm::traverse`]: the far-field lists and the near-field work done.
#[derive(Default)]
struct Traversal {
    /// M2L and M2P pairs (the P2P list is consumed by the traversal).
    lists: Lists,
    /// (target leaf, source node) P2P blocks summed.
    p2p_blocks: usize,
    /// Particle pairs summed directly.
    p2p_pairs: u64,
    /// CPU seconds of the walks.
    walk_cpu: f64,
    /// CPU seconds of the P2P sums.
    p2p_cpu: f64,
}

impl Traversal {
    /// Share of the P2P sums in the CPU time of the traversal phase.
    fn p2p_share(&self) -> f64 {
        let total = self.walk_cpu + self.p2p_cpu;
        if total > 0.0 {
            self.p2p_cpu / total
        } else {
            0.0
        }
    }
}

/// Per-worker gathered-source buffers of the two near-field kernels.
type NearBuffers = (p2p::GatheredSources32, p2p::GatheredSources);

/// Adds the direct sums of one task's P2P pairs `(target leaf, source node)` into the
/// task's outputs `acc`/`pot` (sorted particles `task.start..task.end`): the sources of a
/// leaf are gathered into one padded buffer and each target sums over all of it, its own
/// entry massless. `(eps2, mass_scale)`: the squared softening (kpc^2) and a bound on the
/// source masses. Returns the number of particle pairs evaluated.
///
/// With `mutual`, a pair of the task's own particles is evaluated once for both
/// (Newton's third law): a leaf takes the reaction of the source nodes of the task that
/// come after it in the sorted order and skips those before it, which did the same for
/// it. Valid because the near field is symmetric ([`Walker::walk`]) and a node either lies
/// in the task or is disjoint from it; pairs with sources outside the task are evaluated
/// from both sides, so the result does not depend on which thread runs a task.
#[allow(clippy::too_many_arguments)]
fn task_p2p<B: p2p::Gathered>(
    tree: &Tree,
    pairs: Vec<(usize, usize)>,
    task: &Node,
    mutual: bool,
    (eps2, mass_scale): (f64, f64),
    acc: &mut [[f64; 3]],
    pot: &mut [f64],
    buf: &mut B,
) -> u64 {
    let pairs = group_by_target(tree, task, pairs);
    let inside = |n: &Node| mutual && task.start <= n.start && n.end <= task.end;
    let mut reacting: Vec<(usize, usize, usize)> = Vec::new();
    let mut count = 0u64;
    for group in pairs.chunk_by(|x, y| x.0 == y.0) {
        let lf = group[0].0;
        let nd: &Node = &tree.nodes[lf];
        let own = group.iter().any(|&(_, b)| b == lf);
        // Bound on |x - centre| per coordinate over the sources, from the node geometry.
        let extent = group.iter().fold(nd.radius, |e, &(_, b)| {
            let src = &tree.nodes[b];
            let d = (0..3).fold(0.0f64, |d, k| d.max((src.center[k] - nd.center[k]).abs()));
            e.max(d + src.radius)
        });
        buf.begin(nd.center, extent, mass_scale);
        let mut sources = 0usize;
        if own {
            buf.extend(&tree.soa, nd.start..nd.end);
            sources += nd.count();
        }
        // Segments: own particles, the sources that take the reaction, the others.
        buf.pad();
        let mutual_start = buf.len();
        reacting.clear();
        for &(_, b) in group {
            let src = &tree.nodes[b];
            if b != lf && inside(src) && src.start > nd.start {
                reacting.push((src.start, buf.len(), src.count()));
                buf.extend(&tree.soa, src.start..src.end);
                sources += src.count();
            }
        }
        buf.pad();
        let mutual_range = mutual_start..buf.len();
        for &(_, b) in group {
            let src = &tree.nodes[b];
            if b != lf && !inside(src) {
                buf.extend(&tree.soa, src.start..src.end);
                sources += src.count();
            }
        }
        buf.finish();
        count += (sources * nd.count()) as u64;
        let off = nd.start - task.start;
        // Two targets per pass over the sources (independent work for the CPU to overlap).
        for k in (0..nd.count()).step_by(2) {
            let ks = k..(k + 2).min(nd.count());
            let (i, last) = (nd.start + k, nd.start + ks.end - 1);
            let t = [tree.soa.point(i), tree.soa.point(last)];
            let mt = [tree.soa.m[i], tree.soa.m[last]];
            let n = ks.len();
            let own_entry = own.then_some(k);
            let fields = buf.field_at(&t[..n], &mt[..n], own_entry, eps2, mutual_range.clone());
            for (j, (a, phi)) in ks.zip(fields) {
                for c in 0..3 {
                    acc[off + j][c] += a[c];
                }
                pot[off + j] -= phi;
            }
        }
        for &(first, entry, n) in &reacting {
            for j in 0..n {
                let (a, phi) = buf.reaction(entry + j);
                let o = first + j - task.start;
                for c in 0..3 {
                    acc[o][c] += a[c];
                }
                pot[o] -= phi;
            }
        }
    }
    count
}

/// The pairs `(target leaf, source)` of a task grouped by target leaf in particle order,
/// each leaf's sources in the (deterministic) traversal order: a counting sort on the
/// leaves' first particles, which are distinct and lie in `task.start..task.end`.
fn group_by_target(tree: &Tree, task: &Node, pairs: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    let key = |a: usize| tree.nodes[a].start - task.start;
    let mut offsets = vec![0usize; task.count() + 1];
    for &(a, _) in &pairs {
        offsets[key(a) + 1] += 1;
    }
    for i in 0..task.count() {
        offsets[i + 1] += offsets[i];
    }
    let mut out = vec![(0, 0); pairs.len()];
    for (a, b) in pairs {
        let slot = &mut offsets[key(a)];
        out[*slot] = (a, b);
        *slot += 1;
    }
    out
}

/// The target leaves (leaves holding local particles) with their disjoint slices of the
/// sorted-order outputs, in particle order.
#[allow(clippy::type_complexity)]
fn leaf_slices<'o>(
    tree: &Tree,
    acc_s: &'o mut [[f64; 3]],
    pot_s: &'o mut [f64],
) -> Vec<(usize, &'o mut [[f64; 3]], &'o mut [f64])> {
    let mut leaves: Vec<usize> = (0..tree.nodes.len())
        .filter(|&i| tree.nodes[i].is_leaf())
        .collect();
    leaves.sort_by_key(|&i| tree.nodes[i].start);
    let mut work = Vec::with_capacity(leaves.len());
    let mut acc_rest = acc_s;
    let mut pot_rest = pot_s;
    for &lf in &leaves {
        let c = tree.nodes[lf].count();
        let (a, ar) = std::mem::take(&mut acc_rest).split_at_mut(c);
        let (p, pr) = std::mem::take(&mut pot_rest).split_at_mut(c);
        acc_rest = ar;
        pot_rest = pr;
        if tree.nodes[lf].ntargets > 0 {
            work.push((lf, a, p));
        }
    }
    work
}

/// The far-field sources of one evaluation: the tree's nodes, then the imported cells,
/// with their source coefficients for the M2L/M2P contraction.
struct FarSources<'t> {
    tree: &'t Tree,
    remote: &'t [RemoteCell],
    scheme: &'t expansion::Contraction,
    /// `[source][scheme.ncoeffs()]`, from [`Fmm::source_coefficients`].
    coeffs: &'t [f64],
}

impl<'t> FarSources<'t> {
    /// Centre and source coefficients of source `b`: a tree node when `b < nodes.len()`,
    /// else the imported cell `b - nodes.len()`.
    fn source(&self, b: usize) -> ([f64; 3], &'t [f64]) {
        let nn = self.tree.nodes.len();
        let nc = self.scheme.ncoeffs();
        let center = if b < nn {
            self.tree.nodes[b].center
        } else {
            self.remote[b - nn].center
        };
        (center, &self.coeffs[b * nc..(b + 1) * nc])
    }
}

/// Sorted-order outputs back to input order for the `n_local` targets, scaled by G.
fn unsort_scaled(tree: &Tree, n_local: usize, g: f64, acc_s: &[[f64; 3]], pot_s: &[f64]) -> Forces {
    let mut out = Forces::zeros(n_local);
    for (s, &i) in tree.perm.iter().enumerate() {
        if i < n_local {
            out.acc[i] = [g * acc_s[s][0], g * acc_s[s][1], g * acc_s[s][2]];
            out.pot[i] = g * pot_s[s];
        }
    }
    out
}

/// The traversal's M2L and M2P pairs grouped by target node (`nn` nodes).
fn interaction_lists(lists: Lists, nn: usize) -> InteractionLists {
    InteractionLists {
        m2l: csr(lists.m2l, nn),
        m2p: csr(lists.m2p, nn),
        forced: lists.forced,
    }
}

/// Wall-clock lap timer filling [`PhaseSeconds`].
struct PhaseClock {
    last: std::time::Instant,
    seconds: PhaseSeconds,
}

impl PhaseClock {
    fn new() -> Self {
        PhaseClock {
            last: std::time::Instant::now(),
            seconds: PhaseSeconds::default(),
        }
    }

    /// Adds the time since the previous lap to the phase chosen by `field`.
    fn lap(&mut self, field: &mut dyn FnMut(&mut PhaseSeconds) -> &mut f64) {
        let now = std::time::Instant::now();
        *field(&mut self.seconds) += (now - self.last).as_secs_f64();
        self.last = now;
    }

    /// Splits the time since the previous lap between two phases that ran interleaved:
    /// the share `second_share` (of their CPU time) goes to `second`, the rest to `first`.
    fn split_lap(
        &mut self,
        second_share: f64,
        first: &mut dyn FnMut(&mut PhaseSeconds) -> &mut f64,
        second: &mut dyn FnMut(&mut PhaseSeconds) -> &mut f64,
    ) {
        let now = std::time::Instant::now();
        let dt = (now - self.last).as_secs_f64();
        *first(&mut self.seconds) += dt * (1.0 - second_share);
        *second(&mut self.seconds) += dt * second_share;
        self.last = now;
    }
}

/// A well-separated pair with a leaf target is summed directly when `n_A n_B` is at most
/// this many times the number of expansion coefficients (cost model: one M2L costs a few
/// particle-particle interactions per coefficient).
const DIRECT_PER_TERM: usize = 8;

/// Traversal tasks (target subtrees) aimed at: enough for rayon to balance the near-field
/// sums of a centrally concentrated system on many threads, few enough that most
/// near-field pairs lie within one task and are evaluated once for both particles.
const TASKS: usize = 128;

/// A source node of at most this many leaf sizes that fails the opening test against a
/// target leaf is summed directly as one contiguous range.
const P2P_NODE_LEAVES: usize = 4;

struct Walker<'a> {
    nodes: &'a [Node],
    remote: &'a [RemoteCell],
    theta: f64,
    task: Node,
    /// Largest `n_A n_B` of a well-separated pair with leaf target done by P2P.
    direct_max: usize,
    /// Largest target leaf that takes M2P instead of M2L.
    m2p_max: usize,
    m2p_ratio: f64,
    /// Largest non-leaf source node summed directly against a neighbouring target leaf.
    p2p_node_max: usize,
}

impl Walker<'_> {
    /// True when node `a` holds particles of the task.
    fn overlaps(&self, a: &Node) -> bool {
        a.start < self.task.end && self.task.start < a.end
    }

    /// True when this task records interactions of target `a`.
    fn owns(&self, a: &Node) -> bool {
        a.level >= self.task.level || a.start == self.task.start
    }

    fn walk(&self, a: usize, b: usize, out: &mut Lists) {
        let na = &self.nodes[a];
        if na.ntargets == 0 || !self.overlaps(na) {
            return;
        }
        if a == b {
            if na.is_leaf() {
                if self.owns(na) {
                    out.p2p.push((a, a));
                }
                return;
            }
            for ca in na.children() {
                for cb in na.children() {
                    self.walk(ca, cb, out);
                }
            }
            return;
        }
        let nb = &self.nodes[b];
        let d = dist(na.center, nb.center);
        if na.radius + nb.radius < self.theta * d {
            if na.count() * nb.count() <= self.direct_max && !na.is_leaf() {
                // Few particles: descend to the target leaves and sum directly there.
                for ca in na.children() {
                    self.walk(ca, b, out);
                }
                return;
            }
            if self.owns(na) {
                // Exact and cheaper than M2L + L2P for few particles (falcON's choice).
                if na.is_leaf() && na.count() * nb.count() <= self.direct_max {
                    out.p2p.push((a, b));
                } else if na.is_leaf()
                    && na.radius > self.m2p_ratio * nb.radius
                    && na.count() <= self.m2p_max
                {
                    // A sparse target leaf: evaluating the multipole at each particle is
                    // far more accurate than a local expansion about the leaf centre.
                    out.m2p.push((a, b));
                } else {
                    out.m2l.push((a, b));
                }
            }
            return;
        }
        let split_a = match (na.is_leaf(), nb.is_leaf()) {
            (true, true) => {
                if self.owns(na) {
                    out.p2p.push((a, b));
                }
                return;
            }
            (true, false) if nb.count() <= self.p2p_node_max => {
                // A small source subtree next to a leaf: one direct sum over its contiguous
                // particle range instead of a walk down to its leaves.
                if self.owns(na) {
                    out.p2p.push((a, b));
                }
                return;
            }
            (true, false) => false,
            (false, true) if na.count() <= self.p2p_node_max => {
                // The mirror of the rule above, so that the near field stays symmetric:
                // every target leaf of the small subtree sums the source leaf directly.
                self.p2p_leaves(a, b, out);
                return;
            }
            (false, true) => true,
            (false, false) => (na.radius, a) > (nb.radius, b),
        };
        if split_a {
            for ca in na.children() {
                self.walk(ca, b, out);
            }
        } else {
            for cb in nb.children() {
                self.walk(a, cb, out);
            }
        }
    }

    /// Direct sums of every target leaf of subtree `a` (owned by this task) with node `b`.
    fn p2p_leaves(&self, a: usize, b: usize, out: &mut Lists) {
        let na = &self.nodes[a];
        if na.ntargets == 0 || !self.overlaps(na) {
            return;
        }
        if na.is_leaf() {
            if self.owns(na) {
                out.p2p.push((a, b));
            }
            return;
        }
        for ca in na.children() {
            self.p2p_leaves(ca, b, out);
        }
    }

    fn walk_remote(&self, a: usize, b: usize, cell: &RemoteCell, out: &mut Lists) {
        let na = &self.nodes[a];
        if na.ntargets == 0 || !self.overlaps(na) {
            return;
        }
        let _ = self.remote;
        let d = dist(na.center, cell.center);
        let pass = na.radius + cell.radius < self.theta * d;
        if pass || na.is_leaf() {
            if self.owns(na) {
                if !pass {
                    // The sender should have sent particles; evaluate the multipole at each
                    // particle, the most accurate use of what arrived.
                    out.forced += 1;
                    out.m2p.push((a, b));
                } else if na.is_leaf() && na.radius > self.m2p_ratio * cell.radius {
                    out.m2p.push((a, b));
                } else {
                    out.m2l.push((a, b));
                }
            }
            return;
        }
        for ca in na.children() {
            self.walk_remote(ca, b, cell, out);
        }
    }
}

fn dist(a: [f64; 3], b: [f64; 3]) -> f64 {
    ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)).sqrt()
}

pub(crate) fn check_sources(s: &SourceSet, nterms: usize) -> Result<(), NbodyError> {
    if s.pos.len() != s.mass.len() {
        return Err(NbodyError::param(
            "SourceSet",
            format!("{} positions, {} masses", s.pos.len(), s.mass.len()),
            "pass one mass per local position",
        ));
    }
    if s.remote_pos.len() != s.remote_mass.len() {
        return Err(NbodyError::param(
            "SourceSet.remote",
            format!(
                "{} positions, {} masses",
                s.remote_pos.len(),
                s.remote_mass.len()
            ),
            "pass one mass per imported position",
        ));
    }
    for (k, c) in s.remote_cells.iter().enumerate() {
        if c.multipole.len() != nterms {
            return Err(NbodyError::param(
                "SourceSet.remote_cells",
                format!("cell {k} has {} coefficients", c.multipole.len()),
                &format!("imported multipoles must have the solver's {nterms} coefficients (same order p)"),
            ));
        }
    }
    let bad = s
        .pos
        .iter()
        .chain(s.remote_pos)
        .position(|x| !x.iter().all(|v| v.is_finite()));
    if let Some(i) = bad {
        return Err(NbodyError::param(
            "particle position",
            format!("index {i}"),
            "positions must be finite (check the initial conditions and time step)",
        ));
    }
    Ok(())
}

/// FMM gravity of `pos`/`mass` on themselves with G = `g`, Plummer softening `softening`
/// (kpc) and parameters `params`: acceleration `[n][3]`, potential `[n]`.
pub fn fmm(
    pos: &[[f64; 3]],
    mass: &[f64],
    g: f64,
    softening: f64,
    params: &FmmParams,
) -> Result<Forces, NbodyError> {
    Ok(Fmm::new(*params)?
        .forces(&SourceSet::local(pos, mass), g, softening)?
        .0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InitialConditions;

    fn systems() -> Vec<(&'static str, crate::Particles)> {
        let plummer = InitialConditions::Plummer {
            n: 20_000,
            total_mass: 1.0,
            scale_radius: 1.0,
            max_radius: 30.0,
            seed: 5,
        };
        let clumps = InitialConditions::Clumps {
            n: 20_000,
            clumps: 10,
            total_mass: 1.0,
            box_size: 10.0,
            clump_radius: 0.2,
            velocity_dispersion: 0.0,
            seed: 6,
        };
        vec![
            ("plummer", plummer.generate(1.0, 0, 1, 1.0).unwrap()),
            ("clumps", clumps.generate(1.0, 0, 1, 1.0).unwrap()),
        ]
    }

    /// Every particle's acceleration within `tol` of `want`'s (relative to its norm), and
    /// its potential within `tol` relative.
    fn assert_forces_close(what: &str, got: &Forces, want: &Forces, tol: f64) {
        for (i, (a, b)) in got.acc.iter().zip(&want.acc).enumerate() {
            let norm = b.iter().map(|v| v * v).sum::<f64>().sqrt();
            let err = (0..3).map(|c| (a[c] - b[c]).powi(2)).sum::<f64>().sqrt();
            assert!(err <= tol * norm, "{what}: particle {i}: {a:?} vs {b:?}");
            let (pa, pb) = (got.pot[i], want.pot[i]);
            assert!(
                (pa - pb).abs() <= tol * pb.abs(),
                "{what}: potential {pa} vs {pb}"
            );
        }
    }

    #[test]
    fn harmonic_far_field_matches_the_full_contraction() {
        // Without softening M2L and M2P fold the multipoles into (p+1)^2 coefficients: the
        // same forces as the full contraction up to rounding, for every order.
        for (name, p) in systems() {
            for order in [2, 4, 6] {
                let params = FmmParams {
                    order,
                    near_field: NearField::F64,
                    ..FmmParams::default()
                };
                let harmonic = Fmm::new(params).unwrap();
                let full = Fmm {
                    harmonic_far_field: false,
                    ..harmonic.clone()
                };
                let src = SourceSet::local(p.valid_pos(), p.valid_mass());
                let (fh, sh) = harmonic.forces(&src, 1.0, 0.0).unwrap();
                let (ff, sf) = full.forces(&src, 1.0, 0.0).unwrap();
                assert!(sh.m2l > 1000 && sh.m2p > 0, "{name}: {sh:?}");
                assert_eq!((sh.m2l, sh.m2p), (sf.m2l, sf.m2p));
                assert_forces_close(&format!("{name} p {order}"), &fh, &ff, 1e-11);
            }
        }
    }

    /// Evaluating a pair once for both particles gives the forces of the one-sided sums to
    /// rounding: a pair missed or counted twice (an asymmetric near field) would show as an
    /// error of the size of one pair's force, far above it.
    #[test]
    fn mutual_near_field_matches_the_one_sided_sums() {
        for (name, p) in systems() {
            for near_field in [NearField::F32, NearField::F64] {
                let params = FmmParams {
                    near_field,
                    ..FmmParams::default()
                };
                let mutual = Fmm::new(params).unwrap();
                let one_sided = Fmm {
                    mutual_p2p: false,
                    ..mutual.clone()
                };
                let src = SourceSet::local(p.valid_pos(), p.valid_mass());
                let (fm, sm) = mutual.forces(&src, 1.0, 1e-3).unwrap();
                let (fo, so) = one_sided.forces(&src, 1.0, 1e-3).unwrap();
                assert_eq!(sm.p2p_blocks, so.p2p_blocks);
                assert!(
                    (sm.p2p_pairs as f64) < 0.95 * so.p2p_pairs as f64,
                    "{name}: {} pairs evaluated mutually against {} one-sided",
                    sm.p2p_pairs,
                    so.p2p_pairs
                );
                let tol = match near_field {
                    NearField::F32 => 2e-5,
                    NearField::F64 => 1e-12,
                };
                assert_forces_close(&format!("{name} {near_field:?}"), &fm, &fo, tol);
            }
        }
    }

    /// The tasks, hence which pairs are evaluated once for both particles, do not depend on
    /// the number of threads: the forces are bitwise the same on 1 and 3 threads.
    #[test]
    fn forces_do_not_depend_on_the_thread_count() {
        let (_, p) = systems().remove(0);
        let fmm = Fmm::new(FmmParams::default()).unwrap();
        let src = SourceSet::local(p.valid_pos(), p.valid_mass());
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| fmm.forces(&src, 1.0, 1e-3).unwrap().0)
        };
        let (one, three) = (run(1), run(3));
        assert!(one.acc == three.acc && one.pot == three.pot);
    }
}
