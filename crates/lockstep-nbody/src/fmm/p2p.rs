//! The near field of the FMM: direct particle-particle (P2P) sums of each target leaf over
//! its P2P list, with the sources gathered into one contiguous, padded buffer per leaf so
//! that the inner loop runs over full SIMD vectors without remainders or branches.
//!
//! The kernel is the Plummer-softened field of [`crate::direct`] (`acc += m d / (r^2 +
//! eps^2)^{3/2}`, `pot -= m / sqrt(r^2 + eps^2)`), in one of two arithmetics
//! ([`super::NearField`]):
//!
//! - f32 (the default, [`GatheredSources32`]): coordinates relative to the target leaf's
//!   centre and masses, both scaled by powers of two, rounded once to f32; 8 sources per
//!   256-bit vector; `1 / sqrt` from the integer estimate and three Newton steps; partial
//!   sums added into f64 every 128 sources. About 1.6 times faster than f64 on the
//!   development machine (AMD EPYC Zen 1, AVX2), with a relative error per pair of about
//!   `1e-7 L / r`.
//! - f64 ([`GatheredSources`]): `1 / sqrt` from the integer estimate refined by four Newton
//!   steps, within a few units in the last place of `1.0 / x.sqrt()`.
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
/// [`Gathered::extend`] (the target leaf's own particles first, when it is among the
/// sources) and [`Gathered::finish`], then evaluated at each target particle.
pub(crate) trait Gathered: Default + Send {
    /// Stored mass of an entry (to exclude a particle from its own field and restore it).
    type Mass: Copy + Default;
    /// Empties the buffer; coordinates may be stored relative to `center` (kpc).
    fn begin(&mut self, center: [f64; 3]);
    /// Appends the sorted sources `soa[range]`.
    fn extend(&mut self, soa: &SoA, range: Range<usize>);
    /// Pads (and converts) the appended sources for the kernel.
    fn finish(&mut self);
    /// Stored mass of entry `i`.
    fn mass(&self, i: usize) -> Self::Mass;
    /// Sets the stored mass of entry `i` (zero excludes it).
    fn set_mass(&mut self, i: usize, m: Self::Mass);
    /// The field at `t` (kpc) of all gathered sources: `(sum m d / r^3, sum m / r)` with
    /// `d = x_source - t`, `r^2 = |d|^2 + eps2` (G = 1).
    fn field_at(&self, t: [f64; 3], eps2: f64) -> ([f64; 3], f64);
}

impl Gathered for GatheredSources {
    type Mass = f64;
    fn begin(&mut self, _center: [f64; 3]) {
        self.clear();
    }
    fn extend(&mut self, soa: &SoA, range: Range<usize>) {
        GatheredSources::extend(self, soa, range);
    }
    fn finish(&mut self) {
        self.pad();
    }
    fn mass(&self, i: usize) -> f64 {
        self.m[i]
    }
    fn set_mass(&mut self, i: usize, m: f64) {
        self.m[i] = m;
    }
    fn field_at(&self, t: [f64; 3], eps2: f64) -> ([f64; 3], f64) {
        field_at(t, self, eps2)
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

/// The field at `t` of all gathered sources: returns `(sum m d / r^3, sum m / r)` with
/// `d = x_source - t`, `r^2 = |d|^2 + eps2` (G = 1). Dispatches to an AVX2+FMA build of the
/// same arithmetic when the CPU has it.
#[inline]
pub(crate) fn field_at(t: [f64; 3], s: &GatheredSources, eps2: f64) -> ([f64; 3], f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { field_at_avx2(t, s, eps2) };
        }
    }
    field_at_body(t, s, eps2)
}

/// [`field_at_body`] compiled for AVX2 with FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn field_at_avx2(t: [f64; 3], s: &GatheredSources, eps2: f64) -> ([f64; 3], f64) {
    field_at_body(t, s, eps2)
}

#[inline(always)]
fn field_at_body(t: [f64; 3], s: &GatheredSources, eps2: f64) -> ([f64; 3], f64) {
    let mut ax = [0.0f64; LANES];
    let mut ay = [0.0f64; LANES];
    let mut az = [0.0f64; LANES];
    let mut ph = [0.0f64; LANES];
    let blocks =
        s.x.chunks_exact(LANES)
            .zip(s.y.chunks_exact(LANES))
            .zip(s.z.chunks_exact(LANES).zip(s.m.chunks_exact(LANES)));
    for ((x, y), (z, m)) in blocks {
        for l in 0..LANES {
            let dx = x[l] - t[0];
            let dy = y[l] - t[1];
            let dz = z[l] - t[2];
            let r2 = dx.mul_add(dx, dy.mul_add(dy, dz.mul_add(dz, eps2)));
            let inv = rsqrt(r2);
            let mi = m[l] * inv;
            let mi3 = mi * inv * inv;
            ax[l] = dx.mul_add(mi3, ax[l]);
            ay[l] = dy.mul_add(mi3, ay[l]);
            az[l] = dz.mul_add(mi3, az[l]);
            ph[l] += mi;
        }
    }
    let sum = |a: [f64; LANES]| ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    ([sum(ax), sum(ay), sum(az)], sum(ph))
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
/// and scaled by powers of two: `x' = (x - c) / L`, `m' = m / M`, with `L >= max |x - c|`
/// and `M >= max m` powers of two (so the scaling itself is exact), padded with massless
/// entries at the centre to a multiple of [`LANES32`].
#[derive(Debug, Clone, Default)]
pub(crate) struct GatheredSources32 {
    stage: GatheredSources,
    x: Vec<f32>,
    y: Vec<f32>,
    z: Vec<f32>,
    m: Vec<f32>,
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
    type Mass = f32;

    fn begin(&mut self, center: [f64; 3]) {
        self.stage.clear();
        self.center = center;
    }

    fn extend(&mut self, soa: &SoA, range: Range<usize>) {
        self.stage.extend(soa, range);
    }

    /// Converts the appended sources to scaled f32 (one rounding each) and pads them.
    fn finish(&mut self) {
        let s = &self.stage;
        let c = self.center;
        let mut ext = 0f64;
        let mut mmax = 0f64;
        for i in 0..s.x.len() {
            ext = ext
                .max((s.x[i] - c[0]).abs())
                .max((s.y[i] - c[1]).abs())
                .max((s.z[i] - c[2]).abs());
            mmax = mmax.max(s.m[i]);
        }
        self.inv_len = 1.0 / pow2_at_least(ext);
        self.mass = pow2_at_least(mmax);
        let (il, im) = (self.inv_len, 1.0 / self.mass);
        let n = s.x.len().div_ceil(LANES32) * LANES32;
        for (dst, src, ci) in [
            (&mut self.x, &s.x, c[0]),
            (&mut self.y, &s.y, c[1]),
            (&mut self.z, &s.z, c[2]),
        ] {
            dst.clear();
            dst.extend(src.iter().map(|&v| ((v - ci) * il) as f32));
            dst.resize(n, 0.0);
        }
        self.m.clear();
        self.m.extend(s.m.iter().map(|&v| (v * im) as f32));
        self.m.resize(n, 0.0);
    }

    fn mass(&self, i: usize) -> f32 {
        self.m[i]
    }

    fn set_mass(&mut self, i: usize, m: f32) {
        self.m[i] = m;
    }

    /// Computed in f32 on the scaled coordinates, the f32 partial sums added into f64
    /// every [`FLUSH_BLOCKS`] blocks, the result scaled back in f64.
    #[inline]
    fn field_at(&self, t: [f64; 3], eps2: f64) -> ([f64; 3], f64) {
        let il = self.inv_len;
        let tt = [
            ((t[0] - self.center[0]) * il) as f32,
            ((t[1] - self.center[1]) * il) as f32,
            ((t[2] - self.center[2]) * il) as f32,
        ];
        let e2 = (eps2 * il * il) as f32;
        let (a, phi) = field_at32(tt, self, e2);
        let fa = self.mass * il * il;
        let fp = self.mass * il;
        ([a[0] * fa, a[1] * fa, a[2] * fa], phi * fp)
    }
}

/// `1 / sqrt(x)` in f32 for `x >= MIN_R2_SCALED` (smaller `x` count as that): the integer
/// estimate `0x5F375A86 - bits/2` (relative error below 3.5e-2; Lomont 2003) and three
/// Newton steps `y <- y (3/2 - x/2 y^2)` (errors 1.8e-3, 4.7e-6, then f32 rounding).
#[inline(always)]
pub(crate) fn rsqrt32(x: f32) -> f32 {
    let x = x.max(MIN_R2_SCALED);
    let mut y = f32::from_bits(0x5F37_5A86u32.wrapping_sub(x.to_bits() >> 1));
    let half = -0.5 * x;
    for _ in 0..3 {
        y *= half.mul_add(y * y, 1.5);
    }
    y
}

#[inline]
fn field_at32(t: [f32; 3], s: &GatheredSources32, eps2: f32) -> ([f64; 3], f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { field_at32_avx2(t, s, eps2) };
        }
    }
    field_at32_body(t, s, eps2)
}

/// [`field_at32_body`] compiled for AVX2 with FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn field_at32_avx2(t: [f32; 3], s: &GatheredSources32, eps2: f32) -> ([f64; 3], f64) {
    field_at32_body(t, s, eps2)
}

#[inline(always)]
fn field_at32_body(t: [f32; 3], s: &GatheredSources32, eps2: f32) -> ([f64; 3], f64) {
    let mut sx = [0.0f64; LANES32];
    let mut sy = [0.0f64; LANES32];
    let mut sz = [0.0f64; LANES32];
    let mut sp = [0.0f64; LANES32];
    let span = LANES32 * FLUSH_BLOCKS;
    let chunks =
        s.x.chunks(span)
            .zip(s.y.chunks(span))
            .zip(s.z.chunks(span).zip(s.m.chunks(span)));
    for ((cx, cy), (cz, cm)) in chunks {
        let mut ax = [0.0f32; LANES32];
        let mut ay = [0.0f32; LANES32];
        let mut az = [0.0f32; LANES32];
        let mut ph = [0.0f32; LANES32];
        let blocks = cx
            .chunks_exact(LANES32)
            .zip(cy.chunks_exact(LANES32))
            .zip(cz.chunks_exact(LANES32).zip(cm.chunks_exact(LANES32)));
        for ((x, y), (z, m)) in blocks {
            for l in 0..LANES32 {
                let dx = x[l] - t[0];
                let dy = y[l] - t[1];
                let dz = z[l] - t[2];
                let r2 = dx.mul_add(dx, dy.mul_add(dy, dz.mul_add(dz, eps2)));
                let inv = rsqrt32(r2);
                let mi = m[l] * inv;
                let mi3 = mi * inv * inv;
                ax[l] = dx.mul_add(mi3, ax[l]);
                ay[l] = dy.mul_add(mi3, ay[l]);
                az[l] = dz.mul_add(mi3, az[l]);
                ph[l] += mi;
            }
        }
        for l in 0..LANES32 {
            sx[l] += ax[l] as f64;
            sy[l] += ay[l] as f64;
            sz[l] += az[l] as f64;
            sp[l] += ph[l] as f64;
        }
    }
    let sum = |a: [f64; LANES32]| ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    ([sum(sx), sum(sy), sum(sz)], sum(sp))
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
        g.pad();
        assert_eq!(g.x.len(), LANES);
        // Target = source 0, excluded through its mass.
        g.set_mass(0, 0.0);
        let (a, phi) = field_at([0.0; 3], &g, 0.0);
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
        assert!(worst < 4e-7, "largest relative error {worst:e}");
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
            g32.begin(center);
            Gathered::begin(&mut g64, center);
            for r in [0..100, 100..n] {
                g32.extend(&soa, r.clone());
                Gathered::extend(&mut g64, &soa, r);
            }
            g32.finish();
            Gathered::finish(&mut g64);
            assert_eq!(g32.x.len() % LANES32, 0);
            for k in [0usize, 57, 202] {
                // Target = source k, excluded through its mass.
                let (m32, m64) = (g32.mass(k), Gathered::mass(&g64, k));
                g32.set_mass(k, 0.0);
                Gathered::set_mass(&mut g64, k, 0.0);
                let (a32, p32) = g32.field_at(pos[k], eps2);
                let (a64, p64) = Gathered::field_at(&g64, pos[k], eps2);
                g32.set_mass(k, m32);
                Gathered::set_mass(&mut g64, k, m64);
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
