//! What the N-body GPU modules that sort share (`sort_scan.wgsl`): dispatch records,
//! exclusive scans of up to four levels of 256, a stable radix sort of (key, value) pairs,
//! and the recording of a submission whose dispatch sizes may come from the device
//! (indirect dispatches whose arguments a kernel writes into the module's `meta` array and
//! the host copies between compute passes). Used by the dual tree walk (`walk.rs`) and the
//! tree build (`tree.rs`); their kernel lists begin with the four shared entry points.

use lockstep_gpu::{wgpu, GpuContext};

use super::pipelines::{records_group, Bound, Module, RECORD_STRIDE};

/// What shrinks the tree's and the walk's buffers, for the messages of buffers too large.
pub(super) const REDUCE: &str =
    "the particles per rank (run more ranks or GPUs: mpirun -n R) or raise forces.leaf_size";
/// Bytes of `Rec` in `sort_scan.wgsl`.
pub(super) const REC_BYTES: u64 = 96;
/// Threads per workgroup of the per-item kernels; the scans and sorts use 256.
pub(super) const WG: u32 = 64;
pub(super) const SCAN: u64 = 256;
/// Entries per tile of the radix sort (`TILE` in `sort_scan.wgsl`).
pub(super) const SORT_TILE: u64 = 4096;
/// No length word (`NONE` in `sort_scan.wgsl`).
pub(super) const NONE: u32 = u32::MAX;
/// Where a module's `meta` array keeps the next dispatch sizes (`M_ARGS`): 16 words, the
/// per-item, scan-level and module-specific (x, y, z) triples, copied to the arguments.
pub(super) const M_ARGS: usize = 32;
/// Bytes of the indirect arguments buffer (16 words).
pub(super) const ARGS_BYTES: u64 = 64;
/// The shared entry points, first in every module's list.
pub(super) const SCAN_UP: usize = 0;
pub(super) const SCAN_DOWN: usize = 1;
pub(super) const SORT_COUNT: usize = 2;
pub(super) const SORT_SCATTER: usize = 3;

/// An indirect arguments buffer for a module's dispatches.
pub(super) fn args_buffer(ctx: &GpuContext) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("indirect dispatch sizes"),
        size: ARGS_BYTES,
        usage: wgpu::BufferUsages::INDIRECT | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// The (x, y, 1) workgroups of `n` items of `per` each for the four triples at `M_ARGS`:
/// per item (`WG`) and scan levels 0, 1, 2 (`256^(k+1)`).
pub(super) fn sizes(n: u64) -> [u32; 12] {
    let mut a = [0u32; 12];
    for (k, per) in [WG as u64, SCAN, SCAN * SCAN, SCAN * SCAN * SCAN]
        .into_iter()
        .enumerate()
    {
        let g = n.div_ceil(per) as u32;
        a[3 * k] = g.min(65_535);
        a[3 * k + 1] = g.div_ceil(65_535).max(1);
        a[3 * k + 2] = 1;
    }
    a
}

/// One dispatch: its kernel, its record and its size.
pub(super) enum Size {
    /// Workgroups.
    Direct(u32),
    /// Workgroups from the indirect arguments at this byte offset.
    Indirect(u64),
}

/// A dispatch record (`Rec` of `sort_scan.wgsl`, 24 words): each module reads the fields
/// it needs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Rec {
    pub(super) nn: u32,
    pub(super) direct_max: u32,
    pub(super) p2p_node_max: u32,
    pub(super) th2: [f32; 2],
    pub(super) parity: u32,
    pub(super) cap_f: u32,
    pub(super) cap_e: u32,
    pub(super) pass_bits: u32,
    pub(super) ntiles: u32,
    pub(super) kb: u32,
    pub(super) s: [u32; 4],
    pub(super) s_level: u32,
    pub(super) len: u32,
    pub(super) len_word: u32,
    pub(super) count: u32,
    pub(super) s_top: u32,
    /// Tree: the largest leaf.
    pub(super) leaf: u32,
    /// Tree: the level being split.
    pub(super) level: u32,
    /// Tree: particles below this index are targets.
    pub(super) n_targets: u32,
}

impl Rec {
    pub(super) fn words(&self) -> [u32; 24] {
        [
            self.nn,
            0, // zero: what `opq` XORs with
            self.direct_max,
            self.p2p_node_max,
            self.th2[0].to_bits(),
            self.th2[1].to_bits(),
            self.parity,
            self.cap_f,
            self.cap_e,
            self.pass_bits,
            self.ntiles,
            self.kb,
            self.s[0],
            self.s[1],
            self.s[2],
            self.s[3],
            self.s_level,
            self.len,
            self.len_word,
            self.count,
            self.s_top,
            self.leaf,
            self.level,
            self.n_targets,
        ]
    }
}

/// The levels of one scan of up to `len` entries at word `at` of the scan array: their
/// offsets, as many levels as `len` needs (the top one a single block of at most 256, its
/// grand total after them), and the words it spans.
pub(super) fn scan_levels(at: u64, len: u64) -> (Scan, u64) {
    let mut s = [at as u32; 4];
    let (mut n, mut off, mut top) = (len.max(1), at, 0);
    while n > SCAN {
        off += n;
        n = n.div_ceil(SCAN);
        top += 1;
        s[top] = off as u32;
    }
    let end = off + SCAN + 1;
    (Scan { s, top: top as u32 }, end - at)
}

/// Where one scan's levels are (`scan_levels`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Scan {
    pub(super) s: [u32; 4],
    pub(super) top: u32,
}

impl Scan {
    /// The word of the grand total.
    pub(super) fn total(&self) -> u32 {
        self.s[self.top as usize] + SCAN as u32
    }
}

/// Workgroups in two dimensions (at most 65,535 in x).
pub(super) fn grid(groups: u32) -> (u32, u32) {
    let x = groups.clamp(1, 65_535);
    (x, groups.div_ceil(x).max(1))
}

/// The recorded dispatches of one submission.
#[derive(Default)]
pub(super) struct Recorder {
    pub(super) recs: Vec<[u32; 24]>,
    /// Per compute pass: `(entry, record, size)`; between passes the copy of the next
    /// step's dispatch sizes into the indirect arguments.
    pub(super) passes: Vec<Vec<(usize, usize, Size)>>,
}

impl Recorder {
    pub(super) fn push(&mut self, entry: usize, rec: Rec, size: Size) {
        if self.passes.is_empty() {
            self.passes.push(Vec::new());
        }
        let k = self.recs.len();
        self.recs.push(rec.words());
        self.passes
            .last_mut()
            .expect("a pass")
            .push((entry, k, size));
    }

    /// An exclusive scan at `scan` of the length in meta word `len_word` (or `len`), sized
    /// from the indirect arguments (`indirect`) or from `len`: `2 levels - 1` dispatches.
    pub(super) fn scan(&mut self, base: Rec, scan: Scan, len_word: u32, len: u64, indirect: bool) {
        let size = |level: u32| {
            if indirect {
                Size::Indirect(4 * (M_ARGS as u64 + 3 + 3 * level as u64))
            } else {
                Size::Direct(len.div_ceil(SCAN.pow(level + 1)) as u32)
            }
        };
        let rec = |lv: u32| Rec {
            s: scan.s,
            s_top: scan.top,
            s_level: lv,
            len: len as u32,
            len_word,
            ..base
        };
        for lv in 0..scan.top {
            self.push(SCAN_UP, rec(lv), size(lv));
        }
        self.push(SCAN_UP, rec(scan.top), Size::Direct(1));
        for lv in (0..scan.top).rev() {
            self.push(SCAN_DOWN, rec(lv), size(lv));
        }
    }

    /// A stable radix sort of the `count` entries in `ent_a` by their key word, `passes`
    /// (even) passes of 4 bits from bit 0, the histograms scanned at `seg`.
    pub(super) fn sort(&mut self, base: Rec, seg: Scan, count: usize, passes: u32) {
        debug_assert!(passes.is_multiple_of(2));
        let ntiles = (count as u64).div_ceil(SORT_TILE);
        let hist = 16 * ntiles;
        for p in 0..passes {
            let rec = Rec {
                parity: p % 2,
                pass_bits: 4 * p,
                count: count as u32,
                ntiles: ntiles as u32,
                s: [seg.s[0], 0, 0, 0],
                ..base
            };
            self.push(SORT_COUNT, rec, Size::Direct(ntiles as u32));
            self.scan(base, seg, NONE, hist, false);
            self.push(SORT_SCATTER, rec, Size::Direct(ntiles as u32));
        }
    }
}

/// Records `r`'s passes into `enc` with the kernels of `bound` and `module`'s record layout;
/// before each pass but the first, with `indirect` (`meta`, `args`), the dispatch sizes the
/// earlier passes wrote are copied from `meta` to `args`.
pub(super) fn record(
    ctx: &GpuContext,
    module: &Module,
    enc: &mut wgpu::CommandEncoder,
    bound: &Bound,
    r: &Recorder,
    indirect: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
) {
    let records: Vec<&[u32]> = r.recs.iter().map(|w| &w[..]).collect();
    let group1 = records_group(
        ctx,
        module.layout1(),
        "dispatch records",
        &records,
        REC_BYTES,
    );
    for (k, pass_list) in r.passes.iter().enumerate() {
        // The sizes the previous passes left, for this one's indirect dispatches.
        if let (Some((meta, args)), true) = (indirect, k > 0) {
            enc.copy_buffer_to_buffer(meta, 4 * M_ARGS as u64, args, 0, ARGS_BYTES);
        }
        if pass_list.is_empty() {
            continue;
        }
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_bind_group(0, &bound.group, &[]);
            for (entry, rec, size) in pass_list {
                pass.set_pipeline(&bound.compiled.pipelines[*entry]);
                pass.set_bind_group(1, &group1, &[(*rec as u64 * RECORD_STRIDE) as u32]);
                match size {
                    Size::Direct(0) => {}
                    Size::Direct(g) => {
                        let (x, y) = grid(*g);
                        pass.dispatch_workgroups(x, y, 1);
                    }
                    Size::Indirect(offset) => {
                        let (_, args) = indirect.expect("indirect dispatches have arguments");
                        pass.dispatch_workgroups_indirect(args, *offset - 4 * M_ARGS as u64);
                    }
                }
            }
        }
    }
}
