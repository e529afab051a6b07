//! The near field of the FMM: direct particle-particle (P2P) sums of each target leaf over
//! its P2P list, with the sources gathered into one contiguous, padded buffer per leaf so
//! that the inner loop runs over full SIMD vectors without remainders or branches.
//!
//! The kernel is the Plummer-softened field of [`crate::direct`] (`acc += m d / (r^2 +
//! eps^2)^{3/2}`, `pot -= m / sqrt(r^2 + eps^2)`); `1 / sqrt` comes from the classic
//! integer estimate refined by four Newton steps with fused multiply-adds, which is
//! within a few units in the last place of `1.0 / x.sqrt()` and several times cheaper than
//! a square root and a division. The arithmetic is the same on every instruction set
//! (explicit `mul_add`, IEEE fused), so results do not depend on the CPU.

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

    /// Mass of entry `i`.
    pub fn mass(&self, i: usize) -> f64 {
        self.m[i]
    }

    /// Sets the mass of entry `i` (0 excludes it: a particle does not act on itself).
    pub fn set_mass(&mut self, i: usize, m: f64) {
        self.m[i] = m;
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
}
