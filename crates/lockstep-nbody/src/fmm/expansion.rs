//! Cartesian Taylor expansions of the Plummer-softened kernel (Dehnen 2014, "A fast
//! multipole method for stellar dynamics", Comput. Astrophys. Cosmol. 1:1, sections 2-3).
//!
//! Notation: multi-index `n = (nx, ny, nz)`, `|n| = nx+ny+nz`, `n! = nx! ny! nz!`,
//! `x^n = x^nx y^ny z^nz`. Coefficients with `|n| <= p` are stored in degree order,
//! `(p+1)(p+2)(p+3)/6` per expansion.
//!
//! - Multipole of a cell about its centre `z`: `M_n = sum_i m_i (x_i - z)^n / n!`.
//! - Kernel `psi(r) = (|r|^2 + eps^2)^{-1/2}`, derivatives `D_n(R) = d^n psi(R)`.
//! - Local expansion at a target cell centre `z_A` from a source cell at `z_B`,
//!   `R = z_A - z_B`: `L_n = sum_{|n|+|m|<=p} (-1)^{|m|} D_{n+m}(R) M_m`, and
//!   `Phi(x) = sum_n L_n (x - z_A)^n / n!` with `Phi = sum_j m_j psi(x - x_j)`.
//!   The potential is `-G Phi` and the acceleration `+G grad Phi`.
//!
//! `D_n` of a radial function `f(x) = h(|x|^2 / 2)` follows from
//! `d^n f = sum_{2k<=n} n! / ((n-2k)! k! 2^{|k|}) x^{n-2k} h^{(|n|-|k|)}`, with
//! `h^{(j)} = (-1)^j (2j-1)!! (r^2 + eps^2)^{-j-1/2}` for the Plummer kernel.

/// Sources per batched M2L ([`Tables::m2l_batch`]).
pub const LANES: usize = 8;

/// `acc[l] = a[l] * b[l] + acc[l]` (fused) in every lane. With `AVX2` (only from code
/// compiled with the `avx2` and `fma` target features) as two 256-bit FMAs: the compiler's
/// own vectorization of these loops interleaves consecutive terms with shuffles instead.
/// The same bits either way.
#[inline(always)]
fn lanes_fma<const AVX2: bool>(a: &[f64; LANES], b: &[f64; LANES], acc: &mut [f64; LANES]) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        use std::arch::x86_64::{_mm256_fmadd_pd, _mm256_loadu_pd, _mm256_storeu_pd};
        // SAFETY: `AVX2` is set only by callers compiled with the avx2 and fma target
        // features (the CPU has them); each array holds 8 contiguous f64 (two loads and
        // stores of 4).
        unsafe {
            let (pa, pb, pc) = (a.as_ptr(), b.as_ptr(), acc.as_mut_ptr());
            let lo = _mm256_fmadd_pd(
                _mm256_loadu_pd(pa),
                _mm256_loadu_pd(pb),
                _mm256_loadu_pd(pc),
            );
            let hi = _mm256_fmadd_pd(
                _mm256_loadu_pd(pa.add(4)),
                _mm256_loadu_pd(pb.add(4)),
                _mm256_loadu_pd(pc.add(4)),
            );
            _mm256_storeu_pd(pc, lo);
            _mm256_storeu_pd(pc.add(4), hi);
        }
        return;
    }
    for l in 0..LANES {
        acc[l] = a[l].mul_add(b[l], acc[l]);
    }
}

/// Work arrays of [`Tables::m2l_batch`] (one per thread).
#[derive(Debug, Clone, Default)]
pub struct BatchWork {
    mono: Vec<[f64; LANES]>,
    d: Vec<[f64; LANES]>,
    ms: Vec<[f64; LANES]>,
    /// Per-lane partial sums of the local coefficients over the batches of one M2L call.
    lacc: Vec<[f64; LANES]>,
}

impl BatchWork {
    fn resize(&mut self, n: usize) {
        if self.mono.len() < n {
            self.mono.resize(n, [0.0; LANES]);
            self.d.resize(n, [0.0; LANES]);
            self.ms.resize(n, [0.0; LANES]);
            self.lacc.resize(n, [0.0; LANES]);
        }
    }
}

/// How M2L and M2P contract the derivative tensor `D` with a source's multipole, as index
/// tables over the coefficients of order `p`.
///
/// - `full` (any softening): every coefficient, `L_n = sum_{|n|+|m|<=p} D_{n+m} (-1)^{|m|}
///   M_m`.
/// - `harmonic` (the unsoftened kernel `1/r` only, whose derivatives are harmonic:
///   `D_{j+2e_x} + D_{j+2e_y} + D_{j+2e_z} = 0`): every `D_{n+m}` with `m_z >= 2` is
///   replaced by `-D_{n+m-2e_z+2e_x} - D_{n+m-2e_z+2e_y}` (the same degree, so the
///   identity holds for every truncation). Each multipole is folded once into its `(p+1)^2`
///   coefficients with `m_z <= 1` (the "source coefficients"); only the local coefficients
///   with `n_z <= 1` are summed, and the others follow from the same identity, which the
///   local expansion of a harmonic field obeys term by term: `L_n = -L_{n-2e_z+2e_x} -
///   L_{n-2e_z+2e_y}` (done inside [`Tables::m2l_batch`]). At `p = 6` that is 532
///   products per M2L instead of 924, and 64 derivative entries instead of 84; the result
///   is the same up to rounding. This is the Cartesian form of the `(p+1)^2` degrees of
///   freedom of spherical harmonics (traceless Cartesian tensors: Applequist 1989, J. Phys.
///   A 22:4303).
#[derive(Debug, Clone)]
pub struct Contraction {
    /// Folding into `(p+1)^2` source coefficients (the unsoftened kernel only).
    harmonic: bool,
    /// Full index of each source coefficient, in degree order.
    src: Vec<u16>,
    /// `(m, m - 2e_z + 2e_x, m - 2e_z + 2e_y)` for `m_z >= 2` by decreasing `m_z`: the
    /// multipole at `m` is subtracted from the two others (applied in order).
    fold: Vec<(u16, u16, u16)>,
    /// Full index of each local coefficient summed by M2L.
    rows_n: Vec<u16>,
    /// Full index of `n + m` for each source coefficient `m` with `|n|+|m| <= p` (a prefix
    /// of the source coefficients, in degree order), grouped by row.
    rows: Vec<u16>,
    /// `rows[row_start[k]..row_start[k+1]]` are the entries of row `k`.
    row_start: Vec<usize>,
    /// `(n, n - 2e_z + 2e_x, n - 2e_z + 2e_y)` for `n_z >= 2` by increasing `n_z`:
    /// `L_n = -L_a - L_b` (applied in order).
    unfold: Vec<(u16, u16, u16)>,
    /// For the source coefficients of degree `<= p-1` (a prefix): full index of `m + e_x`,
    /// `m + e_y`, `m + e_z` (M2P gradient).
    grad: Vec<[u16; 3]>,
    /// Monomials needed by the derivative entries below (ascending, parents first, 0 left
    /// out: it is 1).
    mono_needed: Vec<u16>,
    /// Derivative entries `D_j` read by M2L and M2P (ascending).
    d_needed: Vec<u16>,
}

impl Contraction {
    fn new(
        p: usize,
        multi: &[[usize; 3]],
        parent: &[(usize, usize)],
        deriv_rows: (&[(f64, u16, u16)], &[usize]),
        idx: &dyn Fn([usize; 3]) -> Option<usize>,
        harmonic: bool,
    ) -> Self {
        let nt = multi.len();
        let deg = |n: [usize; 3]| n[0] + n[1] + n[2];
        let at = |n: [usize; 3]| idx(n).expect("multi-index within the order") as u16;
        let kept = |n: [usize; 3]| !harmonic || n[2] <= 1;
        let src: Vec<u16> = (0..nt)
            .filter(|&i| kept(multi[i]))
            .map(|i| i as u16)
            .collect();
        // Coefficients with n_z >= 2 in the order of the (un)folding: the folds move
        // weight two steps down in z, so they go from the top; the unfolds read from below.
        let mut high: Vec<usize> = if harmonic {
            (0..nt).filter(|&i| multi[i][2] >= 2).collect()
        } else {
            Vec::new()
        };
        high.sort_by_key(|&i| multi[i][2]);
        let step = |i: usize| {
            let m = multi[i];
            (
                i as u16,
                at([m[0] + 2, m[1], m[2] - 2]),
                at([m[0], m[1] + 2, m[2] - 2]),
            )
        };
        let unfold: Vec<(u16, u16, u16)> = high.iter().map(|&i| step(i)).collect();
        let fold: Vec<(u16, u16, u16)> = high.iter().rev().map(|&i| step(i)).collect();
        let (mut rows_n, mut rows, mut row_start) = (Vec::new(), Vec::new(), vec![0]);
        for (i, &n) in multi.iter().enumerate().filter(|(_, &n)| kept(n)) {
            rows_n.push(i as u16);
            for &j in &src {
                let m = multi[j as usize];
                if deg(n) + deg(m) <= p {
                    rows.push(at([n[0] + m[0], n[1] + m[1], n[2] + m[2]]));
                }
            }
            row_start.push(rows.len());
        }
        let grad: Vec<[u16; 3]> = src
            .iter()
            .map(|&j| multi[j as usize])
            .take_while(|&m| deg(m) < p)
            .map(|m| {
                [
                    at([m[0] + 1, m[1], m[2]]),
                    at([m[0], m[1] + 1, m[2]]),
                    at([m[0], m[1], m[2] + 1]),
                ]
            })
            .collect();
        let mut need_d = vec![false; nt];
        for &j in rows.iter().chain(&src).chain(grad.iter().flatten()) {
            need_d[j as usize] = true;
        }
        let (deriv, deriv_rows) = deriv_rows;
        let mut need_m = vec![false; nt];
        for n in (0..nt).filter(|&n| need_d[n]) {
            for &(_, rest, _) in &deriv[deriv_rows[n]..deriv_rows[n + 1]] {
                need_m[rest as usize] = true;
            }
        }
        // Parents have smaller indices (one degree lower): one descending pass closes the set.
        for i in (1..nt).rev() {
            if need_m[i] {
                need_m[parent[i].0] = true;
            }
        }
        let list = |need: &[bool], from: usize| -> Vec<u16> {
            (from..nt).filter(|&i| need[i]).map(|i| i as u16).collect()
        };
        Contraction {
            harmonic,
            mono_needed: list(&need_m, 1),
            d_needed: list(&need_d, 0),
            src,
            fold,
            rows_n,
            rows,
            row_start,
            unfold,
            grad,
        }
    }

    /// Source coefficients per multipole: `(p+1)(p+2)(p+3)/6` (full) or `(p+1)^2`
    /// (harmonic).
    pub fn ncoeffs(&self) -> usize {
        self.src.len()
    }

    /// Whether this is the harmonic contraction (valid only without softening).
    pub fn is_harmonic(&self) -> bool {
        self.harmonic
    }

    /// Multiply-adds per M2L translation (one source, one target).
    pub fn m2l_products(&self) -> usize {
        self.rows.len()
    }
}

/// Index tables for expansions of order `p`.
#[derive(Debug, Clone)]
pub struct Tables {
    /// Expansion order.
    pub p: usize,
    /// Number of coefficients `(p+1)(p+2)(p+3)/6`.
    pub nterms: usize,
    /// Multi-index of each coefficient.
    pub multi: Vec<[usize; 3]>,
    /// Degree `|n|` of each coefficient.
    pub degree: Vec<usize>,
    /// For `n != 0`: `(index of n - e_axis, axis)` with `axis` the first non-zero axis.
    parent: Vec<(usize, usize)>,
    /// M2L and M2P over all coefficients (any softening).
    pub full: Contraction,
    /// M2L and M2P over the coefficients with `n_z <= 1` (unsoftened kernel only).
    pub harmonic: Contraction,
    /// `1 / n_axis` for the monomial recursion (`axis` from `parent`).
    inv_step: Vec<f64>,
    /// `(n, k, n-k)` for `k <= n` componentwise (M2M and L2L).
    shift: Vec<(u16, u16, u16)>,
    /// `(coefficient, index of n-2k, derivative order |n|-|k|)` grouped by `n`.
    deriv: Vec<(f64, u16, u16)>,
    /// `deriv[deriv_rows[n]..deriv_rows[n+1]]` are the terms of `D_n`.
    deriv_rows: Vec<usize>,
    /// `(-1)^{|n|}`.
    sign: Vec<f64>,
}

/// [`Tables`] flattened for the GPU kernels ([`Tables::flat`]); `nt = nterms(p)`.
#[derive(Debug, Clone)]
pub(crate) struct FlatTables {
    /// `[nt]` index of `n - e_axis` (the monomial recursion's parent).
    pub parent: Vec<u32>,
    /// `[nt]` the axis of that step.
    pub axis: Vec<u32>,
    /// `[nt]` degree `|n|`.
    pub degree: Vec<u32>,
    /// `[nt]` `1 / n_axis`.
    pub inv_step: Vec<f64>,
    /// `[nt]` `(-1)^{|n|}`.
    pub sign: Vec<f64>,
    /// `[3 * shifts]` `(n, k, n - k)` triples of M2M and L2L.
    pub shift: Vec<u32>,
    /// Derivative terms: coefficient, monomial index, order of `h`.
    pub deriv_c: Vec<f64>,
    /// See `deriv_c`.
    pub deriv_rest: Vec<u32>,
    /// See `deriv_c`.
    pub deriv_j: Vec<u32>,
    /// `[nt + 1]` row offsets of the derivative terms.
    pub deriv_rows: Vec<u32>,
    /// The full contraction's `n + m` indices, row `n` over `m` in degree order.
    pub rows: Vec<u32>,
    /// `[nt + 1]` row offsets of `rows`.
    pub row_start: Vec<u32>,
    /// `[3 * nt(p-1)]` indices of `m + e_x, m + e_y, m + e_z` for `|m| <= p - 1`.
    pub grad: Vec<u32>,
}

/// Number of Cartesian coefficients with `|n| <= p`.
pub fn nterms(p: usize) -> usize {
    (p + 1) * (p + 2) * (p + 3) / 6
}

fn factorial(n: usize) -> f64 {
    (1..=n).map(|k| k as f64).product()
}

impl Tables {
    /// Tables for order `p` (any `p`; the solver accepts 1..=6).
    pub fn new(p: usize) -> Self {
        let mut multi = Vec::new();
        for d in 0..=p {
            for nx in (0..=d).rev() {
                for ny in (0..=(d - nx)).rev() {
                    multi.push([nx, ny, d - nx - ny]);
                }
            }
        }
        let nt = multi.len();
        debug_assert_eq!(nt, nterms(p));
        let side = p + 1;
        let mut lookup = vec![usize::MAX; side * side * side];
        for (i, n) in multi.iter().enumerate() {
            lookup[(n[0] * side + n[1]) * side + n[2]] = i;
        }
        let idx = |n: [usize; 3]| -> Option<usize> {
            if n[0] + n[1] + n[2] > p {
                None
            } else {
                Some(lookup[(n[0] * side + n[1]) * side + n[2]])
            }
        };
        let degree: Vec<usize> = multi.iter().map(|n| n[0] + n[1] + n[2]).collect();
        let mut parent = vec![(0, 0); nt];
        for (i, n) in multi.iter().enumerate().skip(1) {
            let axis = (0..3).find(|&a| n[a] > 0).unwrap_or(0);
            let mut q = *n;
            q[axis] -= 1;
            parent[i] = (idx(q).unwrap_or(0), axis);
        }
        let mut shift = Vec::new();
        for (i, n) in multi.iter().enumerate() {
            for (j, k) in multi.iter().enumerate() {
                if k[0] <= n[0] && k[1] <= n[1] && k[2] <= n[2] {
                    let d = idx([n[0] - k[0], n[1] - k[1], n[2] - k[2]]).unwrap_or(0);
                    shift.push((i as u16, j as u16, d as u16));
                }
            }
        }
        let mut deriv = Vec::new();
        let mut deriv_rows = vec![0];
        for n in multi.iter() {
            let nfact = factorial(n[0]) * factorial(n[1]) * factorial(n[2]);
            for kx in 0..=n[0] / 2 {
                for ky in 0..=n[1] / 2 {
                    for kz in 0..=n[2] / 2 {
                        let k = [kx, ky, kz];
                        let ksum = kx + ky + kz;
                        let kfact = factorial(kx) * factorial(ky) * factorial(kz);
                        // Monomials are stored divided by (n-2k)!, so that factor cancels.
                        let c = nfact / (kfact * 2f64.powi(ksum as i32));
                        let rest =
                            idx([n[0] - 2 * k[0], n[1] - 2 * k[1], n[2] - 2 * k[2]]).unwrap_or(0);
                        let deg = n[0] + n[1] + n[2];
                        deriv.push((c, rest as u16, (deg - ksum) as u16));
                    }
                }
            }
            deriv_rows.push(deriv.len());
        }
        let sign = degree
            .iter()
            .map(|&d| if d % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let inv_step = (0..nt)
            .map(|i| {
                if i == 0 {
                    1.0
                } else {
                    1.0 / multi[i][parent[i].1] as f64
                }
            })
            .collect();
        let tables = (&deriv[..], &deriv_rows[..]);
        let full = Contraction::new(p, &multi, &parent, tables, &idx, false);
        let harmonic = Contraction::new(p, &multi, &parent, tables, &idx, true);
        Tables {
            inv_step,
            sign,
            p,
            nterms: nt,
            multi,
            degree,
            parent,
            full,
            harmonic,
            shift,
            deriv,
            deriv_rows,
        }
    }

    /// The index tables of order `p` flattened for the GPU kernels (`crate::fmm_gpu`): the
    /// monomial recursion, the derivative rows, the M2M/L2L shifts, the full contraction's
    /// rows and gradient entries, as plain integer and float arrays (the same tables the
    /// CPU functions above read).
    pub(crate) fn flat(&self) -> FlatTables {
        let c = &self.full;
        FlatTables {
            parent: self.parent.iter().map(|&(q, _)| q as u32).collect(),
            axis: self.parent.iter().map(|&(_, a)| a as u32).collect(),
            degree: self.degree.iter().map(|&d| d as u32).collect(),
            inv_step: self.inv_step.clone(),
            sign: self.sign.clone(),
            shift: self
                .shift
                .iter()
                .flat_map(|&(n, k, d)| [n as u32, k as u32, d as u32])
                .collect(),
            deriv_c: self.deriv.iter().map(|d| d.0).collect(),
            deriv_rest: self.deriv.iter().map(|d| d.1 as u32).collect(),
            deriv_j: self.deriv.iter().map(|d| d.2 as u32).collect(),
            deriv_rows: self.deriv_rows.iter().map(|&r| r as u32).collect(),
            rows: c.rows.iter().map(|&r| r as u32).collect(),
            row_start: c.row_start.iter().map(|&r| r as u32).collect(),
            grad: c.grad.iter().flat_map(|g| g.map(u32::from)).collect(),
        }
    }

    /// Scaled monomials `out[n] = x^n / n!` for `|n| <= p`.
    #[inline]
    pub fn monomials(&self, x: [f64; 3], out: &mut [f64]) {
        out[0] = 1.0;
        for i in 1..self.nterms {
            let (q, axis) = self.parent[i];
            out[i] = out[q] * x[axis] * self.inv_step[i];
        }
    }

    /// Derivative tensor `out[n] = D_n(r)` of `psi = (|r|^2+eps^2)^{-1/2}`, `|n| <= p`.
    /// `scratch` holds at least `nterms` values.
    #[inline]
    pub fn derivatives(&self, r: [f64; 3], eps2: f64, out: &mut [f64], scratch: &mut [f64]) {
        self.monomials(r, scratch);
        let q = 1.0 / (r[0] * r[0] + r[1] * r[1] + r[2] * r[2] + eps2);
        let mut h = [0.0f64; 16];
        h[0] = q.sqrt();
        for j in 1..=self.p {
            h[j] = -((2 * j - 1) as f64) * q * h[j - 1];
        }
        for (n, o) in out[..self.nterms].iter_mut().enumerate() {
            let mut acc = 0.0;
            for &(c, rest, j) in &self.deriv[self.deriv_rows[n]..self.deriv_rows[n + 1]] {
                acc += c * scratch[rest as usize] * h[j as usize];
            }
            *o = acc;
        }
    }

    /// Adds `sum_i m_i (x_i - z)^n / n!` over the given particles into `mp` (P2M).
    pub fn p2m(
        &self,
        pos: &[[f64; 3]],
        mass: &[f64],
        z: [f64; 3],
        mp: &mut [f64],
        scratch: &mut [f64],
    ) {
        for (x, &m) in pos.iter().zip(mass) {
            self.monomials([x[0] - z[0], x[1] - z[1], x[2] - z[2]], scratch);
            for (o, s) in mp.iter_mut().zip(scratch.iter()) {
                *o += m * s;
            }
        }
    }

    /// [`Tables::p2m`] of the sorted sources `soa[range]` (structure of arrays).
    pub(crate) fn p2m_soa(
        &self,
        soa: &crate::direct::SoA,
        range: std::ops::Range<usize>,
        z: [f64; 3],
        mp: &mut [f64],
        scratch: &mut [f64],
    ) {
        for s in range {
            self.monomials([soa.x[s] - z[0], soa.y[s] - z[1], soa.z[s] - z[2]], scratch);
            let m = soa.m[s];
            for (o, v) in mp.iter_mut().zip(scratch.iter()) {
                *o += m * v;
            }
        }
    }

    /// Adds a child multipole about `c` to its parent's about `z` (M2M):
    /// `M_n += sum_{k<=n} M_k (c - z)^{n-k} / (n-k)!`.
    pub fn m2m(
        &self,
        child: &[f64],
        c: [f64; 3],
        z: [f64; 3],
        parent: &mut [f64],
        scratch: &mut [f64],
    ) {
        self.monomials([c[0] - z[0], c[1] - z[1], c[2] - z[2]], scratch);
        for &(n, k, d) in &self.shift {
            parent[n as usize] += child[k as usize] * scratch[d as usize];
        }
    }

    /// Adds the local expansion at `z_child` of a parent expansion at `z_parent` (L2L):
    /// `L'_k += sum_{n>=k} L_n (z_child - z_parent)^{n-k} / (n-k)!`.
    pub fn l2l(
        &self,
        parent: &[f64],
        zp: [f64; 3],
        zc: [f64; 3],
        child: &mut [f64],
        scratch: &mut [f64],
    ) {
        self.monomials([zc[0] - zp[0], zc[1] - zp[1], zc[2] - zp[2]], scratch);
        for &(n, k, d) in &self.shift {
            child[k as usize] += parent[n as usize] * scratch[d as usize];
        }
    }

    /// Adds the local expansion at `z_a` due to the multipole `mp` about `z_b` (M2L).
    /// `deriv` and `scratch` are work arrays of `nterms` values.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn m2l(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        deriv: &mut [f64],
        scratch: &mut [f64],
    ) {
        self.derivatives(
            [za[0] - zb[0], za[1] - zb[1], za[2] - zb[2]],
            eps2,
            deriv,
            scratch,
        );
        // Signed multipoles (-1)^{|m|} M_m, kept in `scratch` (free after `derivatives`).
        for i in 0..self.nterms {
            scratch[i] = self.sign[i] * mp[i];
        }
        let deriv: &[f64] = deriv;
        let c = &self.full;
        for (k, &n) in c.rows_n.iter().enumerate() {
            let row = &c.rows[c.row_start[k]..c.row_start[k + 1]];
            let acc: f64 = scratch[..row.len()]
                .iter()
                .zip(row)
                .map(|(s, &nm)| s * deriv[nm as usize])
                .sum();
            local[n as usize] += acc;
        }
    }

    /// The contraction for squared softening `eps2` (kpc^2): [`Tables::harmonic`] when it
    /// is exactly 0 (the `1/r` kernel), else [`Tables::full`].
    pub fn contraction(&self, eps2: f64) -> &Contraction {
        if eps2 == 0.0 {
            &self.harmonic
        } else {
            &self.full
        }
    }

    /// The source coefficients of the multipole `mp` (`nterms` values) for the contraction
    /// `c`: `out[k] = (-1)^{|m|} M'_m` for its `k`-th coefficient `m`, where `M'` is `M`
    /// folded (harmonic) or `M` itself (full). `out` holds [`Contraction::ncoeffs`] values
    /// and `scratch` at least `nterms`.
    pub fn source_coefficients(
        &self,
        c: &Contraction,
        mp: &[f64],
        out: &mut [f64],
        scratch: &mut [f64],
    ) {
        let folded = if c.fold.is_empty() {
            mp
        } else {
            let t = &mut scratch[..self.nterms];
            t.copy_from_slice(&mp[..self.nterms]);
            for &(from, x, y) in &c.fold {
                let v = t[from as usize];
                t[x as usize] -= v;
                t[y as usize] -= v;
            }
            t
        };
        for (o, &i) in out.iter_mut().zip(&c.src) {
            *o = self.sign[i as usize] * folded[i as usize];
        }
    }

    /// Completes a local expansion summed with the contraction `c`: the harmonic one sums
    /// only the coefficients with `n_z <= 1` and the others follow from `L_n =
    /// -L_{n-2e_z+2e_x} - L_{n-2e_z+2e_y}` (overwritten); nothing for the full one.
    fn complete_local(&self, c: &Contraction, local: &mut [f64]) {
        for &(n, a, b) in &c.unfold {
            local[n as usize] = -local[a as usize] - local[b as usize];
        }
    }

    /// The local expansion about `za` of the given sources, each given by its centre and
    /// its [`Tables::source_coefficients`] for the contraction `c` (the harmonic one only
    /// with `eps2 = 0`), written into `local` (`nterms` values, overwritten; zero without
    /// sources). The arithmetic of [`Tables::m2l`], [`LANES`] sources at a time in SIMD
    /// lanes, with per-lane partial sums added up once at the end (the full contraction
    /// gives the same results as repeated [`Tables::m2l`] up to the order of the sums).
    pub fn m2l_batch(
        &self,
        c: &Contraction,
        sources: &[([f64; 3], &[f64])],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { self.m2l_batch_avx512(c, sources, za, eps2, local, work) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.m2l_batch_avx2(c, sources, za, eps2, local, work) };
            }
        }
        self.m2l_batch_body::<false>(c, sources, za, eps2, local, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn m2l_batch_avx512(
        &self,
        c: &Contraction,
        sources: &[([f64; 3], &[f64])],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        self.m2l_batch_body::<false>(c, sources, za, eps2, local, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn m2l_batch_avx2(
        &self,
        c: &Contraction,
        sources: &[([f64; 3], &[f64])],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        self.m2l_batch_body::<true>(c, sources, za, eps2, local, work)
    }

    #[inline(always)]
    fn m2l_batch_body<const AVX2: bool>(
        &self,
        c: &Contraction,
        sources: &[([f64; 3], &[f64])],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        debug_assert!(
            !c.harmonic || eps2 == 0.0,
            "harmonic contraction with softening"
        );
        let nc = c.ncoeffs();
        work.resize(self.nterms);
        let mut lacc = std::mem::take(&mut work.lacc);
        let lacc_rows = &mut lacc[..c.rows_n.len()];
        lacc_rows.fill([0.0; LANES]);
        for chunk in sources.chunks(LANES) {
            // Lane geometry; unused lanes get a unit separation and zero multipoles.
            let mut r = [[1.0f64; LANES], [0.0; LANES], [0.0; LANES]];
            for (l, (zb, _)) in chunk.iter().enumerate() {
                for a in 0..3 {
                    r[a][l] = za[a] - zb[a];
                }
            }
            self.lane_derivatives::<AVX2>(c, &r, eps2, work);
            let ms = &mut work.ms[..nc];
            for (l, (_, cs)) in chunk.iter().enumerate() {
                for (v, &x) in ms.iter_mut().zip(&cs[..nc]) {
                    v[l] = x;
                }
            }
            for v in ms.iter_mut() {
                v[chunk.len()..].fill(0.0);
            }
            let d = &work.d;
            for (row_k, sum) in lacc_rows.iter_mut().enumerate() {
                let row = &c.rows[c.row_start[row_k]..c.row_start[row_k + 1]];
                // Two dependency chains (even and odd entries) in registers: the row is
                // bound by the latency of the multiply-adds, not by their throughput.
                let (mut even, mut odd) = (*sum, [0.0f64; LANES]);
                let mut pairs = ms.chunks_exact(2).zip(row.chunks_exact(2));
                for (a, nm) in &mut pairs {
                    lanes_fma::<AVX2>(&a[0], &d[nm[0] as usize], &mut even);
                    lanes_fma::<AVX2>(&a[1], &d[nm[1] as usize], &mut odd);
                }
                if row.len() % 2 == 1 {
                    let last = row.len() - 1;
                    lanes_fma::<AVX2>(&ms[last], &d[row[last] as usize], &mut even);
                }
                *sum = std::array::from_fn(|l| even[l] + odd[l]);
            }
        }
        local[..self.nterms].fill(0.0);
        for (acc, &n) in lacc_rows.iter().zip(&c.rows_n) {
            local[n as usize] =
                ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        }
        work.lacc = lacc;
        if !sources.is_empty() {
            self.complete_local(c, local);
        }
    }

    /// [`Tables::m2p`] at up to [`LANES`] points `xs` at once (points in SIMD lanes), of
    /// the source given by its [`Tables::source_coefficients`] `coeffs` for the
    /// contraction `c` (the harmonic one only with `eps2 = 0`): returns `(Phi, grad Phi)`
    /// per point.
    pub fn m2p_batch(
        &self,
        c: &Contraction,
        coeffs: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { self.m2p_batch_avx512(c, coeffs, zb, xs, eps2, work) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.m2p_batch_avx2(c, coeffs, zb, xs, eps2, work) };
            }
        }
        self.m2p_batch_body::<false>(c, coeffs, zb, xs, eps2, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn m2p_batch_avx512(
        &self,
        c: &Contraction,
        coeffs: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        self.m2p_batch_body::<false>(c, coeffs, zb, xs, eps2, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn m2p_batch_avx2(
        &self,
        c: &Contraction,
        coeffs: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        self.m2p_batch_body::<true>(c, coeffs, zb, xs, eps2, work)
    }

    #[inline(always)]
    fn m2p_batch_body<const AVX2: bool>(
        &self,
        c: &Contraction,
        coeffs: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        debug_assert!(
            !c.harmonic || eps2 == 0.0,
            "harmonic contraction with softening"
        );
        let k = xs.len().min(LANES);
        work.resize(self.nterms);
        let mut r = [[1.0f64; LANES], [0.0; LANES], [0.0; LANES]];
        for l in 0..k {
            for a in 0..3 {
                r[a][l] = xs[l][a] - zb[a];
            }
        }
        self.lane_derivatives::<AVX2>(c, &r, eps2, work);
        let d = &work.d;
        let mut phi = [0.0f64; LANES];
        for (&v, &i) in coeffs.iter().zip(&c.src) {
            lanes_fma::<AVX2>(&[v; LANES], &d[i as usize], &mut phi);
        }
        let mut g = [[0.0f64; LANES]; 3];
        for (&v, gi) in coeffs.iter().zip(&c.grad) {
            for a in 0..3 {
                lanes_fma::<AVX2>(&[v; LANES], &d[gi[a] as usize], &mut g[a]);
            }
        }
        (phi, g)
    }

    /// Derivative tensors `work.d[n][lane] = D_n(r[.][lane])` for all lanes, at the entries
    /// the contraction `c` reads (the others are left as they were).
    #[inline(always)]
    fn lane_derivatives<const AVX2: bool>(
        &self,
        c: &Contraction,
        r: &[[f64; LANES]; 3],
        eps2: f64,
        work: &mut BatchWork,
    ) {
        let mono = &mut work.mono;
        mono[0] = [1.0; LANES];
        for &i in &c.mono_needed {
            let i = i as usize;
            let (q, axis) = self.parent[i];
            let f = self.inv_step[i];
            let prev = mono[q];
            let mut v = [0.0; LANES];
            for l in 0..LANES {
                v[l] = prev[l] * r[axis][l] * f;
            }
            mono[i] = v;
        }
        // h_j = (-1)^j (2j-1)!! q^{j+1/2}, q = 1 / (r^2 + eps^2), lanes innermost (SIMD).
        let q: [f64; LANES] = std::array::from_fn(|l| {
            1.0 / (r[0][l] * r[0][l] + r[1][l] * r[1][l] + r[2][l] * r[2][l] + eps2)
        });
        let mut h = [[0.0f64; LANES]; 16];
        h[0] = q.map(f64::sqrt);
        for j in 1..=self.p {
            let f = -((2 * j - 1) as f64);
            h[j] = std::array::from_fn(|l| f * q[l] * h[j - 1][l]);
        }
        let d = &mut work.d;
        for &n in &c.d_needed {
            let n = n as usize;
            let mut acc = [0.0f64; LANES];
            for &(c, rest, j) in &self.deriv[self.deriv_rows[n]..self.deriv_rows[n + 1]] {
                let m = &mono[rest as usize];
                let cm = std::array::from_fn(|l| c * m[l]);
                lanes_fma::<AVX2>(&cm, &h[j as usize], &mut acc);
            }
            d[n] = acc;
        }
    }

    /// Evaluates the multipole `mp` about `zb` directly at the point `x` (M2P, the
    /// tree-code interaction): `Phi = sum_{|m|<=p} (-1)^{|m|} D_m(x - z_b) M_m` and
    /// `d_j Phi = sum_{|m|<=p-1} (-1)^{|m|} D_{m+e_j}(x - z_b) M_m`.
    #[inline]
    pub fn m2p(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        x: [f64; 3],
        eps2: f64,
        deriv: &mut [f64],
        scratch: &mut [f64],
    ) -> (f64, [f64; 3]) {
        self.derivatives(
            [x[0] - zb[0], x[1] - zb[1], x[2] - zb[2]],
            eps2,
            deriv,
            scratch,
        );
        let mut phi = 0.0;
        for i in 0..self.nterms {
            phi += self.sign[i] * deriv[i] * mp[i];
        }
        let mut g = [0.0; 3];
        // The full contraction's gradient table: `n + e_x, n + e_y, n + e_z` for `|n| <= p-1`.
        for (i, gi) in self.full.grad.iter().enumerate() {
            let sm = self.sign[i] * mp[i];
            g[0] += deriv[gi[0] as usize] * sm;
            g[1] += deriv[gi[1] as usize] * sm;
            g[2] += deriv[gi[2] as usize] * sm;
        }
        (phi, g)
    }

    /// Evaluates the local expansion `local` about `z` at `x` (L2P): returns
    /// `(Phi, grad Phi)` with `Phi = sum_n L_n (x-z)^n/n!`.
    #[inline]
    pub fn l2p(
        &self,
        local: &[f64],
        z: [f64; 3],
        x: [f64; 3],
        scratch: &mut [f64],
    ) -> (f64, [f64; 3]) {
        self.monomials([x[0] - z[0], x[1] - z[1], x[2] - z[2]], scratch);
        let mut phi = 0.0;
        for i in 0..self.nterms {
            phi += local[i] * scratch[i];
        }
        let mut g = [0.0; 3];
        for (gi, &s) in self.full.grad.iter().zip(scratch.iter()) {
            g[0] += local[gi[0] as usize] * s;
            g[1] += local[gi[1] as usize] * s;
            g[2] += local[gi[2] as usize] * s;
        }
        (phi, g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn psi(r: [f64; 3], eps2: f64) -> f64 {
        1.0 / (r[0] * r[0] + r[1] * r[1] + r[2] * r[2] + eps2).sqrt()
    }

    /// Arbitrary multipoles `[k][nterms]` and centres around the origin.
    fn sources(t: &Tables, k: usize) -> (Vec<Vec<f64>>, Vec<[f64; 3]>) {
        let mps = (0..k)
            .map(|k| {
                (0..t.nterms)
                    .map(|i| ((i * 7 + k * 3) % 11) as f64 / 11.0 - 0.4)
                    .collect()
            })
            .collect();
        let zbs = (0..k)
            .map(|k| [k as f64 * 0.3, -1.0, 0.5 * k as f64])
            .collect();
        (mps, zbs)
    }

    /// The contraction's source coefficients of each multipole.
    fn coefficients(t: &Tables, c: &Contraction, mps: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let mut s = vec![0.0; t.nterms];
        mps.iter()
            .map(|mp| {
                let mut out = vec![0.0; c.ncoeffs()];
                t.source_coefficients(c, mp, &mut out, &mut s);
                out
            })
            .collect()
    }

    fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
        let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= rel * scale, "{what} {i}: {g} vs {w}");
        }
    }

    #[test]
    fn batched_m2l_equals_single_m2l() {
        // Both contractions without softening (the harmonic one exists only there), the
        // full one also with softening; orders 1..=6. Eleven sources: a full batch and a
        // partial one.
        for p in 1..=6 {
            let t = Tables::new(p);
            let nt = t.nterms;
            let mut w = BatchWork::default();
            let (mut d, mut s) = (vec![0.0; nt], vec![0.0; nt]);
            let (mps, zbs) = sources(&t, 11);
            let za = [4.0, 2.0, -3.0];
            for (c, eps2) in [(&t.full, 0.01), (&t.full, 0.0), (&t.harmonic, 0.0)] {
                let mut single = vec![0.0; nt];
                for k in 0..11 {
                    t.m2l(&mps[k], zbs[k], za, eps2, &mut single, &mut d, &mut s);
                }
                let cs = coefficients(&t, c, &mps);
                let srcs: Vec<([f64; 3], &[f64])> =
                    zbs.iter().zip(&cs).map(|(&z, v)| (z, &v[..])).collect();
                let mut batch = vec![1.0; nt];
                t.m2l_batch(c, &srcs, za, eps2, &mut batch, &mut w);
                let what = format!("p {p} harmonic {} eps2 {eps2}", c.is_harmonic());
                assert_close(&what, &batch, &single, 1e-12);
            }
        }
    }

    #[test]
    fn harmonic_contraction_is_smaller() {
        // (p+1)^2 source coefficients instead of (p+1)(p+2)(p+3)/6; 532 instead of 924
        // products per M2L at p = 6.
        for p in 1..=6 {
            let t = Tables::new(p);
            assert_eq!(t.harmonic.ncoeffs(), (p + 1) * (p + 1));
            assert_eq!(t.full.ncoeffs(), t.nterms);
        }
        let t = Tables::new(6);
        assert_eq!(
            (t.full.m2l_products(), t.harmonic.m2l_products()),
            (924, 532)
        );
    }

    #[test]
    fn batched_m2p_equals_single_m2p() {
        let t = Tables::new(5);
        let nt = t.nterms;
        let mut w = BatchWork::default();
        let (mut d, mut s) = (vec![0.0; nt], vec![0.0; nt]);
        let mp: Vec<f64> = (0..nt).map(|i| ((i * 5) % 7) as f64 / 7.0 - 0.3).collect();
        let xs: Vec<[f64; 3]> = (0..6)
            .map(|k| [3.0 + 0.1 * k as f64, -2.0, 1.0 - 0.2 * k as f64])
            .collect();
        let zb = [0.1, 0.2, -0.1];
        for (c, eps2) in [(&t.full, 0.0), (&t.full, 0.04), (&t.harmonic, 0.0)] {
            let cs = coefficients(&t, c, std::slice::from_ref(&mp));
            let (phi, g) = t.m2p_batch(c, &cs[0], zb, &xs, eps2, &mut w);
            for (l, &x) in xs.iter().enumerate() {
                let (p1, g1) = t.m2p(&mp, zb, x, eps2, &mut d, &mut s);
                let what = format!("harmonic {} eps2 {eps2} point {l}", c.is_harmonic());
                assert!((phi[l] - p1).abs() <= 1e-13 * p1.abs(), "{what}");
                let gmax = g1.iter().map(|v| v.abs()).fold(0.0, f64::max);
                for a in 0..3 {
                    assert!(
                        (g[a][l] - g1[a]).abs() <= 1e-13 * gmax,
                        "{what}: {g:?} {g1:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn table_sizes() {
        for p in 1..=6 {
            let t = Tables::new(p);
            assert_eq!(t.nterms, (p + 1) * (p + 2) * (p + 3) / 6);
        }
    }

    #[test]
    fn derivatives_match_finite_differences() {
        let t = Tables::new(3);
        let r = [0.7, -0.4, 1.1];
        let eps2 = 0.09;
        let mut d = vec![0.0; t.nterms];
        let mut s = vec![0.0; t.nterms];
        t.derivatives(r, eps2, &mut d, &mut s);
        assert!((d[0] - psi(r, eps2)).abs() < 1e-15);
        // First and second derivatives by central differences.
        let h = 1e-4;
        for i in 0..t.nterms {
            let n = t.multi[i];
            if t.degree[i] == 1 {
                let a = n.iter().position(|&v| v == 1).unwrap();
                let mut rp = r;
                let mut rm = r;
                rp[a] += h;
                rm[a] -= h;
                let fd = (psi(rp, eps2) - psi(rm, eps2)) / (2.0 * h);
                assert!((d[i] - fd).abs() < 1e-7, "{n:?} {} {fd}", d[i]);
            }
            if t.degree[i] == 2 {
                let axes: Vec<usize> = (0..3).flat_map(|a| std::iter::repeat_n(a, n[a])).collect();
                let (a, b) = (axes[0], axes[1]);
                let f = |da: f64, db: f64| {
                    let mut q = r;
                    q[a] += da;
                    q[b] += db;
                    psi(q, eps2)
                };
                let fd = (f(h, h) - f(h, -h) - f(-h, h) + f(-h, -h)) / (4.0 * h * h);
                assert!((d[i] - fd).abs() < 1e-5, "{n:?} {} {fd}", d[i]);
            }
        }
    }

    #[test]
    fn unsoftened_derivatives_are_harmonic() {
        // Laplace: sum_j D_{n + 2 e_j} = 0 for psi = 1/r.
        let t = Tables::new(6);
        let mut d = vec![0.0; t.nterms];
        let mut s = vec![0.0; t.nterms];
        t.derivatives([0.3, -0.5, 0.8], 0.0, &mut d, &mut s);
        let find = |n: [usize; 3]| t.multi.iter().position(|&m| m == n).unwrap();
        for (i, n) in t.multi.iter().enumerate() {
            if t.degree[i] + 2 <= 6 {
                let lap: f64 = (0..3)
                    .map(|j| {
                        let mut q = *n;
                        q[j] += 2;
                        d[find(q)]
                    })
                    .sum();
                let scale: f64 = d.iter().map(|v| v.abs()).fold(0.0, f64::max);
                assert!(lap.abs() < 1e-12 * scale, "n {n:?}: laplacian {lap}");
            }
        }
    }

    #[test]
    fn m2l_l2p_converges_with_order() {
        // A few sources near zb, a target near za; compare the expansion with direct sums.
        let src = [[0.1, 0.05, -0.08], [-0.07, 0.02, 0.1], [0.03, -0.1, 0.0]];
        let m = [1.0, 2.0, 0.5];
        let zb = [0.0; 3];
        let za = [2.0, 1.0, -0.5];
        let x = [2.1, 0.92, -0.45];
        let eps2 = 0.01;
        let exact: f64 = src
            .iter()
            .zip(&m)
            .map(|(s, &mm)| mm * psi([x[0] - s[0], x[1] - s[1], x[2] - s[2]], eps2))
            .sum();
        let mut errs = Vec::new();
        for p in 1..=6 {
            let t = Tables::new(p);
            let mut mp = vec![0.0; t.nterms];
            let mut s = vec![0.0; t.nterms];
            let mut d = vec![0.0; t.nterms];
            t.p2m(&src, &m, zb, &mut mp, &mut s);
            // Shift through an intermediate centre to exercise M2M and L2L.
            let zb2 = [0.05, -0.05, 0.02];
            let mut mp2 = vec![0.0; t.nterms];
            t.m2m(&mp, zb, zb2, &mut mp2, &mut s);
            let mut loc = vec![0.0; t.nterms];
            t.m2l(&mp2, zb2, za, eps2, &mut loc, &mut d, &mut s);
            let za2 = [2.05, 0.95, -0.48];
            let mut loc2 = vec![0.0; t.nterms];
            t.l2l(&loc, za, za2, &mut loc2, &mut s);
            let (phi, _) = t.l2p(&loc2, za2, x, &mut s);
            let err = (phi - exact).abs() / exact;
            errs.push(err);
        }
        // The truncation error falls like rho^(p+1) (rho ~ 0.1 here), up to cancellations
        // in single orders: compare every second order.
        for k in 2..errs.len() {
            assert!(errs[k] < 0.3 * errs[k - 2], "errors by order {errs:?}");
        }
        assert!(errs[5] < 1e-4 * errs[0], "errors by order {errs:?}");
        assert!(errs[5] < 1e-7, "errors by order {errs:?}");
        // M2P at the same point, potential and force against direct sums.
        let t = Tables::new(6);
        let mut mp = vec![0.0; t.nterms];
        let mut s = vec![0.0; t.nterms];
        let mut d = vec![0.0; t.nterms];
        t.p2m(&src, &m, zb, &mut mp, &mut s);
        let (phi, g) = t.m2p(&mp, zb, x, eps2, &mut d, &mut s);
        assert!((phi - exact).abs() < 1e-8 * exact);
        let mut ge = [0.0; 3];
        for (sp, &mm) in src.iter().zip(&m) {
            let r = [x[0] - sp[0], x[1] - sp[1], x[2] - sp[2]];
            let q = psi(r, eps2).powi(3);
            for c in 0..3 {
                ge[c] -= mm * r[c] * q;
            }
        }
        for c in 0..3 {
            assert!(
                (g[c] - ge[c]).abs() < 1e-7 * ge[c].abs().max(1e-3),
                "{g:?} {ge:?}"
            );
        }
    }
}
