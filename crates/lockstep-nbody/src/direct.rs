//! Direct summation of softened gravity (docs/nbody.md, "Forces"): the reference for the FMM.
//!
//! Potential of a source of mass `m` at distance `r`: `-G m / sqrt(r^2 + eps^2)` (Plummer
//! softening); a particle does not act on itself. Accumulation is in f64; the loops are
//! blocked over sources (cache) and over targets (rayon tasks).

use rayon::prelude::*;

/// Per-particle gravity: acceleration `[n][3]` in (km/s)^2/kpc and potential `[n]` in
/// (km/s)^2 (with G in kpc (km/s)^2 per mass unit).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Forces {
    /// Accelerations `[n][3]`.
    pub acc: Vec<[f64; 3]>,
    /// Potentials `[n]` (negative for attractive gravity).
    pub pot: Vec<f64>,
}

impl Forces {
    /// Zero forces for `n` particles.
    pub fn zeros(n: usize) -> Self {
        Forces {
            acc: vec![[0.0; 3]; n],
            pot: vec![0.0; n],
        }
    }
}

/// Sources in structure-of-arrays form (vectorisable inner loops).
#[derive(Debug, Clone, Default)]
pub(crate) struct SoA {
    pub x: Vec<f64>,
    pub y: Vec<f64>,
    pub z: Vec<f64>,
    pub m: Vec<f64>,
}

impl SoA {
    /// Position of source `i`.
    #[inline]
    pub fn point(&self, i: usize) -> [f64; 3] {
        [self.x[i], self.y[i], self.z[i]]
    }

    pub fn from(pos: &[[f64; 3]], mass: &[f64]) -> Self {
        SoA {
            x: pos.iter().map(|p| p[0]).collect(),
            y: pos.iter().map(|p| p[1]).collect(),
            z: pos.iter().map(|p| p[2]).collect(),
            m: mass.to_vec(),
        }
    }
}

/// Adds the (unscaled, G = 1) field of the sources `s[lo..hi]` at each target
/// `targets[k]` into `acc[k]`/`pot[k]`: `acc += sum m d / (r^2+eps^2)^{3/2}`,
/// `pot -= sum m / sqrt(r^2+eps^2)`. With `skip_base = Some(b)`, target `k` is source
/// `b + k` and does not act on itself. Dispatches once per block to an AVX-512 or AVX2
/// build of the same arithmetic when the CPU has it.
#[inline]
pub(crate) fn p2p_block(
    targets: &[[f64; 3]],
    skip_base: Option<usize>,
    s: &SoA,
    lo: usize,
    hi: usize,
    eps2: f64,
    acc: &mut [[f64; 3]],
    pot: &mut [f64],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { block_avx512(targets, skip_base, s, lo, hi, eps2, acc, pot) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { block_avx2(targets, skip_base, s, lo, hi, eps2, acc, pot) };
        }
    }
    block_body(targets, skip_base, s, lo, hi, eps2, acc, pot)
}

/// [`block_body`] compiled for AVX-512 (8 f64 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn block_avx512(
    targets: &[[f64; 3]],
    skip_base: Option<usize>,
    s: &SoA,
    lo: usize,
    hi: usize,
    eps2: f64,
    acc: &mut [[f64; 3]],
    pot: &mut [f64],
) {
    block_body(targets, skip_base, s, lo, hi, eps2, acc, pot)
}

/// [`block_body`] compiled for AVX2 (4 f64 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn block_avx2(
    targets: &[[f64; 3]],
    skip_base: Option<usize>,
    s: &SoA,
    lo: usize,
    hi: usize,
    eps2: f64,
    acc: &mut [[f64; 3]],
    pot: &mut [f64],
) {
    block_body(targets, skip_base, s, lo, hi, eps2, acc, pot)
}

#[inline(always)]
fn block_body(
    targets: &[[f64; 3]],
    skip_base: Option<usize>,
    s: &SoA,
    lo: usize,
    hi: usize,
    eps2: f64,
    acc: &mut [[f64; 3]],
    pot: &mut [f64],
) {
    for (k, (&t, (a, p))) in targets
        .iter()
        .zip(acc.iter_mut().zip(pot.iter_mut()))
        .enumerate()
    {
        match skip_base.map(|b| b + k) {
            Some(i) if i >= lo && i < hi => {
                p2p_body(t, s, lo, i, eps2, a, p);
                p2p_body(t, s, i + 1, hi, eps2, a, p);
            }
            _ => p2p_body(t, s, lo, hi, eps2, a, p),
        }
    }
}

/// The particle-particle kernel; the same arithmetic (no FMA contraction) on every
/// instruction set, so results do not depend on the CPU.
#[inline(always)]
fn p2p_body(
    t: [f64; 3],
    s: &SoA,
    lo: usize,
    hi: usize,
    eps2: f64,
    acc: &mut [f64; 3],
    pot: &mut f64,
) {
    let (xs, ys, zs, ms) = (&s.x[lo..hi], &s.y[lo..hi], &s.z[lo..hi], &s.m[lo..hi]);
    // Eight independent lanes so that the compiler can vectorise the sums (f64 addition is
    // not reassociated otherwise); the lanes are added in a fixed order.
    const L: usize = 8;
    let mut ax = [0.0f64; L];
    let mut ay = [0.0f64; L];
    let mut az = [0.0f64; L];
    let mut ph = [0.0f64; L];
    let n = xs.len();
    let nb = n / L * L;
    for b in (0..nb).step_by(L) {
        let (x, y, z, m) = (&xs[b..b + L], &ys[b..b + L], &zs[b..b + L], &ms[b..b + L]);
        for l in 0..L {
            let dx = x[l] - t[0];
            let dy = y[l] - t[1];
            let dz = z[l] - t[2];
            let r2 = dx * dx + dy * dy + dz * dz + eps2;
            let inv = 1.0 / r2.sqrt();
            let mi = m[l] * inv;
            let mi3 = mi * inv * inv;
            ax[l] += dx * mi3;
            ay[l] += dy * mi3;
            az[l] += dz * mi3;
            ph[l] += mi;
        }
    }
    for j in nb..n {
        let dx = xs[j] - t[0];
        let dy = ys[j] - t[1];
        let dz = zs[j] - t[2];
        let r2 = dx * dx + dy * dy + dz * dz + eps2;
        let inv = 1.0 / r2.sqrt();
        let mi = ms[j] * inv;
        let mi3 = mi * inv * inv;
        ax[0] += dx * mi3;
        ay[0] += dy * mi3;
        az[0] += dz * mi3;
        ph[0] += mi;
    }
    let sum = |a: [f64; L]| ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    let (ax, ay, az, ph) = (sum(ax), sum(ay), sum(az), sum(ph));
    acc[0] += ax;
    acc[1] += ay;
    acc[2] += az;
    *pot -= ph;
}

const TARGET_BLOCK: usize = 64;
const SOURCE_BLOCK: usize = 4096;

/// Direct-summation gravity of the particles `pos`/`mass` on themselves (self excluded).
///
/// `g`: G in code units; `softening`: Plummer length `eps` in kpc. O(N^2), parallel over
/// target blocks.
pub fn direct(pos: &[[f64; 3]], mass: &[f64], g: f64, softening: f64) -> Forces {
    direct_on(pos, Some(0), pos, mass, g, softening)
}

/// Direct-summation gravity at `targets` of the sources `src_pos`/`src_mass`.
///
/// If `self_offset` is `Some(o)`, target `i` is source `o + i` and is excluded (use this
/// when the targets are a slice of the sources); otherwise every source acts.
pub fn direct_on(
    targets: &[[f64; 3]],
    self_offset: Option<usize>,
    src_pos: &[[f64; 3]],
    src_mass: &[f64],
    g: f64,
    softening: f64,
) -> Forces {
    let s = SoA::from(src_pos, src_mass);
    let eps2 = softening * softening;
    let ns = src_pos.len().min(src_mass.len());
    let mut out = Forces::zeros(targets.len());
    out.acc
        .par_chunks_mut(TARGET_BLOCK)
        .zip(out.pot.par_chunks_mut(TARGET_BLOCK))
        .enumerate()
        .for_each(|(b, (acc, pot))| {
            // A stop asked for leaves the remaining blocks zero; the callers check it.
            if lockstep_core::interrupt::requested() {
                return;
            }
            let t0 = b * TARGET_BLOCK;
            let tg = &targets[t0..t0 + acc.len()];
            let skip = self_offset.map(|o| o + t0);
            for lo in (0..ns).step_by(SOURCE_BLOCK) {
                let hi = (lo + SOURCE_BLOCK).min(ns);
                p2p_block(tg, skip, &s, lo, hi, eps2, acc, pot);
            }
            for k in 0..acc.len() {
                for c in 0..3 {
                    acc[k][c] *= g;
                }
                pot[k] *= g;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_body_field_matches_formula() {
        let pos = [[0.0, 0.0, 0.0], [3.0, 4.0, 0.0]];
        let mass = [2.0, 5.0];
        let f = direct(&pos, &mass, 1.5, 0.0);
        // |a_0| = G m_1 / r^2 = 1.5 * 5 / 25 toward particle 1.
        let a0 = 1.5 * 5.0 / 25.0;
        assert!((f.acc[0][0] - a0 * 0.6).abs() < 1e-15);
        assert!((f.acc[0][1] - a0 * 0.8).abs() < 1e-15);
        assert!((f.pot[0] + 1.5 * 5.0 / 5.0).abs() < 1e-15);
        assert!((f.pot[1] + 1.5 * 2.0 / 5.0).abs() < 1e-15);
        // Newton's third law.
        for c in 0..3 {
            assert!((mass[0] * f.acc[0][c] + mass[1] * f.acc[1][c]).abs() < 1e-15);
        }
        let soft = direct(&pos, &mass, 1.0, 1.0);
        assert!((soft.pot[0] + 5.0 / 26f64.sqrt()).abs() < 1e-15);
    }
}
