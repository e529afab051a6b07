//! The near field of the FMM: direct particle-particle (P2P) sums of each target leaf over
//! its P2P list, with the sources gathered into one contiguous, padded buffer per leaf so
//! that the inner loop runs over full SIMD vectors without remainders or branches.
//!
//! The kernel is the Plummer-softened field of [`crate::direct`] (`acc += m d / (r^2 +
//! eps^2)^{3/2}`, `pot -= m / sqrt(r^2 + eps^2)`), in one of two arithmetics
//! ([`super::NearField`]):
//!
//! - f32 (the default, [`GatheredSources32`]): coordinates relative to the target leaf's
//!   centre and masses, both scaled by powers of two, converted to f32 as they are
//!   gathered; 8 sources per 256-bit vector and two targets per pass (two independent
//!   dependency chains for the CPU to overlap); `1 / sqrt` from a magic-constant estimate
//!   and two modified Newton steps (within 5e-7 of either sign); partial sums added into
//!   f64 every 128 sources. A pair's force errs by about `1e-6` relative plus `1e-7 L / r`
//!   from the rounding of the coordinates.
//! - f64 ([`GatheredSources`]): `1 / sqrt` from the integer estimate refined by four Newton
//!   steps, within a few units in the last place of `1.0 / x.sqrt()`; one target per pass.
//!
//! The buffer holds up to three segments: the target leaf's own particles (each target
//! skips its own entry), the sources that take the targets' reaction (a pair evaluated
//! once serves both particles, Newton's third law), and the other sources.
//!
//! Both use explicit `mul_add` (IEEE fused) and no approximate-reciprocal instructions, so
//! the results are the same on every CPU.

use std::ops::Range;

use crate::direct::SoA;

/// Sources per SIMD block of the kernel (the gathered buffers are padded to a multiple).
pub(crate) const LANES: usize = 8;

/// Sources of one target leaf in structure-of-arrays form, padded with massless entries
/// at the origin to a multiple of [`LANES`].
#[derive(Debug, Clone, Default)]
pub(crate) struct GatheredSources {
    x: Vec<f64>,
    y: Vec<f64>,
    z: Vec<f64>,
    m: Vec<f64>,
    /// Reaction sums `[x, y, z, potential]` per entry (see [`Gathered::reaction`]).
    react: [Vec<f64>; 4],
}

impl GatheredSources {
    /// Empties the buffer (keeps its capacity).
    pub fn clear(&mut self) {
        self.x.clear();
        self.y.clear();
        self.z.clear();
        self.m.clear();
    }

    /// Appends the sorted sources `soa[range]`.
    pub fn extend(&mut self, soa: &SoA, range: Range<usize>) {
        self.x.extend_from_slice(&soa.x[range.clone()]);
        self.y.extend_from_slice(&soa.y[range.clone()]);
        self.z.extend_from_slice(&soa.z[range.clone()]);
        self.m.extend_from_slice(&soa.m[range]);
    }

    /// Pads to a multiple of [`LANES`] with massless sources at the origin: they add
    /// exactly zero because [`rsqrt`] is finite for every finite argument, 0 included.
    pub fn pad(&mut self) {
        let n = self.x.len().div_ceil(LANES) * LANES;
        self.x.resize(n, 0.0);
        self.y.resize(n, 0.0);
        self.z.resize(n, 0.0);
        self.m.resize(n, 0.0);
    }
}

/// A gathered-sources buffer of one target leaf: filled by [`Gathered::begin`],
/// [`Gathered::extend`] and [`Gathered::pad`] in segments (the target leaf's own
/// particles first, when it is among the sources; then the sources that take the
/// targets' reaction; then the others) and [`Gathered::finish`], then evaluated at each
/// target particle.
pub(crate) trait Gathered: Default + Send {
    /// Empties the buffer; coordinates may be stored relative to `center` (kpc). `extent`
    /// (kpc) bounds `|x - center|` per coordinate over the sources to come and
    /// `mass_scale` bounds their masses (both only set the f32 scaling; a source beyond
    /// them costs precision, not correctness).
    fn begin(&mut self, center: [f64; 3], extent: f64, mass_scale: f64);
    /// Appends the sorted sources `soa[range]`.
    fn extend(&mut self, soa: &SoA, range: Range<usize>);
    /// Pads with massless entries at the centre to a multiple of the kernel's SIMD width,
    /// so that the next entry starts a segment.
    fn pad(&mut self);
    /// Entries so far, padding included.
    fn len(&self) -> usize;
    /// Pads the last segment and zeroes the reaction sums: ready for [`Gathered::field_at`].
    fn finish(&mut self);
    /// The fields at one or two targets `t` (kpc) of masses `mt` from all gathered
    /// sources: per target `(sum m d / r^3, sum m / r)` with `d = x_source - t`,
    /// `r^2 = |d|^2 + eps2` (G = 1). With `own = Some(k0)`, target `j` is entry `k0 + j`
    /// of the first segment `0..mutual.start` and does not act on itself. For the entries
    /// in `mutual` (a segment: its ends are multiples of the SIMD width), also adds the
    /// targets' fields at the source to the entry's reaction sums (Newton's third law: one
    /// evaluation of the pair serves both particles).
    fn field_at(
        &mut self,
        t: &[[f64; 3]],
        mt: &[f64],
        own: Option<usize>,
        eps2: f64,
        mutual: Range<usize>,
    ) -> [([f64; 3], f64); 2];
    /// The reaction on entry `i` summed over the targets evaluated since
    /// [`Gathered::finish`]: `(sum m_t (x_t - x_i) / r^3, sum m_t / r)` (G = 1; the second
    /// is subtracted from the potential).
    fn reaction(&self, i: usize) -> ([f64; 3], f64);
}

impl Gathered for GatheredSources {
    fn begin(&mut self, _center: [f64; 3], _extent: f64, _mass_scale: f64) {
        self.clear();
    }
    fn extend(&mut self, soa: &SoA, range: Range<usize>) {
        GatheredSources::extend(self, soa, range);
    }
    fn pad(&mut self) {
        GatheredSources::pad(self);
    }
    fn len(&self) -> usize {
        self.x.len()
    }
    fn finish(&mut self) {
        self.pad();
        let n = self.x.len();
        for r in &mut self.react {
            r.clear();
            r.resize(n, 0.0);
        }
    }
    fn field_at(
        &mut self,
        t: &[[f64; 3]],
        mt: &[f64],
        own: Option<usize>,
        eps2: f64,
        mutual: Range<usize>,
    ) -> [([f64; 3], f64); 2] {
        let mut out = [([0.0; 3], 0.0); 2];
        for (j, (&tj, &mj)) in t.iter().zip(mt).enumerate() {
            let saved = own.map(|k0| (k0 + j, self.m[k0 + j]));
            if let Some((e, _)) = saved {
                self.m[e] = 0.0;
            }
            out[j] = field_at(tj, mj, self, eps2, mutual.clone());
            if let Some((e, m)) = saved {
                self.m[e] = m;
            }
        }
        out
    }
    fn reaction(&self, i: usize) -> ([f64; 3], f64) {
        let r = &self.react;
        ([-r[0][i], -r[1][i], -r[2][i]], r[3][i])
    }
}

/// `1 / sqrt(x)` for finite `x >= f64::MIN_POSITIVE` (smaller `x`, 0 included, count as
/// `f64::MIN_POSITIVE`, so the result is finite, about 6.7e153, and `y * y` does not
/// overflow): the integer estimate `0x5FE6EB50C7B537A9 - bits/2` (relative error below
/// 3.5e-2; Lomont 2003) and four Newton steps `y <- y (3/2 - x/2 y^2)` (errors 1.8e-3,
/// 4.8e-6, 3.5e-11, then rounding).
#[inline(always)]
pub(crate) fn rsqrt(x: f64) -> f64 {
    let x = x.max(f64::MIN_POSITIVE);
    let mut y = f64::from_bits(0x5FE6_EB50_C7B5_37A9u64.wrapping_sub(x.to_bits() >> 1));
    let half = -0.5 * x;
    for _ in 0..4 {
        y *= half.mul_add(y * y, 1.5);
    }
    y
}

/// The field at `t` of all gathered sources, and the reaction of a target of mass `mt` on
/// the entries in `mutual` ([`Gathered::field_at`]). Dispatches to an AVX2+FMA build of
/// the same arithmetic when the CPU has it.
#[inline]
pub(crate) fn field_at(
    t: [f64; 3],
    mt: f64,
    s: &mut GatheredSources,
    eps2: f64,
    mutual: Range<usize>,
) -> ([f64; 3], f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { field_at_avx2(t, mt, s, eps2, mutual) };
        }
    }
    field_at_body(t, mt, s, eps2, mutual)
}

/// [`field_at_body`] compiled for AVX2 with FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn field_at_avx2(
    t: [f64; 3],
    mt: f64,
    s: &mut GatheredSources,
    eps2: f64,
    mutual: Range<usize>,
) -> ([f64; 3], f64) {
    field_at_body(t, mt, s, eps2, mutual)
}

#[inline(always)]
fn field_at_body(
    t: [f64; 3],
    mt: f64,
    s: &mut GatheredSources,
    eps2: f64,
    mutual: Range<usize>,
) -> ([f64; 3], f64) {
    let mut acc = [[0.0f64; LANES]; 4];
    let n = s.x.len();
    let sources = [&s.x[..], &s.y, &s.z, &s.m];
    let (src, react) = segment(sources, &mut s.react, 0..mutual.start);
    sum64::<false>(t, mt, eps2, src, react, &mut acc);
    let (src, react) = segment(sources, &mut s.react, mutual.end..n);
    sum64::<false>(t, mt, eps2, src, react, &mut acc);
    let (src, react) = segment(sources, &mut s.react, mutual);
    sum64::<true>(t, mt, eps2, src, react, &mut acc);
    let [x, y, z, phi] = acc.map(lane_sum);
    ([x, y, z], phi)
}

/// The sources `[x, y, z, m]` and the reaction sums of the entries `r` of a buffer.
#[inline(always)]
fn segment<'a, T>(
    [x, y, z, m]: [&'a [T]; 4],
    [rx, ry, rz, rp]: &'a mut [Vec<T>; 4],
    r: Range<usize>,
) -> ([&'a [T]; 4], [&'a mut [T]; 4]) {
    (
        [&x[r.clone()], &y[r.clone()], &z[r.clone()], &m[r.clone()]],
        [
            &mut rx[r.clone()],
            &mut ry[r.clone()],
            &mut rz[r.clone()],
            &mut rp[r],
        ],
    )
}

/// The sum of the 8 lanes in a fixed order (pairwise).
#[inline(always)]
fn lane_sum(a: [f64; 8]) -> f64 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

/// Adds the field at `t` of the sources `[x, y, z, m]` (a multiple of [`LANES`] entries)
/// into the lane sums `acc` (`[x, y, z, potential]`); with `REACT`, also the field of the
/// target (mass `mt`) at each source to the source's reaction sums `react` (`[x, y, z,
/// potential]`, the acceleration with the opposite sign; untouched without `REACT`).
#[inline(always)]
fn sum64<const REACT: bool>(
    t: [f64; 3],
    mt: f64,
    eps2: f64,
    [xs, ys, zs, ms]: [&[f64]; 4],
    [rx, ry, rz, rp]: [&mut [f64]; 4],
    acc: &mut [[f64; LANES]; 4],
) {
    let blocks = xs
        .chunks_exact(LANES)
        .zip(ys.chunks_exact(LANES))
        .zip(zs.chunks_exact(LANES).zip(ms.chunks_exact(LANES)));
    let react = rx
        .chunks_exact_mut(LANES)
        .zip(ry.chunks_exact_mut(LANES))
        .zip(rz.chunks_exact_mut(LANES).zip(rp.chunks_exact_mut(LANES)));
    for (((x, y), (z, m)), ((qx, qy), (qz, qp))) in blocks.zip(react) {
        // Local copies of the reaction sums (the vectorizer leaves slices scalar).
        let mut q = [[0.0f64; LANES]; 4];
        if REACT {
            for (dst, src) in q.iter_mut().zip([&*qx, &*qy, &*qz, &*qp]) {
                dst.copy_from_slice(src);
            }
        }
        for l in 0..LANES {
            let dx = x[l] - t[0];
            let dy = y[l] - t[1];
            let dz = z[l] - t[2];
            let r2 = dx.mul_add(dx, dy.mul_add(dy, dz.mul_add(dz, eps2)));
            let inv = rsqrt(r2);
            let inv2 = inv * inv;
            let mi = m[l] * inv;
            let mi3 = mi * inv2;
            acc[0][l] = dx.mul_add(mi3, acc[0][l]);
            acc[1][l] = dy.mul_add(mi3, acc[1][l]);
            acc[2][l] = dz.mul_add(mi3, acc[2][l]);
            acc[3][l] += mi;
            if REACT {
                let ti = mt * inv;
                let ti3 = ti * inv2;
                q[0][l] = dx.mul_add(ti3, q[0][l]);
                q[1][l] = dy.mul_add(ti3, q[1][l]);
                q[2][l] = dz.mul_add(ti3, q[2][l]);
                q[3][l] += ti;
            }
        }
        if REACT {
            for (dst, src) in [qx, qy, qz, qp].into_iter().zip(&q) {
                dst.copy_from_slice(src);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The single-precision near field (`forces.near_field: "f32"`, the default).

/// Sources per f32 SIMD block (one 256-bit register of f32).
pub(crate) const LANES32: usize = 8;
/// Blocks summed in f32 before the partial sums are added into f64 accumulators.
const FLUSH_BLOCKS: usize = 16;
/// Smallest scaled `r^2` the f32 kernel uses (pairs closer than `1e-10` of the buffer's
/// length scale count as that far apart), so `m / r^3` stays finite in f32.
const MIN_R2_SCALED: f32 = 1e-20;

/// Sources of one target leaf in f32 structure-of-arrays form, relative to a centre `c`
/// and scaled by powers of two: `x' = (x - c) / L`, `m' = m / M`, with `L >= extent` and
/// `M >= mass_scale` powers of two (so the scaling itself is exact), converted as they are
/// appended (one rounding each) and padded with massless entries at the centre to a
/// multiple of [`LANES32`].
#[derive(Debug, Clone, Default)]
pub(crate) struct GatheredSources32 {
    x: Vec<f32>,
    y: Vec<f32>,
    z: Vec<f32>,
    m: Vec<f32>,
    /// Reaction sums `[x, y, z, potential]` per entry, scaled like the field.
    react: [Vec<f32>; 4],
    center: [f64; 3],
    /// `1 / L`.
    inv_len: f64,
    /// `M`.
    mass: f64,
}

/// Smallest power of two `>= v`, at least `f64::MIN_POSITIVE` (1 for `v <= 0` or
/// non-finite `v`).
fn pow2_at_least(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    // The floor keeps a subnormal `v` (whose power of two underflows to 0) from looping.
    let mut p = 2f64.powi(v.log2().ceil() as i32).max(f64::MIN_POSITIVE);
    while p < v {
        p *= 2.0;
    }
    p
}

impl Gathered for GatheredSources32 {
    fn begin(&mut self, center: [f64; 3], extent: f64, mass_scale: f64) {
        self.center = center;
        self.inv_len = 1.0 / pow2_at_least(extent);
        self.mass = pow2_at_least(mass_scale);
        self.x.clear();
        self.y.clear();
        self.z.clear();
        self.m.clear();
    }

    /// Appends `soa[range]` converted to scaled f32 (one rounding each).
    fn extend(&mut self, soa: &SoA, range: Range<usize>) {
        let (c, il, im) = (self.center, self.inv_len, 1.0 / self.mass);
        for (dst, src, ci) in [
            (&mut self.x, &soa.x[range.clone()], c[0]),
            (&mut self.y, &soa.y[range.clone()], c[1]),
            (&mut self.z, &soa.z[range.clone()], c[2]),
        ] {
            dst.extend(src.iter().map(|&v| ((v - ci) * il) as f32));
        }
        self.m.extend(soa.m[range].iter().map(|&v| (v * im) as f32));
    }

    /// Pads to a multiple of [`LANES32`] with massless sources at the centre.
    fn pad(&mut self) {
        let n = self.x.len().div_ceil(LANES32) * LANES32;
        self.x.resize(n, 0.0);
        self.y.resize(n, 0.0);
        self.z.resize(n, 0.0);
        self.m.resize(n, 0.0);
    }

    fn len(&self) -> usize {
        self.x.len()
    }

    fn finish(&mut self) {
        self.pad();
        let n = self.x.len();
        for r in &mut self.react {
            r.clear();
            r.resize(n, 0.0);
        }
    }

    /// Computed in f32 on the scaled coordinates, two targets per pass over the sources
    /// (a single target is paired with a massless copy of itself), the f32 partial sums
    /// added into f64 every [`FLUSH_BLOCKS`] blocks, the result scaled back in f64. The
    /// reaction sums stay in f32 (one term per target of the leaf).
    #[inline]
    fn field_at(
        &mut self,
        t: &[[f64; 3]],
        mt: &[f64],
        own: Option<usize>,
        eps2: f64,
        mutual: Range<usize>,
    ) -> [([f64; 3], f64); 2] {
        let (il, c) = (self.inv_len, self.center);
        let scaled = |p: [f64; 3]| {
            [
                ((p[0] - c[0]) * il) as f32,
                ((p[1] - c[1]) * il) as f32,
                ((p[2] - c[2]) * il) as f32,
            ]
        };
        let two = t.len() == 2;
        let tt = [scaled(t[0]), scaled(t[t.len() - 1])];
        let mts = [
            (mt[0] / self.mass) as f32,
            if two { (mt[1] / self.mass) as f32 } else { 0.0 },
        ];
        let e2 = (eps2 * il * il) as f32;
        let [a, b] = fields32(tt, mts, own.map(|k0| (k0, two)), self, e2, mutual);
        let fa = self.mass * il * il;
        let fp = self.mass * il;
        let out = |v: [f64; 4]| ([v[0] * fa, v[1] * fa, v[2] * fa], v[3] * fp);
        [out(a), out(b)]
    }

    fn reaction(&self, i: usize) -> ([f64; 3], f64) {
        let (il, r) = (self.inv_len, &self.react);
        let fa = -self.mass * il * il;
        let fp = self.mass * il;
        (
            [
                r[0][i] as f64 * fa,
                r[1][i] as f64 * fa,
                r[2][i] as f64 * fa,
            ],
            r[3][i] as f64 * fp,
        )
    }
}

/// `1 / sqrt(x)` in f32 for `x >= MIN_R2_SCALED` (smaller `x` count as that), relative
/// error below 5e-7 of either sign: the integer estimate `0x5F1FFFF9 - bits/2` with one
/// modified Newton step `y <- y (k1 - k2 x y^2)`, `k2 = 0.703952253`, `k1 = 2.38924456 k2`
/// (relative error below 6.5e-4; Moroz et al. 2018, "Fast calculation of inverse square
/// root with the use of magic constant - analytical approach", Appl. Math. Comput. 316),
/// then one Newton step scaled by about `1 + 3e-7` so that its error (at most `-1.5 e^2`,
/// always low) is centred on zero.
#[inline(always)]
pub(crate) fn rsqrt32(x: f32) -> f32 {
    let x = x.max(MIN_R2_SCALED);
    let y = f32::from_bits(0x5F1F_FFF9u32.wrapping_sub(x.to_bits() >> 1));
    let y = y * (-0.703_952_25f32 * x).mul_add(y * y, 1.681_914_1);
    y * (-0.500_000_2f32 * x).mul_add(y * y, 1.500_000_5)
}

/// Two targets' fields ([`Gathered::field_at`] in scaled f32 units): `[x, y, z,
/// potential]` per target. `own = Some((k0, two))`: the targets are entries `k0` (and
/// `k0 + 1` when `two`) of the first segment. Dispatches to an AVX2+FMA build of the same
/// arithmetic when the CPU has it.
#[inline]
fn fields32(
    t: [[f32; 3]; 2],
    mt: [f32; 2],
    own: Option<(usize, bool)>,
    s: &mut GatheredSources32,
    eps2: f32,
    mutual: Range<usize>,
) -> [[f64; 4]; 2] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { fields32_avx2(t, mt, own, s, eps2, mutual) };
        }
    }
    fields32_body(t, mt, own, s, eps2, mutual)
}

/// [`fields32_body`] compiled for AVX2 with FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fields32_avx2(
    t: [[f32; 3]; 2],
    mt: [f32; 2],
    own: Option<(usize, bool)>,
    s: &mut GatheredSources32,
    eps2: f32,
    mutual: Range<usize>,
) -> [[f64; 4]; 2] {
    fields32_body(t, mt, own, s, eps2, mutual)
}

/// One pair's contribution in scaled f32: `(d m / r^3, m / r)` for the source at `x` of
/// mass `m` seen from `t`; the same arithmetic as every lane of the kernels.
#[inline(always)]
fn pair32(t: [f32; 3], x: [f32; 3], m: f32, eps2: f32) -> [f32; 4] {
    let dx = x[0] - t[0];
    let dy = x[1] - t[1];
    let dz = x[2] - t[2];
    let r2 = dx.mul_add(dx, dy.mul_add(dy, dz.mul_add(dz, eps2)));
    let inv = rsqrt32(r2);
    let inv2 = inv * inv;
    let mi = m * inv;
    let mi3 = mi * inv2;
    [dx * mi3, dy * mi3, dz * mi3, mi]
}

#[inline(always)]
fn fields32_body(
    t: [[f32; 3]; 2],
    mt: [f32; 2],
    own: Option<(usize, bool)>,
    s: &mut GatheredSources32,
    eps2: f32,
    mutual: Range<usize>,
) -> [[f64; 4]; 2] {
    let mut acc = [[[0.0f64; LANES32]; 4]; 2];
    let n = s.x.len();
    // The first segment with the targets' own entries massless; each target then gets the
    // other target's field, which the massless entry left out.
    let own_entries = own.map(|(k0, two)| {
        let e = [k0, if two { k0 + 1 } else { k0 }];
        let m = [s.m[e[0]], s.m[e[1]]];
        s.m[e[0]] = 0.0;
        s.m[e[1]] = 0.0;
        (e, m, two)
    });
    let [acc0, acc1] = &mut acc;
    let sources = [&s.x[..], &s.y, &s.z, &s.m];
    let (src, react) = segment(sources, &mut s.react, 0..mutual.start);
    sum32::<false>(t, mt, eps2, src, react, acc0, acc1);
    let (src, react) = segment(sources, &mut s.react, mutual.end..n);
    sum32::<false>(t, mt, eps2, src, react, acc0, acc1);
    if let Some((e, m, two)) = own_entries {
        s.m[e[0]] = m[0];
        s.m[e[1]] = m[1];
        if two {
            let at = |k: usize| [s.x[k], s.y[k], s.z[k]];
            let f0 = pair32(t[0], at(e[1]), m[1], eps2);
            let f1 = pair32(t[1], at(e[0]), m[0], eps2);
            for c in 0..4 {
                acc0[c][0] += f0[c] as f64;
                acc1[c][0] += f1[c] as f64;
            }
        }
    }
    let (src, react) = segment([&s.x, &s.y, &s.z, &s.m], &mut s.react, mutual);
    sum32::<true>(t, mt, eps2, src, react, acc0, acc1);
    let total = |a: &[[f64; LANES32]; 4]| a.map(lane_sum);
    [total(acc0), total(acc1)]
}

/// Adds the fields at the two targets `t` of the scaled f32 sources `[x, y, z, m]` (a
/// multiple of [`LANES32`] entries) into their f64 lane sums `acc0`, `acc1` (`[x, y, z,
/// potential]`), through f32 partial sums flushed every [`FLUSH_BLOCKS`] blocks. The two
/// targets' independent dependency chains interleave in one pass over the sources. With
/// `REACT`, also the fields of the two targets (scaled masses `mt`) at each source to the
/// source's f32 reaction sums `react` (`[x, y, z, potential]`, the acceleration with the
/// opposite sign; untouched without `REACT`).
#[inline(always)]
fn sum32<const REACT: bool>(
    t: [[f32; 3]; 2],
    mt: [f32; 2],
    eps2: f32,
    [xs, ys, zs, ms]: [&[f32]; 4],
    [rx, ry, rz, rp]: [&mut [f32]; 4],
    acc0: &mut [[f64; LANES32]; 4],
    acc1: &mut [[f64; LANES32]; 4],
) {
    let span = LANES32 * FLUSH_BLOCKS;
    let [t0, t1] = t;
    let chunks = xs
        .chunks(span)
        .zip(ys.chunks(span))
        .zip(zs.chunks(span).zip(ms.chunks(span)));
    let react_chunks = rx
        .chunks_mut(span)
        .zip(ry.chunks_mut(span))
        .zip(rz.chunks_mut(span).zip(rp.chunks_mut(span)));
    for (((cx, cy), (cz, cm)), ((kx, ky), (kz, kp))) in chunks.zip(react_chunks) {
        let mut p0 = [[0.0f32; LANES32]; 4];
        let mut p1 = [[0.0f32; LANES32]; 4];
        let blocks = cx
            .chunks_exact(LANES32)
            .zip(cy.chunks_exact(LANES32))
            .zip(cz.chunks_exact(LANES32).zip(cm.chunks_exact(LANES32)));
        let react = kx
            .chunks_exact_mut(LANES32)
            .zip(ky.chunks_exact_mut(LANES32))
            .zip(
                kz.chunks_exact_mut(LANES32)
                    .zip(kp.chunks_exact_mut(LANES32)),
            );
        for (((x, y), (z, m)), ((qx, qy), (qz, qp))) in blocks.zip(react) {
            // Local copies of the reaction sums (the vectorizer leaves slices scalar).
            let mut q = [[0.0f32; LANES32]; 4];
            if REACT {
                for (dst, src) in q.iter_mut().zip([&*qx, &*qy, &*qz, &*qp]) {
                    dst.copy_from_slice(src);
                }
            }
            for l in 0..LANES32 {
                let dx = x[l] - t0[0];
                let dy = y[l] - t0[1];
                let dz = z[l] - t0[2];
                let ex = x[l] - t1[0];
                let ey = y[l] - t1[1];
                let ez = z[l] - t1[2];
                let r2 = dx.mul_add(dx, dy.mul_add(dy, dz.mul_add(dz, eps2)));
                let s2 = ex.mul_add(ex, ey.mul_add(ey, ez.mul_add(ez, eps2)));
                let inv = rsqrt32(r2);
                let jnv = rsqrt32(s2);
                let inv2 = inv * inv;
                let jnv2 = jnv * jnv;
                let mi = m[l] * inv;
                let mj = m[l] * jnv;
                let mi3 = mi * inv2;
                let mj3 = mj * jnv2;
                p0[0][l] = dx.mul_add(mi3, p0[0][l]);
                p0[1][l] = dy.mul_add(mi3, p0[1][l]);
                p0[2][l] = dz.mul_add(mi3, p0[2][l]);
                p0[3][l] += mi;
                p1[0][l] = ex.mul_add(mj3, p1[0][l]);
                p1[1][l] = ey.mul_add(mj3, p1[1][l]);
                p1[2][l] = ez.mul_add(mj3, p1[2][l]);
                p1[3][l] += mj;
                if REACT {
                    let ti = mt[0] * inv;
                    let tj = mt[1] * jnv;
                    let ti3 = ti * inv2;
                    let tj3 = tj * jnv2;
                    q[0][l] = ex.mul_add(tj3, dx.mul_add(ti3, q[0][l]));
                    q[1][l] = ey.mul_add(tj3, dy.mul_add(ti3, q[1][l]));
                    q[2][l] = ez.mul_add(tj3, dz.mul_add(ti3, q[2][l]));
                    q[3][l] += ti + tj;
                }
            }
            if REACT {
                for (dst, src) in [qx, qy, qz, qp].into_iter().zip(&q) {
                    dst.copy_from_slice(src);
                }
            }
        }
        for c in 0..4 {
            for l in 0..LANES32 {
                acc0[c][l] += p0[c][l] as f64;
                acc1[c][l] += p1[c][l] as f64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rsqrt_is_within_a_few_ulp_over_the_range() {
        let mut worst: f64 = 0.0;
        let mut x = 1e-300;
        while x < 1e300 {
            for f in [1.0, 1.37, 2.0, 3.1, 5.9] {
                let v = x * f;
                let e = (rsqrt(v) * v.sqrt() - 1.0).abs();
                worst = worst.max(e);
            }
            x *= 7.3;
        }
        assert!(worst < 1e-15, "largest relative error {worst:e}");
        assert!(rsqrt(0.0).is_finite() && (rsqrt(0.0) * rsqrt(0.0)).is_finite());
    }

    #[test]
    fn gathered_field_matches_the_two_body_formula_and_ignores_padding() {
        let soa = SoA::from(
            &[[0.0, 0.0, 0.0], [3.0, 4.0, 0.0], [1.0, 1.0, 1.0]],
            &[2.0, 5.0, 7.0],
        );
        let mut g = GatheredSources::default();
        g.extend(&soa, 0..3);
        Gathered::finish(&mut g);
        assert_eq!(g.x.len(), LANES);
        // Target = source 0, excluded through its mass.
        g.m[0] = 0.0;
        let (a, phi) = field_at([0.0; 3], 0.0, &mut g, 0.0, 0..0);
        let r3 = 3f64.sqrt().powi(3);
        let expect = [
            5.0 * 3.0 / 125.0 + 7.0 / r3,
            5.0 * 4.0 / 125.0 + 7.0 / r3,
            7.0 / r3,
        ];
        for c in 0..3 {
            assert!(
                (a[c] - expect[c]).abs() < 1e-14 * expect[c],
                "{a:?} {expect:?}"
            );
        }
        assert!((phi - (5.0 / 5.0 + 7.0 / 3f64.sqrt())).abs() < 1e-14);
    }

    #[test]
    fn pow2_at_least_is_the_next_power_of_two() {
        assert_eq!(pow2_at_least(3.0), 4.0);
        assert_eq!(pow2_at_least(4.0), 4.0);
        assert_eq!(pow2_at_least(0.3), 0.5);
        assert_eq!(pow2_at_least(0.0), 1.0);
        assert_eq!(pow2_at_least(f64::NAN), 1.0);
        assert_eq!(pow2_at_least(1e-320), f64::MIN_POSITIVE);
        assert_eq!(pow2_at_least(1e300), 2f64.powi(997));
    }

    #[test]
    fn rsqrt32_is_within_f32_rounding_over_the_range() {
        let mut worst: f64 = 0.0;
        let mut x = 1e-20f64;
        while x < 1e30 {
            for f in [1.0, 1.37, 2.0, 3.1, 5.9] {
                let v = (x * f) as f32;
                let e = (rsqrt32(v) as f64 * (v as f64).sqrt() - 1.0).abs();
                worst = worst.max(e);
            }
            x *= 3.3;
        }
        // Every f32 in [1, 4): all mantissas at both exponent parities (the estimate
        // scales exactly by powers of 4 elsewhere).
        for bits in 1f32.to_bits()..4f32.to_bits() {
            let v = f32::from_bits(bits);
            let e = (rsqrt32(v) as f64 * (v as f64).sqrt() - 1.0).abs();
            worst = worst.max(e);
        }
        assert!(worst < 5e-7, "largest relative error {worst:e}");
        // Below the floor the kernel counts r^2 as MIN_R2_SCALED: finite, and m / r^3 too.
        let y = rsqrt32(0.0);
        assert!(y.is_finite() && (y * y * y).is_finite());
    }

    /// Sources around a centre far from the origin, with masses far from 1: the f32 field
    /// (centred, power-of-two scaled) matches the f64 field to f32 rounding.
    #[test]
    fn f32_field_matches_f64_field_for_any_offset_and_mass_scale() {
        let mut rng = crate::rng::Rng::new(7);
        for (offset, mscale, eps2) in [(0.0, 1.0, 0.0), (1e3, 1e10, 1e-6), (-5e4, 1e-12, 0.0)] {
            let n = 203;
            let pos: Vec<[f64; 3]> = (0..n)
                .map(|_| {
                    let u = rng.unit_vector();
                    let r = 0.5 * rng.uniform();
                    [
                        offset + r * u[0],
                        offset * 0.5 + r * u[1],
                        r * u[2] - offset,
                    ]
                })
                .collect();
            let mass: Vec<f64> = (0..n).map(|_| mscale * (0.5 + rng.uniform())).collect();
            let soa = SoA::from(&pos, &mass);
            let center = [offset + 0.01, offset * 0.5, -offset];
            let mut g32 = GatheredSources32::default();
            let mut g64 = GatheredSources::default();
            let extent = pos
                .iter()
                .flat_map(|p| (0..3).map(move |k| (p[k] - center[k]).abs()))
                .fold(0.0, f64::max);
            let mass_scale = mass.iter().copied().fold(0.0, f64::max);
            g32.begin(center, extent, mass_scale);
            Gathered::begin(&mut g64, center, extent, mass_scale);
            for r in [0..100, 100..n] {
                g32.extend(&soa, r.clone());
                Gathered::extend(&mut g64, &soa, r);
            }
            Gathered::finish(&mut g32);
            Gathered::finish(&mut g64);
            assert_eq!(g32.x.len() % LANES32, 0);
            // Targets = sources k (and k + 1), each excluded from its own field; one
            // segment holds every source.
            let all32 = g32.len()..g32.len();
            let all64 = g64.len()..g64.len();
            for (k, two) in [(0usize, true), (57, false), (201, true), (202, false)] {
                let ks = if two { k..k + 2 } else { k..k + 1 };
                let t = &pos[ks.clone()];
                let mt = &mass[ks.clone()];
                let f32s = g32.field_at(t, mt, Some(k), eps2, all32.clone());
                let f64s = Gathered::field_at(&mut g64, t, mt, Some(k), eps2, all64.clone());
                for j in 0..ks.len() {
                    let ((a32, p32), (a64, p64)) = (f32s[j], f64s[j]);
                    let norm = (a64[0] * a64[0] + a64[1] * a64[1] + a64[2] * a64[2]).sqrt();
                    let err = ((a32[0] - a64[0]).powi(2)
                        + (a32[1] - a64[1]).powi(2)
                        + (a32[2] - a64[2]).powi(2))
                    .sqrt();
                    assert!(err < 1e-5 * norm, "offset {offset}: acc {a32:?} vs {a64:?}");
                    assert!(
                        (p32 - p64).abs() < 1e-6 * p64,
                        "offset {offset}: {p32} vs {p64}"
                    );
                }
            }
        }
    }

    /// After the targets' passes, each source of the mutual segment holds the targets'
    /// field at it (Newton's third law), in both arithmetics, for an odd number of targets.
    #[test]
    fn reactions_are_the_targets_fields_at_the_sources() {
        let mut rng = crate::rng::Rng::new(3);
        let mut point = |c: f64| {
            let u = rng.unit_vector();
            let r = 0.3 * rng.uniform();
            [c + r * u[0], r * u[1], r * u[2]]
        };
        let targets: Vec<[f64; 3]> = (0..5).map(|_| point(0.0)).collect();
        let tmass = [1.0, 2.0, 0.5, 3.0, 1.5];
        let sources: Vec<[f64; 3]> = (0..19).map(|_| point(0.8)).collect();
        let smass: Vec<f64> = (0..19).map(|i| 1.0 + i as f64 * 0.1).collect();
        let soa = SoA::from(&sources, &smass);
        let eps2 = 1e-4;
        fn run<B: Gathered>(
            b: &mut B,
            soa: &SoA,
            t: &[[f64; 3]],
            mt: &[f64],
            eps2: f64,
        ) -> (Range<usize>, Vec<([f64; 3], f64)>) {
            b.begin([0.4, 0.0, 0.0], 1.2, 4.0);
            b.pad();
            let start = b.len();
            b.extend(soa, 0..19);
            b.pad();
            let mutual = start..b.len();
            b.finish();
            for k in (0..t.len()).step_by(2) {
                let ks = k..(k + 2).min(t.len());
                b.field_at(&t[ks.clone()], &mt[ks], None, eps2, mutual.clone());
            }
            let r = (0..19).map(|j| b.reaction(mutual.start + j)).collect();
            (mutual, r)
        }
        let (_, r32) = run(
            &mut GatheredSources32::default(),
            &soa,
            &targets,
            &tmass,
            eps2,
        );
        let (_, r64) = run(
            &mut GatheredSources::default(),
            &soa,
            &targets,
            &tmass,
            eps2,
        );
        for (j, s) in sources.iter().enumerate() {
            let (mut a, mut phi) = ([0.0f64; 3], 0.0);
            for (t, m) in targets.iter().zip(tmass) {
                let d = [t[0] - s[0], t[1] - s[1], t[2] - s[2]];
                let r = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2] + eps2).sqrt();
                for c in 0..3 {
                    a[c] += m * d[c] / (r * r * r);
                }
                phi += m / r;
            }
            let norm = (a[0] * a[0] + a[1] * a[1] + a[2] * a[2]).sqrt();
            for (r, tol) in [(r32[j], 1e-5), (r64[j], 1e-13)] {
                for c in 0..3 {
                    assert!(
                        (r.0[c] - a[c]).abs() < tol * norm,
                        "source {j}: {r:?} vs {a:?}"
                    );
                }
                assert!(
                    (r.1 - phi).abs() < tol * phi,
                    "source {j}: {} vs {phi}",
                    r.1
                );
            }
        }
    }
}
