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
}

impl BatchWork {
    fn resize(&mut self, n: usize) {
        if self.mono.len() < n {
            self.mono.resize(n, [0.0; LANES]);
            self.d.resize(n, [0.0; LANES]);
            self.ms.resize(n, [0.0; LANES]);
        }
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
    /// Index of `n+m` for `|n|+|m| <= p`, grouped by `n`: `m` runs over the prefix
    /// `0..nterms(p-|n|)` of the coefficients (see `m2l_rows`).
    m2l: Vec<u16>,
    /// `m2l[m2l_rows[n]..m2l_rows[n+1]]` are the entries of `L_n`.
    m2l_rows: Vec<usize>,
    /// `1 / n_axis` for the monomial recursion (`axis` from `parent`).
    inv_step: Vec<f64>,
    /// `(n, k, n-k)` for `k <= n` componentwise (M2M and L2L).
    shift: Vec<(u16, u16, u16)>,
    /// `(coefficient, index of n-2k, derivative order |n|-|k|)` grouped by `n`.
    deriv: Vec<(f64, u16, u16)>,
    /// `deriv[deriv_rows[n]..deriv_rows[n+1]]` are the terms of `D_n`.
    deriv_rows: Vec<usize>,
    /// For `|n| <= p-1`: index of `n + e_x`, `n + e_y`, `n + e_z`.
    grad: Vec<[usize; 3]>,
    /// Number of coefficients of degree `<= p-1`.
    pub nterms_lower: usize,
    /// `(-1)^{|n|}`.
    sign: Vec<f64>,
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
        let mut m2l = Vec::new();
        let mut m2l_rows = vec![0];
        for (i, n) in multi.iter().enumerate() {
            for (j, m) in multi.iter().enumerate() {
                if degree[i] + degree[j] <= p {
                    let nm = idx([n[0] + m[0], n[1] + m[1], n[2] + m[2]]).unwrap_or(0);
                    m2l.push(nm as u16);
                }
            }
            m2l_rows.push(m2l.len());
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
        let nterms_lower = if p == 0 { 0 } else { nterms(p - 1) };
        let mut grad = Vec::with_capacity(nterms_lower);
        for n in multi.iter().take(nterms_lower) {
            grad.push([
                idx([n[0] + 1, n[1], n[2]]).unwrap_or(0),
                idx([n[0], n[1] + 1, n[2]]).unwrap_or(0),
                idx([n[0], n[1], n[2] + 1]).unwrap_or(0),
            ]);
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
        Tables {
            inv_step,
            sign,
            p,
            nterms: nt,
            multi,
            degree,
            parent,
            m2l,
            m2l_rows,
            shift,
            deriv,
            deriv_rows,
            grad,
            nterms_lower,
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
        for (n, l) in local[..self.nterms].iter_mut().enumerate() {
            let row = &self.m2l[self.m2l_rows[n]..self.m2l_rows[n + 1]];
            let acc: f64 = scratch[..row.len()]
                .iter()
                .zip(row)
                .map(|(s, &nm)| s * deriv[nm as usize])
                .sum();
            *l += acc;
        }
    }

    /// Adds to `local` (about `za`) the M2L translations of up to [`LANES`] source
    /// multipoles `mps[k]` about `zbs[k]` at once: the same arithmetic as [`Tables::m2l`]
    /// with the sources in SIMD lanes (results equal up to the order of the final sums).
    pub fn m2l_batch(
        &self,
        mps: &[&[f64]],
        zbs: &[[f64; 3]],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { self.m2l_batch_avx512(mps, zbs, za, eps2, local, work) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.m2l_batch_avx2(mps, zbs, za, eps2, local, work) };
            }
        }
        self.m2l_batch_body::<false>(mps, zbs, za, eps2, local, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn m2l_batch_avx512(
        &self,
        mps: &[&[f64]],
        zbs: &[[f64; 3]],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        self.m2l_batch_body::<false>(mps, zbs, za, eps2, local, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn m2l_batch_avx2(
        &self,
        mps: &[&[f64]],
        zbs: &[[f64; 3]],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        self.m2l_batch_body::<true>(mps, zbs, za, eps2, local, work)
    }

    #[inline(always)]
    fn m2l_batch_body<const AVX2: bool>(
        &self,
        mps: &[&[f64]],
        zbs: &[[f64; 3]],
        za: [f64; 3],
        eps2: f64,
        local: &mut [f64],
        work: &mut BatchWork,
    ) {
        let nt = self.nterms;
        let k = mps.len().min(LANES).min(zbs.len());
        work.resize(nt);
        // Lane geometry; unused lanes get a unit separation and zero multipoles.
        let mut r = [[1.0f64; LANES], [0.0; LANES], [0.0; LANES]];
        for l in 0..k {
            for c in 0..3 {
                r[c][l] = za[c] - zbs[l][c];
            }
        }
        self.lane_derivatives::<AVX2>(&r, eps2, work);
        let d = &work.d;
        let ms = &mut work.ms;
        for i in 0..nt {
            let mut v = [0.0f64; LANES];
            for l in 0..k {
                v[l] = self.sign[i] * mps[l][i];
            }
            ms[i] = v;
        }
        for n in 0..nt {
            let row = &self.m2l[self.m2l_rows[n]..self.m2l_rows[n + 1]];
            let mut acc = [0.0f64; LANES];
            for (a, &nm) in ms.iter().zip(row) {
                lanes_fma::<AVX2>(a, &d[nm as usize], &mut acc);
            }
            local[n] +=
                ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        }
    }

    /// [`Tables::m2p`] at up to [`LANES`] points `xs` at once (points in SIMD lanes):
    /// returns `(Phi, grad Phi)` per point.
    pub fn m2p_batch(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { self.m2p_batch_avx512(mp, zb, xs, eps2, work) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.m2p_batch_avx2(mp, zb, xs, eps2, work) };
            }
        }
        self.m2p_batch_body::<false>(mp, zb, xs, eps2, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn m2p_batch_avx512(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        self.m2p_batch_body::<false>(mp, zb, xs, eps2, work)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn m2p_batch_avx2(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        self.m2p_batch_body::<true>(mp, zb, xs, eps2, work)
    }

    #[inline(always)]
    fn m2p_batch_body<const AVX2: bool>(
        &self,
        mp: &[f64],
        zb: [f64; 3],
        xs: &[[f64; 3]],
        eps2: f64,
        work: &mut BatchWork,
    ) -> ([f64; LANES], [[f64; LANES]; 3]) {
        let nt = self.nterms;
        let k = xs.len().min(LANES);
        work.resize(nt);
        let mut r = [[1.0f64; LANES], [0.0; LANES], [0.0; LANES]];
        for l in 0..k {
            for c in 0..3 {
                r[c][l] = xs[l][c] - zb[c];
            }
        }
        self.lane_derivatives::<AVX2>(&r, eps2, work);
        let d = &work.d;
        let mut phi = [0.0f64; LANES];
        for i in 0..nt {
            let sm = [self.sign[i] * mp[i]; LANES];
            lanes_fma::<AVX2>(&sm, &d[i], &mut phi);
        }
        let mut g = [[0.0f64; LANES]; 3];
        for i in 0..self.nterms_lower {
            let sm = [self.sign[i] * mp[i]; LANES];
            let gi = self.grad[i];
            for c in 0..3 {
                lanes_fma::<AVX2>(&sm, &d[gi[c]], &mut g[c]);
            }
        }
        (phi, g)
    }

    /// Derivative tensors `work.d[n][lane] = D_n(r[.][lane])` for all lanes.
    #[inline(always)]
    fn lane_derivatives<const AVX2: bool>(
        &self,
        r: &[[f64; LANES]; 3],
        eps2: f64,
        work: &mut BatchWork,
    ) {
        let nt = self.nterms;
        let mono = &mut work.mono;
        mono[0] = [1.0; LANES];
        for i in 1..nt {
            let (q, axis) = self.parent[i];
            let f = self.inv_step[i];
            let prev = mono[q];
            let mut v = [0.0; LANES];
            for l in 0..LANES {
                v[l] = prev[l] * r[axis][l] * f;
            }
            mono[i] = v;
        }
        let mut h = [[0.0f64; LANES]; 16];
        for l in 0..LANES {
            let q = 1.0 / (r[0][l] * r[0][l] + r[1][l] * r[1][l] + r[2][l] * r[2][l] + eps2);
            h[0][l] = q.sqrt();
            for j in 1..=self.p {
                h[j][l] = -((2 * j - 1) as f64) * q * h[j - 1][l];
            }
        }
        let d = &mut work.d;
        for n in 0..nt {
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
        for i in 0..self.nterms_lower {
            let sm = self.sign[i] * mp[i];
            let gi = self.grad[i];
            g[0] += deriv[gi[0]] * sm;
            g[1] += deriv[gi[1]] * sm;
            g[2] += deriv[gi[2]] * sm;
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
        for i in 0..self.nterms_lower {
            let s = scratch[i];
            let gi = self.grad[i];
            g[0] += local[gi[0]] * s;
            g[1] += local[gi[1]] * s;
            g[2] += local[gi[2]] * s;
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

    #[test]
    fn batched_m2l_equals_single_m2l() {
        let t = Tables::new(6);
        let nt = t.nterms;
        let mut w = BatchWork::default();
        let (mut d, mut s) = (vec![0.0; nt], vec![0.0; nt]);
        let mps: Vec<Vec<f64>> = (0..5)
            .map(|k| {
                (0..nt)
                    .map(|i| ((i * 7 + k * 3) % 11) as f64 / 11.0 - 0.4)
                    .collect()
            })
            .collect();
        let zbs: Vec<[f64; 3]> = (0..5)
            .map(|k| [k as f64 * 0.3, -1.0, 0.5 * k as f64])
            .collect();
        let za = [4.0, 2.0, -3.0];
        let mut single = vec![0.0; nt];
        for k in 0..5 {
            t.m2l(&mps[k], zbs[k], za, 0.01, &mut single, &mut d, &mut s);
        }
        let mut batch = vec![0.0; nt];
        let refs: Vec<&[f64]> = mps.iter().map(|v| &v[..]).collect();
        t.m2l_batch(&refs, &zbs, za, 0.01, &mut batch, &mut w);
        for i in 0..nt {
            assert!(
                (single[i] - batch[i]).abs() <= 1e-12 * single[i].abs().max(1e-300),
                "{i}: {} {}",
                single[i],
                batch[i]
            );
        }
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
        let (phi, g) = t.m2p_batch(&mp, [0.1, 0.2, -0.1], &xs, 0.0, &mut w);
        for (l, &x) in xs.iter().enumerate() {
            let (p1, g1) = t.m2p(&mp, [0.1, 0.2, -0.1], x, 0.0, &mut d, &mut s);
            assert!((phi[l] - p1).abs() <= 1e-13 * p1.abs());
            for c in 0..3 {
                assert!((g[c][l] - g1[c]).abs() <= 1e-13 * g1[c].abs().max(1e-12));
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
